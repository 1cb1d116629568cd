"""Communication/computation overlap: step time with each overlap off vs on, measured in one run.

Every collective and p2p call gets a fixed injected latency (``--latency-ms``, default 20) through
``megascale.overlap.trace.CommTrace``, so communication is costly relative to compute even on CPU:
an overlapped op costs about max(compute, latency), a serial one compute + latency. Variants
alternate within each round (noise lands on all alike) and every variant trains the same steps from
the same initial parameters, so their losses must be identical — the table shows the largest
relative difference from "off".

    python benchmarks/overlap.py                      # 8 CPU ranks: TP2 x PP2 (VPP2) x DP2 + SP
    python benchmarks/overlap.py --latency-ms 5 --steps 2 --rounds 1
    python benchmarks/overlap.py --device cuda --latency-ms 0   # 8 GPUs, NCCL, real links
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import tempfile
from pathlib import Path

import megatron.core  # noqa: F401  (import once, before forking the ranks)

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.overlap.measure import measure_rank, with_overlap

DEFAULT_SETS = [
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.vpp=2",
    "parallel.sequence_parallel=true",
    "model.num_layers=8",
    "model.hidden_size=64",
    "model.seq_length=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "optim.warmup_steps=0",
    "overlap.bucket_size=4000",
]
VARIANTS = {
    "off": {"dp": False, "pp": False, "tp": False},
    "dp only": {"dp": True, "pp": False, "tp": False},
    "pp only": {"dp": False, "pp": True, "tp": False},
    "tp only": {"dp": False, "pp": False, "tp": True},
    "all on": {"dp": True, "pp": True, "tp": True},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank, NCCL (use --latency-ms 0 to measure the real links)",
    )
    args = parser.parse_args(argv)

    sets = [*DEFAULT_SETS, "parallel.batch_p2p_comm=false", f"train.device={args.device}"]
    base = load(args.config, [*sets, *args.overrides])
    backend = "nccl" if args.device == "cuda" else "gloo"
    names = [n.strip() for n in args.variants.split(",")]
    variants = {n: validate(with_overlap(base, **VARIANTS[n]), args.nproc, backend) for n in names}
    data_dir = Path(tempfile.mkdtemp(prefix="megascale-bench-"))
    default_token_file(data_dir)
    rank_fn = functools.partial(
        measure_rank,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        latency_s=args.latency_ms / 1e3,
    )
    per_rank = run_local(rank_fn, args.nproc, (variants, data_dir), timeout_s=3600)
    print(report(args, base, per_rank))
    return 0


def report(args, base, per_rank: list[dict]) -> str:
    p, m = base.parallel, base.model
    lines = [
        f"# overlap benchmark — {datetime.date.today()}",
        f"command: {' '.join(sys.argv)}",
        f"layout: {args.nproc} {'GPU ranks (nccl)' if args.device == 'cuda' else 'CPU ranks (gloo)'}"
        f", TP{p.tp} x PP{p.pp} (VPP{p.vpp}) x "
        f"DP{args.nproc // (p.tp * p.pp)}, sequence_parallel={p.sequence_parallel}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, "
        f"gbs {base.train.global_batch_size}, mbs {base.train.micro_batch_size}",
        f"injected latency: {args.latency_ms:g} ms per collective/p2p call; "
        f"{args.steps} timed steps x {args.rounds} rounds per variant",
        "step time: median over steps of the slowest rank; exposed comm: median over steps of the "
        "mean over ranks of the time spent blocked on communication",
        "",
        "| variant | step time (s) | vs off | exposed comm (s) | max loss diff vs off |",
        "|---|---|---|---|---|",
    ]
    names = list(per_rank[0])
    step_time = {n: _median_of_slowest(per_rank, n) for n in names}
    exposed = {n: _median_exposed(per_rank, n) for n in names}
    ref = per_rank[0].get("off") or per_rank[0][names[0]]
    for n in names:
        diff = max(
            abs(a["loss"] - b["loss"]) / abs(b["loss"])
            for a, b in zip(per_rank[0][n], ref, strict=True)
        )
        ratio = step_time[n] / step_time.get("off", step_time[names[0]])
        lines.append(f"| {n} | {step_time[n]:.3f} | {ratio:.2f}x | {exposed[n]:.3f} | {diff:.1e} |")
    return "\n".join(lines)


def _median_of_slowest(per_rank: list[dict], name: str) -> float:
    steps = len(per_rank[0][name])
    return statistics.median(
        max(rank[name][i]["time_s"] for rank in per_rank) for i in range(steps)
    )


def _median_exposed(per_rank: list[dict], name: str) -> float:
    steps = len(per_rank[0][name])
    return statistics.median(
        statistics.fmean(rank[name][i]["exposed_s"] for rank in per_rank) for i in range(steps)
    )


if __name__ == "__main__":
    sys.exit(main())
