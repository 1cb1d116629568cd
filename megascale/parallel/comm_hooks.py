"""Stand wrappers in front of torch.distributed's communication functions, and take them away again.

Shared by the comm trace (``megascale.overlap.trace``) and the flight recorder
(``megascale.probes.flight.recorder``). The traps, solved once here:

* megatron-core binds some functions to its own module names at import time
  (``dist_all_gather_func``, ``dist_reduce_scatter_func``, ``_coalescing_manager``): patching
  ``torch.distributed`` alone misses its bucketed DP and TP calls, so those names are re-pointed
  too.
* ``torch.distributed.P2POp`` checks ``op in [isend, irecv]`` and ``batch_isend_irecv`` checks
  ``op.op is isend`` against ``distributed_c10d``'s globals: a wrapper compares equal to (and hashes
  like) the function it wraps, and ``isend``/``irecv`` are replaced under both module names.
* Under a ``TorchFunctionMode`` (the CPU backend is one) a c10d function calls itself again through
  ``handle_torch_function`` via its module-global name, and c10d functions call one another
  (``all_gather_into_tensor`` -> ``all_gather_single``): a wrapper that must count a call once keeps
  a per-thread "inside" flag (``Reentry``) and passes nested calls straight through.

Several patchers may be stacked (e.g. the flight recorder under the timeline's ``CommTrace``): each
wraps whatever is installed when it installs, and they may be uninstalled in any order.
``Patches.restore`` puts back an attribute only where it still holds its own replacement; a
replacement that another patcher has wrapped since stays in that chain, is "retired", and is skipped
when the patcher above restores. A retired wrapper must pass calls straight through (its owner knows
it is uninstalled).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping

import torch.distributed as dist
from torch.distributed import distributed_c10d

logger = logging.getLogger(__name__)

# megatron-core modules that bind a torch.distributed function to a module name at import time.
MCORE_ALIAS_MODULES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
)
MCORE_FUNCTION_ALIASES = ("dist_all_gather_func", "dist_reduce_scatter_func")
MCORE_COALESCING_ALIAS = "_coalescing_manager"

# The torch.distributed functions the comm wrappers (trace, timers) stand in for.
COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "_all_gather_base",
    "_reduce_scatter_base",
    "broadcast",
    "all_gather",
    "isend",
    "irecv",
    "send",
    "recv",
)
P2P_ASYNC = ("isend", "irecv")


class CommWrapper:
    """Base of a stand-in for one torch.distributed function (``name``, wrapping ``original``).

    Compares equal to and hashes like ``original``, so torch's ``op in [isend, irecv]`` checks and
    megatron-core's alias lookup still work. Subclasses implement ``__call__``.
    """

    def __init__(self, name: str, original: Callable) -> None:
        self.name, self.original = name, original

    @property
    def __signature__(self) -> inspect.Signature:
        """The wrapped function's (a wrapper stacked on this one reads argument positions)."""
        return inspect.signature(self.original)

    def __eq__(self, other) -> bool:
        return other is self or self.original == other

    def __hash__(self) -> int:
        return hash(self.original)


class Reentry(threading.local):
    """Per-thread flag: True while a wrapper is inside the function it wraps."""

    inside = False


class CommThreadFlag(threading.local):
    """Per-thread flag: True on a communication thread (``megascale.parallel.async_comm``), whose
    calls into torch.distributed are the host's calls carried out: wrappers pass them through."""

    active = False


comm_thread_flag = CommThreadFlag()


# id(replacement) -> (replacement, what it replaced), for replacements left under another patcher.
_retired: dict[int, tuple[object, object]] = {}


def _live(fn: object) -> object:
    """``fn``, or what it replaced if it is a retired replacement (repeatedly)."""
    while (entry := _retired.get(id(fn))) is not None and entry[0] is fn:
        fn = entry[1]
    return fn


class Patches:
    """Attribute replacements on modules; ``restore`` undoes them (newest first)."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object, object]] = []

    def set(self, owner: object, name: str, replacement: object) -> None:
        self._saved.append((owner, name, getattr(owner, name), replacement))
        setattr(owner, name, replacement)

    def install(
        self,
        wrappers: Mapping[str, CommWrapper],
        *,
        in_c10d: Iterable[str] = (),
        batch: Callable[[Callable], Callable] | None = None,
        coalescing: Callable[[Callable], Callable] | None = None,
    ) -> None:
        """Put ``wrappers[name]`` at ``torch.distributed.<name>`` (and at
        ``distributed_c10d.<name>`` for the names in ``in_c10d``); ``batch(current)`` at
        ``torch.distributed.batch_isend_irecv``; ``coalescing(current)`` at each megatron-core
        ``_coalescing_manager`` alias; and each megatron-core function alias at the wrapper of the
        function it currently names. ``batch`` and ``coalescing`` are factories given what is there
        now, so that they stack. Imports the megatron-core modules it patches."""
        c10d_names = set(in_c10d)
        for name, wrapper in wrappers.items():
            self.set(dist, name, wrapper)
            if name in c10d_names:
                self.set(distributed_c10d, name, wrapper)
        if batch is not None:
            self.set(dist, "batch_isend_irecv", batch(dist.batch_isend_irecv))
        by_original = {wrapper.original: wrapper for wrapper in wrappers.values()}
        for module_name in MCORE_ALIAS_MODULES:
            module = importlib.import_module(module_name)
            for alias in MCORE_FUNCTION_ALIASES:
                current = getattr(module, alias, None)
                if current is not None and current in by_original:
                    self.set(module, alias, by_original[current])
            if coalescing is not None and hasattr(module, MCORE_COALESCING_ALIAS):
                current = getattr(module, MCORE_COALESCING_ALIAS)
                self.set(module, MCORE_COALESCING_ALIAS, coalescing(current))

    def restore(self) -> None:
        """Put every original back, newest first. An attribute that another patcher has replaced
        since is left alone and our replacement retired (see the module docstring)."""
        for owner, name, original, replacement in reversed(self._saved):
            if getattr(owner, name) is replacement:
                setattr(owner, name, _live(original))
            else:
                _retired[id(replacement)] = (replacement, original)
                logger.debug("%s.%s was patched again on top of ours; ours retired", owner, name)
        self._saved.clear()
