"""Bad input and a busy run directory are refused by the real CLI before anything starts: exit
code 2, one line naming the field (or flag, or variable), the value and the rule, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.launcher.runlock import LOCK_NAME, prepare_run_dir

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGASCALE_INJECT"}
    return {**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **extra}


def refused(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``megascale ARGS``; assert it was refused in one line; that line."""
    proc = subprocess.run(
        [sys.executable, "-m", "megascale.cli", *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("model.num_layers=1000000000", ["model.num_layers = 1000000000", "GiB", "available"]),
        ("optim.lr=inf", ["optim.lr = inf", "finite"]),
        ("model.init_method_std=inf", ["model.init_method_std = inf", "finite"]),
        ("optim.eps=inf", ["optim.eps = inf", "finite"]),
        ("data.path=", ["data.path = ''", "token file prefix"]),
        ("data.path=/nonexistent/tokens", ["data.path='/nonexistent/tokens'", ".idx"]),
        ("checkpoint.url=s3://bucket/run", ["checkpoint.url = 's3://bucket/run'", "package"]),
    ],
)
def test_train_refuses_bad_values(tmp_path, override, fragments):
    if override.startswith("checkpoint.url"):
        pytest.importorskip("fsspec")
        try:
            import s3fs  # noqa: F401

            pytest.skip("s3fs is installed: s3:// is usable here")
        except ImportError:
            pass
    line = refused("train", "--set", override, "--run-dir", str(tmp_path / "run"))
    for fragment in fragments:
        assert fragment in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_launch_refuses_a_non_positive_timeout_and_huge_models(tmp_path):
    line = refused("launch", "--timeout", "-5", "--run-dir", str(tmp_path / "a"))
    assert "--timeout = -5.0" in line and "> 0" in line
    line = refused("launch", "--set", "model.num_layers=1000000000", "--run-dir", str(tmp_path))
    assert "model.num_layers = 1000000000" in line and "available" in line


def test_config_file_that_is_not_utf8(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_bytes(b"[model]\nnum_layers = 2\n# \xff\xfe\n")
    line = refused("train", str(config), "--run-dir", str(tmp_path / "run"))
    assert str(config) in line and "UTF-8" in line


def test_run_directory_that_is_a_file_or_cannot_be_created(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    line = refused("train", "--run-dir", str(afile))
    assert f"--run-dir = {str(afile)!r}" in line and "is a file" in line
    line = refused("launch", "--run-dir", str(afile / "run"))
    assert "--run-dir" in line and "writable directory" in line


@pytest.mark.parametrize("problem", ["missing", "a file"])
def test_tmpdir_missing_or_not_a_directory(tmp_path, problem):
    tmp = tmp_path / "tmp"
    if problem == "a file":
        tmp.write_text("")
    env = _env(TMPDIR=str(tmp))
    line = refused("train", "--run-dir", str(tmp_path / "r"), env=env)
    assert f"TMPDIR = {str(tmp)!r}" in line and "writable directory" in line


def test_a_busy_run_directory_is_refused_naming_its_holder(tmp_path):
    run_dir = tmp_path / "run"
    lock = prepare_run_dir(run_dir)  # this process holds it, as a running job would
    try:
        for command in ("train", "launch"):
            line = refused(command, "--run-dir", str(run_dir))
            assert f"pid {os.getpid()} on {socket.gethostname()}" in line, line
            assert "in use by another job" in line, line
    finally:
        lock.release()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = {"pid": 999999999, "host": socket.gethostname(), "started": "2020-01-01T00:00:00"}
    (run_dir / LOCK_NAME).write_text(json.dumps(stale))
    proc = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "train", "--set", "train.steps=2",
         "--set", "optim.warmup_steps=0", "--run-dir", str(run_dir)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    holder = json.loads((run_dir / LOCK_NAME).read_text())
    assert holder["pid"] != stale["pid"] and holder["started"] != stale["started"]
    assert "taken over" in proc.stderr


@pytest.mark.parametrize(
    "node, fragment",
    [
        ("../../..", "--node = '../../..'"),
        ("n" * 5000, "(5000 characters)"),
        ("node-0\n", "--node = 'node-0\\n'"),
    ],
)
def test_agent_names_are_refused_before_anything_is_written(tmp_path, node, fragment):
    run_dir = tmp_path / "a" / "b" / "run"
    line = refused(
        "agent", "--job", "j", "--node", node, "--run-dir", str(run_dir),
        "--endpoints", "127.0.0.1:1",
    )  # fmt: skip
    assert fragment in line and "letters, digits" in line, line
    assert len(line) < 300, line
    assert list(tmp_path.rglob("*")) == [], "written before the name was refused"


@pytest.mark.parametrize("flag", ["--addr", "--metrics-addr"])
def test_an_agent_address_this_machine_cannot_listen_on_is_refused(tmp_path, flag):
    """Never a fallback to every interface: an address that is not this machine's is refused."""
    run_dir = tmp_path / "run"
    line = refused(
        "agent", "--job", "j", "--node", "n0", "--run-dir", str(run_dir),
        "--endpoints", "127.0.0.1:1", flag, "203.0.113.7",  # TEST-NET-3: nobody's address
    )  # fmt: skip
    assert f"{flag} '203.0.113.7': this machine cannot listen on it" in line, line
    assert list(tmp_path.rglob("*")) == [], "written before the address was refused"


def test_controller_id_is_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "a" / "run"
    line = refused(
        "controller", "--job", "j", "--id", "../../x", "--nodes", "1", "--nproc-per-node", "1",
        "--run-dir", str(run_dir), "--endpoints", "127.0.0.1:1",
    )  # fmt: skip
    assert "--id = '../../x'" in line and "letters, digits" in line, line
    assert list(tmp_path.rglob("*")) == [], "written before the name was refused"


@pytest.mark.parametrize("command", ["agent", "launch", "train"])
def test_a_run_directory_component_over_255_bytes_is_refused(tmp_path, command):
    run_dir = tmp_path / ("r" * 300)
    extra = (
        ["--job", "j", "--node", "n", "--endpoints", "127.0.0.1:1"] if command == "agent" else []
    )
    line = refused(command, *extra, "--run-dir", str(run_dir))
    assert "--run-dir = " in line and "300 bytes long; each must be at most 255" in line, line


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("slow-rank:rank=0,factor=inf", "factor='inf' must be a number in [1, 100]"),
        ("etcd-restart:step=3,downtime=1e9", "downtime='1e9' must be a number in [0, 60]"),
    ],
)
def test_fault_injection_out_of_range_is_refused(tmp_path, spec, fragment):
    line = refused("launch", "--inject", spec, "--run-dir", str(tmp_path / "run"))
    assert fragment in line, line
    assert not (tmp_path / "run").exists()


def test_launch_slurm_is_refused_outside_an_allocation_and_beyond_it(tmp_path):
    """``--slurm`` needs an allocation and fits in it; ``--addr`` is for ``--slurm`` only; a fault
    that names a node by index cannot be injected on an allocation's hosts."""
    run = str(tmp_path / "run")
    env = {k: v for k, v in _env().items() if not k.startswith("SLURM_")}
    line = refused("launch", "--slurm", "--run-dir", run, env=env)
    assert "--slurm: not inside a Slurm allocation" in line, line
    line = refused("launch", "--addr", "127.0.0.1", "--run-dir", run, env=env)
    assert "--addr 127.0.0.1: only with --slurm" in line, line
    if not shutil.which("scontrol") or not shutil.which("srun"):
        pytest.skip("scontrol/srun not installed: the allocation checks need them")
    conf = tmp_path / "slurm.conf"  # what scontrol needs to expand a host list
    conf.write_text("ClusterName=refusals\nSlurmctldHost=localhost\n")
    alloc = {**env, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_CONF": str(conf)}
    line = refused("launch", "--slurm", "--nodes", "3", "--run-dir", run, env=alloc)
    assert "--nodes = 3: the allocation has 2 host(s) (gpu1, gpu2)" in line, line
    line = refused(
        "launch", "--slurm", "--nodes", "1", "--spares", "2", "--run-dir", run, env=alloc
    )
    assert "--nodes + --spares = 3: the allocation has 2 host(s)" in line, line
    spec = "kill-agent:node=1,step=3"
    line = refused("launch", "--slurm", "--inject", spec, "--run-dir", run, env=alloc)
    assert "--inject kill-agent: not with --slurm" in line, line
    assert not (tmp_path / "run").exists()
