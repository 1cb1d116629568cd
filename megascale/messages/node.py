"""The message rules (``Message``, ``declare``, ``decoded``) and what a node writes: its ranks'
progress, the agent's heartbeat and acks, rank 0's metrics line. ``megascale.messages`` re-exports
them with the job-level messages (``messages.job``); producers and consumers import them from there.

==================  ===========================================  =================================
message             producer -> consumers                        where it travels
==================  ===========================================  =================================
``RankProgress``    worker (``probes.progress``) -> agent    ``RUN_DIR/progress/rank_N.json``
``Heartbeat``       agent -> controller, agent exporter          etcd ``heartbeats/<node>``
``StepMetrics``     rank 0 (``train.run``) -> report, launcher   a line of ``metrics.jsonl``
``Ack``             agent -> controller                          etcd ``acks/<node>``
==================  ===========================================  =================================

The job-level messages (commands, the controller's ``state``/``status``/``summary``/``generation``
/``blocklist`` values, events, ``final.json``) are in ``megascale.messages.job``.

Each is a slotted dataclass: producing a field it does not declare is a ``TypeError`` and reading
one an ``AttributeError``, wherever it happens. ``encode()`` gives the JSON-ready dict, headed by
``"schema": "MAJOR.MINOR"`` (``SCHEMA``); ``decode()`` is the one reader and raises
``MessageError`` (one line: the message, the field or version, what is accepted) for

* a missing or unreadable schema version, or another major version: agents and controller of
  different majors must not talk (a rolling upgrade changes the minor only);
* a field the type does not declare, unless the writer's minor is newer than this reader's (a
  newer writer may add fields): then the fields are logged once per type and ignored;
* a required field missing.

Figures and their one meaning at every hop (the dashboards, the report and the status read these):

* per rank and step: ``step_time_s`` (wall time of the step), ``compute_time_s`` (forward and
  backward compute of step ``compute_step``, measured on the device; ``stage`` is the rank's
  pipeline stage, the straggler model's peer group), ``comm_time_s`` (exposed communication,
  i.e. time blocked in it, by group ``dp``/``pp``/``tp``/``other``, same period), ``data_wait_s``
  (time reading the step's batches), ``mem_rss_gib`` (the process's resident host memory at the
  step's end) and, on CUDA only, ``mem_max_allocated_gib``/``mem_max_reserved_gib`` (the step's
  peak CUDA memory held by tensors / reserved by the caching allocator), all in GiB (2**30 bytes);
* per save: ``CheckpointFigures``: ``stall_s`` (training blocked, stage 1) and ``durable_s``
  (from the save's start until its files were written; None while in flight);
* per job: ``tokens_per_s`` and ``mfu`` are job-wide (global batch / rank 0's step time), as
  in ``metrics.jsonl``: only the heartbeat of the node running rank 0 carries them (others, spares
  included, carry None), so no hop sums or averages them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgspec

logger = logging.getLogger("megascale.messages")  # the name users configure

SCHEMA = (1, 3)
"""(major, minor) of this module's messages: a new field bumps the minor, a changed meaning or a
removed field the major."""
SCHEMA_KEY = "schema"
COMM_GROUPS = ("dp", "pp", "tp", "other")
"""The groups exposed communication is reported by."""


class MessageError(ValueError):
    """A message that this version cannot read; the text names the message and the problem."""


_JSON = (
    msgspec.json.Decoder()
)  # parses JSON ~3x faster than json.loads (benchmarks/heartbeat_cost.py)


M = TypeVar("M", bound="Message")

_warned: set[tuple[str, frozenset[str]]] = set()


class Message:
    """Base of the typed messages. Subclasses are ``@dataclass(slots=True)``; ``NESTED`` names
    the fields that hold other messages: ``{field: (type, "one" | "map" | "list")}``; a nested
    message has no nested messages itself (``declare`` checks)."""

    __slots__ = ()
    NESTED: ClassVar[dict[str, tuple[type, str]]] = {}
    OMIT_NONE: ClassVar[tuple[str, ...]] = ()
    """Fields left out of ``encode`` while None (figures of some steps only)."""
    _names: ClassVar[frozenset[str]]
    _order: ClassVar[tuple[str, ...]]
    _required: ClassVar[frozenset[str]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._names = cls._required = frozenset()  # set by _declare once the dataclass exists
        cls._order = ()

    @classmethod
    def _declare(cls) -> None:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        cls._order = tuple(f.name for f in fields)
        cls._names = frozenset(cls._order)
        cls._required = frozenset(
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    # -- writing -------------------------------------------------------------------------------

    def encode(self) -> dict[str, Any]:
        """The JSON-ready dict, headed by the schema version."""
        return {SCHEMA_KEY: f"{SCHEMA[0]}.{SCHEMA[1]}", **self._body()}

    def _body(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self._order}
        for name in self.OMIT_NONE:
            if out[name] is None:
                del out[name]
        for name, (_, how) in self.NESTED.items():
            value = out[name]
            if value is None:
                continue
            if how == "one":
                out[name] = value._body()
            elif how == "map":
                out[name] = {k: v._body() for k, v in value.items()}
            else:
                out[name] = [v._body() for v in value]
        return out

    # -- reading -------------------------------------------------------------------------------

    @classmethod
    def decode(cls, data: Mapping[str, Any]):
        """The message in ``data`` (as ``encode`` wrote it); ``MessageError`` if unreadable."""
        if not isinstance(data, Mapping):
            raise MessageError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        minor = _check_version(cls.__name__, data.get(SCHEMA_KEY))
        return cls._from(data, minor, skip=(SCHEMA_KEY,))

    @classmethod
    def from_json(cls, raw: bytes | str):
        """``decode`` of a JSON text (an etcd value, a file's content)."""
        try:
            data = _JSON.decode(raw)
        except msgspec.DecodeError as e:
            raise MessageError(f"{cls.__name__}: not JSON ({e})") from None
        return cls.decode(data)

    @classmethod
    def _from(cls, data: Mapping[str, Any], minor: int, skip: tuple[str, ...] = ()):
        """The fast path (the controller decodes every heartbeat): build directly; on any
        mismatch ``_checked`` says what is wrong (or reads a newer minor's record)."""
        try:
            if not skip and not cls.NESTED:
                return cls(**data)
            kwargs = dict(data)
            for key in skip:
                del kwargs[key]
            for name, (kind, how) in cls.NESTED.items():
                value = kwargs.get(name)
                if value is None:
                    continue
                if how == "one":
                    kwargs[name] = kind(**value)  # nested records are flat
                elif how == "map":
                    kwargs[name] = {k: kind(**v) for k, v in value.items()}
                else:
                    kwargs[name] = [kind(**v) for v in value]
            return cls(**kwargs)
        except (TypeError, AttributeError):
            return cls._checked(data, minor, skip)

    @classmethod
    def _checked(cls, data: Mapping[str, Any], minor: int, skip: tuple[str, ...]):
        names = cls._names
        unknown = [k for k in data if k not in names and k not in skip]
        if unknown:
            _unknown(cls.__name__, unknown, minor)
        missing = cls._required.difference(data)
        if missing:
            raise MessageError(
                f"{cls.__name__}: field(s) {', '.join(sorted(missing))} missing; required: "
                f"{', '.join(sorted(cls._required))}"
            )
        kwargs = {k: v for k, v in data.items() if k in names}
        for name, (kind, how) in cls.NESTED.items():
            value = kwargs.get(name)
            if value is None:
                continue
            try:
                if how == "one":
                    kwargs[name] = kind._from(value, minor)
                elif how == "map":
                    kwargs[name] = {str(k): kind._from(v, minor) for k, v in value.items()}
                else:
                    kwargs[name] = [kind._from(v, minor) for v in value]
            except (AttributeError, TypeError) as e:
                raise MessageError(f"{cls.__name__}.{name}: malformed ({e})") from None
        return cls(**kwargs)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The fields this type declares (the contract test compares them with what is used)."""
        return cls._names


def _check_version(kind: str, version: Any) -> int:
    """The writer's minor version; ``MessageError`` for a missing, malformed or other major."""
    try:
        major, minor = (int(x) for x in str(version).split("."))
    except ValueError:
        raise MessageError(
            f"{kind}: schema = {version!r}: expected 'MAJOR.MINOR' (this reader: "
            f"{SCHEMA[0]}.{SCHEMA[1]}); was it written by a megascale without typed messages?"
        ) from None
    if major != SCHEMA[0]:
        raise MessageError(
            f"{kind}: schema = {version!r}: major version {major} cannot be read by this megascale "
            f"(reads major {SCHEMA[0]}); run agents, workers and controller of one release"
        )
    return minor


def _unknown(kind: str, names: list[str], minor: int) -> None:
    if minor <= SCHEMA[1]:
        raise MessageError(
            f"{kind}: undeclared field(s) {', '.join(sorted(names))} (schema minor {minor} <= "
            f"this reader's {SCHEMA[1]}: a producer wrote fields its type does not declare)"
        )
    key = (kind, frozenset(names))
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "%s: fields %s of a newer schema minor (%d > %d) are not read by this megascale",
            kind,
            ", ".join(sorted(names)),
            minor,
            SCHEMA[1],
        )


def declare(cls):
    """Class decorator: a slotted dataclass registered as a message (after ``@dataclass``)."""
    cls = dataclass(slots=True)(cls)
    cls._declare()
    if any(kind.NESTED for kind, _ in cls.NESTED.values()):
        raise TypeError(f"{cls.__name__}: a nested message must be flat (the fast decode path)")
    return cls


# -- the worker's progress record ------------------------------------------------------------------


@declare
class CheckpointFigures(Message):
    """One checkpoint save of a rank: ``stall_s`` training was blocked (stage 1, the wait for
    the previous save included), ``durable_s`` from the save's start until its files were written
    (None while the write is in flight)."""

    step: int
    stall_s: float
    durable_s: float | None = None


@declare
class DurableCheckpoint(Message):
    """The newest checkpoint a rank saved completely (its manifest written): the step, the wall
    time it became durable and where it is. Rank 0 reports it (it writes the manifest)."""

    step: int
    time: float
    url: str


@declare
class RankProgress(Message):
    """``RUN_DIR/progress/rank_NNNNN.json``: what a worker tells its agent (``probes.progress``
    documents the sections and clocks). The figures are the last completed step's."""

    rank: int
    pid: int
    section: str = ""
    section_started: float = 0.0
    section_started_mono: float = 0.0
    step: int = 0
    heartbeat: float = 0.0
    heartbeat_mono: float = 0.0
    durations: dict[str, float] = field(default_factory=dict)
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    compute_time_s: float | None = None
    compute_step: int | None = None
    stage: int | None = None
    comm_time_s: dict[str, float] = field(default_factory=dict)
    data_wait_s: float | None = None
    val_loss: float | None = None
    checkpoint: CheckpointFigures | None = None
    mfu_peak: str | None = None
    """The peak ``mfu`` is against, in words (``probes.peak.peak_label``)."""
    durable: DurableCheckpoint | None = None
    mem_rss_gib: float | None = None
    mem_max_allocated_gib: float | None = None
    """None off CUDA, as ``mem_max_reserved_gib``."""
    mem_max_reserved_gib: float | None = None
    NESTED: ClassVar = {
        "checkpoint": (CheckpointFigures, "one"),
        "durable": (DurableCheckpoint, "one"),
    }


# -- the heartbeat ---------------------------------------------------------------------------------


@declare
class WorkerStatus(Message):
    """One worker process as its agent sees it; ``fatal`` is the reason a rank gave for a
    job-fatal exit (``probes.fatal``), None otherwise; ``peer``: its output says a peer
    failed (its own exit is then a symptom)."""

    pid: int
    alive: bool
    exit_code: int | None = None
    peer: bool = False
    fatal: str | None = None
    error: dict[str, str] | None = None
    """The uncaught exception of another failed exit (``{"text", "signature"}``), None for a
    device error or a clean exit (the controller's failure classification reads it)."""


@declare
class RankFigures(Message):
    """One rank's last completed step, as the heartbeat carries it (see the module docstring)."""

    step: int | None = None
    step_time_s: float | None = None
    compute_time_s: float | None = None
    comm_time_s: dict[str, float] = field(default_factory=dict)
    data_wait_s: float | None = None
    compute_step: int | None = None
    stage: int | None = None
    mem_rss_gib: float | None = None
    mem_max_allocated_gib: float | None = None
    """None off CUDA, as ``mem_max_reserved_gib``."""
    mem_max_reserved_gib: float | None = None


@declare
class Reported(Message):
    """An error keyword or notice found in a worker's output, numbered by ``seq`` per agent."""

    seq: int
    rank: int
    kind: str
    text: str
    generation: int = 0
    secondary: bool = False


@declare
class Heartbeat(Message):
    """``heartbeats/<node>``: an agent's report, every heartbeat interval.

    ``step``: highest completed step of its ranks; ``section``: "init" | "step" | "checkpoint";
    ``step_time_s``/``compute_time_s``: its slowest rank's; ``tokens_per_s``/``mfu``: job-wide,
    rank 0's figure, on rank 0's node only (None elsewhere), ``mfu_peak`` with them;
    ``checkpoint``: its ranks' latest save (largest stall); ``durable``: the newest checkpoint
    its ranks saved completely (rank 0's node);
    ``flight``: rank -> the flight recorder's last record (``flight.format.RankState``);
    ``errors``: human-readable forms of ``error_events``; static: host, addr, pid, hardware;
    live: gpus (NVML; None without), network counters, selfchecks (how many ran).
    """

    node: str
    time: float = 0.0
    generation: int = -1
    step: int | None = None
    section: str = "step"
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    compute_time_s: float | None = None
    val_loss: float | None = None
    checkpoint: CheckpointFigures | None = None
    mfu_peak: str | None = None
    durable: DurableCheckpoint | None = None
    workers: dict[str, WorkerStatus] = field(default_factory=dict)
    ranks: dict[str, RankFigures] = field(default_factory=dict)
    flight: dict[str, dict] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    error_events: list[Reported] = field(default_factory=list)
    notices: list[Reported] = field(default_factory=list)
    host: str = ""
    addr: str = ""
    pid: int = 0
    hardware: dict[str, Any] = field(default_factory=dict)
    gpus: list | None = None
    network: dict[str, dict] = field(default_factory=dict)
    selfchecks: int = 0
    NESTED: ClassVar = {
        "checkpoint": (CheckpointFigures, "one"),
        "durable": (DurableCheckpoint, "one"),
        "workers": (WorkerStatus, "map"),
        "ranks": (RankFigures, "map"),
        "error_events": (Reported, "list"),
        "notices": (Reported, "list"),
    }


# -- commands' acks and the metrics line -----------------------------------------------------------


@declare
class Ack(Message):
    """``acks/<node>``: the agent finished command ``id`` (``ok``; ``detail`` says why not)."""

    id: str
    generation: int
    kind: str
    ok: bool = True
    detail: str = ""
    suspects: list[str] = field(default_factory=list)
    """``selfcheck``: the neighbours the node failed the all-reduce with while it passed with
    another (``controller.neighbours.suspected``)."""


@declare
class StepMetrics(Message):
    """What one optimizer step reports (rank 0's view); one line of ``metrics.jsonl``.

    ``tokens_per_s``/``mfu`` are job-wide; ``mfu`` is None when no peak is known. The timing
    figures are rank 0's (see the module docstring); ``checkpoint_stall_s`` is set on a step
    that ended with a save; ``time`` is the wall clock when the line was written. ``val_loss``
    and ``checkpoint_stall_s`` are absent from the line on the other steps, the ``mem_max_*``
    figures off CUDA."""

    OMIT_NONE: ClassVar = (
        "val_loss", "checkpoint_stall_s", "mem_rss_gib", "mem_max_allocated_gib",
        "mem_max_reserved_gib",
    )  # fmt: skip

    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None = None
    mfu_peak_tflops: float | None = None
    """The per-device peak ``mfu`` divides by (``probes.peak``)."""
    mfu_peak_source: str | None = None
    """Where that peak came from: ``train.peak_tflops``, ``gpu:<name> dense bf16`` or
    ``measured:cpu <dtype>`` (a matmul benchmark on this machine)."""
    val_loss: float | None = None
    """Validation loss after this step; None on steps without evaluation."""
    data_wait_s: float | None = None
    compute_time_s: float | None = None
    comm_time_s: dict[str, float] = field(default_factory=dict)
    checkpoint_stall_s: float | None = None
    mem_max_allocated_gib: float | None = None
    """Rank 0's peak CUDA memory held by tensors during this step, GiB (2**30 bytes): the peak
    statistics are reset at the step's start (``probes.profiling``). None off CUDA."""
    mem_max_reserved_gib: float | None = None
    """The same for memory the caching allocator reserved from the device (what an OOM runs
    out of)."""
    mem_rss_gib: float | None = None
    """Rank 0's resident host memory (RSS) at the step's end, GiB, on every device: the RSS
    when the step finished, not a peak within it (``probes.profiling.rss_gib``)."""
    time: float | None = None


def decoded(kind: type[M], value: Any) -> M | None:
    """``kind`` decoded from an etcd value (anything with ``json()``: a key-value, a watch
    event); None when ``value`` is None or is not a readable ``kind`` (logged: a reader keeps
    going past one bad value, e.g. a command a newer-major controller wrote)."""
    if value is None:
        return None
    try:
        return kind.decode(value.json())
    except ValueError as e:  # MessageError, or not JSON
        logger.error("ignoring %s value: %s", kind.__name__, e)
        return None


def read_metrics(lines: Iterable[str]) -> list[StepMetrics]:
    """The records of ``metrics.jsonl`` lines, oldest first. A torn line (a crash mid-write) is
    skipped; a line without a schema (written before messages were versioned, the same fields)
    reads as 1.0; a line of another major raises ``MessageError``."""
    out = []
    for line in lines:
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and SCHEMA_KEY not in data:
            data = {SCHEMA_KEY: "1.0", **data}
        out.append(StepMetrics.decode(data))
    return out
