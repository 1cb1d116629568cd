"""`megascale selfcheck` as a user and the node agent run it: real processes, real gloo groups.

On CPU the GPU checks are skipped with a reason while the host and network checks are measured;
an impossible threshold fails its check (exit code 1, the JSON names it and why); two processes
acting as neighbour nodes on 127.0.0.1 all-reduce with each other; a neighbour that never comes
fails the check with a clear detail within the network timeout instead of hanging.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from megascale.launcher.local import free_port

pytestmark = pytest.mark.slow


def _selfcheck(*args: str, tmp_path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megascale.cli", "selfcheck", "--dir", str(tmp_path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, dict, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, (json.loads(out) if out.strip().startswith("{") else {}), err


def _checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_cpu_node_measures_host_and_gloo_network_and_skips_gpu(tmp_path):
    # a low disk threshold: this tests the measurement, not the CI machine's disk (a stall there
    # can drop 16 MiB + fsync below the profile's 20 MB/s)
    code, report, err = _finish(
        _selfcheck("--json", "--quick", "--set", "host.disk_write=1", tmp_path=tmp_path)
    )
    assert code == 0, err
    checks = _checks(report)
    assert report["ok"] and report["failed"] == [] and report["profile"] == "cpu"
    assert report["node"] and report["time"]
    gpu = [c for n, c in checks.items() if n.startswith("gpu.")]
    assert len(gpu) == 11
    assert all(c["status"] == "skipped" and c["detail"] == "no CUDA device" for c in gpu)
    measured = [
        "host.memory_bandwidth",
        "host.disk_write",
        "host.disk_free",
        "net.loopback_tcp@127.0.0.1",
        "net.intranode_alltoall",
    ]
    for name in measured:
        c = checks[name]
        assert c["status"] == "pass" and c["value"] > 0 and c["threshold"] > 0, c
        assert c["op"] == ">=" and c["unit"] and c["duration_s"] > 0
    assert checks["host.disk_write"]["threshold"] == 1.0
    assert "gloo, 2 processes" in checks["net.intranode_alltoall"]["detail"]
    assert checks["net.neighbour_allreduce"]["status"] == "skipped"


def test_impossible_threshold_exits_1_and_json_names_the_check(tmp_path):
    code, report, _ = _finish(
        _selfcheck(
            *"--json --quick --only net.loopback* --only host.disk_free".split(),
            *("--set", "net.loopback_tcp=1e6"),
            tmp_path=tmp_path,
        )
    )
    assert code == 1
    assert not report["ok"]
    assert report["failed"] and all(n.startswith("net.loopback_tcp@") for n in report["failed"])
    assert "net.loopback_tcp@127.0.0.1" in report["failed"]
    failed = _checks(report)["net.loopback_tcp@127.0.0.1"]
    assert failed["threshold"] == 1e6 and "Gbit/s is not >= 1e+06" in failed["detail"]
    assert _checks(report)["host.disk_free"]["status"] == "pass"


def test_human_table_and_bad_override(tmp_path):
    proc = _selfcheck("--only", "host.disk_free", tmp_path=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "host.disk_free" in out and "PASS" in out and out.strip().endswith("result: PASS")
    code, _, err = _finish(_selfcheck("--set", "host.disk_speed=1", tmp_path=tmp_path))
    assert code == 2 and "host.disk_speed" in err and "accepted in [host]" in err


def test_two_neighbours_allreduce_with_each_other(tmp_path):
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [
        _selfcheck(
            *f"--json --quick --only net.neighbour* --self-endpoint {me} --peer {peer}".split(),
            *("--net-timeout", "30"),
            tmp_path=tmp_path,
        )
        for me, peer in ((a, b), (b, a))
    ]
    for proc, peer in zip(procs, (b, a), strict=True):
        code, report, err = _finish(proc)
        assert code == 0, err
        c = _checks(report)["net.neighbour_allreduce"]
        assert c["status"] == "pass" and c["value"] > 0 and c["unit"] == "GB/s", c
        assert f"gloo over TCP with {peer}" in c["detail"]


@pytest.mark.parametrize("role", ["hosts the store", "joins the store"])
def test_unreachable_neighbour_fails_within_the_timeout(tmp_path, role):
    ports = sorted([free_port(), free_port()], key=lambda p: f"127.0.0.1:{p}")
    me, peer = ports if role == "hosts the store" else ports[::-1]
    timeout = 3
    start = time.monotonic()
    code, report, err = _finish(
        _selfcheck(
            *f"--json --only net.neighbour* --net-timeout {timeout}".split(),
            *("--self-endpoint", f"127.0.0.1:{me}", "--peer", f"127.0.0.1:{peer}"),
            tmp_path=tmp_path,
        ),
        timeout=60,
    )
    wall = time.monotonic() - start
    assert code == 1, err
    c = _checks(report)["net.neighbour_allreduce"]
    assert report["failed"] == ["net.neighbour_allreduce"]
    assert c["status"] == "fail" and c["value"] is None
    assert f"all-reduce with 127.0.0.1:{peer} failed" in c["detail"]
    expected = "peers did not join" if role == "hosts the store" else "cannot reach"
    assert expected in c["detail"], c["detail"]
    # ended by its own deadline (about the timeout; torch is imported before the timer starts),
    # well before the 2.5 x timeout + 5 s after which the check gives up on it as hung
    assert c["duration_s"] < timeout + 7, c
    assert wall < 30, f"no hang: the whole command took {wall:.1f} s"
