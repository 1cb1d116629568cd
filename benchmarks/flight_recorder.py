"""Flight recorder overhead: training step time with the recorder on vs off, interleaved in one run.

Every rank builds its trainer once, then runs rounds of three steps: recorder installed ("on"),
not installed ("off"), and not installed again ("off, control": an A/A comparison that shows what
noise alone does to the numbers). The order rotates through all six permutations, so drift and
machine noise land on every variant alike. Per step: wall time (the trainer's step timer, slowest
rank) and the training thread's CPU time (mean over ranks). The recorder's cost is CPU work on
that thread, and thread CPU time is far less disturbed than wall time by other processes on a
shared machine; blocking in a collective does not count. Because a CPU step of the tiny preset
varies by more than the recorder costs, the cost is also computed from a microbenchmark: one
recorded call (the full wrapper path, around a no-op instead of the collective) minus the bare
call, times the ops recorded per step, over the median step time.

Each mode of the CPU backend is measured in the same run, one after the other: "gloo" (blocking
collectives) and "async" (``parallel.async_collectives``, NCCL-like: calls return at once and run
on communication threads), for each layout: "default" (the preset as ``make run`` trains it: tiny,
TP1, DP over the ranks) and "tp2". The device state of an op in flight costs CPU off the training
thread: completion writes made by the thread that completes the op (the NCCL-like mode's
communication thread, gloo's worker; counted per step, times a microbenchmark of one write), and
the watcher thread's polling of the ops that cannot notify (its CPU time read from ``/proc``).
Both are reported per step against the training thread's CPU time.

    python benchmarks/flight_recorder.py                  # tiny preset, 2 ranks, default and TP2
    python benchmarks/flight_recorder.py --layouts tp2 --modes async --rounds 30
    python benchmarks/flight_recorder.py --nproc 1 --layouts default --rounds 100
    python benchmarks/flight_recorder.py --watch poll     # every op polled, as on CUDA
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import megatron.core  # noqa: F401  (import once, before forking the ranks)
import torch

from megascale.config import JobConfig, load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.parallel import async_comm, cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.probes.flight.format import DeviceState, OpKind, flight_path
from megascale.probes.flight.hooks import _OpWrapper
from megascale.probes.flight.recorder import FlightRecorder
from megascale.probes.flight.watcher import MAX_INTERVAL_S, MIN_INTERVAL_S, Backoff
from megascale.train.run import seed_everything
from megascale.train.trainer import Trainer

VARIANTS = ("on", "off", "off, control")
LAYOUTS = {"default": [], "tp2": ["parallel.tp=2"]}  # --set overrides on top of the preset


def rank_main(
    job: JobConfig,
    run_dir: Path,
    rounds: int,
    warmup: int,
    calls: int,
    poll: tuple[float, float] | None,
) -> dict:
    rank, world = init_distributed("cpu")
    cpu_backend.activate()
    if job.parallel.async_collectives:
        async_comm.install()  # under the recorder, as in training runs
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, "cpu")
    trainer = Trainer(job, groups, "cpu", data_cache_dir=run_dir / "data")
    recorder = FlightRecorder(flight_path(run_dir, rank), rank, world)
    writes = _count_writes(recorder)
    if poll is not None:
        recorder._watcher._poller.backoff = Backoff(*poll)
    for _ in range(warmup):
        trainer.step()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    orders = list(itertools.permutations(VARIANTS))
    watched = 0.0  # the watcher thread's CPU seconds during the "on" steps
    writes[0] = 0
    for i in range(rounds):
        for variant in orders[i % len(orders)]:
            if variant == "on":
                recorder.install()
                recorder._watcher.notify = poll is None  # --watch poll: as on CUDA, all polled
            recorder.set_step(trainer.step_num + 1)
            gc.collect()  # not the garbage of (un)installing, inside the next timed step
            watcher = _thread_cpu(recorder._watcher.thread)
            start = time.thread_time()
            times[variant].append(trainer.step().step_time_s)
            cpu[variant].append(time.thread_time() - start)
            if variant == "on":
                watched += _thread_cpu(recorder._watcher.thread) - watcher
                recorder.uninstall()
    ops_per_step = recorder.written / rounds
    writes_per_step = writes[0] / rounds  # before the microbenchmarks write their own
    per_op = _per_op_cost(recorder, groups.tp, calls)
    per_write = _write_cost(recorder, calls)
    recorder.close()
    destroy_groups()
    return {
        "times": times,
        "cpu": cpu,
        "ops_per_step": ops_per_step,
        "per_op_s": per_op,
        "watcher_s": watched / rounds,
        "writes_per_step": writes_per_step,
        "per_write_s": per_write,
    }


def _count_writes(recorder: FlightRecorder) -> list[int]:
    """Count the device-state writes of the recorder's watcher (notified and polled alike)."""
    count, write = [0], recorder.device

    def counted(*args, **kwargs):
        count[0] += 1
        write(*args, **kwargs)

    recorder._watcher._write = recorder._watcher._poller._write = counted
    return count


def _write_cost(recorder: FlightRecorder, calls: int) -> float:
    """Seconds one device-state write costs (a completion, as a notification writes it), on
    records entered for it (outside the timed loop)."""
    n = min(calls, recorder.capacity // 2)
    channel = recorder.add_group(0xBE7C, (recorder.rank,), "bench")
    samples = []
    for _ in range(5):
        indices = [recorder.enter(OpKind.ALL_REDUCE, channel, 4, 0) for _ in range(n)]
        start = time.perf_counter()
        for index in indices:
            recorder.device(index, DeviceState.COMPLETED, 1.0, 2.0)
        samples.append((time.perf_counter() - start) / n)
    return min(samples)


def _thread_cpu(thread) -> float:
    """CPU seconds (user + system) of another thread of this process; 0 before it started."""
    if thread is None or thread.native_id is None:
        return 0.0
    stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_op_cost(recorder: FlightRecorder, group, calls: int) -> float:
    """Seconds one recorded call adds: the wrapper around a no-op minus the bare no-op."""

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = _OpWrapper("all_reduce", all_reduce, recorder)
    recorder.active = True  # the wrapper records without patching torch.distributed
    tensor = torch.ones(1024)
    best = {}
    for name, fn in (("bare", all_reduce), ("recorded", wrapped)):
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn(tensor, group=group)
            samples.append((time.perf_counter() - start) / calls)
        best[name] = min(samples)
    recorder.active = False
    return best["recorded"] - best["bare"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20, help="rounds of one on + one off step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20000, help="calls per microbenchmark")
    parser.add_argument("--modes", default="gloo,async", help="CPU modes measured, in order")
    parser.add_argument(
        "--layouts", default="default,tp2", help=f"layouts measured: {', '.join(LAYOUTS)}"
    )
    parser.add_argument(
        "--watch",
        choices=("notify", "poll"),
        default="notify",
        help="how ops in flight are followed: completion callbacks where the op offers them (as "
        "in training on CPU), or every op polled with the adaptive interval (as on CUDA)",
    )
    parser.add_argument(
        "--poll-ms",
        default=f"{MIN_INTERVAL_S * 1e3:g},{MAX_INTERVAL_S * 1e3:g}",
        help="with --watch poll: the polling interval's low,high bounds in ms",
    )
    args = parser.parse_args(argv)
    try:
        low, high = (float(x) / 1e3 for x in args.poll_ms.split(","))
    except ValueError:
        parser.error(f"--poll-ms: {args.poll_ms!r} is not LOW,HIGH in milliseconds, e.g. 1,20")
    poll = (low, high) if args.watch == "poll" else None
    runs = []
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            parser.error(f"--layouts: {layout!r} is not a layout; accepted: {', '.join(LAYOUTS)}")
        for mode in args.modes.split(","):
            if mode not in ("gloo", "async"):
                parser.error(f"--modes: {mode!r} is not a mode; accepted: gloo, async")
            runs.append((layout, mode))
    out, rows = [], []
    for layout, mode in runs:
        overrides = [*LAYOUTS[layout], "optim.warmup_steps=0", *args.overrides]
        overrides.append(f"parallel.async_collectives={str(mode == 'async').lower()}")
        job = validate(load(args.config, overrides), args.nproc, "gloo")
        run_dir = Path(tempfile.mkdtemp(prefix="megascale-bench-"))
        default_token_file(run_dir / "data")
        per_rank = run_local(
            rank_main,
            args.nproc,
            (job, run_dir, args.rounds, args.warmup, args.calls, poll),
            timeout_s=3600,
        )
        label = f"{layout}, {mode}" + (f", polled {args.poll_ms} ms" if poll else "")
        text, row = report(args, job, per_rank, label)
        out.append(text)
        rows.append(row)
    print("\n\n".join([*out, summary(rows)]))
    return 0


def summary(rows: list[str]) -> str:
    """The runs side by side: the records' cost as a share of the training thread's CPU time."""
    return "\n".join(
        [
            "# summary: share of the training thread's CPU time per step",
            "",
            "| run | ops/step | us/op | records on the training thread | completion writes "
            "(other threads) | watcher polling | total |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def report(args, job: JobConfig, per_rank: list[dict], mode: str) -> tuple[str, str]:
    """The run's table and figures, and its row of the summary."""
    rounds = range(args.rounds)
    wall = {v: [max(r["times"][v][i] for r in per_rank) for i in rounds] for v in VARIANTS}
    cpu = {
        v: [statistics.fmean(r["cpu"][v][i] for r in per_rank) for i in rounds] for v in VARIANTS
    }
    ops = max(r["ops_per_step"] for r in per_rank)
    per_op = statistics.median(r["per_op_s"] for r in per_rank)
    watcher = statistics.fmean(r["watcher_s"] for r in per_rank)
    writes = statistics.fmean(r["writes_per_step"] for r in per_rank)
    per_write = statistics.median(r["per_write_s"] for r in per_rank)
    written = writes * per_write
    off_wall, off_cpu = statistics.median(wall["off"]), statistics.median(cpu["off"])
    p = job.parallel
    lines = [
        f"# flight recorder overhead, {mode} mode — {datetime.date.today()}",
        f"command: {' '.join(sys.argv)}",
        f"layout: {args.nproc} CPU ranks (gloo), TP{p.tp} x PP{p.pp}; preset {args.config}; "
        f"{args.rounds} rounds of one step per variant, order rotated",
        "",
        "| variant | wall (ms, median) | vs off | paired wall diff | CPU (ms, median) | vs off "
        "| paired CPU diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        w, c = statistics.median(wall[v]), statistics.median(cpu[v])
        pw = statistics.median(a - b for a, b in zip(wall[v], wall["off"], strict=True))
        pc = statistics.median(a - b for a, b in zip(cpu[v], cpu["off"], strict=True))
        lines.append(
            f"| {v} | {w * 1e3:.2f} | {(w / off_wall - 1) * 100:+.2f}% | "
            f"{pw / off_wall * 100:+.2f}% | {c * 1e3:.2f} | {(c / off_cpu - 1) * 100:+.2f}% | "
            f"{pc / off_cpu * 100:+.2f}% |"
        )
    lines += [
        "",
        f"ops recorded per step: {ops:.0f}; one recorded op costs {per_op * 1e6:.2f} us "
        f"(microbenchmark); modelled overhead {ops * per_op / off_wall * 100:.3f}% of the "
        f"median step ({ops * per_op / off_cpu * 100:.3f}% of its CPU time)",
        f"completion writes: {writes:.0f} per step x {per_write * 1e6:.2f} us "
        f"= {writes * per_write * 1e3:.3f} ms CPU per step on the threads that complete ops, "
        f"{written / off_cpu * 100:.2f}% of the training thread's CPU time",
        f"watcher thread (polling): {watcher * 1e3:.3f} ms CPU per step, "
        f"{watcher / off_cpu * 100:.2f}% of the training thread's CPU time (mean over ranks)",
    ]
    host = ops * per_op / off_cpu * 100
    row = (
        f"| {mode} | {ops:.0f} | {per_op * 1e6:.2f} | {host:.2f}% | "
        f"{written / off_cpu * 100:.2f}% | {watcher / off_cpu * 100:.2f}% | "
        f"{host + (written + watcher) / off_cpu * 100:.2f}% |"
    )
    return "\n".join(lines), row


if __name__ == "__main__":
    sys.exit(main())
