"""The controller's ``state`` snapshot: what a standby controller restores ``ControllerFSM`` from.

``snapshot(fsm)`` is plain JSON (the controller mirrors it to etcd's ``state`` key with every
decision; the operator reads it too: ``state``, ``generation``, ``restarts``, ``order``,
``spares``, ``step``, ``fault``, ``failure``). ``restore(fsm, snapshot, now)`` fills a fresh FSM
from it. Times are kept as ages (``restart_ages_s``): a standby's monotonic clock has another
origin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megascale.robustness.controller_types import Fault, State

if TYPE_CHECKING:
    from megascale.robustness.controller import ControllerFSM


def snapshot(fsm: ControllerFSM) -> dict[str, Any]:
    """Everything a standby controller needs to continue ``fsm``, as JSON."""
    fault = fsm.fault
    return {
        "state": fsm.state.value,
        "generation": fsm.generation,
        "restarts": fsm.restarts,
        "restart_ages_s": fsm.budget.ages(fsm.now),
        "failure": fsm.failure,
        "order": list(fsm.order),
        "assignment": {n: list(r) for n, r in fsm.assignment.items()},
        "registered": list(fsm.registered),
        "spares": fsm.spares,
        "blocklist": dict(fsm.blocklist),
        "awaiting": dict(fsm.awaiting),
        "awaiting_kind": fsm.awaiting_kind,
        "step": fsm.step,
        "section": fsm.section(),
        "stall_timeout_s": fsm.stall_timeout(),
        "fault": None
        if fault is None
        else {
            "kind": fault.kind,
            "node": fault.node,
            "rank": fault.rank,
            "detail": dict(fault.detail),
            "suspects": list(fault.suspects),
            "blames_nodes": fault.blames_nodes,
        },
        "faults": len(fsm.faults),
        "culprits": dict(fsm.culprits),
        "error_signatures": dict(fsm.error_signatures),
        "samples": {k: list(v) for k, v in fsm.timeouts.samples.items()},
        "commands": fsm._commands,
        "topology": {n: label for n, label in fsm.topology.items() if label},
    }


def restore(fsm: ControllerFSM, snapshot: Mapping[str, Any], now: float) -> None:
    """Continue from ``snapshot`` in ``fsm``, a fresh FSM made at ``now``."""
    fsm.state = State(snapshot["state"])
    fsm.generation = int(snapshot["generation"])
    fsm.order = list(snapshot["order"])
    fsm.registered = dict.fromkeys(snapshot["registered"])
    fsm.blocklist = dict(snapshot["blocklist"])
    fsm.awaiting = dict(snapshot["awaiting"])
    fsm.awaiting_kind = snapshot["awaiting_kind"]
    fsm.culprits = Counter(snapshot["culprits"])
    fsm.error_signatures = {
        str(k): int(v) for k, v in (snapshot.get("error_signatures") or {}).items()
    }
    fsm.budget.restore(snapshot.get("restart_ages_s", ()), now)
    fsm.failure = snapshot.get("failure")
    fsm._commands = int(snapshot["commands"])
    fsm.topology = dict(snapshot.get("topology") or {})
    for section, samples in snapshot["samples"].items():
        fsm.timeouts.samples[section].extend(samples)
    if snapshot.get("fault"):
        f = snapshot["fault"]
        fsm.fault = Fault(
            f["kind"], f["node"], f["rank"], f["detail"], tuple(f["suspects"]),
            bool(f.get("blames_nodes", True)),
        )  # fmt: skip
    fsm._reset_generation_tracking()
    fsm.step = snapshot.get("step")
    fsm.stepped = snapshot.get("section") != "init"
