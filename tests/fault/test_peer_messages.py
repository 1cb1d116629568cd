"""The controller believes a peer only within the job's bounds (real etcd, the controller's own
intake): a heartbeat out of its types or ranges, or whose progress goes back within a
generation, is dropped whole and logged; a registration of another config is refused and never
counted; a second agent with a name in use is refused and the holder stays."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale.agent import identity
from megascale.controller.fsm import ControllerFSM, ControllerPolicy, SendCommand, State
from megascale.controller.service import ControllerService, ServiceOptions
from megascale.etcd.store import WatchEvent

STEPS = 50


@pytest.fixture
def leader(store, job, tmp_path):
    """A controller running generation 1 on n0, n1 (one rank each) of a 50-step job."""
    policy = ControllerPolicy(nodes=2, nproc_per_node=1)
    opts = ServiceOptions(job.job_id, tmp_path, policy, "c0", train_steps=STEPS, config_hash="aaaa")
    shell = ControllerService(store, opts)
    assert shell.election.campaign(timeout_s=10.0)
    shell.fsm = ControllerFSM(policy, now=1.0)
    for node in ("n0", "n1"):
        shell._dispatch("node", _put(shell.keys.node(node), _registration(node, "aaaa")))
    for action in shell.fsm.on_start(now=2.0):
        if isinstance(action, SendCommand):
            shell.fsm.on_ack(action.node, action.id, ok=True, now=2.0)
    assert shell.fsm.state is State.RUNNING
    yield shell
    shell.election.close()


def _registration(node: str, config_hash: str | None) -> dict:
    return {"node": node, "pid": 1, "host": "h", "config_hash": config_hash}


def _put(key: str, value: dict) -> WatchEvent:
    return WatchEvent("put", key, json.dumps(value).encode(), 1)


def _beat(shell, key_node: str, step, **fields) -> None:
    value = {"schema": "1.1", "node": key_node, "generation": shell.fsm.generation, "step": step}
    shell._dispatch("hb", _put(shell.keys.heartbeat(key_node), {**value, **fields}))


def test_a_heartbeat_out_of_range_or_going_back_is_dropped_and_progress_stands(leader, caplog):
    caplog.set_level(logging.ERROR, "megascale.controller.service")
    _beat(leader, "n0", 5, ranks={"0": {"step": 5}})
    assert leader.fsm.step == 5
    seen = leader.fsm.last_seen["n0"]
    for step, fields, why in [
        (1e30, {}, "step = 1e+30: expected an integer in [0, 50]"),
        (51, {}, "step = 51: expected an integer in [0, 50]"),
        (True, {}, "step = True"),
        (6, {"ranks": {"0": {"step": -1}}}, "ranks[0].step = -1"),
        (6, {"step_time_s": -1.0}, "step_time_s = -1.0: expected a finite number >= 0"),
        (6, {"ranks": {"7": {"step": 6}}}, "ranks key '7': expected a rank in [0, 1]"),
        (6, {"section": "evil"}, "section = 'evil'"),
        (6, {"node": "n1"}, "node = 'n1': written at the key of 'n0'"),
        (6, {"ranks": {"0": {"step": 3}}}, "ranks[0].step = 3: below the 5"),
    ]:
        caplog.clear()
        _beat(leader, "n0", step, **fields)
        assert leader.fsm.step == 5 and leader.fsm.last_seen["n0"] == seen, why
        assert f"node n0: dropping its Heartbeat: {why}" in caplog.text, (why, caplog.text)
    _beat(leader, "n0", 7, ranks={"0": {"step": 7}})  # the node's real progress goes on
    assert leader.fsm.step == 7
    # No stall, no fault: the job's clock is the real progress.
    assert leader.fsm.state is State.RUNNING and not leader.fsm.faults


def test_a_new_generation_starts_its_progress_afresh(leader):
    _beat(leader, "n0", 9, ranks={"0": {"step": 9}})
    leader.fsm.generation = 2  # a restart resumes from an older checkpoint
    _beat(leader, "n0", 3, ranks={"0": {"step": 3}})
    assert leader._steps.previous("rank:0", 2) == 3 and leader._steps.previous("rank:0", 1) is None


def test_an_agent_of_another_config_is_refused_and_never_counted(leader, caplog):
    caplog.set_level(logging.ERROR, "megascale.controller.service")
    leader._dispatch("node", _put(leader.keys.node("n2"), _registration("n2", "bbbb")))
    assert "n2" not in leader.fsm.registered
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals == [
        "node n2 refused: its config hash bbbb is not the job's aaaa: an agent of another "
        "config is never counted (restart it with the job's config)"
    ]
    _beat(leader, "n2", 40)  # its heartbeats are never read
    assert leader.fsm.step is None or leader.fsm.step < 40
    leader._dispatch("node", _put(leader.keys.node("n3"), _registration("n3", None)))
    assert "n3" not in leader.fsm.registered
    leader._dispatch("node", _put(leader.keys.node("n4"), _registration("n4", "aaaa")))
    assert "n4" in leader.fsm.registered  # the job's config: a spare


def test_config_hash_is_of_the_loaded_config(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[train]\nsteps = 10\n")
    b.write_text("[train]\nsteps = 11\n")
    assert identity.config_hash(str(a)) == identity.config_hash(str(a))
    assert identity.config_hash(str(a)) != identity.config_hash(str(b))
    assert identity.config_hash(str(a), ["train.steps=11"]) == identity.config_hash(str(b))
    assert identity.config_hash(None) is None


def test_claim_node_waits_for_a_dead_holder_and_retakes_its_own(store, job):
    key = job.node("n0")
    holder = store.grant(1)
    store.put(key, {"node": "n0", "pid": 42, "host": "h", "instance": "other"}, lease=holder)
    mine = store.grant(5)
    with pytest.raises(identity.NameTaken, match="pid 42 on host 'h': one agent per name"):
        identity.claim_node(store, key, {"node": "n0", "instance": "x"}, mine.id, wait_s=0.0)
    # A holder that stops renewing (a crashed agent) is gone within its TTL: the name is free.
    own = {"node": "n0", "instance": identity.INSTANCE}
    identity.claim_node(store, key, own, mine.id, wait_s=5.0)
    assert store.get(key).lease == mine.id
    again = store.grant(5)  # this agent's own registration (etcd kept its old lease): retaken
    identity.claim_node(store, key, own, again.id, wait_s=0.0)
    assert store.get(key).lease == again.id


@pytest.mark.slow
def test_a_second_agent_with_a_name_in_use_is_refused_and_the_first_stays(
    etcd, store, job, tmp_path
):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MEGASCALE_INJECT", None)
    argv = [
        sys.executable, "-m", "megascale.cli", "agent", "--job", job.job_id, "--node", "n0",
        "--endpoints", etcd.endpoint, "--run-dir", str(tmp_path), "--heartbeat-interval", "0.25",
    ]  # fmt: skip
    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while (held := store.get(job.node("n0"))) is None:
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr[-2000:]
        refused = [line for line in second.stderr.splitlines() if "refused" in line]
        assert len(refused) == 1 and f"pid {first.pid}" in refused[0], second.stderr[-2000:]
        time.sleep(1.0)  # the second's exit left the first's registration alone
        now = store.get(job.node("n0"))
        assert now is not None and now.lease == held.lease and first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)


def test_a_node_missing_at_takeover_has_a_lease_ttl_to_register_again(leader):
    hold = leader.opts.secondary_hold_s
    leader.fsm = ControllerFSM.restore(leader.fsm.policy, leader.fsm.snapshot(), 10.0)
    leader._sync_nodes([], now=10.0)  # the takeover lists no node yet: they re-register
    leader._tick(10.0 + hold - 0.1)
    assert set(leader.fsm.registered) == {"n0", "n1"} and not leader.fsm.faults
    leader._dispatch("node", _put(leader.keys.node("n0"), _registration("n0", "aaaa")))
    leader._tick(10.0 + hold + 0.1)  # n0 came back; n1 did not: lost only now
    assert set(leader.fsm.registered) == {"n0"}
    assert [(f.kind, f.node) for f in leader.fsm.faults] == [("node_lost", "n1")]


def _delete(key: str) -> WatchEvent:
    return WatchEvent("delete", key, b"", 2)


@pytest.mark.parametrize("absence", ["etcd outage", "starved loop"])
def test_a_lease_run_out_in_the_wake_of_the_controllers_own_absence_is_no_lost_node(
    leader, absence
):
    clock = [2.0]  # the fixture's generation started at 2.0
    leader.clock = lambda: clock[0]
    hold = leader.opts.secondary_hold_s
    if absence == "etcd outage":
        leader._store_failed(RuntimeError("etcd down"))
        clock[0] += 3.0
        leader._store_ok()  # etcd is back: the agents' leases may run out before they renew
    else:
        clock[0] += 30.0
        leader._own_gap(2.0)  # this loop turn came 30 s late: every deadline moves by that
    clock[0] += 1.0
    for node in ("n0", "n1"):
        leader._dispatch("node", _delete(leader.keys.node(node)))
    leader._dispatch("node", _put(leader.keys.node("n0"), _registration("n0", "aaaa")))
    leader._tick(clock[0] + hold - 0.1)
    assert set(leader.fsm.registered) == {"n0", "n1"} and not leader.fsm.faults
    leader._tick(clock[0] + hold + 0.1)  # n0 registered again; n1 did not: lost only now
    assert [(f.kind, f.node) for f in leader.fsm.faults] == [("node_lost", "n1")]
    # once that wake is over, a registration that disappears is a lost node at once
    clock[0] += 2 * hold
    leader._dispatch("node", _delete(leader.keys.node("n0")))
    assert "n0" not in leader.fsm.registered


def test_a_peers_symptom_waits_for_a_node_whose_registration_is_pending(leader):
    from megascale.controller.service_heartbeats import Evidence

    clock = [2.0]
    leader.clock = lambda: clock[0]
    hold = leader.opts.secondary_hold_s
    leader._own_gap(clock[0] - 30.0)  # a starved turn, and n1 dies in its wake
    # n0's worker exits at once: its peer on n1 is gone (a symptom, held)
    symptom = Evidence("worker_exit", "n0", 0, leader.fsm.generation, code=1, secondary=True)
    leader._evidence(symptom, clock[0])
    clock[0] += 1.0  # n1's lease runs out later, still in the wake: its loss is pending
    leader._dispatch("node", _delete(leader.keys.node("n1")))
    leader._tick(2.0 + hold + 0.1)  # the symptom is due, but waits for n1
    assert not leader.fsm.faults
    leader._tick(clock[0] + hold + 0.1)  # n1 did not register again: lost, the cause
    assert [(f.kind, f.node) for f in leader.fsm.faults] == [("node_lost", "n1")]
