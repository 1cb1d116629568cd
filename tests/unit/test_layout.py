"""Rank layout: golden tables written out by hand, and equality with megatron-core's RankGenerator."""

from __future__ import annotations

import itertools

import pytest

from megascale.parallel.layout import Coord, Layout

# --- golden tables ----------------------------------------------------------------------------
# rank = tp + TP * (dp + DP * pp): tensor fastest, then data, then pipeline ("tp-cp-ep-dp-pp").

GOLDEN = {
    # world 8 = tp2 x pp2 x dp2
    (8, 2, 2, 2): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        dp=[[0, 2], [1, 3], [4, 6], [5, 7]],
        pp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]],
        coords=[
            (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
            (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1),
        ],
    ),
    # world 16 = tp2 x pp4 x dp2
    (16, 2, 4, 2): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        dp=[[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        pp=[[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        embedding=[[0, 12], [1, 13], [2, 14], [3, 15]],
        coords=[
            (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
            (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1),
            (0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1),
            (0, 3, 0), (0, 3, 1), (1, 3, 0), (1, 3, 1),
        ],
    ),
    # world 8 = dp8 only
    (8, 1, 1, 8): dict(
        tp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        dp=[[0, 1, 2, 3, 4, 5, 6, 7]],
        pp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        embedding=[[0], [1], [2], [3], [4], [5], [6], [7]],
        coords=[(d, 0, 0) for d in range(8)],
    ),
    # world 8 = tp4 x pp2 (dp1)
    (8, 4, 2, 1): dict(
        tp=[[0, 1, 2, 3], [4, 5, 6, 7]],
        dp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]],
        coords=[(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2),
                (0, 1, 3)],
    ),
}  # fmt: skip


@pytest.mark.parametrize("shape", list(GOLDEN), ids=lambda s: "w{}-tp{}-pp{}-dp{}".format(*s))
def test_golden_tables(shape):
    world, tp, pp, dp = shape
    want = GOLDEN[shape]
    layout = Layout(world, tp, pp, dp)
    assert layout.tp_groups() == want["tp"]
    assert layout.dp_groups() == want["dp"]
    assert layout.pp_groups() == want["pp"]
    assert layout.embedding_groups() == want["embedding"]
    assert [tuple(layout.coords(r)) for r in range(world)] == want["coords"]
    for rank, (d, p, t) in enumerate(want["coords"]):
        assert layout.rank(dp=d, pp=p, tp=t) == rank


def test_coords_is_named_and_describe_names_the_rank():
    layout = Layout(world_size=8, tp=2, pp=2, dp=2)
    assert layout.coords(5) == Coord(dp=0, pp=1, tp=1)
    assert layout.coords(5).pp == 1
    assert layout.describe(5) == "rank 5 (dp=0, pp=1, tp=1)"
    assert layout.describe(6) == "rank 6 (dp=1, pp=1, tp=0)"


def _shapes():
    sizes = (1, 2, 3, 4, 8)
    return [(tp, pp, dp) for tp, pp, dp in itertools.product(sizes, repeat=3) if tp * pp * dp <= 64]


def test_matches_megatron_core_rank_generator():
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    for tp, pp, dp in _shapes():
        layout = Layout(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp)
        gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        shape = f"tp{tp} pp{pp} dp{dp}"
        assert layout.tp_groups() == gen.get_ranks("tp"), shape
        assert layout.dp_groups() == gen.get_ranks("dp"), shape
        assert layout.pp_groups() == gen.get_ranks("pp"), shape
        want_embedding = [parallel_state.default_embedding_ranks(g) for g in gen.get_ranks("pp")]
        assert layout.embedding_groups() == want_embedding, shape


@pytest.mark.parametrize("tp, pp, dp", _shapes())
def test_every_rank_in_exactly_one_group_of_each_kind(tp, pp, dp):
    layout = Layout(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp)
    ranks = list(range(layout.world_size))
    for groups, size in [
        (layout.tp_groups(), tp),
        (layout.dp_groups(), dp),
        (layout.pp_groups(), pp),
    ]:
        assert sorted(r for g in groups for r in g) == ranks
        assert all(len(g) == size for g in groups)
    for rank in ranks:
        c = layout.coords(rank)
        assert layout.rank(dp=c.dp, pp=c.pp, tp=c.tp) == rank
        assert [rank == g[c.tp] for g in layout.tp_groups() if rank in g] == [True]
        assert [rank == g[c.pp] for g in layout.pp_groups() if rank in g] == [True]
        assert [rank == g[c.dp] for g in layout.dp_groups() if rank in g] == [True]


def test_from_world_derives_dp():
    assert Layout.from_world(16, tp=2, pp=4) == Layout(16, 2, 4, 2)
    with pytest.raises(ValueError, match="divide world_size = 12"):
        Layout.from_world(12, tp=8, pp=1)


@pytest.mark.parametrize(
    "args, message",
    [
        ((8, 2, 2, 3), "Layout.world_size = 8: must equal tp \\* pp \\* dp = 2 \\* 2 \\* 3 = 12"),
        ((8, 0, 2, 2), "Layout.tp = 0: must be a positive integer"),
        ((8, 2, True, 4), "Layout.pp = True: must be a positive integer"),
        ((8, 2, 2, 2.0), "Layout.dp = 2.0: must be a positive integer"),
    ],
)
def test_invalid_layouts_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        Layout(*args)


def test_out_of_range_coordinates_are_refused():
    layout = Layout(8, 2, 2, 2)
    with pytest.raises(ValueError, match=r"rank = 8: must be an integer in \[0, 8\)"):
        layout.coords(8)
    with pytest.raises(ValueError, match=r"tp = 2: must be an integer in \[0, 2\)"):
        layout.rank(dp=0, pp=0, tp=2)
    with pytest.raises(ValueError, match=r"pp = -1"):
        layout.rank(dp=0, pp=-1, tp=0)


def test_layout_is_frozen():
    layout = Layout(8, 2, 2, 2)
    with pytest.raises(AttributeError):
        layout.tp = 4  # type: ignore[misc]
