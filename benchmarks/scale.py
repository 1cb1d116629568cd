"""Scale benchmark: rendezvous + communication-group setup store traffic, and the
control plane (controller + N simulated agents against a real etcd).

    python benchmarks/scale.py rendezvous [--sizes 256,1024,2048,4096,10240]
    python benchmarks/scale.py control [--nodes 125,250,625,1250] [--kills 3] [--agents asyncio]
    python benchmarks/scale.py heartbeat --baseline CHECKOUT    (benchmarks/heartbeat_cost.py)

Prints what was compared, a table, and ratios / growth exponents. Numbers come from this machine
(2 shared cores): quote the ratios, not the absolute times. See docs/scale.md for the model.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

from megascale.launcher import rendezvous as rdzv
from megascale.parallel.layout import Layout


def growth_exponent(sizes: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(size): 1 linear, 2 quadratic."""
    xs, ys = [math.log(s) for s in sizes], [math.log(max(v, 1e-9)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def table(rows: list[dict]) -> None:
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths, strict=True)))


def rendezvous(sizes: list[int], tp: int, pp: int, cap: int, threads: int) -> None:
    print(
        f"Group setup store traffic, megatron-core groups for tp={tp} pp={pp}, replayed against a "
        f"real TCPStore on loopback from {threads} client threads (<= {cap} ops replayed per cell; "
        "longer streams are uniformly sampled by group and scaled by the exact op count)."
    )
    rows, times = [], {"legacy": [], "default": [], "no-gloo": [], "ours": []}
    for n in sizes:
        layout = Layout.from_world(n, tp=tp, pp=pp)
        row: dict = {"ranks": n, "groups": len(rdzv.megatron_groups(layout))}
        for name, barrier, gloo in (
            ("legacy", True, True),
            ("default", False, True),
            ("no-gloo", False, False),
        ):
            total = rdzv.default_op_count(layout, barrier=barrier, gloo=gloo)
            every = max(1, math.ceil(total / cap))
            ops = rdzv.default_ops(layout, barrier=barrier, sample_every=every, gloo=gloo)
            r = rdzv.replay(ops, total, threads=threads)
            row[f"{name} ops"], row[f"{name} s"] = total, round(r.estimated_s, 2)
            times[name].append(r.estimated_s)
        total = sum(rdzv.count_ops(rdzv.ours_ops(layout)).values())
        r = rdzv.replay(rdzv.ours_ops(layout), total, threads=threads)
        row["ours ops"], row["ours s"] = total, round(r.estimated_s, 3)
        times["ours"].append(r.estimated_s)
        row["legacy/ours"] = round(row["legacy s"] / max(r.estimated_s, 1e-9), 1)
        row["default/ours"] = round(row["default s"] / max(r.estimated_s, 1e-9), 1)
        row["default/no-gloo"] = round(row["default s"] / max(row["no-gloo s"], 1e-9), 1)
        rows.append(row)
        print(f"  ... {n} ranks done", file=sys.stderr, flush=True)
    print("legacy = TORCH_DIST_INIT_BARRIER=1 (torch < 2.1, MegaScale's baseline); default = "
          "torch 2.13 (no barrier, gloo DP groups); no-gloo = torch 2.13 without the gloo twins "
          "(what parallel.build_groups runs); ours = one barrier + NCCL ids, batched (modeled)")  # fmt: skip
    table(rows)
    for name, ts in times.items():
        print(f"growth exponent (time vs ranks) {name}: {growth_exponent(sizes, ts):.2f}")


def control(
    nodes: list[int],
    kills: int,
    processes: int,
    steady: float,
    hb: float,
    agents: str,
) -> None:
    from megascale.etcd.server import EmbeddedEtcd
    from megascale.tools.sim.scenario import as_row, run_scenario

    how = {"asyncio": "asyncio tasks", "threads": "threads"}[agents]
    print(
        f"Control plane: real etcd + real controller process + N real agents ({how}, "
        f"{processes} processes, simulated workers), heartbeat {hb} s, {kills} kills per N "
        f"(target: detection <= {2 * hb + 1:.0f} s, controller CPU < 1 core); etcd with its "
        "default limits"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in nodes:
            with EmbeddedEtcd(unsafe_no_fsync=True) as etcd:
                started = time.time()
                r = run_scenario(
                    etcd.endpoint, etcd.pid, Path(tmp) / f"n{n}", n, heartbeat_s=hb,
                    kills=kills, processes=processes, steady_s=steady, agents=agents,
                )  # fmt: skip
                row = as_row(r)
                rows.append(row)
                print(f"  ... {n} nodes in {time.time() - started:.0f} s: {row}", file=sys.stderr)
                sys.stderr.flush()
    table(rows)


def decision_sizes(nodes: list[int]) -> None:
    from megascale.tools.sim.scenario import decision_bytes

    print(
        "Bytes the controller writes when a generation starts (pure FSM, JSON before base64): "
        "the state snapshot (once per burst of decisions, read by standbys), the status every "
        "agent watches, the start commands (one per node, in transactions of <= 64 puts)"
    )
    rows = []
    for n in nodes:
        b = decision_bytes(n)
        rows.append(
            {
                "nodes": n,
                "state snapshot KB": round(b["snapshot"] / 1e3, 1),
                "status B": b["status"],
                "x agent watches KB": round(b["status"] * n / 1e3, 1),
                "start cmd B": b["start_command"],
                "start cmds MB": round(b["start_txn"] / 1e6, 3),
                "txns": -(-(b["commands"] + 3) // 64),
            }
        )
    table(rows)
    for name in ("state snapshot KB", "start cmds MB", "start cmd B"):
        exponent = growth_exponent(nodes, [r[name] for r in rows])
        print(f"growth exponent {name}: {exponent:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    r = sub.add_parser("rendezvous")
    r.add_argument("--sizes", default="256,1024,2048,4096,10240")
    r.add_argument("--tp", type=int, default=8)
    r.add_argument("--pp", type=int, default=4)
    r.add_argument("--cap", type=int, default=40_000, help="ops replayed per cell at most")
    r.add_argument("--threads", type=int, default=4)
    c = sub.add_parser("control")
    c.add_argument("--nodes", default="125,250,625,1250")
    c.add_argument("--kills", type=int, default=3)
    c.add_argument("--processes", type=int, default=4)
    c.add_argument("--steady", type=float, default=10.0)
    c.add_argument("--heartbeat", type=float, default=1.0)
    c.add_argument(
        "--agents",
        choices=("asyncio", "threads"),
        default="asyncio",
        help="simulated agents as coroutines (hundreds per process) or as the agent's threads",
    )
    h = sub.add_parser("heartbeat", help="controller cost per heartbeat vs another checkout")
    h.add_argument("--baseline", required=True)
    h.add_argument("--nodes", type=int, default=1250)
    h.add_argument("--rounds", type=int, default=5)
    b = sub.add_parser("bytes")
    b.add_argument("--nodes", default="125,250,625,1250")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.part == "heartbeat":
        import subprocess

        script = str(Path(__file__).with_name("heartbeat_cost.py"))
        extra = ["--nodes", str(args.nodes), "--rounds", str(args.rounds)]
        subprocess.run([sys.executable, script, "--baseline", args.baseline, *extra], check=True)
    elif args.part == "bytes":
        decision_sizes([int(s) for s in args.nodes.split(",")])
    elif args.part == "rendezvous":
        sizes = [int(s) for s in args.sizes.split(",")]
        rendezvous(sizes, args.tp, args.pp, args.cap, args.threads)
    else:
        sizes = [int(s) for s in args.nodes.split(",")]
        control(sizes, args.kills, args.processes, args.steady, args.heartbeat, args.agents)


if __name__ == "__main__":
    main()
