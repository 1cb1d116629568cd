"""``data.blend`` and ``data.split`` as megatron-core takes them; pure, no torch (config validation
imports it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from megascale.data.indexed import DataError

_BLEND_FORMS = '["0.7", "PREFIX_A", "0.3", "PREFIX_B"], ["PREFIX_A", "PREFIX_B"] or a table'


def parse_blend(blend: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``data.blend`` -> (prefixes, weights or None); DataError naming the entry that is wrong.

    Accepted: weight/prefix pairs (``["0.7", "A", "0.3", "B"]``; weights positive numbers, not
    necessarily summing to 1), or prefixes only (``["A", "B"]``: weighted by their sizes). A TOML
    table ``{A = 0.7, B = 0.3}`` reaches here as the pairs (``megascale.config``).
    """
    items = [str(x) for x in blend]
    if not items:
        raise DataError(f"data.blend = []: empty; accepted: {_BLEND_FORMS}")
    numbers = [_as_number(x) for x in items]
    if all(n is None for n in numbers):
        return items, None
    if len(items) % 2:
        raise DataError(
            f"data.blend = {items}: {len(items)} entries, expected weight/prefix pairs; "
            f"accepted: {_BLEND_FORMS}"
        )
    weights: list[float] = []
    for i in range(0, len(items), 2):
        w = numbers[i]
        if w is None or not math.isfinite(w) or w <= 0:
            raise DataError(
                f"data.blend[{i}] = {items[i]!r}: not a positive number (the weight of "
                f"{items[i + 1]!r}); accepted: {_BLEND_FORMS}"
            )
        weights.append(w)
    return items[1::2], weights


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_split(split: str) -> list[float]:
    """``data.split`` ("98,1,1") -> the three shares normalised; DataError when it does not parse."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    values = [_as_number(p) for p in parts]
    if (
        len(parts) > 3
        or any(v is None or not math.isfinite(v) or v < 0 for v in values)
        or not sum(v or 0 for v in values) > 0
    ):
        raise DataError(
            f"data.split = {split!r}: expected up to three non-negative numbers "
            'train,valid,test with a positive sum, e.g. "98,1,1"'
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def check_data_config(data, eval_interval: int) -> list[str]:
    """Problems of ``data.*`` that need no file (config validation): each names the field."""
    problems: list[str] = []
    if data.path is not None and data.blend is not None:
        problems.append(
            f"data.path = {data.path!r} and data.blend: set one (a single dataset is "
            f"data.path; a blend lists every prefix, that one included)"
        )
    for check, value in ((parse_blend, data.blend), (parse_split, data.split)):
        if value is None:
            continue
        try:
            check(value)
        except DataError as e:
            problems.append(str(e))
    if eval_interval > 0 and not problems and parse_split(data.split)[1] == 0:
        problems.append(
            f"train.eval_interval = {eval_interval}: needs a valid share in data.split = "
            f'{data.split!r} (e.g. "98,1,1")'
        )
    return problems
