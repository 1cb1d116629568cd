"""The stall analysis over the ranks' flight files: which ranks hold up a stall, and why.

``stall_culprits`` builds a wait-for graph from each rank's ``RankState`` (``flight.format``'s
reader, or its JSON as the agents' heartbeats carry it) and names the ranks it ends in;
``stall_suspects`` is the set of their ranks. No torch: the controller runs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megascale.probes.flight.format import P2P, OpKind, OpRecord, RankState


@dataclass(frozen=True)
class Culprit:
    """A rank named by the stall analysis, why, and where (group label, op, sequence number)."""

    rank: int
    reason: str
    """"not-entered": never enqueued the op its peers wait in; "not-started": enqueued it, but
    its device never started it (its communication is stuck); "stopped": the process is stopped;
    "mismatch": at the same sequence number it issued another op or size than its peers; "waiting":
    in a cycle of ranks waiting for one another."""
    group: str = ""
    op: str = ""
    seq: int = 0

    def describe(self) -> str:
        where = f" in {self.op} #{self.seq} on {self.group}" if self.op else ""
        return f"rank {self.rank} {self.reason.replace('-', ' ')}{where}"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "reason": self.reason, "group": self.group, "op": self.op,
                "seq": self.seq}  # fmt: skip


@dataclass(frozen=True)
class Undecided:
    """A stall the flight records cannot pin on one rank, with the evidence: a collective whose
    members disagree with no majority and no replica group to tell which record is the odd one
    (two ranks, two shapes). Its ranks are candidates, not culprits: nobody is blamed for it."""

    ranks: tuple[int, ...]
    reason: str
    """"mismatch": the members' records of one collective differ and nothing says whose is odd."""
    group: str
    seq: int
    ops: tuple[str, ...]
    """What each of ``ranks`` issued, in the same order."""

    def describe(self) -> str:
        issued = ", ".join(
            f"rank {r} issued {op}" for r, op in zip(self.ranks, self.ops, strict=True)
        )
        return (
            f"cannot tell which rank: #{self.seq} on {self.group} differs ({issued}), with no "
            f"majority and no replica group that recorded it"
        )

    def to_json(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "reason": self.reason, "group": self.group,
                "seq": self.seq, "ops": list(self.ops), "text": self.describe()}  # fmt: skip


@dataclass(frozen=True)
class StallAnalysis:
    culprits: list[Culprit]
    undecided: list[Undecided]


def stall_suspects(states: Mapping[int, RankState]) -> list[int]:
    """The ranks that hold up a stall (``stall_culprits``' ranks)."""
    return sorted({c.rank for c in stall_culprits(states)})


def stall_culprits(states: Mapping[int, RankState]) -> list[Culprit]:
    """``analyse_stall``'s culprits."""
    return analyse_stall(states).culprits


def analyse_stall(states: Mapping[int, RankState]) -> StallAnalysis:
    """The ranks that hold up a stall, each with the reason and the op it holds up, and what
    cannot be pinned on one rank (``Undecided``).

    A wait-for graph over what the ranks' flight files say: a rank waits in op (group g, seq s)
    when it is blocked there (host view) or its device started it and it has not completed
    (NCCL-like records). It waits for each member of g that has not started (g, s): never entered
    it (its last sequence number on g is below s; p2p: the peer on that pair's channel), entered
    it but its device never started it, or whose state is missing (file unreadable). Following
    the waits from every waiting rank ends in ranks that wait for no one: computing, stopped before
    the collective, gone, or with their communication stuck. Those are the suspects, with ranks
    waiting for each other in a cycle (a mismatched order). A rank waiting where every member has
    started is no suspect (that collective itself hangs: nobody is behind), unless the members'
    records of it differ in op or size: then the ranks in the minority are named ("mismatch"),
    and they alone (with stopped ranks): every other wait is behind that collective, which never
    completes. In a tie (a pair) the replica groups decide: groups of the same label whose
    members recorded the same collectives as this group's members before that sequence number
    (data-parallel replicas issue the same calls; the same label in another pipeline stage does
    not); the op most of them recorded at that number wins. With no replica, the op the group
    issued at the same place in the previous step wins (the k-th collective of a step on a group
    is the same call every step), where the histories hold that step. With neither, the stall is
    ``Undecided`` and nobody is named: an innocent rank is never named by a coin toss.
    Ranks whose process is stopped (SIGSTOP, /proc state "T", known only on the same host) are
    suspects wherever they stopped. [] when no rank waits and none is stopped.

    This follows waits across groups: with TP {0,1},{2,3} and DP {0,2},{1,3}, rank 3 stopped
    before a TP all-reduce that rank 2 waits in, ranks 0 and 1 waiting in DP ops for 2 and 3,
    the suspect is 3 alone (2 is blocked too, but waits for 3).
    """
    edges: dict[object, set[object]] = {}
    ops: dict[tuple[int, int], dict[int, OpRecord]] = {}
    for rank, state in states.items():
        for op in state.blocked:
            info = state.groups.get(op.group)
            if info is None:
                continue  # group table was full: membership unknown
            node = ("op", op.group, op.seq)
            ops.setdefault((op.group, op.seq), {})[rank] = op
            edges.setdefault(rank, set()).add(node)
            if node in edges:
                continue
            edges[node] = {
                m
                for m in info.ranks
                if m not in states
                or (m != rank and not states[m].started(op.group, op.seq))
                or (m == rank and (op.group, op.seq) in state.unstarted)
            }
    culprits: dict[int, Culprit] = {}
    undecided: list[Undecided] = []
    for (gid, seq), by_rank in ops.items():
        odd = _mismatched(states, gid, seq, by_rank)
        if isinstance(odd, Undecided):
            undecided.append(odd)
        else:
            culprits.update({c.rank: c for c in odd})
    # A mismatch hangs its group for good: every rank waiting or queued behind it is downstream.
    dead = {} if culprits or undecided else _dead_links(states)
    culprits.update(dead)
    for comp in [] if dead or culprits or undecided else _sink_components(edges):
        for node in comp:
            if isinstance(node, int) and node not in culprits:
                culprits[node] = _why(states, node, comp, edges)
    for rank, state in states.items():
        if state.stopped and rank not in culprits:
            culprits[rank] = Culprit(rank, "stopped")
    return StallAnalysis(sorted(culprits.values(), key=lambda c: c.rank), undecided)


def _dead_links(states: Mapping[int, RankState]) -> dict[int, Culprit]:
    """Ranks whose device has not started an op that a group peer's device already started:
    their communication stopped (a dead NIC, a stuck kernel) while the host went on issuing
    (NCCL, or the NCCL-like mode: a host waiting for a result is not in a ``wait()``, so its
    ``blocked`` may be empty). Its peers then wait on ops queued behind the dead ones, in every
    group it is in, so the wait graph alone would not single it out. A rank waiting in an op
    its device started may only be queued behind that op: when some candidates wait in no
    started op, only they are named."""
    out: dict[int, Culprit] = {}
    for rank, state in states.items():
        if state.stopped:
            continue
        for gid, seq in sorted(state.unstarted, key=lambda g: (g[1], g[0])):
            info = state.groups.get(gid)
            peers = [m for m in (info.ranks if info else ()) if m != rank and m in states]
            if any(states[m].started(gid, seq) for m in peers):
                kind = next(
                    (op.kind.name.lower() for st in states.values() for op in st.blocked
                     if (op.group, op.seq) == (gid, seq)), "",
                )  # fmt: skip
                out[rank] = Culprit(rank, "not-started", _label(states, gid), kind, seq)
                break
    idle = {
        r: c
        for r, c in out.items()
        if all((o.group, o.seq) in states[r].unstarted for o in states[r].blocked)
    }
    return idle or out


def _mismatched(
    states: Mapping[int, RankState], gid: int, seq: int, by_rank: Mapping[int, OpRecord]
) -> list[Culprit] | Undecided:
    """The ranks whose record of (gid, seq) differs in op or size from the most common one; in a
    tie, from the one the replica groups recorded (see ``stall_culprits``)."""
    if len(by_rank) < 2:
        return []
    shapes: dict[tuple[object, int], list[int]] = {}
    for rank, op in by_rank.items():
        shapes.setdefault(_shape(op), []).append(rank)
    if len(shapes) < 2:
        return []
    label = _label(states, gid)
    ranked = sorted(shapes.items(), key=lambda kv: -len(kv[1]))
    if len(ranked[0][1]) == len(ranked[1][1]):
        votes = _replica_votes(states, gid, seq)
        if not votes:
            votes = _previous_step_votes(states, gid, seq, next(iter(by_rank.values())).step)
        ranked = sorted(shapes.items(), key=lambda kv: -votes[kv[0]])
        if votes[ranked[0][0]] == votes[ranked[1][0]]:
            members = sorted(by_rank)
            return Undecided(tuple(members), "mismatch", label, seq,
                             tuple(_issued(by_rank[r]) for r in members))  # fmt: skip
    common = ranked[0][1]
    return [
        Culprit(rank, "mismatch", label, _issued(op), seq)
        for rank, op in by_rank.items()
        if rank not in common
    ]


def _issued(op: OpRecord) -> str:
    return f"{op.kind.name.lower()} of {op.nbytes} bytes"


def _replica_votes(states: Mapping[int, RankState], gid: int, seq: int) -> Counter:
    """(op, bytes) that each replica of group ``gid`` recorded as collective ``seq``: groups of
    the same label whose members' records before ``seq`` agree with ``gid``'s members' where
    both are known (none different)."""
    label = _label(states, gid).split(" [")[0]
    mine = _program(states, gid)
    votes: Counter = Counter()
    for other in {g for st in states.values() for g in st.groups} - {gid}:
        if _label(states, other).split(" [")[0] != label:
            continue
        theirs = _program(states, other)
        before = [q for q in mine if q < seq and q in theirs]
        if any(theirs[q] != mine[q] for q in before) or seq not in theirs:
            continue
        votes[theirs[seq]] += 1
    return votes


def _previous_step_votes(states: Mapping[int, RankState], gid: int, seq: int, step: int) -> Counter:
    """(op, bytes) that group ``gid`` issued at the same place in the step before ``step``: the
    k-th collective of a step on a group is the same call every step. Empty unless the members'
    histories hold that whole previous step and the start of this one."""
    steps: dict[int, int] = {}
    for st in states.values():
        history = st.history.get(gid)
        for q in range(history.first, history.first + len(history.ops)) if history else ():
            steps.setdefault(q, history.step_of(q))
    first = min((q for q, t in steps.items() if t == step), default=None)
    if first is None or steps.get(first - 1) != step - 1:
        return Counter()
    before = min(q for q, t in steps.items() if t == step - 1)
    if before > 1 and before - 1 not in steps:
        return Counter()  # the previous step's start is out of the histories
    then = before + (seq - first)
    if then >= first:
        return Counter()  # this step issued more on the group than the previous one
    shape = _program(states, gid).get(then)
    return Counter({shape: 1}) if shape is not None else Counter()


def _program(states: Mapping[int, RankState], gid: int) -> dict[int, tuple[object, int]]:
    """(op, bytes) by sequence number on group ``gid``, as its members' histories and blocked
    ops record them (the first member's record where they differ)."""
    out: dict[int, tuple[object, int]] = {}
    for rank in sorted(states):
        for op in states[rank].blocked:
            if op.group == gid:
                out.setdefault(op.seq, _shape(op))
        history = states[rank].history.get(gid)
        for q in range(history.first, history.first + len(history.ops)) if history else ():
            if (shape := history.at(q)) is not None:
                out.setdefault(q, (OpKind[shape[0].upper()], shape[1]))
    return out


def _shape(op: OpRecord) -> tuple[object, int]:
    # The two ends of a p2p transfer record a send and a receive at the same number.
    return ("p2p", 0) if op.flags & P2P else (op.kind, op.nbytes)


def _why(states: Mapping[int, RankState], rank: int, comp: list[object], edges: Mapping) -> Culprit:
    """Why ``rank``, in sink component ``comp``, is a suspect: the op a waiter waits for it in."""
    for node, behind in edges.items():
        if isinstance(node, tuple) and rank in behind:
            _, gid, seq = node
            state = states.get(rank)
            reason = "stopped" if state is not None and state.stopped else (
                "not-started" if state is not None and state.seq(gid) >= seq else "not-entered"
            )  # fmt: skip
            waiter = next(
                (op for st in states.values() for op in st.blocked
                 if (op.group, op.seq) == (gid, seq)), None,
            )  # fmt: skip
            kind = waiter.kind.name.lower() if waiter is not None else ""
            return Culprit(rank, reason, _label(states, gid), kind, seq)
    return Culprit(rank, "waiting" if len(comp) > 1 else "not-entered")


def _label(states: Mapping[int, RankState], gid: int) -> str:
    for state in states.values():
        info = state.groups.get(gid)
        if info is not None:
            return f"{info.label or 'group'} {list(info.ranks)}"
    return f"{gid:016x}"


def _sink_components(edges: Mapping[object, set[object]]) -> list[list[object]]:
    """Strongly connected components with no edge leaving them (Tarjan, iterative)."""
    index: dict[object, int] = {}
    low: dict[object, int] = {}
    comp_of: dict[object, int] = {}
    components: list[list[object]] = []
    stack: list[object] = []
    on_stack: set[object] = set()
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp_of[member] = len(components)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return [
        comp
        for i, comp in enumerate(components)
        if all(comp_of[child] == i for node in comp for child in edges.get(node, ()))
    ]
