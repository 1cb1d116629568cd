"""``megascale export``: a trained run to a Hugging Face ``transformers`` model directory.

``export(run_dir, output, step=None)`` reads the run's ``config.toml``, builds a 1-process CPU
trainer the way training does, loads the checkpoint through ``checkpoint.load.load_latest`` (the only
reader of checkpoint files), maps the model's ``state_dict()`` onto a ``transformers`` architecture
that computes the same function, and writes ``config.json`` + ``model.safetensors`` (+ the files
of ``RUN_DIR/tokenizer/``) for ``AutoModelForCausalLM.from_pretrained`` (no custom code).

A SwiGLU + RMSNorm model (Llama-style: biases or none, tied or untied, GQA) is
``LlamaForCausalLM``, mapped by ``hf_llama`` (its vocabulary cut to ``model.vocab_size``). The GeLU
GPT is pre-LN with LayerNorm (with bias), biased linears, GeLU (erf), RoPE (not interleaved), tied
embeddings, a final LayerNorm and optional GQA. Its serial block is ``Starcoder2ForCausalLM``
(``model.window_size`` is its ``sliding_window``: both let a token see itself and the
``window_size - 1`` tokens before it, in every layer); the parallel block, one LayerNorm shared by
both branches, is ``PhiForCausalLM`` (its ``lm_head`` bias written as zeros), both at megatron's
padded vocabulary (a multiple of 128), so the logits match megascale's over every id. Refused,
naming the feature: what these architectures cannot express (e.g. the parallel block with a sliding
window, LayerNorm with SwiGLU), and any parameter or model setting the mapping does not know.

A bf16 run is loaded into the fp32 CPU model and its weights rounded to bf16 (the values its bf16
model computed with); they are written in bf16, and the check runs both sides in fp32. The export
is written to a temporary directory next to ``output`` and renamed into place at the end:
``output`` is absent or complete.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from megascale.config import JobConfig, ModelConfig, load
from megascale.data.tokenizer import EOD
from megascale.tools import hf_llama
from megascale.tools.hf_llama import ConversionError, split_qkv

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"
TOLERANCE = 1e-4
"""Largest |logit difference| (fp32) the written model may show against megascale's forward."""


ExportError = ConversionError
"""The run cannot be exported as asked; the message names what and why, on one line."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A ``transformers`` causal LM: where megascale's tensors go, and its own config fields."""

    name: str  # the ``architectures`` entry
    model_type: str  # what ``AutoConfig.for_model`` takes
    layer: dict[str, str]
    """megascale module in ``decoder.layers.N.`` -> HF module in ``model.layers.N.`` (weight and
    bias); the fused ``self_attention.linear_qkv`` is split by ``split_qkv``."""
    final_norm: str  # HF module of decoder.final_layernorm
    fields: dict  # constant config fields
    dropout_fields: tuple[str, str]  # (after attention/MLP, on embeddings): model.hidden_dropout
    eps_field: str  # config field of the LayerNorm epsilon
    lm_head_bias: bool  # HF's lm_head has a bias (megascale's has none: zeros)
    partial_rotary: bool  # supports ``partial_rotary_factor``


STARCODER2 = Architecture(
    name="Starcoder2ForCausalLM",
    model_type="starcoder2",
    layer={
        "input_layernorm.norm": "input_layernorm",
        "self_attention.linear_proj": "self_attn.o_proj",
        "pre_mlp_layernorm.norm": "post_attention_layernorm",
        "mlp.linear_fc1": "mlp.c_fc",
        "mlp.linear_fc2": "mlp.c_proj",
    },
    final_norm="model.norm",
    fields={"use_bias": True},
    dropout_fields=("residual_dropout", "embedding_dropout"),
    eps_field="norm_epsilon",
    lm_head_bias=False,
    partial_rotary=False,
)
PHI = Architecture(
    name="PhiForCausalLM",
    model_type="phi",
    layer={
        "input_layernorm.norm": "input_layernorm",
        "self_attention.linear_proj": "self_attn.dense",
        "mlp.linear_fc1": "mlp.fc1",
        "mlp.linear_fc2": "mlp.fc2",
    },
    final_norm="model.final_layernorm",
    fields={"qk_layernorm": False},
    dropout_fields=("resid_pdrop", "embd_pdrop"),
    eps_field="layer_norm_eps",
    lm_head_bias=True,
    partial_rotary=True,
)


def hf_config_fields(arch: Architecture, m: ModelConfig, facts: dict) -> dict:
    """``transformers`` config fields for ``m`` given ``model_facts`` (+ ``eos_token_id``)."""
    rope = {"rope_type": "default", "rope_theta": facts["rotary_base"]}
    if arch.partial_rotary:
        rope["partial_rotary_factor"] = facts["rotary_percent"]
    elif facts["rotary_percent"] != 1.0:
        raise ExportError(
            f"rotary_percent={facts['rotary_percent']}: {arch.name} rotates whole heads"
        )
    window = {} if m.window_size is None else {"sliding_window": m.window_size}
    return {
        **arch.fields,
        **window,
        **dict.fromkeys(arch.dropout_fields, m.hidden_dropout),  # where megatron applies it
        "attention_dropout": m.attention_dropout,
        arch.eps_field: facts["eps"],
        "rope_parameters": rope,
        "vocab_size": facts["vocab_size"],
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size or 4 * m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_query_groups or m.num_heads,
        "hidden_act": "gelu",  # torch's exact (erf) GeLU, what megascale trains with
        "max_position_embeddings": m.seq_length,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": facts["eos_token_id"],
        "pad_token_id": None,
        "dtype": "float32",
    }


LLAMA = Architecture(
    name=hf_llama.ARCHITECTURE,
    model_type=hf_llama.MODEL_TYPE,
    layer={},  # mapped by hf_llama.to_hf (QKV and SwiGLU's fc1 split, vocabulary cut)
    final_norm="model.norm",
    fields={},  # hf_llama.config_fields
    dropout_fields=("", ""),
    eps_field="rms_norm_eps",
    lm_head_bias=False,
    partial_rotary=False,
)


def choose_architecture(m: ModelConfig) -> Architecture:
    """The architecture that computes what ``m`` does; ExportError naming the feature otherwise.

    SwiGLU models are Llama (``hf_llama.check_exportable``); the GeLU GPT is Starcoder2 (serial
    block) or Phi (parallel block), both with LayerNorm, biases and tied embeddings."""
    if hf_llama.is_llama(m):
        hf_llama.check_exportable(m)
        return LLAMA
    for field, value, default in (
        ("normalization", m.normalization, "LayerNorm"),
        ("bias", m.bias, True),
        ("tie_embeddings", m.tie_embeddings, True),
    ):
        if value != default:
            raise ExportError(
                f"model.{field} = {value!r} with model.swiglu = false: the GeLU GPT exports to "
                f"Starcoder2 or Phi (LayerNorm, biased linears, tied embeddings); only {default!r} "
                "is exported (a SwiGLU + RMSNorm model exports to Llama)"
            )
    if m.parallel_block and m.window_size is not None:
        raise ExportError(
            f"model.window_size = {m.window_size} with model.parallel_block = true: Phi (the "
            "parallel block's counterpart) has no sliding-window attention; not exported"
        )
    return PHI if m.parallel_block else STARCODER2


_LAYER = "decoder.layers."
_LEAVES = ("weight", "bias")


def convert(
    state: dict[str, torch.Tensor], m: ModelConfig, arch: Architecture, vocab: int
) -> dict[str, torch.Tensor]:
    """megascale's 1-process ``GPTModel.state_dict()`` -> ``arch``'s tensors (contiguous copies).

    Every megascale tensor must land somewhere: an unknown one raises ExportError, so a model
    feature added later is refused instead of silently dropped.
    """
    import torch

    top = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        **{f"decoder.final_layernorm.norm.{x}": f"{arch.final_norm}.{x}" for x in _LEAVES},
    }
    out = {"lm_head.bias": torch.zeros(vocab)} if arch.lm_head_bias else {}
    for name, tensor in state.items():
        if name.endswith("._extra_state"):
            continue
        index, _, inner = name.removeprefix(_LAYER).partition(".")
        module, _, leaf = inner.rpartition(".")
        prefix = f"model.layers.{index}."
        if name in top:
            out[top[name]] = tensor
        elif not (name.startswith(_LAYER) and index.isdigit() and leaf in _LEAVES):
            raise ExportError(f"parameter {name!r} has no counterpart in {arch.name}")
        elif module == "self_attention.linear_qkv":
            heads, groups = m.num_heads, m.num_query_groups or m.num_heads
            for proj, part in zip("qkv", split_qkv(tensor, heads, groups), strict=True):
                out[f"{prefix}self_attn.{proj}_proj.{leaf}"] = part
        elif module in arch.layer:
            out[f"{prefix}{arch.layer[module]}.{leaf}"] = tensor
        else:
            raise ExportError(f"parameter {name!r} has no counterpart in {arch.name}")
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def model_facts(trainer) -> dict:
    """The numbers the HF config needs, read from the built model (not assumed from the config).

    Semantics the mapping assumes and the config cannot change (GeLU (erf), RoPE not interleaved,
    LayerNorm, biases) are not re-checked here: the written model's logits are (``_verify``).
    """
    model = trainer.model[0].module
    norm = model.decoder.final_layernorm.norm
    return {
        "eps": float(norm.eps),
        "rotary_base": float(model.rotary_base),
        "rotary_percent": float(model.rotary_percent),
        "vocab_size": int(model.vocab_size),
    }


def _loopback_ifname() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), None)


def _one_rank_job(job: JobConfig) -> JobConfig:
    from megascale.config import validate

    one = dataclasses.replace(
        job,
        parallel=dataclasses.replace(
            job.parallel, tp=1, pp=1, vpp=1, dp=None, sequence_parallel=False, batch_p2p_comm=None
        ),
        # The CPU model is fp32: a bf16 checkpoint loads into it (its fp32 main parameters), and
        # ``load_model`` rounds the weights to the bf16 values the run computed with.
        model=dataclasses.replace(job.model, spec="local", params_dtype="fp32"),
        train=dataclasses.replace(job.train, device="cpu"),
        data=dataclasses.replace(job.data, path=None),
    )
    return validate(one, 1, "gloo")


@dataclasses.dataclass
class LoadedModel:
    """A checkpoint's model as a 1-process trainer holds it, and its answer to a probe batch."""

    step: int
    state: dict[str, torch.Tensor]  # GPTModel.state_dict()
    facts: dict  # model_facts()
    probe: torch.Tensor  # token ids [1, s]
    probe_logits: torch.Tensor  # megascale's logits for them [1, s, padded vocab]


def _probe(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (256, or past the sliding window, at most a sample) and megascale's logits."""
    import torch

    m, model = trainer.job.model, trainer.model[0].module
    length = min(m.seq_length, max(256, (m.window_size or 0) + 16))
    tokens = torch.randint(0, m.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        return tokens, model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), None)


@contextlib.contextmanager
def one_rank_trainer(job: JobConfig) -> Iterator:
    """A 1-rank CPU trainer of ``job`` (``_one_rank_job``), its parameters freshly initialised.

    ``parallel.tp = pp = dp = 1``, in this process's own world-size-1 gloo group (a FileStore, no
    listening store; gloo bound to the loopback interface), torn down on exit; refused if a process
    group already exists. The trainer reads the built-in corpus from a temporary directory: no
    run's training data is read. Used by the export (to load a checkpoint) and the import (to
    write one)."""
    import torch.distributed as dist

    from megascale.parallel import cpu_backend
    from megascale.parallel.groups import build_groups, destroy_groups
    from megascale.train.run import seed_everything
    from megascale.train.trainer import Trainer

    if dist.is_initialized():
        raise ExportError("a torch.distributed process group is already initialised here")
    one = _one_rank_job(job)
    saved_ifname, backend_was_active = os.environ.get("GLOO_SOCKET_IFNAME"), cpu_backend.is_active()
    try:
        if saved_ifname is None and (loopback := _loopback_ifname()):
            os.environ["GLOO_SOCKET_IFNAME"] = loopback  # gloo listens on this interface only
        with tempfile.TemporaryDirectory(prefix="megascale-hf-") as scratch:
            store = dist.FileStore(str(Path(scratch) / "store"), 1)  # no listening socket
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            cpu_backend.activate()
            groups = build_groups(one.parallel)
            seed_everything(one.train.seed, groups.tp_rank, "cpu")
            yield Trainer(one, groups, "cpu", data_cache_dir=Path(scratch) / "data")
    finally:
        destroy_groups()
        if not backend_was_active:
            cpu_backend.deactivate()
        if saved_ifname is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def load_model(job: JobConfig, run_dir: Path, step: int | None) -> LoadedModel:
    """Load checkpoint ``step`` (None: the newest) into a ``one_rank_trainer`` through
    ``checkpoint.load.load_latest``; a bf16 run's weights are rounded to bf16 (what its bf16
    model held: megatron-core rounds the fp32 main parameters so)."""
    import torch

    from megascale.train.checkpoint.storage import location

    with one_rank_trainer(job) as trainer:
        loaded = _load(trainer, location(job.checkpoint, run_dir), step)
        with torch.no_grad():
            model = trainer.model[0].module
            if job.model.params_dtype == "bf16":
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16))
            state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        return LoadedModel(loaded, state, model_facts(trainer), *_probe(trainer))


def _load(trainer, where: str, step: int | None) -> int:
    """``checkpoint.load.load_latest`` into ``trainer``; the step loaded, or ExportError saying
    why not."""
    from megascale.train.checkpoint import load as checkpoint_load

    try:
        loaded = checkpoint_load.load_latest(trainer, where, step=step)
    except (RuntimeError, KeyError) as e:  # e.g. a state_dict that does not fit this model
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise ExportError(f"the checkpoint does not load into a 1-process model: {why}") from e
    if loaded is None:
        which = "the newest checkpoint" if step is None else f"checkpoint step {step}"
        raise ExportError(
            f"{which} at {where} does not load into a 1-process model (see the warnings above)"
        )
    return loaded


def _read_job(run_dir: Path) -> JobConfig:
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ExportError(f"{path}: no such file; RUN_DIR must be a megascale run directory")
    return load(path)


def _check_output(output: Path, option: str = "--output") -> None:
    if output.exists() and not output.is_dir():
        raise ExportError(f"{option} {output}: exists and is not a directory")
    if output.is_dir() and any(output.iterdir()):
        raise ExportError(f"{option} {output}: exists and is not empty; give a new directory")


def _check_step(job: JobConfig, run_dir: Path, step: int | None) -> None:
    from megascale.train.checkpoint.storage import Storage, check_config, location

    check_config(job.checkpoint, 1)  # ConfigError naming checkpoint.url if it cannot be read here
    where = location(job.checkpoint, run_dir)
    steps = Storage(where).complete_steps()
    if not steps:
        raise ExportError(f"no complete checkpoint at {where}; train with checkpoint.interval > 0")
    if step is not None and step not in steps:
        listed = ", ".join(str(s) for s in steps)
        raise ExportError(f"--step {step}: no complete checkpoint; available steps: {listed}")
    _check_spec(Storage(where), step if step is not None else steps[-1])


def _check_spec(storage, step: int) -> None:
    """ExportError when checkpoint ``step`` was saved by Transformer Engine's layer spec: its norms
    are fused into the next linear layer (``...linear_qkv.layer_norm_weight``), while the export's
    1-process CPU model is megatron-core's local spec (``...input_layernorm.norm.weight``)."""
    import megascale.train.checkpoint.format as fmt
    from megascale.train.checkpoint.storage import step_name

    data = storage.read_bytes(f"{step_name(step)}/{fmt.METADATA}")
    try:
        keys = fmt.load_metadata(data).state_dict_metadata if data else {}
    except Exception:  # unreadable here: the load verifies and reports it
        return
    fused = next((k for k in keys if k.endswith(".layer_norm_weight")), None)
    if fused is not None:
        raise ExportError(
            f"checkpoint step {step} was saved with model.spec = 'te' (norms fused into linear "
            f"layers: {fused!r}); the export reads checkpoints of the local spec only"
        )


def _import_hf():
    try:
        import safetensors.torch
        import transformers
    except ImportError as e:
        raise ExportError(
            f"export needs transformers and safetensors ({e.name} is missing): "
            "pip install 'megascale[hf]'"
        ) from e
    return transformers, safetensors.torch


def _copy_tokenizer(run_dir: Path, dest: Path) -> list[str]:
    """Copy the files of ``RUN_DIR/tokenizer/`` next to the weights (not config.json, weights)."""
    source = run_dir / "tokenizer"
    files = sorted(p for p in source.glob("*") if p.is_file())
    for item in files:
        if item.name in (HF_CONFIG, WEIGHTS):
            raise ExportError(f"{item}: a tokenizer file may not be named {item.name}")
        shutil.copy2(item, dest / item.name)
    return [item.name for item in files]


def export(run_dir: str | Path, output: str | Path, step: int | None = None) -> dict:
    """Export ``run_dir``'s checkpoint ``step`` (None: the newest) to ``output``.

    Before the rename the written model is loaded with ``AutoModelForCausalLM`` and its logits for
    a probe batch are compared with megascale's (``TOLERANCE``). Returns {"architecture", "step",
    "output", "tokenizer" (files copied), "max_abs_diff"}. Raises ExportError (one line) for a
    missing config.toml, an unsupported model, a non-empty ``output``, no checkpoint, an unknown
    ``step``, missing ``transformers`` or a failed check; ConfigError for a bad config.toml.
    ``output`` is written whole or not at all.
    """
    run_dir, output = Path(run_dir), Path(output)
    job = _read_job(run_dir)
    arch = choose_architecture(job.model)
    _check_output(output)
    _check_step(job, run_dir, step)
    transformers, safetensors_torch = _import_hf()
    loaded = load_model(job, run_dir, step)
    facts = {**loaded.facts, "eos_token_id": None if (run_dir / "tokenizer").is_dir() else EOD}
    fields, tensors = _hf_model(arch, job.model, facts, loaded.state)
    hf_config = transformers.AutoConfig.for_model(
        arch.model_type, architectures=[arch.name], **fields
    )
    loaded.state.clear()  # converted: hold one copy of the weights, not two
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        hf_config.save_pretrained(tmp)
        _add_pre_v5_rope_fields(tmp / HF_CONFIG)
        safetensors_torch.save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        del tensors  # written; _verify loads them back
        (tmp / WEIGHTS).chmod((tmp / HF_CONFIG).stat().st_mode)  # not safetensors' 0600
        copied = _copy_tokenizer(run_dir, tmp)
        diff = _verify(transformers, tmp, arch, loaded)
        _check_output(output)  # still absent or empty: rename replaces an empty directory
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %s step %d as %s to %s", run_dir, loaded.step, arch.name, output)
    return {
        "architecture": arch.name,
        "step": loaded.step,
        "output": str(output),
        "tokenizer": copied,
        "max_abs_diff": diff,
    }


def _hf_model(
    arch: Architecture, m: ModelConfig, facts: dict, state: dict[str, torch.Tensor]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``arch``'s config fields and tensors (bf16 for a bf16 run: ``load_model`` rounded them)."""
    import torch

    if arch is LLAMA:
        fields, tensors = hf_llama.config_fields(m, facts), hf_llama.to_hf(state, m)
    else:
        fields = hf_config_fields(arch, m, facts)
        tensors = convert(state, m, arch, facts["vocab_size"])
    if m.params_dtype == "bf16":
        fields["dtype"] = "bfloat16"
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    return fields, tensors


def _add_pre_v5_rope_fields(path: Path) -> None:
    """transformers < 5 reads ``rope_theta`` / ``partial_rotary_factor`` as top-level fields (and
    Phi's default factor is 0.5): write them next to ``rope_parameters``, which 5.x reads."""
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters") or {}
    config.update({k: v for k, v in rope.items() if k in ("rope_theta", "partial_rotary_factor")})
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _verify(transformers, directory: Path, arch: Architecture, loaded: LoadedModel) -> float:
    """Load ``directory`` with ``AutoModelForCausalLM`` and compare its logits for the probe with
    megascale's; the max |difference|, or ExportError when it exceeds ``TOLERANCE``."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=loaded.probe).logits
    # A Llama export cuts the vocabulary's padding rows: compare the ids it kept.
    diff = float((logits - loaded.probe_logits[..., : logits.shape[-1]]).abs().max())
    if not diff <= TOLERANCE:
        raise ExportError(
            f"the written {arch.name} computes other logits than megascale's model (max |diff| "
            f"{diff:.2e} > {TOLERANCE}); not exported"
        )
    return diff


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale export RUN_DIR [--step N] --output DIR``."""
    parser.add_argument("run_dir", help="the run directory (holds config.toml and checkpoints)")
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step to export (default: the newest)"
    )
    parser.add_argument(
        "--output", required=True, help="directory to write (must not exist or be empty)"
    )
