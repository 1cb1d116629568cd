"""The typed messages (``megascale.messages``): round trip, the schema check, undeclared fields."""

from __future__ import annotations

import json
import logging

import pytest

from megascale.etcd.keys import make_command
from megascale.messages import (
    SCHEMA,
    Ack,
    BlockedNode,
    CheckpointFigures,
    ControllerState,
    ControllerStatus,
    DurableCheckpoint,
    Event,
    FinalOutcome,
    GenerationRecord,
    Heartbeat,
    JobSummaryRecord,
    MessageError,
    RankFigures,
    RankProgress,
    Reported,
    StepMetrics,
    WorkerStatus,
    read_metrics,
)


def _heartbeat() -> Heartbeat:
    return Heartbeat(
        node="node-0",
        generation=2,
        step=7,
        tokens_per_s=1000.0,
        mfu=0.4,
        checkpoint=CheckpointFigures(step=5, stall_s=0.1, durable_s=0.9),
        workers={"0": WorkerStatus(pid=11, alive=True)},
        ranks={"0": RankFigures(7, 0.5, 0.3, {"dp": 0.1, "tp": 0.05}, 0.01)},
        error_events=[Reported(seq=1, rank=0, kind="oom", text="out of memory", generation=2)],
    )


def test_every_message_survives_json():
    messages = [
        _heartbeat(),
        RankProgress(rank=3, pid=5, checkpoint=CheckpointFigures(4, 0.2)),
        Ack(id="c1", generation=1, kind="start"),
        StepMetrics(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, step_time_s=0.5, tokens_per_s=9.0),
    ]
    for message in messages:
        encoded = json.loads(json.dumps(message.encode()))
        assert encoded["schema"] == f"{SCHEMA[0]}.{SCHEMA[1]}"
        assert type(message).decode(encoded) == message


def test_a_field_the_type_does_not_declare_fails_on_both_sides():
    with pytest.raises(TypeError):
        Heartbeat(node="n", tokens_per_second=1.0)  # producing it
    beat = _heartbeat()
    with pytest.raises(AttributeError):
        beat.tokens_per_second  # noqa: B018  (reading it)
    with pytest.raises(AttributeError):
        beat.tokens_per_second = 1.0
    data = beat.encode()
    data["ranks"]["0"]["comm_s"] = 0.1  # a producer bug, at this reader's version
    with pytest.raises(MessageError, match=r"RankFigures: undeclared field\(s\) comm_s"):
        Heartbeat.decode(data)


def test_another_major_version_is_refused_and_a_newer_minor_is_read(caplog):
    data = _heartbeat().encode()
    with pytest.raises(MessageError, match=r"schema = '2.0': major version 2 cannot be read"):
        Heartbeat.decode({**data, "schema": "2.0"})
    with pytest.raises(MessageError, match=r"schema = None: expected 'MAJOR.MINOR'"):
        Heartbeat.decode({k: v for k, v in data.items() if k != "schema"})
    newer = f"{SCHEMA[0]}.{SCHEMA[1] + 1}"
    with caplog.at_level(logging.WARNING, logger="megascale.messages"):
        beat = Heartbeat.decode({**data, "schema": newer, "power_w": 700})
    assert beat == _heartbeat() and "power_w" in caplog.text  # logged, not silently dropped


def test_a_required_field_missing_is_named():
    with pytest.raises(MessageError, match=r"Ack: field\(s\) kind missing"):
        Ack.decode({"schema": "1.0", "id": "c1", "generation": 1})


def test_metrics_lines_read_old_lines_and_skip_a_torn_one():
    old = json.dumps({"step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 0.1, "step_time_s": 0.5,
                      "tokens_per_s": 9.0, "mfu": None, "time": 5.0})  # fmt: skip
    new = json.dumps(StepMetrics(2, 1.9, 1.0, 0.1, 0.5, 9.0, time=6.0).encode())
    assert [m.step for m in read_metrics([old, new, '{"step": 3, "lo'])] == [1, 2]


def test_a_metrics_line_names_val_loss_and_a_stall_only_on_their_steps():
    plain = StepMetrics(1, 2.0, 1.0, 0.1, 0.5, 9.0).encode()
    assert "val_loss" not in plain and "checkpoint_stall_s" not in plain
    saved = StepMetrics(2, 2.0, 1.0, 0.1, 0.5, 9.0, val_loss=2.1, checkpoint_stall_s=0.2)
    assert StepMetrics.decode(json.loads(json.dumps(saved.encode()))) == saved


def _job_messages() -> list:
    from megascale.messages.job import EffectiveFigures, FatalError, FaultRecord, FaultTiming

    return [
        make_command(
            "job",
            2,
            "start",
            "g2-start-1",
            {"ranks": [0, 1], "world_size": 4, "master_node": "node-0"},
        ),  # fmt: skip
        make_command("job", 2, "selfcheck", "g2-sc-2", neighbours=[{"node": "n1", "channel": 1}]),
        ControllerStatus("running", 2),
        GenerationRecord(2, {"node-0": [0, 1]}),
        BlockedNode("lost", 2, 1.0),
        ControllerState("diagnosing", 2, fault=FaultRecord("stall", "n1", 3, {"x": 1}, ["n1"])),
        JobSummaryRecord(
            time=1.0,
            state="running",
            generation=2,
            last_checkpoint=DurableCheckpoint(5, 1.0, "file:///c"),
            effective=EffectiveFigures(1.0, 2.0, 0.5),
        ),
        Event(1, 1.0, 1, "fault", "n1", 3, {"fault": "worker_exit"}, term=7),
        FinalOutcome(
            finished=False,
            state="failed",
            final_step=3,
            steps=10,
            job_id="job",
            run_dir="/r",
            fault_timings=[FaultTiming("kill-worker:rank=1", 1.0, 3, decision="fault")],
            fatal=FatalError("n0", 0, "bad data"),
        ),
    ]


def test_job_messages_survive_json_and_refuse_undeclared_fields_on_every_side():
    for message in _job_messages():
        kind = type(message)
        encoded = json.loads(json.dumps(message.encode()))
        assert kind.decode(encoded) == message, kind
        with pytest.raises(AttributeError):  # a consumer reading a field nobody declared
            message.no_such_field  # noqa: B018
        with pytest.raises(MessageError, match=rf"{kind.__name__}: undeclared field\(s\) extra"):
            kind.decode({**encoded, "extra": 1})
        with pytest.raises(MessageError, match="major version 2"):
            kind.decode({**encoded, "schema": "2.0"})


def test_the_real_consumers_read_only_declared_fields():
    """The operator's status and the launcher's outcome, run on typed records: a consumer
    reading a field its message does not declare fails here (AttributeError), not silently."""
    from megascale.k8s.status import _figures, fault_message
    from megascale.launcher.outcome import failure, faults_detected

    messages = {type(m).__name__: m for m in _job_messages()}
    figures = _figures(messages["JobSummaryRecord"])
    assert figures["lastCheckpoint"]["step"] == 5 and figures["effectiveTrainingTime"]["ratio"]
    assert (
        fault_message(messages["ControllerState"])
        == "stall on node n1, rank 3 (suspect ranks ['n1'])"
    )
    events = [messages["Event"], Event(1, 2.0, 1, "failed", detail={"reason": "gave up"})]
    assert faults_detected(events) == {"worker_exit": 1}
    assert failure(events) == ("gave up", None)


def test_a_stall_is_shown_by_whom_it_names_in_the_job_status_and_the_launcher_log():
    from megascale.k8s.status import fault_message
    from megascale.launcher.monitor import describe_event
    from megascale.messages.job import ControllerState, FaultRecord

    text = "rank 5 (dp=0, pp=1, tp=1) on node-1 not started in all_reduce #43 on TP [4, 5]"
    detail = {"culprits": [{"rank": 5, "reason": "not-started", "text": text}],
              "blocked_in": ["all_reduce #43 on [4, 5]"], "suspects": ["rank 5 (...)"]}  # fmt: skip
    state = ControllerState("stopping", 1, fault=FaultRecord("stall", "node-1", 5, detail, ["5"]))
    assert fault_message(state) == f"stall on node node-1, rank 5: {text}"
    event = Event(1, 2.0, 1, "fault", "node-1", 5, {**detail, "fault": "stall", "step": 12})
    line = describe_event(event)
    assert line.startswith(f"FAULT stall node node-1 rank 5 at step 12: {text} (blocked_in=")
    nobody = {"fault": "stall", "step": 12, "culprits": [],
              "undecided": [{"text": "cannot tell which rank: ..."}]}  # fmt: skip
    assert "cannot tell which rank" in describe_event(Event(2, 2.0, 1, "fault", None, None, nobody))
