"""The flight recorder's hooks: the wrappers that stand in front of torch.distributed's
collective and p2p functions, ``batch_isend_irecv`` and megatron-core's ``_coalescing_manager``,
and turn each call into ``FlightRecorder.enter`` / ``mark`` / ``leave`` / ``track`` calls on the
recorder they were made for (``FlightRecorder.install`` builds and installs them).

An op re-entered through ``handle_torch_function`` (the CPU backend's TorchFunctionMode) or called
by another c10d function is counted once, by the outermost call (``_Local.inside``); ops issued in
a coalescing block are gathered in a ``_Pending`` and recorded as one op when the block ends.
``_OpWrapper.__call__`` and ``_RecordedWork.wait`` are the hot path: they run on every collective.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megascale.parallel.comm_hooks import CommWrapper, Reentry, comm_thread_flag
from megascale.probes.flight.format import ASYNC, BATCH, COALESCED, NO_PEER, P2P, OpKind, OpState

if TYPE_CHECKING:
    from megascale.probes.flight.recorder import Channel, FlightRecorder

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
# Hot-path constants bound once (an enum member or module attribute read costs as much as the
# call it feeds).
_WAITING, _LEFT, _FAILED = int(OpState.WAITING), int(OpState.LEFT), int(OpState.FAILED)
_monotonic = time.monotonic

_KIND_OF = {
    "all_reduce": OpKind.ALL_REDUCE,
    "all_gather": OpKind.ALL_GATHER,
    "all_gather_into_tensor": OpKind.ALL_GATHER_INTO_TENSOR,
    "all_gather_single": OpKind.ALL_GATHER_INTO_TENSOR,
    "_all_gather_base": OpKind.ALL_GATHER_INTO_TENSOR,
    "reduce_scatter": OpKind.REDUCE_SCATTER,
    "reduce_scatter_tensor": OpKind.REDUCE_SCATTER_TENSOR,
    "reduce_scatter_single": OpKind.REDUCE_SCATTER_TENSOR,
    "_reduce_scatter_base": OpKind.REDUCE_SCATTER_TENSOR,
    "broadcast": OpKind.BROADCAST,
    "reduce": OpKind.REDUCE,
    "all_to_all": OpKind.ALL_TO_ALL,
    "all_to_all_single": OpKind.ALL_TO_ALL_SINGLE,
    "gather": OpKind.GATHER,
    "scatter": OpKind.SCATTER,
    "barrier": OpKind.BARRIER,
    "send": OpKind.SEND,
    "recv": OpKind.RECV,
    "isend": OpKind.ISEND,
    "irecv": OpKind.IRECV,
}
# The argument whose size a record carries: the full collective's payload.
_SIZE_ARG = {
    "all_reduce": "tensor",
    "all_gather": "tensor_list",
    "all_gather_into_tensor": "output_tensor",
    "all_gather_single": "output_tensor",
    "_all_gather_base": "output_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "_reduce_scatter_base": "input",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "gather": "tensor",
    "scatter": "tensor",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
_P2P_PEER_KW = {
    "send": "group_dst",
    "isend": "group_dst",
    "recv": "group_src",
    "irecv": "group_src",
}


@dataclass
class _Pending:
    """The ops issued inside one coalescing block, recorded as one op on leaving it."""

    kind: OpKind | None = None
    nbytes: int = 0
    count: int = 0


class CallState(Reentry):
    """Per thread: inside a recorded call (``inside``), and the coalescing block being gathered."""

    coalescing: _Pending | None = None


class _OpWrapper(CommWrapper):
    """Records one torch.distributed function's calls. The hot path: keep it short (it runs on
    every collective, with the training step's data in the caches)."""

    def __init__(self, name: str, original: Callable, recorder: FlightRecorder) -> None:
        super().__init__(name, original)
        self.recorder, self.kind, self.local = recorder, _KIND_OF[name], recorder.local
        params = list(inspect.signature(original).parameters)
        self.group_at = params.index("group")
        # -1: no async_op parameter (isend/irecv are always asynchronous, the others synchronous)
        self.async_at = params.index("async_op") if "async_op" in params else -1
        self.always_async = name in ("isend", "irecv")
        self.size_name = _SIZE_ARG.get(name)
        self.size_at = params.index(self.size_name) if self.size_name else -1
        self.peer_kw = _P2P_PEER_KW.get(name)

    def __call__(self, *args, **kwargs):
        local = self.local
        if local.inside or not self.recorder.active or comm_thread_flag.active:
            # re-entered through handle_torch_function, or the NCCL-like mode's communication
            # thread carrying out a call the host made (recorded then)
            return self.original(*args, **kwargs)
        recorder, index, n = self.recorder, None, len(args)
        at = self.size_at
        nbytes = 0 if at < 0 else _nbytes(args[at] if n > at else kwargs.get(self.size_name))
        pending = local.coalescing
        if pending is None:
            group = args[self.group_at] if n > self.group_at else kwargs.get("group")
            at = self.async_at
            is_async = self.always_async or (
                at >= 0 and bool(args[at] if n > at else kwargs.get("async_op"))
            )
            if self.peer_kw is None:
                channel, peer, flags = recorder.group(group), NO_PEER, 0
            else:
                peer = self._peer(args, kwargs, group)
                channel, flags = recorder.pair(group, peer), P2P
                peer = peer if peer >= 0 else NO_PEER
            if channel is not None:  # None: not a member (torch does nothing either)
                flags |= ASYNC if is_async else 0
                # one clock read: the record's enter time, and the start of the blocked interval
                started = _monotonic()
                index = recorder.enter(self.kind, channel, nbytes, flags, peer, 1, started)
                start = recorder.start_event() if recorder._cuda else None
        else:  # inside a coalescing block: recorded as one op when the block ends
            pending.kind = pending.kind or self.kind
            pending.nbytes += nbytes
            pending.count += 1
        local.inside = True
        try:
            result = self.original(*args, **kwargs)
        except BaseException:
            if index is not None:
                recorder.mark((index,), _FAILED)
            raise
        finally:
            local.inside = False
        if index is None:
            return result
        recorder.track(index, result, channel.gid if self.peer_kw is None else None, start)
        if is_async and result is not None:
            return _RecordedWork(result, recorder, (index,), channel)
        left = _monotonic()  # the record's leave time, and the end of the blocked interval
        recorder.leave(index, left)
        recorder.blocked_s += left - started
        channel.blocked_s += left - started
        return result

    def _peer(self, args, kwargs, group) -> int:
        peer = (
            args[1]
            if len(args) > 1
            else kwargs.get("dst" if self.peer_kw == "group_dst" else "src")
        )
        if peer is None and kwargs.get(self.peer_kw) is not None:
            peer = dist.get_global_rank(group, kwargs[self.peer_kw])
        return -1 if peer is None else int(peer)


class _RecordedWork:
    """A work handle (or megatron-core's coalescing handle) whose ``wait()`` marks its records."""

    def __init__(
        self,
        work,
        recorder: FlightRecorder,
        indices: tuple[int, ...],
        channel: Channel | None = None,
    ) -> None:
        self._work, self._recorder, self.indices, self._done = work, recorder, indices, False
        self.channel = channel  # whose blocked time the wait adds to

    def wait(self, *args, **kwargs):
        if self._done:
            return self._work.wait(*args, **kwargs)
        recorder, indices = self._recorder, self.indices
        started = _monotonic()  # the WAITING time, and the start of the blocked interval
        recorder.mark(indices, _WAITING, started)
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException:
            recorder.mark(indices, _FAILED)
            raise
        finally:
            self._done = True
        left = _monotonic()
        recorder.mark(indices, _LEFT, left)
        recorder.blocked_s += left - started
        if self.channel is not None:
            self.channel.blocked_s += left - started
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def op_wrappers(recorder: FlightRecorder) -> dict[str, _OpWrapper]:
    """A wrapper per torch.distributed collective and p2p function this torch has."""
    return {
        name: _OpWrapper(name, getattr(dist, name), recorder)
        for name in _KIND_OF
        if hasattr(dist, name)
    }


def batch_wrapper(recorder: FlightRecorder, original: Callable) -> Callable:
    """``torch.distributed.batch_isend_irecv`` recording each of its ops (``Patches.install``)."""

    def batch_isend_irecv(p2p_op_list):
        local = recorder.local
        if local.inside or not recorder.active or comm_thread_flag.active:
            return original(p2p_op_list)
        indices, channels = [], []
        for op in p2p_op_list:
            name = getattr(op.op, "name", None) or getattr(op.op, "__name__", "")
            channel = recorder.pair(op.group, op.peer)
            if channel is not None:
                kind = OpKind.ISEND if name == "isend" else OpKind.IRECV
                flags = ASYNC | P2P | BATCH
                nbytes = _nbytes(op.tensor)
                indices.append(recorder.enter(kind, channel, nbytes, flags, op.peer))
                channels.append(channel)
        local.inside = True
        try:
            works = original(p2p_op_list)
        except BaseException:
            recorder.mark(indices, _FAILED)
            raise
        finally:
            local.inside = False
        for i, w in zip(indices, works, strict=False):
            recorder.track(i, w)
        if len(works) == len(indices):
            return [
                _RecordedWork(w, recorder, (i,), c)
                for w, i, c in zip(works, indices, channels, strict=True)
            ]
        first = channels[0] if channels else None
        return [_RecordedWork(w, recorder, tuple(indices), first) for w in works]  # NCCL

    return batch_isend_irecv


def coalescing_wrapper(recorder: FlightRecorder, original: Callable) -> Callable:
    """megatron-core's ``_coalescing_manager`` recording its block's ops as one record."""

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        local = recorder.local
        if (
            local.inside
            or local.coalescing is not None
            or not recorder.active
            or comm_thread_flag.active
        ):
            with original(group, device, async_ops) as cm:
                yield cm
            return
        pending, indices = _Pending(), ()
        try:
            with original(group, device, async_ops) as cm:
                handle = _RecordedWork(cm, recorder, ())
                local.coalescing = pending
                try:
                    yield handle
                finally:
                    local.coalescing = None
                channel = recorder.group(group)
                if pending.count and channel is not None:  # leaving the block issues the ops
                    flags = COALESCED | (ASYNC if async_ops else 0)
                    index = recorder.enter(
                        pending.kind, channel, pending.nbytes, flags, count=pending.count
                    )
                    handle.indices = indices = (index,)
                    handle.channel = channel
        except BaseException:
            recorder.mark(indices, _FAILED)
            raise
        for i in indices:
            recorder.track(i, getattr(handle, "_work", None), handle.channel.gid)
        if not async_ops:
            recorder.mark(indices, _LEFT)

    return coalescing_manager


def _nbytes(value) -> int:
    """Bytes of a tensor or a list of tensors (0 for anything else)."""
    # Under a TorchFunctionMode (the CPU backend) every tensor attribute read goes through the
    # mode's Python handler; a size needs no device remapping.
    with _NO_TORCH_FUNCTION():
        if isinstance(value, torch.Tensor):
            return value.nbytes
        if isinstance(value, list | tuple):
            return sum(t.nbytes for t in value if isinstance(t, torch.Tensor))
    return 0
