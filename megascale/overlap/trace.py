"""See overlap on any backend: record every collective and p2p call, and optionally make each one
take a fixed extra latency, so that communication is costly relative to compute even on CPU.

``CommTrace.install()`` wraps ``torch.distributed``'s collective and p2p functions (and the aliases
megatron-core binds at import time) in this process. For each call it records an event (kind, issue
time, when the caller started and stopped waiting) and, with ``latency_s > 0``, models a link with
that latency:

* an asynchronous call returns at once; its handle's ``wait()`` returns no earlier than
  ``issue time + latency`` — compute done in between hides the latency;
* a synchronous call blocks for its own duration plus the latency.

``exposed_s`` accumulates the time the caller spent blocked (synchronous calls and ``wait()``): the
communication that computation did not hide. Ops issued together inside megatron-core's
``_coalescing_manager`` (one bucket's collectives) count as one operation.

This is a measurement tool for benchmarks and ordering tests; nothing in training depends on it.
Which names are patched and why (megatron-core's aliases, P2POp's identity checks, re-entry through
``handle_torch_function``) is ``megascale.parallel.comm_hooks``, shared with the flight recorder.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from megascale.parallel.comm_hooks import COLLECTIVES, P2P_ASYNC, CommWrapper, Patches

_ACTIVE: CommTrace | None = None


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


@dataclass
class Mark:
    name: str
    time: float


@dataclass
class _State:
    events: list[CommEvent] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    exposed_s: float = 0.0


class _DelayedWork:
    """A work handle whose ``wait()`` also waits out the modelled link latency."""

    def __init__(self, work, event: CommEvent, ready_at: float, trace: CommTrace) -> None:
        self._work, self._event, self._ready_at, self._trace = work, event, ready_at, trace

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        result = self._work.wait(*args, **kwargs) if self._work is not None else True
        remaining = self._ready_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        end = time.perf_counter()
        if self._event.wait_start is None:
            self._event.wait_start, self._event.wait_end = start, end
        self._trace.state.exposed_s += end - start
        return result

    def is_completed(self) -> bool:
        done = self._work is None or self._work.is_completed()
        return done and time.perf_counter() >= self._ready_at

    def __getattr__(self, name):
        return getattr(self._work, name)


class _Wrapped(CommWrapper):
    """A traced stand-in for one torch.distributed function."""

    def __init__(self, name: str, original, trace: CommTrace) -> None:
        super().__init__(name, original)
        self.trace = trace

    def __call__(self, *args, **kwargs):
        trace = self.trace
        if trace.reentered or not trace.installed:  # or uninstalled while stacked under another
            # torch's handle_torch_function (a TorchFunctionMode is active on CPU) calls the
            # function again through the patched module name: already recorded by the outer call.
            return self.original(*args, **kwargs)
        if trace.passthrough:  # inside a coalescing manager or batch: counted there
            trace.state.events.append(CommEvent(self.name, time.perf_counter(), coalesced=True))
            with trace.entered():
                return self.original(*args, **kwargs)
        is_async = self.name in P2P_ASYNC or kwargs.get("async_op", False)
        issued = time.perf_counter()
        event = CommEvent(self.name, issued)
        trace.state.events.append(event)
        with trace.entered():
            result = self.original(*args, **kwargs)
        if is_async:
            return _DelayedWork(result, event, issued + trace.latency_s, trace)
        remaining = issued + trace.latency_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        event.wait_start, event.wait_end = issued, time.perf_counter()
        trace.state.exposed_s += event.wait_end - issued
        return result


class CommTrace:
    """Records (and with ``latency_s`` delays) this process's communication. Install once per
    process, after megatron-core is imported; ``uninstall`` restores everything."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.state = _State()
        self._local = threading.local()
        self._patches = Patches()
        self.installed = False

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
        """Return and clear (events, marks, exposed seconds) — e.g. once per training step."""
        state, self.state = self.state, _State()
        return state.events, state.marks, state.exposed_s

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
        return self

    def uninstall(self) -> None:
        global _ACTIVE
        _ACTIVE = None
        self.installed = False
        self._patches.restore()

    @contextlib.contextmanager
    def _grouped(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def _batch(self, original):
        def batch_isend_irecv(p2p_op_list):
            issued = time.perf_counter()
            event = CommEvent("batch_isend_irecv", issued)
            self.state.events.append(event)
            with self._grouped():
                works = original(p2p_op_list)
            return [_DelayedWork(w, event, issued + self.latency_s, self) for w in works]

        return batch_isend_irecv

    def _coalescing(self, original):
        trace = self

        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            proxy = _CoalescedHandle()
            with trace._grouped(), original(group, device, async_ops) as cm:
                proxy.cm = cm
                yield proxy
            issued = time.perf_counter()  # the coalesced ops are issued on exiting the block
            event = CommEvent("coalesced", issued)
            trace.state.events.append(event)
            proxy.delayed = _DelayedWork(cm, event, issued + trace.latency_s, trace)
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
