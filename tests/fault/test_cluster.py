"""The local cluster end to end: real etcd, controller(s), agents and workers as processes, one
injected fault per run; each recovered run must finish with the fault-free run's parameters.

Every scenario is ``megascale launch`` in a subprocess: 2 nodes x 1 rank (plus a spare where
the scenario needs one), the tiny preset for 20 steps, a checkpoint every 4 steps, heartbeats every
0.5 s. One fault-free run (module fixture) gives the reference digest.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from megascale.controller.events import Event, read_events
from megascale.k8s.status import rfc3339
from megascale.launcher.outcome import read_final

pytestmark = pytest.mark.slow

STEPS = 20
REPO = Path(__file__).resolve().parents[2]
BASE = [
    "--nodes", "2", "--nproc-per-node", "1", "--heartbeat-interval", "0.5",
    "--selfcheck", "builtin", "--timeout", "240",
    "--set", f"train.steps={STEPS}", "--set", "checkpoint.interval=4", "--set", "checkpoint.keep=3",
    "--set", "train.log_interval=5",
]  # fmt: skip


class StatusWatch(threading.Thread):
    """The operator's status function (``k8s.status.decide``) fed the etcd state of a running
    ``megascale launch`` every 0.1 s, as the operator's timer feeds it a cluster's: the job id
    and the etcd endpoint come from the launcher's log; ``statuses`` is every status it made."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.stop = run_dir, threading.Event()
        self.statuses: list[dict] = []

    def run(self) -> None:
        from megascale.etcd.keys import JobKeys
        from megascale.etcd.store import Store, StoreError
        from megascale.k8s.builders import Job
        from megascale.k8s.operator import read_view
        from megascale.k8s.status import decide
        from megascale.launcher.cluster import local_store_config

        found = None
        while found is None and not self.stop.wait(0.2):
            log = self.run_dir / "logs" / "launch.log"
            found = (
                re.search(r"job (\S+): .* etcd at (\S+);", log.read_text())
                if log.exists()
                else None
            )
        if found is None:
            return
        config = local_store_config(self.run_dir, found[2], retry_s=0.5)
        keys, store = JobKeys(found[1]), Store(config)
        body = yaml.safe_load((REPO / "k8s" / "examples" / "minimal-cpu.yaml").read_text())
        job, status = Job.from_body({**body, "metadata": {**body["metadata"], "uid": "u"}}), {}
        while not self.stop.wait(0.1):
            try:
                view = read_view(store, keys)
            except StoreError:
                continue  # etcd stopped at the end, or restarting
            status = decide(job, status, [], view, time.time()).status
            self.statuses.append(copy.deepcopy(status))
        store.close()


class Run:
    """One ``megascale launch`` run: exit code, output, final.json, events; with ``watch``, the
    status the operator would have shown while it ran (``StatusWatch``)."""

    def __init__(
        self,
        run_dir: Path,
        *args: str,
        watch: bool = False,
        during: Callable[[], None] | None = None,
    ) -> None:
        """Run to the end; ``during()``, if given, is called once the launcher has started."""
        self.dir = run_dir
        self.watch = StatusWatch(run_dir)
        cmd = [sys.executable, "-m", "megascale.cli", "launch", *BASE, "--run-dir", str(run_dir)]
        proc = subprocess.Popen(
            [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
        )
        if watch:
            self.watch.start()
        try:
            if during is not None:
                during()
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            stdout, stderr = _stop(proc)
            pytest.fail(f"megascale launch ran past 300 s:\n{(stdout + stderr)[-6000:]}")
        finally:
            if proc.poll() is None:  # interrupted
                _stop(proc)
            self.watch.stop.set()
            if watch:
                self.watch.join()
        self.rc, self.output = proc.returncode, stdout + stderr
        final = run_dir / "final.json"
        # decoded (schema and fields checked), then read as the JSON a user sees
        self.final = read_final(run_dir).encode() if final.exists() else {}
        self.events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def faults(self) -> list[Event]:
        return self.of("fault")

    def check_recovered(self, reference: Run, generations: int = 2, steps: int = STEPS) -> None:
        """Finished, restarted once, with the fault-free run's parameters."""
        assert self.rc == 0, self.output[-6000:]
        assert self.final["finished"] and self.final["final_step"] == steps
        assert self.final["generations"] == generations, self.events
        assert self.final["recoveries"] == generations - 1
        assert self.final["param_digest"] == reference.final["param_digest"]


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM the launcher (its agents, controllers and etcd die with it: parent-death signal),
    SIGKILL if it has not exited 20 s later; its output."""
    proc.terminate()
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MEGASCALE_INJECT", None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """The fault-free run, in a run directory whose name holds error keywords: the workers' own
    lines that name it are no fault."""
    return Run(tmp_path_factory.mktemp("repro-OOM-NCCL-error-Segmentation-fault"))


def test_fault_free_run_finishes_and_clean_exits_are_not_faults(reference):
    assert reference.rc == 0, reference.output[-6000:]
    final = reference.final
    assert final["finished"] and final["final_step"] == STEPS and final["digest_step"] == STEPS
    assert len(final["param_digest"]) == 64
    assert final["faults_detected"] == {} and final["recoveries"] == 0
    assert final["generations"] == 1 and not reference.faults()
    # Every worker exited 0 at the end: recorded, and that is how the job finished.
    assert {(e.node, e.rank) for e in reference.of("worker_exit_clean")} <= {
        ("node-0", 0),
        ("node-1", 1),
    }
    assert reference.of("finished")[0].detail["reason"] == "every rank exited 0"


def test_kill_worker_detected_named_recovered(reference, tmp_path):
    run = Run(tmp_path, "--inject", "kill-worker:rank=1,step=12", watch=True)
    run.check_recovered(reference)
    check_live_status(run)
    [fault] = run.faults()
    assert fault.detail["fault"] == "worker_exit" and fault.detail["exit_code"] == -9
    assert (fault.node, fault.rank) == ("node-1", 1)
    assert fault.detail["where"] == "rank 1 (dp=1, pp=0, tp=0)"
    # In-process recovery (the default): the culprit's node alone was self-checked, and passed;
    # node-0's worker paused and rejoined. The same nodes run generation 2.
    assert sorted(e.node for e in run.of("selfcheck") if e.detail["ok"]) == ["node-1"]
    assert run.of("generation_start")[-1].detail["nodes"] == ["node-0", "node-1"]
    [timing] = run.final["fault_timings"]
    # From the injection record (written and fsynced just before the kill) to the decision, which
    # came from the worker's exit (the fault's kind above), not from a heartbeat timeout or a stall.
    assert 0 < timing["detection_s"] < timing["resumed_s"], timing


def check_live_status(run: Run) -> None:
    """The MegaScaleJob status made from the run's etcd while it trained holds the run's own
    figures: step, tokens/s (rank 0's, as in metrics.jsonl), MFU against the measured CPU peak,
    the last durable checkpoint (as its manifest says), the fault and the restart, the effective
    training time, and the conditions Running, then Recovering (naming the fault), then Running."""
    statuses = run.watch.statuses
    phases = [s["phase"] for i, s in enumerate(statuses) if i == 0 or s != statuses[i - 1]]
    assert "Recovering" in phases[phases.index("Running") :], phases

    def true(status: dict) -> set[str]:
        return {c["type"] for c in status["conditions"] if c["status"] == "True"} - {"Created"}

    recovering = next(s for s in statuses if s["phase"] == "Recovering")
    assert true(recovering) == {"Recovering"} and "worker_exit" in recovering["message"]
    final = [s for s in statuses if s["phase"] == "Running" and s["currentGeneration"] == 2][-1]
    assert true(final) == {"Running"} and (final["restarts"], final["faults"]) == (1, 1)
    assert 0 < final["step"] <= STEPS
    lines = (run.dir / "metrics.jsonl").read_text().splitlines()
    assert final["tokensPerSecond"] in [json.loads(line)["tokens_per_s"] for line in lines]
    assert 0 < final["mfu"] < 1 and final["mfuPeak"].endswith(" measured:cpu fp32"), final
    mark = final["lastCheckpoint"]
    assert mark["step"] % 4 == 0 and mark["url"].endswith(f"step_{mark['step']:08d}"), mark
    manifest = Path(mark["url"]) / "manifest.json"
    if manifest.exists():  # not yet retired by checkpoint.keep
        assert mark["time"] == rfc3339(json.loads(manifest.read_text())["time"])
    effective = final["effectiveTrainingTime"]
    assert 0 < effective["productiveSeconds"] < effective["wallSeconds"]
    assert 0 < effective["ratio"] < 1


def test_hang_worker_stall_names_culprit_failed_node_evicted(reference, tmp_path):
    topology = tmp_path / "topology.toml"
    topology.write_text('node-0 = "tor-a"\nnode-1 = "tor-a"\nnode-2 = "tor-b"\n')
    run = Run(
        tmp_path / "run",
        "--spares", "1",
        "--set", "fault_tolerance.recovery=restart",  # every node is self-checked
        "--topology", str(topology),
        "--inject", "hang-worker:rank=1,step=12",
        "--inject", "fail-selfcheck:node=1",
        "--inject", "break-net:node=1",
    )  # fmt: skip
    run.check_recovered(reference)
    # The neighbour all-reduce: labels reached the controller through the registrations; tor-b's
    # lone node joined tor-a's ring, so each node tested with both others. node-1's network is
    # down: it failed with every neighbour, and each of them passed naming node-1.
    [plan] = run.of("neighbours")
    assert plan.detail["topology"] == {"node-0": "tor-a", "node-1": "tor-a", "node-2": "tor-b"}
    assert {n: sorted(p) for n, p in plan.detail["plan"].items()} == {
        "node-0": ["node-1", "node-2"],
        "node-1": ["node-0", "node-2"],
        "node-2": ["node-0", "node-1"],
    }
    checks = {e.node: e.detail for e in run.of("selfcheck")}
    for healthy in ("node-0", "node-2"):
        assert checks[healthy]["ok"], checks[healthy]
        assert "failed with node-1 (suspected)" in checks[healthy]["detail"]
    assert not checks["node-1"]["ok"]
    assert "neighbour all-reduce failed with every neighbour" in checks["node-1"]["detail"]
    [fault] = run.faults()
    assert fault.detail["fault"] == "stall"
    assert (fault.node, fault.rank) == ("node-1", 1)
    assert fault.detail["suspects"] == ["rank 1 (dp=1, pp=0, tp=0)"]
    assert fault.detail["stopped"] == [1]  # the flight recorder saw it SIGSTOPped
    [evict] = run.of("evict")
    assert evict.node == "node-1" and "fail-selfcheck" in evict.detail["reason"]
    assert "failed with every neighbour (node-" in evict.detail["reason"]
    start = run.of("generation_start")[-1].detail
    assert start["nodes"] == ["node-0", "node-2"] and start["replaced"] == {"node-1": "node-2"}
    assert run.final["evicted"] == ["node-1"]


def test_kill_agent_node_lost_and_node_reregisters(reference, tmp_path):
    run = Run(tmp_path, "--inject", "kill-agent:node=1,step=12")
    run.check_recovered(reference)
    # node-0's worker died of the lost peer first; the controller still names the lost node.
    [fault] = run.faults()
    assert fault.detail["fault"] == "node_lost" and fault.node == "node-1"
    assert [e.node for e in run.of("node_registered")].count("node-1") == 2
    assert run.of("generation_start")[-1].detail["nodes"] == ["node-0", "node-1"]
    # The default policy "wait": the controller waited for the node (which the launcher brings
    # back only then), said so, and restarted at full size.
    [wait] = run.of("elastic")
    assert wait.detail["decision"] == "wait" and wait.detail["lost"] == ["node-1"]
    assert wait.detail["text"].startswith("wait: node-1 lost, no spare (1 of 2 nodes healthy)")
    [timing] = run.final["fault_timings"]
    assert timing["detection_s"] < 5.0


def test_kill_agent_spare_takes_over(reference, tmp_path):
    run = Run(tmp_path, "--spares", "1", "--inject", "kill-agent:node=1,step=12")
    run.check_recovered(reference)
    [fault] = run.faults()
    assert fault.detail["fault"] == "node_lost" and fault.node == "node-1"
    assert run.of("generation_start")[-1].detail["replaced"] == {"node-1": "node-2"}


def test_corrupt_checkpoint_falls_back_to_previous(reference, tmp_path):
    run = Run(
        tmp_path,
        "--set", "fault_tolerance.recovery=restart",  # in-process reads no checkpoint
        "--inject", "kill-worker:rank=0,step=15",
        "--inject", "corrupt-checkpoint:latest",
    )  # fmt: skip
    run.check_recovered(reference)
    fired = {f["kind"]: f for f in _fired(tmp_path)}
    # The newest complete checkpoint when the workers were stopped (step 12, unless its background
    # write had not finished) was corrupted; the restart skipped it and resumed from the one before.
    corrupted = int(Path(fired["corrupt-checkpoint"]["checkpoint"]).name.removeprefix("step_"))
    assert corrupted in (8, 12) and fired["corrupt-checkpoint"]["file"] == "rank_00000/__0_0.distcp"
    fallbacks = run.of("checkpoint_fallback")
    assert any(
        (e.node, e.rank) == ("node-0", 0) and "rank_00000/__0_0.distcp" in e.detail["text"]
        for e in fallbacks
    ), fallbacks
    assert run.final["faults_detected"] == {"worker_exit": 1, "checkpoint_fallback": 1}
    log = (tmp_path / "logs" / "rank_00000.log").read_text()
    resumed = log.rsplit("resumed from", 1)[1].split()[0]
    assert resumed.endswith(f"step_{corrupted - 4:08d}"), resumed


def test_etcd_restart_is_survived_without_a_restart(reference, tmp_path):
    # What is promised: no restart, no fault, nobody lost, the fault-free parameters, and the
    # outage reported. It is seen when a leadership check (every 1 s) fails after retrying for
    # up to 1 s while etcd is down: 3 s down leaves a controller loop running late ~1 s of slack.
    run = Run(tmp_path, "--inject", "etcd-restart:step=8,downtime=3")
    run.check_recovered(reference, generations=1)
    assert not run.faults() and not run.of("node_lost") and not run.of("evict"), run.events
    [down] = run.of("etcd_unavailable")
    # Its end is either of two correct outcomes: the leader sees etcd answer again; or, on a
    # starved machine (every client re-authenticates to the restarted etcd), the leader's own
    # 2 s lease runs out first, its buffered events are dropped as a deposed leader's, and a
    # controller takes over from the snapshot without a restart.
    recovered = [e for e in run.of("etcd_recovered") if e.time >= down.time]
    takeovers = [e for e in run.of("controller_takeover") if e.time >= down.time]
    assert recovered or takeovers, run.events
    assert run.final["faults_detected"] == {"etcd_unavailable": 1} | (
        {"controller_takeover": len(takeovers)} if takeovers else {}
    )


def test_kill_controller_standby_takes_over_and_handles_the_next_fault(reference, tmp_path):
    run = Run(
        tmp_path,
        "--inject", "kill-controller:step=5",
        "--inject", "kill-worker:rank=0,step=14",
    )  # fmt: skip
    run.check_recovered(reference)
    [takeover] = run.of("controller_takeover")
    assert takeover.detail["controller"] == "controller-1"
    [fault] = run.faults()
    assert fault.time > takeover.time and (fault.node, fault.rank) == ("node-0", 0)


# NCCL-like mode: collectives return at once and complete on communication threads; 8 ranks,
# TP2 x PP2 x DP2 + SP, on 2 nodes of 4 (and a spare); a node named culprit once is evicted.
NCCL_STEPS = 10
NCCL = [
    "--nodes", "2", "--nproc-per-node", "4", "--set", f"train.steps={NCCL_STEPS}",
    "--heartbeat-interval", "1.5",  # 3 s leases: 8 workers starve agents on 2 busy cores
    "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "parallel.sequence_parallel=true",
    "--set", "parallel.async_collectives=true",
    "--set", "fault_tolerance.evict_repeat_culprit=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def nccl_reference(tmp_path_factory) -> Run:
    """The fault-free run in the NCCL-like mode and layout."""
    run = Run(tmp_path_factory.mktemp("nccl-reference"), *NCCL)
    assert run.rc == 0 and run.final["generations"] == 1, run.output[-6000:]
    return run


@pytest.mark.parametrize(
    ("inject", "reasons"),
    [
        ("hang-comm:rank=5,step=6", {"not-started", "not-entered"}),
        ("hang-worker:rank=5,step=6", {"stopped"}),
    ],
    ids=["hang-comm", "hang-worker"],
)
def test_nccl_like_hang_names_the_rank_alone_and_a_spare_replaces_its_node(
    nccl_reference, tmp_path, inject, reasons
):
    run = Run(tmp_path, *NCCL, "--spares", "1", "--inject", inject)
    run.check_recovered(nccl_reference, steps=NCCL_STEPS)
    [fault] = run.faults()
    assert fault.detail["fault"] == "stall"
    assert (fault.node, fault.rank) == ("node-1", 5)
    assert fault.detail["suspects"] == ["rank 5 (dp=0, pp=1, tp=1)"]
    culprits = fault.detail["culprits"]
    assert {c["rank"] for c in culprits} == {5}, culprits
    assert {c["reason"] for c in culprits} <= reasons, culprits
    [evict] = run.of("evict")
    assert evict.node == "node-1" and "named culprit in 1 faults" in evict.detail["reason"]
    start = run.of("generation_start")[-1].detail
    assert start["nodes"] == ["node-0", "node-2"] and start["replaced"] == {"node-1": "node-2"}


def test_a_mismatched_collective_is_named_and_evicts_nobody(tmp_path):
    # 2 nodes x 2 ranks (DP4, so that the odd rank is in a minority), a policy that evicts a node
    # named culprit once: rank 2's collective mismatches at step 12 and hangs; the stall names it
    # (a mismatch, its group and op), no node is blamed, the job restarts on the same nodes and
    # finishes (the injection fires once; a mismatch that came back would fail the job).
    run = Run(
        tmp_path,
        "--nproc-per-node", "2", "--spares", "1",
        "--inject", "mismatch-comm:rank=2,step=12",
        "--set", "fault_tolerance.evict_repeat_culprit=1",
    )  # fmt: skip
    assert run.rc == 0 and run.final["finished"] and run.final["final_step"] == STEPS, run.output
    assert run.final["generations"] == 2 and run.final["evicted"] == []
    [fault] = run.faults()
    assert fault.detail["fault"] == "stall" and (fault.node, fault.rank) == ("node-1", 2)
    assert fault.detail["classified"] == "software: mismatched collective"
    [culprit] = fault.detail["culprits"]
    assert (culprit["rank"], culprit["reason"]) == (2, "mismatch"), culprit
    assert culprit["group"].endswith(" [0, 1, 2, 3]") and culprit["op"].endswith(" bytes")
    assert not run.of("evict")
    start = run.of("generation_start")[-1].detail
    assert start["nodes"] == ["node-0", "node-1"] and not start.get("replaced")


def test_slow_rank_is_not_a_fault(reference, tmp_path):
    run = Run(tmp_path, "--inject", "slow-rank:rank=1,factor=2")
    run.check_recovered(reference, generations=1)
    assert not run.faults() and run.final["faults_detected"] == {}


@pytest.mark.parametrize("async_collectives", [False, True], ids=["gloo", "nccl-like"])
def test_slow_node_is_evicted_when_configured_and_a_spare_takes_its_ranks(
    reference, tmp_path, async_collectives
):
    # Flagging takes 6 heartbeats per node that each carry a new step (a window of 4, slow in 3
    # windows in a row), all before step 20: 8 x slow steps make that so even on a fast machine,
    # where 4 x the tiny model's step can be well under a heartbeat interval. It costs little:
    # the node is evicted after those 6 heartbeats. In the NCCL-like mode the host never blocks
    # in a collective, so the slow node is told by its compute time alone: the same result (and
    # the same numbers as the blocking gloo reference).
    run = Run(
        tmp_path,
        "--spares", "1",
        "--inject", "slow-node:node=1,factor=8",
        "--set", "diagnostics.straggler_action=evict",
        "--set", f"parallel.async_collectives={str(async_collectives).lower()}",
    )  # fmt: skip
    run.check_recovered(reference)
    # The first generation's report names the slow machine (on a loaded 2-core box a later
    # generation may report a node again, with no spare left to replace it).
    [straggler] = [e for e in run.of("straggler") if e.generation == 1]
    assert straggler.node == "node-1" and straggler.detail["action"] == "evict"
    assert straggler.rank == straggler.detail["rank"] == 1  # its slowest rank, by compute
    assert straggler.detail["score"] > straggler.detail["threshold"]
    [fault] = run.faults()
    assert fault.detail["fault"] == "straggler" and fault.node == "node-1"
    [evict] = run.of("evict")
    assert evict.node == "node-1" and "straggler" in evict.detail["reason"]
    start = run.of("generation_start")[-1].detail
    assert start["nodes"] == ["node-0", "node-2"] and start["replaced"] == {"node-1": "node-2"}
    assert run.final["evicted"] == ["node-1"]


def _fired(run_dir: Path) -> list[dict]:
    from megascale.probes.inject import fired

    return fired(run_dir)


def _check_failed_as_the_jobs_error(run: Run, text: str, why: str) -> None:
    """Failed at once with ``text`` as its reason (summary, final.json, events): one generation,
    no self-check round, nobody evicted, the spare never used."""
    assert run.rc == 1, run.output[-6000:]
    assert run.final["state"] == "failed" and not run.final["finished"]
    assert text in run.final["failure"] and why in run.final["failure"], run.final
    assert text in run.final["fatal"]["reason"]
    assert "job FAILED: job-fatal error on rank" in run.output and text in run.output
    [fault] = run.faults()
    assert fault.detail["fault"] == "job_fatal" and fault.detail["classified"].startswith(why)
    assert run.final["generations"] == 1 and run.final["recoveries"] == 0
    assert not run.of("evict") and not run.of("selfcheck") and run.final["evicted"] == []
    assert all("node-2" not in e.detail["nodes"] for e in run.of("generation_start"))


def test_the_same_error_on_every_rank_fails_the_job_at_once_evicting_nobody(tmp_path):
    run = Run(tmp_path, "--spares", "1", "--inject", "raise-error:step=6")
    _check_failed_as_the_jobs_error(
        run, "cannot read its data at step 6", "the same error ended every rank (2)"
    )


def test_a_controller_frozen_past_its_lease_records_nothing_when_it_wakes(reference, tmp_path):
    # Frozen for 7 s: past its 2 s lease (the standby takes over) and past the 5 s heartbeat
    # timeout (the frozen controller, waking up, sees every node silent). slow-rank only sleeps
    # (the parameters are the fault-free run's) and keeps the job running after it wakes.
    run = Run(
        tmp_path,
        "--inject", "pause-controller:step=3,seconds=7",
        "--inject", "slow-rank:rank=0,factor=3",
    )  # fmt: skip
    run.check_recovered(reference, generations=1)
    [takeover] = run.of("controller_takeover")
    assert takeover.detail["controller"] == "controller-1"
    assert not run.faults() and run.final["faults_detected"] == {"controller_takeover": 1}
    # It did wake up while the job ran, and found it no longer led.
    log = (tmp_path / "logs" / "controller_controller-0.log").read_text()
    assert "no longer the leader" in log, log[-3000:]
    terms = [e.term for e in run.events]
    assert terms == sorted(terms) and len(set(terms)) == 2


def test_etcd_is_per_job_authenticated_and_a_forged_command_is_ignored(reference, tmp_path):
    from megascale.etcd.store import Store, StoreConfig, StoreError

    def anonymous_writes_are_refused() -> None:
        log, deadline = tmp_path / "logs" / "launch.log", time.monotonic() + 120
        found = None
        while found is None and time.monotonic() < deadline:
            found = re.search(r"etcd at (\S+);", log.read_text()) if log.exists() else None
            time.sleep(0.1)
        assert found is not None, "the launcher never said where etcd is"
        anonymous = Store(StoreConfig.parse(found.group(1), retry_s=1.0))
        with pytest.raises(StoreError, match="user name is empty"):
            anonymous.put("/megascale/any/commands/node-0", {"kind": "stop"})

    run = Run(tmp_path, "--inject", "forge-command:step=6", during=anonymous_writes_are_refused)
    run.check_recovered(reference, generations=1)
    assert not run.faults() and not run.of("all_stopped")
    password = tmp_path / "etcd.password"
    assert password.stat().st_mode & 0o777 == 0o600 and len(password.read_text().strip()) >= 32
    agent_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("agent_node-*.log"))
    assert agent_logs.count("generation beyond the controller's") == 2, agent_logs[-3000:]


# The layout a new user tries first: TP2 x DP2 on 2 nodes of 2, NCCL-like, no pipeline. The
# distributed optimizer's overlapped gathers are in flight when the rank's communication stops.
TP2_DP2 = [
    "--nproc-per-node", "2", "--set", "train.steps=12", "--set", "parallel.tp=2",
    "--set", "parallel.async_collectives=true",
]  # fmt: skip


@pytest.mark.parametrize(("rank", "node", "coords"), [(1, "node-0", "dp=0, pp=0, tp=1"),
                                                      (2, "node-1", "dp=1, pp=0, tp=0")])  # fmt: skip
def test_tp2_dp2_nccl_like_hang_names_the_rank_its_node_coordinates_group_and_op(
    tmp_path, rank, node, coords
):
    run = Run(tmp_path, *TP2_DP2, "--inject", f"hang-comm:rank={rank},step=6")
    assert run.rc == 0 and run.final["finished"] and run.final["final_step"] == 12, run.output
    [fault] = run.faults()
    assert fault.detail["fault"] == "stall" and (fault.node, fault.rank) == (node, rank)
    assert fault.detail["suspects"] == [f"rank {rank} ({coords})"]
    assert fault.detail["suspect_nodes"] == [node]
    [culprit] = fault.detail["culprits"]
    assert (culprit["rank"], culprit["reason"], culprit["node"]) == (rank, "not-started", node)
    assert culprit["text"].startswith(f"rank {rank} ({coords}) on {node} not started in ")
    assert culprit["group"] and culprit["op"] and culprit["seq"] > 0, culprit
    assert f"FAULT stall node {node} rank {rank}" in run.output and culprit["text"] in run.output


def test_a_forged_heartbeat_beyond_the_last_step_is_dropped_and_the_job_finishes(
    reference, tmp_path
):
    from megascale.etcd.keys import JobKeys
    from megascale.etcd.store import Store
    from megascale.launcher.cluster import local_store_config

    def forge() -> None:
        log, deadline = tmp_path / "logs" / "launch.log", time.monotonic() + 120
        while _steps_done(tmp_path) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        found = re.search(r"job (\S+): .* etcd at (\S+);", log.read_text())
        store, keys = Store(local_store_config(tmp_path, found[2], retry_s=1.0)), JobKeys(found[1])
        beat = {"schema": "1.1", "node": "node-0", "generation": 1, "step": 1e30}
        store.put(keys.heartbeat("node-0"), beat)  # with the job's own credentials
        store.close()

    run = Run(tmp_path, during=forge)
    run.check_recovered(reference, generations=1)
    assert not run.faults()
    controller = (tmp_path / "logs" / "controller_controller-0.log").read_text()
    assert "dropping its Heartbeat: step = 1e+30: expected an integer in [0, 20]" in controller


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0
