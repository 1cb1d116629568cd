"""The controller's policy for a lost node with no spare (wait / shrink / fail), growing back,
the restart budget per time window and job-fatal worker exits; a fake clock, no processes."""

from __future__ import annotations

import json

import pytest
from test_controller_fsm import Clock, ack_all, commands, policy, records

from megascale import config
from megascale.config import ConfigError
from megascale.controller.elastic import RestartBudget, dp_of, shrink_nodes
from megascale.controller.fsm import (
    ControllerFSM,
    ControllerPolicy,
    Evict,
    StartGeneration,
    State,
)
from megascale.probes.fatal import EXIT_JOB_FATAL, read_fatal, write_fatal

NODES = ("n0", "n1", "n2", "n3")


def four_nodes(nodes=NODES, **kw):
    """4 nodes x 1 rank, dp 4, running generation 1 (no spare unless ``nodes`` has more)."""
    base = dict(nodes=4, nproc_per_node=1, tp=1, global_batch_size=12, micro_batch_size=1)
    clock = Clock()
    fsm = ControllerFSM(policy(**{**base, **kw}), now=clock())
    for n in nodes:
        fsm.on_node_registered(n, now=clock())
    ack_all(fsm, fsm.on_start(now=clock()), clock)
    assert fsm.state is State.RUNNING and fsm.world_size == 4
    return fsm, clock


def lose(fsm, clock, node):
    """``node`` is lost while running; every other node acks the stop and passes its self-check.
    Returns the actions of the self-check round (where the decision is taken)."""
    out = ack_all(fsm, fsm.on_node_lost(node, now=clock()), clock)
    assert fsm.state is State.DIAGNOSING
    return ack_all(fsm, out, clock)


def test_shrink_restarts_at_once_on_the_nodes_left_with_the_largest_dp():
    fsm, clock = four_nodes(node_loss_policy="shrink")
    out = lose(fsm, clock, "n2")
    assert fsm.state is State.STARTING and fsm.generation == 2
    assert fsm.order == ["n0", "n1", "n3"] and fsm.world_size == 3
    assert StartGeneration(2, {"n0": (0,), "n1": (1,), "n3": (2,)}) in out
    assert {c.rank_assignment["world_size"] for c in commands(out, "start")} == {3}
    [event] = records(out, "elastic")
    assert event.detail["decision"] == "shrink" and event.detail["lost"] == ["n2"]
    assert event.detail["dp"] == [4, 3] and event.detail["microbatches"] == [3, 4]
    assert event.detail["text"] == (
        "shrink: n2 lost, no spare; nodes 4 -> 3, dp 4 -> 3, "
        "micro-batches 3 -> 4 per rank (global batch 12 kept)"
    )
    assert not [a for a in out if isinstance(a, Evict)]
    ack_all(fsm, out, clock)
    assert fsm.state is State.RUNNING
    # the shrunk generation's ranks: 3 clean exits finish it
    for rank, node in enumerate(fsm.order):
        fsm.on_worker_exit(node, rank, 0, now=clock())
    assert fsm.state is State.FINISHED


def test_shrink_skips_sizes_that_do_not_split_the_global_batch():
    fsm, clock = four_nodes(node_loss_policy="shrink", global_batch_size=8, micro_batch_size=2)
    out = lose(fsm, clock, "n0")
    assert fsm.order == ["n1", "n2"]  # dp 3 would need 8 % (2 * 3) == 0
    assert records(out, "elastic")[0].detail["microbatches"] == [1, 2]


def test_shrink_keeps_whole_model_parallel_replicas():
    p = ControllerPolicy(nodes=4, nproc_per_node=2, tp=2, pp=2)  # a replica spans 2 nodes
    assert [shrink_nodes(h, p) for h in (1, 2, 3, 4)] == [None, 2, 2, 2]
    assert dp_of(p, 4) == 2 and dp_of(p, 3) is None
    vpp = ControllerPolicy(nodes=4, nproc_per_node=1, pp=1, vpp=1, global_batch_size=6)
    assert shrink_nodes(3, vpp) == 3 and shrink_nodes(5, vpp) == 3  # never above nodes - 1


def test_a_shrunk_job_grows_back_at_the_next_restart_once_a_node_registered():
    fsm, clock = four_nodes(node_loss_policy="shrink")
    ack_all(fsm, lose(fsm, clock, "n2"), clock)
    assert fsm.world_size == 3
    for node in ("n2", "n4"):  # the lost node comes back, and a new one registers
        assert not commands(fsm.on_node_registered(node, now=clock()))
    assert fsm.state is State.RUNNING and fsm.spares == ["n2", "n4"]  # no restart for it
    out = ack_all(fsm, fsm.on_worker_exit("n1", 1, 1, now=clock()), clock)
    out = ack_all(fsm, out, clock)
    assert fsm.order == ["n0", "n1", "n3", "n2"] and fsm.world_size == 4
    [event] = records(out, "elastic")
    assert event.detail["decision"] == "grow" and event.detail["dp"] == [3, 4]
    assert "nodes 3 -> 4" in event.detail["text"]


def test_wait_restarts_at_full_size_when_a_node_comes_back():
    fsm, clock = four_nodes(node_loss_policy="wait", node_wait_timeout_s=30.0)
    out = lose(fsm, clock, "n3")
    assert fsm.state is State.RESTARTING
    [event] = records(out, "elastic")
    assert event.detail["decision"] == "wait"
    assert event.detail["text"] == (
        "wait: n3 lost, no spare (3 of 4 nodes healthy); waiting up to 30 s for a replacement "
        "node to register"
    )
    assert fsm.on_tick(clock(20.0)) == []
    out = fsm.on_node_registered("n3", now=clock())  # the repaired node registers again
    assert fsm.state is State.STARTING and fsm.world_size == 4
    assert not records(out, "elastic")  # same size: nothing to say


def test_wait_fails_after_the_timeout_with_the_policy_as_reason():
    fsm, clock = four_nodes(node_loss_policy="wait", node_wait_timeout_s=30.0)
    lose(fsm, clock, "n3")
    assert fsm.on_tick(clock(29.0)) == []
    out = fsm.on_tick(clock(2.0))
    assert fsm.state is State.FAILED
    assert records(out, "failed")[0].detail["reason"] == (
        "fault_tolerance.policy = wait: no replacement node registered within "
        "node_wait_timeout_s = 30 s (3 of 4 nodes healthy)"
    )


def test_fail_policy_fails_the_job_at_once_and_evicts_nobody():
    fsm, clock = four_nodes(node_loss_policy="fail")
    out = lose(fsm, clock, "n1")
    assert fsm.state is State.FAILED and not commands(out, "start")
    assert records(out, "elastic")[0].detail["decision"] == "fail"
    assert records(out, "failed")[0].detail["reason"] == (
        "fault_tolerance.policy = fail: n1 lost, no spare (3 of 4 nodes healthy)"
    )
    assert not [a for a in out if isinstance(a, Evict)]


def test_a_spare_is_used_before_any_policy():
    fsm, clock = four_nodes((*NODES, "n4"), node_loss_policy="fail")
    out = lose(fsm, clock, "n1")
    assert fsm.state is State.STARTING and fsm.order == ["n0", "n4", "n2", "n3"]
    assert not records(out, "elastic")


def crash_and_recover(fsm, clock):
    out = ack_all(fsm, fsm.on_worker_exit("n0", 0, 1, now=clock()), clock)
    if fsm.state is State.DIAGNOSING:
        ack_all(fsm, ack_all(fsm, out, clock), clock)
    return out


def test_restart_budget_counts_restarts_within_the_window_only():
    fsm, clock = four_nodes(max_restarts=2, restart_window_s=100.0, evict_repeat_culprit=9)
    crash_and_recover(fsm, clock)
    crash_and_recover(fsm, clock)
    assert fsm.state is State.RUNNING and fsm.generation == 3
    clock(101.0)  # both restarts leave the window
    crash_and_recover(fsm, clock)
    crash_and_recover(fsm, clock)
    assert fsm.state is State.RUNNING and fsm.generation == 5  # 4 restarts in all
    out = crash_and_recover(fsm, clock)  # a third within 100 s
    assert fsm.state is State.FAILED
    assert records(out, "failed")[0].detail["reason"] == (
        "max_restarts = 2 within restart_window_s = 100 s exhausted"
    )


def test_restart_budget_survives_a_controller_takeover():
    fsm, clock = four_nodes(max_restarts=1, restart_window_s=100.0)
    crash_and_recover(fsm, clock)
    snap = json.loads(json.dumps(fsm.snapshot()))
    standby = ControllerFSM.restore(fsm.policy, snap, now=clock(50.0))
    out = crash_and_recover(standby, clock)
    assert standby.state is State.FAILED and records(out, "failed")
    budget = RestartBudget(1, None)  # None: the whole run, the old lifetime-wide meaning
    budget.record(0.0)
    assert not budget.allows(1e9)


def test_job_fatal_exit_fails_the_job_with_its_reason_and_evicts_nobody():
    fsm, clock = four_nodes((*NODES, "n4"))
    reason = "data.path = '/nope': /nope.bin does not exist"
    out = fsm.on_worker_exit("n2", 2, EXIT_JOB_FATAL, now=clock(), fatal=reason)
    assert fsm.state is State.STOPPING
    assert records(out, "fault")[0].detail["fault"] == "job_fatal"
    assert fsm.on_worker_exit("n1", 1, EXIT_JOB_FATAL, now=clock(), fatal=reason) == []
    out = ack_all(fsm, out, clock, skip=("n3",))  # n3 never answers the stop
    assert fsm.state is State.STOPPING
    out += fsm.on_tick(clock(10.0))
    assert fsm.state is State.FAILED
    [failed] = records(out, "failed")
    assert failed.detail["reason"] == f"job-fatal error on rank 2: {reason}"
    assert (failed.node, failed.rank) == ("n2", 2)
    assert not [a for a in out if isinstance(a, Evict)] and not commands(out, "selfcheck")
    assert fsm.blocklist == {} and fsm.generation == 1


def test_fatal_record_is_read_back_only_for_the_process_that_wrote_it(tmp_path):
    import os

    write_fatal(tmp_path, 3, "checkpoint step 40 cannot be loaded at dp=3")
    assert read_fatal(tmp_path, 3, os.getpid()) == "checkpoint step 40 cannot be loaded at dp=3"
    assert read_fatal(tmp_path, 3, os.getpid() + 1) is None  # an earlier worker's record
    assert read_fatal(tmp_path, 4, os.getpid()) is None


def test_policy_and_config_refuse_bad_fault_tolerance_values():
    with pytest.raises(ValueError, match="node_loss_policy = 'grow': must be one of wait"):
        ControllerPolicy(nodes=1, nproc_per_node=1, node_loss_policy="grow")
    with pytest.raises(ValueError, match="restart_window_s = 0: must be > 0"):
        ControllerPolicy(nodes=1, nproc_per_node=1, restart_window_s=0)
    bad = ["policy=elastic", "max_restarts=-1", "evict_repeat_culprit=0"]
    cfg = config.load(None, [f"fault_tolerance.{b}" for b in bad])
    with pytest.raises(ConfigError) as e:
        config.validate(cfg, 1, "gloo")
    assert "fault_tolerance.policy = 'elastic': must be one of wait, shrink, fail" in str(e.value)
    assert "fault_tolerance.max_restarts = -1: must be an integer >= 0" in str(e.value)
    assert "fault_tolerance.evict_repeat_culprit = 0: must be an integer >= 1" in str(e.value)
    ok = config.validate(config.load(None, ["fault_tolerance.policy=shrink"]), 1, "gloo")
    assert ok.fault_tolerance.policy == "shrink" and ok.fault_tolerance.max_restarts == 10


def test_launch_flags_win_over_the_config_and_bad_ones_are_refused_in_one_line():
    from megascale.cli import build_parser
    from megascale.launcher import cluster

    parser = build_parser()
    argv = [
        "launch",
        "--set",
        "fault_tolerance.policy=fail",
        "--set",
        "fault_tolerance.max_restarts=2",
    ]
    opts = cluster.options_from_args(parser.parse_args([*argv, "--fault-policy", "shrink"]))
    job, _ = cluster.check_options(opts)
    ft = job.fault_tolerance
    assert (ft.policy, ft.max_restarts, ft.node_wait_timeout_s) == ("shrink", 2, 60.0)
    with pytest.raises(cluster.LaunchError, match=r"^--restart-window 0.0: must be > 0 seconds$"):
        cluster.options_from_args(parser.parse_args([*argv, "--restart-window", "0"]))
    with pytest.raises(SystemExit):  # argparse: invalid choice, with the accepted ones
        parser.parse_args([*argv, "--fault-policy", "grow"])
