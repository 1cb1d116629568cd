"""Training-thread cost of the step figures, this tree against a baseline checkout, side by side.

    python benchmarks/figures.py --baseline /work/main [--steps 2000] [--metrics RUN/metrics.jsonl]

What a rank's training thread does per step for the agent (``probes.progress``): the
``WorkerSignals`` step boundary (compute time from the flight recorder; in this tree also the
exposed communication by group, data wait, MFU and checkpoint figures) and the progress-file
rewrite. A real ``FlightRecorder`` with 24 registered channels (a TP/PP/DP job's groups and p2p
pairs) feeds it. Each tree runs in its own process, rounds interleaved; the difference of medians
per step is printed, and, with ``--metrics``, as a fraction of that run's median step time.
The per-op addition (one float added to the op's channel) is not in the loop: it is printed from
a separate micro-measurement, times the ops a step issues (``--ops``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path


def measure(steps: int) -> float:
    """Seconds per step of the step boundary + progress write (child process)."""
    from megascale.probes.flight.recorder import FlightRecorder
    from megascale.probes.progress import ProgressFile, WorkerSignals

    try:
        from megascale.messages import StepMetrics
    except ImportError:
        from megascale.train.trainer import StepMetrics
    run = Path(tempfile.mkdtemp())
    recorder = FlightRecorder(run / "flight.bin", 0, 8)
    for gid in range(24):
        recorder.add_group(gid, (0, gid % 8), f"DATA_PARALLEL_GROUP_{gid}")
    signals = WorkerSignals(recorder, ProgressFile(run / "progress.json", 0))
    signals.enter("step")
    metrics = StepMetrics(step=0, loss=2.0, grad_norm=1.0, lr=1e-3, step_time_s=0.3,
                          tokens_per_s=1e4, mfu=0.4)  # fmt: skip
    start = time.perf_counter()
    for step in range(1, steps + 1):
        signals.step_started(step)
        recorder.blocked_s += 1e-3
        metrics.step = step
        signals.step_done(metrics)
    return (time.perf_counter() - start) / steps


def per_op_add() -> float:
    """Seconds of the per-op addition (``channel.blocked_s += dt``)."""
    from megascale.probes.flight.recorder import Channel

    channel = Channel(1, 0)
    return timeit.timeit("c.blocked_s += 1e-6", globals={"c": channel}, number=200_000) / 2e5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=200, help="collectives + p2p per step")
    parser.add_argument("--metrics", help="a run's metrics.jsonl: its median step time")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.steps)))
        return
    trees = {"figures": str(Path(__file__).resolve().parents[1]), "baseline": args.baseline}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            cmd = [sys.executable, __file__, "--baseline", "-", "--measure",
                   "--steps", str(args.steps)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            times[name].append(json.loads(out.stdout))
    medians = {name: statistics.median(t) for name, t in times.items()}
    added = medians["figures"] - medians["baseline"] + args.ops * per_op_add()
    print("Training thread per step: step boundary + progress write (median of rounds)")
    for name, m in medians.items():
        print(f"  {name:9s} {m * 1e6:8.1f} us")
    print(f"added per step (incl. {args.ops} ops x the per-op add): {added * 1e6:.1f} us")
    if args.metrics:
        lines = [json.loads(x) for x in Path(args.metrics).read_text().splitlines() if x]
        step = statistics.median(m["step_time_s"] for m in lines)
        print(f"median step time of {args.metrics}: {step * 1e3:.0f} ms; "
              f"added / step time: {added / step:.4%}")  # fmt: skip


if __name__ == "__main__":
    main()
