"""The stall analysis on hand-written NCCL-like records (device states), expected ranks by hand.

Layout used: TP {0,1},{2,3}; DP {0,2},{1,3} (dp, pp, tp) = (rank // 2 ... ) as in a TP2 x DP2 job.
"""

from __future__ import annotations

from megascale.probes.flight.culprits import analyse_stall, stall_culprits, stall_suspects
from megascale.probes.flight.format import (
    DeviceState,
    GroupHistory,
    GroupInfo,
    OpKind,
    OpRecord,
    OpState,
    RankState,
)

TP = {0: 0x10, 1: 0x10, 2: 0x11, 3: 0x11}
DP = {0: 0x20, 2: 0x20, 1: 0x21, 3: 0x21}
GROUPS = {
    0x10: GroupInfo(0x10, "TP", (0, 1), 0),
    0x11: GroupInfo(0x11, "TP", (2, 3), 0),
    0x20: GroupInfo(0x20, "DP", (0, 2), 0),
    0x21: GroupInfo(0x21, "DP", (1, 3), 0),
}


def op(gid, seq, device, kind=OpKind.ALL_REDUCE, nbytes=64, index=0):
    return OpRecord(
        index, seq, gid, kind, OpState.LEFT, 0, nbytes, 1, 1.0, 1.0, 1.0, None, 1, device
    )


def state(rank, seqs, ops, process="S"):
    """``seqs``: gid -> last seq entered; ``ops``: its records."""
    groups = {g: GroupInfo(g, i.label, i.ranks, seqs.get(g, 0)) for g, i in GROUPS.items()}
    return RankState(
        rank=rank,
        world_size=4,
        pid=100 + rank,
        step=3,
        section="step",
        last=ops[-1] if ops else None,
        blocked=tuple(o for o in ops if o.blocking),
        groups={g: groups[g] for g in (TP[rank], DP[rank])},
        process=process,
        unstarted=frozenset((o.group, o.seq) for o in ops if o.device == DeviceState.QUEUED),
    )


S, Q, C = DeviceState.STARTED, DeviceState.QUEUED, DeviceState.COMPLETED


def test_hang_comm_names_the_rank_whose_ops_never_started():
    # 3's link died: it enqueued TP #5 and DP #5 but started neither. 2 waits in TP #5 (started);
    # 0 waits in DP #5 for 2 (2's DP op is queued behind its stuck TP op); 1 in DP #5 for 3.
    states = {
        0: state(0, {0x10: 5, 0x20: 5}, [op(0x10, 5, C), op(0x20, 5, S)]),
        1: state(1, {0x10: 5, 0x21: 5}, [op(0x10, 5, C), op(0x21, 5, S)]),
        2: state(2, {0x11: 5, 0x20: 5}, [op(0x11, 5, S), op(0x20, 5, Q)]),
        3: state(3, {0x11: 5, 0x21: 5}, [op(0x11, 5, Q), op(0x21, 5, Q)]),
    }
    culprits = stall_culprits(states)
    assert [(c.rank, c.reason) for c in culprits] == [(3, "not-started")]
    assert culprits[0].group.startswith("TP") or culprits[0].group.startswith("DP")
    assert stall_suspects(states) == [3]


def test_rank_that_never_enqueued_is_named():
    # 1 is computing: it never enqueued TP #4 that 0 started.
    states = {
        0: state(0, {0x10: 4, 0x20: 3}, [op(0x10, 4, S)]),
        1: state(1, {0x10: 3, 0x21: 3}, [op(0x10, 3, C)]),
        2: state(2, {0x11: 4, 0x20: 3}, [op(0x11, 4, C)]),
        3: state(3, {0x11: 4, 0x21: 3}, [op(0x11, 4, C)]),
    }
    culprits = stall_culprits(states)
    assert [(c.rank, c.reason, c.seq, c.op) for c in culprits] == [
        (1, "not-entered", 4, "all_reduce")
    ]


def test_mismatched_size_at_the_same_sequence_number_names_the_odd_rank():
    # DP {1,3} #7: rank 3 all-reduces 128 bytes, rank 1 64 (as every other rank does); all
    # started, nobody is behind. In a pair the tie goes to the lower rank's op: 3 is named.
    states = {
        1: state(1, {0x21: 7}, [op(0x21, 7, S, nbytes=64)]),
        3: state(3, {0x21: 7}, [op(0x21, 7, S, nbytes=128)]),
        0: state(0, {0x20: 7}, [op(0x20, 7, S, nbytes=64)]),
        2: state(2, {0x20: 7}, [op(0x20, 7, S, nbytes=64)]),
    }
    culprits = stall_culprits(states)
    assert [(c.rank, c.reason, c.op) for c in culprits] == [
        (3, "mismatch", "all_reduce of 128 bytes")
    ]


def test_a_mismatch_in_a_pair_is_told_by_the_other_replica_and_hides_what_waits_behind_it():
    # TP {0,1} #4: rank 0 broadcasts, rank 1 all-reduces, as TP {2,3} does at #4 (caught in it):
    # the lower rank is the odd one. 2's DP #4 started (another thread), 0's is queued behind its
    # hung TP op: 0 is named for the mismatch, not as a dead link, and nobody else.
    states = {
        0: state(0, {0x10: 4, 0x20: 4}, [op(0x10, 4, S, kind=OpKind.BROADCAST), op(0x20, 4, Q)]),
        1: state(1, {0x10: 4, 0x21: 3}, [op(0x10, 4, S)]),
        2: state(2, {0x11: 4, 0x20: 4}, [op(0x20, 4, S), op(0x11, 4, S)]),
        3: state(3, {0x11: 4, 0x21: 3}, [op(0x11, 4, S)]),
    }
    culprits = stall_culprits(states)
    assert [(c.rank, c.reason, c.group, c.op, c.seq) for c in culprits] == [
        (0, "mismatch", "TP [0, 1]", "broadcast of 64 bytes", 4)
    ]


def test_mismatched_op_kind_in_a_larger_group_names_the_minority():
    groups = {0x30: GroupInfo(0x30, "DP", (0, 1, 2), 9)}

    def st(rank, kind):
        o = op(0x30, 9, S, kind=kind)
        return RankState(rank, 3, 1, 2, "step", o, (o,), groups, process="S")

    states = {0: st(0, OpKind.ALL_REDUCE), 1: st(1, OpKind.BROADCAST), 2: st(2, OpKind.ALL_REDUCE)}
    assert [(c.rank, c.reason, c.op) for c in stall_culprits(states)] == [
        (1, "mismatch", "broadcast of 64 bytes")
    ]


def test_completed_ops_are_no_stall():
    states = {r: state(r, {TP[r]: 2, DP[r]: 2}, [op(TP[r], 2, C), op(DP[r], 2, C)]) for r in TP}
    assert stall_culprits(states) == []


def test_state_round_trips_through_json_with_device_fields():
    s = state(3, {0x11: 5, 0x21: 5}, [op(0x11, 5, Q), op(0x21, 5, S)])
    back = RankState.from_json(s.to_json())
    assert back.unstarted == s.unstarted and back.blocked == s.blocked


def _with_history(st, history):
    """``history``: gid -> (seq, op, bytes, step) of consecutive collectives."""
    return RankState(**{**st.__dict__, "history": {g: _h(*ops) for g, ops in history.items()}})


def _h(*ops):
    shapes = tuple(dict.fromkeys((k, n) for _, k, n, _ in ops))
    steps = tuple(dict.fromkeys((t, min(q for q, _, _, u in ops if u == t)) for *_, t in ops))
    chars = "".join(str(shapes.index((k, n))) for _, k, n, _ in ops)
    return GroupHistory(ops[0][0], shapes, chars, steps)


def test_a_pair_mismatch_is_told_by_a_replica_that_already_passed_that_collective():
    # TP {0,1} #4: rank 1 all-reduces 128 bytes, rank 0 64. TP {2,3} passed #4 long ago (both now
    # wait in DP #4): their history says 64, and #1-#3 agree with {0,1}'s, so it is a replica.
    # Rank 1 is named, never rank 0 (the lower rank, which a coin toss would have named).
    tp01 = [(q, "all_reduce", 64, 1) for q in (1, 2, 3)]
    tp23 = [(q, "all_reduce", 64, 1) for q in (1, 2, 3, 4)]
    states = {
        0: _with_history(state(0, {0x10: 4, 0x20: 3}, [op(0x10, 4, S)]), {0x10: tp01}),
        1: _with_history(state(1, {0x10: 4, 0x21: 3}, [op(0x10, 4, S, nbytes=128)]), {0x10: tp01}),
        2: _with_history(state(2, {0x11: 4, 0x20: 4}, [op(0x20, 4, S)]), {0x11: tp23}),
        3: _with_history(state(3, {0x11: 4, 0x21: 4}, [op(0x21, 4, S)]), {0x11: tp23}),
    }
    assert [(c.rank, c.reason, c.op) for c in stall_culprits(states)] == [
        (1, "mismatch", "all_reduce of 128 bytes")
    ]


def test_a_group_of_the_same_label_that_ran_another_program_is_no_replica():
    # TP {2,3} recorded 32-byte collectives before #4 (another pipeline stage): no evidence; with
    # no previous step in the histories either, nobody is named and the stall says why.
    states = {
        0: _with_history(
            state(0, {0x10: 4}, [op(0x10, 4, S)]), {0x10: ((3, "all_reduce", 64, 1),)}
        ),
        1: _with_history(
            state(1, {0x10: 4}, [op(0x10, 4, S, nbytes=128)]),
            {0x10: ((3, "all_reduce", 64, 1),)},
        ),
        2: _with_history(
            state(2, {0x11: 4}, [op(0x11, 4, C)]),
            {0x11: ((3, "all_reduce", 32, 1), (4, "all_reduce", 128, 1))},
        ),
    }
    analysis = analyse_stall(states)
    assert analysis.culprits == []
    [undecided] = analysis.undecided
    assert (undecided.ranks, undecided.reason, undecided.seq) == ((0, 1), "mismatch", 4)
    assert undecided.describe().startswith("cannot tell which rank: #4 on TP [0, 1] differs")


def test_a_pair_with_no_replica_is_told_by_its_previous_step():
    # EMBEDDING {0,3} (PP4: no replica): one all-reduce per step, #1 in step 1, #2 in step 2; at
    # #3 (step 3) rank 0 issued 128 bytes, rank 3 64 as in every step before: rank 0 is named.
    def hist(n):
        return {
            0x40: _h((1, "all_reduce", 64, 1), (2, "all_reduce", 64, 2), (3, "all_reduce", n, 3))
        }

    groups = {0x40: GroupInfo(0x40, "EMBEDDING", (0, 3), 3)}

    def st(rank, nbytes):
        o = OpRecord(0, 3, 0x40, OpKind.ALL_REDUCE, OpState.LEFT, 0, nbytes, 3, 1.0, 1.0, 1.0,
                     None, 1, S)  # fmt: skip
        return RankState(rank, 4, 1, 3, "step", o, (o,), groups, process="S", history=hist(nbytes))

    states = {0: st(0, 128), 3: st(3, 64)}
    assert [(c.rank, c.reason) for c in stall_culprits(states)] == [(0, "mismatch")]
    alone = {r: RankState(**{**s.__dict__, "history": {}}) for r, s in states.items()}
    assert stall_culprits(alone) == [] and analyse_stall(alone).undecided  # no evidence left


def test_history_travels_in_the_heartbeat_json():
    st = _with_history(state(0, {0x10: 4}, [op(0x10, 4, S)]), {0x10: ((4, "all_reduce", 64, 2),)})
    assert RankState.from_json(st.to_json()).history == st.history
