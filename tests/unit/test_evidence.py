"""Evidence before eviction, in the controller's pure parts: its own absence (a starved loop,
an etcd that did not answer) moves its deadlines instead of blaming nodes; a fault counts each
culprit once (a generation ends at its first fault, however often it is seen); a neighbour that
is not there is no evidence against the node that tested it."""

from __future__ import annotations

from test_controller_fsm import beat, records, running

from megascale.controller.actions import Fault
from megascale.controller.fsm import ControllerFSM, State
from megascale.controller.neighbours import ABSENT, NeighbourResult, judge


def test_the_controllers_own_absence_extends_deadlines_instead_of_blaming_a_node():
    away = 60.0  # far past the heartbeat (5 s) and stall timeouts
    for extended in (False, True):
        fsm, clock = running()
        beat(fsm, clock, 1)
        beat(fsm, clock, 2)
        now = clock(away)
        if not extended:  # a node's "silence" is a fault
            assert records(fsm.on_tick(now), "fault")
            continue
        fsm.extend_deadlines(away)
        assert fsm.on_tick(now) == [] and fsm.state is State.RUNNING
        beat(fsm, clock, 3)  # the nodes were there all along
        assert fsm.on_tick(clock(1.0)) == [] and not fsm.faults


def test_a_fault_seen_again_in_its_generation_counts_its_culprit_once():
    fsm, clock = running(evict_repeat_culprit=2)
    fsm.on_worker_exit("n1", 2, 1, now=clock())
    assert fsm.culprits == {"n1": 1}
    fsm._count_culprits(Fault("worker_exit", "n1", 2))  # the same generation: one fault
    assert fsm.culprits == {"n1": 1}
    # A standby (or the leader after an etcd outage) restores mid-recovery: still counted once.
    again = ControllerFSM.restore(fsm.policy, fsm.snapshot(), clock())
    assert again.state is State.STOPPING
    again._count_culprits(again.fault)
    assert again.culprits == {"n1": 1}


def test_an_absent_neighbour_is_no_evidence_against_the_node_that_tested():
    gone = [NeighbourResult("n0", False, ABSENT), NeighbourResult("n2", False, ABSENT)]
    ok, detail = judge(gone)
    assert ok and detail == f"no verdict: every neighbour (n0, n2) is {ABSENT}"
    broken = [NeighbourResult("n0", False, ABSENT), NeighbourResult("n2", False, "timed out")]
    ok, detail = judge(broken)  # its only present neighbour failed: a pair, both fail
    assert not ok and "its only neighbour (n2)" in detail and "not tested: n0" in detail
    mixed = [NeighbourResult("n0", True, "1.0 GB/s"), NeighbourResult("n2", False, ABSENT)]
    assert judge(mixed)[0]
