"""Timeline overhead: training step time with the timeline recording vs not, interleaved in one run.

Every rank builds one trainer and one timeline, with the flight recorder installed for the whole run
as ``run_rank`` installs it (``--no-flight-recorder``: without it, as with
``MEGASCALE_FLIGHT_RECORDER=0``). Steps alternate between "on" (the timeline attached:
megatron-core's timers, every collective and p2p call's timing, the trainer's own segments) and
"off" (``NULL_TIMELINE``, nothing attached); the order flips every round (on/off, off/on) so drift
lands on both, and every step starts after a barrier. With the flight recorder installed the
timeline reads the calls from its records (no wrapper of its own), and the recorder runs in both
"on" and "off" steps: it is part of training, not of the timeline. Without it the timeline installs a
flight recorder of its own whose ring lives in memory (same records, no file). After each round, outside the timed steps, the records are flushed
to disk; the writer thread's own time is reported separately (it runs in the background during
training; counting all of it on the critical path is the upper bound).

Three views of the overhead:
* measured: median over rounds of (on - off) / off of the step time (slowest rank);
* measured CPU: the same for the CPU time all ranks spent in the step (``process_time``): on a
  shared, oversubscribed machine the work added is what the timeline costs, and it is far less
  noisy than wall time;
* bottom-up: segments and comm calls per step x their unit costs (a span enter/exit; a real
  all-reduce on a group of the rank alone with the timeline's comm source attached vs not, and
  taking a step's comm records at the step boundary; main-thread CPU, measured in the ranks after
  training) + writer time per step, over the step time: not blurred by the noise of 8 ranks on 2
  cores.

The default model (hidden 256, seq 128, 4 micro-batches of 2 per DP rank) computes about 1 ms per
collective on a rank, as training does; the collectives per step are what megatron-core issues for
the layout, whatever the model size.

Each mode of the CPU backend is measured in turn in one run (``--modes gloo,async``, the default):
blocking gloo, and the NCCL-like ``parallel.async_collectives`` mode, where the calls return at once
and the flight recorder's records carry each op's device state and times.

    python benchmarks/timers.py                 # 8 CPU ranks: TP2 x PP2 x DP2 + SP, 30 rounds
    python benchmarks/timers.py --no-flight-recorder
    python benchmarks/timers.py --rounds 10 --set model.hidden_size=64 --set model.seq_length=64
    python benchmarks/timers.py --compute-meter  # the same, toggling the compute meter instead

``--compute-meter`` measures the trainer's ``ComputeMeter`` (the per-step forward/backward compute
time the straggler model reads) the same way: "on" steps with it standing in megatron-core's
``config.timers`` (the timeline off), "off" steps with no timers at all; its bottom-up unit cost is
one compute span (megatron-core's ``config.timers(name).start()/stop()``) and one step's ``end``.
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
from megascale.launcher.local import run_local
from megascale.logs import quiet_expected_noise
from megascale.overlap.trace import CommTrace
from megascale.parallel import async_comm, cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.probes import timers
from megascale.probes.comm_timer import timeline_comm
from megascale.probes.flight.format import flight_path
from megascale.probes.flight.recorder import FlightRecorder, NullFlightRecorder
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


def _toggle(trainer, timeline, subject: str, mode: str) -> None:
    """Put what is measured (``subject``: "timeline" or "meter") in or out of the next step."""
    if subject == "meter":
        trainer.config.timers = trainer.compute if mode == "on" else None
    elif mode == "on":
        trainer.timeline = timeline
        timeline.attach(trainer.config, trainer.optimizer)
    else:
        timeline.detach()
        trainer.timeline = timers.NULL_TIMELINE


def _rank(
    job, data_dir: Path, run_dir: Path, rounds: int, warmup: int, flight: bool, subject: str
) -> dict:
    torch.set_num_threads(1)
    rank, world = init_distributed("cpu")
    if job.parallel.async_collectives:
        async_comm.install()  # under the flight recorder, which must see the host's calls
    recorder = (
        FlightRecorder(flight_path(run_dir, rank), rank, world).install()
        if flight
        else NullFlightRecorder()
    )  # installed first, as run_rank does
    cpu_backend.activate()
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, "cpu")
    timeline = timers.build_timeline(job.diagnostics, run_dir, groups, "cpu")
    trainer = Trainer(job, groups, "cpu", data_cache_dir=data_dir)  # starts with NULL_TIMELINE
    times: dict[str, list[float]] = {"on": [], "off": [], "cpu_on": [], "cpu_off": []}
    records = []
    for r in range(warmup + rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            _toggle(trainer, timeline, subject, mode)
            dist.barrier()
            recorder.set_step(trainer.step_num + 1)  # as run_rank does, in both modes
            comm_before = timeline._comm.count()
            start, cpu_start = time.perf_counter(), time.process_time()
            trainer.step()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if mode == "on":  # this step's records, for the counts
                spans = (
                    len(timeline._batch.spans)
                    if subject == "timeline"
                    else meter_spans(job, groups.layout.dp)
                )
                records.append((spans, timeline._comm.count() - comm_before))
            if r >= warmup:
                times[mode].append(elapsed)
                times[f"cpu_{mode}"].append(cpu)
        timeline.detach()
        timeline.flush()  # outside the timed steps; timed by the writer itself
    timeline.close()
    comm = statistics.median(c for _, c in records)
    costs = {**comm_costs(int(comm)), **wrapper_costs()}
    recorder.close()
    destroy_groups()
    return {
        **times,
        **costs,
        "span_s": span_cost() if subject == "timeline" else meter_cost(),
        "spans": statistics.median(s for s, _ in records),
        "comm": comm,
        "write_s": timeline.write_seconds / len(records),
    }


def _paired_cpu(fn, hook_on, hook_off, reps: int = 15) -> float:
    """Main-thread CPU seconds ``fn()`` takes with a hook over without it: the least of ``reps``
    runs each (noise only adds), alternating, so load on the machine lands on both."""
    on, off = float("inf"), float("inf")
    for _ in range(reps):
        start = time.thread_time()
        fn()
        off = min(off, time.thread_time() - start)
        hook = hook_on()
        start = time.thread_time()
        fn()
        on = min(on, time.thread_time() - start)
        hook_off(hook)
    return on - off


def _own_group():
    """A process group of this rank alone: a call on it runs the whole call path (the hooks, the
    CPU backend's torch-function mode, gloo) without waiting for another rank, so its CPU time is
    what the hooks cost, not 8 ranks' scheduling on 2 cores. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return [dist.new_group([r]) for r in range(world)][rank]


def comm_costs(calls: int, n: int = 300) -> dict[str, float]:
    """What the timeline's comm records cost on the training thread, with this rank's hooks as in
    training (the flight recorder when installed), on a group of this rank alone:
    ``comm_call_s``, a small all-reduce with the timeline's comm source attached
    (``timeline_comm``) less without; ``comm_take_s``, taking a step's worth (``calls``) of
    records at the step boundary. Collective."""
    tensor, group = torch.ones(64), _own_group()

    def loop(k: int):
        return lambda: [dist.all_reduce(tensor, group=group) for _ in range(k)]

    call_s = _paired_cpu(loop(n), timeline_comm, lambda source: source.uninstall()) / n
    source = timeline_comm()
    takes = []
    for _ in range(8):
        loop(calls)()
        start = time.thread_time()
        source.take()
        takes.append(time.thread_time() - start)
    source.uninstall()
    return {"comm_call_s": call_s, "comm_take_s": min(takes)}


def wrapper_costs(n: int = 300) -> dict[str, float]:
    """Main-thread CPU seconds per small all-reduce (on a group of this rank alone) through each
    recording wrapper over the call without it (stacked on the flight recorder when installed):
    an in-memory flight recorder (what the timeline installs where no recorder is) and the comm
    trace. Collective."""
    tensor, group = torch.ones(64), _own_group()

    def loop():
        for _ in range(n):
            dist.all_reduce(tensor, group=group)

    rank, world = dist.get_rank(), dist.get_world_size()
    hooks = {
        "memory_recorder": (lambda: FlightRecorder(None, rank, world).install(), "close"),
        "CommTrace": (lambda: CommTrace().install(), "uninstall"),
    }
    return {
        f"{name}_s": _paired_cpu(loop, install, lambda h, m=undo: getattr(h, m)()) / n
        for name, (install, undo) in hooks.items()
    }


def meter_spans(job, dp: int) -> int:
    """Compute spans per step on a rank: a forward and a backward per micro-batch (and per
    virtual stage)."""
    micro = job.train.global_batch_size // (job.train.micro_batch_size * dp)
    return 2 * micro * job.parallel.vpp


def meter_cost(n: int = 20000) -> float:
    """Seconds per compute span through a ``ComputeMeter`` as megatron-core drives it, a step's
    ``begin``/``end`` spread over its spans (best of 5 loops; the flight recorder's counter read
    as in training)."""
    from types import SimpleNamespace

    from megascale.probes.compute_time import ComputeMeter

    recorder = SimpleNamespace(blocked_s=0.0)
    config = SimpleNamespace(timers=None)
    meter = ComputeMeter("cpu", blocked_s=lambda: recorder.blocked_s).install(config)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for i in range(n // 8):
            meter.begin(i)
            for _ in range(8):
                config.timers("forward-compute", log_level=2).start()
                config.timers("forward-compute").stop()
            meter.end()
        best = min(best, (time.perf_counter() - start) / n)
    return best


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
    parser.add_argument(
        "--compute-meter",
        dest="subject",
        action="store_const",
        const="meter",
        default="timeline",
        help="toggle the trainer's compute meter (timeline off) instead of the timeline",
    )
    parser.add_argument(
        "--no-flight-recorder",
        dest="flight",
        action="store_false",
        help="run without the flight recorder: the timeline times each call with its own wrapper",
    )
    parser.add_argument("--modes", default="gloo,async", help="CPU modes measured, in order")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in ("gloo", "async"):
            parser.error(f"--modes: {mode!r} is not a mode; accepted: gloo, async")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as run_rank does
    quiet_expected_noise()
    work = Path(tempfile.mkdtemp(prefix="megascale-bench-timers-"))
    data_dir = work / "data"
    default_token_file(data_dir)
    out = []
    for mode in modes:
        sets = [*DEFAULT_SETS, *args.overrides]
        sets.append(f"parallel.async_collectives={str(mode == 'async').lower()}")
        job = validate(load(args.config, sets), args.nproc, "gloo")
        per_rank = run_local(
            _rank,
            args.nproc,
            (job, data_dir, work / mode, args.rounds, args.warmup, args.flight, args.subject),
            timeout_s=3600,
        )
        out.append(report(args, job, per_rank))
    print("\n\n".join(out))
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
    call_s = statistics.median(r["comm_call_s"] for r in per_rank)
    take_s = statistics.median(r["comm_take_s"] for r in per_rank)
    memory_s = statistics.median(r["memory_recorder_s"] for r in per_rank)
    trace_s = statistics.median(r["CommTrace_s"] for r in per_rank)
    span_s = statistics.median(r["span_s"] for r in per_rank)
    meter = args.subject == "meter"
    what = "compute meter" if meter else "timeline"
    hot = spans * span_s if meter else spans * span_s + comm * call_s + take_s
    source = "flight recorder's records" if args.flight else "timeline's in-memory flight recorder"
    # A rank's CPU time per step: with 8 ranks on 2 cores the ranks' CPU adds up to the step, so
    # added work is judged against it (stricter than against the wall-clock step).
    rank_cpu = statistics.median(cpu_off) / args.nproc
    return "\n".join(
        [
            f"# {what} overhead benchmark, "
            f"{'async (NCCL-like)' if p.async_collectives else 'gloo'} mode — "
            f"{datetime.date.today()}",
            f"command: {' '.join(sys.argv)}",
            f"layout: {args.nproc} CPU ranks (gloo), TP{p.tp} x PP{p.pp} x "
            f"DP{args.nproc // (p.tp * p.pp)}, sequence_parallel={p.sequence_parallel}; "
            f"model: {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, "
            f"gbs {job.train.global_batch_size}, mbs {job.train.micro_batch_size}",
            f"{args.rounds} on/off pairs interleaved (order flipped each round) after "
            f"{args.warmup} warm-up pairs; step time = slowest rank after a barrier",
            f"flight recorder: {'installed in both on and off steps' if args.flight else 'off'}; "
            f"timeline comm timing from the {source}",
            "",
            "| | value |",
            "|---|---|",
            f"| step time, {what} off (median) | {1e3 * step:.1f} ms |",
            f"| step time, {what} on (median) | {1e3 * statistics.median(on):.1f} ms |",
            f"| measured overhead: median of paired (on - off) / off | "
            f"{100 * statistics.median(paired):+.2f}% (IQR {100 * q1:+.1f}% .. {100 * q3:+.1f}%) |",
            f"| CPU time per step, all ranks, off / on (median) | "
            f"{statistics.median(cpu_off):.3f} s / {statistics.median(cpu_on):.3f} s |",
            f"| measured CPU overhead: median of paired (on - off) / off | "
            f"{100 * statistics.median(cpu_paired):+.2f}% (IQR {100 * c1:+.1f}% .. "
            f"{100 * c3:+.1f}%) |",
            f"| {'compute spans' if meter else 'segments'} recorded per step (busiest rank) "
            f"| {spans} |",
            f"| comm calls recorded per step (busiest rank) | {comm} |",
            f"| unit cost: {'compute span through the meter' if meter else 'span enter/exit'} "
            f"| {1e6 * span_s:.2f} us |",
            f"| unit cost: a comm call, timeline's comm source attached vs not (main-thread CPU, "
            f"group of one rank, median over ranks) | {1e6 * call_s:+.2f} us |",
            f"| unit cost: taking a step's comm records at the step boundary | "
            f"{1e6 * take_s:.1f} us |",
            f"| for comparison: a comm call through an in-memory flight recorder / CommTrace over "
            f"the call without it | {1e6 * memory_s:.2f} us / {1e6 * trace_s:.2f} us |",
            f"| a rank's CPU time per step, {what} off (median) | {1e3 * rank_cpu:.1f} ms |",
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
