"""Activation recomputation's memory saving, measured on CPU: none vs selective vs full.

Builds the same model (default: the Llama-style preset ``llama-tiny`` at a longer sequence) three
times in one process, with ``train.recompute`` = ``none``, ``selective`` (megatron-core recomputes
the attention core) and ``full`` (it recomputes whole layers, ``train.recompute_method`` /
``recompute_num_layers`` as configured), and runs one forward and backward pass of the same
micro-batch through megatron-core's ``GPTModel``. What it measures, per variant:

- **saved for backward**: the bytes autograd holds for the backward pass at the end of the
  forward pass (their peak: nothing saved is freed before backward starts). Every tensor autograd
  saves passes through ``torch.autograd.graph.saved_tensors_hooks``; they are counted once per
  storage (views and tensors saved by several ops share one), parameters excluded (they are held
  anyway). This is the activation memory recomputation exists to cut, independent of the
  allocator and of the other tenants of the machine.
- with ``--rss``, **peak RSS growth**: each variant again in a fresh process (this script with
  ``--child``), the growth of the process's resident-set high-water mark (``VmHWM``, reset
  through ``/proc/self/clear_refs`` just before) over that one forward and backward pass. It
  includes the transient tensors, the gradients and the allocator's slack: the memory a user sees.

The loss is printed per variant: recomputation must change no number. Printed: date, versions,
config and command, then one row per variant with its figures and their ratio to ``none``.

    python benchmarks/recompute_memory.py                             # llama-tiny, seq 1024
    python benchmarks/recompute_memory.py --rss                       # + peak RSS per process
    python benchmarks/recompute_memory.py --set model.seq_length=128  # smaller, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_blocks  # noqa: E402  (benchmarks/ is not a package)

from megascale import config as config_mod  # noqa: E402
from megascale.config import JobConfig  # noqa: E402
from megascale.logs import quiet_expected_noise  # noqa: E402
from megascale.model.gpt import build_gpt, release_model_caches, transformer_config  # noqa: E402
from megascale.parallel.groups import build_groups, destroy_groups  # noqa: E402
from megascale.train.run import seed_everything  # noqa: E402

logger = logging.getLogger("megascale.benchmarks.recompute_memory")

VARIANTS = ("none", "selective", "full")
MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama-tiny", help="preset name or TOML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=["model.seq_length=1024"],
        metavar="SECTION.KEY=VALUE",
        help="config overrides (default: model.seq_length=1024; later ones win)",
    )
    parser.add_argument("--rss", action="store_true", help="also peak RSS, a process per variant")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def variant_job(args: argparse.Namespace, recompute: str) -> JobConfig:
    """The job with ``train.recompute = recompute``, validated for one CPU process."""
    job = config_mod.load(args.config, [*args.overrides, "train.device=cpu"])
    train = dataclasses.replace(job.train, recompute=recompute)
    return config_mod.validate(dataclasses.replace(job, train=train), 1, "gloo")


def _model_and_batch(job: JobConfig):
    """megatron-core's GPTModel for ``job`` (one rank) and one seeded micro-batch."""
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, "cpu")
    model = build_gpt(
        job, transformer_config(job, "cpu"), use_te=False, pre_process=True, post_process=True
    )
    m = job.model
    gen = torch.Generator().manual_seed(job.train.seed)
    shape = (job.train.micro_batch_size, m.seq_length)
    tokens = torch.randint(0, m.vocab_size, shape, generator=gen)
    position_ids = torch.arange(m.seq_length).expand(shape)
    return model, tokens, position_ids, torch.roll(tokens, -1, dims=1)


def _free(model) -> None:
    del model
    release_model_caches()
    gc.collect()


def saved_for_backward(job: JobConfig) -> dict[str, float]:
    """Bytes autograd saves for backward in one forward pass (per storage, no parameters); the
    number of tensors saved; the loss after the backward pass."""
    model, tokens, position_ids, labels = _model_and_batch(job)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in params:
            storages[ptr] = max(storages.get(ptr, 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
    held = sum(storages.values())
    loss.backward()  # the recomputation (if any) runs here, outside the hooks
    result = {"saved_bytes": held, "saved_tensors": count, "loss": loss.item()}
    _free(model)
    return result


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_growth(job: JobConfig) -> dict[str, float]:
    """Growth of this process's RSS high-water mark over one forward + backward pass (bytes)."""
    model, tokens, position_ids, labels = _model_and_batch(job)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    before = _status_kib("VmHWM")
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    return {"rss_growth_bytes": (_status_kib("VmHWM") - before) * 1024, "loss": loss.item()}


def rss_in_fresh_processes(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--config", args.config, "--child", name]
        cmd += [a for o in args.overrides[1:] for a in ("--set", o)]  # [0] is the default
        env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # the child's own
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"--child {name} failed: {proc.stderr[-2000:]}")
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def report(
    args: argparse.Namespace,
    job: JobConfig,
    saved: dict[str, dict[str, float]],
    rss: dict[str, dict[str, float]] | None,
) -> str:
    m, t = job.model, job.train
    full = f"method {t.recompute_method}, {t.recompute_num_layers} layer(s) per group"
    lines = [
        f"# recomputation memory: {model_blocks.device_name('cpu')}",
        f"date:     {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"command:  {shlex.join([sys.executable, *sys.argv])}",
        f"versions: torch {torch.__version__}, megatron-core {model_blocks._mcore_version()}",
        f"config:   {args.config} {' '.join(f'--set {o}' for o in args.overrides)}".rstrip(),
        f"model:    {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads "
        f"({m.num_query_groups or m.num_heads} kv), ffn {m.ffn_hidden_size}, seq {m.seq_length}, "
        f"vocab {m.vocab_size}, {m.params_dtype}, local spec",
        f"batch:    one micro-batch of {t.micro_batch_size} x {m.seq_length} tokens; full: {full}",
        "",
        "| recompute | saved for backward (MiB) | vs none | tensors saved "
        + ("| peak RSS growth (MiB) | vs none " if rss else "")
        + "| loss |",
        "|---|---:|---:|---:|" + ("---:|---:|" if rss else "") + "---:|",
    ]
    for name in VARIANTS:
        s = saved[name]
        row = (
            f"| {name} | {s['saved_bytes'] / MiB:.1f} "
            f"| {s['saved_bytes'] / saved['none']['saved_bytes']:.3f} | {s['saved_tensors']:.0f} "
        )
        if rss:
            growth, base = rss[name]["rss_growth_bytes"], rss["none"]["rss_growth_bytes"]
            row += f"| {growth / MiB:.1f} | {growth / base:.3f} "
        lines.append(row + f"| {s['loss']:.6f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    quiet_expected_noise()
    model_blocks.join_as_one_rank("cpu")
    try:
        if args.child:
            print(json.dumps(peak_rss_growth(variant_job(args, args.child))))
            return 0
        saved = {}
        for name in VARIANTS:
            saved[name] = saved_for_backward(variant_job(args, name))
            logger.info("%-9s %8.1f MiB saved for backward", name, saved[name]["saved_bytes"] / MiB)
    finally:
        destroy_groups()
    rss = rss_in_fresh_processes(args) if args.rss else None
    print(report(args, variant_job(args, "none"), saved, rss))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
