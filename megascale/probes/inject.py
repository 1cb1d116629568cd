"""Deterministic fault injection for the local cluster (``megascale launch --inject SPEC``).

A spec is ``KIND:KEY=VALUE,KEY=VALUE`` (``corrupt-checkpoint:latest`` takes a bare word)::

    kill-worker:rank=3,step=20        the worker of global rank 3 SIGKILLs itself before step 20
    hang-worker:rank=5,step=30        ... SIGSTOPs itself before step 30 (an NCCL-style hang)
    hang-comm:rank=5,step=30          rank 5's communication stops completing at step 30 while its
                                      host goes on issuing until it blocks on a result (a dead NIC,
                                      a stuck NCCL kernel); with parallel.async_collectives the
                                      ops stay queued on its communication threads
    mismatch-comm:rank=5,step=30[,kind=size|op]
                                      rank 5's first collective of step 30 is issued with twice
                                      the size (or another op) than its group peers issue at the
                                      same sequence number, and hangs as NCCL's would
                                      (``megascale.probes.inject_comm``); a software bug: the
                                      controller evicts nobody for it
    slow-rank:rank=2,factor=1.5       rank 2's forward and backward compute takes factor x as long
    slow-node:node=1,factor=1.5       so does every rank that runs on node 1 (a slow machine: the
                                      ranks it gets in a later generation are slow too)
    kill-agent:node=1,step=25         the launcher SIGKILLs node 1's agent (its workers die with it)
    etcd-restart:step=40[,downtime=1] the launcher stops etcd for ``downtime`` s, then restarts it
    kill-controller:step=N            the launcher SIGKILLs the active controller (standby takes over)
    corrupt-checkpoint:latest[,rank=R] the newest complete checkpoint is corrupted after the
                                      workers of a fault were stopped, before the restart reads it
    fail-selfcheck:node=N             node N's agent fails every self-check (it is evicted)
    break-net:node=N                  node N's network is down for the self-check's neighbour
                                      all-reduce: it fails with every neighbour, they name it
    raise-error:step=N[,rank=R]       every rank (or rank R) raises the same error before step N,
                                      each time it gets there (an error that follows the job)
    disk-full:step=N                  from step N on, every checkpoint write fails with ENOSPC
                                      on every rank (a full shared disk), after restarts too
    pause-controller:step=N,seconds=S the launcher SIGSTOPs the active controller for S seconds
    forge-command:step=N              the launcher writes, with the job's etcd credentials, a
                                      ``stop`` command of generation 999999 to every node

Who fires what (``FaultSpec.side``): worker faults are carried to the workers in the environment
variable ``MEGASCALE_INJECT`` and fired by ``WorkerFaults``, called from ``run_rank``'s loop; agent
faults (``fail-selfcheck``, ``break-net``, ``corrupt-checkpoint``) by the agent when it runs a self-check, so the
corruption is on disk before any node acks and the next generation starts; launcher faults by
``megascale.launcher.cluster`` when the job reaches the step.

Exactly once: a fault keyed on a step fires the first time the job reaches it, never again after
a restart that replays the step. Whoever fires a fault first claims it by creating
``RUN_DIR/faults/<id>.json`` exclusively (``claim``), with the time it fired; detection-latency
measurements read those times back (``fired``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale import runfiles

logger = logging.getLogger(__name__)

ENV = "MEGASCALE_INJECT"
"""Environment variable carrying the worker-side specs (``;``-separated) to every worker."""
FAULTS_DIR = "faults"


class InjectError(ValueError):
    """A ``--inject`` spec is malformed or does not fit the job; the message says what to write."""


@dataclass(frozen=True)
class Kind:
    required: tuple[str, ...]
    optional: tuple[str, ...]
    side: str  # "worker" | "agent" | "launcher"
    help: str


KINDS: dict[str, Kind] = {
    "kill-worker": Kind(("rank", "step"), (), "worker", "SIGKILL a worker before a step"),
    "hang-worker": Kind(("rank", "step"), (), "worker", "SIGSTOP a worker before a step"),
    "hang-comm": Kind(("rank", "step"), (), "worker", "a rank's communication stops completing"),
    "mismatch-comm": Kind(("rank", "step"), ("kind",), "worker", "a rank's collective mismatches"),
    "slow-rank": Kind(("rank", "factor"), (), "worker", "a rank computes factor x as long"),
    "slow-node": Kind(("node", "factor"), (), "worker", "a node's ranks compute factor x as long"),
    "kill-agent": Kind(("node", "step"), (), "launcher", "SIGKILL a node's agent and workers"),
    "etcd-restart": Kind(("step",), ("downtime",), "launcher", "stop and restart etcd"),
    "kill-controller": Kind(("step",), (), "launcher", "SIGKILL the active controller"),
    "corrupt-checkpoint": Kind(("latest",), ("rank",), "agent", "corrupt the newest checkpoint"),
    "fail-selfcheck": Kind(("node",), (), "agent", "a node fails its self-checks"),
    "break-net": Kind(("node",), (), "agent", "a node's neighbour all-reduces fail"),
    "raise-error": Kind(("step",), ("rank",), "worker", "ranks raise an error at a step, always"),
    "disk-full": Kind(("step",), (), "worker", "checkpoint writes fail with ENOSPC from a step"),
    "pause-controller": Kind(("step", "seconds"), (), "launcher", "SIGSTOP the controller"),
    "forge-command": Kind(("step",), (), "launcher", "write a forged stop command"),
}
_INT_KEYS = ("rank", "step", "node")
_FLOAT_KEYS = {"factor": (1.0, 100.0), "downtime": (0.0, 60.0), "seconds": (0.0, 600.0)}
"""key -> the closed range accepted. ``factor``: a rank 100x slower is a hung one (hang-worker);
``downtime``: the launcher blocks while etcd is down, and gives up on an etcd that stays away for
60 s; ``seconds``: a controller paused longer outlives every lease it would lose."""
_WORD_KEYS = {"kind": ("size", "op")}  # key -> the words accepted


def accepted() -> str:
    """Every kind with an example, for error messages and ``--help``."""
    return "; ".join(f"{name}:{_example(name)}" for name in KINDS)


@dataclass(frozen=True)
class FaultSpec:
    """One parsed ``--inject`` spec."""

    kind: str
    params: Mapping[str, Any] = field(default_factory=dict)
    text: str = ""

    @property
    def id(self) -> str:
        """A file-name-safe id, stable across restarts (the marker's name)."""
        keys = ",".join(f"{k}={self.params[k]}" for k in sorted(self.params))
        return f"{self.kind}_{keys}".replace("=", "-").replace(",", "_").replace(".", "p")

    @property
    def side(self) -> str:
        return KINDS[self.kind].side

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)


def parse(text: str) -> FaultSpec:
    """Parse one spec; InjectError names the bad part and lists what is accepted."""
    kind_name, sep, rest = text.strip().partition(":")
    if kind_name not in KINDS:
        raise InjectError(
            f"--inject {text!r}: unknown fault kind {kind_name!r}; accepted: {accepted()}"
        )
    kind = KINDS[kind_name]
    if not sep or not rest.strip():
        raise InjectError(f"--inject {text!r}: {kind_name} needs {_needs(kind_name)}")
    params: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq and key == "latest" and "latest" in kind.required:
            params["latest"] = True
            continue
        if key not in kind.required + kind.optional or not eq:
            raise InjectError(
                f"--inject {text!r}: {item.strip()!r} is not a key of {kind_name} "
                f"(it takes {_needs(kind_name)})"
            )
        if key in params:
            raise InjectError(f"--inject {text!r}: {key} is given twice")
        params[key] = _value(text, key, value)
    missing = [k for k in kind.required if k not in params]
    if missing:
        raise InjectError(f"--inject {text!r}: missing {', '.join(missing)}; {_needs(kind_name)}")
    return FaultSpec(kind_name, params, text.strip())


def _needs(kind_name: str) -> str:
    kind = KINDS[kind_name]
    keys = ["latest" if k == "latest" else f"{k}=N" for k in kind.required]
    keys += [f"optional {k}={'|'.join(_WORD_KEYS.get(k, ('N',)))}" for k in kind.optional]
    return f"{', '.join(keys)} (e.g. {kind_name}:{_example(kind_name)})"


def _example(kind_name: str) -> str:
    return {
        "kill-worker": "rank=1,step=12",
        "hang-worker": "rank=1,step=12",
        "hang-comm": "rank=1,step=12",
        "mismatch-comm": "rank=1,step=12,kind=op",
        "slow-rank": "rank=1,factor=1.5",
        "slow-node": "node=1,factor=1.5",
        "kill-agent": "node=1,step=12",
        "etcd-restart": "step=12,downtime=1",
        "kill-controller": "step=12",
        "corrupt-checkpoint": "latest,rank=0",
        "fail-selfcheck": "node=1",
        "break-net": "node=1",
        "raise-error": "step=12",
        "disk-full": "step=8",
        "pause-controller": "step=6,seconds=8",
        "forge-command": "step=6",
    }[kind_name]


def _value(text: str, key: str, value: str) -> Any:
    if key in _WORD_KEYS:
        if value not in _WORD_KEYS[key]:
            words = " or ".join(_WORD_KEYS[key])
            raise InjectError(f"--inject {text!r}: {key}={value!r} must be {words}")
        return value
    if key in _INT_KEYS:
        if not (value.isascii() and value.isdigit() and len(value) <= 9):
            raise InjectError(
                f"--inject {text!r}: {key}={value!r} must be an integer in [0, 999999999]"
            )
        number = int(value)
        if key == "step" and number < 1:
            raise InjectError(f"--inject {text!r}: step={value} must be >= 1")
        return number
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    low, high = _FLOAT_KEYS[key]
    if not low <= number <= high:  # NaN and inf fail too
        raise InjectError(
            f"--inject {text!r}: {key}={value!r} must be a number in [{low:g}, {high:g}]"
        )
    return number


def check_fits(specs: Iterable[FaultSpec], *, nodes: int, world_size: int, steps: int) -> None:
    """Refuse specs that name a rank, node or step this job does not have (``nodes`` counts
    spares), or a checkpoint corruption with nothing that would make the job restart."""
    specs = list(specs)
    for spec in specs:
        for key, limit, what in (
            ("rank", world_size, f"the job's {world_size} ranks"),
            ("node", nodes, f"the {nodes} nodes (spares included)"),
        ):
            value = spec.get(key)
            if value is not None and value >= limit:
                raise InjectError(f"--inject {spec.text!r}: {key}={value} is not one of {what}")
        step = spec.get("step")
        if step is not None and step > steps:
            raise InjectError(
                f"--inject {spec.text!r}: step={step} is after the last step ({steps})"
            )
    restarting = {"kill-worker", "hang-worker", "hang-comm", "mismatch-comm", "kill-agent"}
    if any(s.kind == "corrupt-checkpoint" for s in specs) and not any(
        s.kind in restarting for s in specs
    ):
        raise InjectError(
            "--inject corrupt-checkpoint:latest corrupts the checkpoint a restart reads: add a "
            f"fault that makes the job restart ({', '.join(sorted(restarting))})"
        )


# -- exactly once --------------------------------------------------------------------------------


def claim(run_dir: str | Path, spec: FaultSpec, **detail: Any) -> bool:
    """Record that ``spec`` fires now; False if it already fired (in this or an earlier
    generation), in which case the caller must not fire it."""
    directory = Path(run_dir) / FAULTS_DIR
    runfiles.make_dir(directory)  # O_EXCL below never follows a link at the name itself
    record = {"id": spec.id, "spec": spec.text, "kind": spec.kind, "time": time.time(), **detail}
    try:
        fd = os.open(directory / f"{spec.id}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    logger.warning("injecting fault %s (%s)", spec.text, detail)
    return True


def fired(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every fault that fired in this run, oldest first."""
    directory = Path(run_dir) / FAULTS_DIR
    records = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being written
    return sorted(records, key=lambda r: r.get("time", 0.0))


# -- the worker side ----------------------------------------------------------------------------


def to_env(specs: Iterable[FaultSpec]) -> str:
    """The ``MEGASCALE_INJECT`` value carrying the worker-side specs."""
    return ";".join(s.text for s in specs if s.side == "worker")


def from_env(value: str | None = None) -> list[FaultSpec]:
    text = os.environ.get(ENV, "") if value is None else value
    return [parse(item) for item in text.split(";") if item.strip()]


class WorkerFaults:
    """The worker-side faults of one rank; a null object when none applies (the default).

    ``run_rank`` calls ``before_step(n)`` before computing step n and hands ``slow`` (the
    compute slowdown factor, 1 for none) to the trainer's ``ComputeMeter.stretch``, which sleeps
    inside each forward and backward compute span. Built by ``worker_faults``.
    """

    def __init__(
        self, specs: Iterable[FaultSpec], rank: int, run_dir: Path, node: str | None = None
    ) -> None:
        self.rank, self.run_dir = rank, Path(run_dir)
        self.specs = [s for s in specs if s.side == "worker" and _targets(s, rank, node)]
        slow = [s.get("factor") for s in self.specs if s.kind in ("slow-rank", "slow-node")]
        self.slow = max(slow, default=1)
        full = [s.get("step") for s in self.specs if s.kind == "disk-full"]
        if full:
            _fill_disk_from(min(full))

    def before_step(self, step: int) -> None:
        for spec in self.specs:
            if spec.kind == "raise-error" and spec.get("step") == step:
                claim(self.run_dir, spec, rank=self.rank, step=step)  # the first time: its time
                raise RuntimeError(
                    f"injected fault {spec.text}: rank {self.rank} cannot read its data at step "
                    f"{step} (the data file is unreadable)"
                )
            if spec.get("step") != step or spec.kind not in _STEP_FAULTS:
                continue
            if not claim(self.run_dir, spec, rank=self.rank, step=step, pid=os.getpid()):
                continue
            for handler in logging.getLogger().handlers:
                handler.flush()
            if spec.kind == "hang-comm":
                _halt_communication()
                continue
            if spec.kind == "mismatch-comm":
                from megascale.probes import inject_comm  # torch: the worker side only

                inject_comm.arm(spec.get("kind", "size"))
                continue
            sig = signal.SIGKILL if spec.kind == "kill-worker" else signal.SIGSTOP
            os.kill(os.getpid(), sig)


_STEP_FAULTS = ("kill-worker", "hang-worker", "hang-comm", "mismatch-comm")


def _halt_communication() -> None:
    """Stop this process's communication for good. In the blocking gloo mode the NCCL-like
    engine is stood in front of torch.distributed first, so the next collective is queued and
    never runs (the flight recorder, now under it, sees no further op)."""
    from megascale.parallel import async_comm  # the worker has torch; the agent never gets here

    async_comm.install().halt()


def _targets(spec: FaultSpec, rank: int, node: str | None) -> bool:
    """Whether a worker-side ``spec`` is for this rank: by node for ``slow-node``, every rank
    for ``disk-full`` and a ``raise-error`` without a rank, else by rank."""
    if spec.kind == "slow-node":
        return f"node-{spec.get('node')}" == node
    if spec.kind == "disk-full" or (spec.kind == "raise-error" and spec.get("rank") is None):
        return True
    return spec.get("rank") == rank


def _fill_disk_from(first_step: int) -> None:
    """Make every checkpoint write of step ``first_step`` or later fail as a full disk does."""
    import errno

    from megascale.train.checkpoint import save as checkpoint

    def hook(point: str, rank: int, step: int) -> None:
        if point == "stage2_start" and step >= first_step:
            where = checkpoint.step_name(step)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{where}/rank_{rank:05d}")

    checkpoint.fault_hook = hook


def worker_faults(rank: int, run_dir: str | Path) -> WorkerFaults:
    """This rank's faults from ``MEGASCALE_INJECT`` (none when unset); ``slow-node`` by the node
    the agent named in ``MEGASCALE_NODE``."""
    return WorkerFaults(from_env(), rank, Path(run_dir), os.environ.get("MEGASCALE_NODE"))


# -- the agent side ------------------------------------------------------------------------------


def corrupt_latest_checkpoint(
    run_dir: Path, config: str | None, overrides: tuple[str, ...], spec: FaultSpec
) -> str | None:
    """The ``corrupt-checkpoint`` fault: flip bytes in the middle of one file of the newest
    complete checkpoint (rank ``spec.rank``'s file, default rank 0), keeping its size, so that only
    its checksum gives it away. Once per run; None when there is no checkpoint yet."""
    from megascale.config import load
    from megascale.train.checkpoint.paths import CheckpointPathError, resolve_file
    from megascale.train.checkpoint.storage import MANIFEST, Storage, location, step_name

    job = load(config, list(overrides))
    storage = Storage(location(job.checkpoint, run_dir))
    steps = storage.complete_steps()
    if not steps:
        return None
    directory = Path(storage.path(step_name(steps[-1])))
    manifest = json.loads((directory / MANIFEST).read_text())
    names = sorted(manifest["files"])
    rank = int(spec.get("rank", 0))
    mine = (f"rank_{rank:05d}/__0_0.distcp", f"rank_{rank:05d}.pt")  # DCP data; the older format
    name = next((n for n in names if n in mine), names[0])
    try:
        target = Path(resolve_file(directory, name))  # never a file outside the checkpoint
    except CheckpointPathError as e:
        logger.warning("fault %s not injected: %s", spec.text, e)
        return None
    if not claim(run_dir, spec, checkpoint=str(directory), file=name):
        return None
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    target.write_bytes(bytes(data))
    logger.warning("corrupted %s (fault %s)", target, spec.text)
    return str(target)
