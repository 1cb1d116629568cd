"""How jobs end and what they expose: signals to ``megascale launch`` and ``megascale train``,
etcd or the only controller killed under a running launch, and what listens where.

Real processes throughout: the CLI in a subprocess, its etcd, agents, controllers and ranks; the
faults are signals sent from here. A job that should finish must end with the fault-free run's
parameters (the module's reference launch).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cluster import BASE, Run, _env

pytestmark = pytest.mark.slow

LONG = ["--set", "train.steps=2000", "--set", "checkpoint.interval=0"]
"""A run that is still training when the test signals it."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    return Run(tmp_path_factory.mktemp("reference"))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megascale.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or _env(),
    )


def _wait_for(what: str, check, timeout_s: float = 180.0, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"exited ({proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout_s} s")


def _steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the processes ``pids`` hold."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                found.append((_address(addr), int(port, 16)))
    return found


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # each word little-endian
    if len(raw) == 4:
        return ".".join(str(b) for b in words[0])
    if raw == bytes(16):
        return "::"
    return ":".join(b"".join(words).hex()[i : i + 4] for i in range(0, 32, 4))


def _check_nothing_on_every_interface(listeners: list[tuple[str, int]]) -> None:
    assert listeners, "the job listens nowhere: the check would prove nothing"
    wide = [(a, p) for a, p in listeners if a in ("0.0.0.0", "::")]
    assert not wide, f"listening on every interface: {wide} (all: {listeners})"


def test_sigterm_to_launch_stops_in_order_and_nothing_listens_wide(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run_dir = tmp_path / "run"
    env = {**_env(), "TMPDIR": str(tmp)}
    proc = _cli("launch", *BASE, *LONG, "--run-dir", str(run_dir), env=env)
    _wait_for("a training step", lambda: _steps(run_dir) >= 2, proc=proc)
    assert list(tmp.glob("megascale-etcd-*")), "etcd's temporary directory is not under TMPDIR"
    _check_nothing_on_every_interface(_listening(_descendants(proc.pid)))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # stopping the agents and their workers takes longer than this
    proc.send_signal(signal.SIGTERM)  # a second one while it stops: handled too
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert "SIGTERM received while stopping: the stop goes on" in output, output[-4000:]
    final = json.loads((run_dir / "final.json").read_text())
    assert final["state"] == "interrupted" and final["reason"] == "SIGTERM received"
    assert 2 <= final["final_step"] < 2000 and not final["finished"]
    assert not list(tmp.glob("megascale-etcd-*")), "etcd's temporary directory was left behind"
    assert not any(_alive(p) for p in _descendants(proc.pid) if p != proc.pid)


def test_sighup_with_a_corrupt_newest_checkpoint_still_stops_in_order_and_writes_final(tmp_path):
    # The terminal closes (SIGHUP to the launcher's process group) after the newest checkpoints
    # were truncated on disk: the stop is the orderly one and the final digest refuses the files.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run_dir = tmp_path / "run"
    env = {**_env(), "TMPDIR": str(tmp)}
    slow = ["--inject", "slow-rank:rank=0,factor=6"]  # checkpoints far apart in time
    proc = _cli("launch", *BASE, *LONG, "--set", "checkpoint.interval=4", *slow,
                "--run-dir", str(run_dir), env=env)  # fmt: skip
    complete = lambda: list(run_dir.glob("checkpoints/step_*/manifest.json"))  # noqa: E731
    _wait_for("a complete checkpoint", complete, proc=proc)
    for data in run_dir.glob("checkpoints/step_*/rank_*/*.distcp"):
        data.write_bytes(data.read_bytes()[:1000])
    group = os.getpgid(proc.pid)
    for pid in _descendants(proc.pid):
        try:
            if os.getpgid(pid) == group:  # not etcd: it has its own session, as on a terminal
                os.kill(pid, signal.SIGHUP)
        except ProcessLookupError:
            pass
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    final = json.loads((run_dir / "final.json").read_text())
    assert final["state"] == "interrupted" and final["reason"] == "SIGHUP received", final
    assert final["param_digest"] is None and final["digest_step"] is not None, final
    assert not list(tmp.glob("megascale-etcd-*")), "etcd's temporary directory was left behind"
    assert not any(_alive(p) for p in _descendants(proc.pid) if p != proc.pid)


def test_a_link_planted_at_final_json_during_the_run_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run_dir = tmp_path / "run"
    proc = _cli("launch", *BASE, "--set", "train.steps=6", "--run-dir", str(run_dir))
    _wait_for("a training step", lambda: _steps(run_dir) >= 1, proc=proc)
    (run_dir / "final.json").symlink_to(victim)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert "final.json not written" in output and "it is a symlink" in output, output[-4000:]
    assert victim.read_text() == "precious\n"


def test_sigterm_to_train_reaches_its_ranks_and_sigkill_takes_them_along(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        run_dir = tmp_path / sig.name
        proc = _cli("train", "--nproc-per-node", "2", *LONG, "--run-dir", str(run_dir))
        _wait_for("a training step", lambda d=run_dir: _steps(d) >= 2, proc=proc)
        ranks = [p for p in _descendants(proc.pid) if p != proc.pid]
        assert len(ranks) >= 2, ranks
        _check_nothing_on_every_interface(_listening([proc.pid, *ranks]))
        proc.send_signal(sig)
        output = proc.communicate(timeout=60)[0]
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM, output[-4000:]
            assert "stopped by SIGTERM" in output and "Traceback" not in output, output[-4000:]
        _wait_for("the ranks to exit", lambda r=ranks: not any(_alive(p) for p in r), 30)
        step = _steps(run_dir)
        time.sleep(1.0)
        assert _steps(run_dir) == step < 2000  # nothing trains on


def test_killed_etcd_and_killed_only_controller_are_restarted(reference, tmp_path):
    # slow-rank only sleeps: the parameters are the fault-free run's, the run lasts long enough
    # for both kills and their recoveries.
    run_dir = tmp_path / "run"
    proc = _cli("launch", *BASE, "--inject", "slow-rank:rank=0,factor=6", "--run-dir", str(run_dir))
    log = run_dir / "logs" / "launch.log"

    def pid_of(pattern: str) -> int | None:
        found = re.search(pattern, log.read_text()) if log.exists() else None
        return int(found.group(1)) if found else None

    etcd = _wait_for("etcd's pid", lambda: pid_of(r"etcd \S+ healthy on \S+ in \S+ s \(pid (\d+)"))
    controller = _wait_for(
        "the controller's pid", lambda: pid_of(r"controller-0 started \(pid (\d+)")
    )
    _wait_for("step 3", lambda: _steps(run_dir) >= 3, proc=proc)
    os.kill(etcd, signal.SIGKILL)
    _wait_for("etcd back", lambda: "etcd is back" in log.read_text(), 60, proc=proc)
    os.kill(controller, signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    final = json.loads((run_dir / "final.json").read_text())
    assert proc.returncode == 0 and final["finished"], output[-6000:]
    assert final["final_step"] == reference.final["final_step"]
    assert final["param_digest"] == reference.final["param_digest"]
    text = log.read_text()
    assert "starting controller-1" in text and "etcd exited" in text, text[-4000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(
        e["kind"] == "controller_takeover" and e["detail"]["controller"] == "controller-1"
        for e in events
    ), events[-10:]


def test_a_run_directory_moved_aside_mid_run_is_never_written_at_its_old_path(tmp_path):
    run_dir, moved = tmp_path / "run", tmp_path / "run.old"
    proc = _cli("launch", *BASE, "--set", "train.steps=400", "--run-dir", str(run_dir))
    _wait_for("a training step", lambda: _steps(run_dir) >= 1, proc=proc)
    run_dir.rename(moved)  # a new job could now start at the path: the old one leaves it alone
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output[-4000:]
    assert f"stopping the job: the run directory {run_dir} is gone" in output, output[-4000:]
    assert "final.json not written" in output, output[-4000:]
    assert not run_dir.exists()  # nothing re-created, nothing written at the old path
