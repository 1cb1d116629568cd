"""Checkpoint stall, time until durable, and restart load time, compared side by side in one run.

1. Training stall and time until durable. ``--nproc`` ranks (DP, distributed optimizer) train a
   model whose checkpoint is ~120 MB (``--set`` to change it). Each round saves the same trainer
   once with each method, in an order that rotates from round to round:

   - megascale two-stage: copy the pieces to host buffers, write them (per-rank DCP files,
     merged metadata, manifest last) in a background thread;
   - megascale synchronous: the same files written before training continues;
   - ``torch.distributed.checkpoint.async_save`` of the same pieces (ShardedTensors), staged to
     CPU by DCP, written with its collective plan on a gloo group of its own;
   - megatron-core ``dist_checkpointing.save(..., async_sharded_save=True)`` of the model's and the
     distributed optimizer's sharded state dicts (``dp_reshardable``, the format megatron-core 0.16
     can write), scheduled on its ``AsyncCallsQueue``.

   Stall: the time until training may go on (slowest rank). Durable: from the save's start until
   the checkpoint is complete on storage (ours: the manifest; DCP: its future; megatron-core: its
   finalization). Training steps run while a background write is in flight.
2. Restart load time: the same checkpoint loaded at the layout that saved it (DP) and resharded
   to TP (same number of ranks), alternating; slowest rank, page cache warm.

    python benchmarks/checkpoint.py
    python benchmarks/checkpoint.py --rounds 3 --nproc 2 --set model.hidden_size=256
    python benchmarks/checkpoint.py --device cuda --stall-only   # the state in GPU memory
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megascale import gpus

# ruff: noqa: E402  (the imports below come after prefer_nvml_checks on purpose)
# The ranks are forked from this process: count GPUs through NVML (or hide CUDA on a machine
# without a driver) before megatron-core's import asks torch whether CUDA is there.
gpus.prefer_nvml_checks()

import megatron.core  # import once, before forking the ranks
import megatron.core.dist_checkpointing
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.logs import quiet_expected_noise
from megascale.parallel import cpu_backend
from megascale.parallel.groups import (
    build_groups,
    collective_device,
    destroy_groups,
    init_distributed,
)
from megascale.train.checkpoint import load as checkpoint_load
from megascale.train.checkpoint import save as checkpoint
from megascale.train.checkpoint.shards import to_dcp, training_entries
from megascale.train.checkpoint.storage import Storage
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
    "parallel.distributed_optimizer=true",
]
MCORE_ASYNC = (
    {"async_strategy": "mcore"}
    if "async_strategy" in inspect.signature(megatron.core.dist_checkpointing.save).parameters
    else {}
)
"""megatron-core's own asynchronous writer: from 0.17 on ``save`` defaults to nvidia-resiliency-
ext's ("nvrx"), which is a separate package."""
METHODS = ("megascale two-stage", "megascale synchronous", "DCP async_save", "megatron-core async")


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


def _slowest(seconds: float) -> float:
    """The largest of the ranks' ``seconds``. Collective (on the default group's device)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _anyone(flag: bool) -> bool:
    """Whether any rank's flag is set (the ranks step together or not at all). Collective."""
    t = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t)


class _Ours:
    def __init__(self, job, trainer: Trainer, root: Path, async_save: bool) -> None:
        self.saver = _saver(job, trainer, str(root), async_save)

    def start(self, trainer: Trainer, _round: int) -> None:
        self.saver.save(trainer)

    def in_flight(self) -> bool:
        return self.saver.in_flight

    def finish(self) -> None:
        self.saver.wait()


class _DCPAsync:
    """DCP's own asynchronous save of the same pieces, its collectives on a gloo group."""

    def __init__(self, trainer: Trainer, root: Path) -> None:
        self.root, self.group, self.future = root, dist.new_group(backend="gloo"), None
        self.world, self.rank = trainer.groups.layout.world_size, trainer.groups.rank

    def start(self, trainer: Trainer, r: int) -> None:
        entries = training_entries(trainer, saving=True)
        state = to_dcp([e for e in entries if e.main], self.rank, self.world)
        path = self.root / f"round_{r}"
        writer = dcp.FileSystemWriter(str(path), sync_files=True)
        self.future = dcp.async_save(state, storage_writer=writer, process_group=self.group)

    def in_flight(self) -> bool:
        return not self.future.done()

    def finish(self) -> None:
        self.future.result()


class _MCoreAsync:
    """megatron-core's asynchronous dist_checkpointing save (model + distributed optimizer)."""

    def __init__(self, root: Path) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.root, self.queue = root, AsyncCallsQueue(persistent=False)

    def start(self, trainer: Trainer, r: int) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy,
        )

        model = {}
        for chunk in trainer.model:
            model.update(chunk.sharded_state_dict())
        optim = trainer.optimizer.sharded_state_dict(
            model, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
        path = self.root / f"round_{r}"
        if trainer.groups.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        request = dist_checkpointing.save(
            {"model": model, "optimizer": optim},
            str(path),
            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1),
            async_sharded_save=True,
            validate_access_integrity=r == 0,
            **MCORE_ASYNC,
        )
        self.queue.schedule_async_request(request)

    def in_flight(self) -> bool:
        # Collective (every rank polls together): finalizes once every rank's write is done.
        if self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False)
        return bool(self.queue.get_num_unfinalized_calls())

    def finish(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)


def stall_rank(job, data_dir: Path, root: Path, rounds: int) -> dict:
    trainer = _trainer(job, data_dir)
    methods = {
        METHODS[0]: _Ours(job, trainer, root / "two-stage", async_save=True),
        METHODS[1]: _Ours(job, trainer, root / "sync", async_save=False),
        METHODS[2]: _DCPAsync(trainer, root / "dcp"),
        METHODS[3]: _MCoreAsync(root / "mcore"),
    }
    out: dict = {name: {"stall": [], "durable": []} for name in methods}
    out |= {"busy": [], "idle": []}
    for r in range(rounds + 1):  # round 0 warms up (first writes, cached plans, host buffers)
        order = list(methods)[r % len(methods) :] + list(methods)[: r % len(methods)]
        for name in order:
            method = methods[name]
            out["idle"] += [trainer.step().step_time_s for _ in range(2)] if r else []
            dist.barrier()
            start = time.perf_counter()
            method.start(trainer, r)
            stall = time.perf_counter() - start
            while _anyone(method.in_flight()):  # training goes on during the background write
                step_s = trainer.step().step_time_s
                out["busy"] += [step_s] if r else []
            method.finish()
            durable = time.perf_counter() - start
            stall, durable = _slowest(stall), _slowest(durable)
            if r:
                out[name]["stall"].append(stall)
                out[name]["durable"].append(durable)
        if trainer.groups.rank == 0:  # keep the disk from filling up
            for name in ("dcp", "mcore"):
                shutil.rmtree(root / name / f"round_{r}", ignore_errors=True)
    for method in methods.values():
        if isinstance(method, _Ours):
            method.saver.finalize()
    steps = Storage(root / "sync").complete_steps()
    out["bytes"] = sum(
        p.stat().st_size for p in (root / "sync").glob(f"step_{steps[-1]:08d}/**/*") if p.is_file()
    )
    destroy_groups()
    return out


def save_once(job, data_dir: Path, root: Path) -> int:
    trainer = _trainer(job, data_dir)
    saver = _saver(job, trainer, str(root), async_save=False)
    saver.save(trainer)
    saver.finalize()
    step = trainer.step_num
    destroy_groups()
    return step


def load_rank(job, data_dir: Path, root: Path, rounds: int) -> list[float]:
    trainer = _trainer(job, data_dir)
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        checkpoint_load.load_latest(trainer, Storage(root))
        times.append(_slowest(time.perf_counter() - start))
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
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds per comparison")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the training state lives for the stall comparison (cuda: copied from GPU "
        "memory into pinned host buffers)",
    )
    parser.add_argument(
        "--stall-only", action="store_true", help="measure the stall and durability only (part 1)"
    )
    args = parser.parse_args(argv)
    quiet_expected_noise()  # before forking: the ranks inherit the filters
    command = "python " + shlex.join(["benchmarks/checkpoint.py", *(argv or sys.argv[1:])])
    backend = "nccl" if args.device == "cuda" else "gloo"

    with tempfile.TemporaryDirectory(prefix="megascale-ckpt-bench-") as tmp:
        tmp_path = Path(tmp)
        data_dir = tmp_path / "data"
        default_token_file(data_dir)
        sets = [*DEFAULT_SETS, *args.overrides, f"train.device={args.device}"]
        job = validate(load(args.config, sets), args.nproc, backend)
        stall = run_local(stall_rank, args.nproc, (job, data_dir, tmp_path / "stall", args.rounds))[
            0
        ]
        loads = {}
        if not args.stall_only:
            root = tmp_path / "load"
            run_local(save_once, args.nproc, (job, data_dir, root))
            tp = validate(
                load(args.config, [*sets, f"parallel.tp={args.nproc}"]), args.nproc, backend
            )
            for r in range(args.rounds):
                for label, layout in (
                    (("same layout", job), ("resharded", tp))
                    if r % 2
                    else (("resharded", tp), ("same layout", job))
                ):
                    loads.setdefault(label, []).extend(
                        run_local(load_rank, args.nproc, (layout, data_dir, root, 1))[0]
                    )

    sync = _median(stall[METHODS[1]]["stall"])
    print(f"# checkpoint benchmark, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
    print(f"# {command}")
    print(f"# model: {' '.join(DEFAULT_SETS + args.overrides)}")
    print()
    where = "GPU memory" if args.device == "cuda" else "CPU memory"
    print(
        f"## 1. per save: {args.nproc} ranks (DP{args.nproc}, distributed optimizer), "
        f"{stall['bytes'] / 1e6:.0f} MB checkpoint from {where}, slowest rank, median of "
        f"{args.rounds} rotating rounds"
    )
    print()
    print("| save | training stall (s) | stall vs synchronous | until durable (s) |")
    print("|---|---|---|---|")
    for name in METHODS:
        s, d = _median(stall[name]["stall"]), _median(stall[name]["durable"])
        print(f"| {name} | {s:.3f} | {s / sync:.1%} | {d:.3f} |")
    print()
    print(
        f"step time while a background write runs {_median(stall['busy']) * 1e3:.0f} ms vs "
        f"{_median(stall['idle']) * 1e3:.0f} ms without ({len(stall['busy'])} steps)"
    )
    if args.stall_only:
        return 0
    same, resharded = _median(loads["same layout"]), _median(loads["resharded"])
    print()
    print(f"## 2. restart load, {args.nproc} ranks, slowest rank, median of {args.rounds}")
    print()
    print("| load | seconds | vs same layout |")
    print("|---|---|---|")
    print(f"| DP{args.nproc} checkpoint at DP{args.nproc} | {same:.3f} | 1.00 |")
    print(
        f"| DP{args.nproc} checkpoint resharded to TP{args.nproc} | {resharded:.3f} | {resharded / same:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
