"""The controller service's options (``ServiceOptions``): the job, its policy, the clocks of the
service loop, its ``/metrics``, straggler detection, and what a peer's messages are checked
against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megascale.config import FaultToleranceConfig
from megascale.config.rules import STRAGGLER_ACTIONS
from megascale.controller.policy import ControllerPolicy, lease_ttl


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
    starved_s: float = 1.0
    """A turn of the controller's loop this much later than its tick extends the FSM's
    deadlines by the delay (``ControllerFSM.extend_deadlines``): its own absence is not the
    nodes'."""
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
    train_steps: int | None = None
    """The job's ``train.steps``: a heartbeat claiming a step beyond it is dropped (None: no
    upper bound is checked)."""
    config_hash: str | None = None
    """The job's config hash (``agent.identity.config_hash``): a node registered with another
    is refused and never counted (None: not checked)."""

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
