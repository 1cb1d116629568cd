"""megascale's trainer beside a plain megatron-core training loop, and what recomputation costs.

The same model (default: the ``h100-1b`` preset's layers on megatron-core's local spec), the same
batch and the same optimizer, trained in one process and one run by:

    megascale                 ``Trainer``: data pipeline, megatron-core DDP + optimizer, the
                              flight recorder's hooks, the compute meter, NaN checks, the timeline
    megascale + selective ... the same with ``train.recompute=selective`` (core attention recomputed)
    megascale + full ...      the same with ``train.recompute=full`` (every layer, uniform, 1 layer
                              per checkpointed group)
    megatron-core loop        megatron-core's own simple loop, nothing of megascale's: GPTModel on
                              ``get_gpt_layer_local_spec``, megatron-core DDP, ``get_megatron_optimizer``,
                              ``get_forward_backward_func``, random tokens already on the device,
                              and the fusions Megatron-LM turns on by default where their kernels
                              exist (bias-GeLU, bias-dropout; the fused softmax needs a CUDA
                              extension the image may lack)

So the first row over the last is what megascale's machinery and its choices cost (or save) against
the plain loop a Megatron user starts from; the recompute rows show the activation memory
recomputation saves and the time it costs. Variants take turns as in ``model_blocks.py``: each of
``--rounds`` rounds builds every variant afresh, runs ``--warmup`` untimed and ``--steps`` timed
optimizer steps and frees it; the order rotates from round to round.

Printed: device, date, versions, config and command, then one row per variant: median step time,
tokens/s, MFU (model FLOPs, ``megascale.probes.flops``; recomputation is not model work), HFU
for full recomputation (one more forward of every layer), the peak memory allocated during the
timed steps (CUDA; "n/a" on CPU), and tokens/s relative to the megascale row.

    python benchmarks/mcore_loop.py --set model.spec=local --set train.global_batch_size=16
    python benchmarks/mcore_loop.py --config tiny --device cpu --steps 2 --warmup 1 --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import shlex
import statistics
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_blocks  # noqa: E402  (benchmarks/ is not a package)

from megascale.config import JobConfig  # noqa: E402
from megascale.logs import quiet_expected_noise  # noqa: E402
from megascale.model.gpt import use_te_spec  # noqa: E402
from megascale.parallel.groups import build_groups, destroy_groups  # noqa: E402
from megascale.probes.flops import flops_per_token  # noqa: E402
from megascale.probes.peak import run_peak  # noqa: E402
from megascale.train.run import fp32_gemms_as_tf32, resolve_device, seed_everything  # noqa: E402
from megascale.train.trainer import Trainer  # noqa: E402

logger = logging.getLogger("megascale.benchmarks.mcore_loop")

MEGASCALE = "megascale"
PLAIN = "megatron-core loop"


@dataclass(frozen=True)
class Variant:
    name: str
    recompute: str  # train.recompute of the megascale rows; "none" for the plain loop
    plain: bool = False


VARIANTS = (
    Variant(MEGASCALE, "none"),
    Variant("megascale + selective recompute", "selective"),
    Variant("megascale + full recompute", "full"),
    Variant(PLAIN, "none", plain=True),
)


@dataclass
class Measured:
    job: JobConfig
    step_times: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: list[int] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    model: weakref.ref | None = None
    """The variant's model, once freed: it must be gone before the next variant's peak counts."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="h100-1b", help="preset name or TOML file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=2, help="turns each variant takes")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--variants",
        default=",".join(v.name for v in VARIANTS),
        help="comma-separated subset of: " + ", ".join(v.name for v in VARIANTS),
    )
    args = parser.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be >= 0")
    known = {v.name: v for v in VARIANTS}
    chosen = [s.strip() for s in args.variants.split(",") if s.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown or not chosen:
        parser.error(f"--variants {args.variants!r}: expected names from {sorted(known)}")
    args.variants = [known[c] for c in chosen]
    return args


def variant_job(job: JobConfig, variant: Variant) -> JobConfig:
    return dataclasses.replace(
        job, train=dataclasses.replace(job.train, recompute=variant.recompute)
    )


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def _timed(
    step: Callable[[], float], model: torch.nn.Module, device: str, warmup: int, steps: int
) -> Measured:
    """``warmup`` untimed and ``steps`` timed calls of ``step`` (each returns the loss as a float,
    which waits for the device); the peak memory of the timed ones."""
    out = Measured(job=None, model=weakref.ref(model))  # type: ignore[arg-type]
    for _ in range(warmup):
        step()
    _peak_reset(device)
    for _ in range(steps):
        start = time.perf_counter()
        out.losses.append(step())
        out.step_times.append(time.perf_counter() - start)
    out.peak_bytes.append(_peak_bytes(device))
    return out


def run_megascale(job: JobConfig, device: str, data_dir: Path, warmup: int, steps: int) -> Measured:
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, device)
    trainer = Trainer(job, groups, device, data_cache_dir=data_dir)
    try:
        return _timed(lambda: trainer.step().loss, trainer.model[0], device, warmup, steps)
    finally:
        trainer = None  # the closure's reference too: frees the model before the next variant
        model_blocks.free_models(device)


def plain_transformer_config(job: JobConfig, device: str):
    """A TransformerConfig with the job's shapes and what Megatron-LM sets by default."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = job.model
    on_cuda = device == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[m.params_dtype]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        normalization=m.normalization,
        add_bias_linear=m.bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        use_cpu_initialization=not on_cuda,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        bias_activation_fusion=on_cuda and m.bias and not m.swiglu,
        bias_dropout_fusion=on_cuda,
        masked_softmax_fusion=on_cuda and model_blocks_softmax_kernels(),
        cuda_graph_scope=[],
    )


def model_blocks_softmax_kernels() -> bool:
    import importlib.util

    return importlib.util.find_spec("scaled_upper_triang_masked_softmax_cuda") is not None


def run_plain(job: JobConfig, device: str, warmup: int, steps: int) -> Measured:
    """megatron-core's simple training loop on one rank, with the job's shapes and batch."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()  # the megascale variants' groups
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(job.train.seed)
    config = plain_transformer_config(job, device)
    m, t, o = job.model, job.train, job.optim
    vocab = int(math.ceil(m.vocab_size / 128) * 128)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=m.normalization),
        vocab_size=vocab,
        max_sequence_length=m.seq_length,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=m.rotary_base,
    ).to(device)
    if config.bf16 or config.fp16:
        # Megatron-LM's own wrapping: every parameter and buffer in bf16, inputs cast on entry
        # (megatron-core's local norms are built in fp32).
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=False,
            clip_grad=o.clip_grad,
        ),
        [ddp],
    )
    micro = t.global_batch_size // t.micro_batch_size
    generator = torch.Generator(device=device).manual_seed(t.seed)
    shape = (t.micro_batch_size, m.seq_length)
    positions = torch.arange(m.seq_length, device=device).expand(shape)
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, positions, None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def step() -> float:
        batches = [
            (
                torch.randint(0, m.vocab_size, shape, device=device, generator=generator),
                torch.randint(0, m.vocab_size, shape, device=device, generator=generator),
            )
            for _ in range(micro)
        ]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=ddp,
            num_microbatches=micro,
            seq_length=m.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
        )
        optimizer.step()
        return float(torch.stack([d["lm loss"] for d in losses]).mean())

    try:
        return _timed(step, ddp, device, warmup, steps)
    finally:
        ddp = model = optimizer = None  # the closure's references too
        parallel_state.destroy_model_parallel()
        model_blocks.free_models(device)


def measure(
    args: argparse.Namespace, job: JobConfig, device: str, data_dir: Path
) -> dict[str, Measured]:
    results = {v.name: Measured(variant_job(job, v)) for v in args.variants}
    variants = list(args.variants)
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for variant in order:
            m = results[variant.name]
            if variant.plain:
                got = run_plain(m.job, device, args.warmup, args.steps)
            else:
                got = run_megascale(m.job, device, data_dir, args.warmup, args.steps)
            if got.model() is not None:
                raise RuntimeError(f"{variant.name}: its model is still alive after it was freed")
            m.step_times += got.step_times
            m.peak_bytes += got.peak_bytes
            m.losses += got.losses
            logger.info(
                "round %d/%d %-22s %8.1f ms/step, peak %.1f GiB",
                r + 1,
                args.rounds,
                variant.name,
                1e3 * statistics.median(got.step_times),
                max(got.peak_bytes) / 2**30,
            )
    return results


def report(
    args: argparse.Namespace,
    job: JobConfig,
    device: str,
    results: dict[str, Measured],
    peak_tflops: float | None,
    notes: list[str],
) -> str:
    m, t = job.model, job.train
    spec = "te" if use_te_spec(m, device) else "local"
    plain = plain_transformer_config(job, device)
    lines = [
        f"# megascale vs a plain megatron-core loop: {model_blocks.device_name(device)}",
        f"date:     {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"command:  {shlex.join([sys.executable, *sys.argv])}",
        f"versions: torch {torch.__version__}, megatron-core {model_blocks._mcore_version()}",
        f"config:   {args.config} {' '.join(f'--set {o}' for o in args.overrides)}".rstrip(),
        f"model:    {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
        f"seq {m.seq_length}, vocab {m.vocab_size}, {m.params_dtype}, spec {spec} (megascale)",
        f"batch:    {t.global_batch_size} x {m.seq_length} tokens/step, micro-batch "
        f"{t.micro_batch_size}",
        f"timing:   {args.rounds} round(s) x ({args.warmup} warm-up + {args.steps} timed) steps "
        "per variant, variants alternating, order rotated each round",
        f"plain loop fusions: bias-activation {plain.bias_activation_fusion}, bias-dropout "
        f"{plain.bias_dropout_fusion}, masked softmax {plain.masked_softmax_fusion}",
        f"peak:     {f'{peak_tflops:g} TFLOP/s dense' if peak_tflops else 'n/a'}",
        *(f"note:     {n}" for n in notes),
        "",
        "| variant | step ms (median) | tokens/s | MFU | HFU | peak memory (GiB) | vs megascale |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    tokens_per_step = t.global_batch_size * m.seq_length
    base = None
    for variant in args.variants:
        r = results[variant.name]
        tokens_per_s = tokens_per_step * len(r.step_times) / sum(r.step_times)
        if variant.name == MEGASCALE:
            base = tokens_per_s
        mfu = hfu = "n/a"
        if peak_tflops:
            model_flops = flops_per_token(m).total
            mfu = f"{tokens_per_s * model_flops / (peak_tflops * 1e12):.1%}"
            hardware = flops_per_token(m, include_recompute=variant.recompute == "full").total
            hfu = f"{tokens_per_s * hardware / (peak_tflops * 1e12):.1%}"
        memory = f"{max(r.peak_bytes) / 2**30:.1f}" if device == "cuda" else "n/a"
        ratio = f"{tokens_per_s / base:.3f}" if base else "n/a"
        lines.append(
            f"| {variant.name} | {1e3 * statistics.median(r.step_times):.1f} "
            f"| {tokens_per_s:,.0f} | {mfu} | {hfu} | {memory} | {ratio} |"
        )
    lines.append("")
    lines.append(
        "Selective recomputation's HFU is its MFU plus the recomputed core attention (not "
        "counted here); losses: "
        + ", ".join(f"{v.name} {results[v.name].losses[-1]:.3f}" for v in args.variants)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    quiet_expected_noise()
    device = resolve_device(args.device)
    bench_args = argparse.Namespace(
        config=args.config, overrides=args.overrides, warmup=args.warmup, steps=args.steps,
        window=1 << 30,
    )  # fmt: skip
    job, notes = model_blocks.base_job(bench_args, device)
    notes = [n for n in notes if not n.startswith("--window")]
    model_blocks.join_as_one_rank(device)
    try:
        with tempfile.TemporaryDirectory(prefix="megascale-bench-") as tmp:
            results = measure(args, job, device, Path(tmp) / "data")
    finally:
        destroy_groups()
    tf32 = fp32_gemms_as_tf32(job, device)
    peak = run_peak(device, job.model.params_dtype, None, tf32=tf32) if device == "cuda" else None
    print(report(args, job, device, results, peak.tflops if peak else None, notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
