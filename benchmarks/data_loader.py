"""Per-step data wait and loader memory: ``data.loader = "node"`` vs ``"rank"``, side by side.

8 forked ranks (TP x PP x DP, default TP2 x PP2 x DP2) on two simulated machines of 4 ranks
(``MEGASCALE_NODE``), the built-in corpus through megatron-core's GPTDataset. Each round runs both
loaders in alternating order for ``--steps`` steps over a fresh dataset (fresh memory maps): a
step is ``next_step()`` (timed: the data wait) then ``--step-ms`` of sleep standing for the
forward/backward and gradient synchronisation, then a barrier (ranks step together, as
collectives make them). Every sample read costs ``--sample-ms`` more (a sleep: storage latency,
decompression; the built-in corpus is in the page cache and reads in microseconds).

Memory: the growth of the rank's proportional set size (``Pss`` of ``/proc/self/smaps_rollup``:
shared pages, the shared-memory segment and the dataset's memory maps included, divided among the
processes that map them) from before the loader is built to after the last step; per machine the
sum over its ranks. Steady state: the first step (no prefetched batch yet) is left out of the
wait and shown apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import megatron.core  # noqa: F401  (import once, before forking the ranks)
import torch
import torch.distributed as dist

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.data.dataset import build_splits
from megascale.data.node_loader import train_batches
from megascale.launcher.local import run_local
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed

WORLD, MACHINES = 8, 2
MODES = ("rank", "node")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("loader")
    group.add_argument("--tp", type=int, default=2)
    group.add_argument("--pp", type=int, default=2)
    group.add_argument("--steps", type=int, default=12, help="steps per loader per round")
    group.add_argument("--sample-ms", type=float, default=1.0, help="added cost of one read")
    group.add_argument("--step-ms", type=float, default=50.0, help="compute + grad sync")
    group.add_argument("--global-batch", type=int, default=32)
    group.add_argument("--seq", type=int, default=256)


class _SlowReads:
    """A dataset whose every sample read costs ``ms`` more."""

    def __init__(self, dataset, ms: float) -> None:
        self.dataset, self.delay = dataset, ms / 1e3

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.dataset[i]


def _pss_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise RuntimeError("no Pss in /proc/self/smaps_rollup")


def _measure(job, groups, prefix: Path, cache: Path, args) -> dict:
    train, _ = build_splits(job, prefix, cache)
    dataset = _SlowReads(train, args.sample_ms)
    dist.barrier()
    before = _pss_kib()
    batches = train_batches(job, dataset, groups.dp_rank, groups.layout.dp)
    waits = []
    for _ in range(args.steps):
        start = time.perf_counter()
        batches.next_step()
        waits.append(time.perf_counter() - start)
        time.sleep(args.step_ms / 1e3)
        dist.barrier()
    grown = _pss_kib() - before
    if hasattr(batches, "close"):
        batches.close()
    shm = getattr(batches, "segment_bytes", 0) if getattr(batches, "leader", False) else 0
    return {"first": waits[0], "steady": statistics.mean(waits[1:]), "pss": grown, "shm": shm}


def _rank(job, data_dir: Path, cache: Path, args) -> dict:
    init_distributed("cpu")
    torch.set_num_threads(1)
    groups = build_groups(job.parallel)
    os.environ["MEGASCALE_NODE"] = f"machine-{dist.get_rank() * MACHINES // WORLD}"
    prefix = default_token_file(data_dir)
    out: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            loader_job = dataclasses.replace(job, data=dataclasses.replace(job.data, loader=mode))
            out[mode].append(_measure(loader_job, groups, prefix, cache, args))
    destroy_groups()
    return {"node": os.environ["MEGASCALE_NODE"], **out}


def run(args: argparse.Namespace) -> None:
    job = load("tiny")
    job = dataclasses.replace(
        job,
        parallel=dataclasses.replace(job.parallel, tp=args.tp, pp=args.pp),
        model=dataclasses.replace(job.model, seq_length=args.seq),
        train=dataclasses.replace(
            job.train, global_batch_size=args.global_batch, micro_batch_size=2, steps=1000
        ),
    )
    job = validate(job, WORLD, "gloo")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        default_token_file(data_dir)
        results = run_local(_rank, WORLD, (job, data_dir, data_dir / "cache", args), timeout_s=600)
    p = job.parallel
    print(
        f"loader: {WORLD} ranks (TP{p.tp} x PP{p.pp} x DP{WORLD // (p.tp * p.pp)}) on {MACHINES} "
        f"machines, gbs {args.global_batch}, mbs 2, seq {args.seq}, {args.sample_ms} ms per "
        f"sample read, {args.step_ms} ms per step, {args.steps} steps x {args.rounds} rounds"
    )
    print(f"  {'data.loader':12s} {'wait/step ms':>13s} {'max rank':>9s} {'first step':>11s} "
          f"{'MiB/rank':>9s} {'MiB/machine':>12s} {'shm MiB/machine':>16s}")  # fmt: skip
    steady = {}
    for mode in MODES:
        per_rank = [statistics.median(m["steady"] for m in r[mode]) * 1e3 for r in results]
        first = statistics.median(m["first"] for r in results for m in r[mode]) * 1e3
        pss = [statistics.median(m["pss"] for m in r[mode]) / 1024 for r in results]
        shm = max(m["shm"] for r in results for m in r[mode]) / 2**20
        steady[mode] = statistics.mean(per_rank)
        print(
            f"  {mode:12s} {steady[mode]:13.2f} {max(per_rank):9.2f} {first:11.2f} "
            f"{statistics.mean(pss):9.2f} {sum(pss) / MACHINES:12.2f} {shm:16.2f}"
        )
    ratio = steady["rank"] / max(steady["node"], 1e-9)
    print(f"  data wait per step, rank / node: {ratio:.1f}x")
