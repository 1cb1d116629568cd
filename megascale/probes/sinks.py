"""Optional sinks for the per-step figures: TensorBoard event files and Weights & Biases.

Rank 0 writes every step's ``metrics.jsonl`` record (``train.run.MetricsLog``) and hands the same
record to ``Sinks.write``: each enabled sink gets every numeric field of it (``loss``,
``grad_norm``, ``lr``, ``step_time_s``, ``tokens_per_s``, ``mfu``, ``mfu_peak_tflops``,
``val_loss`` on steps that evaluated, the memory figures ``mem_rss_gib`` and, on CUDA,
``mem_max_allocated_gib``/``mem_max_reserved_gib``) under ``train/<field>`` at the record's
``step``, and its text
fields (``mfu_peak_source``: where MFU's peak came from) once. Both are off by default
(``[metrics]`` in the config); disabled, ``open_sinks`` returns a sink that does nothing.

* TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` into ``RUN_DIR/<metrics.tensorboard_dir>``;
  needs the ``tensorboard`` package (the ``tensorboard`` extra). After a restart the steps redone
  from the checkpoint replace the lost ones (``purge_step``), as in ``metrics.jsonl``.
* Weights & Biases: ``wandb.init(project=metrics.wandb_project, mode=metrics.wandb_mode)`` with
  the resolved config, one run per run directory (its id kept in ``RUN_DIR/wandb_run_id``, so a
  restart resumes the same run); needs the ``wandb`` package (the ``wandb`` extra). Offline,
  wandb's service writes ``RUN_DIR/wandb/offline-run-*/run-<id>.wandb`` (``wandb sync`` uploads
  it).

A sink that is enabled but whose package is missing is a ``ConfigError`` naming the field, raised
by ``open_sinks`` before the first step.
"""

from __future__ import annotations

import importlib.util
import logging
import uuid
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.config import ConfigError, MetricsConfig
from megascale.messages import SCHEMA_KEY

logger = logging.getLogger(__name__)

PREFIX = "train/"


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric figures (not ``step`` or ``time``), keyed ``train/<field>``; a figure
    by group (``comm_time_s``) as ``train/<field>/<group>``."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update({f"{key}/{group}": v for group, v in value.items()})
        elif key not in ("step", "time"):
            flat[key] = value
    return {
        PREFIX + key: float(value)
        for key, value in flat.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def _texts(record: dict[str, Any]) -> dict[str, str]:
    """The record's words (the MFU peak's source), not the message's schema version."""
    return {PREFIX + k: v for k, v in record.items() if isinstance(v, str) and k != SCHEMA_KEY}


class TensorBoardSink:
    """Event files under ``log_dir`` (``SummaryWriter``)."""

    def __init__(self, log_dir: Path, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=resumed_step + 1 or None)
        self._texts: set[str] = set()

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in _numbers(record).items():
            self.writer.add_scalar(tag, value, step)
        for tag, text in _texts(record).items():
            if tag not in self._texts:
                self._texts.add(tag)
                self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per run directory, resumed after a restart."""

    def __init__(self, cfg: MetricsConfig, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        runfiles.write_text(id_file, run_id + "\n")
        self.run = wandb.init(
            project=cfg.wandb_project,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=cfg.wandb_mode,
            config=config,
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({**_numbers(record), **_texts(record)}, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """The enabled sinks as one (none: every method does nothing)."""

    def __init__(self, sinks: list[Any] | None = None) -> None:
        self.sinks = sinks or []

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record (rank 0, after every step)."""
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def check_installed(cfg: MetricsConfig) -> None:
    """ConfigError naming the field when an enabled sink's package is not importable."""
    for enabled, field, package, hint in (
        (
            cfg.tensorboard,
            "metrics.tensorboard",
            "tensorboard",
            "pip install 'megascale[tensorboard]'",
        ),
        (cfg.wandb, "metrics.wandb", "wandb", "pip install 'megascale[wandb]'"),
    ):
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"{field} = true: needs the {package} package, which is not installed "
                f"({hint}), or set {field} = false"
            )


def open_sinks(
    cfg: MetricsConfig, run_dir: Path, resumed_step: int, config: dict[str, Any]
) -> Sinks:
    """The sinks ``cfg`` enables, for rank 0 (``config``: the resolved job config, for W&B)."""
    check_installed(cfg)
    sinks: list[Any] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / cfg.tensorboard_dir, resumed_step))
        logger.info("TensorBoard event files in %s", run_dir / cfg.tensorboard_dir)
    if cfg.wandb:
        sinks.append(WandbSink(cfg, run_dir, config))
    return Sinks(sinks)
