"""GPT on megatron-core, with MegaScale's model changes.

``build_gpt`` is the one entry point: it turns a ``JobConfig`` into megatron-core's
``TransformerConfig``, picks the layer spec (Transformer Engine or megatron-core's local modules; the
serial or the parallel block; sliding-window attention through ``window_size``), and builds one
``GPTModel`` per virtual pipeline stage of this rank.

Parameters are initialised by ``init_parameters`` from a seed keyed by each parameter's *global*
name (its layer index in the whole model, not in this stage), and each rank keeps only its tensor
parallel slice of the full tensor. So every parallel layout starts from exactly the parameters of the
1-process model, which is what makes step-by-step equivalence tests possible.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import zlib
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megascale.config import JobConfig, ModelConfig
from megascale.model.norm import LocalNorm
from megascale.model.parallel_block import ParallelTransformerLayer
from megascale.overlap.tp import (
    GatheredInputColumnParallelLinear,
    OverlappedColumnParallelLinear,
    OverlappedRowParallelLinear,
    PartialRowParallelLinear,
)
from megascale.overlap.tp_plan import TPOverlapPlan

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def te_available() -> bool:
    """True when Transformer Engine imports (it is a GPU-only extra)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install raises more than ImportError
        return False
    return True


def use_te_spec(model: ModelConfig, device: str) -> bool:
    """Resolve ``model.spec``: "auto" means TE when it imports and we run on CUDA."""
    if model.spec == "te":
        if device != "cuda" or not te_available():
            raise ValueError(
                f"model.spec='te' needs CUDA and Transformer Engine (device={device!r}, "
                f"TE importable={te_available()}); use model.spec='local' or 'auto'"
            )
        return True
    if model.spec == "local":
        return False
    return device == "cuda" and te_available()


def _softmax_kernels_available() -> bool:
    """megatron-core's fused masked softmax needs its CUDA extension (shipped with apex/Megatron)."""
    import importlib.util

    return importlib.util.find_spec("scaled_upper_triang_masked_softmax_cuda") is not None


def use_masked_softmax_fusion(
    on_cuda: bool, kernels_available: bool, window_size: int | None
) -> bool:
    """Whether the local spec may use megatron-core's fused masked softmax.

    Only on CUDA with its kernels importable, and never with a sliding window: megatron-core 0.16's
    fused causal kernel (``scaled_upper_triang_masked_softmax``) applies the plain causal mask and
    ignores ``window_size``, so the window would be silently dropped in bf16/fp16. The unfused path
    builds the sliding-window causal mask itself. Pure: tested without CUDA.
    """
    return on_cuda and kernels_available and window_size is None


def mask_padded_vocabulary(model: GPTModel, vocab_size: int) -> None:
    """Keep the padding rows of the vocabulary out of the loss: their logits are set to the
    dtype's lowest value before megatron-core's cross entropy, so they take no probability and
    their rows no gradient.

    The vocabulary is padded to a multiple of 128 x TP (``padded_vocab_size``), so its padded size
    depends on the layout: 300 tokens are 384 rows at TP1 and 512 at TP2. Unmasked, the padding
    entries would take part in every softmax, and a layout would train another function than the
    1-process reference, and a checkpoint resumed at another TP (its padding rows clipped or
    zero-filled: ``train.checkpoint.load``) would not continue the run. A no-op where nothing is
    padded."""
    if model.vocab_size == vocab_size:
        return
    compute_loss = model.compute_language_model_loss
    tp_group = model.tp_group

    def loss_without_padding(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        local = logits.shape[-1]
        first = vocab_size - torch.distributed.get_rank(tp_group) * local  # first padding column
        if first < local:
            padding = torch.arange(local, device=logits.device) >= max(first, 0)
            logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)
        return compute_loss(labels, logits)

    model.compute_language_model_loss = loss_without_padding


def release_model_caches() -> None:
    """Let go of every model this process built (call after dropping the last reference to one).

    megatron-core caches ``RotaryEmbedding.forward`` with a class-level ``functools.lru_cache``,
    whose keys hold ``self``: the rotary module, and through DDP's forward pre-hooks on every
    submodule the whole wrapped model, its gradient buffers and (on a GPU) their memory, stay
    alive after the trainer is gone. A process that builds a second model (a benchmark's
    variants, a rebuild after a fault) would carry the first one's memory."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if clear is not None:
        clear()


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Pad the vocabulary so the embedding splits evenly over TP ranks (Megatron's convention)."""
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)


def _recompute(job: JobConfig) -> dict[str, object]:
    """megatron-core's recomputation fields for ``train.recompute`` (none: its defaults)."""
    t = job.train
    if t.recompute == "none":
        return {}
    if t.recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {
        "recompute_granularity": "full",
        "recompute_method": t.recompute_method,
        "recompute_num_layers": t.recompute_num_layers,
    }


def transformer_config(
    job: JobConfig, device: str, tp_overlap: TPOverlapPlan | None = None
) -> TransformerConfig:
    """megatron-core's TransformerConfig for this job (fusions off on CPU: they need CUDA kernels).

    ``tp_overlap`` (``megascale.overlap.tp_plan``): a TE userbuffers plan adds megatron-core's
    ``tp_comm_overlap`` fields, which its TE linears turn into TE's ``ub_*`` arguments."""
    m, p = job.model, job.parallel
    on_cuda = device == "cuda"
    dtype = _DTYPES[m.params_dtype]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        gated_linear_unit=m.swiglu,
        normalization=m.normalization,
        add_bias_linear=m.bias,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        # megatron-core's window is (left, right) exclusive of the token itself.
        window_size=(m.window_size - 1, 0) if m.window_size is not None else None,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        # megatron-core's own init also tags TP-split weights (tensor_model_parallel, partition_dim),
        # which grad-norm and slicing rely on; init_parameters() then overwrites the values.
        perform_initialization=True,
        use_cpu_initialization=not on_cuda,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
        sequence_parallel=p.sequence_parallel,
        # overlap.pp (interleaved only): async steady-phase p2p, decoupled warm-up/cool-down.
        batch_p2p_comm=p.effective_batch_p2p_comm(job.overlap),
        overlap_p2p_comm=job.overlap.pp_active(p),
        overlap_p2p_comm_warmup_flush=job.overlap.pp_active(p),
        # Never fused: megatron-core's fused bias-GeLU is the tanh approximation, so a GPU run
        # would train another function than the CPU run (exact erf GeLU) and than what
        # ``megascale export`` declares (``hidden_act = "gelu"``).
        bias_activation_fusion=False,
        bias_dropout_fusion=on_cuda,
        masked_softmax_fusion=use_masked_softmax_fusion(
            on_cuda, on_cuda and _softmax_kernels_available(), m.window_size
        ),
        gradient_accumulation_fusion=False,
        **_recompute(job),
        apply_rope_fusion=False,
        deterministic_mode=not on_cuda,
        cuda_graph_scope=[],  # the dataclass default "full" is deprecated and warns
        **(tp_overlap.megatron_flags if tp_overlap is not None else {}),
    )


def layer_spec(model: ModelConfig, use_te: bool, tp_overlap_chunks: int = 1) -> ModuleSpec:
    """The transformer layer spec: TE or local modules, serial or MegaScale's parallel block.

    ``tp_overlap_chunks > 1`` (local modules, sequence parallelism, ``overlap.tp``): the serial
    block's attention and FFN collectives are chunked and overlapped with their GEMMs; the parallel
    block shares one all-gather and one reduce-scatter between its two branches, both chunked and
    pipelined with the branches' GEMMs (``megascale.overlap.tp``).
    """
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec()
        if model.parallel_block:
            # TE's default spec fuses each LayerNorm into the following linear; the parallel block
            # has one LayerNorm shared by both branches, so use the unfused TE linears.
            from megatron.core.extensions.transformer_engine import (
                TEColumnParallelLinear,
                TENorm,
            )

            sub = spec.submodules
            attention = dataclasses.replace(
                sub.self_attention.submodules, linear_qkv=TEColumnParallelLinear
            )
            spec = ModuleSpec(
                module=ParallelTransformerLayer,
                submodules=dataclasses.replace(
                    sub,
                    input_layernorm=TENorm,
                    self_attention=dataclasses.replace(sub.self_attention, submodules=attention),
                    mlp=with_mlp_linears(sub.mlp, linear_fc1=TEColumnParallelLinear),
                    pre_mlp_layernorm=IdentityOp,
                ),
            )
        return spec
    spec = get_gpt_layer_local_spec()
    if model.parallel_block and tp_overlap_chunks > 1:
        return _fused_parallel_spec(spec, tp_overlap_chunks)
    mlp, attention = spec.submodules.mlp, spec.submodules.self_attention
    if tp_overlap_chunks > 1:
        chunks = {"overlap_chunks": tp_overlap_chunks}
        column = ModuleSpec(module=OverlappedColumnParallelLinear, params=chunks)
        row = ModuleSpec(module=OverlappedRowParallelLinear, params=chunks)
        mlp = with_mlp_linears(mlp, linear_fc1=column, linear_fc2=row)
        attention = dataclasses.replace(
            attention,
            submodules=dataclasses.replace(
                attention.submodules, linear_qkv=column, linear_proj=row
            ),
        )
    sub = dataclasses.replace(
        spec.submodules,
        input_layernorm=LocalNorm,
        pre_mlp_layernorm=IdentityOp if model.parallel_block else LocalNorm,
        self_attention=attention,
        mlp=mlp,
    )
    module = ParallelTransformerLayer if model.parallel_block else spec.module
    return ModuleSpec(module=module, submodules=sub)


def with_mlp_linears(mlp: Any, **linears: Any) -> Any:
    """The layer spec's MLP slot with ``linears`` (``linear_fc1``, ``linear_fc2``) replaced, in
    the form the installed megatron-core uses: up to 0.16 a ``ModuleSpec(module=MLP,
    submodules=MLPSubmodules(...))``; from 0.17 on a ``functools.partial(MLP.as_mlp_submodule,
    submodules=MLPSubmodules(...))``."""
    if isinstance(mlp, functools.partial):
        submodules = dataclasses.replace(mlp.keywords["submodules"], **linears)
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, **linears))


def _fused_parallel_spec(spec: ModuleSpec, chunks: int) -> ModuleSpec:
    """Parallel block with shared TP communication: branch linears neither gather nor reduce;
    the block gathers and reduce-scatters once, chunked ``chunks`` ways."""
    sub = spec.submodules
    attention = dataclasses.replace(
        sub.self_attention.submodules,
        linear_qkv=GatheredInputColumnParallelLinear,
        linear_proj=PartialRowParallelLinear,
    )
    mlp = with_mlp_linears(
        sub.mlp,
        linear_fc1=GatheredInputColumnParallelLinear,
        linear_fc2=PartialRowParallelLinear,
    )
    return ModuleSpec(
        module=ParallelTransformerLayer,
        params={"fused_tp_comm": True, "tp_overlap_chunks": chunks},
        submodules=dataclasses.replace(
            sub,
            input_layernorm=LocalNorm,
            pre_mlp_layernorm=IdentityOp,
            self_attention=dataclasses.replace(sub.self_attention, submodules=attention),
            mlp=mlp,
        ),
    )


def _tp_chunks(job: JobConfig, use_te: bool) -> int:
    """Sequence chunks of the chunked TP overlap (1: none). The TE spec's linears overlap inside
    TE (config.tp_comm_overlap, megascale.overlap.tp_plan): our chunked linears replace
    megatron-core's local ones only."""
    return job.overlap.tp_chunks if job.overlap.tp_active(job.parallel) and not use_te else 1


def _block_spec(
    job: JobConfig, config: TransformerConfig, use_te: bool, vp_stage: int | None
) -> ModuleSpec:
    layer = layer_spec(job.model, use_te, _tp_chunks(job, use_te))
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm: type = TENorm
    else:
        final_norm = LocalNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[layer] * num_layers, layer_norm=final_norm
        ),
    )


def build_gpt(
    job: JobConfig,
    config: TransformerConfig,
    *,
    use_te: bool,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    pg_collection: object = None,
) -> GPTModel:
    """Build this rank's GPTModel for one virtual pipeline stage (parameters not yet initialised).

    With the chunked TP overlap the output layer's sequence-parallel all-gather is chunked and
    pipelined with the vocabulary GEMM like the layers' (``OverlappedColumnParallelLinear``).
    megatron-core builds that layer itself as a ``ColumnParallelLinear``; it becomes the chunked
    subclass in place (same parameters and state, plus its chunk count).
    """
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(job, config, use_te, vp_stage),
        vocab_size=padded_vocab_size(job.model.vocab_size, job.parallel.tp),
        max_sequence_length=job.model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=job.model.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=job.model.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    if post_process:
        mask_padded_vocabulary(model, job.model.vocab_size)
    chunks = _tp_chunks(job, use_te)
    if post_process and chunks > 1:
        model.output_layer.__class__ = OverlappedColumnParallelLinear
        model.output_layer.overlap_chunks = chunks
    return model


_LAYER_INDEX = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_parameter_name(
    local_name: str, model: GPTModel, config: TransformerConfig, vp_stage: int | None, pp_rank: int
) -> str:
    """The name a parameter has in the 1-process model: layer indices offset to global ones, and the
    last stage's copy of the tied output weight named after the embedding it mirrors."""
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    name = _LAYER_INDEX.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_name)
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight"
    return name


def _full_tensor(
    name: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int, device: torch.device
) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        is_norm_scale = "norm" in name and leaf in ("weight", "layer_norm_weight")
        return (torch.ones if is_norm_scale else torch.zeros)(shape, device=device)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = std / math.sqrt(2.0 * num_layers)  # GPT-2/Megatron scaled init of residual outputs
    # Drawn on the CPU generator whatever the device: CUDA's generator (Philox) gives other
    # numbers for the same seed, and one seed must give one model on CPU and GPU alike.
    generator = torch.Generator()
    generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.empty(shape).normal_(0.0, std, generator=generator).to(device)


def _tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a TP-split parameter, with megatron-core's stride convention (a stride
    of 2 for SwiGLU's fc1 interleaves the gate and up halves)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    per_stride = param.shape[dim] // stride
    pieces = torch.split(full, per_stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def _full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


@torch.no_grad()
def init_parameters(
    model: GPTModel,
    config: TransformerConfig,
    seed: int,
    *,
    vp_stage: int | None,
    pp_rank: int,
    tp_rank: int,
    tp_size: int,
) -> None:
    """Initialise every parameter from a seed keyed by its global name (layout-independent)."""
    for local_name, param in model.named_parameters():
        name = global_parameter_name(local_name, model, config, vp_stage, pp_rank)
        full = _full_tensor(
            name,
            _full_shape(param, tp_size),
            seed,
            config.init_method_std,
            config.num_layers,
            param.device,
        )
        param.copy_(_tp_slice(full, param, tp_rank, tp_size))
