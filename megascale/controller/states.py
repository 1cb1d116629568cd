"""The controller's states and events, and ``TRANSITIONS``: the table of every allowed
(state, event) -> states that ``ControllerFSM`` checks each event against. Pure values.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    INIT = "init"
    WAITING_FOR_NODES = "waiting_for_nodes"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    DIAGNOSING = "diagnosing"
    RESTARTING = "restarting"
    FINISHED = "finished"
    FAILED = "failed"


class Event(enum.Enum):
    START = "start"
    NODE_REGISTERED = "node_registered"
    NODE_LOST = "node_lost"
    HEARTBEAT = "heartbeat"
    WORKER_EXIT = "worker_exit"
    ERROR_KEYWORD = "error_keyword"
    STALL_DETECTED = "stall_detected"
    ACK = "ack"
    ALL_STOPPED = "all_stopped"
    SELFCHECK_RESULT = "selfcheck_result"
    GENERATION_STARTED = "generation_started"
    TRAINING_FINISHED = "training_finished"
    STRAGGLER = "straggler"
    TICK = "tick"


S, E = State, Event
# After a fault the stop / self-check / restart protocol may run through several states within one
# event (e.g. the last stop ack, with no node left to self-check, restarts at once).
_FAULT = frozenset({S.STOPPING, S.DIAGNOSING, S.STARTING, S.RESTARTING, S.FAILED})
_CHECKED = frozenset({S.DIAGNOSING, S.STARTING, S.RESTARTING, S.FAILED})
# (state, event) -> every state the machine may be in once the event is handled. A pair that is
# missing is an illegal transition; observations (below) default to "stay" in every state.
TRANSITIONS: dict[tuple[State, Event], frozenset[State]] = {
    (S.INIT, E.START): frozenset({S.WAITING_FOR_NODES, S.STARTING}),
    (S.WAITING_FOR_NODES, E.NODE_REGISTERED): frozenset({S.WAITING_FOR_NODES, S.STARTING}),
    (S.WAITING_FOR_NODES, E.TICK): frozenset({S.WAITING_FOR_NODES, S.FAILED}),
    (S.STARTING, E.GENERATION_STARTED): frozenset({S.RUNNING}),
    (S.STARTING, E.ACK): _FAULT | {S.RUNNING},
    (S.STARTING, E.TRAINING_FINISHED): frozenset({S.FINISHED}),
    (S.RUNNING, E.TRAINING_FINISHED): frozenset({S.FINISHED}),
    (S.RUNNING, E.STRAGGLER): _FAULT | {S.RUNNING},
    **{
        (state, event): _FAULT | {state, S.FINISHED}
        for state in (S.STARTING, S.RUNNING)
        for event in (E.NODE_LOST, E.WORKER_EXIT, E.ERROR_KEYWORD, E.STALL_DETECTED, E.TICK)
    },
    **{(S.STOPPING, event): _FAULT for event in (E.ACK, E.NODE_LOST, E.TICK)},
    (S.STOPPING, E.ALL_STOPPED): _FAULT - {S.STOPPING},
    **{(S.DIAGNOSING, event): _CHECKED for event in (E.ACK, E.NODE_LOST, E.TICK)},
    (S.DIAGNOSING, E.SELFCHECK_RESULT): _CHECKED,
    (S.RESTARTING, E.NODE_REGISTERED): frozenset({S.RESTARTING, S.STARTING}),
    (S.RESTARTING, E.TICK): frozenset({S.RESTARTING, S.FAILED}),
    (S.FINISHED, E.TRAINING_FINISHED): frozenset({S.FINISHED}),
    **{
        (state, E.STALL_DETECTED): frozenset({state})
        for state in (S.STOPPING, S.DIAGNOSING, S.RESTARTING)
    },
}
OBSERVATIONS = (
    E.NODE_REGISTERED,
    E.NODE_LOST,
    E.HEARTBEAT,
    E.WORKER_EXIT,
    E.ERROR_KEYWORD,
    E.ACK,
    E.STRAGGLER,
    E.TICK,
)
for _state in State:
    for _event in OBSERVATIONS:
        TRANSITIONS.setdefault((_state, _event), frozenset({_state}))


class IllegalTransition(RuntimeError):
    """An event arrived in a state that does not allow it (a bug in the caller or the table)."""
