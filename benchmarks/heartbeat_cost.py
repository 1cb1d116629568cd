"""Controller cost per heartbeat, typed messages against plain dicts, side by side in one run.

    python benchmarks/scale.py heartbeat --baseline /work/main   (or benchmarks/heartbeat_cost.py)

What the controller does with each heartbeat of a 1,250-node job (8 ranks per node, the agent's
real payload: workers, flight records, per-rank figures, hardware, network counters): the
controller service's heartbeat handler, from the etcd watch event to the FSM (the typed tree
decodes a ``Heartbeat``; the baseline reads the dict). The same bytes go through this
tree and through ``--baseline`` (a checkout whose controller reads dicts), each in its own
process, rounds interleaved; the ratio of medians is printed. Quote the ratio, not the times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RANKS = 8


def payloads(nodes: int) -> list[bytes]:
    """One encoded heartbeat per node, as the agent writes it (this tree's encoder)."""
    from megascale.messages import CheckpointFigures, Heartbeat, RankFigures, WorkerStatus

    out = []
    for n in range(nodes):
        ranks = range(n * RANKS, (n + 1) * RANKS)
        beat = Heartbeat(
            node=f"n{n}", time=time.time(), generation=1, step=100, section="step",
            tokens_per_s=1e6 if n == 0 else None, mfu=0.4 if n == 0 else None,
            step_time_s=1.0, compute_time_s=0.8, val_loss=2.0,
            checkpoint=CheckpointFigures(100, 0.2, 3.0),
            workers={str(r): WorkerStatus(pid=1000 + r, alive=True) for r in ranks},
            ranks={str(r): RankFigures(100, 1.0, 0.8, {"dp": 0.1, "tp": 0.05, "pp": 0.02}, 0.01)
                   for r in ranks},
            flight={str(r): {"seq": 5, "kind": "all_reduce", "left": True, "group": None}
                    for r in ranks},
            host=f"host{n}", addr="10.0.0.1", pid=4242,
            hardware={"cpus": 96, "gpus": ["H100"] * 8}, network={"eth0": {"rx_bytes": 1}},
        )  # fmt: skip
        out.append(json.dumps(beat.encode()).encode())
    return out


class _NoStore:
    """A store that holds nothing: the handler under test does no I/O (its actions are dropped)."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: []


def measure(path: str, rounds: int) -> list[float]:
    """Seconds per heartbeat, per round, of the tree on ``sys.path`` (child process): the
    controller service's own handler (``_dispatch`` of a watch event: parse, decode where typed,
    exporter, FSM, step-time learning, straggler tracker, flight records, exits, errors)."""
    import tempfile

    from megascale.controller.fsm import ControllerFSM, ControllerPolicy, SendCommand
    from megascale.controller.service import ControllerService, ServiceOptions
    from megascale.etcd.store import WatchEvent

    raw = Path(path).read_bytes().split(b"\n")
    nodes = len(raw)
    policy = ControllerPolicy(nodes=nodes, nproc_per_node=RANKS, tp=8)
    opts = ServiceOptions("bench", Path(tempfile.mkdtemp()), policy, "c0", metrics_port=-1)
    service = ControllerService(_NoStore(), opts, clock=lambda: 0.0)
    service.metrics = None
    fsm = service.fsm = ControllerFSM(policy, now=0.0)
    for n in range(nodes):
        fsm.on_node_registered(f"n{n}", now=0.0)
    actions = fsm.on_start(now=0.0)
    for _ in range(3):  # the self-check, then the start
        actions = [
            a for c in actions if isinstance(c, SendCommand)
            for a in fsm.on_ack(c.node, c.id, ok=True, now=0.0)
        ]  # fmt: skip
    service._act = lambda actions: None
    events = [WatchEvent("put", service.keys.heartbeat(f"n{n}"), v, 1) for n, v in enumerate(raw)]
    out = []
    for i in range(rounds):
        service.clock = lambda i=i: float(i + 1)
        start = time.perf_counter()
        for event in events:
            service._dispatch("hb", event)
        out.append((time.perf_counter() - start) / nodes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="a checkout reading dicts (main)")
    parser.add_argument("--nodes", type=int, default=1250)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.rounds)))
        return
    data = Path(f"/tmp/megascale-bench-heartbeats-{os.getpid()}.jsonl")
    data.write_bytes(b"\n".join(payloads(args.nodes)))
    trees = {"typed": str(Path(__file__).resolve().parents[1]), "dicts": args.baseline}
    times: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for _ in range(3):  # interleaved: both see the same machine load
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": tree}
                cmd = [sys.executable, __file__, "--baseline", "-", "--measure", str(data),
                       "--rounds", str(args.rounds)]  # fmt: skip
                text = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                times[name] += json.loads(text.stdout)[1:]  # the first round warms up
    finally:
        data.unlink()
    print(f"Controller per heartbeat, {args.nodes} nodes x {RANKS} ranks "
          "(the service's handler), median of rounds:")  # fmt: skip
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, m in medians.items():
        print(f"  {name:6s} {m * 1e6:8.1f} us")
    print(f"typed / dicts: {medians['typed'] / medians['dicts']:.3f}")


if __name__ == "__main__":
    main()
