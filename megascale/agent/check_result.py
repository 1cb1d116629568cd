"""One self-check's result (``CheckResult``) and how a check builds it: ``judged`` (a figure held
to a threshold) and ``skipped``. The checks of every kind (host, network, GPU) return these."""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"


@dataclass
class CheckResult:
    """One check's outcome. ``value op threshold`` must hold for ``pass`` (e.g. 5.2 >= 1.0)."""

    name: str
    status: str
    """``pass``, ``fail`` or ``skipped``."""
    value: float | str | None = None
    """the measured figure (None when skipped or when the measurement itself failed)."""
    unit: str = ""
    threshold: float | str | None = None
    """what ``value`` was held to (None: not enforced)."""
    op: str = ""
    """``>=``, ``<=``, ``==``, or a word for non-numeric checks."""
    detail: str = ""
    """why it failed or was skipped; how it was measured."""
    duration_s: float = 0.0


def judged(
    name: str,
    value: float,
    unit: str,
    op: str,
    threshold: float | None,
    detail: str = "",
    duration_s: float = 0.0,
) -> CheckResult:
    """A numeric check's result: ``pass`` iff ``value op threshold`` (or no threshold)."""
    ok = {
        ">=": lambda: value >= threshold,
        "<=": lambda: value <= threshold,
        "==": lambda: value == threshold,
    }[op]
    passed = threshold is None or ok()
    if not passed:
        detail = f"{value:.4g} {unit} is not {op} {threshold:g}" + (f"; {detail}" if detail else "")
    return CheckResult(
        name, PASS if passed else FAIL, value, unit, threshold, op, detail, duration_s
    )


def skipped(name: str, reason: str, duration_s: float = 0.0) -> CheckResult:
    """A check that did not run, and why."""
    return CheckResult(name, SKIPPED, detail=reason, duration_s=duration_s)
