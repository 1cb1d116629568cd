"""The scale simulator against real services: group-setup store traffic replayed on a real
TCPStore, and a small control-plane simulation (real etcd, the real controller process, real
agents with simulated workers, as threads or as asyncio tasks) that must detect killed nodes
within 2 heartbeats + 1 s."""

from __future__ import annotations

import pytest

from megascale.launcher import rendezvous as rdzv
from megascale.parallel.layout import Layout
from megascale.robustness.simulate import run_scenario


def test_replay_issues_every_operation_against_a_real_tcpstore():
    layout = Layout.from_world(64, tp=8, pp=2)
    total = rdzv.count_ops(rdzv.ours_ops(layout)).total()
    result = rdzv.replay(rdzv.ours_ops(layout), total, threads=2)
    assert result.ops == total and result.elapsed_s > 0
    sampled = rdzv.replay(rdzv.default_ops(layout, barrier=True, sample_every=25), 10**6, threads=2)
    assert 0 < sampled.ops < rdzv.default_op_count(layout, barrier=True)


@pytest.mark.slow
def test_twenty_agents_a_killed_node_is_detected_within_the_bound(etcd, tmp_path):
    heartbeat = 1.0
    result = run_scenario(
        etcd.endpoint, etcd.pid, tmp_path / "run", 20,
        heartbeat_s=heartbeat, kills=2, processes=2, steady_s=2.0,
    )  # fmt: skip
    assert result.notes == [], result
    assert len(result.detect_s) == 2, result
    assert max(result.detect_s) <= 2 * heartbeat + 1.0, result
    assert result.controller_cpu < 1.0, result  # 10 ms ticks: may read 0 over 2 s
    assert result.writes_per_s > 5, result  # ~one heartbeat per node per second (20/s)
    assert all(s > 0 for s in result.restart_s), result


@pytest.mark.slow
def test_twenty_asyncio_agents_a_killed_node_is_detected_within_the_bound(etcd, tmp_path):
    heartbeat = 1.0
    result = run_scenario(
        etcd.endpoint, etcd.pid, tmp_path / "run", 20,
        heartbeat_s=heartbeat, kills=2, processes=2, steady_s=2.0, agents="asyncio",
    )  # fmt: skip
    assert result.notes == [], result
    assert len(result.detect_s) == 2, result
    assert max(result.detect_s) <= 2 * heartbeat + 1.0, result
    assert result.controller_cpu < 1.0, result
    assert result.writes_per_s > 5, result  # ~one heartbeat per node per second (20/s)
    assert all(s > 0 for s in result.restart_s), result
