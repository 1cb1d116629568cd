"""MegaScale's model changes side by side: serial vs parallel block, full vs sliding-window attention.

Trains the same job (default: the 1-GPU preset ``h100-1b``) in four variants, in one
process and one run, with the real ``Trainer``:

    baseline          serial block (x + Attn(LN(x)), then + MLP(LN(.)))   full causal attention
    parallel block    y = x + Attn(LN(x)) + MLP(LN(x))                     full causal attention
    sliding window    serial block                                         window of --window tokens
    parallel+window   parallel block                                       window of --window tokens

Drift (clocks, thermals, other tenants) must hit every variant alike, so the variants take turns:
each of ``--rounds`` rounds builds every variant afresh (megatron-core's parallel state is rebuilt
by ``build_groups``), runs ``--warmup`` untimed and ``--steps`` timed optimizer steps, and frees it
before the next; the order rotates from round to round. Only one variant's model and optimizer
state is in memory at a time (the 1B preset needs ~18 GB of it).

Printed: the device, date, versions, config and command, then one table row per variant with the
median step time, tokens/s over all timed steps, the spread of per-round tokens/s, MFU (model
FLOPs of *that* variant, per ``megascale.probes.flops``: a window does less attention work, so
its MFU can drop while its tokens/s rises) and tokens/s relative to the baseline. On CPU the MFU
column reads "n/a". Paste GPU results into ``benchmarks/RESULTS.md``.

    python benchmarks/model_blocks.py                                  # GPU, h100-1b, window 512
    python benchmarks/model_blocks.py --config tiny --device cpu --window 16 \\
        --steps 3 --warmup 1 --rounds 1                                # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from megascale import config as config_mod
from megascale.config import JobConfig
from megascale.launcher.local import free_port
from megascale.logs import quiet_expected_noise
from megascale.model.gpt import release_model_caches, te_available, use_te_spec
from megascale.parallel import cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.probes.flops import flops_per_token
from megascale.probes.peak import run_peak
from megascale.train.run import fp32_gemms_as_tf32, resolve_device, seed_everything
from megascale.train.trainer import Trainer

logger = logging.getLogger("megascale.benchmarks.model_blocks")


@dataclass(frozen=True)
class Variant:
    name: str
    parallel_block: bool
    window: bool


VARIANTS = (
    Variant("baseline", parallel_block=False, window=False),
    Variant("parallel block", parallel_block=True, window=False),
    Variant("sliding window", parallel_block=False, window=True),
    Variant("parallel+window", parallel_block=True, window=True),
)


@dataclass
class Measured:
    """Timed steps of one variant, all rounds together."""

    job: JobConfig
    step_times: list[float] = dataclasses.field(default_factory=list)
    round_tokens_per_s: list[float] = dataclasses.field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="h100-1b", help="preset name or TOML file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="turns each variant takes")
    parser.add_argument("--window", type=int, default=512, help="sliding window in tokens")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be >= 0")
    return args


def base_job(args: argparse.Namespace, device: str) -> tuple[JobConfig, list[str]]:
    """The job every variant shares, validated for 1 process; and notes for the report."""
    notes = []
    job = config_mod.load(args.config, [*args.overrides, f"train.device={device}"])
    if job.model.spec == "te" and not (device == "cuda" and te_available()):
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, spec="auto"))
        notes.append("model.spec 'te' -> 'auto': Transformer Engine unavailable here")
    if args.window >= job.model.seq_length:
        notes.append(f"--window {args.window} >= seq_length {job.model.seq_length}: no effect")
    # The LR schedule must outlast warm-up + timed steps (its values do not change step time).
    steps = max(job.train.steps, args.warmup + args.steps + 1, job.optim.warmup_steps + 1)
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, steps=steps))
    return config_mod.validate(job, 1, "nccl" if device == "cuda" else "gloo"), notes


def variant_job(job: JobConfig, variant: Variant, window: int) -> JobConfig:
    model = dataclasses.replace(
        job.model,
        parallel_block=variant.parallel_block,
        window_size=window if variant.window else None,
    )
    return dataclasses.replace(job, model=model)


def run_variant(
    job: JobConfig, device: str, data_dir: Path, warmup: int, steps: int
) -> list[float]:
    """Build ``job`` from scratch, train ``warmup`` + ``steps`` steps; the timed step times."""
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, device)
    trainer = Trainer(job, groups, device, data_cache_dir=data_dir)
    try:
        for _ in range(warmup):
            trainer.step()
        # Each step ends in float(loss), which waits for the device: step_time_s is wall time.
        return [trainer.step().step_time_s for _ in range(steps)]
    finally:
        del trainer
        free_models(device)


def free_models(device: str) -> None:
    """Free the models dropped so far (megatron-core's caches hold them: release_model_caches)."""
    release_model_caches()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure(
    args: argparse.Namespace, job: JobConfig, device: str, data_dir: Path
) -> dict[str, Measured]:
    results = {v.name: Measured(variant_job(job, v, args.window)) for v in VARIANTS}
    tokens_per_step = job.train.global_batch_size * job.model.seq_length
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            m = results[variant.name]
            times = run_variant(m.job, device, data_dir, args.warmup, args.steps)
            m.step_times.extend(times)
            m.round_tokens_per_s.append(tokens_per_step * len(times) / sum(times))
            logger.info(
                "round %d/%d %-15s %8.1f ms/step",
                r + 1,
                args.rounds,
                variant.name,
                1e3 * statistics.median(times),
            )
    return results


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


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
    lines = [
        f"# model blocks: {device_name(device)}",
        f"date:     {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"command:  {shlex.join([sys.executable, *sys.argv])}",
        f"versions: torch {torch.__version__}, megatron-core {_mcore_version()}",
        f"config:   {args.config} {' '.join(f'--set {o}' for o in args.overrides)}".rstrip(),
        f"model:    {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
        f"seq {m.seq_length}, vocab {m.vocab_size}, {m.params_dtype}, spec {spec}",
        f"batch:    {t.global_batch_size} x {m.seq_length} tokens/step, micro-batch "
        f"{t.micro_batch_size}; window {args.window}",
        f"timing:   {args.rounds} round(s) x ({args.warmup} warm-up + {args.steps} timed) steps "
        "per variant, variants alternating, order rotated each round",
        f"peak:     {f'{peak_tflops:g} TFLOP/s dense bf16' if peak_tflops else 'n/a'}; MFU counts "
        "each variant's own model FLOPs (causal keys attended, megascale.probes.flops)",
        *(f"note:     {n}" for n in notes),
        "",
        "| variant | parallel_block | window | step ms (median) | tokens/s | spread | MFU "
        "| vs baseline |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    tokens_per_step = t.global_batch_size * m.seq_length
    base = None
    for variant in VARIANTS:
        r = results[variant.name]
        tokens_per_s = tokens_per_step * len(r.step_times) / sum(r.step_times)
        base = base or tokens_per_s
        rounds = r.round_tokens_per_s
        spread = (max(rounds) - min(rounds)) / statistics.median(rounds)
        if peak_tflops:
            flops = flops_per_token(r.job.model).total
            mfu = f"{tokens_per_s * flops / (peak_tflops * 1e12):.1%}"
        else:
            mfu = "n/a"
        window = r.job.model.window_size or "full"
        lines.append(
            f"| {variant.name} | {variant.parallel_block} | {window} "
            f"| {1e3 * statistics.median(r.step_times):.1f} | {tokens_per_s:,.0f} "
            f"| {spread:.1%} | {mfu} | {tokens_per_s / base:.3f} |"
        )
    return "\n".join(lines)


def _mcore_version() -> str:
    import megatron.core

    return megatron.core.__version__


def join_as_one_rank(device: str) -> None:
    """This process as the one rank of a job, torchrun-style: the same setup as
    ``megascale.train.run.run_rank``."""
    for key, value in [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
        ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
    ]:
        os.environ.setdefault(key, value)
    init_distributed(device)
    if device == "cpu":
        cpu_backend.activate()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    quiet_expected_noise()
    device = resolve_device(args.device)
    job, notes = base_job(args, device)
    join_as_one_rank(device)
    try:
        with tempfile.TemporaryDirectory(prefix="megascale-bench-") as tmp:
            # The built-in corpus is built here unless data.path names a token file.
            results = measure(args, job, device, Path(tmp) / "data")
    finally:
        destroy_groups()
    tf32 = fp32_gemms_as_tf32(job, device)
    peak = run_peak(device, job.model.params_dtype, None, tf32=tf32) if device == "cuda" else None
    print(report(args, job, device, results, peak.tflops if peak else None, notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
