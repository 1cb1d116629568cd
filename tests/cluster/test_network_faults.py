"""The network fault matrix across hosts: what only a network does to a job. Each case runs the
multi-host job (``multihost_job``: etcd and the controller on ``ctl``, an agent per host, gloo
over the bridge), injects its fault once rank 0 has logged step 6, and must end with the
parameters of the same job run fault-free on one host (the ``reference`` fixture) and nothing
left running (the ``net`` fixture kills and checks). Each prints the line its row of
``benchmarks/RESULTS.md`` is read from.

- 20% packet loss, or 100 ms added delay, on a worker host: TCP carries on; training goes on and
  no node is evicted (a slow host may be reported as a straggler, never replaced under the
  default ``straggler_action = "report"``).
- two worker hosts cut from each other while both still reach etcd: a collective hangs, the
  stall names ranks of those two hosts and no other; a spare takes one's place and the job ends.
- the active controller's host partitioned from etcd while a standby runs on another host: the
  standby takes over; the deposed one, healed, acts on nothing (no event of its term after the
  takeover).
- etcd's host restarted (etcd and the controller there killed, the host back, both started
  again on the same data): the job goes on from the state etcd kept.
"""

from __future__ import annotations

import json
import time

import pytest
from multihost_job import OVERRIDES, STEPS, MultiHostJob

from megascale.config import load
from megascale.controller.events import read_events
from megascale.launcher.outcome import parameter_digest

pytestmark = pytest.mark.slow


def run_until_step(job: MultiHostJob, step: int, wait_s: float = 180.0) -> None:
    deadline = time.monotonic() + wait_s
    while not any(r["step"] >= step for r in job.steps()):
        assert job.procs["controller"].poll() is None, job.tail("controller")
        assert time.monotonic() < deadline, f"the job did not reach step {step}"
        time.sleep(0.02)


def first_generation(job: MultiHostJob):
    return next(e for e in read_events(job.run_dir) if e.kind == "generation_start")


def check_fault_free_parameters(job: MultiHostJob, reference: str) -> None:
    assert parameter_digest(job.run_dir, load("tiny", OVERRIDES)) == (reference, STEPS)


@pytest.mark.parametrize("fault", ["loss-20", "delay-100"])
def test_a_lossy_or_slow_link_evicts_nobody(net, tmp_path, reference, fault):
    job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2", "node3"], 2, OVERRIDES)
    try:
        job.start()
        run_until_step(job, 6)
        victim = first_generation(job).detail["nodes"][1]
        if fault == "loss-20":
            net.loss(victim, 20)
        else:
            net.delay(victim, 100)
        fault_time, step_at_fault = time.time(), max(r["step"] for r in job.steps())
        rc = job.wait(300)
    finally:
        job.stop(grace_s=5)
    assert rc == 0, job.tail("controller")
    check_fault_free_parameters(job, reference)
    after = [e for e in read_events(job.run_dir) if e.time >= fault_time]
    kinds = [e.kind for e in after]
    assert not [e for e in after if e.kind in ("fault", "evict", "generation_start")], kinds
    records = [r for r in job.steps() if r["time"] >= fault_time]
    span = records[-1]["time"] - fault_time
    print(
        f"{fault} on {victim} (rank 1) from step {step_at_fault}: "
        f"{records[-1]['step'] - step_at_fault} steps in {span:.1f} s after it, events {kinds}"
    )


def test_two_hosts_cut_from_each_other_stall_names_them_and_a_spare_steps_in(
    net, tmp_path, reference
):
    """Rank 0's and rank 1's hosts stop reaching each other while both still reach etcd (no
    lease lapses): the next collective hangs. The stall must name ranks of those two hosts and
    no other; the job goes on without the pair (a spare replaces the one found at fault) and ends
    with the fault-free parameters. The cut stays until the end. With two ranks, both wait in the
    same collective for each other: the stall names the blocked group, and the self-check's
    neighbour all-reduce finds the pair (each fails with the other, passes with the spare)."""
    job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2", "node3"], 2, OVERRIDES)
    try:
        job.start()
        run_until_step(job, 6)
        pair = first_generation(job).detail["nodes"]
        net.cut(*pair)
        fault_time = time.time()
        rc = job.wait(300)
    finally:
        job.stop(grace_s=5)
    events = read_events(job.run_dir)
    after = [e for e in events if e.time >= fault_time]
    assert rc == 0, [(e.kind, e.node, e.detail) for e in after]
    check_fault_free_parameters(job, reference)
    faults = [e for e in after if e.kind == "fault"]
    assert faults and faults[0].detail["fault"] == "stall", faults
    stall = faults[0].detail
    # Both ranks wait in the same collective for each other: the flight records cannot tell the
    # two apart (nobody, or only the pair, is named); the neighbour all-reduce then can.
    assert set(stall["suspect_nodes"]) <= set(pair), stall
    assert stall["blocked_in"] and all(g.endswith("on [0, 1]") for g in stall["blocked_in"]), stall
    [evict] = [e for e in after if e.kind == "evict"]  # one of the pair, never the third host
    assert (
        evict.node in pair
        and f"cannot reach {pair[pair.index(evict.node) - 1]}" in (evict.detail["reason"])
    ), evict.detail
    [restart] = [e for e in after if e.kind == "generation_start"]
    assert restart.detail["replaced"] == {evict.node: "node3"}, restart.detail
    resumed = next(r for r in job.steps() if r["time"] > restart.time)
    stopped = next(e for e in after if e.kind == "all_stopped")
    print(
        f"cut {pair[0]} <-> {pair[1]} at step >= 6: stall after {faults[0].time - fault_time:.2f} "
        f"s (blocked in {stall['blocked_in']}, suspects {stall['suspect_nodes']}), stopped after "
        f"{stopped.time - fault_time:.2f} s, {evict.node} evicted ({evict.detail['reason']}) "
        f"after {evict.time - fault_time:.2f} s, generation {restart.generation} on "
        f"{restart.detail['nodes']}, first step (step {resumed['step']}) after "
        f"{resumed['time'] - fault_time:.2f} s"
    )


def leader(job: MultiHostJob) -> str | None:
    from megascale.etcd.keys import JobKeys

    out = job.etcdctl("get", JobKeys(job.job_id).controller_leader, "--print-value-only")
    try:
        return json.loads(out.strip().splitlines()[-1]).get("id")
    except (ValueError, IndexError, AttributeError):
        return None


def test_controller_partitioned_from_etcd_standby_takes_over_deposed_acts_on_nothing(
    net, tmp_path, reference
):
    """etcd on ``ctl``; the leading controller on ``node3``, its standby on ``ctl``. ``node3`` is
    partitioned at step 6: its lease lapses and the standby leads. Healed after the takeover, the
    deposed controller finds it no longer leads and records nothing: every event after the
    takeover is of the new term. The job ends with the fault-free parameters."""
    job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2"], 2, OVERRIDES)
    try:
        job.start_etcd()
        job.write_config()
        for host in job.workers:
            job.start_agent(host)
        for host in job.workers:
            job.wait_registered(host, 120)
        job.start_controller("node3", "controller", "controller-0")
        deadline = time.monotonic() + 60
        while leader(job) != "controller-0":
            assert time.monotonic() < deadline, job.tail("controller")
            time.sleep(0.2)
        job.start_controller("ctl", "standby", "controller-1")
        run_until_step(job, 6)
        net.partition("node3")
        fault_time = time.time()
        deadline = time.monotonic() + 60
        while not [e for e in read_events(job.run_dir) if e.kind == "controller_takeover"]:
            assert time.monotonic() < deadline, job.tail("standby")
            time.sleep(0.1)
        time.sleep(2.0)  # the deposed one sees the network again (the job may have ended)
        net.heal()
        heal_time = time.time()
        deadline = time.monotonic() + 30  # its next leadership check finds its lease gone
        while "no longer the leader" not in job.tail("controller", 50000):
            assert time.monotonic() < deadline, job.tail("controller")
            time.sleep(0.2)
        rc = job.procs["standby"].wait(240)
    finally:
        job.stop(grace_s=5)
    assert rc == 0, job.tail("standby")
    check_fault_free_parameters(job, reference)
    events = read_events(job.run_dir)
    [takeover] = [e for e in events if e.kind == "controller_takeover"]
    assert takeover.detail["controller"] == "controller-1", takeover
    terms = [e.term for e in events]
    assert terms == sorted(terms), terms  # nothing of the old term after the new one began
    end = next(e for e in events if e.kind == "finished")
    assert {e.term for e in events if takeover.time <= e.time <= end.time} == {takeover.term}
    assert not [e for e in events if e.time >= fault_time and e.kind in ("fault", "evict")]
    steps = [r for r in job.steps() if r["time"] >= fault_time]
    print(
        f"controller host node3 partitioned at step >= 6: standby led after "
        f"{takeover.time - fault_time:.2f} s (term {takeover.term}); healed "
        f"{heal_time - fault_time:.1f} s after the fault; training never stopped "
        f"({len(steps)} steps logged after the fault); events after the takeover all of term "
        f"{takeover.term}"
    )


def test_etcd_host_restarted_the_job_goes_on_from_the_state_etcd_kept(net, tmp_path, reference):
    """``ctl`` (etcd and the controller) loses power at step 6: its link goes down and both die.
    3 s later it is back: etcd starts again on the same data directory and password, and the
    controller again, which resumes from the state etcd kept. The agents re-register; the job
    ends with the fault-free parameters."""
    job = MultiHostJob(net, tmp_path / "multi", ["node1", "node2", "node3"], 2, OVERRIDES)
    try:
        job.start()
        run_until_step(job, 6)
        net.crash("ctl")
        fault_time = time.time()
        step_at_fault = max(r["step"] for r in job.steps())
        time.sleep(3.0)
        net.heal()
        job.start_etcd()
        back_time = time.time()
        job.start_controller()
        rc = job.wait(240)
    finally:
        job.stop(grace_s=5)
    assert rc == 0, job.tail("controller")
    check_fault_free_parameters(job, reference)
    after = [e for e in read_events(job.run_dir) if e.time >= fault_time]
    kinds = [(e.kind, e.node) for e in after]
    assert not [e for e in after if e.kind == "evict"], kinds
    during = [r for r in job.steps() if fault_time <= r["time"] <= back_time]
    print(
        f"etcd host crashed at step {step_at_fault}, back after {back_time - fault_time:.1f} s; "
        f"{len(during)} steps logged while it was down; events after it: {kinds}"
    )
