"""Measure overlap: train a few steps per variant on every rank with a ``CommTrace`` installed.

``measure_rank`` runs on each rank (started by ``megascale.launcher.local.run_local``): for each
round and each variant it rebuilds the trainer with that variant's ``overlap`` settings, runs
``warmup`` untimed and ``steps`` timed steps, and returns per-step wall time, exposed communication,
modelled and exposed communication per link class (tp, dp, pp) and per kind and size of call, loss,
grad norm, and (optionally) the comm events and marks of the step — so benchmarks and ordering
tests share one code path.
Communication is priced by a fixed latency, or (``fabric``) by the byte-proportional model of
``megascale.overlap.cost`` calibrated on every rank at once against this CPU's GEMM rate. With
``parallel.async_collectives`` (the NCCL-like CPU mode) the costs are waited out on that mode's
communication threads. Variants alternate within each round, so machine noise lands on all of
them alike.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megascale.config import JobConfig
from megascale.overlap import pp_exposure
from megascale.overlap.cost import CostModel, measure_gemm_flops
from megascale.overlap.trace import CommTrace
from megascale.parallel import async_comm, cpu_backend
from megascale.parallel.groups import (
    build_groups,
    collective_device,
    destroy_groups,
    init_distributed,
)
from megascale.train.run import seed_everything
from megascale.train.trainer import Trainer


def with_overlap(job: JobConfig, **changes) -> JobConfig:
    return dataclasses.replace(job, overlap=dataclasses.replace(job.overlap, **changes))


def _instrument(trainer: Trainer, trace: CommTrace) -> None:
    """Marks: step start, batch loaded, first forward of the step, each micro-batch's forward step,
    backward done (grad finalize)."""
    first_forward = {"seen": False}

    def on_forward(_module, _inputs):
        if not first_forward["seen"]:
            first_forward["seen"] = True
            trace.mark("forward_start")

    trainer.model[0].module.register_forward_pre_hook(on_forward)
    finalize = trainer.config.finalize_model_grads_func

    def finalize_with_mark(*args, **kwargs):
        trace.mark("backward_done")
        return finalize(*args, **kwargs)

    trainer.config.finalize_model_grads_func = finalize_with_mark
    next_step = trainer.data.next_step

    def next_step_with_mark():
        batches = next_step()
        trace.mark("data_loaded")
        return batches

    trainer.data.next_step = next_step_with_mark
    forward_step = trainer._forward_step

    def forward_step_with_mark(data_iterator, model):
        trace.mark("microbatch_forward")
        return forward_step(data_iterator, model)

    trainer._forward_step = forward_step_with_mark
    trainer.reset_first_forward = lambda: first_forward.update(seen=False)


def _link_classifier(groups):
    """``link_of(group)``: "tp", "dp" or "pp" by the group's ranks, "other" for the rest (grad-norm
    all-reduce, world). The tied embedding's gradient all-reduce between the first and the last
    stage (megatron-core's embedding group) counts as "dp": like the DP buckets it synchronises a
    weight's gradient once per step, its bytes are the weight's (not the activations' that PP's
    p2p carries), and at PP2 its ranks are the pipeline group's, so it is told by identity."""
    classes = [
        (frozenset(dist.get_process_group_ranks(g)), link)
        for g, link in ((groups.tp, "tp"), (groups.dp, "dp"), (groups.pp, "pp"))
        if g is not None and g.size() > 1
    ]
    cache: dict[int, str] = {}
    for group in (getattr(groups.pg_collection, name, None) for name in ("embd", "pos_embd")):
        if group is not None:
            cache[id(group)] = "dp"

    def link_of(group) -> str:
        if group is None:
            return "other"
        if id(group) not in cache:
            ranks = frozenset(dist.get_process_group_ranks(group))
            link = next((name for members, name in classes if ranks == members), None)
            if link is None:
                pp_ranks = next((m for m, name in classes if name == "pp"), frozenset())
                link = "pp" if len(ranks) > 1 and ranks <= pp_ranks else "other"
            cache[id(group)] = link
        return cache[id(group)]

    return link_of


_P2P = pp_exposure.SENDS + pp_exposure.RECEIVES


def _add_paired_pp(rows: list[dict], p2p_by_step: list[list[dict]]) -> None:
    """Give each step's ``by_link["pp"]`` an ``exposed_paired_s``: its ``exposed_s`` with this
    rank's p2p waits re-counted from both ends of each message (``megascale.overlap.pp_exposure``).
    Gathers every rank's p2p events once, after the timed steps. Collective."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, p2p_by_step)
    me = dist.get_rank()
    for i, row in enumerate(rows):
        step = [per_rank[i] for per_rank in everyone]
        try:
            paired = pp_exposure.paired_exposure(step)[me]
        except ValueError:  # unpaired (batched p2p): keep the receiver-side bound
            continue
        pp = row["by_link"].setdefault("pp", {"comm_s": 0.0, "exposed_s": 0.0})
        own = pp_exposure.receiver_side_exposure(step[me])
        pp["exposed_paired_s"] = max(0.0, pp["exposed_s"] - own) + paired


def _release_memory() -> None:
    """Free the last variant's trainer before the next is built: its reference cycles (modules,
    hooks, the schedule's closures) and the heap pages the allocator keeps (glibc's
    ``malloc_trim``), so eight ranks of a large preset hold one trainer each, not two."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass


def _by_call(events) -> dict[str, dict[str, list]]:
    """Per link class, per kind of call and size: [calls, modelled cost, exposed] of one step
    (where a dimension's exposure comes from: e.g. TP's layer chunks vs the embedding's
    unchunked reduce-scatter)."""
    out: dict[str, dict[str, list]] = {}
    for e in events:
        entry = out.setdefault(e.link, {}).setdefault(f"{e.kind} {e.nbytes}B", [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += e.cost_s
        entry[2] += e.exposed_s
    return out


def calibrated_cost(fabric: str, elem_scale: float, alpha_scale: float) -> CostModel:
    """The fabric's cost model scaled by the GEMM rate every rank gets while all run at once
    (mean over ranks). Collective."""
    dist.barrier()
    rate = torch.tensor([measure_gemm_flops()], dtype=torch.float64, device=collective_device())
    dist.all_reduce(rate)
    mean = rate.item() / dist.get_world_size()
    return CostModel.calibrated(fabric, mean, elem_scale, alpha_scale)


def measure_rank(
    variants: dict[str, JobConfig],
    data_dir: Path,
    *,
    steps: int,
    warmup: int,
    rounds: int,
    latency_s: float = 0.0,
    fabric: str | None = None,
    elem_scale: float = 0.5,
    alpha_scale: float = 1.0,
    keep_events: bool = False,
) -> dict[str, list[dict]]:
    """Per variant, one dict per timed step. Collective: every rank runs the same variants."""
    torch.set_num_threads(1)
    first = next(iter(variants.values()))
    device = "cuda" if first.train.device == "cuda" else "cpu"
    init_distributed(device)
    if device == "cpu":
        cpu_backend.activate()
    cost = (
        calibrated_cost(fabric, elem_scale, alpha_scale) if fabric else CostModel.fixed(latency_s)
    )
    # The NCCL-like mode (every call returns at once, runs on a thread per group): its threads
    # apply the costs. Installed under the trace, as under the flight recorder in training.
    engine = async_comm.install() if first.parallel.async_collectives and device == "cpu" else None
    trace = CommTrace(cost=cost, engine=engine).install()
    results: dict[str, list[dict]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            job = variants[name]
            groups = build_groups(job.parallel)
            # Before the trainer: its set-up already calls some groups (a group's link is read
            # when its first call is priced).
            trace.link_of = _link_classifier(groups)
            seed_everything(job.train.seed, groups.tp_rank, device)
            trainer = Trainer(job, groups, device, data_cache_dir=data_dir)
            _instrument(trainer, trace)
            p2p_by_step = []
            for i in range(warmup + steps):
                trainer.reset_first_forward()
                trace.reset()
                torch.distributed.barrier()
                trace.mark("step_start")
                start = time.perf_counter()
                m = trainer.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                events, marks, exposed = trace.reset()
                if i < warmup:
                    continue
                row = {
                    "time_s": elapsed,
                    "exposed_s": exposed,
                    "loss": m.loss,
                    "grad_norm": m.grad_norm,
                    "by_link": {
                        link: {"comm_s": c, "exposed_s": x}
                        for link, (c, x) in trace.last_by_link.items()
                    },
                    "cost_model": cost.describe(),
                }
                row["by_call"] = _by_call(events)
                p2p_by_step.append(
                    [dataclasses.asdict(e) for e in events if e.kind in _P2P and not e.coalesced]
                )
                if keep_events:
                    row["events"] = [dataclasses.asdict(e) for e in events]
                    row["marks"] = [dataclasses.asdict(mk) for mk in marks]
                results[name].append(row)
            _add_paired_pp(results[name][len(results[name]) - len(p2p_by_step) :], p2p_by_step)
            del trainer
            _release_memory()
    trace.uninstall()
    if engine is not None:
        engine.drain()
    destroy_groups()
    return results
