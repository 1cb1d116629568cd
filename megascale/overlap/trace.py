"""Make communication cost what a network would on any backend: each collective and p2p call is
delayed by its modelled cost, so that communication is costly relative to compute even on CPU;
what each call did is read back from the flight recorder's records.

``CommTrace.install()`` wraps ``torch.distributed``'s collective and p2p functions (and the aliases
megatron-core binds at import time) in this process with the network model, and installs an
in-memory flight recorder (``megascale.probes.flight.recorder``, ``path=None``) outside it, so
the recorder's times — issue, when the caller started and stopped waiting — include the modelled
cost. The cost of a call is ``CostModel.delay(op, bytes, group size, link)``
(``megascale.overlap.cost``): a fixed latency per call, or alpha + bytes / beta of a named fabric.
With a non-zero cost, calls run on communication threads, one per process group (a FIFO, like a
GPU's communication stream):

* the thread waits out the call's cost after the previous call of that group ended, then runs the
  real call: an asynchronous call returns at once and its handle's ``wait()`` blocks until the
  thread is done, so compute done in between hides the cost; a synchronous call waits at once;
* a send carries the cost of its message (it reaches the peer only after it); a receive is posted
  at once and costs nothing of its own — it completes when the delayed send arrives, so the
  receiver waits exactly as long as the link and the sender's lateness make it.

The network model keeps, per record index, what only it knows (link class, bytes, cost, p2p peer,
start of the modelled transfer, the ops of a coalescing block, the batch of a p2p op) and the
intervals each link was busy; ``reset()`` joins them with the step's records into ``CommEvent``s
and counts exposure (``megascale.overlap.trace_events``): ``exposed_s`` the time the caller spent
blocked (synchronous calls and ``wait()``), ``exposed_by_link`` the part of it that the link's
modelled transfers explain (the communication that computation did not hide), ``comm_by_link``
the modelled cost of the calls issued. Each event keeps what it was counted (``exposed_s``), its
p2p peer and the start of its modelled transfer, so a receive's wait can be re-counted from both
ends of its message once every rank's events are gathered (``megascale.overlap.pp_exposure``).
Ops issued together inside megatron-core's ``_coalescing_manager`` (one bucket's collectives) or a
``batch_isend_irecv`` count as one operation; they run in the caller's thread after their group's
queue drains (so every rank issues a group's calls in the same order), and their handle waits out
their summed cost. All times are ``time.monotonic`` (the recorder's clock; CLOCK_MONOTONIC on
Linux, as ``perf_counter``).

In the NCCL-like CPU mode (``parallel.async_collectives``, ``megascale.parallel.async_comm``)
pass its engine (``engine=``): the engine's own communication threads then wait out each call's
cost (``AsyncComm.set_cost``) instead of this module's, so an asynchronous op runs beside compute
there too; a synchronous call is waited for at once (the next kernel would wait for it).

This is a measurement tool for benchmarks and ordering tests; nothing in training depends on it.
Which names are patched and why (megatron-core's aliases, P2POp's identity checks, re-entry through
``handle_torch_function``) is ``megascale.parallel.comm_hooks``, shared with the flight recorder.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from megascale.overlap.cost import CostModel
from megascale.overlap.trace_events import CommEvent, Ledger, Mark, Priced, step_events
from megascale.parallel.async_comm import p2p_name
from megascale.parallel.comm_hooks import (
    COLLECTIVES,
    P2P_ASYNC,
    CommWrapper,
    Patches,
    comm_thread_flag,
)
from megascale.probes.comm_timer import FlightComm
from megascale.probes.flight.recorder import FlightRecorder

__all__ = ["CommEvent", "CommTrace", "Mark", "mark"]

_ACTIVE: CommTrace | None = None
_P2P = ("isend", "irecv", "send", "recv")
_RING = 1 << 16  # records a step may issue before the oldest of them are overwritten


def mark(name: str) -> None:
    """Record a named point in the installed trace, if any (a no-op otherwise: cheap on hot paths)."""
    if _ACTIVE is not None:
        _ACTIVE.mark(name)


def _group_of(args, kwargs):
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group


def _nbytes(args, kwargs) -> int:
    """Bytes of the call's full tensor: the larger of output and input (all-gather: the output,
    reduce-scatter: the input), or the sum of a tensor list."""
    sizes = [0]
    for value in (*args[:2], *kwargs.values()):
        if isinstance(value, torch.Tensor):
            sizes.append(value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            sizes.append(sum(t.numel() * t.element_size() for t in value))
    return max(sizes)


def _peer(kind: str, args, kwargs) -> int | None:
    """The global rank at the other end of a p2p call (``dst``/``src``, or the second argument)."""
    if kind not in _P2P:
        return None
    name = "dst" if kind in ("isend", "send") else "src"
    peer = kwargs.get(name, args[1] if len(args) > 1 else None)
    group_peer = kwargs.get(f"group_{name}")
    if peer is None and group_peer is not None:
        peer = dist.get_global_rank(kwargs["group"], group_peer)
    return peer if isinstance(peer, int) else None


class _Lane:
    """One process group's communication thread: calls run in issue order, each starting no
    earlier than the previous one's modelled end plus its own cost."""

    def __init__(self, on_busy: Callable[[float, float], None]) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megascale-comm")
        self.busy_until = 0.0
        self._on_busy = on_busy

    def reserve(self, cost_s: float) -> float:
        """The modelled end of a call of ``cost_s`` starting now or when the lane frees up."""
        start = max(self.busy_until, time.monotonic())
        self.busy_until = start + cost_s
        self._on_busy(start, self.busy_until)
        return self.busy_until

    def submit(self, call: Priced, fn: Callable) -> Future:
        def run():
            end = self.reserve(call.cost_s)
            call.transfer_start = end - call.cost_s
            remaining = end - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
            return fn()

        return self.executor.submit(run)

    def drain(self) -> None:
        self.executor.submit(lambda: None).result()


class _DelayedWork:
    """A work handle whose ``wait()`` also waits for the communication thread and for the modelled
    end of the call (``ready_at``). ``work`` is the real handle or a Future of it."""

    # What the flight recorder's watcher looks for: none of them, so it polls ``is_completed``
    # (read through ``__getattr__`` they would block on the communication thread).
    started = observe = get_future = None

    def __init__(self, work, ready_at: float) -> None:
        self._work, self._ready_at = work, ready_at

    def _real(self):
        return self._work.result() if isinstance(self._work, Future) else self._work

    def wait(self, *args, **kwargs):
        work = self._real()
        result = work.wait(*args, **kwargs) if work is not None else True
        remaining = self._ready_at - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return result

    def is_completed(self) -> bool:
        if isinstance(self._work, Future) and not self._work.done():
            return False
        work = self._real()
        done = work is None or work.is_completed()
        return done and time.monotonic() >= self._ready_at

    def __getattr__(self, name):
        return getattr(self._real(), name)


class _Wrapped(CommWrapper):
    """The network model's stand-in for one torch.distributed function."""

    def __init__(self, name: str, original, trace: CommTrace) -> None:
        super().__init__(name, original)
        self.trace = trace

    def __call__(self, *args, **kwargs):
        trace = self.trace
        if trace.reentered or not trace.installed or comm_thread_flag.active:
            # (or uninstalled while stacked under another; or on the NCCL-like mode's thread,
            # running a call the host issued and this trace priced already)
            # torch's handle_torch_function (a TorchFunctionMode is active on CPU) calls the
            # function again through the patched module name: already priced by the outer call.
            return self.original(*args, **kwargs)
        call = trace.price_call(self.name, args, kwargs)
        if trace.passthrough:  # inside a coalescing manager or batch: counted there
            with trace.entered():
                return self.original(*args, **kwargs)
        is_async = self.name in P2P_ASYNC or kwargs.get("async_op", False)
        if trace.engine is not None:
            return self._on_engine(args, kwargs, is_async)
        result = None
        if not trace.threaded or self.name in ("irecv", "recv"):
            with trace.entered():
                result = self.original(*args, **kwargs)
            handle = result if hasattr(result, "wait") else None  # blocking recv: a rank
            work = _DelayedWork(handle, call.issued + call.cost_s)
        else:
            work = _DelayedWork(trace.run_on_lane(self, args, kwargs, call), 0.0)
        if is_async:
            return work
        if self.name in ("send", "recv") or trace.threaded:
            work.wait()
        else:  # unthreaded, synchronous: the call is done; wait out its modelled cost
            remaining = call.issued + call.cost_s - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
        return result if self.name == "recv" else work._real()

    def _on_engine(self, args, kwargs, is_async: bool):
        """The NCCL-like mode: the engine queues the call (and waits out its cost on its thread);
        a synchronous call is waited for here."""
        trace = self.trace
        with trace.entered():
            result = self.original(*args, **kwargs)
        if is_async:
            return result
        op = result if hasattr(result, "wait") else trace.engine.last_op()
        if op is not None:
            op.wait()
        return result


class CommTrace:
    """Delays this process's communication by a network model and reads back what it did from
    an in-memory flight recorder. Install once per process, after megatron-core is imported;
    ``uninstall`` restores everything.

    ``latency_s``: the fixed-latency model (every call costs that much); ``cost``: any
    ``CostModel`` (overrides ``latency_s``). ``link_of(group) -> "tp" | "dp" | "pp" | "other"``
    classifies collectives by their process group (p2p calls are always "pp").
    ``exposed_s``, ``exposed_by_link`` and ``comm_by_link`` are those of the step the last
    ``reset()`` cleared (``last_by_link`` has both per link).
    """

    def __init__(
        self,
        latency_s: float = 0.0,
        *,
        cost: CostModel | None = None,
        link_of: Callable[[object], str] | None = None,
        engine=None,
    ) -> None:
        self.cost = cost if cost is not None else CostModel.fixed(latency_s)
        self.link_of = link_of or (lambda _group: "other")
        self.engine = engine
        """The NCCL-like mode's ``AsyncComm``, whose threads then apply the costs; or None."""
        costly = self.cost.fabric is not None or self.cost.fixed_latency_s > 0
        self.threaded = costly and engine is None
        self.ledger = Ledger()
        self.marks: list[Mark] = []
        self.recorder: FlightRecorder | None = None
        self._records: FlightComm | None = None
        self._local = threading.local()
        self._patches = Patches()
        self._lanes: dict[object, _Lane] = {}
        self._lock = threading.Lock()
        self.last_by_link: dict[str, tuple[float, float]] = {}
        self.exposed_s = 0.0
        self.exposed_by_link: dict[str, float] = {}
        self.comm_by_link: dict[str, float] = {}
        self.installed = False

    @property
    def latency_s(self) -> float:
        return self.cost.fixed_latency_s

    @property
    def passthrough(self) -> bool:
        return getattr(self._local, "inner", None) is not None

    @property
    def reentered(self) -> bool:
        return getattr(self._local, "entered", False)

    @contextlib.contextmanager
    def entered(self):
        self._local.entered = True
        try:
            yield
        finally:
            self._local.entered = False

    def mark(self, name: str) -> None:
        """Record a named point in time (e.g. "forward_start") next to the comm events."""
        self.marks.append(Mark(name, time.monotonic()))

    def reset(self) -> tuple[list[CommEvent], list[Mark], float]:
        """Return and clear (events, marks, exposed seconds) — e.g. once per training step: the
        events of the calls recorded since the last reset, read from the flight recorder's
        records (a wait that ends after this is not counted). ``last_by_link`` then holds the
        cleared step's (comm, exposed) seconds per link class."""
        for lane in list(self._lanes.values()):
            lane.drain()
        if self.engine is not None:
            self.engine.drain()
        records = self._records.take().records() if self._records is not None else []
        with self._lock:
            ledger, self.ledger = self.ledger, Ledger()
        marks, self.marks = self.marks, []
        step = step_events(records, ledger, self._message_cost)
        self.exposed_s = step.exposed_s
        self.exposed_by_link, self.comm_by_link = dict(step.exposed_by_link), ledger.comm_by_link
        self.last_by_link = {
            link: (ledger.comm_by_link.get(link, 0.0), step.exposed_by_link.get(link, 0.0))
            for link in sorted({*ledger.comm_by_link, *step.exposed_by_link})
        }
        return step.events, marks, step.exposed_s

    def _message_cost(self, nbytes: int, link: str) -> float:
        """The modelled cost of a p2p message (a receive's wait is explained up to it)."""
        size = dist.get_world_size() if dist.is_initialized() else 2
        return self.cost.delay("isend", nbytes, size, link)

    def _busy(self, link: str) -> Callable[[float, float], None]:
        def on_busy(start: float, end: float) -> None:
            with self._lock:
                self.ledger.busy[link].append((start, end))

        return on_busy

    # -- pricing and lanes -------------------------------------------------------------------------

    def _link(self, kind: str, group) -> str:
        return "pp" if kind in _P2P or kind == "batch_isend_irecv" else self.link_of(group)

    def price(self, kind: str, group, args=(), kwargs=None) -> float:
        """The modelled seconds of one call (p2p receives cost nothing: their send carries it)."""
        if kind in ("irecv", "recv"):
            return 0.0
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        return self.cost.delay(kind, _nbytes(args, kwargs or {}), size, self._link(kind, group))

    def price_call(self, kind: str, args=(), kwargs=None, *, group=None) -> Priced:
        """Price one call (``price``) and file it: in the coalescing block or batch being
        issued, else in the side table under the record the flight recorder just entered."""
        kwargs = kwargs or {}
        group = group if group is not None else _group_of(args, kwargs)
        link, nbytes = self._link(kind, group), _nbytes(args, kwargs)
        call = Priced(kind, link, nbytes, self.price(kind, group, args, kwargs), time.monotonic())
        call.peer = _peer(kind, args, kwargs)
        if self.passthrough:
            self._local.inner.append(call)
        else:
            self.ledger.comm_by_link[link] += call.cost_s
            self._file(call, 0)
        return call

    def _file(self, call: Priced, back: int) -> None:
        """Key ``call`` by the record ``back`` before the newest one (the outer recorder enters
        a call's record before calling this model; ``step_events`` checks the kinds match)."""
        recorder = self.recorder
        if recorder is not None and recorder.active and recorder.written > back:
            self.ledger.side[recorder.written - 1 - back] = call

    def lane(self, group, link: str | None = None) -> _Lane:
        """The thread that runs ``group``'s calls, booking its busy time to ``link`` (keyed by
        both: a group's link may be classified again, e.g. once the caller knows its groups)."""
        link = link or self.link_of(group)
        key = (id(group) if group is not None else None, link)
        if key not in self._lanes:
            self._lanes[key] = _Lane(self._busy(link))
        return self._lanes[key]

    def run_on_lane(self, wrapper: _Wrapped, args, kwargs, call: Priced) -> Future:
        """Run the real call on its group's thread after its modelled cost; the Future yields
        the real handle (collectives already waited for, a send only posted)."""
        group = _group_of(args, kwargs)
        collective = wrapper.name not in _P2P

        grad_mode = torch.is_grad_enabled()  # thread-local: the caller's, not the thread's

        def run():
            with self.entered(), torch.set_grad_enabled(grad_mode):
                work = wrapper.original(*args, **kwargs)
            if collective and hasattr(work, "wait"):
                work.wait()  # the thread is the collective's stream: it ends when the call does
                return None
            return work

        return self.lane(group, call.link).submit(call, run)

    # -- installation ------------------------------------------------------------------------------

    def install(self) -> CommTrace:
        """Patch torch.distributed with the network model, then install the flight recorder
        outside it (its records then include the modelled cost)."""
        global _ACTIVE
        _ACTIVE = self
        self.installed = True
        self._patches.install(
            {name: _Wrapped(name, getattr(dist, name), self) for name in COLLECTIVES},
            in_c10d=P2P_ASYNC,  # P2POp's identity check reads the c10d module's names
            batch=self._batch,
            coalescing=self._coalescing,
        )
        initialized = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
        self.recorder = FlightRecorder(None, rank, world, capacity=_RING, follow_device=False)
        self.recorder.install()
        self._records = FlightComm(self.recorder)
        if self.engine is not None:
            self.engine.set_cost(
                lambda kind, group, args, kwargs: self.price(kind, group, args, kwargs),
                lambda group, start, end: self._busy(self.link_of(group))(start, end),
            )
        return self

    def uninstall(self) -> None:
        global _ACTIVE
        _ACTIVE = None
        self.installed = False
        if self.engine is not None:
            self.engine.set_cost(None)
        if self.recorder is not None:
            self.recorder.close()  # outside the model's patches: restored first
        self._patches.restore()
        for lane in self._lanes.values():
            lane.executor.shutdown(wait=True)
        self._lanes.clear()

    @contextlib.contextmanager
    def _grouped(self):
        """Gather the calls issued inside (a coalescing block, a batch) into the yielded list."""
        outer, self._local.inner = getattr(self._local, "inner", None), []
        try:
            yield self._local.inner
        finally:
            self._local.inner = outer

    def _grouped_call(self, kind: str, inner: list[Priced], group) -> tuple[Priced, float]:
        """Calls issued together, priced as one: their summed cost, on their group's lane."""
        link = inner[0].link if inner else self.link_of(group)
        call = Priced(kind, link, sum(c.nbytes for c in inner), 0.0, time.monotonic())
        call.cost_s = sum(c.cost_s for c in inner)
        self.ledger.comm_by_link[link] += call.cost_s
        ready_at = self.lane(group, link).reserve(call.cost_s) if self.threaded else call.issued
        if self.threaded:
            call.transfer_start = ready_at - call.cost_s
        return call, ready_at

    def _drain(self, group, link: str | None = None) -> None:
        """Wait (exposed) until ``group``'s thread has run every call issued before this one."""
        if not self.threaded:
            return
        start = time.monotonic()
        self.lane(group).drain()
        self.ledger.drains.append((start, time.monotonic(), link or self.link_of(group)))

    def _batch(self, original):
        def batch_isend_irecv(p2p_op_list):
            group = p2p_op_list[0].group if p2p_op_list else None
            self._drain(group, "pp")
            with self._grouped() as inner:
                works = original(p2p_op_list)
            if self.engine is not None and not inner:  # queued: its calls run on the engine
                with self._grouped() as inner:
                    for o in p2p_op_list:
                        self.price_call(p2p_name(o), (o.tensor,), group=o.group)
            batch, ready_at = self._grouped_call("batch_isend_irecv", inner, group)
            for i, call in enumerate(inner):  # one record each, entered before the batch ran
                call.batch = batch
                self._file(call, len(inner) - 1 - i)
            return [_DelayedWork(w, ready_at) for w in works]

        return batch_isend_irecv

    def _coalescing(self, original):
        trace = self

        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            trace._drain(group)  # this group's earlier calls first, as on every rank
            proxy = _CoalescedHandle()
            with trace._grouped() as inner, original(group, device, async_ops) as cm:
                proxy.cm = cm
                yield proxy
            block, ready_at = trace._grouped_call("coalesced", inner, group)
            if inner:  # the recorder entered the block's record on leaving it
                block.inner = inner
                trace._file(block, 0)
            proxy.delayed = _DelayedWork(cm, ready_at)
            if not async_ops:
                proxy.delayed.wait()

        return coalescing_manager


class _CoalescedHandle:
    """What megatron-core keeps from ``with _coalescing_manager(...) as cm`` and later ``cm.wait()``."""

    cm = None
    delayed: _DelayedWork | None = None

    def wait(self):
        if self.delayed is not None:
            return self.delayed.wait()
        return self.cm.wait()

    def append(self, work) -> None:
        self.cm.append(work)

    @property
    def works(self):
        return self.cm.works
