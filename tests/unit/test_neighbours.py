"""The self-check's neighbour all-reduce: grouping by switch label, the ring and its channels, a
node's verdict from its results, and the controller passing each node its neighbours (including
after a takeover)."""

from __future__ import annotations

import pytest
from test_controller_fsm import ack_all, beat, commands, records, running

from megascale.agent.neighbour_check import TopologyError, load_topology, resolve
from megascale.controller.fsm import ControllerFSM, Evict, SendCommand, StartGeneration
from megascale.controller.neighbours import (
    ABSENT,
    NeighbourResult,
    NeighbourTest,
    judge,
    neighbour_groups,
    plan_neighbour_tests,
    ring_tests,
    suspected,
)


def test_groups_follow_labels_and_small_groups_join_a_neighbouring_one():
    nodes = [f"n{i}" for i in range(8)]
    labels = {"n0": "a", "n1": "b", "n2": "a", "n3": "a", "n4": "b", "n5": "b", "n6": "c"}
    # a: n0 n2 n3; b: n1 n4 n5; c: n6 (too small: joins b); unlabelled n7 joins too
    assert neighbour_groups(nodes, labels) == [["n0", "n2", "n3"], ["n1", "n4", "n5", "n6", "n7"]]
    # no labels: one ring in order; a small first group carries into the next
    assert neighbour_groups(nodes[:4], {}) == [nodes[:4]]
    assert neighbour_groups(nodes[:4], {"n0": "x", "n1": "y", "n2": "y"}) == [nodes[:4]]
    assert neighbour_groups(["n0", "n1"], {"n0": "x", "n1": "y"}) == [["n0", "n1"]]
    assert neighbour_groups(["n0"], {}) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_gives_each_node_two_neighbours_on_distinct_channels(n):
    group = [f"n{i}" for i in range(n)]
    tests = ring_tests(group)
    for i, node in enumerate(group):
        peers = sorted(t.node for t in tests[node])
        want = [group[(i + 1) % n]] if n == 2 else sorted({group[i - 1], group[(i + 1) % n]})
        assert peers == want
        channels = [t.channel for t in tests[node]]
        assert len(set(channels)) == len(channels) and set(channels) <= {0, 1, 2}
        for t in tests[node]:  # both ends of an edge agree on its channel
            assert NeighbourTest(node, t.channel) in tests[t.node]


def test_plan_covers_every_node():
    plan = plan_neighbour_tests(["n0", "n1", "n2", "n3"], {"n0": "a"})
    assert set(plan) == {"n0", "n1", "n2", "n3"} and all(len(v) == 2 for v in plan.values())
    assert plan_neighbour_tests(["n0"], {}) == {"n0": []}


def _r(node, ok, detail="x"):
    return NeighbourResult(node, ok, detail)


def test_a_node_failing_with_every_neighbour_is_the_broken_one():
    ok, detail = judge([_r("n0", False, "peers did not join"), _r("n2", False, "timeout")])
    assert not ok and "every neighbour (n0, n2)" in detail and "peers did not join" in detail
    # a healthy neighbour of the broken node passes and names it
    ok, detail = judge([_r("n1", False, "peers did not join"), _r("n2", True, "1.2 GB/s")])
    assert ok and "failed with n1 (suspected)" in detail and "passed with n2" in detail
    # a pair cannot tell which side is broken: both fail
    ok, detail = judge([_r("n1", False)])
    assert not ok and "its only neighbour" in detail
    assert judge([]) == (True, "no neighbours to all-reduce with")
    assert judge([_r("n1", True), _r("n2", True)])[0]


def test_resolve_uses_each_neighbours_registration():
    regs = {"n1": {"addr": "10.0.0.2", "neighbour_port": 4000}, "n2": {"addr": "10.0.0.3"}}
    out = resolve(
        [NeighbourTest("n1", 1), NeighbourTest("n2", 0), NeighbourTest("n3", 2)], regs.get
    )
    assert out[0] == {"node": "n1", "channel": 1, "host": "10.0.0.2", "port": 4000}
    assert out[1]["host"] is None and out[2]["host"] is None  # no port / not registered


def test_load_topology_names_bad_entries(tmp_path):
    good = tmp_path / "t.toml"
    good.write_text('node-0 = "tor-1"\nnode-1 = "tor-2"\n')
    assert load_topology(str(good), ["node-0", "node-1"]) == {"node-0": "tor-1", "node-1": "tor-2"}
    with pytest.raises(TopologyError, match="node 'node-1' is not one of this launch's nodes"):
        load_topology(str(good), ["node-0"])
    bad = tmp_path / "t.json"
    bad.write_text('{"node-0": 3}')
    with pytest.raises(TopologyError, match="node-0 = 3: must be a non-empty string"):
        load_topology(str(bad), ["node-0"])


def test_controller_sends_each_node_its_neighbours_by_topology():
    fsm, clock = running(nodes=("n0", "n1", "n2", "n3"))
    for node, label in {"n0": "a", "n1": "b", "n2": "a", "n3": "a"}.items():
        fsm.on_node_registered(node, now=clock(), topology=label)  # re-registration: label only
    out = ack_all(fsm, fsm.on_worker_exit("n0", 1, 1, now=clock()), clock)
    checks = {c.node: c for c in commands(out, "selfcheck")}
    # a: n0 n2 n3 (a ring); b: n1 alone joins it
    assert {n: sorted(t.node for t in c.neighbours) for n, c in checks.items()} == {
        "n0": ["n1", "n2"],
        "n1": ["n0", "n3"],
        "n2": ["n0", "n3"],
        "n3": ["n1", "n2"],
    }
    message = checks["n0"].message("job")
    assert [n.node for n in message.neighbours] == [t.node for t in checks["n0"].neighbours]
    [rec] = records(out, "neighbours")
    assert rec.detail["topology"]["n1"] == "b" and sorted(rec.detail["plan"]["n1"]) == ["n0", "n3"]
    # a successor re-sends the pending self-checks without a plan whose partners may have acked
    successor = ControllerFSM.restore(fsm.policy, fsm.snapshot(), clock())
    assert successor.topology["n1"] == "b"
    pending = [a for a in successor.pending_commands() if isinstance(a, SendCommand)]
    assert pending and all(not c.neighbours for c in pending)


def test_a_node_suspects_the_neighbours_it_failed_with_only_when_it_passed_with_another():
    assert suspected([_r("n1", False), _r("n2", True)]) == ["n1"]
    assert suspected([_r("n1", False), _r("n2", False)]) == []  # the node itself is the suspect
    assert suspected([_r("n1", False)]) == []  # a pair tells nothing
    assert suspected([_r("n1", False, ABSENT), _r("n2", True)]) == []  # absent: no evidence
    assert suspected([_r("n1", True), _r("n2", True)]) == []


def _diagnose(fsm, clock, suspects):
    """A stall that names nobody; each self-check passes, naming ``suspects[node]``."""
    out = []
    while not out:  # no step reported at all: the init timeout applies
        out = fsm.on_tick(beat(fsm, clock, step=None))
    out = ack_all(fsm, out, clock)  # the stop
    checks = commands(out, "selfcheck")
    assert sorted(c.node for c in checks) == ["n0", "n1", "n2"]
    result = []
    for c in checks:
        result += fsm.on_ack(c.node, c.id, True, "passed", now=clock(), suspects=suspects[c.node])
    return result


def test_two_nodes_that_cannot_reach_each_other_never_train_together_again():
    # n0 and n1 train, n2 is the spare; the n0-n1 link is cut: each fails its all-reduce with the
    # other and passes with n2. n1 (later in slot order) is evicted and n2 takes its slot.
    fsm, clock = running()
    out = _diagnose(fsm, clock, {"n0": ["n1"], "n1": ["n0"], "n2": []})
    [evict] = [a for a in out if isinstance(a, Evict)]
    assert evict.node == "n1" and "cannot reach n0" in evict.reason
    start = next(a for a in out if isinstance(a, StartGeneration))
    assert start.assignment == {"n0": (0, 1), "n2": (2, 3)}


def test_one_sided_or_unknown_suspicions_evict_nobody():
    fsm, clock = running()
    out = _diagnose(fsm, clock, {"n0": ["n1"], "n1": [], "n2": ["n9"]})
    assert not [a for a in out if isinstance(a, Evict)]
    start = next(a for a in out if isinstance(a, StartGeneration))
    assert start.assignment == {"n0": (0, 1), "n1": (2, 3)}


def test_in_process_checks_the_culprit_alone_and_every_node_when_a_stall_names_nobody():
    fsm, clock = running(recovery="in-process")
    out = ack_all(fsm, fsm.on_worker_exit("n1", 2, -9, now=clock()), clock)
    assert [c.node for c in commands(out, "selfcheck")] == ["n1"]  # n0's ranks paused
    fsm, clock = running(recovery="in-process")
    out = _diagnose(fsm, clock, {"n0": ["n1"], "n1": ["n0"], "n2": []})  # every node checked
    assert [a.node for a in out if isinstance(a, Evict)] == ["n1"]
