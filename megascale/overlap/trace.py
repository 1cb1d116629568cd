"""See overlap on any backend: record every collective and p2p call, and optionally give each one a
modelled cost, so that communication is costly relative to compute even on CPU.

``CommTrace.install()`` wraps ``torch.distributed``'s collective and p2p functions (and the aliases
megatron-core binds at import time) in this process. For each call it records an event (kind, link
class, bytes, modelled cost, issue time, when the caller started and stopped waiting). The cost of a
call is ``CostModel.delay(op, bytes, group size, link)`` (``megascale.overlap.cost``): a fixed
latency per call, or alpha + bytes / beta of a named fabric. With a non-zero cost, calls run on
communication threads, one per process group (a FIFO, like a GPU's communication stream):

* the thread waits out the call's cost after the previous call of that group ended, then runs the
  real call: an asynchronous call returns at once and its handle's ``wait()`` blocks until the
  thread is done, so compute done in between hides the cost; a synchronous call waits at once;
* a send carries the cost of its message (it reaches the peer only after it); a receive is posted
  at once and costs nothing of its own — it completes when the delayed send arrives, so the
  receiver waits exactly as long as the link and the sender's lateness make it.

``exposed_s`` accumulates the time the caller spent blocked (synchronous calls and ``wait()``);
``exposed_by_link`` the part of it that the link's modelled transfers explain (``add_wait``): the
communication that computation did not hide; ``comm_by_link`` sums the modelled cost of the calls
issued. Each event keeps what it was counted (``exposed_s``), its p2p peer and the start of its
modelled transfer, so a receive's wait can be re-counted from both ends of its message once every
rank's events are gathered (``megascale.overlap.pp_exposure``). Ops issued together inside
megatron-core's ``_coalescing_manager`` (one bucket's collectives) or a ``batch_isend_irecv`` count
as one operation; they run in the caller's thread after their group's queue drains (so every rank
issues a group's calls in the same order), and their handle waits out their summed cost.

In the NCCL-like CPU mode (``parallel.async_collectives``, ``megascale.parallel.async_comm``)
pass its engine (``engine=``): the engine's own communication threads then wait out each call's
cost (``AsyncComm.set_cost``) instead of this module's, so an asynchronous op runs beside compute
there too; a synchronous call is waited for at once (the next kernel would wait for it) and
counted as exposed.

This is a measurement tool for benchmarks and ordering tests; nothing in training depends on it.
Which names are patched and why (megatron-core's aliases, P2POp's identity checks, re-entry through
``handle_torch_function``) is ``megascale.parallel.comm_hooks``, shared with the flight recorder.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megascale.overlap.cost import CostModel
from megascale.overlap.pp_exposure import covered
from megascale.parallel.async_comm import p2p_name
from megascale.parallel.comm_hooks import (
    COLLECTIVES,
    P2P_ASYNC,
    CommWrapper,
    Patches,
    comm_thread_flag,
)

_ACTIVE: CommTrace | None = None
_P2P = ("isend", "irecv", "send", "recv")


def mark(name: str) -> None:
    """Record a named point in the installed trace, if any (a no-op otherwise: cheap on hot paths)."""
    if _ACTIVE is not None:
        _ACTIVE.mark(name)


@dataclass
class CommEvent:
    kind: str
    issued: float
    wait_start: float | None = None
    wait_end: float | None = None
    coalesced: bool = False
    link: str = "other"
    nbytes: int = 0
    cost_s: float = 0.0
    peer: int | None = None
    """p2p only: the other end's global rank (a send's destination, a receive's source)."""
    transfer_start: float | None = None
    """When the modelled transfer began: after the call was posted and its group's earlier calls
    ended (``perf_counter``, system-wide on Linux, so it compares across ranks); None where the
    trace does not run the cost itself (the NCCL-like mode's threads do)."""
    exposed_s: float = 0.0
    """The part of the caller's waits on this call that ``add_wait`` counted as exposed."""


@dataclass
class Mark:
    name: str
    time: float


@dataclass
class _State:
    events: list[CommEvent] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    exposed_s: float = 0.0
    exposed_by_link: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    comm_by_link: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))


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
        start = max(self.busy_until, time.perf_counter())
        self.busy_until = start + cost_s
        self._on_busy(start, self.busy_until)
        return self.busy_until

    def submit(self, cost_s: float, fn: Callable, event: CommEvent | None = None) -> Future:
        def run():
            end = self.reserve(cost_s)
            if event is not None:
                event.transfer_start = end - cost_s
            remaining = end - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            return fn()

        return self.executor.submit(run)

    def drain(self) -> None:
        self.executor.submit(lambda: None).result()


class _DelayedWork:
    """A work handle whose ``wait()`` also waits for the communication thread and for the modelled
    end of the call (``ready_at``). ``work`` is the real handle or a Future of it."""

    def __init__(self, work, event: CommEvent, ready_at: float, trace: CommTrace) -> None:
        self._work, self._event, self._ready_at, self._trace = work, event, ready_at, trace

    def _real(self):
        return self._work.result() if isinstance(self._work, Future) else self._work

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        work = self._real()
        result = work.wait(*args, **kwargs) if work is not None else True
        remaining = self._ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        end = time.perf_counter()
        if self._event.wait_start is None:
            self._event.wait_start, self._event.wait_end = start, end
        self._trace.add_wait(self._event, start, end)
        return result

    def is_completed(self) -> bool:
        if isinstance(self._work, Future) and not self._work.done():
            return False
        work = self._real()
        done = work is None or work.is_completed()
        return done and time.perf_counter() >= self._ready_at

    def __getattr__(self, name):
        return getattr(self._real(), name)


class _Wrapped(CommWrapper):
    """A traced stand-in for one torch.distributed function."""

    def __init__(self, name: str, original, trace: CommTrace) -> None:
        super().__init__(name, original)
        self.trace = trace

    def __call__(self, *args, **kwargs):
        trace = self.trace
        if trace.reentered or not trace.installed or comm_thread_flag.active:
            # (or uninstalled while stacked under another; or on the NCCL-like mode's thread,
            # running a call the host issued and this trace recorded already)
            # torch's handle_torch_function (a TorchFunctionMode is active on CPU) calls the
            # function again through the patched module name: already recorded by the outer call.
            return self.original(*args, **kwargs)
        event = trace.record(self.name, args, kwargs, coalesced=trace.passthrough)
        if trace.passthrough:  # inside a coalescing manager or batch: counted there
            with trace.entered():
                return self.original(*args, **kwargs)
        is_async = self.name in P2P_ASYNC or kwargs.get("async_op", False)
        if trace.engine is not None:
            return self._on_engine(args, kwargs, event, is_async)
        result = None
        if not trace.threaded or self.name in ("irecv", "recv"):
            with trace.entered():
                result = self.original(*args, **kwargs)
            handle = result if hasattr(result, "wait") else None  # blocking recv: a rank
            work = _DelayedWork(handle, event, event.issued + event.cost_s, trace)
        else:
            work = _DelayedWork(trace.run_on_lane(self, args, kwargs, event), event, 0.0, trace)
        if is_async:
            return work
        if self.name in ("send", "recv") or trace.threaded:
            work.wait()
        else:  # unthreaded, synchronous: the call is done; wait out its modelled cost
            remaining = event.issued + event.cost_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            event.wait_start, event.wait_end = event.issued, time.perf_counter()
            trace.add_wait(event, event.issued, event.wait_end)
        return result if self.name == "recv" else work._real()

    def _on_engine(self, args, kwargs, event: CommEvent, is_async: bool):
        """The NCCL-like mode: the engine queues the call (and waits out its cost on its thread);
        a synchronous call is waited for here, all of it exposed."""
        trace = self.trace
        start = time.perf_counter()  # in backward the engine waits inside the call: count it
        with trace.entered():
            result = self.original(*args, **kwargs)
        op = result if hasattr(result, "wait") else trace.engine.last_op()
        if is_async:
            return _DelayedWork(op, event, 0.0, trace)
        if op is not None:
            op.wait()
        event.wait_start, event.wait_end = start, time.perf_counter()
        trace.add_wait(event, start, event.wait_end)
        return result


class CommTrace:
    """Records (and with a cost model delays) this process's communication. Install once per
    process, after megatron-core is imported; ``uninstall`` restores everything.

    ``latency_s``: the fixed-latency model (every call costs that much); ``cost``: any
    ``CostModel`` (overrides ``latency_s``). ``link_of(group) -> "tp" | "dp" | "pp" | "other"``
    classifies collectives by their process group (p2p calls are always "pp").
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
        self.state = _State()
        self._local = threading.local()
        self._patches = Patches()
        self._lanes: dict[object, _Lane] = {}
        self._lock = threading.Lock()
        self.last_by_link: dict[str, tuple[float, float]] = {}
        self.installed = False

    @property
    def latency_s(self) -> float:
        return self.cost.fixed_latency_s

    @property
    def passthrough(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

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
        self.state.marks.append(Mark(name, time.perf_counter()))

    def reset(self) -> tuple[list[CommEvent], list[Mark], float]:
        """Return and clear (events, marks, exposed seconds) — e.g. once per training step.
        ``last_by_link`` then holds the cleared step's (comm, exposed) seconds per link class."""
        for lane in list(self._lanes.values()):
            lane.drain()
        if self.engine is not None:
            self.engine.drain()
        state, self.state = self.state, _State()
        self.last_by_link = {
            link: (state.comm_by_link.get(link, 0.0), state.exposed_by_link.get(link, 0.0))
            for link in sorted({*state.comm_by_link, *state.exposed_by_link})
        }
        return state.events, state.marks, state.exposed_s

    def add_wait(self, event: CommEvent | None, start: float, end: float, link: str = "") -> None:
        """Account the caller's wait ``[start, end]`` for ``event`` (or for a drain of ``link``).

        ``exposed_s`` counts all of it. ``exposed_by_link`` counts only the part the link's
        modelled transfers explain: the wait's overlap with that link's busy intervals, or for a
        receive (priced at its sender) at most the cost of the message — the rest of a wait is
        a peer arriving late (a pipeline bubble, a slower rank), not communication.
        """
        link = event.link if event is not None else link
        if event is not None and event.kind in ("irecv", "recv"):
            size = dist.get_world_size() if dist.is_initialized() else 2
            message = self.cost.delay("isend", event.nbytes, size, link)
            explained = min(end - start, message)
        else:
            explained = self._busy_overlap(link, start, end)
        with self._lock:
            self.state.exposed_s += end - start
            self.state.exposed_by_link[link] += explained
            if event is not None:
                event.exposed_s += explained

    def _busy_overlap(self, link: str, start: float, end: float) -> float:
        with self._lock:
            spans = list(self.state.busy[link])
        return covered((start, end), spans)

    def _busy(self, link: str) -> Callable[[float, float], None]:
        def on_busy(start: float, end: float) -> None:
            with self._lock:
                self.state.busy[link].append((start, end))

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

    def record(self, kind: str, args=(), kwargs=None, *, coalesced=False, group=None) -> CommEvent:
        """Append the event of one call, priced by the cost model (``price``)."""
        kwargs = kwargs or {}
        group = group if group is not None else _group_of(args, kwargs)
        link, nbytes = self._link(kind, group), _nbytes(args, kwargs)
        cost = self.price(kind, group, args, kwargs)
        event = CommEvent(kind, time.perf_counter(), coalesced=coalesced, link=link, nbytes=nbytes)
        event.cost_s = cost
        event.peer = _peer(kind, args, kwargs)
        self.state.events.append(event)
        if not coalesced:
            self.state.comm_by_link[link] += cost
        return event

    def lane(self, group, link: str | None = None) -> _Lane:
        key = id(group) if group is not None else None
        if key not in self._lanes:
            self._lanes[key] = _Lane(self._busy(link or self.link_of(group)))
        return self._lanes[key]

    def run_on_lane(self, wrapper: _Wrapped, args, kwargs, event: CommEvent) -> Future:
        """Run the real call on its group's thread after its modelled cost; the Future yields
        the real handle (collectives already waited for, a send only posted)."""
        group = _group_of(args, kwargs)
        collective = wrapper.name not in _P2P

        grad_mode = torch.is_grad_enabled()  # thread-local: the caller's, not the thread's

        def call():
            with self.entered(), torch.set_grad_enabled(grad_mode):
                work = wrapper.original(*args, **kwargs)
            if collective and hasattr(work, "wait"):
                work.wait()  # the thread is the collective's stream: it ends when the call does
                return None
            return work

        return self.lane(group, event.link).submit(event.cost_s, call, event)

    # -- installation ------------------------------------------------------------------------------

    def install(self) -> CommTrace:
        global _ACTIVE
        _ACTIVE = self
        self.installed = True
        self._patches.install(
            {name: _Wrapped(name, getattr(dist, name), self) for name in COLLECTIVES},
            in_c10d=P2P_ASYNC,  # P2POp's identity check reads the c10d module's names
            batch=self._batch,
            coalescing=self._coalescing,
        )
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
        self._patches.restore()
        for lane in self._lanes.values():
            lane.executor.shutdown(wait=True)
        self._lanes.clear()

    @contextlib.contextmanager
    def _grouped(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _grouped_event(self, kind: str, inner: list[CommEvent], group) -> tuple[CommEvent, float]:
        """One event for calls issued together: their summed cost, on their group's lane."""
        link = inner[0].link if inner else self.link_of(group)
        event = CommEvent(kind, time.perf_counter(), link=link)
        event.nbytes = sum(e.nbytes for e in inner)
        event.cost_s = sum(e.cost_s for e in inner)
        self.state.events.append(event)
        self.state.comm_by_link[link] += event.cost_s
        ready_at = self.lane(group, link).reserve(event.cost_s) if self.threaded else event.issued
        if self.threaded:
            event.transfer_start = ready_at - event.cost_s
        return event, ready_at

    def _drain(self, group, link: str | None = None) -> None:
        """Wait (exposed) until ``group``'s thread has run every call issued before this one."""
        if not self.threaded:
            return
        start = time.perf_counter()
        self.lane(group).drain()
        self.add_wait(None, start, time.perf_counter(), link or self.link_of(group))

    def _batch(self, original):
        def batch_isend_irecv(p2p_op_list):
            group = p2p_op_list[0].group if p2p_op_list else None
            self._drain(group, "pp")
            first = len(self.state.events)
            with self._grouped():
                works = original(p2p_op_list)
            inner = self.state.events[first:]
            if self.engine is not None and not inner:  # queued: its calls run on the engine
                inner = [
                    self.record(p2p_name(o), (o.tensor,), coalesced=True, group=o.group)
                    for o in p2p_op_list
                ]
            event, ready_at = self._grouped_event("batch_isend_irecv", inner, group)
            return [_DelayedWork(w, event, ready_at, self) for w in works]

        return batch_isend_irecv

    def _coalescing(self, original):
        trace = self

        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            trace._drain(group)  # this group's earlier calls first, as on every rank
            proxy = _CoalescedHandle()
            first = len(trace.state.events)
            with trace._grouped(), original(group, device, async_ops) as cm:
                proxy.cm = cm
                yield proxy
            inner = trace.state.events[first:]
            event, ready_at = trace._grouped_event("coalesced", inner, group)
            proxy.delayed = _DelayedWork(cm, event, ready_at, trace)
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
