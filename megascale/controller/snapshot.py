"""The controller's ``state`` snapshot: what a standby controller restores ``ControllerFSM`` from.

``snapshot(fsm)`` is a ``messages.ControllerState``, encoded: plain JSON (the controller mirrors it to etcd's ``state`` key with every
decision; the operator reads it too: ``state``, ``generation``, ``restarts``, ``order``,
``spares``, ``step``, ``fault``, ``failure``). ``restore(fsm, snapshot, now)`` fills a fresh FSM
from it. Times are kept as ages (``restart_ages_s``): a standby's monotonic clock has another
origin.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megascale.controller.actions import Fault
from megascale.controller.states import State
from megascale.messages.job import ControllerState, FaultRecord

if TYPE_CHECKING:
    from megascale.controller.fsm import ControllerFSM


def snapshot(fsm: ControllerFSM) -> dict[str, Any]:
    """Everything a standby controller needs to continue ``fsm``: ``messages.ControllerState``,
    encoded."""
    fault = fsm.fault
    return ControllerState(
        state=fsm.state.value,
        generation=fsm.generation,
        restarts=fsm.restarts,
        restart_ages_s=list(fsm.budget.ages(fsm.now)),
        failure=fsm.failure,
        order=list(fsm.order),
        assignment={n: list(r) for n, r in fsm.assignment.items()},
        registered=list(fsm.registered),
        spares=list(fsm.spares),
        blocklist=dict(fsm.blocklist),
        awaiting=dict(fsm.awaiting),
        awaiting_kind=fsm.awaiting_kind,
        step=fsm.step,
        section=fsm.section(),
        stall_timeout_s=fsm.stall_timeout(),
        fault=None
        if fault is None
        else FaultRecord(
            fault.kind,
            fault.node,
            fault.rank,
            dict(fault.detail),
            list(fault.suspects),
            fault.blames_nodes,
        ),
        faults=len(fsm.faults),
        culprits=dict(fsm.culprits),
        error_signatures=dict(fsm.error_signatures),
        samples={k: list(v) for k, v in fsm.timeouts.samples.items()},
        commands=fsm._commands,
        topology={n: label for n, label in fsm.topology.items() if label},
    ).encode()


def restore(fsm: ControllerFSM, snapshot: Mapping[str, Any], now: float) -> None:
    """Continue from ``snapshot`` (``snapshot()``'s value) in ``fsm``, a fresh FSM made at
    ``now``; ``MessageError`` when it is not a readable ``ControllerState``."""
    saved = ControllerState.decode(snapshot)
    fsm.state = State(saved.state)
    fsm.generation = saved.generation
    fsm.order = list(saved.order)
    fsm.registered = dict.fromkeys(saved.registered)
    fsm.blocklist = dict(saved.blocklist)
    fsm.awaiting = dict(saved.awaiting)
    fsm.awaiting_kind = saved.awaiting_kind
    fsm.culprits = Counter(saved.culprits)
    fsm.error_signatures = {str(k): int(v) for k, v in saved.error_signatures.items()}
    fsm.budget.restore(saved.restart_ages_s, now)
    fsm.failure = saved.failure
    fsm._commands = saved.commands
    fsm.topology = dict(saved.topology)
    for section, samples in saved.samples.items():
        fsm.timeouts.samples[section].extend(samples)
    if saved.fault is not None:
        f = saved.fault
        fsm.fault = Fault(f.kind, f.node, f.rank, f.detail, tuple(f.suspects), f.blames_nodes)
        if fsm.state in (State.STOPPING, State.DIAGNOSING):  # this generation's: counted already
            fsm.counted = dict.fromkeys(fsm._fault_culprits(fsm.fault), fsm.generation)
    fsm._reset_generation_tracking()
    fsm.step = saved.step
    fsm.stepped = saved.section != "init"
