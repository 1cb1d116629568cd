"""``megascale`` end to end: the command line in subprocesses, as a user runs it.

A training run costs ~10 s (one torch + megatron-core import, then the steps), so there are few:
the default preset once (a module-scoped fixture that several tests read the run directory of),
two ranks with tensor parallelism, and one under a pseudo-terminal for the progress bar. Config
errors and ``mfu`` never import megatron-core and take ~2 s each; ``data build`` writes with
megatron-core's builder (~8 s). A Hugging Face tokenizer trained in the test feeds ``data build``
and a short run with validation on the result.
"""

from __future__ import annotations

import json
import math
import os
import pty
import re
import select
import subprocess
import sys
import time
import tty
from pathlib import Path

import pytest

from megascale import config
from megascale.data.tokenizer import EOD

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
STEPS = 6
DEFAULT_OVERRIDES = [f"train.steps={STEPS}", "checkpoint.interval=3"]
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu"}


def megascale(*args: str, cwd: Path = REPO) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``python -m megascale.cli ARGS``; stdout and stderr are pipes (not a terminal)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "megascale.cli", *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return proc, time.monotonic() - start


def _sets(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _failed(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"


# --------------------------------------------------------------------------------------------------
# megascale train: the default preset, one rank, checkpoints every 3 steps
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    proc, _ = megascale("train", *_sets(DEFAULT_OVERRIDES), "--run-dir", str(run_dir))
    assert proc.returncode == 0, _failed(proc)
    return proc, run_dir


def test_train_writes_the_resolved_config(default_run):
    _, run_dir = default_run
    resolved = config.validate(config.load(None, DEFAULT_OVERRIDES), 1, "gloo")
    assert config.load(run_dir / "config.toml") == resolved
    assert resolved.parallel.dp == 1 and resolved.train.steps == STEPS


def test_train_writes_one_metrics_line_per_step(default_run):
    proc, run_dir = default_run
    assert re.search(r"mfu \d+\.\d% \[peak \S+ TFLOP/s measured:cpu fp32\]", proc.stdout), (
        proc.stdout
    )
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert METRIC_KEYS <= m.keys(), m
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["step_time_s"] > 0 and m["tokens_per_s"] > 0
        assert 0 < m["mfu"] < 1, m  # CPU: against the peak this machine measured
        assert m["mfu_peak_source"] == "measured:cpu fp32" and m["mfu_peak_tflops"] > 0, m
    assert metrics[-1]["loss"] < metrics[0]["loss"], [m["loss"] for m in metrics]


def test_train_writes_rank_prefixed_logs(default_run):
    _, run_dir = default_run
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank_00000.log"]
    lines = (run_dir / "logs" / "rank_00000.log").read_text().splitlines()
    assert lines, "empty rank log"
    assert all(line.startswith("[rank 0] ") for line in lines), lines


def test_train_keeps_the_last_two_checkpoints(default_run):
    _, run_dir = default_run
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step"))
    assert steps == ["step_00000003", "step_00000006"]  # interval 3, checkpoint.keep = 2
    for name, step in (("step_00000003", 3), ("step_00000006", 6)):
        manifest = json.loads((run_dir / "checkpoints" / name / "manifest.json").read_text())
        assert manifest["step"] == step
        assert {k: manifest["layout"][k] for k in ("tp", "pp", "dp")} == {"tp": 1, "pp": 1, "dp": 1}


def test_train_progress_on_a_pipe_is_plain_lines(default_run):
    proc, run_dir = default_run
    assert "\r" not in proc.stdout and "\x1b" not in proc.stdout
    lines = proc.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    # tiny's log_interval is 5: step 5, and always the last step.
    assert [line.split()[1] for line in progress] == ["5/6", "6/6"], lines
    line = r"step 6/6 loss \d+\.\d{4} grad_norm .* tok/s mfu \d+\.\d% \[peak \S+ TFLOP/s \S+ fp32\]"
    assert re.fullmatch(line, progress[-1]), progress[-1]
    assert lines[-1] == f"run directory: {run_dir}"


# --------------------------------------------------------------------------------------------------
# megascale train: two ranks, tensor parallel
# --------------------------------------------------------------------------------------------------


def test_train_two_ranks_tensor_parallel(tmp_path, default_run):
    run_dir = tmp_path / "tp2"
    overrides = [f"train.steps={STEPS}", "parallel.tp=2"]
    proc, _ = megascale(
        "train", "--nproc-per-node", "2", *_sets(overrides), "--run-dir", str(run_dir)
    )
    assert proc.returncode == 0, _failed(proc)
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "rank_00000.log",
        "rank_00001.log",
    ]
    for rank in (0, 1):
        lines = (run_dir / "logs" / f"rank_{rank:05d}.log").read_text().splitlines()
        assert all(line.startswith(f"[rank {rank}] ") for line in lines), lines
    job = config.load(run_dir / "config.toml")
    assert (job.parallel.tp, job.parallel.dp) == (2, 1)
    # TP2 computes the same model as one rank (same global-name init, same data): same losses.
    one_rank = [m["loss"] for m in _metrics(default_run[1])]
    two_ranks = [m["loss"] for m in _metrics(run_dir)]
    assert two_ranks == pytest.approx(one_rank, rel=1e-5)


# --------------------------------------------------------------------------------------------------
# megascale train: progress bar on a terminal
# --------------------------------------------------------------------------------------------------


def _run_on_a_terminal(args: list[str], stderr_path: Path) -> tuple[int, str]:
    """Run ``python -m megascale.cli ARGS`` with stdout on a raw pseudo-terminal; (rc, output)."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no "\n" -> "\r\n" translation: every "\r" read is the program's own
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megascale.cli", *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=stderr,
        )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


def test_train_progress_on_a_terminal_redraws_a_bar(tmp_path):
    run_dir = tmp_path / "tty"
    rc, out = _run_on_a_terminal(
        ["train", "--set", f"train.steps={STEPS}", "--run-dir", str(run_dir)],
        tmp_path / "stderr.txt",
    )
    assert rc == 0, out + (tmp_path / "stderr.txt").read_text()[-6000:]
    # One redraw per step (a terminal ignores log_interval): "\r[bar] text" + clear-to-end-of-line.
    redraws = re.findall(rf"\r\[([#.]{{30}})\] step (\d+)/{STEPS} ", out)
    assert [int(step) for _, step in redraws] == list(range(1, STEPS + 1)), repr(out)
    assert [bar.count("#") for bar, _ in redraws] == [30 * s // STEPS for s in range(1, STEPS + 1)]
    assert out.count("\x1b[K") == STEPS
    assert (
        "\n" not in out.split(f"step {STEPS}/{STEPS}")[0]
    )  # the bar stays on one line until the end
    assert out.rstrip("\n").endswith(f"run directory: {run_dir}")


# --------------------------------------------------------------------------------------------------
# Config errors: exit 2, the field named, before any rank starts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--set", "parallel.tp=3", "--nproc-per-node", "2"],
            ["parallel.tp * parallel.pp = 3 * 1 = 3: must divide world_size = 2"],
        ),
        (
            ["--set", "model.hiden_size=3"],
            ["unknown key model.hiden_size", "did you mean 'model.hidden_size'"],
        ),
        (["no-such-preset"], ["config 'no-such-preset'", "tiny"]),
        # A cross-field rule that only build_scheduler used to catch, inside every rank.
        (["--set", "train.steps=3"], ["optim.warmup_steps = 5", "train.steps = 3"]),
    ],
    ids=["tp-does-not-divide-world", "misspelt-key", "unknown-preset", "steps-within-warmup"],
)
def test_bad_config_exits_2_before_any_rank_starts(tmp_path, args, expected):
    run_dir = tmp_path / "never"
    proc, elapsed = megascale("train", *args, "--run-dir", str(run_dir))
    assert proc.returncode == 2, _failed(proc)
    assert proc.stderr.startswith("megascale: config error: "), proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # Refused before anything ran: no run directory, megatron-core never even imported, no steps.
    assert not run_dir.exists()
    assert "megatron" not in proc.stderr and "step" not in proc.stdout
    assert elapsed < 60, elapsed  # ~2 s alone; generous for a loaded 2-core machine


# --------------------------------------------------------------------------------------------------
# megascale mfu, megascale data build
# --------------------------------------------------------------------------------------------------


def test_mfu_of_the_megascale_175b_run():
    proc, _ = megascale(
        "mfu",
        "megascale/config/presets/megascale-175b.toml",
        "--tokens-per-s",
        "1984000",
        "--gpus",
        "12288",
        "--gpu",
        "A100",
    )
    assert proc.returncode == 0, _failed(proc)
    out = proc.stdout
    assert "peak: A100 dense bf16 312 TFLOP/s" in out
    # 96 layers, parallel block (one LayerNorm per layer), 50,257 tokens padded to 51,200 rows at
    # tp 8, rotary positions: 174,588,321,792 parameters.
    assert "parameters: 174,588,321,792" in out
    mfu = float(re.search(r"^MFU: (\d+\.\d)%", out, re.MULTILINE).group(1))
    assert abs(mfu - 55.2) < 1.5, out  # the paper: 55.2% (we count 54.5% with the 512 window)


def test_data_build_writes_megatron_indexed_data(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    text = tmp_path / "in.txt"
    text.write_text("hello world\n\nsecond paragraph\nline two\n")
    prefix = tmp_path / "out" / "tokens"
    proc, _ = megascale("data", "build", str(text), "--output", str(prefix))
    assert proc.returncode == 0, _failed(proc)
    ds = IndexedDataset(str(prefix))
    assert [ds[i].tolist() for i in range(len(ds))] == [
        [*b"hello world", EOD],
        [*b"second paragraph\nline two", EOD],
    ]
    assert json.loads(Path(f"{prefix}.json").read_text())["vocab_size"] == 256


def test_hf_tokenizer_data_build_and_training_with_validation(tmp_path):
    """A BPE tokenizer trained here; ``data build`` with it; megatron-core reads what the tokenizer
    encodes; a run on it whose loss falls, with val_loss at the configured steps."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    from megascale.data.corpus import generate_corpus
    from megascale.data.tokenizer import train_bpe

    vocab = 400
    tok_path = train_bpe(generate_corpus().split("\n\n"), vocab, tmp_path / "tokenizer.json")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(generate_corpus())
    prefix = tmp_path / "bpe"
    proc, _ = megascale(
        "data", "build", str(corpus), "--tokenizer", str(tok_path), "--output", str(prefix)
    )
    assert proc.returncode == 0, _failed(proc)
    assert "tokens/s" in proc.stderr
    tok = Tokenizer.from_file(str(tok_path))
    eod = tok.token_to_id("<|endoftext|>")
    ds = IndexedDataset(str(prefix))
    paragraphs = generate_corpus().strip("\n").split("\n\n")
    assert len(ds) == len(paragraphs)
    for i in (0, 1, len(ds) - 1):
        assert ds[i].tolist() == tok.encode(paragraphs[i], add_special_tokens=False).ids + [eod]

    run_dir = tmp_path / "run"
    overrides = [
        f"data.path={prefix}",
        f"model.vocab_size={vocab}",
        "train.steps=12",
        "train.eval_interval=4",
        "train.log_interval=100",
    ]
    proc, _ = megascale("train", *_sets(overrides), "--run-dir", str(run_dir))
    assert proc.returncode == 0, _failed(proc)
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics if "val_loss" in m] == [4, 8, 12]
    losses = [m["loss"] for m in metrics]
    # From ln(400) ~ 6.0 (the vocabulary's 112 padding entries are masked out of the loss, so
    # no part of the fall is pushing them down): 0.5 in 12 steps here.
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert vals[-1] < vals[0], vals
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["4/12", "8/12", "12/12"], progress
    assert all(" val_loss " in line for line in progress)
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
