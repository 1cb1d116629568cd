"""Neighbour all-reduce tests in recovery: which nodes test with which, on which channel, and what a
node's results say about it. Pure (no I/O): the controller plans, the agent judges.

MegaScale's self-check all-reduces each node with its neighbours under the same switch, so a bad
NIC, cable or switch port shows before training resumes. A plain pair cannot tell which of its two
nodes is at fault, so each node here tests with *two* neighbours: the nodes sharing a topology label
(the ToR switch or rack) form a ring, in registration order, and each node all-reduces with the
node before and the node after it. A node that fails with every neighbour is the broken one; a node
that fails with one neighbour and passes with the other is healthy and names that neighbour.

* Groups: nodes by topology label (first-seen order; nodes without a label share one group). A
  group of fewer than 3 nodes cannot make a ring that tells its nodes apart: it joins the next
  group (the last one joins the previous), so those edges cross a switch. A job of two nodes is one
  pair, whose failure fails both; a job of one node has no neighbours.
* Channels: the ring's edges are coloured so that no node is in two edges of one colour (2 colours
  for an even ring, 3 for an odd one). The colour is the edge's channel, a port offset: both ends
  of an edge listen on their own base port + channel, so a node runs all its tests at once on
  distinct ports, and a neighbour that never answers costs one network timeout, not one per test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_RING = 3
ABSENT = "not registered (no endpoint)"
"""A neighbour test's detail when the neighbour has no registration to reach it at: its
absence, never evidence against the node that tested (``judge`` leaves it out)."""


@dataclass(frozen=True)
class NeighbourTest:
    """One all-reduce this node runs: with ``node``, on ``channel`` (0, 1 or 2: a port offset)."""

    node: str
    channel: int

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "channel": self.channel}


def neighbour_groups(nodes: Sequence[str], labels: Mapping[str, str | None]) -> list[list[str]]:
    """``nodes`` (in order) grouped by ``labels[node]``, groups under 3 nodes merged (see the
    module docstring)."""
    by_label: dict[str | None, list[str]] = {}
    for node in nodes:
        by_label.setdefault(labels.get(node) or None, []).append(node)
    merged: list[list[str]] = []
    carry: list[str] = []
    for group in by_label.values():
        group, carry = carry + group, []
        if len(group) >= MIN_RING:
            merged.append(group)
        else:
            carry = group
    if carry:
        if merged:
            merged[-1] += carry
        else:
            merged.append(carry)
    return [g for g in merged if len(g) > 1]


def ring_tests(group: Sequence[str]) -> dict[str, list[NeighbourTest]]:
    """Each member's tests in its group's ring, by channel."""
    n = len(group)
    if n < 2:
        return {}
    edges = [(group[0], group[1])] if n == 2 else [(group[i], group[(i + 1) % n]) for i in range(n)]
    tests: dict[str, list[NeighbourTest]] = {node: [] for node in group}
    for i, (a, b) in enumerate(edges):
        channel = 2 if n % 2 and i == n - 1 else i % 2  # an odd ring's closing edge: colour 3
        tests[a].append(NeighbourTest(b, channel))
        tests[b].append(NeighbourTest(a, channel))
    return {node: sorted(ts, key=lambda t: t.channel) for node, ts in tests.items()}


def plan_neighbour_tests(
    nodes: Sequence[str], labels: Mapping[str, str | None]
) -> dict[str, list[NeighbourTest]]:
    """node -> the neighbour all-reduces it runs in this self-check (every node of ``nodes`` has
    an entry; empty when it has no neighbour)."""
    plan: dict[str, list[NeighbourTest]] = {node: [] for node in nodes}
    for group in neighbour_groups(nodes, labels):
        plan.update(ring_tests(group))
    return plan


def suspected(results: Sequence[NeighbourResult]) -> list[str]:
    """The neighbours this node names suspect: those it failed with while it passed with
    another (``judge``'s "(suspected)"); none when it passed with all or failed with all. The
    controller reads them from every node's self-check: two nodes that name each other cannot
    reach each other (a cut link) and must not train in one generation."""
    present = [r for r in results if r.ok or r.detail != ABSENT]
    if not any(r.ok for r in present):
        return []
    return [r.node for r in present if not r.ok]


@dataclass(frozen=True)
class NeighbourResult:
    """One all-reduce's outcome as the node saw it."""

    node: str
    ok: bool
    detail: str


def judge(results: Sequence[NeighbourResult]) -> tuple[bool, str]:
    """This node's verdict from its neighbour all-reduces: (ok, one line naming the neighbours).

    Fails when every neighbour test failed (the node itself is the common factor) or when its only
    neighbour failed (a pair cannot tell which side is broken). A neighbour that is not registered
    (``ABSENT``) is left out: its absence is no evidence about this node. Passes when it failed with some
    neighbours and passed with another: those neighbours are named as suspects.
    """
    if not results:
        return True, "no neighbours to all-reduce with"
    absent = [r for r in results if not r.ok and r.detail == ABSENT]
    if absent:  # a neighbour that is not there says nothing about this node
        gone = ", ".join(r.node for r in absent)
        present = [r for r in results if r not in absent]
        if not present:
            return True, f"no verdict: every neighbour ({gone}) is {ABSENT}"
        ok, detail = judge(present)
        return ok, f"{detail}; not tested: {gone} ({ABSENT})"
    failed = [r for r in results if not r.ok]
    passed = [r for r in results if r.ok]
    names = ", ".join(r.node for r in results)
    if not failed:
        return True, f"neighbour all-reduce passed with {names}"
    reasons = "; ".join(f"{r.node}: {r.detail}" for r in failed)
    if not passed:
        who = "its only neighbour" if len(results) == 1 else "every neighbour"
        return False, f"neighbour all-reduce failed with {who} ({names}): {reasons}"
    suspects = ", ".join(r.node for r in failed)
    good = ", ".join(r.node for r in passed)
    return True, (
        f"neighbour all-reduce passed with {good}, failed with {suspects} (suspected): {reasons}"
    )
