"""Stall analysis: the ranks' flight-recorder states (``FlightRecord``), which ranks a stalled
collective waits for (``stall_suspects``), a stall caused by mismatched collectives
(``mismatch_signature``), and the per-section stall timeouts learned from observed durations
(``SectionTimeouts``). Pure values and functions, no I/O.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from megascale.parallel.layout import Layout


@dataclass(frozen=True)
class FlightRecord:
    """A rank's flight-recorder state: the last collective it entered and whether it left it."""

    seq: int
    """Sequence number of that collective within ``group`` (every member counts the same calls)."""
    kind: str
    """e.g. "all_reduce", "reduce_scatter", "send"."""
    left: bool
    """Whether the rank has left (completed) it."""
    group: tuple[int, ...] | None = None
    """Global ranks of the process group; None when one sequence spans all ranks."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FlightRecord:
        group = d.get("group")
        return cls(
            int(d["seq"]),
            str(d.get("kind", "")),
            bool(d.get("left", False)),
            tuple(int(r) for r in group) if group is not None else None,
        )


def stall_suspects(records: Mapping[int, FlightRecord], *, ranks: Iterable[int] = ()) -> list[int]:
    """The ranks that never entered the collective the others wait in.

    The awaited collective is the (group, seq) in which most ranks wait (have entered, not left),
    ties going to the higher seq. Its participants are ``group`` (or, for group None, every rank in
    ``records`` and ``ranks``); a participant is a suspect if its last record is an older seq,
    another group, or missing (its recorder could not be read). [] when no rank waits.
    """
    waiting = Counter((rec.group, rec.seq) for rec in records.values() if not rec.left)
    if not waiting:
        return []
    (group, seq), _ = max(waiting.items(), key=lambda item: (item[1], item[0][1]))
    participants = set(group) if group is not None else set(records) | set(ranks)
    return sorted(
        r
        for r in participants
        if (rec := records.get(r)) is None or rec.group != group or rec.seq < seq
    )


class SectionTimeouts:
    """Per-section stall timeouts learned from observed durations (STYLE.md #9): ``factor`` x the
    longest of the last ``window`` observations, at least ``floor``; the section's default until
    ``min_samples`` observations exist."""

    def __init__(
        self,
        defaults: Mapping[str, float],
        floor: float,
        factor: float,
        min_samples: int,
        window: int = 32,
    ) -> None:
        self.defaults, self.floor, self.factor = dict(defaults), floor, factor
        self.min_samples, self.window = min_samples, window
        self.samples: dict[str, deque[float]] = {s: deque(maxlen=window) for s in defaults}

    def observe(self, section: str, seconds: float) -> None:
        self.samples[section].append(seconds)

    def timeout(self, section: str) -> float:
        samples = self.samples[section]
        if len(samples) < self.min_samples:
            return self.defaults[section]
        return max(self.floor, self.factor * max(samples))


def mismatch_signature(
    culprits: Iterable[Mapping[str, Any]], undecided: Iterable[Mapping[str, Any]] = ()
) -> str | None:
    """The signature of a stall whose culprits (a ``stall`` event's ``culprits``) are all
    mismatched collectives, or that names nobody but found mismatches it could not pin on one
    rank (its ``undecided``): what each odd rank issued, where; None for any other stall."""
    culprits, undecided = list(culprits), list(undecided)
    if any(c.get("reason") != "mismatch" for c in culprits + undecided):
        return None
    issued = [(c.get("rank"), c.get("op"), c.get("group")) for c in culprits]
    issued += [
        (rank, op, u.get("group"))
        for u in undecided
        for rank, op in zip(u.get("ranks", ()), u.get("ops", ()), strict=False)
    ]
    if not issued:
        return None
    odd = "; ".join(sorted(f"rank {rank} issued {op} on {group}" for rank, op, group in issued))
    return f"mismatched collective: {odd} while its group's other members issued another"


def flight_suspects(flight: Mapping[int, Any], world_size: int) -> list[int]:
    """``stall_suspects`` over the ranks' last flight records as heartbeats carry them (a
    malformed one counts as missing: its rank is a suspect if it belongs to the awaited
    collective)."""
    records = {}
    for rank, record in flight.items():
        try:
            records[rank] = FlightRecord.from_json(record)
        except (KeyError, TypeError, ValueError):
            continue
    return stall_suspects(records, ranks=range(world_size))


def place_culprit(
    culprit: Mapping[str, Any], layout: Layout, node_of: Callable[[int], str | None]
) -> dict[str, Any]:
    """A stall culprit (``Culprit.to_json`` and its text) with its node and (dp, pp, tp)
    coordinates: ``text`` becomes "rank 5 (dp=0, pp=1, tp=1) on node-1 not started in ...".
    """
    rank, out = culprit.get("rank"), dict(culprit)
    if not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        return out
    node, where = node_of(rank), layout.describe(rank)
    out.update(node=node, where=where)
    text = str(culprit.get("text", ""))
    on = f"{where} on {node}" if node is not None else where
    if text.startswith(f"rank {rank} "):
        out["text"] = on + text[len(f"rank {rank}") :]
    return out
