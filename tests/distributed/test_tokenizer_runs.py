"""``megascale data build`` with a SentencePiece model (Llama 2's kind) and a tiktoken vocabulary
(megatron-core's format), each trained in the test by its library's own trainer, then a short
``megascale train`` of the Llama-style preset on the result, as a user runs them (subprocesses).
The run must train on those ids (loss recorded for every step, finite) and keep the tokenizer file
in its run directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizer_files import train_sentencepiece, write_tiktoken_vocab

from megascale.data.corpus import generate_corpus
from megascale.data.indexed import DatasetInfo

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def _megascale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megascale.cli", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_data_build_then_train(tmp_path, kind):
    if kind == "sentencepiece":
        tok, run_name = train_sentencepiece(tmp_path / "tokenizer.model"), "tokenizer.model"
    else:
        write_tiktoken_vocab(tmp_path / "vocab.json")
        tok, run_name = tmp_path / "vocab.json", "tiktoken.json"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(generate_corpus())
    prefix = tmp_path / "data"
    proc = _megascale("data", "build", str(corpus), "--tokenizer", str(tok), "-o", str(prefix))
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = DatasetInfo.read(prefix)
    assert info.tokenizer == kind and info.documents == len(generate_corpus().strip().split("\n\n"))

    run_dir = tmp_path / "run"
    sets = [
        f"data.path={prefix}",
        f"model.vocab_size={info.vocab_size}",
        f"train.steps={STEPS}",
        "optim.warmup_steps=1",
    ]
    args = [a for s in sets for a in ("--set", s)]
    proc = _megascale("train", "llama-tiny", *args, "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # a fresh model's loss on this vocabulary: about ln(vocab_size)
    assert abs(metrics[0]["loss"] - math.log(info.vocab_size)) < 1.0, metrics[0]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert (run_dir / "tokenizer" / run_name).read_bytes() == tok.read_bytes()
