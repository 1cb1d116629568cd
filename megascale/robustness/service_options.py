"""What a controller process is configured with; pure values, no I/O.

* ``lease_ttl``: the lease TTL agents and controllers share, from the heartbeat interval.
* ``policy_for``: the ``ControllerPolicy`` of a ``fault_tolerance`` config section, its timeouts
  following the heartbeat interval; ``straggler_options``: the service's straggler settings.
* ``ServiceOptions``: the options of a ``service.ControllerService``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale.config import FaultToleranceConfig
from megascale.config_validate import STRAGGLER_ACTIONS
from megascale.robustness.controller import ControllerPolicy

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


# -- the controller service's options ----------------------------------------------------------


@dataclass(frozen=True)
class ServiceOptions:
    job_id: str
    run_dir: Path
    policy: ControllerPolicy
    candidate_id: str
    heartbeat_interval: float = 1.0
    tick_s: float = 0.25
    """How often the FSM's clock advances (``on_tick``)."""
    check_s: float = 1.0
    """How often leadership (and so etcd) is confirmed with a read."""
    snapshot_s: float = 0.25
    """The ``state`` snapshot (O(nodes) bytes) is written at most this often when nothing else
    is: a decision that sends commands writes it with them at once."""
    drain: int = 512
    """Watch events handled per loop iteration before the outbox is written (one write for a
    burst of acks or heartbeats, not one per event)."""
    metrics_port: int = 0
    """Port of the Prometheus ``/metrics`` on ``metrics_addr`` (0: a free one; -1: none)."""
    metrics_addr: str = "127.0.0.1"
    """Address ``/metrics`` listens on: loopback locally, the pod's IP in Kubernetes."""
    straggler_threshold: float = FaultToleranceConfig.straggler_threshold
    """A node is slow when one of its ranks computes this many times the median of the other
    ranks of its pipeline stage (``stragglers``)."""
    straggler_window: int = FaultToleranceConfig.straggler_window
    """New compute times per rank (one per heartbeat with a new step) in the sliding window."""
    straggler_consecutive: int = FaultToleranceConfig.straggler_consecutive
    """Windows in a row a node must be slow to be recorded as a ``straggler`` event."""
    straggler_action: str = FaultToleranceConfig.straggler_action
    """``"report"``: a ``straggler`` event and the metrics; ``"evict"``: also replace the node
    with a spare (``ControllerFSM.on_straggler``)."""

    def __post_init__(self) -> None:
        if self.straggler_action not in STRAGGLER_ACTIONS:
            raise ValueError(
                f"straggler_action = {self.straggler_action!r}: must be one of {STRAGGLER_ACTIONS}"
            )

    @property
    def election_ttl(self) -> int:
        return lease_ttl(self.heartbeat_interval)

    @property
    def secondary_hold_s(self) -> float:
        # A vanished node's lease is gone up to TTL after its last keep-alive, found by etcd's
        # expiry scan (every 0.5 s), then delivered: 2 s for that delivery on a busy host.
        return lease_ttl(self.heartbeat_interval) + 0.5 + 2.0

    @property
    def error_hold_s(self) -> float:
        """How long a worker's exception exit waits for the other ranks': the same error on
        every rank is the job's, not the node's (every exit is reported at once; two
        heartbeats and a second allow for a rank a little behind)."""
        return 2 * self.heartbeat_interval + 1.0
