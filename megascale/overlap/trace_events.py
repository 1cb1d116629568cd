"""A step's ``CommEvent``s and exposure, read from the flight recorder's records.

The flight recorder (``megascale.probes.flight.recorder``) stands outside the network model of
``megascale.overlap.trace``, so its record of a call has the caller's view of it with the modelled
cost included: when it was issued, and when the caller started and stopped waiting on it. The
network model adds what only it knows, in a side table keyed by record index (``Ledger``): each
call's link class, bytes, modelled cost, p2p peer and the start of its modelled transfer, the ops
inside a coalescing block, the batch a p2p op belongs to, the intervals its links were busy and
the waits that are no call's (draining a group's queue before a block). ``step_events`` joins the
two at ``CommTrace.reset()`` and counts exposure from the wait and busy intervals.

Only records with a side-table entry become events (the calls the network model saw); an entry
whose record is not the op it priced (a call the recorder did not record) is dropped with it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from megascale.overlap.pp_exposure import covered
from megascale.probes.flight.hooks import _KIND_OF

logger = logging.getLogger(__name__)

RECEIVES = ("irecv", "recv")


@dataclass
class CommEvent:
    kind: str
    issued: float
    wait_start: float | None = None
    wait_end: float | None = None
    coalesced: bool = False
    link: str = "other"
    nbytes: int = 0
    cost_s: float = 0.0
    peer: int | None = None
    """p2p only: the other end's global rank (a send's destination, a receive's source)."""
    transfer_start: float | None = None
    """When the modelled transfer began: after the call was posted and its group's earlier calls
    ended (``time.monotonic``, system-wide on Linux, so it compares across ranks); None where the
    trace does not run the cost itself (the NCCL-like mode's threads do)."""
    exposed_s: float = 0.0
    """The part of the caller's waits on this call that its link's modelled transfers explain."""


@dataclass
class Mark:
    name: str
    time: float


@dataclass
class Priced:
    """One call as the network model priced it: the side table's entry for its record."""

    kind: str
    link: str
    nbytes: int
    cost_s: float
    issued: float
    peer: int | None = None
    transfer_start: float | None = None
    inner: list[Priced] = field(default_factory=list)
    """A coalescing block's ops (the block itself is one record)."""
    batch: Priced | None = None
    """A ``batch_isend_irecv`` op (one record each): the batch, priced as one operation."""

    def record_kind(self) -> str:
        """The record's kind for this call, as the flight recorder names it."""
        name = self.inner[0].kind if self.inner else self.kind
        kind = _KIND_OF.get(name)
        return kind.name.lower() if kind is not None else name


@dataclass
class Ledger:
    """What the network model adds to one step's records (``CommTrace`` keeps one per step)."""

    side: dict[int, Priced] = field(default_factory=dict)
    drains: list[tuple[float, float, str]] = field(default_factory=list)
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    comm_by_link: dict[str, float] = field(default_factory=lambda: defaultdict(float))


@dataclass
class StepComm:
    """A step's events and exposure (``step_events``)."""

    events: list[CommEvent] = field(default_factory=list)
    exposed_s: float = 0.0
    exposed_by_link: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def _event(p: Priced, issued: float, coalesced: bool = False) -> CommEvent:
    return CommEvent(
        p.kind, issued, coalesced=coalesced, link=p.link, nbytes=p.nbytes, cost_s=p.cost_s,
        peer=p.peer, transfer_start=p.transfer_start,
    )  # fmt: skip


def step_events(
    records: list[tuple], ledger: Ledger, message_cost: Callable[[int, str], float]
) -> StepComm:
    """Join a step's timeline records (``FlightComm``'s ``(index, kind, coalesced, issued_ns,
    wait_start_ns, wait_end_ns, ...)``) with the network model's ``ledger``.

    A coalescing block gives its ops (``coalesced``, their own issue times, no wait) and then the
    block (kind ``coalesced``); a batch gives its ops (``coalesced``, the times of their records)
    and then the batch (kind ``batch_isend_irecv``, from its first wait to its last). Exposure:
    every wait counts in ``exposed_s``; ``exposed_by_link`` counts the part the link explains —
    its overlap with the link's busy intervals, or for a receive (priced at its sender) at most
    the message's cost (``message_cost(nbytes, link)``); the rest is a peer arriving late.
    """
    out = StepComm()
    batches: dict[int, CommEvent] = {}
    for index, kind, _coalesced, issued_ns, start_ns, end_ns, *_device in records:
        p = ledger.side.get(index)
        if p is None:
            continue
        if p.record_kind() != kind:
            logger.debug("comm trace: record %d is a %s, priced as %s", index, kind, p.kind)
            continue
        issued = issued_ns / 1e9
        start, end = (None, None) if end_ns is None else (start_ns / 1e9, end_ns / 1e9)
        target = event = _event(p, issued, coalesced=p.batch is not None)
        out.events.extend(_event(op, op.issued, coalesced=True) for op in p.inner)
        out.events.append(event)
        if p.batch is not None:
            target = batches.get(id(p.batch))
            if target is None:
                target = batches[id(p.batch)] = _event(p.batch, p.batch.issued)
                out.events.append(target)  # the batch after its first op
            event.wait_start, event.wait_end = start, end
        if start is None:
            continue
        if target.wait_start is None or start < target.wait_start:
            target.wait_start = start
        target.wait_end = end if target.wait_end is None else max(target.wait_end, end)
        explained = _explained(ledger, p, start, end, message_cost)
        out.exposed_s += end - start
        out.exposed_by_link[p.link] += explained
        target.exposed_s += explained
    for start, end, link in ledger.drains:
        out.exposed_s += end - start
        out.exposed_by_link[link] += covered((start, end), ledger.busy[link])
    return out


def _explained(ledger: Ledger, p: Priced, start: float, end: float, message_cost) -> float:
    if p.kind in RECEIVES:
        return min(end - start, message_cost(p.nbytes, p.link))
    return covered((start, end), ledger.busy[p.link])
