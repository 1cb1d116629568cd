"""The Weights & Biases sink on a real run: ``megascale train`` with ``metrics.wandb = true`` in
offline mode (no login, no network; wandb's own service writes the run under the run directory),
then the run's ``.wandb`` file read back: every figure of every ``metrics.jsonl`` record, the
memory figure and ``val_loss`` included, must be in the run's history at that step.

wandb (0.31) has no Python reader of its ``.wandb`` files any more (the Go service writes and
syncs them); the file is LevelDB's log format (32 KiB blocks of checksummed chunks) after a 7-byte
W&B header, and each record is wandb's own protobuf ``Record``, parsed here with wandb's classes.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.messages import SCHEMA_KEY

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
BLOCK = 32 * 1024  # LevelDB log format: chunks never cross a block
CHUNK_HEADER = 7  # masked crc32c (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # ident, magic, version


def read_wandb_records(path: Path) -> list:
    """wandb's ``Record`` messages of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data.startswith(WANDB_HEADER), data[:7]
    records, pending, pos = [], b"", len(WANDB_HEADER)
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's zero-filled trailer
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        assert kind in (FULL, FIRST, MIDDLE, LAST) and (kind in (FULL, FIRST)) == (pending == b"")
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    assert pending == b"", "the file ends inside a record"
    return records


def _history(records: list) -> dict[int, dict]:
    """``_step`` -> {key: value} of the run's history records."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item
            }
            rows[int(row["_step"])] = row
    return rows


def test_offline_run_holds_every_figure_of_every_step(tmp_path):
    pytest.importorskip("wandb", reason="wandb (the dev extra) is not installed")
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }
    env.pop("WANDB_API_KEY", None)
    sets = [
        f"train.steps={STEPS}",
        "optim.warmup_steps=1",
        "train.eval_interval=2",
        "metrics.wandb=true",
        "metrics.wandb_mode='offline'",
        "metrics.wandb_project='megascale-test'",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "train", *[a for s in sets for a in ("--set", s)]]
        + ["--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    (wandb_file,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = read_wandb_records(wandb_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "megascale-test", "run")
    history = _history(records)
    assert sorted(history) == [r["step"] for r in logged]
    for record in logged:
        row = history[record["step"]]
        for key, value in record.items():
            if key in ("step", "time", SCHEMA_KEY) or isinstance(value, bool):
                continue
            figures = value if isinstance(value, dict) else {None: value}  # per-group figures
            for group, v in figures.items():
                assert row[f"train/{key}" + (f"/{group}" if group else "")] == v, (key, group)
        assert row["train/mem_rss_gib"] > 0.05 and "train/loss" in row
    assert [s for s, row in history.items() if "train/val_loss" in row] == [2, 4]
    assert {"model", "train", "metrics"} <= {item.key for item in run.config.update}  # the config
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0  # run.finish() was called
