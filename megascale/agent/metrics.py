"""Prometheus metrics of a megascale job: every metric defined once (``METRICS``), two exporters.

``AgentMetrics`` runs in each node agent, ``ControllerMetrics`` in the controller; each owns its
registry (several may live in one process) and serves it with ``serve(port, addr="127.0.0.1")``.
The dashboards (``megascale.tools.dashboards``) query exactly these names.

Labels: ``megascale_job`` (the job id: *not* ``job``, which Prometheus reserves for the scrape
job and would rename to ``exported_job``), ``node`` (agent node name), ``rank`` (global rank),
``group`` (communication group: ``dp``, ``pp``, ``tp``, or ``all``), ``kind`` (fault kind).

==========================================  =========  ==========================  ==========
metric                                      type       labels (+ megascale_job)    exporter
==========================================  =========  ==========================  ==========
megascale_step                              gauge      node, rank                  agent
megascale_step_time_seconds                 gauge      node, rank                  agent
megascale_compute_time_seconds              gauge      node, rank                  agent
megascale_data_wait_seconds                 gauge      node, rank                  agent
megascale_comm_time_seconds                 gauge      node, rank, group           agent
megascale_memory_rss_bytes                  gauge      node, rank                  agent
megascale_memory_max_allocated_bytes        gauge      node, rank                  agent
megascale_memory_max_reserved_bytes         gauge      node, rank                  agent
megascale_tokens_per_second                 gauge      node                        agent
megascale_mfu_ratio                         gauge      node                        agent
megascale_validation_loss                   gauge      node                        agent
megascale_checkpoint_stall_seconds          histogram  node                        agent
megascale_checkpoint_stall_last_seconds     gauge      node                        agent
megascale_checkpoint_durable_seconds        gauge      node                        agent
megascale_heartbeats_sent_total             counter    node                        agent
megascale_heartbeats_total                  counter    node                        controller
megascale_straggler_score                   gauge      node, rank                  controller
megascale_faults_total                      counter    kind                        controller
megascale_stall_culprit_total               counter    rank, reason                controller
megascale_restarts_total                    counter    --                          controller
megascale_generation                        gauge      --                          controller
megascale_effective_training_time_ratio     gauge      --                          controller
megascale_productive_seconds                gauge      --                          controller
megascale_job_step                          gauge      --                          controller
megascale_job_tokens_per_second             gauge      --                          controller
megascale_job_mfu_ratio                     gauge      --                          controller
megascale_job_last_checkpoint_step          gauge      --                          controller
==========================================  =========  ==========================  ==========

Two sources, one meaning each: the ``megascale_job_*`` series are the controller's job summary
(``messages.JobSummaryRecord``, written with decisions or every ``snapshot_s``): one series per job
whatever the number of nodes, read by the dashboards' job-level stat panels; the agents' series are
per node and rank, read by the over-time and per-rank panels. No panel mixes the two.

Meanings: step/compute/comm times are the last completed step's, per rank (compute = forward +
backward + optimizer kernels; comm = communication time *not* hidden behind compute, per group).
Tokens/s and MFU are job-wide figures (global batch / step time) exported once: by the agent of
the node running rank 0 (``messages.Heartbeat``), the figure of ``metrics.jsonl``; dashboards
aggregate with ``avg`` so that a series left by a previous rank-0 node does not add up. The straggler score of a rank is its
step (or compute) time over the median of its peers (1.0 = median, 1.1 = 10% slow).
Memory, per rank, in bytes (from the GiB of the progress record, so to about 1 MiB): the resident
host memory at the last step's end (every device), and that step's peak CUDA memory held by
tensors and reserved by the caching allocator (CUDA only: no series on CPU).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from megascale.messages import Heartbeat, JobSummaryRecord

logger = logging.getLogger(__name__)

JOB_LABEL = "megascale_job"
FAULT_KINDS = (
    "node_lost",
    "worker_exit",
    "error_keyword",
    "stall",
    "start_failed",
    "heartbeat_timeout",
)
"""The controller's ``Fault.kind`` values; pre-set to 0 so that ``increase()`` sees the first."""
GIB = 2**30
MEMORY_GAUGES = (
    "megascale_memory_rss_bytes",
    "megascale_memory_max_allocated_bytes",
    "megascale_memory_max_reserved_bytes",
)
"""The per-rank memory gauges (``AgentMetrics.set_memory``)."""
CUDA_ONLY = frozenset(MEMORY_GAUGES[1:])
"""Metrics that have no series on CPU (a dashboard query of them is empty there)."""
STALL_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its Prometheus name (as queried), type, help, and labels besides the job's."""

    name: str
    type: type
    help: str
    labels: tuple[str, ...] = ()
    exporter: str = "agent"

    def __post_init__(self) -> None:
        if "job" in self.labels or JOB_LABEL in self.labels:
            raise ValueError(f"metric {self.name}: labels {self.labels} must not name 'job'")

    def create(self, registry: CollectorRegistry) -> Any:
        """The prometheus-client metric in ``registry``, labelled ``megascale_job`` first."""
        name = self.name.removesuffix("_total") if self.type is Counter else self.name
        kwargs: dict[str, Any] = {"registry": registry}
        if self.type is Histogram:
            kwargs["buckets"] = STALL_BUCKETS
        return self.type(name, self.help, (JOB_LABEL, *self.labels), **kwargs)


METRICS: dict[str, MetricSpec] = {
    s.name: s
    for s in (
        MetricSpec("megascale_step", Gauge, "Last completed training step.", ("node", "rank")),
        MetricSpec(
            "megascale_step_time_seconds",
            Gauge,
            "Wall time of the last completed step.",
            ("node", "rank"),
        ),
        MetricSpec(
            "megascale_compute_time_seconds",
            Gauge,
            "Compute time (forward, backward, optimizer) of the last step.",
            ("node", "rank"),
        ),
        MetricSpec(
            "megascale_data_wait_seconds",
            Gauge,
            "Time the last step waited for its batches.",
            ("node", "rank"),
        ),
        MetricSpec(
            "megascale_comm_time_seconds",
            Gauge,
            "Communication time not overlapped with compute in the last step, by group.",
            ("node", "rank", "group"),
        ),
        MetricSpec(
            "megascale_memory_rss_bytes",
            Gauge,
            "Resident host memory of the rank's process at the end of its last step.",
            ("node", "rank"),
        ),
        MetricSpec(
            "megascale_memory_max_allocated_bytes",
            Gauge,
            "Peak CUDA memory held by tensors during the rank's last step (CUDA only).",
            ("node", "rank"),
        ),
        MetricSpec(
            "megascale_memory_max_reserved_bytes",
            Gauge,
            "Peak CUDA memory reserved by the caching allocator during the rank's last step "
            "(CUDA only).",
            ("node", "rank"),
        ),
        MetricSpec(
            "megascale_tokens_per_second",
            Gauge,
            "Job-wide training throughput (rank 0's, exported by its node only).",
            ("node",),
        ),
        MetricSpec(
            "megascale_mfu_ratio",
            Gauge,
            "Model FLOPs utilisation (0-1) of the job (rank 0's, exported by its node only).",
            ("node",),
        ),
        MetricSpec(
            "megascale_validation_loss",
            Gauge,
            "The last validation loss (train.eval_interval) this node's ranks computed.",
            ("node",),
        ),
        MetricSpec(
            "megascale_checkpoint_stall_seconds",
            Histogram,
            "Time training was blocked by a checkpoint save.",
            ("node",),
        ),
        MetricSpec(
            "megascale_checkpoint_stall_last_seconds",
            Gauge,
            "Training time blocked by the last checkpoint save.",
            ("node",),
        ),
        MetricSpec(
            "megascale_checkpoint_durable_seconds",
            Gauge,
            "From the start of the last finished save until its files were written.",
            ("node",),
        ),
        MetricSpec(
            "megascale_heartbeats_sent_total", Counter, "Heartbeats this agent sent.", ("node",)
        ),
        MetricSpec(
            "megascale_heartbeats_total",
            Counter,
            "Heartbeats the controller received, by node.",
            ("node",),
            "controller",
        ),
        MetricSpec(
            "megascale_straggler_score",
            Gauge,
            "Step time of a rank over the median of its peers (1.0 = median).",
            ("node", "rank"),
            "controller",
        ),
        MetricSpec(
            "megascale_faults_total", Counter, "Faults detected, by kind.", ("kind",), "controller"
        ),
        MetricSpec(
            "megascale_stall_culprit_total",
            Counter,
            "Ranks named as holding up a stall, by rank and reason (not-entered, not-started, "
            "stopped, mismatch, waiting).",
            ("rank", "reason"),
            "controller",
        ),
        MetricSpec("megascale_restarts_total", Counter, "Job restarts.", (), "controller"),
        MetricSpec("megascale_generation", Gauge, "Current generation.", (), "controller"),
        MetricSpec(
            "megascale_effective_training_time_ratio",
            Gauge,
            "Productive training time over wall time since the job started (0-1).",
            (),
            "controller",
        ),
        MetricSpec(
            "megascale_productive_seconds",
            Gauge,
            "Wall time spent in steps whose progress was kept.",
            (),
            "controller",
        ),
        MetricSpec(
            "megascale_job_step",
            Gauge,
            "The job's highest completed step (the controller's summary).",
            (),
            "controller",
        ),
        MetricSpec(
            "megascale_job_tokens_per_second",
            Gauge,
            "Job-wide training throughput, rank 0's figure (the controller's summary).",
            (),
            "controller",
        ),
        MetricSpec(
            "megascale_job_mfu_ratio",
            Gauge,
            "Job-wide model FLOPs utilisation (0-1), rank 0's (the controller's summary).",
            (),
            "controller",
        ),
        MetricSpec(
            "megascale_job_last_checkpoint_step",
            Gauge,
            "Step of the newest checkpoint saved completely (the controller's summary).",
            (),
            "controller",
        ),
    )
}
"""Every metric of the job, by the name PromQL uses."""


class MetricsServer:
    """An HTTP ``/metrics`` endpoint of one registry; ``close()`` stops it."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str) -> None:
        self._server, self._thread = start_http_server(port, addr, registry)
        self.addr = addr
        self.port = self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _Exporter:
    exporter = ""

    def __init__(self, job: str) -> None:
        self.job = job
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._m = {
            name: spec.create(self.registry)
            for name, spec in METRICS.items()
            if spec.exporter == self.exporter
        }

    def _metric(self, name: str, **labels: object) -> Any:
        return self._m[name].labels(
            **{JOB_LABEL: self.job}, **{k: str(v) for k, v in labels.items()}
        )

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve ``/metrics`` on ``addr:port`` (port 0: a free one, see ``.port``) in a thread.

        Loopback by default: pass the pod IP or ``0.0.0.0`` to let a Prometheus elsewhere scrape.
        """
        server = MetricsServer(self.registry, port, addr)
        logger.info("%s metrics of job %s at %s", self.exporter, self.job, server.url)
        return server


def _num(value: Any) -> float | None:
    return None if value is None or isinstance(value, bool) else float(value)


class AgentMetrics(_Exporter):
    """The node agent's metrics (one instance per agent). Thread-safe."""

    exporter = "agent"

    def __init__(self, job: str, node: str) -> None:
        super().__init__(job)
        self.node = node
        self._ranks: set[str] = set()
        self._groups: dict[str, set[str]] = {}
        self._saved_step: int | None = None  # the save whose stall was observed last

    def set_step(
        self,
        rank: int,
        step: int,
        step_time_s: float | None = None,
        compute_time_s: float | None = None,
        comm_time_s: float | Mapping[str, float] | None = None,
        data_wait_s: float | None = None,
    ) -> None:
        """One rank's last completed step and its timings (``comm_time_s`` by group or total)."""
        r, n = str(rank), self.node
        with self._lock:
            self._ranks.add(r)
            self._metric("megascale_step", node=n, rank=r).set(step)
            if step_time_s is not None:
                self._metric("megascale_step_time_seconds", node=n, rank=r).set(step_time_s)
            if compute_time_s is not None:
                self._metric("megascale_compute_time_seconds", node=n, rank=r).set(compute_time_s)
            if data_wait_s is not None:
                self._metric("megascale_data_wait_seconds", node=n, rank=r).set(data_wait_s)
            if comm_time_s is not None:
                by_group = comm_time_s if isinstance(comm_time_s, Mapping) else {"all": comm_time_s}
                for group, seconds in by_group.items():
                    self._groups.setdefault(r, set()).add(group)
                    self._metric("megascale_comm_time_seconds", node=n, rank=r, group=group).set(
                        seconds
                    )

    def set_memory(
        self,
        rank: int,
        rss_gib: float | None,
        max_allocated_gib: float | None = None,
        max_reserved_gib: float | None = None,
    ) -> None:
        """One rank's memory at its last step, in GiB as the progress record has it (exported
        in bytes); a figure that is None (CUDA's, off CUDA) leaves its gauge unset."""
        r, n = str(rank), self.node
        with self._lock:
            for name, gib in zip(
                MEMORY_GAUGES, (rss_gib, max_allocated_gib, max_reserved_gib), strict=True
            ):
                if gib is not None:
                    self._metric(name, node=n, rank=r).set(gib * GIB)

    def set_throughput(self, tokens_per_s: float | None, mfu: float | None = None) -> None:
        """The job-wide tokens/s and MFU (a fraction) as this node's ranks computed them."""
        with self._lock:
            if tokens_per_s is not None:
                self._metric("megascale_tokens_per_second", node=self.node).set(tokens_per_s)
            if mfu is not None:
                self._metric("megascale_mfu_ratio", node=self.node).set(mfu)

    def set_validation_loss(self, loss: float) -> None:
        """The last validation loss (``train.eval_interval``) this node's ranks computed."""
        with self._lock:
            self._metric("megascale_validation_loss", node=self.node).set(loss)

    def observe_checkpoint_stall(self, seconds: float) -> None:
        """One checkpoint save blocked training for ``seconds``."""
        with self._lock:
            self._metric("megascale_checkpoint_stall_seconds", node=self.node).observe(seconds)
            self._metric("megascale_checkpoint_stall_last_seconds", node=self.node).set(seconds)

    def observe_heartbeat(self, payload: Heartbeat) -> None:
        """Export what a heartbeat (``messages.Heartbeat``) carries; call once per heartbeat the
        agent sends. Job-wide figures (tokens/s, MFU) are set when the node has ranks (a spare
        exports none); a save's stall is observed once per saved step; ranks that are no longer
        this node's are removed."""
        self._metric("megascale_heartbeats_sent_total", node=self.node).inc()
        self.set_throughput(payload.tokens_per_s, payload.mfu)
        if payload.ranks and "0" not in payload.ranks:  # rank 0 runs elsewhere now
            with self._lock:
                for name in ("megascale_tokens_per_second", "megascale_mfu_ratio"):
                    try:
                        self._m[name].remove(self.job, self.node)
                    except KeyError:
                        pass
        if payload.val_loss is not None:
            self.set_validation_loss(payload.val_loss)
        save = payload.checkpoint
        if save is not None and save.step != self._saved_step:
            self._saved_step = save.step
            self.observe_checkpoint_stall(save.stall_s)
        if save is not None and save.durable_s is not None:
            with self._lock:
                self._metric("megascale_checkpoint_durable_seconds", node=self.node).set(
                    save.durable_s
                )
        for rank in self._ranks - set(payload.ranks):
            self.remove_rank(int(rank))
        for rank, info in payload.ranks.items():
            if info.step is None:
                continue
            self.set_step(
                int(rank),
                info.step,
                info.step_time_s,
                info.compute_time_s,
                info.comm_time_s or None,
                info.data_wait_s,
            )
            self.set_memory(
                int(rank), info.mem_rss_gib, info.mem_max_allocated_gib, info.mem_max_reserved_gib
            )

    def remove_rank(self, rank: int) -> None:
        """Forget a rank that left this node (its series disappear from the next scrape)."""
        r, n = str(rank), self.node
        with self._lock:
            self._ranks.discard(r)
            for name in (
                "megascale_step",
                "megascale_step_time_seconds",
                "megascale_compute_time_seconds",
                "megascale_data_wait_seconds",
                *MEMORY_GAUGES,
            ):
                try:
                    self._m[name].remove(self.job, n, r)
                except KeyError:
                    pass
            for group in self._groups.pop(r, set()):
                self._m["megascale_comm_time_seconds"].remove(self.job, n, r, group)


class ControllerMetrics(_Exporter):
    """The controller's metrics (one per controller process). Thread-safe."""

    exporter = "controller"

    def __init__(self, job: str) -> None:
        super().__init__(job)
        self._scored: set[tuple[str, str]] = set()
        for kind in FAULT_KINDS:
            self._metric("megascale_faults_total", kind=kind)
        self._metric("megascale_restarts_total")

    def observe_heartbeat(self, node: str, payload: Heartbeat | None = None) -> None:
        """A heartbeat from ``node`` arrived (its job figures reach the agent's exporter)."""
        self._metric("megascale_heartbeats_total", node=node).inc()

    def record_fault(self, kind: str) -> None:
        """The controller detected a fault of ``kind`` (``Fault.kind``)."""
        self._metric("megascale_faults_total", kind=kind).inc()

    def record_stall_culprit(self, rank: int, reason: str) -> None:
        """The stall analysis named ``rank`` for ``reason`` (``flight.culprits.Culprit.reason``)."""
        self._metric("megascale_stall_culprit_total", rank=rank, reason=reason).inc()

    def record_restart(self, generation: int | None = None) -> None:
        """The job restarted (a new generation started after a fault)."""
        self._metric("megascale_restarts_total").inc()
        if generation is not None:
            self.set_generation(generation)

    def set_generation(self, generation: int) -> None:
        self._metric("megascale_generation").set(generation)

    def set_straggler_scores(self, scores: Mapping[tuple[str, int], float]) -> None:
        """Scores by (node, rank); ranks absent from ``scores`` are removed."""
        with self._lock:
            current = {(node, str(rank)): s for (node, rank), s in scores.items()}
            for node, rank in self._scored - current.keys():
                self._m["megascale_straggler_score"].remove(self.job, node, rank)
            for (node, rank), score in current.items():
                self._metric("megascale_straggler_score", node=node, rank=rank).set(score)
            self._scored = set(current)

    def set_effective_training_time(self, productive_s: float, wall_s: float) -> None:
        """Productive time (steps whose progress was kept) and wall time since the job began.
        The ratio is set first, so that it is never behind a productive time already set; a
        scrape collects the ratio before the productive time, though, so one that overlaps this
        call may still pair the old ratio with the new time (a reader needing both checks both)."""
        if wall_s > 0:
            self._metric("megascale_effective_training_time_ratio").set(productive_s / wall_s)
        self._metric("megascale_productive_seconds").set(productive_s)

    def set_job_summary(self, summary: JobSummaryRecord) -> None:
        """The job's figures as the controller publishes them (``summary`` key); a figure not
        known yet (None) leaves its gauge unset."""
        figures = {
            "megascale_job_step": summary.step,
            "megascale_job_tokens_per_second": summary.tokens_per_s,
            "megascale_job_mfu_ratio": summary.mfu,
            "megascale_job_last_checkpoint_step": None
            if summary.last_checkpoint is None
            else summary.last_checkpoint.step,
        }
        for name, value in figures.items():
            if value is not None:
                self._metric(name).set(value)


def metric_names(exporter: str | None = None) -> Iterable[str]:
    """The names in ``METRICS`` (of one exporter if given), plus histogram series suffixes."""
    for spec in METRICS.values():
        if exporter is None or spec.exporter == exporter:
            yield spec.name
            if spec.type is Histogram:
                yield from (spec.name + s for s in ("_bucket", "_sum", "_count"))
