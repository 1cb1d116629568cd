"""The typed messages (``megascale.messages``): round trip, the schema check, undeclared fields."""

from __future__ import annotations

import json
import logging

import pytest

from megascale.messages import (
    SCHEMA,
    Ack,
    CheckpointFigures,
    Heartbeat,
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
