"""What megascale runs with: the supported releases of megatron-core, and the check that refuses
any other one before a rank starts.

megatron-core is the 3D-parallel engine; megascale reaches into it (layer specs, the distributed
optimizer's state, the CPU backend's redirections in ``parallel/cpu_backend.py``), so every
supported series was run and its CUDA call sites recorded (``parallel/mcore_cuda_sites.py``). A
release outside ``MEGATRON_CORE_RANGE`` is refused at start with one line naming the range, never
discovered as a traceback from inside megatron-core.

Versions are read from the installed distributions' metadata (``importlib.metadata``): no
``import megatron.core`` (~8 s) and no CUDA probe in a process that forks ranks.
"""

from __future__ import annotations

from importlib import metadata

MEGATRON_CORE_MIN = (0, 16, 1)
"""The oldest megatron-core release supported (the last series for Python 3.11 is 0.16)."""
MEGATRON_CORE_BELOW = (0, 20)
"""The first megatron-core series not yet supported."""
MEGATRON_CORE_RANGE = ">=0.16.1,<0.20"
"""``MEGATRON_CORE_MIN`` and ``MEGATRON_CORE_BELOW`` as a pip specifier (pyproject's pin)."""


class UnsupportedVersion(RuntimeError):
    """An installed package's release is outside the range megascale supports."""


def release(version: str) -> tuple[int, ...]:
    """``"0.19.2"`` -> ``(0, 19, 2)``; ``"0.16.1rc0"``, ``"0.17.0.dev3+abc"`` -> ``(0, 16, 1)``,
    ``(0, 17, 0)``: the numeric release, pre/dev/local parts dropped."""
    parts = []
    for piece in version.split("+", 1)[0].split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(piece):
            break
    return tuple(parts)


def series(version: str) -> str:
    """``"0.19.2"`` -> ``"0.19"``: the series a release belongs to."""
    return ".".join(str(p) for p in release(version)[:2])


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def megatron_core_version() -> str | None:
    """The installed megatron-core release (None when it is not installed)."""
    return installed("megatron-core") or installed("megatron_core")


def megatron_core_problem(version: str | None) -> str | None:
    """Why ``version`` of megatron-core cannot run megascale (one line), or None when it can."""
    if version is None:
        return (
            "megatron-core is not installed; megascale needs megatron-core"
            f"{MEGATRON_CORE_RANGE} (pip install 'megatron-core{MEGATRON_CORE_RANGE}')"
        )
    numbers = release(version)
    if not numbers or numbers < MEGATRON_CORE_MIN or numbers[:2] >= MEGATRON_CORE_BELOW:
        return (
            f"megatron-core {version} is installed; megascale supports megatron-core"
            f"{MEGATRON_CORE_RANGE} (pip install 'megatron-core{MEGATRON_CORE_RANGE}')"
        )
    return None


def check_megatron_core(version: str | None = None) -> str:
    """The installed megatron-core version when megascale supports it; else
    ``UnsupportedVersion`` with one line naming the installed release and the supported range."""
    version = megatron_core_version() if version is None else version
    problem = megatron_core_problem(version)
    if problem:
        raise UnsupportedVersion(problem)
    assert version is not None
    return version
