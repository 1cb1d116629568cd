"""Pipeline p2p exposure from both ends of each message, not from the receiver alone.

A receive's wait mixes two things: the message still being on the wire (communication) and the
sender still computing the tensor (a pipeline bubble, a slower stage). ``CommTrace``'s per-rank
count can only bound the first from the receiver's side (``min(wait, message cost)``), which counts
bubble waits as communication. With every rank's p2p events in hand the split is exact under the model:
the message's modelled transfer occupies ``[transfer_start, transfer_start + cost]`` (the send's
post, after its group's earlier calls, plus its cost), and communication is exposed only where some
rank — the receiver waiting for it, or the sender waiting on its handle — was blocked inside that
window. Times are ``time.monotonic`` readings, CLOCK_MONOTONIC on Linux: one clock for every
process of the machine, so windows of different ranks compare.

Sends and receives pair in order per (source, destination): p2p messages between two ranks in one
direction are matched in issue order (gloo and NCCL alike). Batched p2p (``batch_isend_irecv``) is
one event per batch with no per-message waits and is left to the receiver-side bound.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

SENDS = ("isend", "send")
RECEIVES = ("irecv", "recv")


def covered(window: tuple[float, float], waits: Sequence[tuple[float, float]]) -> float:
    """Length of ``window`` (start, end) covered by the union of the intervals ``waits``."""
    lo, hi = window
    spans = sorted((max(s, lo), min(e, hi)) for s, e in waits if e > lo and s < hi)
    total, reach = 0.0, lo
    for s, e in spans:
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def _wait(event: Mapping) -> list[tuple[float, float]]:
    start, end = event.get("wait_start"), event.get("wait_end")
    return [(start, end)] if start is not None and end is not None else []


def paired_exposure(events_by_rank: Sequence[Sequence[Mapping]]) -> list[float]:
    """Per rank, the exposed seconds of the p2p messages it sent in one step.

    ``events_by_rank[r]``: rank ``r``'s events of the step (``CommEvent`` fields as dicts; only
    uncoalesced sends and receives with a ``peer`` are read). A message's exposure is the part of
    its modelled transfer window during which its receiver or its sender waited on it; it is at
    most the message's cost, and a wait for a sender still computing counts nothing.

    Raises ``ValueError`` when the sends and receives of a (source, destination) pair do not
    match one to one in count and bytes (a trace that lost events, or batched p2p).
    """
    sends: dict[tuple[int, int], list[Mapping]] = defaultdict(list)
    receives: dict[tuple[int, int], list[Mapping]] = defaultdict(list)
    for rank, events in enumerate(events_by_rank):
        for e in events:
            if e.get("coalesced") or e.get("peer") is None:
                continue
            if e["kind"] in SENDS:
                sends[(rank, e["peer"])].append(e)
            elif e["kind"] in RECEIVES:
                receives[(e["peer"], rank)].append(e)
    exposed = [0.0] * len(events_by_rank)
    for pair in sends.keys() | receives.keys():
        out, into = sends.get(pair, []), receives.get(pair, [])
        if len(out) != len(into) or any(
            s["nbytes"] != r["nbytes"] for s, r in zip(out, into, strict=True)
        ):
            raise ValueError(
                f"p2p {pair[0]} -> {pair[1]}: {len(out)} sends do not pair with "
                f"{len(into)} receives (count or bytes differ)"
            )
        for send, recv in zip(out, into, strict=True):
            start = send.get("transfer_start")
            start = send["issued"] if start is None else start
            window = (start, start + send["cost_s"])
            exposed[pair[0]] += covered(window, _wait(send) + _wait(recv))
    return exposed


def receiver_side_exposure(events: Sequence[Mapping]) -> float:
    """What ``CommTrace`` counted for this rank's paired p2p events (the part the paired measure
    replaces)."""
    return sum(
        e.get("exposed_s", 0.0)
        for e in events
        if not e.get("coalesced") and e.get("peer") is not None and e["kind"] in SENDS + RECEIVES
    )
