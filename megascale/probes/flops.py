"""Model FLOPs per token, parameter counts, GPU peaks and MFU: the numbers behind `megascale mfu`.

Counting rules (one multiply-add = 2 FLOPs; d = hidden_size / num_heads, g = num_query_groups,
f = ffn_hidden_size, V = vocab_size as configured, i.e. *unpadded*: the padding rows of the
embedding are waste, not model work). Forward FLOPs per token and layer:

    qkv projection        2 * h * (h + 2 * g * d)      K and V are g * d wide under GQA
    attention QK^T        2 * h * k                    k = keys this query attends to (below)
    attention AV          2 * h * k
    output projection     2 * h * h
    mlp                   2 * h * f * 2                GeLU: fc1 h->f, fc2 f->h
                          2 * h * f * 3                SwiGLU: gate and up h->f, down f->h
    lm head (once)        2 * h * V

Training = forward + backward = 3 x forward (backward = data gradient + weight gradient). Norms,
softmax, activations, the embedding lookup and the optimizer are not counted (they are O(h) per
token, not O(h^2)). MegaScale's parallel block changes no FLOPs, only the order of the work.

Keys per query, ``k``: by default we count the keys each query actually attends to. With causal
attention the query at position i (0-based) sees min(i + 1, w) keys (w = window_size, or s for full
attention), and ``k`` is the exact mean over the s positions: (s + 1) / 2 for full causal attention,
w * (w + 1) / 2 + (s - w) * w summed over the sequence with a window w < s. Megatron-LM and
Narayanan et al. (2021) instead count every query against all s keys ("dense s*s"); pass
``dense_attention=True`` for that convention (with a window: every query against w keys), e.g. to
compare with numbers those codebases print. The two differ only in the attention terms.

MFU (model FLOPs utilisation) uses these model FLOPs: activation recomputation is *not* counted,
since recomputed work is not model work. ``include_recompute=True`` adds one more forward of every
layer (full recomputation; the LM head is not recomputed), which gives hardware FLOPs (HFU) instead.

Parameter counts (``count_parameters``), unlike FLOPs, are of the model as built and so *include*
the vocabulary padding (the embedding has ``padded_vocab(V, tp)`` rows): they are memory, not work.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from dataclasses import dataclass
from fractions import Fraction

from megascale import config
from megascale.config import ModelConfig

logger = logging.getLogger(__name__)

PEAK_TFLOPS: dict[str, float] = {
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
}
"""Dense (no structured sparsity) bf16 tensor-core peaks per GPU in TFLOP/s, from NVIDIA's data
sheets (the sparse figures are twice these). Never TF32 or sparse numbers. H100/H200 NVL parts
(lower clocks) are deliberately absent: pass an explicit peak for them."""

FP32_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"tf32": 494.7, "fp32": 67.0},
    "H100 PCIe": {"tf32": 378.0, "fp32": 51.0},
    "H200": {"tf32": 494.7, "fp32": 67.0},
    "A100": {"tf32": 156.0, "fp32": 19.5},
}
"""Dense peaks in TFLOP/s of an fp32 model per GPU (keys of ``PEAK_TFLOPS``), from NVIDIA's data
sheets: ``tf32`` where its GEMMs run on the tensor cores as TF32 (the sheets' sparse TF32 figure
halved), ``fp32`` where they run as true FP32 on the CUDA cores. GPUs absent here have no fp32
figure (pass an explicit peak)."""


@dataclass(frozen=True)
class FlopBreakdown:
    """Training FLOPs per token (forward + backward = 3 x forward) by component, whole model.

    All layers are summed; ``lm_head`` is the output projection to the vocabulary. ``total``
    excludes activation recomputation unless the breakdown was made with ``include_recompute``.
    ``keys_per_query`` is the mean number of keys the attention terms were counted with.
    """

    qkv: float
    attention_scores: float
    attention_values: float
    attention_output: float
    mlp: float
    lm_head: float
    keys_per_query: float

    @property
    def total(self) -> float:
        """Sum of the components."""
        return (
            self.qkv
            + self.attention_scores
            + self.attention_values
            + self.attention_output
            + self.mlp
            + self.lm_head
        )

    def components(self) -> dict[str, float]:
        """Component name -> FLOPs, in the order of the data path, plus ``total``."""
        d = dataclasses.asdict(self)
        d.pop("keys_per_query")
        d["total"] = self.total
        return d


def _shape(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(head_dim, query_groups, ffn_hidden_size, window) with the config's defaults resolved."""
    h, n = cfg.hidden_size, cfg.num_heads
    g = n if cfg.num_query_groups is None else cfg.num_query_groups
    if n < 1 or h % n:
        raise ValueError(f"model.hidden_size={h} must be a multiple of model.num_heads={n}")
    if g < 1 or n % g:
        raise ValueError(f"model.num_query_groups={g} must divide model.num_heads={n}")
    f = 4 * h if cfg.ffn_hidden_size is None else cfg.ffn_hidden_size
    s = cfg.seq_length
    w = s if cfg.window_size is None else min(cfg.window_size, s)
    if w < 1:
        raise ValueError(f"model.window_size={cfg.window_size}; accepted: >= 1 or None")
    return h // n, g, f, w


def mean_keys_per_query(seq_length: int, window_size: int | None = None) -> Fraction:
    """Exact mean over positions 0..s-1 of min(i + 1, w) (w = window_size, capped at s).

    Full causal attention: (s + 1) / 2. A window w < s: (w * (w + 1) / 2 + (s - w) * w) / s.
    """
    s = seq_length
    w = s if window_size is None else min(window_size, s)
    return Fraction(w * (w + 1) // 2 + (s - w) * w, s)


def flops_per_token(
    model: ModelConfig, *, include_recompute: bool = False, dense_attention: bool = False
) -> FlopBreakdown:
    """Training FLOPs per token of ``model`` by component (rules in the module docstring).

    ``include_recompute``: count one extra forward of every layer (full activation
    recomputation); MFU must not, so leave it False for MFU. ``dense_attention``: count every query
    against all s keys (w with a window), the Megatron/Narayanan convention, instead of the keys
    the causal mask leaves.
    """
    d, g, f, w = _shape(model)
    h, L, V = model.hidden_size, model.num_layers, model.vocab_size
    q = model.num_heads * d  # query width (== h)
    keys = Fraction(w) if dense_attention else mean_keys_per_query(model.seq_length, w)
    layer_passes = 4 if include_recompute else 3  # forward (+ recomputed forward) + backward
    per_layer = 2 * layer_passes * L  # 2 FLOPs per multiply-add, every pass, every layer
    return FlopBreakdown(
        qkv=float(per_layer * h * (q + 2 * g * d)),
        attention_scores=float(per_layer * q * keys),
        attention_values=float(per_layer * q * keys),
        attention_output=float(per_layer * q * h),
        mlp=float(per_layer * h * f * (3 if model.swiglu else 2)),
        lm_head=float(2 * 3 * h * V),
        keys_per_query=float(keys),
    )


VOCAB_PAD_MULTIPLE = 128
"""The embedding's rows are padded to a multiple of this times ``parallel.tp`` (Megatron's
convention; ``megascale.model.gpt.padded_vocab_size``, restated here so that ``megascale mfu``
does not import torch)."""


def padded_vocab(vocab_size: int, tp: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``128 * tp``: the rows ``build_gpt`` allocates."""
    step = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab_size // step) * step


def count_parameters(model_cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of the GPT that ``megascale.model.gpt.build_gpt`` builds, counted analytically.

    The count is of the model *as built*, with ``parallel.tp = tp``: every tensor once (summed over
    the tensor-parallel slices, the tied output layer not counted again on the last pipeline stage),
    so it equals ``sum(p.numel())`` of the 1-process model. It therefore includes the vocabulary
    padding: the word embedding has ``padded_vocab(vocab_size, tp)`` rows (a multiple of
    ``128 * tp``), which are allocated, optimised and checkpointed like any other parameter even
    though no token id reaches them. (FLOPs, in contrast, use the unpadded vocabulary; the padding
    is ``(padded_vocab - vocab_size) * h``.)

    The model: rotary position embeddings (no parameters), the word embedding tied with the LM
    head (counted once, no output bias; ``tie_embeddings = false`` adds the LM head's own matrix),
    megatron-core's local modules or Transformer Engine (the same parameters: biases on every
    linear layer unless ``bias = false``, LayerNorm with weight and bias, RMSNorm a weight only). Per layer: QKV
    ``h * (h + 2*g*d)`` + bias, output projection ``h * h`` + bias, MLP ``h*f*2`` (GeLU) or
    ``h*f*3`` (SwiGLU, gate and up stacked in fc1) + biases, and two LayerNorms, or one with
    ``parallel_block`` (attention and MLP read the same normalised input; ``pre_mlp_layernorm`` is
    an ``IdentityOp``). Plus the final LayerNorm.
    """
    d, g, f, _ = _shape(model_cfg)
    h = model_cfg.hidden_size
    qkv_out = h + 2 * g * d
    fc1_out = 2 * f if model_cfg.swiglu else f
    b = 1 if model_cfg.bias else 0  # model.bias: biases on every linear layer
    norm = 2 * h if model_cfg.normalization == "LayerNorm" else h  # RMSNorm: a weight only
    layer = (
        (h * qkv_out + b * qkv_out)  # linear_qkv
        + (h * h + b * h)  # linear_proj
        + (h * fc1_out + b * fc1_out)  # linear_fc1 (gate and up stacked for SwiGLU)
        + (f * h + b * h)  # linear_fc2
        + (1 if model_cfg.parallel_block else 2) * norm
    )
    embedding = padded_vocab(model_cfg.vocab_size, tp) * h  # the input embedding
    output = 0 if model_cfg.tie_embeddings else embedding  # an LM head of its own when untied
    return embedding + output + model_cfg.num_layers * layer + norm  # + the final norm


def lookup_peak(gpu_name: str) -> tuple[str, float]:
    """(table key, dense bf16 TFLOP/s) for a GPU name as ``nvidia-smi`` or a user writes it.

    Case-insensitive and tolerant of vendor words: "H100", "nvidia h100 80gb hbm3" and
    "H100-SXM5-80GB" are the H100 SXM; "NVIDIA H100 PCIe" the PCIe card; any A100/A800 variant is
    312. Raises ValueError listing the accepted names for anything else (H100 NVL, L40, ...).
    """
    words = set(re.split(r"[^A-Z0-9]+", gpu_name.upper())) - {"", "NVIDIA", "TESLA"}
    if "NVL" not in words:
        if "H100" in words:
            key = "H100 PCIe" if "PCIE" in words else "H100 SXM"  # "H100 80GB HBM3" is SXM
            return key, PEAK_TFLOPS[key]
        for key in ("H200", "H800", "A100", "A800", "L40S", "B200"):
            if key in words:
                return key, PEAK_TFLOPS[key]
    accepted = ", ".join(f"{k} ({v:g})" for k, v in PEAK_TFLOPS.items())
    raise ValueError(
        f"unknown GPU name {gpu_name!r}: accepted names contain one of {accepted} "
        "(dense bf16 TFLOP/s); for any other GPU pass --peak-tflops with its dense bf16 peak"
    )


def resolve_peak(peak_tflops: float | None, gpu_name: str | None) -> tuple[float, str] | None:
    """(TFLOP/s, where it came from) from an explicit peak (wins) or a GPU name; None if neither."""
    if peak_tflops is not None:
        if peak_tflops <= 0:
            raise ValueError(f"--peak-tflops {peak_tflops:g}; accepted: > 0")
        return peak_tflops, f"--peak-tflops {peak_tflops:g}"
    if gpu_name is not None:
        key, value = lookup_peak(gpu_name)
        return value, f"{key} dense bf16 {value:g} TFLOP/s (from GPU name {gpu_name!r})"
    return None


def mfu(tokens_per_s: float, n_gpus: int, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation, a fraction: achieved model FLOP/s over n_gpus * peak.

    ``flops_per_token`` is training FLOPs per token without recomputation
    (``flops_per_token(cfg).total``); ``tokens_per_s`` is the whole job's throughput.
    """
    if n_gpus < 1 or peak_tflops <= 0 or tokens_per_s < 0:
        raise ValueError(
            f"mfu(tokens_per_s={tokens_per_s}, n_gpus={n_gpus}, peak_tflops={peak_tflops}): "
            "need tokens_per_s >= 0, n_gpus >= 1, peak_tflops > 0"
        )
    return tokens_per_s * flops_per_token / (n_gpus * peak_tflops * 1e12)


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {prefix}{unit}"
    return f"{x:.4g} {unit}"


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)


_LABELS = {
    "qkv": "qkv projection",
    "attention_scores": "attention QK^T",
    "attention_values": "attention AV",
    "attention_output": "attention output proj",
    "mlp": "mlp",
    "lm_head": "lm head",
    "total": "total",
}


def mfu_report(
    model_cfg: ModelConfig,
    tokens_per_s: float | None,
    gpus: int,
    peak_tflops: float | None,
    gpu_name: str | None,
    tp: int = 1,
) -> str:
    """The text of ``megascale mfu``: shape, parameters, FLOPs/token by component, peak, MFU.

    MFU is given with our causal-keys count and, for comparison, with the dense s*s convention.
    ``tp`` (``parallel.tp``) only sets the vocabulary padding in the parameter count.
    Raises ValueError for an unknown GPU name or a non-positive peak.
    """
    m = model_cfg
    d, g, f, w = _shape(m)
    fl = flops_per_token(m)
    dense = flops_per_token(m, dense_attention=True)
    n_params = count_parameters(m, tp)
    vocab_rows = padded_vocab(m.vocab_size, tp)
    non_embedding = n_params - vocab_rows * m.hidden_size * (1 if m.tie_embeddings else 2)
    lines = [
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads "
        f"({g} query groups, head dim {d}), ffn {f} ({'SwiGLU' if m.swiglu else 'GeLU'}), "
        f"seq {m.seq_length}, vocab {m.vocab_size} (embedding padded to {vocab_rows} rows "
        f"for tp {tp}), "
        f"window {'none' if m.window_size is None else w}, "
        f"{'parallel' if m.parallel_block else 'sequential'} block",
        f"parameters: {n_params:,} ({_count(n_params)}; {non_embedding:,} outside the embeddings;"
        f" {'tied input/output embedding' if m.tie_embeddings else 'input and output embeddings'}"
        f" incl. padding, rotary positions, {'biases, ' if m.bias else 'no biases, '}"
        f"{m.normalization})",
        "training FLOPs per token (forward + backward = 3 x forward; activation recomputation "
        "not counted):",
    ]
    for name, value in fl.components().items():
        share = f"{100 * value / fl.total:5.1f}%"
        lines.append(f"  {_LABELS[name]:<22} {_si(value, 'FLOP'):>14}  {share}")
    lines += [
        f"  (attention counted over {fl.keys_per_query:.6g} keys per query on average, the keys "
        f"the {'sliding-window ' if m.window_size is not None else ''}causal mask leaves)",
        f"  dense s*s convention (Megatron, Narayanan et al. 2021"
        f"{f'; every query against {w} keys' if m.window_size is not None else ''}): "
        f"{_si(dense.total, 'FLOP')}",
        f"  6N rule of thumb (N = {non_embedding:,} non-embedding): "
        f"{_si(6 * non_embedding, 'FLOP')}",
    ]
    peak = resolve_peak(peak_tflops, gpu_name)
    lines.append(f"peak: {peak[1]}" if peak else "peak: none given (--gpu NAME or --peak-tflops P)")
    if tokens_per_s is not None:
        lines.append(
            f"throughput: {tokens_per_s:,.1f} tokens/s on {gpus} GPU(s) = "
            f"{tokens_per_s / gpus:,.1f} tokens/s per GPU, "
            f"{_si(tokens_per_s * fl.total / gpus, 'FLOP/s')} of model FLOPs per GPU"
        )
        if peak:
            value = mfu(tokens_per_s, gpus, fl.total, peak[0])
            lines.append(
                f"MFU: {100 * value:.1f}% "
                f"({100 * mfu(tokens_per_s, gpus, dense.total, peak[0]):.1f}% with the dense "
                "s*s attention convention)"
                + (" -- above 100%: check the throughput, GPU count and peak" if value > 1 else "")
            )
        else:
            lines.append("MFU: needs a peak (--gpu NAME or --peak-tflops P)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale mfu [CONFIG] [--set ...] --tokens-per-s X --gpus N
    (--peak-tflops P | --gpu NAME)``."""
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        help="TOML file or preset name (default: the default preset)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override a config value (repeatable)",
    )
    parser.add_argument(
        "--tokens-per-s",
        type=float,
        default=None,
        help="measured throughput of the whole job, tokens per second",
    )
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the throughput was measured on")
    peak = parser.add_mutually_exclusive_group()
    peak.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak per GPU in TFLOP/s (overrides the table)",
    )
    peak.add_argument(
        "--gpu", default=None, metavar="NAME", help=f"GPU name to look up: {', '.join(PEAK_TFLOPS)}"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``megascale mfu``: write the report to stdout; 1 with a logged error on bad input."""
    try:
        cfg = config.load(args.config, args.overrides)
        text = mfu_report(
            cfg.model, args.tokens_per_s, args.gpus, args.peak_tflops, args.gpu, cfg.parallel.tp
        )
    except ValueError as e:  # ConfigError is a ValueError
        logger.error("megascale mfu: %s", e)
        return 1
    sys.stdout.write(text + "\n")
    return 0
