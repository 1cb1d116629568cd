"""The node agent on its own against a real etcd (commands it must and must not run; losing etcd
and its lease), and ``megascale launch`` refusing bad arguments before it starts anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megascale import cli
from megascale.agent import workers
from megascale.agent import zygote as zygotes
from megascale.etcd.keys import JobKeys, make_command
from megascale.etcd.server import EmbeddedEtcd
from megascale.etcd.store import Store, StoreConfig
from megascale.messages import GenerationRecord


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--inject", "kill-workr:rank=1"],
            "unknown fault kind 'kill-workr'; accepted: kill-worker:",
        ),
        (["--inject", "kill-worker:rank=1"], "missing step; rank=N, step=N (e.g. kill-worker:"),
        (["--inject", "kill-worker:rnk=1,step=3"], "'rnk=1' is not a key of kill-worker"),
        (["--inject", "slow-rank:rank=1,factor=0.5"], "factor='0.5' must be a number in [1, 100]"),
        (["--inject", "slow-rank:rank=1,factor=inf"], "factor='inf' must be a number in [1, 100]"),
        (["--inject", "slow-node:node=1,factor=nan"], "factor='nan' must be a number in [1, 100]"),
        (
            ["--inject", "etcd-restart:step=3,downtime=1e9"],
            "downtime='1e9' must be a number in [0, 60]",
        ),
        (
            ["--inject", "pause-controller:step=3,seconds=1e9"],
            "seconds='1e9' must be a number in [0, 600]",
        ),
        (["--inject", "kill-worker:rank=²,step=3"], "rank='²' must be an integer in [0,"),
        (["--inject", "kill-worker:rank=1,step=1" + "0" * 30], "must be an integer in [0, 9999"),
        (["--inject", "kill-worker:rank=9,step=3"], "rank=9 is not one of the job's 2 ranks"),
        (["--inject", "kill-agent:node=3,step=3"], "node=3 is not one of the 3 nodes"),
        (["--inject", "hang-worker:rank=1,step=99"], "step=99 is after the last step (50)"),
        (["--inject", "corrupt-checkpoint:latest"], "add a fault that makes the job restart"),
        (["--nodes", "0"], "--nodes = 0: must be an integer >= 1"),
        (["--heartbeat-interval", "0"], "--heartbeat-interval = 0.0: must be in [0.05, 60]"),
        (["--nproc-per-node", "2", "--set", "parallel.tp=4"], "parallel.tp"),
    ],
)
def test_bad_launch_arguments_are_refused(args, message, capsys, tmp_path):
    code = cli.main(["launch", "--spares", "1", "--run-dir", str(tmp_path / "run"), *args])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything started


def _wait(what, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_agent_runs_current_commands_only_and_survives_losing_etcd(tmp_path):
    keys, node = JobKeys("agent-test"), "n0"
    with EmbeddedEtcd(unsafe_no_fsync=True) as etcd:
        store = Store(StoreConfig.parse(etcd.endpoint, retry_s=10.0))
        # A command left from before the agent started must never run.
        store.put(keys.command(node), make_command(keys.job_id, 0, "selfcheck", "stale"))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        env.pop("MEGASCALE_INJECT", None)
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "megascale.cli", "agent", "--job", keys.job_id,
                "--node", node, "--endpoints", etcd.endpoint, "--run-dir", str(tmp_path),
                "--heartbeat-interval", "0.25", "--selfcheck", "builtin",
            ],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            registered = _wait("registration", lambda: store.get(keys.node(node)), 30)
            assert registered.json()["hardware"]["cpus"] == os.cpu_count()
            beat = _wait("a heartbeat", lambda: store.get(keys.heartbeat(node)))
            assert {"workers", "network", "flight", "errors"} <= set(beat.json())

            def ack():
                kv = store.get(keys.ack(node))
                return kv.json() if kv is not None else None

            # Another job's command, one of a generation beyond the one the controller
            # published (forged: run, it would make the agent ignore every real command after
            # it), then a current one (generation 3, published), then an older one.
            store.put(keys.generation, GenerationRecord(3, {node: [0]}))
            store.put(keys.command(node), make_command("other-job", 5, "selfcheck", "other"))
            store.put(keys.command(node), make_command(keys.job_id, 999999, "stop", "forged"))
            store.put(keys.command(node), make_command(keys.job_id, 3, "selfcheck", "c1"))
            first = _wait("the self-check ack", ack, 90)  # the zygote imports torch first
            assert first["id"] == "c1" and first["ok"], first
            store.put(keys.command(node), make_command(keys.job_id, 2, "stop", "old"))
            time.sleep(1.0)
            assert ack()["id"] == "c1"  # "stale", "other", "forged" and "old" were never run

            # etcd gone for 3 s (longer than the agent's lease TTL): the agent keeps going.
            etcd.kill()
            time.sleep(3.0)
            assert agent.poll() is None
            etcd.start()
            restarted = time.time()

            def beat_since_restart():
                kv = store.get(keys.heartbeat(node))  # absent while the agent registers again
                return kv is not None and kv.json()["time"] > restarted

            _wait("a heartbeat after the restart", beat_since_restart)
            # Its lease ends (as if it had expired while etcd was unreachable): it registers again.
            lease = store.get(keys.node(node)).lease
            store.revoke(lease)
            again = _wait("re-registration", lambda: store.get(keys.node(node)))
            assert again.lease != lease and agent.poll() is None
        finally:
            agent.send_signal(signal.SIGTERM)
            _, err = agent.communicate(timeout=30)
        assert agent.returncode == 0, err[-3000:]
        assert store.get(keys.node(node)) is None  # deregistered on the way out
        assert "etcd unreachable" in err and "registering again" in err, err[-3000:]
        assert "generation beyond the controller's (3)" in err, err[-3000:]
        store.close()


def _sleeping_rank(argv: list[str]) -> int:
    time.sleep(600)
    return 0


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (OSError, IndexError):
        return True


def test_a_killed_zygote_is_reported_as_this_nodes_fault(monkeypatch, tmp_path):
    """The zygote killed under running workers: they die with it, the pool reports their exits
    (SIGKILL, not a peer's failure) and a ``zygote_died`` error at once, and a later fork (the
    self-check before a restart) fails naming the zygote instead of waiting."""
    monkeypatch.setitem(zygotes.TARGETS, "train", _sleeping_rank)  # forked: the zygote has it
    zygote = zygotes.Zygote(preload=())
    changed = threading.Event()
    pool = workers.WorkerPool(zygote, tmp_path, "node-0", on_change=changed.set)
    try:
        [worker] = pool.start(1, [0], {}, [])
        os.kill(zygote.pid, signal.SIGKILL)
        assert changed.wait(30)
        status = pool.status(1)["0"]
        assert (status["alive"], status["exit_code"], status["peer"]) == (False, -9, False)
        [(lost, error)] = pool.scan()
        assert lost is worker and error.kind == "zygote_died" and not error.notice
        assert f"zygote (pid {zygote.pid}) died" in error.text
        _wait("the worker to die with its zygote", lambda: _dead(worker.pid))
        with pytest.raises(RuntimeError, match=f"zygote \\(pid {zygote.pid}\\) died"):
            pool.selfcheck(1, timeout_s=30)
        assert pool.scan() == [] and pool.running() == []
    finally:
        pool.stop(0.5)
        zygote.close()
