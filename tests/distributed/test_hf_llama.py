"""``megascale import`` and ``megascale export`` of Llama-style models, against real ``transformers``.

Small random ``LlamaForCausalLM`` models are built and saved by ``transformers`` itself (hidden
64, 2 layers, 4 query heads over 2 key/value heads, vocabulary 500: megascale pads it to 512, the
export cuts it back), imported, loaded by megascale's training path, trained at TP2 x DP2 with the
distributed optimizer and at one rank, and exported; logits are compared within 1e-4 in fp32.

As in ``test_export``: every torch computation runs in a forked child and comes back as numpy (a
parent that has run a multi-threaded torch op makes later forked children hang in OpenMP).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import with_changes

from megascale.config import load, validate
from megascale.launcher.local import RankFailed, run_local
from megascale.tools import export as export_mod
from megascale.tools import hf_import
from megascale.train.run import run_rank

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4
VOCAB = 500


def _in_child(fn, *args):
    return run_local(fn, 1, args, timeout_s=300)[0]


def _save_llama(directory: Path, dtype: str, bias: bool, tied: bool, shard: bool) -> None:
    """A random LlamaForCausalLM saved by transformers (norm weights random too, so a norm
    mapped to the wrong place shows in the logits)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        attention_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.05)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, max_shard_size="200KB" if shard else "5GB")


def _hf_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens)).logits.numpy()


def _megascale_logits(run_dir: Path, tokens: np.ndarray) -> np.ndarray:
    """megascale's forward of the run's newest checkpoint, resumed the way training resumes."""
    from megascale.parallel.groups import destroy_groups
    from megascale.train.run import start_rank

    trainer, _ = start_rank(load(run_dir / "config.toml"), run_dir)
    model = trainer.model[0].module
    model.eval()
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    destroy_groups()
    return logits.numpy()


def _tensors_equal(a: Path, b: Path) -> list[str]:
    """Names of the tensors that differ (in name, dtype, shape or any bit) between two models."""
    from safetensors.torch import load_file

    def read(directory: Path) -> dict:
        out = {}
        for file in sorted(directory.glob("*.safetensors")):
            out.update(load_file(file))
        return out

    x, y = read(a), read(b)
    names = sorted(x.keys() | y.keys())
    return [
        n
        for n in names
        if n not in x or n not in y or x[n].dtype != y[n].dtype or not torch.equal(x[n], y[n])
    ]


def _tokens(seq: int = 32) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, seq), dtype=np.int64)


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path]:
    """fp32, untied, no biases, sharded safetensors: (HF directory, imported run directory)."""
    root = tmp_path_factory.mktemp("hf_llama")
    hf, out = root / "hf", root / "run"
    _in_child(_save_llama, hf, "float32", False, False, True)
    assert (hf / "model.safetensors.index.json").is_file()
    result = _in_child(hf_import.import_hf, hf, out)
    assert result["max_abs_diff"] <= TOL
    return hf, out


def test_import_computes_transformers_logits_and_exports_back_bitwise(imported, tmp_path):
    hf, out = imported
    job = load(out / "config.toml")
    m = job.model
    assert (m.swiglu, m.normalization, m.bias, m.tie_embeddings) == (True, "RMSNorm", False, False)
    assert (m.num_query_groups, m.ffn_hidden_size, m.vocab_size, m.rotary_base) == (
        2,
        176,
        VOCAB,
        500000,
    )
    back = tmp_path / "back"
    result = _in_child(export_mod.export, out, back)
    assert (result["architecture"], result["step"]) == ("LlamaForCausalLM", 0)
    assert _in_child(_tensors_equal, hf, back) == []
    config = json.loads((back / "config.json").read_text())
    assert (config["vocab_size"], config["num_key_value_heads"], config["dtype"]) == (
        VOCAB,
        2,
        "float32",
    )

    tokens = _tokens()
    ours = _in_child(_megascale_logits, out, tokens)  # megascale's training path, 1 rank
    assert ours.shape == (2, 32, 512)  # the padded vocabulary
    diff = _max_diff(ours[..., :VOCAB], _in_child(_hf_logits, hf, tokens))
    print(f"import: max |logit diff| vs transformers {diff:.2e}")
    assert diff <= TOL


def _train(run_dir: Path, ranks: int, parallel: dict, stop_after: int | None = None) -> list:
    """Train ``run_dir`` (resuming from its newest checkpoint) on a 2-step schedule, checkpointing
    every step, stopping after ``stop_after``; (step, loss, grad norm) of the steps taken."""
    job = with_changes(
        load(run_dir / "config.toml"),
        parallel=parallel,
        optim={"warmup_steps": 0},
        train={"steps": 2, "global_batch_size": 4, "micro_batch_size": 1},
        checkpoint={"interval": 1},
    )
    args = (validate(job, ranks, "gloo"), run_dir, stop_after)
    history = run_local(run_rank, ranks, args, timeout_s=300)[0]
    return [(m.step, m.loss, m.grad_norm) for m in history]


def test_an_import_trains_at_tp2_dp2_as_at_one_rank_and_exports(imported, tmp_path):
    """TP2 x DP2 with the distributed optimizer loads the 1-rank import (resharded), takes a step
    and saves (SwiGLU's fc1 split over TP, its optimizer state over DP); one rank resumes that
    checkpoint and takes the second step as the uninterrupted one-rank run does (same loss and
    grad norm: the Adam moments came back), and the exports of both compute the same logits."""
    hf, out = imported
    runs = {"tp2dp2": tmp_path / "tp2dp2", "one": tmp_path / "one"}
    for run in runs.values():
        shutil.copytree(out, run)
    tp2 = _train(runs["tp2dp2"], 4, {"tp": 2, "dp": None, "distributed_optimizer": True}, 1)
    one_rank = {"tp": 1, "dp": None, "distributed_optimizer": False}
    resumed = _train(runs["tp2dp2"], 1, one_rank)
    straight = _train(runs["one"], 1, one_rank)
    assert [s for s, _, _ in tp2 + resumed] == [s for s, _, _ in straight] == [1, 2]
    for ours, reference in zip(tp2 + resumed, straight, strict=True):
        assert ours == pytest.approx(reference, abs=1e-5)
    tokens, logits = _tokens(), {}
    for name, run in runs.items():
        result = _in_child(export_mod.export, run, tmp_path / f"hf_{name}")
        assert result["step"] == 2 and result["max_abs_diff"] <= TOL
        logits[name] = _in_child(_hf_logits, tmp_path / f"hf_{name}", tokens)
    diff = _max_diff(logits["tp2dp2"], logits["one"])
    print(f"TP2xDP2 + 1 rank vs 1 rank after two steps: max |logit diff| {diff:.2e}")
    assert diff <= TOL
    assert _max_diff(logits["one"], _in_child(_hf_logits, hf, tokens)) > 1e-3  # it trained


def test_bf16_tied_biased_llama_round_trips_bitwise(tmp_path):
    hf, out, back = tmp_path / "hf", tmp_path / "run", tmp_path / "back"
    _in_child(_save_llama, hf, "bfloat16", True, True, False)
    assert _in_child(hf_import.import_hf, hf, out)["max_abs_diff"] <= TOL
    m = load(out / "config.toml").model
    assert (m.params_dtype, m.bias, m.tie_embeddings) == ("bf16", True, True)
    assert _in_child(export_mod.export, out, back)["max_abs_diff"] <= TOL
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"
    assert _in_child(_tensors_equal, hf, back) == []


def _import_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megascale.cli", "import", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _import_without(hf: Path, dropped: str, out: Path) -> None:
    """Import ``hf`` after removing tensor ``dropped`` from its shards (in this child)."""
    real = hf_import.read_tensors

    def missing(directory):
        tensors = real(directory)
        del tensors[dropped]
        return tensors

    hf_import.read_tensors = missing  # this forked process only
    hf_import.import_hf(hf, out)


def test_bad_inputs_are_one_line_errors(imported, tmp_path):
    hf, _ = imported
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    scaled = tmp_path / "scaled"
    shutil.copytree(hf, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    (scaled / "config.json").write_text(json.dumps(config))
    for source, needle in (
        (gpt2, "model_type 'gpt2'"),
        (scaled, "rope_parameters type 'llama3'"),
        (tmp_path / "none", "config.json: no such file"),
    ):
        proc = _import_cli(str(source), "--out", str(tmp_path / "o"))
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("megascale import: "), proc.stderr
        assert needle in lines[0], lines[0]
        assert not (tmp_path / "o").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("user data")
    proc = _import_cli(str(hf), "--out", str(taken))
    assert proc.returncode == 2 and f"--out {taken}: exists and is not empty" in proc.stderr
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    dropped = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(RankFailed, match=f"tensor '{dropped}' is missing"):
        run_local(_import_without, 1, (hf, dropped, tmp_path / "p" / "o"), timeout_s=300)
    assert not (tmp_path / "p").exists() or list((tmp_path / "p").iterdir()) == []
