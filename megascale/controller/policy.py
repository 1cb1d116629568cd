"""What the controller aims for and how patient it is: ``ControllerPolicy``, and the one place
it is built from a ``fault_tolerance`` config section (``policy_for``), with the service's
straggler settings (``straggler_options``) and the lease TTL agents and controllers share
(``lease_ttl``). Pure values, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megascale.config import FaultToleranceConfig
from megascale.config.rules import fault_tolerance_problems
from megascale.parallel.layout import Layout


@dataclass(frozen=True)
class ControllerPolicy:
    """What the controller aims for and how patient it is."""

    nodes: int
    """Nodes per generation (M); registered nodes beyond M are spares."""
    nproc_per_node: int
    """Worker processes (ranks) per node (K)."""
    tp: int = 1
    """Tensor-parallel size, to name ranks as (dp, pp, tp)."""
    pp: int = 1
    """Pipeline-parallel size."""
    max_restarts: int = FaultToleranceConfig.max_restarts
    """Generations started after a fault within any ``restart_window_s``, at most; the fault that
    would exceed it fails the job."""
    restart_window_s: float | None = FaultToleranceConfig.restart_window_s
    """The sliding window ``max_restarts`` counts in (seconds); None: the whole run."""
    node_loss_policy: str = FaultToleranceConfig.policy
    """A node lost or evicted with no spare to take its slot: ``"wait"`` for one to register (up
    to ``node_wait_timeout_s``), ``"shrink"`` to the largest data-parallel size the nodes left
    allow (``controller_elastic.shrink_nodes``), or ``"fail"`` the job."""
    global_batch_size: int | None = None
    """``train.global_batch_size``: a shrink keeps it, so the data-parallel size must split it
    into whole micro-batches; None: any data-parallel size is accepted."""
    micro_batch_size: int = 1
    """``train.micro_batch_size``."""
    vpp: int = 1
    """``parallel.vpp`` (interleaving needs the micro-batches per rank divisible by pp)."""
    heartbeat_timeout_s: float = 10.0
    """An active node silent this long is faulty (its lease may still be alive)."""
    init_timeout_s: float = 600.0
    """Longest a generation may take to make its first step of progress (start-up, restore)."""
    step_timeout_s: float = 300.0
    """Stall timeout between steps until ``stall_min_samples`` gaps have been observed."""
    checkpoint_timeout_s: float = 600.0
    """Stall timeout in a checkpoint section until enough checkpoints have been observed."""
    stall_floor_s: float = 10.0
    """Learned timeouts are never below this (progress is seen at heartbeat granularity)."""
    stall_safety_factor: float = 4.0
    """Learned timeout = factor x the longest recent observed duration."""
    stall_min_samples: int = 3
    """Observations needed before a section's timeout is learned rather than the default."""
    start_timeout_s: float = 120.0
    """Every node must ack a start command within this."""
    stop_timeout_s: float = 30.0
    """Every node must ack a stop command within this, or it is evicted."""
    selfcheck_timeout_s: float = FaultToleranceConfig.selfcheck_timeout_s
    """Every node must report its self-check within this, or it is evicted."""
    node_wait_timeout_s: float | None = FaultToleranceConfig.node_wait_timeout_s
    """Longest to wait for enough (replacement) nodes before failing; None waits forever."""
    evict_repeat_culprit: int = FaultToleranceConfig.evict_repeat_culprit
    """A node named culprit in this many faults is evicted even if its self-check passes."""
    recovery: str = "restart"
    """How the agents recover (``train.resident.in_process_applies``). ``"in-process"``: after a
    fault only the nodes it names culprit are self-checked; the others' workers paused with their
    state, a better proof of health than a self-check, and rejoin at once. ``megascale launch``
    sets it; a ``megascale controller`` of its own (the operator's, Slurm's) self-checks every
    node, whatever the agents do."""

    def __post_init__(self) -> None:
        for name in (
            "nodes",
            "nproc_per_node",
            "tp",
            "pp",
            "stall_min_samples",
            "evict_repeat_culprit",
            "micro_batch_size",
            "vpp",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ControllerPolicy.{name} = {value!r}: must be an integer >= 1")
        problems = fault_tolerance_problems(
            self.node_loss_policy,
            self.max_restarts,
            self.restart_window_s,
            self.node_wait_timeout_s,
            "ControllerPolicy.",
            "node_loss_policy",
        )
        if problems:
            raise ValueError("; ".join(problems))
        self.layout  # noqa: B018  (validates that tp * pp divides the world size)

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def layout(self) -> Layout:
        return Layout.from_world(self.world_size, tp=self.tp, pp=self.pp)


# -- timing shared by agents and controllers -----------------------------------------------------


def lease_ttl(heartbeat_interval: float) -> int:
    """Agents' and controllers' lease TTL: 2 heartbeats, at least 2 s (etcd counts whole
    seconds, and a 1 s lease expires under a few hundred ms of CPU starvation)."""
    return max(2, math.ceil(2 * heartbeat_interval))


def policy_for(
    nodes: int,
    nproc_per_node: int,
    *,
    tp: int = 1,
    pp: int = 1,
    heartbeat_interval: float = 1.0,
    fault_tolerance: FaultToleranceConfig | None = None,
    **overrides: Any,
) -> ControllerPolicy:
    """The ``ControllerPolicy`` of a job, the one place it is built (``megascale launch``,
    ``megascale controller``, hence the operator's controller pod, and the simulators).

    Its fault-tolerance settings are the config's ``fault_tolerance`` section (the defaults when
    None); its timeouts follow the heartbeat interval: a node silent for 10 heartbeats (at least
    5 s) is faulty, and a stall is never declared in under 12 heartbeats (at least 4 s) however
    fast the steps were. ``overrides`` (other ``ControllerPolicy`` fields: the training layout and
    batch, start-up timeouts) win."""
    ft = fault_tolerance or FaultToleranceConfig()
    base = {
        "heartbeat_timeout_s": max(10 * heartbeat_interval, 5.0),
        "stall_floor_s": max(12 * heartbeat_interval, 4.0),
        "max_restarts": ft.max_restarts,
        "restart_window_s": ft.restart_window_s,
        "node_loss_policy": ft.policy,
        "node_wait_timeout_s": ft.node_wait_timeout_s,
        "evict_repeat_culprit": ft.evict_repeat_culprit,
        "selfcheck_timeout_s": ft.selfcheck_timeout_s,
    }
    return ControllerPolicy(nodes, nproc_per_node, tp, pp, **{**base, **overrides})


def straggler_options(ft: FaultToleranceConfig) -> dict[str, Any]:
    """The ``ServiceOptions`` straggler fields of a ``fault_tolerance`` section."""
    return {
        "straggler_threshold": ft.straggler_threshold,
        "straggler_window": ft.straggler_window,
        "straggler_consecutive": ft.straggler_consecutive,
        "straggler_action": ft.straggler_action,
    }
