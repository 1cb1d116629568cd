"""Fault detection and recovery on the local cluster, measured side by side in one run.

For each fault kind, one ``megascale launch`` (2 nodes x 1 rank, tiny preset, CPU) with that fault
injected; ``final.json`` gives, per fired fault, the controller's decision time minus the time the
fault fired (detection latency) and the time of the next completed training step minus the fault
time (fault to training resumed). Then the effective training time of a run with a fault every N
steps: the fault-free run's wall time over the faulty run's (same config, same machine, measured
in this invocation), and the share of the faulty run's wall time spent in steps that count.

    python benchmarks/recovery.py [--heartbeat-interval 1.0] [--steps 40] [--ettr-steps 200]
                                  [--every 50] [--selfcheck builtin]

Prints the commands it ran and a table. Every run's final parameter digest is compared with the
fault-free run's (a recovery that changed the result is reported as such).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = {
    "none": [],
    "kill-worker": ["--inject", "kill-worker:rank=1,step={mid}"],
    "hang-worker": ["--inject", "hang-worker:rank=1,step={mid}"],
    "kill-agent": ["--spares", "1", "--inject", "kill-agent:node=1,step={mid}"],
    "corrupt-checkpoint": [
        "--inject", "kill-worker:rank=0,step={mid}", "--inject", "corrupt-checkpoint:latest",
    ],
    "etcd-restart": ["--inject", "etcd-restart:step={mid},downtime=2"],
    "kill-controller": ["--inject", "kill-controller:step={mid}"],
}  # fmt: skip


def launch(run_dir: Path, args: argparse.Namespace, extra: list[str], steps: int, interval: int):
    """One ``megascale launch``; returns (its command line, its final.json)."""
    cmd = [
        sys.executable, "-m", "megascale.cli", "launch", "--nodes", "2", "--nproc-per-node", "1",
        "--heartbeat-interval", str(args.heartbeat_interval), "--selfcheck", args.selfcheck,
        "--max-restarts", "20", "--timeout", "900", "--run-dir", str(run_dir),
        "--set", f"train.steps={steps}", "--set", f"checkpoint.interval={interval}",
        "--set", "checkpoint.keep=3", "--set", "train.log_interval=10", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, capture_output=True, text=True, check=False)
    final = run_dir / "final.json"
    return shlex.join(cmd[2:]), json.loads(final.read_text()) if final.exists() else {}


def step_share(run_dir: Path) -> float | None:
    """Sum of the step times that count (each step once, in the final metrics.jsonl) over the
    wall time from the first step's start to the end of the last."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    if not lines:
        return None
    start = lines[0]["time"] - lines[0]["step_time_s"]
    return sum(m["step_time_s"] for m in lines) / (lines[-1]["time"] - start)


def print_table(rows: list[dict], h: float) -> None:
    print(
        f"{'fault':38} {'detected as':18} {'named':14} {'detect s':>9} {'x hb':>6} {'resumed s':>10}"
    )
    for t in rows:
        named = " ".join(str(t.get(k)) for k in ("node", "rank") if t.get(k) is not None) or "-"
        det, res = t.get("detection_s"), t.get("resumed_s")
        det_text = f"{det:9.3f} {det / h:6.1f}" if det is not None else f"{'-':>9} {'-':>6}"
        res_text = f"{res:10.3f}" if res is not None else f"{'-':>10}"
        print(f"{t['fault']:38} {t.get('detected_as', '-'):18} {named:14} {det_text} {res_text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=40, help="steps of each fault-kind run")
    parser.add_argument("--interval", type=int, default=5, help="their checkpoint interval")
    parser.add_argument("--ettr-steps", type=int, default=200, help="steps of the ETTR runs")
    parser.add_argument("--every", type=int, default=50, help="ETTR run: a fault every N steps")
    parser.add_argument("--selfcheck", default="builtin", choices=("auto", "builtin", "full"))
    parser.add_argument("--kinds", nargs="*", default=list(SCENARIOS))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="megascale-recovery-"))
    rows, commands, finals = [], [], {}
    for kind in ["none", *[k for k in args.kinds if k != "none"]]:
        extra = [a.format(mid=args.steps // 2 + 1) for a in SCENARIOS[kind]]
        command, finals[kind] = launch(tmp / kind, args, extra, args.steps, args.interval)
        commands.append(command)
        rows += finals[kind].get("fault_timings", [])
    # Effective training time: the same longer job without and with a fault every N steps (a
    # spare, since the controller evicts a node named culprit twice).
    steps = range(args.every, args.ettr_steps, args.every)
    faults = [f"kill-worker:rank={i % 2},step={s}" for i, s in enumerate(steps)]
    injected = ["--spares", "1", *[x for f in faults for x in ("--inject", f)]]
    for name, extra in (("ettr-ref", []), ("ettr", injected)):
        command, finals[name] = launch(tmp / name, args, extra, args.ettr_steps, 10)
        commands.append(command)
    report(args, tmp, commands, rows, finals, len(faults))
    digests = {k: f.get("param_digest") for k, f in finals.items()}
    same = {
        k: d == digests["none" if not k.startswith("ettr") else "ettr-ref"]
        for k, d in digests.items()
    }
    print(f"\nfinal parameters equal to the fault-free run's: {same}")
    print(f"run directories: {tmp}")
    return 0 if digests["none"] and all(same.values()) else 1


def report(args, tmp: Path, commands, rows, finals, n_faults: int) -> None:
    print("commands (python -m megascale.cli ...):")
    for c in commands:
        print("  " + c)
    h = args.heartbeat_interval
    print(f"\nheartbeat interval {h} s; {args.steps} steps; checkpoint every {args.interval}")
    print_table(rows, h)
    print("(etcd-restart and kill-controller stop no training: 'resumed' is the next step)")
    ettr, ref = finals["ettr"], finals["ettr-ref"]
    print(f"\neffective training time over {args.ettr_steps} steps, a kill-worker every "
          f"{args.every} steps ({n_faults} faults, {ettr.get('recoveries')} recoveries):")  # fmt: skip
    if ref.get("wall_time_s") and ettr.get("wall_time_s"):
        ratio = ref["wall_time_s"] / ettr["wall_time_s"]
        print(f"  wall: fault-free {ref['wall_time_s']:.1f} s vs with faults "
              f"{ettr['wall_time_s']:.1f} s -> {ratio:.1%}")  # fmt: skip
    if (tmp / "ettr" / "metrics.jsonl").exists() and (tmp / "ettr-ref" / "metrics.jsonl").exists():
        share, ref_share = step_share(tmp / "ettr"), step_share(tmp / "ettr-ref")
        print(f"  time in steps that count, first step to last: {share:.1%} "
              f"(fault-free run: {ref_share:.1%})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
