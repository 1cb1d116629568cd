"""The pure parts of the scale model: which groups megatron-core creates, how many store
operations each group-setup path costs, and the simulator's bookkeeping."""

from __future__ import annotations

from collections import Counter

import pytest

from megascale.launcher import rendezvous as rdzv
from megascale.parallel.layout import Layout
from megascale.tools.sim.agents import SimPool
from megascale.tools.sim.scenario import percentile


@pytest.mark.parametrize(("world", "tp", "pp"), [(8, 2, 2), (64, 8, 4), (96, 4, 3)])
def test_every_rank_is_in_exactly_one_group_of_each_kind(world, tp, pp):
    layout = Layout.from_world(world, tp=tp, pp=pp)
    groups = rdzv.megatron_groups(layout)
    for kind in ("dp", "cp", "mp", "tp", "pp", "tp-dp"):
        members = Counter(
            r for g in groups if g.kind == kind and g.backend == "nccl" for r in g.ranks
        )
        assert members == Counter(range(world)), kind
    assert [g.ranks for g in groups if g.kind == "tp"] == [tuple(g) for g in layout.tp_groups()]
    assert sum(1 for g in groups if g.backend == "gloo") == 2 * tp * pp


def test_groups_of_is_what_each_rank_computes_locally():
    layout = Layout.from_world(32, tp=4, pp=2)
    groups = rdzv.megatron_groups(layout)
    for rank in (0, 5, 31):
        mine = rdzv.groups_of(layout, rank)
        assert all(rank in groups[i].ranks for i in mine)
        assert len(mine) == sum(1 for g in groups if rank in g.ranks)


@pytest.mark.parametrize("barrier", [False, True])
def test_closed_form_count_matches_the_replayed_stream(barrier):
    layout = Layout.from_world(64, tp=8, pp=2)
    counted = rdzv.count_ops(rdzv.default_ops(layout, barrier=barrier)).total()
    assert rdzv.default_op_count(layout, barrier=barrier) == counted


def test_ours_is_linear_and_the_default_paths_are_not():
    def counts(n):
        layout = Layout.from_world(n, tp=8, pp=4)
        ours = rdzv.count_ops(rdzv.ours_ops(layout)).total()
        return (
            ours,
            rdzv.default_op_count(layout, barrier=False),
            rdzv.default_op_count(layout, barrier=True),
        )

    (o1, d1, l1), (o4, d4, l4) = counts(1024), counts(4096)
    assert 3.9 < o4 / o1 < 4.1  # O(N): about 5 round trips per rank
    assert o4 < 6 * 4096
    assert d4 / d1 > 8  # gloo full mesh of the data-parallel groups: O(N^2 / (tp * pp))
    # Without the gloo twins (parallel.build_groups) the default path is linear too.
    no_gloo = [
        rdzv.default_op_count(Layout.from_world(n, tp=8, pp=4), barrier=False, gloo=False)
        for n in (1024, 4096)
    ]
    assert 3.9 < no_gloo[1] / no_gloo[0] < 4.1
    assert l4 / l1 > 14  # a world barrier per new_group: O(groups x world) = O(N^2)


def test_multi_get_asks_each_rank_only_for_its_own_groups():
    layout = Layout.from_world(16, tp=2, pp=2)
    groups = rdzv.megatron_groups(layout)
    _, (writes, reads) = list(rdzv.ours_ops(layout))
    assert len(writes) == sum(1 for g in groups if g.backend == "nccl" and len(g.ranks) > 1)
    assert all(op.kind == "multi_get" for op in reads)
    assert max(len(op.keys) for op in reads) <= len({g.kind for g in groups})


def test_replay_estimate_scales_the_sample():
    r = rdzv.Replay(ops=100, total_ops=1000, elapsed_s=0.5)
    assert r.estimated_s == pytest.approx(5.0)


def test_percentile_and_sim_pool():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 1.0) == 2.0
    pool = SimPool()
    pool.start(2, [8, 9], {}, [])
    assert set(pool.status(2)) == {"8", "9"} and pool.status(1) == {}
    assert pool.selfcheck(8) == (True, "simulated", [])
    pool.stop()
    assert pool.status(2) == {}
