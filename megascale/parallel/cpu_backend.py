"""Run megatron-core's real TP/SP/PP/VPP/DDP/distributed-optimizer code on CPU processes (gloo).

Megatron-core assumes CUDA on the paths we use: buffers are allocated on
``torch.cuda.current_device()``, schedules, the optimizer and grad clipping create tensors with
``device="cuda"``, the distributed optimizer checks ``Tensor.type() == "torch.cuda.FloatTensor"``,
dropout runs under a CUDA RNG tracker, and batched p2p calls ``torch.cuda.synchronize()``.
This module redirects exactly those to the CPU, and nothing else:

* a ``TorchFunctionMode`` that rewrites a CUDA ``device=`` argument (``"cuda"``, ``"cuda:0"``,
  ``torch.device("cuda")``, or the integer that ``torch.cuda.current_device()`` returns) to CPU,
  turns ``Tensor.cuda()`` into a no-op, and answers ``Tensor.type()`` with the CUDA type name;
* a handful of ``torch.cuda`` functions replaced by CPU equivalents (each its own function object:
  two attributes sharing one function object crash ``torch._dynamo``), ``is_available`` answering
  False among them: with a CUDA build of torch, code that asks whether CUDA is there before it
  touches it (torch's own ``Optimizer.step`` health check, ``torch.accelerator``) must hear no,
  or it initialises CUDA (no driver: "Found no NVIDIA driver"; a forked rank: "Cannot
  re-initialize CUDA in forked subprocess");
* an RNG tracker that forks the CPU default generator instead of a CUDA one.

It is activated only when training on CPU (``activate()``; the trainer decides), is idempotent, and
is checked against each supported megatron-core series: ``megascale.parallel.mcore_cuda_sites``
records the CUDA call sites on our paths per series (``mcore_sites/<series>.json``), ``activate``
refuses a series without one, and ``tests/unit/test_cpu_backend.py`` fails loudly when a
megatron-core release adds or moves one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megascale.parallel import mcore_cuda_sites
from megascale.versions import MEGATRON_CORE_RANGE, series

logger = logging.getLogger(__name__)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_CPU = torch.device("cpu")


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare int device is a CUDA ordinal.
    return isinstance(device, int) and not isinstance(device, bool)


# Set by the NCCL-like mode (``megascale.parallel.async_comm``): called before every torch call of
# the host thread (it waits for the synchronous collectives issued so far), and by synchronize().
_compute_gate: Callable[[], None] | None = None
_device_sync: Callable[[], None] | None = None


def set_comm_hooks(
    compute_gate: Callable[[], None] | None, device_sync: Callable[[], None] | None
) -> None:
    """Install (or, with None, remove) the asynchronous-communication hooks (see above)."""
    global _compute_gate, _device_sync
    _compute_gate, _device_sync = compute_gate, device_sync


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _compute_gate is not None:
            _compute_gate()
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _current_device() -> torch.device:
    # A device, not an ordinal: megatron-core passes it as ``device=`` also inside autograd
    # backward functions, where no TorchFunctionMode is active to rewrite it.
    return _CPU


def _device_count() -> int:
    return 1


def _is_available() -> bool:
    return False


def _synchronize(device: object = None) -> None:
    if _device_sync is not None:
        _device_sync()


def _set_device(device: object) -> None:
    return None


def _manual_seed(seed: int) -> None:
    # The "device" generator on CPU is the CPU default generator (dropout draws from it).
    torch.manual_seed(seed)


def _get_rng_state(device: object = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: object = "cuda") -> None:
    torch.set_rng_state(state)


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered on one thread."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        return None

    def wait_event(self, event: object) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: object = None) -> object:
        return event


def _current_stream(device: object = None) -> _NullStream:
    return _NullStream()


@contextlib.contextmanager
def _stream(stream: object) -> Iterator[None]:
    yield


_TORCH_CUDA_REPLACEMENTS = {
    "current_device": _current_device,
    "device_count": _device_count,
    "is_available": _is_available,
    "synchronize": _synchronize,
    "set_device": _set_device,
    "manual_seed": _manual_seed,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "Stream": _NullStream,
    "current_stream": _current_stream,
    "stream": _stream,
}


def _mcore_get_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _mcore_set_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


_MCORE_RNG_REPLACEMENTS = {
    "_get_cuda_rng_state": _mcore_get_rng_state,
    "_set_cuda_rng_state": _mcore_set_rng_state,
}
"""megatron-core's own RNG-state helpers (``tensor_parallel.random``), replaced the same way."""


def _in_cpu_mode(backward: Callable) -> Callable:
    """``backward`` run under the CPU device mode (megatron-core's recomputing backward)."""

    def cpu_backward(ctx, *args):
        with _CpuDeviceMode():
            return backward(ctx, *args)

    return cpu_backward


def _make_rng_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mcore_random

    class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
        """megatron-core's RNG tracker with the CPU default generator as the forked stream."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self.seeds_.add(seed)
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"RNG state {name!r} was never added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


class CpuBackend:
    """The set of redirections; ``activate()`` installs them once per process."""

    def __init__(self) -> None:
        self.active = False
        self._mode: _CpuDeviceMode | None = None
        self._saved: dict[str, object] = {}
        self._saved_mcore: dict[str, object] = {}
        self._saved_backward: object = None
        self._saved_tracker: tuple[object, bool] = (None, False)

    def activate(self) -> None:
        if self.active:
            return
        import megatron.core
        from megatron.core.tensor_parallel import random as mcore_random

        version = megatron.core.__version__
        checked = mcore_cuda_sites.snapshot_series()
        if series(version) not in checked:
            raise RuntimeError(
                f"megatron-core {version} is installed; the CPU backend was checked against "
                f"megatron-core {', '.join(checked)} (megascale supports {MEGATRON_CORE_RANGE}). "
                "Re-run tests/unit/test_cpu_backend.py and record its CUDA call sites "
                "(python -m megascale.parallel.mcore_cuda_sites --write) before training on CPU "
                "with it."
            )
        for name, replacement in _TORCH_CUDA_REPLACEMENTS.items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, replacement)
        self._saved_tracker = (
            mcore_random._CUDA_RNG_STATE_TRACKER,
            mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        )
        mcore_random._CUDA_RNG_STATE_TRACKER = _make_rng_tracker_class()()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        # Activation recomputation saves and restores "the CUDA RNG state" through these two
        # (torch.cuda.random and torch.cuda.default_generators inside): on CPU it is the CPU one.
        for name, replacement in _MCORE_RNG_REPLACEMENTS.items():
            self._saved_mcore[name] = getattr(mcore_random, name)
            setattr(mcore_random, name, replacement)
        # A recomputed forward runs inside autograd's backward, where no TorchFunctionMode is
        # active: its device="cuda" tensors (the causal mask, ...) are redirected there too.
        checkpoint = mcore_random.CheckpointFunction
        self._saved_backward = checkpoint.__dict__["backward"]
        checkpoint.backward = staticmethod(_in_cpu_mode(self._saved_backward.__func__))
        self._mode = _CpuDeviceMode()
        self._mode.__enter__()
        self.active = True
        logger.debug("CPU backend active for megatron-core %s", version)

    def deactivate(self) -> None:
        if not self.active:
            return
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        for name, original in self._saved.items():
            setattr(torch.cuda, name, original)
        self._saved.clear()
        from megatron.core.tensor_parallel import random as mcore_random

        for name, original in self._saved_mcore.items():
            setattr(mcore_random, name, original)
        self._saved_mcore.clear()
        mcore_random.CheckpointFunction.backward = self._saved_backward

        (
            mcore_random._CUDA_RNG_STATE_TRACKER,
            mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        ) = self._saved_tracker
        self.active = False


_BACKEND = CpuBackend()


def activate() -> None:
    """Install the CPU redirections in this process (idempotent). Call before building a model."""
    _BACKEND.activate()


def deactivate() -> None:
    """Undo ``activate()`` (used by tests)."""
    _BACKEND.deactivate()


def is_active() -> bool:
    return _BACKEND.active


def seed_rng_tracker(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """CPU version of megatron-core's ``model_parallel_cuda_manual_seed``: same names, same seeds."""
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(
        mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank
    )
