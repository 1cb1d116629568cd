"""When each collective and p2p call was issued and how long the caller was blocked in it, for the
timeline, read from the flight recorder's records: one recorder wraps torch.distributed, and the
timeline, the stall analysis and the straggler compute time all read what it wrote.

``timeline_comm()`` gives the timeline a ``FlightComm`` over the flight recorder installed in this
process (``megascale.probes.flight.recorder``; training runs install one before the trainer is
built), or, where none is (tests, ``benchmarks/timers.py``, a process without a run directory),
over a recorder of the timeline's own installed now, whose ring lives in anonymous memory (same
records, same completion watcher, no file; ``benchmarks/timers.py`` measures its cost per call).
The timeline copies each step's records from the ring at the step boundary and decodes them on
the writer thread; nothing more runs per call than the recorder's wrapper.

A source's contract: ``count()`` is the index the next record will get (it only grows; spans note
it on entry and exit), ``take()`` hands over the records since the last ``take`` as a chunk whose
``records()`` the writer thread calls, ``uninstall()`` stops it. A record is ``(index, kind,
coalesced, issued_ns, wait_start_ns, wait_end_ns)`` on the ``time.monotonic_ns`` clock (the flight
recorder's):

* a synchronous call: blocked from issue until it returned;
* an asynchronous one (``isend``/``irecv``, ``async_op=True``, the ops of a batch, an asynchronous
  coalescing block): its first ``wait()`` gives the blocked interval; None if never waited on;
* a megatron-core coalescing block (one DP bucket): one record, ``coalesced`` true, ``kind`` that
  of the ops inside it; a block without ops has no record;
* an op whose start and completion where it runs were seen (the NCCL-like CPU mode's
  communication threads; on CUDA, timing events recorded on the stream before and after it; not
  the blocking gloo mode, where the host call is the op, nor torch ``Work`` handles, whose start
  is not observable) carries two more fields, ``device_start_ns`` and ``device_done_ns``
  (start <= done);
* ``kind`` is the operation's name as the flight recorder's ``OpKind`` spells it in lower case:
  ``_all_gather_base`` is ``all_gather_into_tensor``, ``_reduce_scatter_base`` is
  ``reduce_scatter_tensor``; each op of a ``batch_isend_irecv`` is an ``isend`` or ``irecv``.
"""

from __future__ import annotations

import torch.distributed as dist

from megascale.probes.flight.format import ASYNC, COALESCED, DeviceState, OpKind
from megascale.probes.flight.recorder import FlightRecorder, RingCopy, installed_recorder

_FLIGHT_KINDS = {int(kind): kind.name.lower() for kind in OpKind}
_COMPLETED = int(DeviceState.COMPLETED)


def timeline_comm() -> FlightComm:
    """The timeline's communication records: from the flight recorder installed in this process
    (read with ``installed_recorder``), else from an in-memory recorder installed now and closed
    by the source's ``uninstall``."""
    recorder = installed_recorder()
    if recorder is not None:
        return FlightComm(recorder)
    initialized = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    return FlightComm(FlightRecorder(None, rank, world).install(), owned=True)


class FlightComm:
    """The records of an installed flight recorder from now on. Costs nothing per call; ``take``
    copies the step's slice of the ring (one memory copy). A step that issued more ops than the
    ring holds keeps its newest ``capacity``; the recorder must stay open until the last
    ``take``. ``owned``: the recorder is this source's (``uninstall`` closes it)."""

    def __init__(self, recorder: FlightRecorder, *, owned: bool = False) -> None:
        self.recorder, self.owned = recorder, owned
        self._taken = recorder.written

    def count(self) -> int:
        return self.recorder.written

    def take(self) -> _FlightChunk:
        end = self.recorder.written
        chunk = _FlightChunk(self.recorder.copy(self._taken, end))
        self._taken = end
        return chunk

    def uninstall(self) -> None:
        """Close the recorder if it is this source's; a shared one is left as it is."""
        if self.owned:
            self.recorder.close()


class _FlightChunk:
    """A step's flight records, decoded into timeline records on the writer thread."""

    __slots__ = ("_copy",)

    def __init__(self, copy: RingCopy) -> None:
        self._copy = copy

    def __len__(self) -> int:
        return len(self._copy)

    def records(self) -> list[tuple]:
        out = []
        for expected, (fields, wait) in enumerate(self._copy.records(), self._copy.first):
            index, enter, leave, kind, flags = (
                fields[0],
                fields[5],
                fields[7],
                fields[9],
                fields[11],
            )
            device, start, done = fields[13], fields[14], fields[15]
            if index != expected:
                continue  # a slot overwritten before it was copied
            issued = round(enter * 1e9)
            wait_start = wait_end = None
            if leave:  # left (or failed): the caller's wait is over
                wait_end = round(leave * 1e9)
                waited = flags & ASYNC and wait >= enter  # else returned at once: synchronous
                wait_start = round(wait * 1e9) if waited else issued
            kind_name = _FLIGHT_KINDS.get(kind, "unknown")
            record = (index, kind_name, bool(flags & COALESCED), issued, wait_start, wait_end)
            if device == _COMPLETED and start and done >= start:  # ran where it was seen to
                record += (round(start * 1e9), round(done * 1e9))
            out.append(record)
        return out
