"""The cost of a fault under each way of running a job, measured side by side in one run.

The same 2-rank tiny job (``--steps``, a checkpoint every 5 steps) run by each launcher, once
fault-free and once with rank 1 SIGKILLed at steps 50, 100 and 150 (``kill-worker``):

    megascale train --nproc-per-node 2                      no control plane (fault-free only)
    torchrun --max-restarts 5 -m megascale.cli train         torchrun's elastic restart
    megascale launch --nodes 2 --spares 1 (recovery restart) every rank a new process, checkpoint read
    megascale launch --nodes 2 --spares 1 (in-process)       healthy ranks kept, state from memory

Effective training time = a launcher's fault-free wall time over its faulty one; cost of one
fault = (faulty - fault-free) / faults. On a shared machine two runs differ by seconds whatever
their faults, so each fault's cost is also read from the faulty run's own steps
(``lost_to_faults``), and the effective training time from those. For the in-process run, each
fault's cost broken down from its events and the workers' logs: detect (the kill to the controller's fault event), decide
(to the next generation's start: stop, self-check, plan), re-form (to the restore's start: the
rejoin and a new process for the failed rank, process groups, model), restore (from memory), and
the first step after it; and the steps redone. Then the snapshot's cost per step: the stall of
taking one, beside the step time, in one process (``--snapshot-steps`` steps each way).

    python benchmarks/recovery_cost.py [--steps 200] [--every 50] [--repeats N] [--only LAUNCHER]
    python benchmarks/recovery_cost.py --snapshot-only [--config h100-1b --device cuda --set ...]

Each launcher's faulty run's final parameters are compared with its own fault-free run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def _env(inject: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGASCALE_INJECT"}
    env["PYTHONPATH"] = str(REPO)
    if inject:
        env["MEGASCALE_INJECT"] = inject
    return env


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return time.perf_counter() - start, proc.returncode, proc.stdout + proc.stderr


def commands(args, run_dir: Path, kills: list[int]) -> dict[str, tuple[list[str], str]]:
    """launcher -> (command, MEGASCALE_INJECT) for ``run_dir``; faulty when ``kills``."""
    from megascale.launcher.local import free_port

    common = [
        "--set", f"train.steps={args.steps}", "--set", "checkpoint.interval=5",
        "--set", "train.log_interval=50", "--run-dir", str(run_dir),
    ]  # fmt: skip
    specs = [f"kill-worker:rank=1,step={s}" for s in kills]
    launch = [
        PY, "-m", "megascale.cli", "launch", "--nodes", "2", "--nproc-per-node", "1",
        "--spares", "1", "--heartbeat-interval", "0.5", "--selfcheck", "builtin",
        "--max-restarts", "20", "--timeout", "900", *common,
        *[x for s in specs for x in ("--inject", s)],
    ]  # fmt: skip
    torchrun = [
        PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "5",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "-m", "megascale.cli", "train", *common,
    ]  # fmt: skip
    found = {
        "torchrun": (torchrun, ";".join(specs)),
        "launch, recovery restart": (
            [*launch, "--set", "fault_tolerance.recovery=restart"],
            "",
        ),
        "launch, in-process": ([*launch, "--set", "fault_tolerance.recovery=in-process"], ""),
    }
    if not kills:
        train = [PY, "-m", "megascale.cli", "train", "--nproc-per-node", "2", *common]
        found = {"megascale train": (train, ""), **found}
    return found


def _digest(run_dir: Path, steps: int) -> str | None:
    from megascale.config import load
    from megascale.launcher.outcome import parameter_digest

    job = load("tiny", [f"train.steps={steps}", "checkpoint.interval=5"])
    return parameter_digest(run_dir, job)[0]


def _log_time(line: str) -> float:
    stamp = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    when = datetime.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S")
    return when.timestamp() + int(stamp[2]) / 1000


def breakdown(run_dir: Path) -> list[dict[str, float]]:
    """Per fault of an in-process run: detect, decide, re-form, restore, first step (s), and
    the steps redone."""
    from megascale.controller.events import read_events
    from megascale.probes.inject import fired

    events = read_events(run_dir)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    restores = []
    for out in (run_dir / "logs").glob("node-*/rank_*.out"):
        for line in out.read_text().splitlines():
            found = re.search(r"restored step (\d+) from .* in ([\d.]+) s", line)
            if found:
                end = _log_time(line)
                restores.append((end - float(found[2]), end, int(found[1])))
    rows = []
    for kill in fired(run_dir):
        t0 = float(kill["time"])
        fault = next((e for e in events if e.kind == "fault" and e.time >= t0 - 0.5), None)
        start = next((e for e in events if e.kind == "generation_start" and e.time > t0), None)
        if fault is None or start is None:
            continue
        mine = sorted(r for r in restores if r[0] >= start.time - 0.5)
        if not mine:
            continue
        began = min(r[0] for r in mine[:2])
        ended = max(r[1] for r in mine if r[0] < began + 5)
        step = mine[0][2]
        first = next((m["time"] for m in metrics if m["step"] == step + 1), None)
        stopped = _first(events, "all_stopped", fault.time, start.time)
        checked = _first(events, "selfcheck", fault.time, start.time)
        rows.append({
            "detect": fault.time - t0, "decide": start.time - fault.time,
            "decide: stop": stopped - fault.time if stopped else float("nan"),
            "decide: self-check": checked - stopped if stopped and checked else float("nan"),
            "decide: plan and start": start.time - (checked or stopped or fault.time),
            "re-form": began - start.time, "restore": ended - began,
            "first step": (first - ended) if first else float("nan"),
            "redone": int(kill["step"]) - 1 - step,
        })  # fmt: skip
    return rows


def lost_to_faults(run_dir: Path, kills: list[int]) -> tuple[list[float], float]:
    """Each fault's cost read from the faulty run's own steps, unaffected by how busy the machine
    was in another run: the longest wait between two logged steps around the kill (it spans the
    lost steps, the recovery and the steps redone: a redone step's record replaces the first)
    less the run's median wait. Also that median (s)."""
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    times = {m["step"]: m["time"] for m in metrics}
    steps = sorted(times)
    waits = {s: times[s] - times[p] for p, s in zip(steps, steps[1:], strict=False)}
    median = statistics.median(waits.values())
    costs = []
    for kill in kills:
        near = [w for s, w in waits.items() if kill - 10 <= s <= kill + 1]
        if near:
            costs.append(max(near) - median)
    return costs, median


def _first(events, kind: str, after: float, before: float) -> float | None:
    """The time of the first event ``kind`` between ``after`` and ``before``."""
    return next((e.time for e in events if e.kind == kind and after <= e.time <= before), None)


def snapshot_cost(
    steps: int, config: str = "tiny", sets: list[str] | None = None, device: str = "cpu"
) -> tuple[float, float, float, int]:
    """(median step time without a snapshot, median step time with the snapshot after it, median
    snapshot stall, bytes per snapshot) of ``config`` on one rank of ``device``, in this process:
    ``steps`` steps without snapshots, then ``steps`` steps each followed by one (the first 2 of
    each left out: the buffers are made then). A step with snapshots includes its update's wait
    for the previous snapshot's copy, if still in flight (a GPU), and the stall of its own."""
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", LOCAL_RANK="0")
    from megascale.launcher.local import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    import torch

    from megascale.config import load
    from megascale.data.corpus import default_token_file
    from megascale.parallel import cpu_backend
    from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
    from megascale.train.memory_snapshot import SnapshotStore
    from megascale.train.run import seed_everything
    from megascale.train.trainer import Trainer

    job = load(config, [*(sets or []), f"train.device={device}"])
    init_distributed(device)
    if device == "cpu":
        cpu_backend.activate()
        torch.set_num_threads(1)
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, device)
    data = Path(tempfile.mkdtemp(prefix="megascale-snapshot-"))
    default_token_file(data)
    trainer = Trainer(job, groups, device, data_cache_dir=data)
    memory = SnapshotStore(1, 1)
    plain_s, step_s, take_s = [], [], []
    for _ in range(steps):  # steps without snapshots
        plain_s.append(trainer.step().step_time_s)
    for _ in range(steps):  # then each step followed by a snapshot
        start = time.perf_counter()
        trainer.step()  # (its update waits for the last snapshot's copy, if still in flight)
        take_s.append(memory.take(trainer))
        step_s.append(time.perf_counter() - start)
    if device == "cuda":
        torch.cuda.synchronize()
    size = memory.own[-1].payload.numel()
    destroy_groups()
    median = lambda xs: statistics.median(xs[2:])  # noqa: E731
    return median(plain_s), median(step_s), median(take_s), size


def print_snapshot_cost(steps: int, config: str, sets: list[str], device: str) -> None:
    plain, step, take, size = snapshot_cost(steps, config, sets, device)
    what = " ".join([config, *(f"--set {s}" for s in sets)])
    print(f"\nsnapshot after a step, {what}, 1 rank on {device}, {size / 2**30:.2f} GiB per "
          f"snapshot: step {plain * 1e3:.1f} ms without, {step * 1e3:.1f} ms with it "
          f"({step / plain:.3f}x); snapshot stall {take * 1e3:.2f} ms "
          f"({take / plain:.2%} of a step)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--snapshot-steps", type=int, default=40)
    parser.add_argument(
        "--snapshot-only", action="store_true", help="only the snapshot's cost per step"
    )
    parser.add_argument("--config", default="tiny", help="the snapshot's config (default: tiny)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--only", action="append", default=[], metavar="LAUNCHER",
        help="run only this launcher (repeatable): torchrun, 'launch, recovery restart', "
        "'launch, in-process', 'megascale train'",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="run each pair this many times, alternating; the table shows the medians",
    )  # fmt: skip
    args = parser.parse_args()
    if args.snapshot_only:
        print_snapshot_cost(args.snapshot_steps, args.config, args.set, args.device)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="megascale-recovery-cost-"))
    kills = list(range(args.every, args.steps, args.every))
    runs: dict[str, dict[str, list[float]]] = {}
    parts: list[dict[str, float]] = []
    resumed: dict[str, list[float | None]] = {}
    digests: dict[str, str | None] = {}
    spans: dict[str, list[tuple[list[float], float, float]]] = {}
    for repeat in range(args.repeats):
        for kind, faults in (("fault-free", []), ("faulty", kills)):
            names = [n for n in commands(args, tmp, faults) if not args.only or n in args.only]
            for n, name in enumerate(names):
                run_dir = tmp / f"{kind}-{n}-{repeat}"
                cmd, inject = commands(args, run_dir, faults)[name]
                print(
                    f"{kind}: {' '.join(cmd[1:])}"
                    + (f"  (MEGASCALE_INJECT={inject})" if inject else "")
                )
                wall, rc, output = _timed(cmd, _env(inject))
                if rc != 0:
                    print(f"  exit {rc}:\n{output[-3000:]}")
                runs.setdefault(name, {}).setdefault(kind, []).append(wall)
                digest = _digest(run_dir, args.steps)
                if digests.setdefault(f"{name} {kind}", digest) != digest:
                    digests[f"{name} {kind}"] = None  # two repeats ended differently
                final = run_dir / "final.json"
                if kind == "faulty" and final.exists():
                    timings = json.loads(final.read_text()).get("fault_timings", [])
                    resumed.setdefault(name, []).extend(t.get("resumed_s") for t in timings)
                if kind == "faulty" and (run_dir / "metrics.jsonl").exists():
                    costs, step = lost_to_faults(run_dir, kills)
                    spans.setdefault(name, []).append((costs, step, wall))
                if name == "launch, in-process" and kind == "faulty":
                    parts += breakdown(run_dir)
    walls = {name: {k: statistics.median(v) for k, v in w.items()} for name, w in runs.items()}
    repeats = f", the median of {args.repeats} runs each" if args.repeats > 1 else ""
    print(f"\n{args.steps} steps, checkpoint every 5, rank 1 killed at steps {kills}{repeats}\n")
    print(f"| how the job ran | fault-free | {len(kills)} kills | effective training time | "
          "cost of one fault | final parameters |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, wall in walls.items():
        free, faulty = wall.get("fault-free"), wall.get("faulty")
        same = digests.get(f"{name} faulty") == digests.get(f"{name} fault-free")
        if faulty is None:
            print(f"| {name} | {free:.1f} s | - | - | - | - |")
            continue
        print(f"| {name} | {free:.1f} s | {faulty:.1f} s | {free / faulty:.2f} | "
              f"{(faulty - free) / len(kills):.2f} s | {'same' if same else 'DIFFERENT'} |")  # fmt: skip
    for name, times in resumed.items():
        shown = ", ".join(f"{t:.2f}" for t in times if t is not None)
        print(f"{name}: from each kill to training resumed (controller's figure): {shown} s")
    print(
        "\nEach fault's cost from the faulty run's own steps (the longest wait between two logged"
        " steps around the kill, less the run's median step; lost and redone steps included),"
        " and the effective training time it gives (1 - faults' cost / the run's wall time):"
    )
    for name, runs_of in spans.items():
        costs = [c for run_costs, _step, _wall in runs_of for c in run_costs]
        effective = [1 - sum(c) / wall for c, _step, wall in runs_of]
        print(
            f"  {name}: {', '.join(f'{c:.2f}' for c in costs)} s (median "
            f"{statistics.median(costs):.2f} s; median step "
            f"{statistics.median(s for _c, s, _w in runs_of) * 1000:.0f} ms); effective "
            f"{', '.join(f'{e:.3f}' for e in effective)}"
        )
    print(
        "\nin-process, each fault (s): detect, decide, re-form, restore, first step; steps redone"
    )
    for row in parts:
        print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in row.items()))  # fmt: skip
    print_snapshot_cost(args.snapshot_steps, args.config, args.set, args.device)
    print(f"run directories: {tmp}")
    same = all(
        digests[f"{n} faulty"] is not None and digests[f"{n} faulty"] == digests[f"{n} fault-free"]
        for n in resumed
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
