"""``megascale export``: runs trained by the real training path, exported, loaded by transformers.

Each run trains a tiny model for a few steps with ``run_rank`` (forked from this process, which
imported megatron-core once) and checkpoints. The reference logits come from megascale's own
forward of the resumed 1-rank trainer (``start_rank``, the training path's resume); the export is
loaded with ``transformers.AutoModelForCausalLM.from_pretrained`` (no custom code) and must give the
same logits over the whole padded vocabulary within 1e-4 in fp32.

Every torch computation runs in a forked child and comes back as numpy: a parent that has run a
multi-threaded torch op makes later forked children hang in OpenMP (this pytest process forks
ranks for the other distributed tests too).
"""

from __future__ import annotations

import json
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
from megascale.train.run import run_rank

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4


def _job(**model):
    job = with_changes(
        load("tiny"),
        model={"num_layers": 2, "seq_length": 32, **model},
        optim={"warmup_steps": 1},
        train={"steps": 4, "global_batch_size": 4, "micro_batch_size": 2},
        checkpoint={"interval": 2, "keep": 2},
    )
    return validate(job, 1, "gloo")


def _train(run_dir: Path, job) -> Path:
    run_local(run_rank, 1, (job, run_dir), timeout_s=300)
    return run_dir


def _in_child(fn, *args):
    return run_local(fn, 1, args, timeout_s=300)[0]


def _reference_logits(run_dir: Path, tokens: np.ndarray) -> tuple[int, np.ndarray]:
    """megascale's forward of the run's newest checkpoint, resumed the way training resumes."""
    from megascale.parallel.groups import destroy_groups
    from megascale.train.run import start_rank

    trainer, _ = start_rank(load(run_dir / "config.toml"), run_dir)
    model = trainer.model[0].module
    model.eval()
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)  # [b, s, vocab]
    destroy_groups()
    return trainer.step_num, logits.numpy()


def _hf_logits(out: Path, tokens: np.ndarray, config_changes: dict | None = None) -> np.ndarray:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True, **(config_changes or {})
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens)).logits.numpy()


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def _tokens(vocab: int, seq: int = 32) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(2, seq), dtype=np.int64)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megascale.cli", "export", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _export_in_child(run_dir: Path, out: Path, step: int | None = None) -> dict:
    """The export function in a forked process (it builds its own process group)."""
    return _in_child(export_mod.export, run_dir, out, step)


@pytest.fixture(scope="module")
def serial_run(tmp_path_factory) -> Path:
    """Serial block, GQA (4 heads, 2 groups), a 8-token sliding window: Starcoder2."""
    job = _job(num_query_groups=2, window_size=8)
    return _train(tmp_path_factory.mktemp("export") / "serial", job)


def _files(directory: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    )


def test_serial_block_exports_to_starcoder2_with_equal_logits(serial_run, tmp_path):
    out = tmp_path / "hf"
    before = _files(serial_run)
    proc = _cli(str(serial_run), "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _files(serial_run) == before  # the run directory is only read
    assert "exported step 4 as Starcoder2ForCausalLM" in proc.stdout
    assert "logits checked" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Starcoder2ForCausalLM"]
    assert (config["sliding_window"], config["num_key_value_heads"]) == (8, 2)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    tokens = _tokens(256)
    step, ours = _in_child(_reference_logits, serial_run, tokens)
    assert step == 4 and ours.shape == (2, 32, 256)
    assert _max_diff(_in_child(_hf_logits, out, tokens), ours) <= TOL
    # The window is in play: the same weights without it compute something else.
    unwindowed = _in_child(_hf_logits, out, tokens, {"sliding_window": None})
    assert _max_diff(unwindowed, ours) > 1e-3


def test_a_multi_rank_run_exports_through_a_resharded_load(serial_run, tmp_path):
    # The same job trained at TP2 x DP2 with the distributed optimizer: its checkpoint is
    # resharded into the 1-process model, and the export computes the 1-rank run's logits.
    job = with_changes(
        _job(num_query_groups=2, window_size=8),
        parallel={"tp": 2, "dp": None, "distributed_optimizer": True},
    )
    run_dir = tmp_path / "tp2xdp2"
    run_local(run_rank, 4, (validate(job, 4, "gloo"), run_dir), timeout_s=300)
    out = tmp_path / "hf"
    assert _export_in_child(run_dir, out)["step"] == 4
    tokens = _tokens(256)
    _, ours = _in_child(_reference_logits, serial_run, tokens)
    assert _max_diff(_in_child(_hf_logits, out, tokens), ours) <= TOL


def test_step_selects_an_older_checkpoint(serial_run, tmp_path):
    newest, older = tmp_path / "newest", tmp_path / "older"
    assert _export_in_child(serial_run, newest)["step"] == 4
    assert _export_in_child(serial_run, older, 2)["step"] == 2
    tokens = _tokens(256)
    assert (
        _max_diff(_in_child(_hf_logits, older, tokens), _in_child(_hf_logits, newest, tokens)) > TOL
    )


TEXT = "megascale exports the parallel block"


def _save_tokenizer(directory: Path) -> list[int]:
    """Train a small BPE tokenizer, save it as a transformers tokenizer; ``TEXT``'s ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    text = ["the parallel block shares one layer norm", "megascale exports to transformers"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.save_pretrained(directory)
    return fast(TEXT)["input_ids"]


def _loaded_tokenizer_ids(out: Path) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"]


def test_parallel_block_exports_to_phi_with_padded_vocab_and_tokenizer(tmp_path):
    """Parallel block (one shared LayerNorm), vocab 300 padded to 384, a tokenizer to copy."""
    run_dir = _train(tmp_path / "parallel", _job(parallel_block=True, vocab_size=300))
    original = _in_child(_save_tokenizer, run_dir / "tokenizer")
    out = tmp_path / "hf"
    result = _export_in_child(run_dir, out)
    assert (result["architecture"], result["step"]) == ("PhiForCausalLM", 4)
    assert result["max_abs_diff"] <= TOL
    assert "tokenizer.json" in result["tokenizer"]
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (384, None)
    # Phi's default rotates half of each head; megascale rotates all of it (in both config styles).
    assert (
        config["rope_parameters"]["partial_rotary_factor"] == config["partial_rotary_factor"] == 1
    )

    tokens = _tokens(300)
    _, ours = _in_child(_reference_logits, run_dir, tokens)
    assert ours.shape == (2, 32, 384)
    assert _max_diff(_in_child(_hf_logits, out, tokens), ours) <= TOL
    assert _in_child(_loaded_tokenizer_ids, out) == original


def _export_with_a_wrong_mapping(run_dir: Path, out: Path) -> None:
    """Export with the k and v projections swapped (a mapping bug the logit check must catch)."""
    real = export_mod.convert

    def swapped(*args):
        tensors = real(*args)
        for name in [n for n in tensors if ".self_attn.k_proj." in n]:
            v_name = name.replace(".k_proj.", ".v_proj.")
            tensors[name], tensors[v_name] = tensors[v_name], tensors[name]
        return tensors

    export_mod.convert = swapped  # this forked process only
    export_mod.export(run_dir, out)


def test_a_model_that_computes_other_logits_is_not_written(serial_run, tmp_path):
    out = tmp_path / "parent" / "hf"
    with pytest.raises(RankFailed, match="computes other logits than megascale's model"):
        run_local(_export_with_a_wrong_mapping, 1, (serial_run, out), timeout_s=300)
    assert list(out.parent.iterdir()) == []  # no output, no temporary directory


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megascale export: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_inputs_are_one_line_errors(serial_run, tmp_path):
    out = tmp_path / "out"
    _one_line_error(_cli(str(tmp_path / "none"), "--output", str(out)), "config.toml")
    _one_line_error(
        _cli(str(serial_run), "--step", "3", "--output", str(out)),
        "--step 3",
        "available steps: 2, 4",
    )
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    _one_line_error(_cli(str(serial_run), "--output", str(out)), str(out), "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    untrained = tmp_path / "untrained"
    untrained.mkdir()
    (untrained / "config.toml").write_text((serial_run / "config.toml").read_text())
    _one_line_error(_cli(str(untrained), "--output", str(tmp_path / "o")), "no complete checkpoint")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"swiglu": True}, "model.swiglu"),
        ({"parallel_block": True, "window_size": 8}, "model.window_size = 8"),
        ({"normalization": "RMSNorm"}, "model.normalization = 'RMSNorm'"),
        ({"bias": False}, "model.bias = False"),
        ({"tie_embeddings": False}, "model.tie_embeddings = False"),
    ],
)
def test_unsupported_features_are_refused(tmp_path, change, needle):
    from megascale.config import to_toml

    job = with_changes(load("tiny"), model=change)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(job))
    _one_line_error(_cli(str(run_dir), "--output", str(tmp_path / "o")), needle)
    assert not (tmp_path / "o").exists()
