"""Process groups: torch.distributed, megatron-core's parallel state, and this rank's place in them.

``build_groups`` is called once per rank after ``torch.distributed`` is up. Megatron-core keeps its
groups in module globals (``parallel_state``) and many of its code paths read them from there, so we
initialise those; everything of ours receives the groups explicitly as a ``Groups`` value.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megascale.config import ParallelConfig
from megascale.parallel.layout import Layout

logger = logging.getLogger(__name__)

TIMEOUT_S = 600.0
"""How long a collective of any group of a run may take before torch aborts it (its watchdog,
on NCCL): the default group's and the TP/PP/DP groups' alike."""


@dataclass(frozen=True)
class Groups:
    """This rank's coordinates and process groups."""

    layout: Layout
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0


NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


def init_distributed(device: str, timeout_s: float = TIMEOUT_S) -> tuple[int, int]:
    """Join the job's process group from the torchrun-style environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Returns (rank, world_size)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Every NCCL group times its kernels on its own stream, so the flight recorder gives an
        # asynchronous collective its device time, not the watcher's polling (a user's 0 stands).
        os.environ.setdefault(NCCL_TIMING_ENV, "1")
    if not dist.is_initialized():
        from megascale.launcher.job_store import job_store  # rank 0's store on MASTER_ADDR only

        dist.init_process_group(
            backend,
            store=job_store(rank, world, timeout_s),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return rank, world


def build_groups(parallel: ParallelConfig, timeout_s: float = TIMEOUT_S) -> Groups:
    """Create megatron-core's TP/PP/DP groups for ``parallel`` (already validated) on this rank,
    with ``timeout_s`` as their collectives' timeout (the default group's, ``init_distributed``'s;
    megatron-core's own default is 30 minutes)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    world, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(
        world_size=world, tp=parallel.tp, pp=parallel.pp, dp=world // (parallel.tp * parallel.pp)
    )
    from megatron.core.rerun_state_machine import (
        destroy_rerun_state_machine,
        initialize_rerun_state_machine,
    )

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    destroy_rerun_state_machine()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        order="tp-cp-ep-dp-pp",  # the order megascale.parallel.layout computes
        # No gloo twin of every data-parallel group: nothing here uses them (the optimizer is
        # built without them, checkpoints hold per-rank shards), and their full-mesh connect
        # through the store is what makes default group setup grow as N^2 (docs/scale.md).
        create_gloo_process_groups=False,
        distributed_timeout_minutes=timeout_s / 60,  # a timedelta's minutes: need not be whole
    )
    initialize_rerun_state_machine()  # explicit, or megatron-core warns on the first step
    coord = layout.coords(rank)
    groups = Groups(
        layout=layout,
        rank=rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    if (groups.dp_rank, groups.pp_rank, groups.tp_rank) != (coord.dp, coord.pp, coord.tp):
        raise RuntimeError(
            f"megatron-core placed rank {rank} at (dp={groups.dp_rank}, pp={groups.pp_rank}, "
            f"tp={groups.tp_rank}) but the layout says {layout.describe(rank)}"
        )
    return groups


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor given to a collective over ``group`` (None: the default group) must be:
    this process's current CUDA device when the group runs on NCCL, which takes no host tensors,
    else the CPU (gloo). Needs torch.distributed initialised."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def destroy_groups() -> None:
    """Tear down megatron-core's groups and the default process group (end of a run, tests)."""
    from megatron.core import parallel_state as ps
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    destroy_rerun_state_machine()
    if dist.is_initialized():
        dist.destroy_process_group()
