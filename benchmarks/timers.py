"""Timeline overhead: training step time with the timeline recording vs not, interleaved in one run.

Every rank builds one trainer and one timeline. Steps alternate between "on" (the timeline attached:
megatron-core's timers, every collective and p2p call traced, the trainer's own segments) and "off"
(``NULL_TIMELINE``, nothing attached); the order flips every round (on/off, off/on) so drift lands
on both, and every step starts after a barrier. After each round, outside the timed steps, the
records are flushed to disk; the writer thread's own time is reported separately (it runs in the
background during training; counting all of it on the critical path is the upper bound).

Three views of the overhead:
* measured: median over rounds of (on - off) / off of the step time (slowest rank);
* measured CPU: the same for the CPU time all ranks spent in the step (``process_time``): on a
  shared, oversubscribed machine the work added is what the timeline costs, and it is far less
  noisy than wall time;
* bottom-up: segments and comm calls per step x their unit costs (a span enter/exit; a real
  all-reduce through the comm hook vs bare, main-thread CPU, measured in the ranks after training)
  + writer time per step, over the step time: not blurred by the noise of 8 ranks on 2 cores.

    python benchmarks/timers.py                 # 8 CPU ranks: TP2 x PP2 x DP2 + SP, 30 rounds
    python benchmarks/timers.py --rounds 10 --set model.num_layers=2
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import megatron.core  # noqa: F401  (import once, before forking the ranks)
import torch
import torch.distributed as dist

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.diagnostics import timers
from megascale.diagnostics.comm_timer import CommTimer
from megascale.launcher.local import run_local
from megascale.logs import quiet_expected_noise
from megascale.overlap.trace import CommTrace
from megascale.parallel import cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.train.run import seed_everything
from megascale.train.trainer import Trainer

# Hidden 256 x seq 128: a step whose time goes to computing, as in real training, rather than to
# Python dispatch around tiny GEMMs (the tests' hidden-32 model). Compare with --set
# model.hidden_size=64 --set model.seq_length=64: the same calls, a quarter of the compute.
DEFAULT_SETS = [
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.sequence_parallel=true",
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.seq_length=128",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "optim.warmup_steps=0",
    "diagnostics.flush_interval_steps=1000",  # flushed explicitly between rounds
]


def _rank(job, data_dir: Path, run_dir: Path, rounds: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    init_distributed("cpu")
    cpu_backend.activate()
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, "cpu")
    timeline = timers.build_timeline(job.diagnostics, run_dir, groups, "cpu")
    trainer = Trainer(job, groups, "cpu", data_cache_dir=data_dir)  # starts with NULL_TIMELINE
    times: dict[str, list[float]] = {"on": [], "off": [], "cpu_on": [], "cpu_off": []}
    records = []
    for r in range(warmup + rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            if mode == "on":
                trainer.timeline = timeline
                timeline.attach(trainer.config, trainer.optimizer)
            else:
                timeline.detach()
                trainer.timeline = timers.NULL_TIMELINE
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            trainer.step()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if mode == "on":
                batch = timeline._batch  # this step's records, for the counts
                records.append((len(batch.spans), len(batch.comm) + len(timeline._comm.events)))
            if r >= warmup:
                times[mode].append(elapsed)
                times[f"cpu_{mode}"].append(cpu)
        timeline.detach()
        timeline.flush()  # outside the timed steps; timed by the writer itself
    timeline.close()
    costs = comm_call_costs()
    destroy_groups()
    return {
        **times,
        **costs,
        "span_s": span_cost(),
        "spans": statistics.median(s for s, _ in records),
        "comm": statistics.median(c for _, c in records),
        "write_s": timeline.write_seconds / len(records),
    }


def comm_call_costs(n: int = 300, reps: int = 8) -> dict[str, float]:
    """Main-thread CPU seconds per small all-reduce on the world group through each comm hook,
    over the bare call, in this rank (so with the CPU backend's torch-function mode and gloo, as in
    training); the best of ``reps`` loops each, as noise only adds. Collective."""
    tensor = torch.ones(64)
    per_call: dict[str, list[float]] = {"bare": [], "CommTimer": [], "CommTrace": []}
    for _ in range(reps):
        for name in per_call:
            hook = {"CommTimer": CommTimer, "CommTrace": CommTrace}.get(name)
            hook = hook().install() if hook is not None else None
            dist.barrier()
            start = time.thread_time()
            for _ in range(n):
                dist.all_reduce(tensor)
            per_call[name].append((time.thread_time() - start) / n)
            if hook is not None:
                hook.uninstall()
    bare = min(per_call["bare"])
    return {k: min(v) - bare for k, v in per_call.items() if k != "bare"}


def span_cost(n: int = 20000) -> float:
    """Seconds per ``Timeline.span`` enter/exit (best of 5 loops)."""
    timeline = timers.Timeline(Path(tempfile.mkdtemp()) / "x.jsonl", {}, trace_comm=False)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            with timeline.span("megascale::data::load"):
                pass
        best = min(best, (time.perf_counter() - start) / n)
        timeline._batch.spans.clear()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30, help="on/off pairs timed")
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs first")
    args = parser.parse_args(argv)

    job = validate(load(args.config, [*DEFAULT_SETS, *args.overrides]), args.nproc, "gloo")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as run_rank does
    quiet_expected_noise()
    work = Path(tempfile.mkdtemp(prefix="megascale-bench-timers-"))
    data_dir = work / "data"
    default_token_file(data_dir)
    per_rank = run_local(
        _rank, args.nproc, (job, data_dir, work / "run", args.rounds, args.warmup), timeout_s=3600
    )
    print(report(args, job, per_rank))
    return 0


def report(args, job, per_rank: list[dict]) -> str:
    p, m = job.parallel, job.model
    on = [max(r["on"][i] for r in per_rank) for i in range(args.rounds)]
    off = [max(r["off"][i] for r in per_rank) for i in range(args.rounds)]
    paired = sorted((a - b) / b for a, b in zip(on, off, strict=True))
    q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
    cpu_on = [sum(r["cpu_on"][i] for r in per_rank) for i in range(args.rounds)]
    cpu_off = [sum(r["cpu_off"][i] for r in per_rank) for i in range(args.rounds)]
    cpu_paired = sorted((a - b) / b for a, b in zip(cpu_on, cpu_off, strict=True))
    c1, c3 = cpu_paired[len(cpu_paired) // 4], cpu_paired[(3 * len(cpu_paired)) // 4]
    step = statistics.median(off)
    spans = max(r["spans"] for r in per_rank)
    comm = max(r["comm"] for r in per_rank)
    write = max(r["write_s"] for r in per_rank)
    comm_cost = statistics.median(r["CommTimer"] for r in per_rank)
    trace_cost = statistics.median(r["CommTrace"] for r in per_rank)
    span_s = statistics.median(r["span_s"] for r in per_rank)
    hot = spans * span_s + comm * comm_cost
    # A rank's CPU time per step: with 8 ranks on 2 cores the ranks' CPU adds up to the step, so
    # added work is judged against it (stricter than against the wall-clock step).
    rank_cpu = statistics.median(cpu_off) / args.nproc
    return "\n".join(
        [
            f"# timeline overhead benchmark — {datetime.date.today()}",
            f"command: {' '.join(sys.argv)}",
            f"layout: {args.nproc} CPU ranks (gloo), TP{p.tp} x PP{p.pp} x "
            f"DP{args.nproc // (p.tp * p.pp)}, sequence_parallel={p.sequence_parallel}; "
            f"model: {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, "
            f"gbs {job.train.global_batch_size}, mbs {job.train.micro_batch_size}",
            f"{args.rounds} on/off pairs interleaved (order flipped each round) after "
            f"{args.warmup} warm-up pairs; step time = slowest rank after a barrier",
            "",
            "| | value |",
            "|---|---|",
            f"| step time, timeline off (median) | {1e3 * step:.1f} ms |",
            f"| step time, timeline on (median) | {1e3 * statistics.median(on):.1f} ms |",
            f"| measured overhead: median of paired (on - off) / off | "
            f"{100 * statistics.median(paired):+.2f}% (IQR {100 * q1:+.1f}% .. {100 * q3:+.1f}%) |",
            f"| CPU time per step, all ranks, off / on (median) | "
            f"{statistics.median(cpu_off):.3f} s / {statistics.median(cpu_on):.3f} s |",
            f"| measured CPU overhead: median of paired (on - off) / off | "
            f"{100 * statistics.median(cpu_paired):+.2f}% (IQR {100 * c1:+.1f}% .. "
            f"{100 * c3:+.1f}%) |",
            f"| segments recorded per step (busiest rank) | {spans} |",
            f"| comm calls traced per step (busiest rank) | {comm} |",
            f"| unit cost: span enter/exit | {1e6 * span_s:.2f} us |",
            f"| unit cost: a comm call through CommTimer over the bare call (main-thread CPU, "
            f"median over ranks) | {1e6 * comm_cost:.2f} us (CommTrace: {1e6 * trace_cost:.2f} us) |",
            f"| a rank's CPU time per step, timeline off (median) | {1e3 * rank_cpu:.1f} ms |",
            f"| bottom-up hot-path cost per step | {1e3 * hot:.2f} ms = "
            f"{100 * hot / rank_cpu:.2f}% of a rank's CPU time per step |",
            f"| writer thread CPU time per step (background) | {1e3 * write:.2f} ms = "
            f"{100 * write / rank_cpu:.2f}% |",
            f"| bottom-up total, writer counted on the critical path | "
            f"{100 * (hot + write) / rank_cpu:.2f}% |",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
