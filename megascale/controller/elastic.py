"""Elastic data parallelism and the restart budget: pure helpers of ``ControllerFSM``.

* ``shrink_nodes``: how many of the nodes left a shrunk generation uses (the largest data-parallel
  size the layout and the global batch allow).
* ``resize_detail``: what an ``elastic`` event says about a change of size (nodes, dp,
  micro-batches per rank, and a one-line ``text``).
* ``RestartBudget``: at most ``max_restarts`` restarts within any ``restart_window_s``.

No I/O and no clock: times are passed in, like everywhere in the controller's core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from megascale.config.rules import batch_split_problem
from megascale.controller.policy import ControllerPolicy


def dp_of(policy: ControllerPolicy, nodes: int) -> int | None:
    """The data-parallel size of a generation on ``nodes`` nodes, None when its ranks do not form
    whole replicas of ``tp * pp`` ranks or the global batch does not split over them."""
    world, replica = nodes * policy.nproc_per_node, policy.tp * policy.pp
    if nodes < 1 or world % replica:
        return None
    dp = world // replica
    if policy.global_batch_size is not None and batch_split_problem(
        policy.global_batch_size, policy.micro_batch_size, dp, policy.pp, policy.vpp
    ):
        return None
    return dp


def shrink_nodes(healthy: int, policy: ControllerPolicy) -> int | None:
    """The most nodes, at most ``healthy`` and fewer than ``policy.nodes``, that a generation can
    run on (``dp_of`` is not None); None when no count from 1 up works."""
    for nodes in range(min(healthy, policy.nodes - 1), 0, -1):
        if dp_of(policy, nodes) is not None:
            return nodes
    return None


def microbatches(policy: ControllerPolicy, nodes: int) -> int | None:
    """Micro-batches each rank runs per step on ``nodes`` nodes (None when unknown)."""
    dp = dp_of(policy, nodes)
    if dp is None or policy.global_batch_size is None:
        return None
    return policy.global_batch_size // (policy.micro_batch_size * dp)


def resize_detail(
    decision: str, policy: ControllerPolicy, before: int, after: int, lost: Sequence[str]
) -> dict[str, Any]:
    """The detail of an ``elastic`` event for a generation going from ``before`` to ``after``
    nodes: ``decision`` ("shrink" | "grow"), the sizes, and ``text``, e.g. "shrink: node-2 lost,
    no spare; nodes 4 -> 3, dp 4 -> 3, micro-batches 1 -> 2 per rank (global batch 12 kept)"."""
    dp_before, dp_after = dp_of(policy, before), dp_of(policy, after)
    mb_before, mb_after = microbatches(policy, before), microbatches(policy, after)
    why = f"{', '.join(lost)} lost, no spare" if decision == "shrink" else "enough nodes again"
    text = f"{decision}: {why}; nodes {before} -> {after}, dp {dp_before} -> {dp_after}"
    if mb_before is not None and mb_after is not None:
        text += (
            f", micro-batches {mb_before} -> {mb_after} per rank "
            f"(global batch {policy.global_batch_size} kept)"
        )
    return {
        "decision": decision,
        "policy": policy.node_loss_policy,
        "lost": list(lost),
        "nodes": [before, after],
        "dp": [dp_before, dp_after],
        "microbatches": [mb_before, mb_after],
        "text": text,
    }


class RestartBudget:
    """Restarts allowed: at most ``max_restarts`` within any ``window_s`` seconds (None: within
    the whole run, the lifetime-wide budget)."""

    def __init__(self, max_restarts: int, window_s: float | None) -> None:
        self.max_restarts, self.window_s = max_restarts, window_s
        self.times: deque[float] = deque()

    def _expire(self, now: float) -> None:
        if self.window_s is not None:
            while self.times and now - self.times[0] >= self.window_s:
                self.times.popleft()

    def allows(self, now: float) -> bool:
        """Whether one more restart at ``now`` stays within the budget."""
        self._expire(now)
        return len(self.times) < self.max_restarts

    def record(self, now: float) -> None:
        self.times.append(now)
        self._expire(now)

    def describe(self) -> str:
        window = "the run" if self.window_s is None else f"{self.window_s:g} s"
        return f"max_restarts = {self.max_restarts} within restart_window_s = {window} exhausted"

    def ages(self, now: float) -> list[float]:
        """How long ago each counted restart was (for a snapshot: clocks differ between hosts)."""
        self._expire(now)
        return [now - t for t in self.times]

    def restore(self, ages: Iterable[float], now: float) -> None:
        self.times = deque(sorted(now - float(a) for a in ages))
        self._expire(now)
