"""A child process's life tied to its parent's (Linux ``prctl(PR_SET_PDEATHSIG)``).

The launcher's etcd, agents and controllers, and an agent's zygote and workers, use it so that a
parent killed outright (SIGKILL, a test's timeout) leaves no process behind. The signal follows the
*thread* that forked the child, and survives ``exec`` and ``setsid``. Elsewhere it is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies. With ``parent`` (the pid
    the parent should have), send it now if the parent has died already, before the call."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def die_with_parent_preexec(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """``die_with_parent`` as a ``subprocess.Popen`` ``preexec_fn``, with this process as the
    parent. ``prctl`` is looked up now, in the parent: the forked child only makes the call."""
    _prctl()
    parent = os.getpid()
    return functools.partial(die_with_parent, sig, parent)
