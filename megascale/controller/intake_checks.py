"""What the controller checks in a peer's message before it believes it.

A heartbeat is a claim by one agent; the controller acts on it (a job's progress, a stall's
clock, an exit, a culprit), so a claim it cannot hold true is dropped, not half-used:
``heartbeat_problem`` names the first field out of its type or range in one line, and the
intake drops the whole heartbeat and logs that line (once per node and generation).

* types: integers are JSON integers (``1e30`` and ``true`` are not steps), figures are finite
  and not negative (a validation loss may be anything: a diverged run reports inf or nan);
* ranges: every step in [0, ``train.steps``], every rank in [0, world size), the section one of
  ``SECTIONS``, the payload's ``node`` the node of the key it was written at;
* progress: within a generation each rank's step never goes back (``StepMemory``);
  a new generation starts afresh (a restart resumes from an older checkpoint).

Registration (``registration_problem``): a ``nodes/<node>`` value names its node and carries the
job's config hash; a node of another config is refused and never counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from megascale.messages import Heartbeat

SECTIONS = ("init", "step", "checkpoint")
"""The sections a heartbeat may report (the FSM keeps a count per section)."""


def _is_int(value: Any) -> bool:
    return type(value) is int


def _int_in(name: str, value: Any, low: int, high: int | None) -> str | None:
    if value is None:
        return None
    top = "" if high is None else f", {high}"
    if not _is_int(value) or value < low or (high is not None and value > high):
        return f"{name} = {value!r}: expected an integer in [{low}{top or ', ...'}]"
    return None


def _figure(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        return f"{name} = {value!r}: expected a finite number >= 0"
    return None


def _rank_key(name: str, key: Any, world: int) -> str | None:
    text = str(key)
    if not (text.isascii() and text.isdigit()) or int(text) >= world:
        return f"{name} key {key!r}: expected a rank in [0, {world - 1}]"
    return None


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p), None)


class StepMemory:
    """The last step each rank reported, per generation (what "never goes back" is
    checked against). ``remember`` only after a heartbeat was accepted."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}  # "rank:<r>" -> (generation, step)

    def clear(self) -> None:
        self._last.clear()

    def previous(self, key: str, generation: int) -> int | None:
        seen = self._last.get(key)
        return seen[1] if seen is not None and seen[0] == generation else None

    def remember(self, payload: Heartbeat) -> None:
        generation = payload.generation
        steps = {f"rank:{r}": f.step for r, f in payload.ranks.items()}
        for key, step in steps.items():
            seen = self._last.get(key)
            if step is not None and (seen is None or seen[0] <= generation):
                self._last[key] = (generation, step)


def heartbeat_problem(
    payload: Heartbeat, node: str, max_step: int | None, world: int, memory: StepMemory
) -> str | None:
    """The first thing wrong with ``payload`` (written at ``heartbeats/<node>``), in one line;
    None when the controller may believe it. ``max_step``: the job's ``train.steps`` (None: no
    upper bound known); ``world``: the configured world size (ranks are below it)."""
    p = payload
    problem = _first(
        [
            None if p.node == node else f"node = {p.node!r}: written at the key of {node!r}",
            _int_in("generation", p.generation, -1, None),
            _int_in("step", p.step, 0, max_step),
            None if p.section in SECTIONS else f"section = {p.section!r}: expected {SECTIONS}",
            _figure("time", p.time),
            *(
                _figure(name, getattr(p, name))
                for name in ("tokens_per_s", "mfu", "step_time_s", "compute_time_s")
            ),
            _int_in("checkpoint.step", p.checkpoint and p.checkpoint.step, 0, max_step),
            _figure("checkpoint.stall_s", p.checkpoint and p.checkpoint.stall_s),
            _int_in("durable.step", p.durable and p.durable.step, 0, max_step),
            _int_in("pid", p.pid, 0, None),
        ]
    )
    return problem or _ranks_problem(p, max_step, world) or _progress_problem(p, memory)


def _ranks_problem(p: Heartbeat, max_step: int | None, world: int) -> str | None:
    for name, keys in (("workers", p.workers), ("ranks", p.ranks), ("flight", p.flight)):
        problem = _first(_rank_key(name, key, world) for key in keys)
        if problem:
            return problem
    for key, worker in p.workers.items():
        problem = _first(
            [
                _int_in(f"workers[{key}].pid", worker.pid, 0, None),
                _int_in(f"workers[{key}].exit_code", worker.exit_code, -255, 255),
            ]
        )
        if problem:
            return problem
    for key, figures in p.ranks.items():
        problem = _first(
            [
                _int_in(f"ranks[{key}].step", figures.step, 0, max_step),
                _int_in(f"ranks[{key}].compute_step", figures.compute_step, 0, max_step),
                _int_in(f"ranks[{key}].stage", figures.stage, 0, world - 1),
                _figure(f"ranks[{key}].step_time_s", figures.step_time_s),
                _figure(f"ranks[{key}].compute_time_s", figures.compute_time_s),
                _figure(f"ranks[{key}].data_wait_s", figures.data_wait_s),
                *(
                    _figure(f"ranks[{key}].comm_time_s[{g}]", s)
                    for g, s in figures.comm_time_s.items()
                ),
            ]
        )
        if problem:
            return problem
    for name, items in (("error_events", p.error_events), ("notices", p.notices)):
        for item in items:
            problem = _first(
                [
                    _int_in(f"{name}.seq", item.seq, 0, None),
                    _int_in(f"{name}.rank", item.rank, 0, world - 1),
                    _int_in(f"{name}.generation", item.generation, 0, None),
                ]
            )
            if problem:
                return problem
    return None


def _progress_problem(p: Heartbeat, memory: StepMemory) -> str | None:
    # Per rank only: the node's ``step`` is the highest of the ranks it could read this beat, so
    # it may dip while one rank's progress file is being replaced; a rank's own never does.
    steps = {f"rank:{r}": (f"ranks[{r}].step", f.step) for r, f in p.ranks.items()}
    for key, (name, step) in steps.items():
        before = memory.previous(key, p.generation)
        if step is not None and before is not None and step < before:
            return (
                f"{name} = {step}: below the {before} reported before in generation "
                f"{p.generation} (progress never goes back within a generation)"
            )
    return None


def registration_problem(value: Any, node: str, config_hash: str | None) -> str | None:
    """Why the ``nodes/<node>`` value ``value`` must not be counted, in one line; None when it
    may. ``config_hash``: the job's (None: not checked)."""
    if not isinstance(value, Mapping):
        return f"its registration is not a JSON object ({type(value).__name__})"
    if value.get("node") != node:
        return f"its registration names node {value.get('node')!r}, written at {node!r}"
    if config_hash is None:
        return None
    theirs = value.get("config_hash")
    if theirs != config_hash:
        return (
            f"its config hash {theirs} is not the job's {config_hash}: an agent of another "
            "config is never counted (restart it with the job's config)"
        )
    return None
