"""Classifying failures: an uncaught exception that would follow the job to any node (the same
signature on every rank, or again after a restart) fails the job and evicts nobody; the events of
a deposed controller's term are not read. A fake clock, no processes."""

from __future__ import annotations

import json
import os

from test_controller_elastic import four_nodes
from test_controller_fsm import ack_all, commands, records

from megascale.controller.events import read_events
from megascale.controller.fsm import ControllerFSM, Evict, State
from megascale.probes.fatal import error_signature, read_exit_error, write_exit_error

NODES_AND_SPARE = ("n0", "n1", "n2", "n3", "n4")
READ_ONLY = "CheckpointError: checkpoint write failed: Read-only file system (EROFS)"


def error(rank: int, message: str = "checkpoint write failed: Read-only file system (EROFS)"):
    text = f"CheckpointError: {message}: /ckpt/step_00000008/rank_{rank:05d}/__0_0.distcp"
    return {"text": text, "signature": error_signature("CheckpointError", text.split(": ", 1)[1])}


def restarted(fsm, out, clock) -> None:
    """Ack the stop, self-check and start rounds of a fault: the next generation runs."""
    for _ in range(3):
        out = ack_all(fsm, out, clock)
    assert fsm.state is State.RUNNING


def test_the_signature_drops_ranks_paths_and_numbers_and_keeps_the_type():
    one = error_signature("RuntimeError", "rank 3 cannot read /data/a_3.bin at step 12 (0x7f3a)")
    two = error_signature("RuntimeError", "rank 0 cannot read /data/b.bin at step 9 (0x10)\nmore")
    assert one == two == "RuntimeError: rank <n> cannot read <path> at step <n> (<hex>)"
    assert error_signature("OSError", "rank 3 cannot read /x at step 1 (0x1)") != one
    assert error(0)["signature"] == error(5)["signature"] == f"{READ_ONLY}: <path>"


def test_an_exit_error_is_read_back_only_for_the_process_that_wrote_it(tmp_path):
    write_exit_error(tmp_path, 2, ValueError("bad token id 70000 in /d/x.bin\ndetail"))
    record = read_exit_error(tmp_path, 2, os.getpid())
    assert record.text == "ValueError: bad token id 70000 in /d/x.bin"
    assert record.signature == "ValueError: bad token id <n> in <path>"
    assert read_exit_error(tmp_path, 2, os.getpid() + 1) is None
    assert read_exit_error(tmp_path, 3, os.getpid()) is None


def test_the_same_error_on_every_rank_fails_the_job_and_evicts_nobody():
    fsm, clock = four_nodes(NODES_AND_SPARE)
    out = fsm.on_worker_exit("n0", 0, 1, clock(), 1, error=error(0), everywhere=True)
    [fault] = records(out, "fault")
    assert fault.detail["fault"] == "job_fatal" and fault.detail["exit_code"] == 1
    assert fault.detail["classified"] == "the same error ended every rank (4)"
    out = ack_all(fsm, out, clock)
    assert fsm.state is State.FAILED and fsm.generation == 1
    assert fsm.failure.startswith(f"job-fatal error on rank 0: {READ_ONLY}: /ckpt/")
    assert fsm.failure.endswith("(the same error ended every rank (4))")
    assert not [a for a in out if isinstance(a, Evict)] and not commands(out, "selfcheck")
    assert fsm.blocklist == {} and fsm.spares == ["n4"]


def test_the_same_error_again_after_a_restart_fails_the_job_even_after_a_takeover():
    fsm, clock = four_nodes(NODES_AND_SPARE)
    out = fsm.on_worker_exit("n1", 1, 1, clock(), 1, error=error(1))
    assert records(out, "fault")[0].detail["fault"] == "worker_exit"  # may be n1's: restart
    restarted(fsm, out, clock)
    assert fsm.generation == 2
    fsm = ControllerFSM.restore(fsm.policy, json.loads(json.dumps(fsm.snapshot())), clock())
    out = fsm.on_worker_exit("n3", 3, 1, clock(), 2, error=error(3))
    [fault] = records(out, "fault")
    assert fault.detail["classified"] == "the same error again after a restart (generations 1, 2)"
    out = ack_all(fsm, out, clock)
    assert fsm.state is State.FAILED and not [a for a in out if isinstance(a, Evict)]
    assert fsm.spares == ["n4"] and fsm.blocklist == {}


def test_another_error_after_a_restart_or_a_signal_is_an_ordinary_fault():
    fsm, clock = four_nodes(NODES_AND_SPARE)
    restarted(fsm, fsm.on_worker_exit("n1", 1, 1, clock(), 1, error=error(1)), clock)
    other = error(2, "gloo: connection reset")
    out = fsm.on_worker_exit("n2", 2, 1, clock(), 2, error=other)
    assert records(out, "fault")[0].detail["fault"] == "worker_exit"
    restarted(fsm, out, clock)
    out = fsm.on_worker_exit("n2", 2, -9, clock(), 3)
    assert records(out, "fault")[0].detail == {
        "exit_code": -9,
        "fault": "worker_exit",
        "where": "rank 2 (dp=2, pp=0, tp=0)",
        "step": None,
    }


def test_events_of_a_deposed_controllers_term_are_not_read(tmp_path):
    lines = [
        {"seq": 0, "kind": "controller_start", "term": 5},
        {"seq": 1, "kind": "controller_takeover", "term": 9},
        {"seq": 2, "kind": "fault", "term": 5},  # the frozen leader, woken up
        {"seq": 3, "kind": "finished", "term": 9},
        {"seq": 4, "kind": "note"},  # no term: not a controller's
    ]
    text = "".join(json.dumps({"time": 1.0, "generation": 1, **e}) + "\n" for e in lines)
    (tmp_path / "events.jsonl").write_text(text)
    assert [e.seq for e in read_events(tmp_path)] == [0, 1, 3, 4]


MISMATCH = {"rank": 2, "reason": "mismatch", "group": "DP [0, 1, 2, 3]", "op": "broadcast of 8 bytes",
            "seq": 7}  # fmt: skip


def test_a_mismatched_collective_blames_no_node_and_fails_the_job_when_it_comes_back():
    # A policy that evicts a node named culprit once: a stall with a "not-started" culprit
    # would evict n2; a mismatch evicts nobody, restarts once, and the same again fails the job.
    fsm, clock = four_nodes(NODES_AND_SPARE, evict_repeat_culprit=1)
    out = fsm.on_stall_detected([2], clock(), {"culprits": [MISMATCH]})
    [fault] = records(out, "fault")
    assert fault.detail["fault"] == "stall" and (fault.node, fault.rank) == ("n2", 2)
    assert fault.detail["classified"] == "software: mismatched collective"
    signature = fault.detail["signature"]
    assert signature.startswith("mismatched collective: rank 2 issued broadcast of 8 bytes on DP")
    restarted(fsm, out, clock)
    assert fsm.generation == 2 and fsm.blocklist == {} and fsm.spares == ["n4"]
    fsm = ControllerFSM.restore(fsm.policy, json.loads(json.dumps(fsm.snapshot())), clock())
    out = fsm.on_stall_detected([2], clock(), {"culprits": [{**MISMATCH, "seq": 3}]})
    [fault] = records(out, "fault")
    assert fault.detail["fault"] == "job_fatal"
    assert fault.detail["classified"] == (
        "the same collective mismatch after a restart (generations 1, 2)"
    )
    out = ack_all(fsm, out, clock)
    assert fsm.state is State.FAILED and fsm.failure.startswith(
        f"job-fatal error on rank 2: {signature} (the same collective mismatch"
    )
    assert not [a for a in out if isinstance(a, Evict)] and fsm.blocklist == {}


def test_a_stall_with_a_node_culprit_besides_a_mismatch_still_blames_it():
    fsm, clock = four_nodes(NODES_AND_SPARE, evict_repeat_culprit=1)
    hung = {"rank": 3, "reason": "not-started", "group": "TP", "op": "all_reduce", "seq": 4}
    out = fsm.on_stall_detected([2, 3], clock(), {"culprits": [MISMATCH, hung]})
    assert "classified" not in records(out, "fault")[0].detail
    assert fsm.culprits == {"n2": 1, "n3": 1}
