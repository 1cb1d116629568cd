"""The ``mismatch-comm`` fault on the worker: this rank's next collective is issued with another
op or another size than its group peers issue at the same sequence number, and hangs.

What a real mismatch does decides what this one does. On NCCL nothing checks that the members of
a collective agree: every member's kernel starts and waits for data that never comes in the
shape it expects (or reads garbage), so the job hangs until a watchdog fires. Gloo checks sizes
in its transport and aborts the whole process (``EnforceNotMet ... Received data size doesn't
match expected size``, from a gloo thread: an uncatchable ``std::terminate``), and a different op
blocks until the process group's timeout. megascale's CPU modes stand in for the GPU, so the
injected mismatch behaves as NCCL's does in both: the odd op is issued and recorded with its
wrong op or size (the flight recorder sees the call as the host made it), then never completes.
In the NCCL-like mode it runs on its group's communication thread, which it holds forever (the
device started it, it never completes); in the blocking gloo mode the host stays in the call.
Its peers run the right op for real and wait in gloo for this rank, as NCCL peers would.

``arm(kind)`` stands a wrapper in front of the collectives (on top of the flight recorder and the
NCCL-like engine, see ``megascale.parallel.comm_hooks``); it fires once, on the first collective
this thread issues outside a coalescing block on a group of two or more, and is inert after that. p2p calls are left
alone: the two ends of a transfer differ anyway.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megascale.parallel.comm_hooks import CommWrapper, Patches, comm_thread_flag

logger = logging.getLogger(__name__)

KINDS = ("size", "op")
"""``size``: the same op on a payload twice as large; ``op``: another op on a payload of the
same size (an all-reduce becomes a broadcast, anything else an all-reduce)."""

# The collectives a mismatch may hit, with the argument whose size the flight recorder records.
_PAYLOAD = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather_into_tensor": "output_tensor",
    "_all_gather_base": "output_tensor",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
}
_TENSOR_ARGS = ("tensor", "output_tensor", "input_tensor", "output", "input")


class _Mismatch:
    """The armed fault: ``fire`` replaces one call by its mismatched form and hangs it."""

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"mismatch kind {kind!r}: accepted {', '.join(KINDS)}")
        self.kind = kind
        self.fired = False
        self.thread = threading.get_ident()
        self.coalescing = threading.local()
        self.wrappers: dict[str, _Wrapper] = {}
        self._patches = Patches()

    def install(self) -> _Mismatch:
        self.wrappers = {
            name: _Wrapper(name, getattr(dist, name), self)
            for name in _PAYLOAD
            if hasattr(dist, name)
        }
        self._patches.install(
            self.wrappers,
            in_c10d=[
                n for n in self.wrappers if getattr(distributed_c10d, n, None) is dist.__dict__[n]
            ],
            coalescing=self._coalescing,
        )
        return self

    def applies(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether this call is the one to mismatch: the first one of the armed thread, outside
        a coalescing block, on a group with a peer to disagree with."""
        if (
            self.fired
            or threading.get_ident() != self.thread
            or comm_thread_flag.active
            or getattr(self.coalescing, "inside", False)
        ):
            return False
        group = inspect.signature(self.wrappers[name].original).bind(*args, **kwargs)
        return dist.get_world_size(group.arguments.get("group")) > 1

    def fire(self, name: str, args: tuple, kwargs: dict):
        """Issue ``name(*args, **kwargs)`` mismatched, through the wrappers below this one (the
        recorder records it), with the function at the bottom of that chain replaced, for this
        call, by one that never returns."""
        self.fired = True
        bound = inspect.signature(self.wrappers[name].original).bind(*args, **kwargs)
        group = bound.arguments.get("group")
        payload = bound.arguments[_PAYLOAD[name]]
        if self.kind == "size":
            target = name
            for arg in _TENSOR_ARGS:
                value = bound.arguments.get(arg)
                if isinstance(value, torch.Tensor):
                    bound.arguments[arg] = value.new_zeros(2 * value.numel())
            call_args, call_kwargs = bound.args, bound.kwargs
        elif name == "all_reduce":
            target = "broadcast"
            src = dist.get_global_rank(group, 0) if group is not None else 0
            call_args, call_kwargs = (payload.clone(),), {"src": src, "group": group}
        else:
            target = "all_reduce"
            call_args, call_kwargs = (payload.new_zeros(payload.shape),), {"group": group}
        logger.warning(
            "injected collective mismatch: %s issued as %s (%s); it never completes",
            name,
            target,
            self.kind,
        )
        wrapper = self.wrappers[target]
        bottom = _bottom(wrapper)
        real = bottom.original
        bottom.original = _hang  # read once by the call below (the NCCL-like engine keeps it)
        try:
            return wrapper.original(*call_args, **call_kwargs)
        finally:
            bottom.original = real

    def _coalescing(self, original: Callable) -> Callable:
        state = self.coalescing

        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            outer = getattr(state, "inside", False)
            state.inside = True
            try:
                with original(group, device, async_ops) as cm:
                    yield cm
            finally:
                state.inside = outer

        return coalescing_manager


class _Wrapper(CommWrapper):
    def __init__(self, name: str, original: Callable, fault: _Mismatch) -> None:
        super().__init__(name, original)
        self.fault = fault

    def __call__(self, *args, **kwargs):
        if self.fault.applies(self.name, args, kwargs):
            return self.fault.fire(self.name, args, kwargs)
        return self.original(*args, **kwargs)


class _Bottom:
    """Stands for the chain's raw function when no wrapper is below ours."""

    def __init__(self, wrapper: _Wrapper) -> None:
        self.wrapper = wrapper

    @property
    def original(self) -> Callable:
        return self.wrapper.original

    @original.setter
    def original(self, fn: Callable) -> None:
        self.wrapper.original = fn


def _bottom(wrapper: _Wrapper) -> CommWrapper | _Bottom:
    """The last ``CommWrapper`` of the chain under ``wrapper`` (the one that calls torch's own
    function), or ``wrapper`` itself when nothing stands between it and torch."""
    below, fn = None, wrapper.original
    while isinstance(fn, CommWrapper):
        below, fn = fn, fn.original
    return below if below is not None else _Bottom(wrapper)


def _hang(*args, **kwargs):
    """A collective whose peers never send what it waits for: it never returns."""
    while True:
        time.sleep(3600)


def arm(kind: str) -> None:
    """Make this thread's next collective a mismatched one that hangs (``mismatch-comm``)."""
    _Mismatch(kind).install()
