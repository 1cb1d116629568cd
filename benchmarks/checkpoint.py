"""Checkpoint stall and restart read time, each compared side by side in one run.

1. Training stall. One rank trains a model whose checkpoint is ~100 MB (``--set`` to change it);
   rounds alternate a synchronous save (``checkpoint.async_save = false``: write, fsync, manifest
   before training continues) and a two-stage save (copy to host buffers, write in the background)
   of the same trainer. Training goes on while the background write runs; the table shows the
   stall of each, their ratio (target <= 10%), how long the background write took, and the step
   time during it vs without it.
2. Restart read time. 4 ranks (DP4) restart from one checkpoint: dp_rank 0 reads the DP-shared
   file and broadcasts it (read-once-and-broadcast) vs every rank reading it, for the distributed
   optimizer (optimizer shards stay per rank) and for a replicated optimizer (plain DDP: all of the
   state is DP-shared). Storage: (a) the local temp dir with the files' page cache dropped before
   each load, (b) a shared store modelled as one pipe of ``--storage-mbps`` MB/s for all readers
   together (what thousands of readers of one HDFS/NFS namespace see); time = the slowest rank.

    python benchmarks/checkpoint.py
    python benchmarks/checkpoint.py --rounds 3 --storage-mbps 500 --set model.hidden_size=256
    python benchmarks/checkpoint.py --device cuda --stall-only   # the state in GPU memory
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import megatron.core  # noqa: F401  (import once, before forking the ranks)
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.logs import quiet_expected_noise
from megascale.parallel import cpu_backend
from megascale.parallel.groups import build_groups, destroy_groups, init_distributed
from megascale.train import checkpoint
from megascale.train.checkpoint_io import Storage, step_name
from megascale.train.run import seed_everything
from megascale.train.trainer import Trainer

DEFAULT_SETS = [
    "model.num_layers=4",
    "model.hidden_size=384",
    "model.num_heads=6",
    "model.vocab_size=8192",
    "model.seq_length=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.steps=100000",
    "optim.warmup_steps=0",
]


class ThrottledFileSystem(LocalFileSystem):
    """Local files read through one shared pipe of ``MBPS`` MB/s: readers in all processes take
    turns on an flock, each 8 MB chunk holding it for chunk / bandwidth seconds."""

    protocol = ("throttled",)
    MBPS = 200.0
    LOCK = "/tmp/megascale-bench-storage.lock"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("throttled://"))

    def cat_file(self, path, start=None, end=None, **kwargs):
        chunks = []
        with open(self._strip_protocol(path), "rb") as f, open(self.LOCK, "a") as lock:
            while chunk := f.read(8 << 20):
                fcntl.flock(lock, fcntl.LOCK_EX)
                time.sleep(len(chunk) / (self.MBPS * 1e6))
                fcntl.flock(lock, fcntl.LOCK_UN)
                chunks.append(chunk)
        return b"".join(chunks)


def _trainer(job, data_dir: Path) -> Trainer:
    device = "cuda" if job.train.device == "cuda" else "cpu"  # cuda: the state is in GPU memory
    init_distributed(device)
    if device == "cpu":
        torch.set_num_threads(1)
        cpu_backend.activate()
    groups = build_groups(job.parallel)
    seed_everything(job.train.seed, groups.tp_rank, device)
    trainer = Trainer(job, groups, device, data_cache_dir=data_dir)
    trainer.step()  # the optimizer state exists from the first step on
    return trainer


def _saver(job, trainer: Trainer, url: str, async_save: bool) -> checkpoint.Checkpointer:
    # interval > 0: the two-stage saver reserves its host buffers up front, as in training.
    cfg = dataclasses.replace(job.checkpoint, url=url, async_save=async_save, keep=1, interval=1)
    return checkpoint.Checkpointer(cfg, Path(url), trainer)


def stall_rank(job, data_dir: Path, root: Path, rounds: int) -> dict:
    trainer = _trainer(job, data_dir)
    savers = {
        "synchronous": _saver(job, trainer, str(root / "sync"), async_save=False),
        "two-stage": _saver(job, trainer, str(root / "two-stage"), async_save=True),
    }
    out: dict = {name: [] for name in savers} | {"write_s": [], "busy": [], "idle": [], "first": 0}
    for r in range(rounds + 1):  # round 0 warms up (first writes to a fresh directory)
        order = list(savers) if r % 2 else list(reversed(savers))
        for name in order:
            out["idle"] += [trainer.step().step_time_s for _ in range(2)] if r else []
            stall = savers[name].save(trainer)
            while savers[name].in_flight:  # training goes on during the background write
                step_s = trainer.step().step_time_s
                out["busy"] += [step_s] if r else []
            savers[name].wait()
            if not r:
                out["first"] = stall if name == "two-stage" else out["first"]
                continue
            out[name].append(stall)
            if name == "two-stage":
                out["write_s"].append(savers[name].last_write_s)
    for saver in savers.values():
        saver.finalize()
    # keep = 1: the synchronous saver's root holds exactly one checkpoint now.
    out["bytes"] = sum(p.stat().st_size for p in (root / "sync").glob("step_*/*.pt"))
    destroy_groups()
    return out


def _drop_page_cache(directory: Path) -> None:
    for path in directory.glob("*.pt"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def recovery_rank(job, data_dir: Path, root: Path, rounds: int, mbps: float) -> dict:
    ThrottledFileSystem.MBPS = mbps
    fsspec.register_implementation("throttled", ThrottledFileSystem, clobber=True)
    trainer = _trainer(job, data_dir)
    saver = _saver(job, trainer, str(root), async_save=False)
    saver.save(trainer)
    saver.finalize()
    dist.barrier()
    stores = {"local disk": str(root), f"shared {mbps:g} MB/s": f"throttled://{root}"}
    times: dict = {}
    for r in range(rounds):
        for label, url in stores.items():
            for broadcast in (True, False) if r % 2 else (False, True):
                if trainer.groups.rank == 0:
                    _drop_page_cache(root / step_name(trainer.step_num))
                dist.barrier()
                storage = Storage(url)
                start = time.perf_counter()
                checkpoint.load_latest(trainer, storage, broadcast=broadcast)
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                nbytes = sum(
                    (root / rel).stat().st_size for rel in storage.reads if rel.endswith(".pt")
                )
                total = torch.tensor([nbytes], dtype=torch.float64)
                dist.all_reduce(total)
                times.setdefault((label, broadcast), []).append((float(took), float(total)))
    destroy_groups()
    return times


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per comparison")
    parser.add_argument("--nproc", type=int, default=4, help="ranks (all DP) for the restart part")
    parser.add_argument("--storage-mbps", type=float, default=200.0)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the training state lives for the stall comparison (cuda: copied from GPU "
        "memory into pinned host buffers)",
    )
    parser.add_argument(
        "--stall-only", action="store_true", help="measure the training stall only (part 1)"
    )
    args = parser.parse_args(argv)
    quiet_expected_noise()  # before forking: the ranks inherit the filters
    command = "python " + shlex.join(["benchmarks/checkpoint.py", *(argv or sys.argv[1:])])

    with tempfile.TemporaryDirectory(prefix="megascale-ckpt-bench-") as tmp:
        tmp_path = Path(tmp)
        data_dir = tmp_path / "data"
        default_token_file(data_dir)
        base = load(args.config, DEFAULT_SETS + args.overrides)

        on = load(args.config, [*DEFAULT_SETS, *args.overrides, f"train.device={args.device}"])
        one = validate(on, 1, "nccl" if args.device == "cuda" else "gloo")
        stall = run_local(stall_rank, 1, (one, data_dir, tmp_path / "stall", args.rounds))[0]

        recovery = {}
        comparisons = [] if args.stall_only else [("sharded", True), ("replicated", False)]
        for optimizer, distributed in comparisons:
            job = dataclasses.replace(
                base, parallel=dataclasses.replace(base.parallel, distributed_optimizer=distributed)
            )
            job = validate(job, args.nproc, "gloo")
            root = tmp_path / f"recovery-{optimizer}"
            recovery[optimizer] = run_local(
                recovery_rank, args.nproc, (job, data_dir, root, args.rounds, args.storage_mbps)
            )[0]

    sync_s, two_s = _median(stall["synchronous"]), _median(stall["two-stage"])
    print(f"# checkpoint benchmark, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
    print(f"# {command}")
    print(f"# model: {' '.join(DEFAULT_SETS + args.overrides)}")
    print()
    where = "GPU memory" if args.device == "cuda" else "CPU memory"
    print(
        f"## 1. training stall per save (1 rank, {stall['bytes'] / 1e6:.0f} MB of state in {where},"
    )
    print(f"##    median of {args.rounds} alternating rounds, temp dir on local disk)")
    print()
    print("| save | stall (s) | vs synchronous |")
    print("|---|---|---|")
    print(f"| synchronous (write + fsync + manifest) | {sync_s:.3f} | 1.00 |")
    print(f"| two-stage (host copy; write in background) | {two_s:.3f} | {two_s / sync_s:.3f} |")
    print()
    print(
        f"two-stage: stall/synchronous = {two_s / sync_s:.1%} (target <= 10%); first save "
        f"{stall['first']:.3f} s (host buffers reserved up front); background write "
        f"{_median(stall['write_s']):.3f} s; step time during it "
        f"{_median(stall['busy']) * 1e3:.0f} ms vs {_median(stall['idle']) * 1e3:.0f} ms without "
        f"({len(stall['busy'])} steps)"
    )
    if args.stall_only:
        return 0
    print()
    print(f"## 2. restart read time, {args.nproc} ranks (DP{args.nproc}), slowest rank, median")
    print()
    print(
        "| optimizer state | storage | every rank reads (s) | read once + broadcast (s) | ratio | MB read (every / once) |"
    )
    print("|---|---|---|---|---|---|")
    for optimizer, times in recovery.items():
        labels = dict.fromkeys(label for label, _ in times)
        for label in labels:
            every = times[(label, False)]
            once = times[(label, True)]
            t_every, t_once = _median([t for t, _ in every]), _median([t for t, _ in once])
            mb_every, mb_once = every[0][1] / 1e6, once[0][1] / 1e6
            print(
                f"| {optimizer} | {label} | {t_every:.3f} | {t_once:.3f} | "
                f"{t_once / t_every:.2f} | {mb_every:.0f} / {mb_once:.0f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
