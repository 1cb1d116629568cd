"""The timeline's vocabulary: segment names and categories, megatron-core's timer names mapped to
them, and the rules that turn communication records into ``comm.dp``/``comm.pp``/``comm.tp``/
``comm.other`` segments (``classify_comm``, ``comm_segments``).

Pure functions over names and tuples: the per-rank timeline (``megascale.probes.timers``) calls them
on its writer thread, and the merged trace (``megascale.tools.timeline``) orders its threads by
``CATEGORIES``.
"""

from __future__ import annotations

import bisect

# name -> (category, timed on the device). Categories become threads in the merged trace.
SEGMENTS: dict[str, tuple[str, bool]] = {
    "megascale::train::step": ("step", False),
    "megascale::data::load": ("data", False),
    "megascale::data::wait": ("data", False),
    "megascale::optim::step": ("optimizer", True),
    "megascale::checkpoint::save": ("checkpoint", False),
}

# megatron-core timer name -> (span name, category). Anything else: megascale::mcore::<name>.
MEGATRON_SEGMENTS: dict[str, tuple[str, str]] = {
    "forward-backward": ("megascale::schedule::forward_backward", "step"),
    "forward-compute": ("megascale::model::forward", "compute"),
    "backward-compute": ("megascale::model::backward", "compute"),
    "all-grads-sync": ("megascale::dp::grad_sync", "comm.dp"),
    "params-all-gather": ("megascale::dp::param_gather", "comm.dp"),
    "non-tensor-parallel-grads-all-reduce": ("megascale::tp::norm_grads_all_reduce", "comm.tp"),
    "embedding-grads-all-reduce": ("megascale::pp::embedding_grads_all_reduce", "comm.pp"),
}
for _p2p in (
    "forward-recv",
    "backward-recv",
    "forward-send",
    "backward-send",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "forward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
):
    MEGATRON_SEGMENTS[_p2p] = (f"megascale::pp::{_p2p.replace('-', '_')}", "comm.pp")

CATEGORIES = (
    "step",
    "data",
    "compute",
    "optimizer",
    "comm.dp",
    "comm.pp",
    "comm.tp",
    "comm.other",
    "checkpoint",
    "other",
)
"""Every category a span can have, in the order the merged trace shows them as threads."""

_P2P_KINDS = frozenset({"isend", "irecv", "send", "recv"})


def megatron_segment(name: str) -> tuple[str, str]:
    """(span name, category) for a megatron-core timer name."""
    if name in MEGATRON_SEGMENTS:
        return MEGATRON_SEGMENTS[name]
    if name.startswith("optimizer-"):
        return f"megascale::optim::{name.removeprefix('optimizer-').replace('-', '_')}", "optimizer"
    return f"megascale::mcore::{name.replace('-', '_')}", "other"


def classify_comm(kind: str, coalesced: bool, enclosing_category: str | None) -> str:
    """Which parallelism a communication call belongs to: "dp", "pp", "tp" or "other".

    The comm hooks do not see process groups, so the rule reads the call and where it was issued:
    inside a segment of megatron-core that names its group (DP grad sync, a pipeline send/receive,
    the SP LayerNorm grads) -> that group; a p2p call -> pp; ops issued together through
    megatron-core's coalescing manager (DP buckets) -> dp; a collective issued from inside a
    forward or backward computation -> tp (the TP/SP all-gathers, reduce-scatters, all-reduces);
    anything else (the loss and grad-norm all-reduces, checkpoint gathers) -> other.
    """
    if enclosing_category is not None and enclosing_category.startswith("comm."):
        return enclosing_category.removeprefix("comm.")
    if kind in _P2P_KINDS:
        return "pp"
    if coalesced:
        return "dp"
    if enclosing_category == "compute":
        return "tp"
    return "other"


def comm_segments(
    records: list[tuple], spans: list[tuple], host: bool = True
) -> tuple[list[list], list[list]]:
    """Comm records (``megascale.probes.comm_timer``: ``(index, kind, coalesced, issued,
    wait_start, wait_end[, device_start, device_done])``, by index) -> (segments, in-flight
    intervals of asynchronous calls). A record that carries device times becomes the segment from
    its start to its completion where it ran (NCCL-like mode) and is in flight from its issue until
    it completed or its wait returned (NCCL-like mode; CUDA, from events before and after it on
    its stream); otherwise the segment is the interval its caller was blocked, unless ``host`` is
    false (CUDA: a host interval says nothing of when the GPU ran the op; the record is dropped).

    ``spans`` carry the range of comm record indices issued inside each; the innermost one that
    holds a record decides its group (``classify_comm``). A coalesced block (one DP bucket) is
    named after the ops inside it.
    """
    indices = [record[0] for record in records]
    enclosing: list[tuple[int, str] | None] = [None] * len(records)
    for _name, cat, _s, _e, first, last in spans:
        if cat != "compute" and not cat.startswith("comm."):
            continue  # no other category changes a call's group (classify_comm)
        width = last - first
        for i in range(bisect.bisect_left(indices, first), bisect.bisect_left(indices, last)):
            current = enclosing[i]
            if current is None or width < current[0]:
                enclosing[i] = (width, cat)
    blocked, inflight = [], []
    for record, where in zip(records, enclosing, strict=True):
        _index, kind, coalesced, issued, wait_start, wait_end = record[:6]
        group = classify_comm(kind, coalesced, where[1] if where is not None else None)
        name, cat = f"megascale::{group}::{kind}", f"comm.{group}"
        if len(record) > 6:  # seen where it ran: from its start there to its completion
            start, done = record[6], record[7]
            blocked.append([name, cat, start, done - start])
            inflight.append([name, cat, issued, max(done, wait_end or 0) - issued])
        elif host and wait_start is not None and wait_end is not None:
            blocked.append([name, cat, wait_start, wait_end - wait_start])
            if wait_start > issued:  # asynchronous: in flight from issue until the wait returned
                inflight.append([name, cat, issued, wait_end - issued])
    return blocked, inflight
