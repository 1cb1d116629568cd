"""``megascale import``: a Hugging Face ``LlamaForCausalLM`` directory to a megascale run directory.

``import_hf(hf_dir, out, config=None, overrides=())`` reads ``config.json`` and the weights
(``model.safetensors``, or the shards that ``model.safetensors.index.json`` lists), derives the
``model`` section (``hf_llama.model_fields``; the other sections come from ``config``, a TOML file
or preset, default ``tiny``, with ``--set`` overrides), and writes::

    OUT/config.toml                    the job: train it with ``megascale train OUT/config.toml
                                       --run-dir OUT`` (any layout: ``--set parallel.tp=2`` ...)
    OUT/checkpoints/step_00000000/     the weights as a megascale checkpoint, step 0
    OUT/tokenizer/                     the tokenizer files of HF_DIR, if any (the export copies
                                       them back)

The checkpoint is written by the project's own writer (``checkpoint.save.Checkpointer``) from a
1-rank CPU trainer (``export.one_rank_trainer``) whose parameters hold the imported weights: it is
the layout-free format every layout loads, resharded, like any run's checkpoint. Optimizer moments
are zero and the step count 0, as before a first step. Before anything is written, megascale's
logits for a probe batch are compared with ``transformers``' own (``export.TOLERANCE``, fp32): a
mapping that computes something else is refused. ``OUT`` is written to a temporary directory next
to it and renamed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from megascale.config import JobConfig, load, to_toml
from megascale.tools import hf_llama
from megascale.tools.export import TOLERANCE, _check_output, _import_hf, one_rank_trainer
from megascale.tools.hf_llama import ConversionError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
"""Files of HF_DIR copied to ``OUT/tokenizer/`` (``megascale export`` copies them back)."""
PROBE_TOKENS = 64


def read_config(hf_dir: Path) -> dict:
    """HF_DIR's ``config.json`` as a dict; ConversionError when there is none or it is not JSON."""
    path = hf_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(
            f"{path}: no such file; HF_DIR must be a transformers model directory"
        ) from None
    except (ValueError, OSError) as e:
        raise ConversionError(f"{path}: not readable as JSON ({e})") from e
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return config


def read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors``, or of the shards ``model.safetensors.index.json``
    lists (each file read once)."""
    import safetensors.torch

    single, index = hf_dir / "model.safetensors", hf_dir / INDEX
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        for name in files:
            if name.parent != hf_dir or not name.is_file():
                raise ConversionError(f"{index}: lists {name.name!r}, which is not in {hf_dir}")
    else:
        raise ConversionError(
            f"{hf_dir}: no model.safetensors or {INDEX} (only safetensors weights are imported)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(safetensors.torch.load_file(name))
    return tensors


USER_MODEL_FIELDS = ("seq_length", "params_dtype", "attention_dropout")
"""Derived ``model`` fields that ``--set model.X=...`` may change (the rest decide the tensors)."""


def derive_job(hf_config: dict, config: str | Path | None, overrides: list[str]) -> JobConfig:
    """The job: ``config`` (default preset) with ``--set`` ``overrides``, its ``model`` section
    replaced by the fields ``hf_llama.model_fields`` derives (but ``USER_MODEL_FIELDS`` the user
    set), checkpoints under the run directory."""
    base = load(config, overrides)
    fields = hf_llama.model_fields(hf_config)
    for item in overrides:
        key = item.partition("=")[0].strip()
        name = key.removeprefix("model.")
        if key.startswith("model.") and name in fields:
            if name not in USER_MODEL_FIELDS:
                raise ConversionError(
                    f"--set {key}: the model's shape comes from HF_DIR/config.json; only "
                    f"{', '.join('model.' + f for f in USER_MODEL_FIELDS)} may be set"
                )
            del fields[name]
    model = dataclasses.replace(base.model, **fields)
    checkpoint = dataclasses.replace(base.checkpoint, url=None, resume=True)
    return dataclasses.replace(base, model=model, checkpoint=checkpoint)


def _scratch_job(job: JobConfig) -> JobConfig:
    """The 1-rank job that writes the checkpoint: the same tensors, a short sequence (not saved;
    its built-in corpus stays small), a synchronous save."""
    seq = min(job.model.seq_length, PROBE_TOKENS)
    return dataclasses.replace(
        job,
        model=dataclasses.replace(job.model, seq_length=seq),
        checkpoint=dataclasses.replace(job.checkpoint, async_save=False),
    )


def _load_weights(trainer, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the trainer's model (names and shapes must match it exactly) and into
    the optimizer's main parameters."""
    import torch

    model = trainer.model[0].module
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    missing = sorted(own.keys() - state.keys())
    if missing:
        raise ConversionError(f"megascale's model has {missing[0]!r}, which the import lacks")
    with torch.no_grad():
        for name, target in own.items():
            if tuple(state[name].shape) != tuple(target.shape):
                raise ConversionError(
                    f"tensor {name!r}: shape {tuple(state[name].shape)} from the Hugging Face "
                    f"model, megascale's model has {tuple(target.shape)}"
                )
            target.copy_(state[name])
    trainer.optimizer.reload_model_params()  # main (fp32) copies, where the optimizer keeps any


def _check_logits(transformers, hf_dir: Path, trainer) -> float:
    """megascale's logits for random tokens vs ``transformers``' own model of HF_DIR (fp32)."""
    import torch

    m, model = trainer.job.model, trainer.model[0].module
    tokens = torch.randint(
        0, m.vocab_size, (1, m.seq_length), generator=torch.Generator().manual_seed(0)
    )
    model.eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    reference.eval()
    with torch.no_grad():
        ours = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)
        theirs = reference(input_ids=tokens).logits
    diff = float((ours[..., : theirs.shape[-1]] - theirs).abs().max())
    if not diff <= TOLERANCE:
        raise ConversionError(
            f"megascale's model of {hf_dir} computes other logits than transformers' (max |diff| "
            f"{diff:.2e} > {TOLERANCE}); not imported"
        )
    return diff


def _write_checkpoint(job: JobConfig, hf_dir: Path, tensors: dict, run_dir: Path) -> float:
    """Import ``tensors`` into a 1-rank trainer, check its logits, save it as step 0 under
    ``run_dir/checkpoints``; the max |logit difference|."""
    from megascale.model.gpt import padded_vocab_size
    from megascale.train.checkpoint.save import Checkpointer

    transformers, _ = _import_hf()
    state = hf_llama.from_hf(tensors, job.model, padded_vocab_size(job.model.vocab_size, 1))
    tensors.clear()  # mapped: hold one copy of the weights, not two
    scratch = _scratch_job(job)
    with one_rank_trainer(scratch) as trainer:
        _load_weights(trainer, state)
        del state
        diff = _check_logits(transformers, hf_dir, trainer)
        trainer.step_num = 0
        checkpointer = Checkpointer(scratch.checkpoint, run_dir, trainer)
        checkpointer.save(trainer)
        checkpointer.finalize()
    return diff


def import_hf(
    hf_dir: str | Path,
    out: str | Path,
    config: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict:
    """Import HF_DIR into the run directory ``out`` (absent or empty); see the module docstring.

    Returns {"out", "job" (the JobConfig written), "max_abs_diff", "tokenizer" (files copied)}.
    Raises ConversionError (one line) for a directory without config.json or safetensors weights,
    a model that is not Llama or uses what megascale cannot express (the field is named), a
    missing or unused tensor, a non-empty ``out``, or a failed logit check; ConfigError for a bad
    ``config`` or override. ``out`` is written whole or not at all.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    job = derive_job(read_config(hf_dir), config, list(overrides))
    _check_output(out, "--out")
    tensors = read_tensors(hf_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        diff = _write_checkpoint(job, hf_dir, tensors, tmp)
        (tmp / "config.toml").write_text(to_toml(job))
        copied = [name for name in TOKENIZER_FILES if (hf_dir / name).is_file()]
        if copied:
            (tmp / "tokenizer").mkdir()
            for name in copied:
                shutil.copy2(hf_dir / name, tmp / "tokenizer" / name)
        _check_output(out, "--out")  # still absent or empty: rename replaces an empty directory
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("imported %s into %s", hf_dir, out)
    return {"out": str(out), "job": job, "max_abs_diff": diff, "tokenizer": copied}


def model_section(job: JobConfig) -> str:
    """The ``[model]`` table of ``job``'s TOML (what the import derived), for printing."""
    rest = to_toml(job).split("[model]", 1)[1].split("\n[", 1)[0]
    return f"[model]{rest.rstrip()}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale import HF_DIR --out RUN_DIR [CONFIG options]``."""
    parser.add_argument("hf_dir", help="a LlamaForCausalLM directory (config.json + safetensors)")
    parser.add_argument(
        "--out", required=True, help="run directory to write (must not exist or be empty)"
    )
    parser.add_argument(
        "--config",
        default=None,
        help="TOML file or preset for every section but [model] (default: tiny)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value of --config (repeatable); [model] comes from HF_DIR",
    )
