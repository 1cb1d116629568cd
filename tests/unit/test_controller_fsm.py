"""The controller's pure state machine, driven by a fake clock: every fault kind leads to the right
actions and names the right node and rank; spares, evictions, max restarts, illegal transitions."""

from __future__ import annotations

import json

import pytest

from megascale.controller.fsm import (
    BLOCKED_PAUSE_WAIT_S,
    TRANSITIONS,
    ControllerFSM,
    ControllerPolicy,
    Event,
    Evict,
    IllegalTransition,
    RecordEvent,
    SectionTimeouts,
    SendCommand,
    StartGeneration,
    State,
)
from megascale.controller.stall_analysis import FlightRecord, stall_suspects
from megascale.etcd.keys import JobKeys, is_current, make_command
from megascale.messages import Command, Heartbeat, MessageError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self, advance: float = 0.0) -> float:
        self.t += advance
        return self.t


def commands(actions, kind=None):
    return [a for a in actions if isinstance(a, SendCommand) and kind in (None, a.kind)]


def records(actions, kind):
    return [a for a in actions if isinstance(a, RecordEvent) and a.kind == kind]


def ack_all(fsm, actions, clock, *, ok=True, skip=()):
    """Ack every command in ``actions`` (except to ``skip`` nodes); returns the actions produced."""
    out = []
    for c in commands(actions):
        if c.node not in skip:
            out += fsm.on_ack(c.node, c.id, ok=ok, now=clock())
    return out


def policy(**kw):
    base = dict(
        nodes=2,
        nproc_per_node=2,
        tp=2,
        max_restarts=3,
        heartbeat_timeout_s=5.0,
        init_timeout_s=30.0,
        step_timeout_s=20.0,
        stall_floor_s=2.0,
        stall_safety_factor=4.0,
        stall_min_samples=3,
        start_timeout_s=10.0,
        stop_timeout_s=5.0,
        selfcheck_timeout_s=8.0,
    )
    base.update(kw)
    return ControllerPolicy(**base)


def running(nodes=("n0", "n1", "n2"), **kw):
    """An FSM in RUNNING generation 1 on n0, n1 with the rest spares."""
    clock = Clock()
    fsm = ControllerFSM(policy(**kw), now=clock())
    for n in nodes:
        fsm.on_node_registered(n, now=clock())
    start = fsm.on_start(now=clock())
    ack_all(fsm, start, clock)
    assert fsm.state is State.RUNNING
    return fsm, clock


def beat(fsm, clock, step, advance=1.0, section="step", flight=None, nodes=None):
    now = clock(advance)
    for n in nodes or fsm.order:
        payload = Heartbeat(node=n, generation=fsm.generation, step=step, section=section)
        if flight:
            payload.flight = {str(r): rec for r, rec in flight.items() if fsm.node_of(r) == n}
        fsm.on_heartbeat(n, payload, now)
    return now


def test_start_assigns_k_consecutive_ranks_per_node_and_keeps_spares():
    clock = Clock()
    fsm = ControllerFSM(policy(), now=clock())
    actions = fsm.on_start(now=clock())
    assert fsm.state is State.WAITING_FOR_NODES and records(actions, "waiting_for_nodes")
    fsm.on_node_registered("n0", now=clock())
    actions = fsm.on_node_registered("n1", now=clock())
    assert fsm.state is State.STARTING
    assert actions[1] == StartGeneration(1, {"n0": (0, 1), "n1": (2, 3)})
    starts = commands(actions, "start")
    assert [c.node for c in starts] == ["n0", "n1"]
    assert starts[1].rank_assignment == {
        "ranks": [2, 3],
        "world_size": 4,
        "master_node": "n0",
    }  # no whole-assignment "nodes": that would make a generation start O(N^2) bytes
    assert starts[0].message("job-a").job == "job-a"
    fsm.on_node_registered("n2", now=clock())
    assert fsm.spares == ["n2"]
    done = ack_all(fsm, actions, clock)
    assert fsm.state is State.RUNNING and records(done, "generation_running")


def test_clean_exit_of_every_rank_finishes_without_a_fault():
    fsm, clock = running()
    beat(fsm, clock, step=10)
    out = []
    for rank in range(3):
        out += fsm.on_worker_exit(fsm.node_of(rank), rank, 0, now=clock(0.1))
    assert fsm.state is State.RUNNING and not records(out, "fault")
    out = fsm.on_worker_exit("n1", 3, 0, now=clock(0.1))
    assert fsm.state is State.FINISHED and records(out, "finished")
    assert not fsm.faults
    # the stragglers of a finished job change nothing
    assert fsm.on_worker_exit("n1", 3, 1, now=clock()) == []


def test_worker_crash_stops_diagnoses_and_restarts_on_the_same_nodes():
    fsm, clock = running()
    out = fsm.on_worker_exit("n1", 3, -9, now=clock())
    assert fsm.state is State.STOPPING
    (fault,) = records(out, "fault")
    assert (fault.node, fault.rank, fault.detail["fault"]) == ("n1", 3, "worker_exit")
    assert fault.detail["where"] == "rank 3 (dp=1, pp=0, tp=1)"
    assert fault.detail["exit_code"] == -9
    stops = commands(out, "stop")
    assert [c.node for c in stops] == ["n0", "n1"] and {c.generation for c in stops} == {1}
    assert {c.pause_wait_s for c in stops} == {None}  # a dead worker: its peers fail and pause
    out = ack_all(fsm, out, clock)
    assert fsm.state is State.DIAGNOSING
    checks = commands(out, "selfcheck")
    assert sorted(c.node for c in checks) == ["n0", "n1", "n2"]  # spares are checked too
    out = ack_all(fsm, out, clock)
    assert fsm.state is State.STARTING and fsm.generation == 2 and fsm.restarts == 1
    assert StartGeneration(2, {"n0": (0, 1), "n1": (2, 3)}) in out
    assert {c.generation for c in commands(out, "start")} == {2}


def test_failed_selfcheck_evicts_and_a_spare_takes_the_slot():
    fsm, clock = running()
    out = ack_all(fsm, fsm.on_worker_exit("n0", 1, 1, now=clock()), clock)
    out2 = []
    for c in commands(out, "selfcheck"):
        ok = c.node != "n0"
        out2 += fsm.on_ack(c.node, c.id, ok=ok, detail="" if ok else "gpu 1: ECC", now=clock())
    assert Evict("n0", "self-check failed: gpu 1: ECC") in out2
    assert fsm.blocklist == {"n0": "self-check failed: gpu 1: ECC"}
    start = next(a for a in out2 if isinstance(a, StartGeneration))
    assert start.assignment == {"n2": (0, 1), "n1": (2, 3)}  # n2 took n0's slot: same ranks
    assert records(out2, "generation_start")[0].detail["replaced"] == {"n0": "n2"}
    # an evicted node that comes back is refused
    out3 = fsm.on_node_registered("n0", now=clock())
    assert records(out3, "node_rejected") and "n0" not in fsm.registered


def test_error_keyword_is_a_fault_naming_the_node():
    fsm, clock = running()
    out = fsm.on_error_keyword("n0", "NCCL error: unhandled system error", rank=0, now=clock())
    (fault,) = records(out, "fault")
    assert fault.detail["fault"] == "error_keyword" and fault.node == "n0" and fault.rank == 0
    assert "NCCL error" in fault.detail["text"]
    assert fsm.state is State.STOPPING


def test_node_lost_while_running_uses_the_spare():
    fsm, clock = running()
    out = fsm.on_node_lost("n1", now=clock())
    (fault,) = records(out, "fault")
    assert fault.detail["fault"] == "node_lost" and fault.node == "n1"
    assert [c.node for c in commands(out, "stop")] == ["n0"]  # nobody left to stop on n1
    # n0's ranks may be blocked in a collective with n1's: no long wait for them to pause
    [stop] = commands(out, "stop")
    assert stop.pause_wait_s == BLOCKED_PAUSE_WAIT_S
    sent = Command.decode(json.loads(json.dumps(stop.message("job").encode())))
    assert sent.pause_wait_s == BLOCKED_PAUSE_WAIT_S
    out = ack_all(fsm, out, clock)
    assert sorted(c.node for c in commands(out, "selfcheck")) == ["n0", "n2"]
    out = ack_all(fsm, out, clock)
    assert next(a for a in out if isinstance(a, StartGeneration)).assignment == {
        "n0": (0, 1),
        "n2": (2, 3),
    }


def test_silent_node_is_a_heartbeat_timeout():
    fsm, clock = running()
    beat(fsm, clock, step=1)
    for _ in range(6):  # n1 keeps beating, n0 is silent
        out = fsm.on_tick(beat(fsm, clock, step=1, nodes=["n1"]))
    (fault,) = records(out, "fault")
    assert fault.detail["fault"] == "heartbeat_timeout" and fault.node == "n0"
    assert {c.pause_wait_s for c in commands(out, "stop")} == {BLOCKED_PAUSE_WAIT_S}


def test_stall_timeout_is_learned_and_the_rank_that_never_entered_is_named():
    fsm, clock = running(nodes=("n0", "n1"))
    assert fsm.section() == "init" and fsm.stall_timeout() == 30.0
    for step in range(1, 6):  # a step every second
        fsm.on_tick(beat(fsm, clock, step=step))
    assert fsm.section() == "step"
    assert fsm.stall_timeout() == pytest.approx(4.0)  # 4 x 1 s, above the 2 s floor
    # ranks 0, 1, 3 wait in all_reduce #10; rank 2 never entered it
    flight = {
        0: {"seq": 10, "kind": "all_reduce", "left": False},
        1: {"seq": 10, "kind": "all_reduce", "left": False},
        2: {"seq": 9, "kind": "all_reduce", "left": True},
        3: {"seq": 10, "kind": "all_reduce", "left": False},
    }
    last = clock.t
    out = []
    while not out:
        out = fsm.on_tick(beat(fsm, clock, step=5, advance=0.5, flight=flight))
    assert clock.t - last == pytest.approx(4.5)  # first tick past the learned 4 s
    (fault,) = records(out, "fault")
    assert fault.detail["fault"] == "stall" and fault.node == "n1" and fault.rank == 2
    assert fault.detail["suspects"] == ["rank 2 (dp=1, pp=0, tp=0)"]
    assert fault.detail["suspect_nodes"] == ["n1"]
    assert fsm.faults[-1].suspects == (2,)
    assert fsm.state is State.STOPPING


def test_stall_without_flight_records_names_nobody_and_checks_every_node():
    fsm, clock = running()
    out = []
    while not out:  # no step reported at all: the init timeout (30 s) applies
        out = fsm.on_tick(beat(fsm, clock, step=None, advance=1.0))
    (fault,) = records(out, "fault")
    assert fault.detail["fault"] == "stall" and fault.detail["section"] == "init"
    assert fault.node is None and fault.detail["suspects"] == []
    assert fault.detail["timeout_s"] == 30.0
    assert {c.pause_wait_s for c in commands(out, "stop")} == {BLOCKED_PAUSE_WAIT_S}
    checks = commands(ack_all(fsm, out, clock), "selfcheck")
    assert sorted(c.node for c in checks) == ["n0", "n1", "n2"]


def test_checkpoint_section_has_its_own_timeout():
    fsm, clock = running(nodes=("n0", "n1"), checkpoint_timeout_s=15.0)
    for step in range(1, 6):
        fsm.on_tick(beat(fsm, clock, step=step))
    for _ in range(20):  # a 10 s checkpoint: longer than the 4 s step timeout, no fault
        assert fsm.on_tick(beat(fsm, clock, step=5, advance=0.5, section="checkpoint")) == []
    assert fsm.section() == "checkpoint" and fsm.stall_timeout() == 15.0
    assert fsm.on_tick(beat(fsm, clock, step=6, section="step")) == []
    assert list(fsm.timeouts.samples["checkpoint"]) == [pytest.approx(10.5)]


def test_checkpoint_lasts_until_the_last_node_leaves_it():
    fsm, clock = running(nodes=("n0", "n1", "n2"))
    for step in range(1, 4):
        beat(fsm, clock, step=step)
    start = beat(fsm, clock, step=3, section="checkpoint", nodes=["n0"])
    assert fsm.section() == "checkpoint" and fsm.checkpoint_since == start
    beat(fsm, clock, step=3, section="checkpoint", nodes=["n1"])
    beat(fsm, clock, step=3, section="step", nodes=["n0"])
    assert fsm.section() == "checkpoint"  # n1 still checkpoints
    beat(fsm, clock, step=3, section="init", nodes=["n0"])
    assert fsm.section() == "init"
    beat(fsm, clock, step=3, section="step", nodes=["n0"])
    end = beat(fsm, clock, step=3, section="step", nodes=["n1"])
    assert fsm.section() == "step" and fsm.checkpoint_since is None
    assert list(fsm.timeouts.samples["checkpoint"]) == [pytest.approx(end - start)]
    fsm.on_heartbeat(
        "n2", Heartbeat(node="n2", generation=fsm.generation, section="checkpoint"), clock()
    )
    assert fsm.section() == "step"  # n2 is a spare: not in the generation


def test_order_membership_follows_every_assignment_of_order():
    fsm, clock = running(nodes=("n0", "n1", "n2"))
    assert fsm.in_order("n0") and not fsm.in_order("n2") and fsm.spares == ["n2"]
    restored = ControllerFSM.restore(fsm.policy, fsm.snapshot(), clock())
    assert restored.in_order("n1") and not restored.in_order("n2")
    assert restored.snapshot() == fsm.snapshot()
    out = fsm.on_node_lost("n1", now=clock())  # stop, self-check, the spare n2 takes the slot
    ack_all(fsm, ack_all(fsm, ack_all(fsm, out, clock), clock), clock)
    assert fsm.state is State.RUNNING and fsm.order == ["n0", "n2"]
    assert fsm.in_order("n2") and not fsm.in_order("n1") and fsm.spares == []


def test_external_stall_detection_names_suspects_by_coordinates():
    fsm, clock = running(nodes=("n0", "n1"), pp=2, tp=1)
    out = fsm.on_stall_detected([3], now=clock())
    (fault,) = records(out, "fault")
    assert fault.detail["suspects"] == ["rank 3 (dp=1, pp=1, tp=0)"] and fault.node == "n1"


def test_stall_suspects():
    def rec(seq, left=False, kind="all_reduce", group=None):
        return FlightRecord(seq, kind, left, group)

    # one global sequence
    assert stall_suspects({0: rec(7), 1: rec(7), 2: rec(6, left=True), 3: rec(7)}) == [2]
    # nobody waits: not a collective hang
    assert stall_suspects({0: rec(7, left=True), 1: rec(7, left=True)}) == []
    # a rank whose recorder could not be read is a suspect too
    assert stall_suspects({0: rec(7), 1: rec(7)}, ranks=range(3)) == [2]
    # per-group sequences: rank 0 waits in DP group (0, 2) #4; rank 2, its peer there, is busy
    # in its TP group (2, 3): it never entered DP #4
    dp02, tp23 = (0, 2), (2, 3)
    assert stall_suspects({0: rec(4, group=dp02), 2: rec(9, group=tp23, left=True)}) == [2]
    waiting_in_dp = {0: rec(4, group=dp02), 3: rec(4, group=dp02), 2: rec(3, group=dp02)}
    assert stall_suspects(waiting_in_dp) == [2]


def test_section_timeouts_floor_and_default():
    t = SectionTimeouts({"step": 60.0}, floor=10.0, factor=4.0, min_samples=2)
    assert t.timeout("step") == 60.0
    t.observe("step", 0.5)
    t.observe("step", 1.0)
    assert t.timeout("step") == 10.0  # 4 x 1.0 is below the floor
    t.observe("step", 5.0)
    assert t.timeout("step") == 20.0


def test_crash_while_diagnosing():
    fsm, clock = running()
    out = ack_all(fsm, fsm.on_worker_exit("n0", 0, 134, now=clock()), clock)
    assert fsm.state is State.DIAGNOSING
    # a worker exit report arriving now is stale (workers are stopped); n1 dies mid-check
    assert fsm.on_worker_exit("n0", 1, -15, now=clock()) == []
    lost = fsm.on_node_lost("n1", now=clock())
    assert records(lost, "node_lost") and fsm.state is State.DIAGNOSING
    out2 = ack_all(fsm, out, clock, skip=("n1",))
    assert fsm.state is State.STARTING
    assert fsm.assignment == {"n0": (0, 1), "n2": (2, 3)}
    assert not [a for a in out2 if isinstance(a, Evict)]  # lost, not evicted: may come back


def test_unanswered_stop_and_selfcheck_evict_the_node():
    fsm, clock = running()
    out = fsm.on_error_keyword("n1", "CUDA error: an illegal memory access", now=clock())
    ack_all(fsm, out, clock, skip=("n1",))
    assert fsm.state is State.STOPPING
    assert fsm.on_tick(clock(4.0)) == []
    out = fsm.on_tick(clock(2.0))
    assert Evict("n1", "no stop ack in 5.0 s") in out and fsm.state is State.DIAGNOSING
    checks = commands(out, "selfcheck")
    assert sorted(c.node for c in checks) == ["n0", "n2"]
    ack_all(fsm, out, clock, skip=("n2",))
    out = fsm.on_tick(clock(9.0))
    assert Evict("n2", "no selfcheck ack in 8.0 s") in out
    assert fsm.state is State.RESTARTING and records(out, "waiting_for_nodes")
    out = fsm.on_node_registered("n3", now=clock())
    assert fsm.state is State.STARTING and fsm.assignment == {"n0": (0, 1), "n3": (2, 3)}


def test_max_restarts_exhausted_fails_the_job():
    fsm, clock = running(max_restarts=1)
    out = ack_all(fsm, fsm.on_worker_exit("n0", 0, 1, now=clock()), clock)
    ack_all(fsm, ack_all(fsm, out, clock), clock)
    assert fsm.state is State.RUNNING and fsm.generation == 2
    out = ack_all(fsm, fsm.on_worker_exit("n1", 2, 1, now=clock()), clock)
    assert fsm.state is State.FAILED
    (failed,) = records(out, "failed")
    assert "max_restarts = 1" in failed.detail["reason"]
    assert not commands(out, "selfcheck")
    assert fsm.on_tick(clock(100.0)) == []  # terminal


def test_repeat_culprit_is_evicted_even_if_its_selfcheck_passes():
    fsm, clock = running(evict_repeat_culprit=2)
    for generation in (1, 2):
        out = ack_all(fsm, fsm.on_worker_exit("n1", 2, 1, now=clock()), clock)
        out = ack_all(fsm, out, clock)  # every self-check passes
        evicted = [a for a in out if isinstance(a, Evict)]
        if generation == 1:
            assert not evicted and fsm.assignment == {"n0": (0, 1), "n1": (2, 3)}
            ack_all(fsm, out, clock)
        else:
            assert evicted == [Evict("n1", "named culprit in 2 faults")]
            assert fsm.assignment == {"n0": (0, 1), "n2": (2, 3)}


def test_waiting_for_nodes_times_out():
    clock = Clock()
    fsm = ControllerFSM(policy(node_wait_timeout_s=60.0), now=clock())
    fsm.on_start(now=clock())
    fsm.on_node_registered("n0", now=clock())
    assert fsm.on_tick(clock(59.0)) == []
    out = fsm.on_tick(clock(2.0))
    assert (
        fsm.state is State.FAILED and "fewer than 2" in records(out, "failed")[0].detail["reason"]
    )


def test_start_timeout_names_the_node_that_did_not_ack():
    clock = Clock()
    fsm = ControllerFSM(policy(), now=clock())
    for n in ("n0", "n1"):
        fsm.on_node_registered(n, now=clock())
    out = fsm.on_start(now=clock())
    ack_all(fsm, out, clock, skip=("n1",))
    for _ in range(4):  # both heartbeat, but n1 never acks its start
        fsm.on_heartbeat("n0", Heartbeat(node="n0", generation=1), clock(3.0))
        fsm.on_heartbeat("n1", Heartbeat(node="n1", generation=1), clock())
        out = fsm.on_tick(clock())
    (fault,) = records(out, "fault")
    assert fault.detail["fault"] == "start_timeout" and fault.node == "n1"


def test_stale_messages_are_ignored():
    fsm, clock = running()
    beat(fsm, clock, step=3)
    assert fsm.on_ack("n0", "g0-start-999", now=clock()) == []
    fsm.on_heartbeat("n0", Heartbeat(node="n0", generation=0, step=99), clock())
    assert fsm.step == 3
    assert fsm.on_worker_exit("n0", 0, 1, generation=0, now=clock()) == []
    assert fsm.on_worker_exit("n2", 4, 1, now=clock()) == []  # a spare runs no ranks
    assert fsm.state is State.RUNNING


def test_illegal_transitions_raise_with_a_clear_message():
    fsm, clock = running()
    with pytest.raises(IllegalTransition, match="'all_stopped' is not allowed in state 'running'"):
        fsm.on_all_stopped(now=clock())
    with pytest.raises(IllegalTransition, match="'start' is not allowed in state 'running'"):
        fsm.on_start(now=clock())
    with pytest.raises(IllegalTransition, match="selfcheck_result"):
        fsm.on_selfcheck_result("n0", True, now=clock())
    fresh = ControllerFSM(policy())
    with pytest.raises(IllegalTransition, match="generation_started.*'init'"):
        fresh.on_generation_started(1)
    with pytest.raises(IllegalTransition, match="training_finished"):
        fresh.on_training_finished()


def test_transition_table_covers_every_state_and_observation():
    for state in State:
        for event in (Event.HEARTBEAT, Event.TICK, Event.ACK, Event.NODE_LOST):
            assert state in TRANSITIONS[(state, event)]  # observations may always be ignored
    assert all(isinstance(t, State) for targets in TRANSITIONS.values() for t in targets)


def test_snapshot_restores_a_standby_mid_recovery():
    fsm, clock = running()
    out = fsm.on_worker_exit("n1", 3, -6, now=clock())
    snap = json.loads(json.dumps(fsm.snapshot()))  # it is plain JSON
    assert snap["state"] == "stopping" and snap["fault"]["rank"] == 3
    standby = ControllerFSM.restore(fsm.policy, snap, now=clock(5.0))
    assert standby.state is State.STOPPING and standby.assignment == fsm.assignment
    out = ack_all(standby, out, clock)  # acks written before the takeover, replayed
    assert standby.state is State.DIAGNOSING
    out = ack_all(standby, out, clock)
    assert standby.generation == 2
    ids = {c.id for c in commands(out)}
    assert not ids & set(snap["awaiting"].values())  # command ids never repeat


def test_a_straggler_is_replaced_by_a_spare_and_evicted_once_stopped():
    fsm, clock = running()  # n0, n1 running, n2 spare
    out = fsm.on_straggler("n1", {"score": 1.8}, now=clock())
    [fault] = records(out, "fault")
    assert fault.node == "n1" and fault.detail["fault"] == "straggler"
    assert fsm.state is State.STOPPING and {c.node for c in commands(out, "stop")} == {"n0", "n1"}
    standby = ControllerFSM.restore(fsm.policy, fsm.snapshot(), now=clock())  # survives takeover
    out = ack_all(standby, out, clock)
    [evict] = [a for a in out if isinstance(a, Evict)]
    assert evict.node == "n1" and "1.8x" in evict.reason
    assert {c.node for c in commands(out, "selfcheck")} == {"n0", "n2"}  # not the evicted node
    out = ack_all(standby, out, clock)
    assert standby.order == ["n0", "n2"] and standby.generation == 2


def test_a_straggler_without_a_spare_is_kept_and_that_is_recorded():
    fsm, clock = running(nodes=("n0", "n1"))
    out = fsm.on_straggler("n1", {"score": 1.8}, now=clock())
    assert fsm.state is State.RUNNING and not commands(out)
    [kept] = records(out, "straggler_kept")
    assert kept.node == "n1" and kept.detail == {"reason": "no spare node", "score": 1.8}
    assert fsm.on_straggler("n9", {}, now=clock()) == []  # not in this generation: ignored


def test_a_standby_resends_exactly_the_commands_still_awaited():
    clock = Clock()
    fsm = ControllerFSM(policy(), now=clock())
    for n in ("n0", "n1", "n2"):
        fsm.on_node_registered(n, now=clock())
    start = commands(fsm.on_start(now=clock()), "start")
    fsm.on_ack(start[0].node, start[0].id, ok=True, now=clock())  # n0 acked before the takeover
    standby = ControllerFSM.restore(fsm.policy, fsm.snapshot(), now=clock(1.0))
    assert standby.pending_commands() == start[1:]  # same ids, same rank assignment
    ack_all(standby, start[1:], clock)
    assert standby.state is State.RUNNING and standby.pending_commands() == []


def test_policy_validation_names_the_field():
    with pytest.raises(ValueError, match="nproc_per_node = 0"):
        ControllerPolicy(nodes=1, nproc_per_node=0)
    with pytest.raises(ValueError, match="tp \\* pp"):
        ControllerPolicy(nodes=1, nproc_per_node=2, tp=4)


def test_commands_are_scoped_to_job_and_generation():
    keys = JobKeys("job-a")
    assert keys.command("n1") == "/megascale/job-a/commands/n1"
    assert keys.event(7) == "/megascale/job-a/events/000000000007"
    assert keys.name_of(keys.heartbeat("n1")) == "n1"
    cmd = make_command("job-a", 3, "stop", "g3-stop-1")
    assert is_current(cmd, "job-a", 3) and is_current(cmd, "job-a", 2)
    assert not is_current(cmd, "job-a", 4)  # older generation
    assert not is_current(cmd, "job-b", 3)  # another job
    with pytest.raises(MessageError, match="Command: field.s. generation, id missing"):
        Command.decode({"schema": "1.0", "job": "job-a", "kind": "stop"})  # malformed
    with pytest.raises(MessageError, match="schema = '2.0': major version 2"):
        Command.decode({**cmd.encode(), "schema": "2.0"})  # another release's controller
    with pytest.raises(ValueError, match="node = 'a/b'"):
        keys.node("a/b")
    with pytest.raises(ValueError, match="kind = 'reboot'"):
        make_command("job-a", 1, "reboot", "x")


def test_a_stall_culprit_is_placed_by_node_and_coordinates():
    # What the stall event, the report's fault list and the launcher's log line show: the rank,
    # its (dp, pp, tp), its node, the group and the op it holds up.
    fsm, clock = running(nodes=("n0", "n1"), pp=2, tp=1)
    culprit = {"rank": 3, "reason": "not-started", "group": "TP [2, 3]", "op": "all_reduce",
               "seq": 43, "text": "rank 3 not started in all_reduce #43 on TP [2, 3]"}  # fmt: skip
    out = fsm.on_stall_detected([3], now=clock(), detail={"culprits": [culprit]})
    (fault,) = records(out, "fault")
    [placed] = fault.detail["culprits"]
    assert placed["node"] == "n1" and placed["where"] == "rank 3 (dp=1, pp=1, tp=0)"
    assert (
        placed["text"]
        == "rank 3 (dp=1, pp=1, tp=0) on n1 not started in all_reduce #43 on TP [2, 3]"
    )
    assert fault.detail["suspect_nodes"] == ["n1"] and (fault.node, fault.rank) == ("n1", 3)


def test_a_stall_that_names_nobody_says_why_and_blames_no_node():
    fsm, clock = running(nodes=("n0", "n1"), pp=2, tp=1)
    undecided = {"ranks": [0, 1], "reason": "mismatch", "group": "TP [0, 1]", "seq": 4,
                 "ops": ["all_reduce of 64 bytes", "all_reduce of 128 bytes"],
                 "text": "cannot tell which rank: ..."}  # fmt: skip
    out = fsm.on_stall_detected([], now=clock(), detail={"culprits": [], "undecided": [undecided]})
    (fault,) = records(out, "fault")
    assert fault.node is None and fault.rank is None and fault.detail["suspect_nodes"] == []
    assert fault.detail["classified"] == "software: mismatched collective"
    assert fsm.culprits == {}
