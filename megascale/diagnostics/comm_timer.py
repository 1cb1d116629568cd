"""When each collective and p2p call was issued and how long the caller was blocked in it, for the
timeline, at the lowest cost the hot path allows.

``CommTimer.install()`` stands a thin wrapper in front of torch.distributed's collective and p2p
functions, ``batch_isend_irecv`` and megatron-core's aliases and coalescing manager, through
``megascale.parallel.comm_hooks`` (the patching that the comm trace and the flight recorder share;
the three stack in any order). Each call appends one record
``[kind, coalesced, issued_ns, wait_start_ns, wait_end_ns]`` (``time.perf_counter_ns``):

* a synchronous call: blocked from issue until it returned;
* an asynchronous one (``isend``/``irecv``, ``async_op=True``, a batch, an asynchronous coalescing
  block): the first ``wait()`` on its handle gives the blocked interval; none if never waited on;
* a call issued inside a coalescing block or a batch: ``coalesced`` true and no timing, the block's
  own record (kind ``"coalesced"`` or ``"batch_isend_irecv"``) carries it.

About 2 us per call on CPU, against ~10 us for ``megascale.overlap.trace.CommTrace``, which also
models link latency for benchmarks (``benchmarks/timers.py`` measures both unit costs).
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from megascale.parallel.comm_hooks import COLLECTIVES, P2P_ASYNC, CommWrapper, Patches, Reentry


class _State(Reentry):
    """Per thread: inside a wrapped call (``inside``), inside a coalescing block or batch
    (``depth``)."""

    depth = 0


class _Timed(CommWrapper):
    """The stand-in for one torch.distributed function."""

    def __init__(self, name: str, original, timer: CommTimer) -> None:
        super().__init__(name, original)
        self.timer = timer
        self.is_p2p_async = name in P2P_ASYNC

    def __call__(self, *args, **kwargs):
        timer = self.timer
        state = timer.state
        if state.inside or not timer.installed:  # re-entered through torch, or retired
            return self.original(*args, **kwargs)
        issued = time.perf_counter_ns()
        if state.depth:
            timer.events.append([self.name, True, issued, None, None])
        state.inside = True
        try:
            result = self.original(*args, **kwargs)
        finally:
            state.inside = False
        if state.depth:
            return result
        if self.is_p2p_async or kwargs.get("async_op"):
            record = [self.name, False, issued, None, None]
            timer.events.append(record)
            return result if result is None else _TimedWork(result, record)
        timer.events.append([self.name, False, issued, issued, time.perf_counter_ns()])
        return result


class _TimedWork:
    """An asynchronous call's handle: its first ``wait()`` is the blocked interval."""

    __slots__ = ("_work", "_record")

    def __init__(self, work, record: list) -> None:
        self._work, self._record = work, record

    def wait(self, *args, **kwargs):
        start = time.perf_counter_ns()
        result = self._work.wait(*args, **kwargs)
        record = self._record
        if record is not None and record[3] is None:
            record[3], record[4] = start, time.perf_counter_ns()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class _CoalescedHandle(_TimedWork):
    """What megatron-core keeps from ``with _coalescing_manager(...) as cm`` (``cm.wait()``,
    ``cm.append``, ``cm.works``)."""

    __slots__ = ()

    def append(self, work) -> None:
        self._work.append(work)

    @property
    def works(self):
        return self._work.works


class CommTimer:
    """Records this process's communication calls into ``events`` while installed.

    Contract: ``install`` once megatron-core is imported; ``take`` returns and clears the records
    (once per step); ``uninstall`` restores torch.distributed (calls through a wrapper that another
    patcher still holds then pass straight through).
    """

    def __init__(self) -> None:
        self.events: list[list] = []
        self.state = _State()
        self.installed = False
        self._patches = Patches()

    def install(self) -> CommTimer:
        self.installed = True
        self._patches.install(
            {name: _Timed(name, getattr(dist, name), self) for name in COLLECTIVES},
            in_c10d=P2P_ASYNC,  # P2POp's identity check reads the c10d module's names
            batch=self._batch,
            coalescing=self._coalescing,
        )
        return self

    def uninstall(self) -> None:
        self.installed = False
        self._patches.restore()

    def take(self) -> list[list]:
        """The records since the last ``take``, oldest first."""
        events, self.events = self.events, []
        return events

    def _batch(self, original):
        def batch_isend_irecv(p2p_op_list):
            if not self.installed:
                return original(p2p_op_list)
            record = ["batch_isend_irecv", False, time.perf_counter_ns(), None, None]
            self.events.append(record)
            self.state.depth += 1
            try:
                works = original(p2p_op_list)
            finally:
                self.state.depth -= 1
            return [_TimedWork(w, record) for w in works]

        return batch_isend_irecv

    def _coalescing(self, original):
        timer = self

        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            if not timer.installed:
                with original(group, device, async_ops) as cm:
                    yield cm
                return
            state = timer.state
            state.depth += 1
            try:
                with original(group, device, async_ops) as cm:
                    handle = _CoalescedHandle(cm, None)
                    yield handle
                    issued = time.perf_counter_ns()  # the block's ops are issued on leaving it
            finally:
                state.depth -= 1
            if async_ops:
                handle._record = ["coalesced", False, issued, None, None]
                timer.events.append(handle._record)
            else:  # the original manager waited on leaving the block
                timer.events.append(["coalesced", False, issued, issued, time.perf_counter_ns()])

        return coalescing_manager
