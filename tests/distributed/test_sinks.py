"""Optional sinks: off by default, refused with a one-line error when their package is missing,
and (when ``tensorboard`` is installed) TensorBoard event files holding exactly the figures of
``metrics.jsonl`` as ``MetricsLog`` writes them, restarts included."""

from __future__ import annotations

import json

import pytest

from megascale.config import ConfigError, MetricsConfig, load, validate
from megascale.probes import sinks
from megascale.train.run import MetricsLog
from megascale.train.trainer import StepMetrics


def metrics(step: int, val_loss: float | None = None) -> StepMetrics:
    return StepMetrics(
        step=step,
        loss=5.0 - step / 10,
        grad_norm=1.0 + step,
        lr=1e-3,
        step_time_s=0.1 * step,
        tokens_per_s=1000.0 + step,
        mfu=0.01 * step,
        mfu_peak_tflops=0.2,
        mfu_peak_source="measured:cpu fp32",
        val_loss=val_loss,
    )


def test_off_by_default_and_validated():
    cfg = load("tiny")
    assert cfg.metrics == MetricsConfig() and not cfg.metrics.tensorboard and not cfg.metrics.wandb
    assert sinks.open_sinks(cfg.metrics, None, 0, {}).sinks == []
    for override, field in [
        ("metrics.wandb_mode='sometimes'", "metrics.wandb_mode = 'sometimes'"),
        ("metrics.tensorboard_dir='/abs'", "metrics.tensorboard_dir = '/abs'"),
        ("metrics.tensorboard_dir='../out'", "metrics.tensorboard_dir = '../out'"),
        ("metrics.wandb_project=' '", "metrics.wandb_project = ' '"),
    ]:
        with pytest.raises(ConfigError, match=field):
            validate(load("tiny", [override]), 1, "gloo")


def test_a_missing_package_is_a_config_error_naming_the_field(monkeypatch):
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name: None)
    for field in ("tensorboard", "wandb"):
        with pytest.raises(ConfigError, match=rf"^metrics.{field} = true: needs the {field} pack"):
            sinks.check_installed(MetricsConfig(**{field: True}))


def _scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_the_figures_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    cfg = MetricsConfig(tensorboard=True, tensorboard_dir="tb")
    log = MetricsLog(tmp_path / "metrics.jsonl", 0, sinks.open_sinks(cfg, tmp_path, 0, {}))
    for step in range(1, 5):
        log.write(metrics(step, val_loss=4.0 if step == 4 else None))
    log.close()
    # a restart from the checkpoint of step 2 redoes steps 3 and 4 (faster this time)
    log = MetricsLog(tmp_path / "metrics.jsonl", 2, sinks.open_sinks(cfg, tmp_path, 2, {}))
    for step in (3, 4):
        log.write(metrics(step) if step == 3 else metrics(step, val_loss=3.5))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(tmp_path / "tb")
    expected: dict[str, dict[int, float]] = {}
    for line in lines:
        for key, value in line.items():  # the numbers; not the schema, the peak's source
            if key not in ("step", "time") and isinstance(value, int | float):
                expected.setdefault(f"train/{key}", {})[line["step"]] = value
    assert set(scalars) == set(expected) >= {"train/mfu", "train/tokens_per_s", "train/val_loss"}
    for tag, by_step in expected.items():
        assert scalars[tag] == pytest.approx(by_step), tag  # float32 in event files
    assert scalars["train/val_loss"] == pytest.approx({4: 3.5})  # the redone step's, once


def test_wandb_offline_logs_the_same_figures(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb (the wandb and dev extras) is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = MetricsConfig(wandb=True, wandb_mode="offline", wandb_project="test")
    log = MetricsLog(tmp_path / "metrics.jsonl", 0, sinks.open_sinks(cfg, tmp_path, 0, {"a": 1}))
    log.write(metrics(1))
    log.close()
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
