"""The controller's fenced writes against a real etcd: an outbox larger than etcd's
``--max-txn-ops`` (default 128) is written in several fenced transactions, not refused; a burst of
decisions costs one ``state`` write, agents get a few-byte ``status``, events are batched."""

from __future__ import annotations

import pytest

from megascale.controller import service as service_mod
from megascale.controller.events import EventLog, read_events
from megascale.controller.fsm import ControllerFSM, ControllerPolicy
from megascale.controller.service import ControllerService, LostLeadership, ServiceOptions
from megascale.etcd.keys import make_command
from megascale.messages import ControllerState, ControllerStatus, Event, GenerationRecord

NODES = 300  # > 2 x 128: several transactions


@pytest.fixture
def leader(store, job, tmp_path):
    policy = ControllerPolicy(nodes=NODES, nproc_per_node=1)
    opts = ServiceOptions(job.job_id, tmp_path, policy, candidate_id="c0")
    shell = ControllerService(store, opts)
    assert shell.election.campaign(timeout_s=10.0)
    shell.fsm = ControllerFSM(policy)
    yield shell
    shell.election.close()


def fill(shell: ControllerService) -> None:
    for i in range(NODES):
        shell._outbox[shell.keys.command(f"n{i}")] = make_command(
            shell.opts.job_id, 1, "stop", f"g1-stop-{i}"
        )
    shell._outbox[shell.keys.generation] = GenerationRecord(1, {})
    shell._outbox[shell.keys.state] = shell.fsm.snapshot()  # last in the outbox: written first


def test_a_flush_of_more_than_128_puts_is_written_in_fenced_chunks(leader, store):
    fill(leader)
    leader._flush()
    assert not leader._outbox and leader._outage_since is None
    commands = store.snapshot(leader.keys.commands_prefix).items
    assert len(commands) == NODES
    assert ControllerState.decode(store.get(leader.keys.state).json()).state == "init"
    assert GenerationRecord.decode(store.get(leader.keys.generation).json()).generation == 1
    # Several transactions (one revision each), the state snapshot in the first.
    revisions = sorted({kv.mod_revision for kv in commands})
    assert len(revisions) == -(-(NODES + 2) // service_mod.TXN_MAX_OPS)
    assert store.get(leader.keys.state).mod_revision == revisions[0]


def test_etcd_refusing_a_transaction_is_a_bug_not_an_outage(leader, monkeypatch):
    monkeypatch.setattr(service_mod, "TXN_MAX_OPS", 1000)  # what one transaction used to be
    fill(leader)
    with pytest.raises(RuntimeError, match="not an outage") as raised:
        leader._flush()
    assert not isinstance(raised.value, LostLeadership)
    assert leader._outage_since is None  # not mistaken for etcd being down


def test_a_deposed_leader_writes_nothing(leader, store):
    fill(leader)
    store.delete(leader.keys.controller_leader)  # another controller's term would follow
    with pytest.raises(LostLeadership):
        leader._flush()
    assert not store.snapshot(leader.keys.commands_prefix).items


def test_a_burst_of_decisions_is_one_snapshot_write_and_agents_get_a_small_status(leader, store):
    for i in range(NODES):
        leader._act(leader.fsm.on_node_registered(f"n{i}", now=1.0))
    assert store.get(leader.keys.state) is None  # queued, nothing written yet
    leader._flush(force=True)
    state, status = store.get(leader.keys.state), store.get(leader.keys.status)
    assert state.version == 1 and len(ControllerState.decode(state.json()).registered) == NODES
    assert ControllerStatus.decode(status.json()) == ControllerStatus("init", 0)
    assert len(status.value) < 64 < 4000 < len(state.value)  # O(1) vs O(nodes) bytes
    leader._act(leader.fsm.on_start(now=2.0))  # sends start commands: written at once
    leader._flush()
    assert store.get(leader.keys.state).version == 2
    assert len(store.snapshot(leader.keys.commands_prefix).items) == NODES
    status = ControllerStatus.decode(store.get(leader.keys.status).json())
    assert status == ControllerStatus("starting", 1)


def test_buffered_events_are_batched_and_renumbered_after_another_writer(store, job, tmp_path):
    log = EventLog(tmp_path, store, job, buffered=True)
    for i in range(100):
        log.append("straggler", generation=1, node=f"n{i}")
    assert not store.snapshot(job.events_prefix).items and not (tmp_path / "events.jsonl").exists()
    store.put(job.event(70), {"seq": 70, "kind": "written by a predecessor"})
    log.flush()
    mirrored = store.snapshot(job.events_prefix).items
    assert len(mirrored) == 101
    # The batch holding seq 70 moved after it, in order; the file says what etcd says.
    ours = [Event.decode(kv.json()) for kv in mirrored if kv.json()["kind"] == "straggler"]
    assert [e.node for e in ours] == [f"n{i}" for i in range(100)]
    assert [e.seq for e in ours] == sorted(e.seq for e in ours)
    assert min(e.seq for e in ours[64:]) > 70
    assert read_events(tmp_path) == ours
