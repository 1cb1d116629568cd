"""Straggler and MFU analysis of a run's timeline: which ranks and machines are slow, and the MFU.

The model is the live controller's (``megascale.controller.stragglers``, one module for both): the
measure is each rank's *compute time* per step, its forward and backward compute as the device saw
it (``megascale.tools.timeline.Breakdown.device_compute_s``, from the same megatron-core
timers as the live ``ComputeMeter``), and a rank's *slowdown* in a step is that over the median of
the other ranks of its pipeline stage (``stage_scores``: the ranks that do the same work; a rank
alone in its stage is not scored). A rank is flagged when it is persistently slow: its median
slowdown over the analysed steps is at least the threshold *and* it is at least that slow in half
of them. A machine (node) is as slow as its slowest rank (the job runs at its pace) and is
flagged when one of its ranks is. MegaScale found hosts ~10% slow this way; the threshold defaults
to ``fault_tolerance.straggler_threshold`` (1.10).

MFU per step comes from ``megascale.probes.flops`` (training FLOPs per token without
recomputation) over the step period (median over ranks), against the dense bf16 peak of the GPU
the run used (its name is in the timeline) or an explicit ``peak_tflops``; on CPU the peak the run
measured and recorded in ``metrics.jsonl`` (``mfu_peak_tflops``, ``mfu_peak_source``); with none of
these MFU is absent, with ``mfu_note`` saying why.

``StragglerReport`` is what the controller acts on (``flagged_nodes``: report, or evict when
configured); ``analyze`` is pure and unit-tested, ``analyze_run`` reads a run directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.config import FaultToleranceConfig
from megascale.controller.stragglers import stage_scores
from megascale.parallel.layout import Coord, Layout
from megascale.probes import flops
from megascale.tools.timeline import breakdowns, load_run

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = FaultToleranceConfig.straggler_threshold


@dataclass(frozen=True)
class RankVerdict:
    """One rank over the analysed steps."""

    rank: int
    node: str
    coords: Coord
    slowdown: float
    """Median over the analysed steps of compute time / median of the stage peers' (1.0 = even)."""
    slow_steps: int
    """Analysed steps in which the slowdown was at least the threshold."""
    steps: int
    """Steps analysed (steps where the rank and at least one peer have a compute time)."""
    flagged: bool

    def describe(self) -> str:
        c = self.coords
        return (
            f"rank {self.rank} (dp={c.dp}, pp={c.pp}, tp={c.tp}) on {self.node}: "
            f"{self.slowdown:.2f}x its pipeline-stage peers "
            f"(slow in {self.slow_steps} of {self.steps} steps)"
        )


@dataclass(frozen=True)
class NodeVerdict:
    """One machine: as slow as its slowest rank."""

    node: str
    slowdown: float
    ranks: tuple[int, ...]
    flagged_ranks: tuple[int, ...]
    flagged: bool


@dataclass(frozen=True)
class StepMFU:
    step: int
    step_time_s: float
    """The step's period (start to next start), median over ranks."""
    tokens_per_s: float
    mfu: float | None
    """A fraction of the peak; None without a peak (CPU)."""


@dataclass
class StragglerReport:
    """The analysis of one run. ``compute_s`` and ``slowdown`` are the heat map (rank x step)."""

    threshold: float
    ranks: list[int]
    steps: list[int]
    analysed_steps: list[int]
    """The steps the verdicts use (the first ``warmup_steps`` are left out when there are more)."""
    labels: dict[int, str]
    compute_s: dict[int, dict[int, float]]
    slowdown: dict[int, dict[int, float]]
    rank_verdicts: list[RankVerdict]
    node_verdicts: list[NodeVerdict]
    mfu: list[StepMFU] = field(default_factory=list)
    peak: str | None = None
    """Which peak MFU is computed against (name and TFLOP/s), or None."""
    mfu_note: str = ""

    @property
    def flagged_ranks(self) -> list[RankVerdict]:
        return sorted(
            (v for v in self.rank_verdicts if v.flagged), key=lambda v: v.slowdown, reverse=True
        )

    @property
    def flagged_nodes(self) -> list[NodeVerdict]:
        return sorted(
            (v for v in self.node_verdicts if v.flagged), key=lambda v: v.slowdown, reverse=True
        )

    def describe(self) -> list[str]:
        """Lines a person reads: the verdict, then MFU."""
        lines = []
        if self.flagged_ranks:
            lines.append(f"stragglers (>= {self.threshold:.2f}x their pipeline-stage peers):")
            lines += [f"  {v.describe()}" for v in self.flagged_ranks]
            nodes = ", ".join(f"{n.node} ({n.slowdown:.2f}x)" for n in self.flagged_nodes)
            lines.append(f"slow machines: {nodes}")
        else:
            worst = max(self.rank_verdicts, key=lambda v: v.slowdown, default=None)
            tail = f"; slowest: {worst.describe()}" if worst else ""
            lines.append(f"no straggler at {self.threshold:.2f}x{tail}")
        values = [m.mfu for m in self.mfu if m.mfu is not None]
        if values:
            lines.append(f"MFU: median {100 * statistics.median(values):.1f}% ({self.peak})")
        else:
            lines.append(f"MFU: not computed: {self.mfu_note}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stage_peers(layout: Layout, rank: int) -> list[int]:
    """The other ranks of ``rank``'s pipeline stage (none when it is alone there)."""
    pp = layout.coords(rank).pp
    peers = [layout.rank(dp=d, pp=pp, tp=t) for d in range(layout.dp) for t in range(layout.tp)]
    return [p for p in peers if p != rank]


def analyze(
    compute_s: Mapping[int, Mapping[int, float]],
    layout: Layout,
    nodes: Mapping[int, str],
    threshold: float = DEFAULT_THRESHOLD,
    *,
    warmup_steps: int = 1,
    labels: Mapping[int, str] | None = None,
) -> StragglerReport:
    """Find the persistently slow ranks and machines from per-rank, per-step compute times.

    ``compute_s[rank][step]`` in seconds (missing entries are skipped); ``nodes[rank]`` the
    machine's name. The first ``warmup_steps`` steps are left out of the verdicts when more steps
    remain (allocation and first-call costs are not the machine's fault).
    """
    if not threshold > 1.0:
        raise ValueError(f"threshold = {threshold}: must be > 1 (e.g. 1.1 for 10% slower)")
    ranks = sorted(compute_s)
    steps = sorted({s for r in ranks for s in compute_s[r]})
    analysed = steps[warmup_steps:] if len(steps) > warmup_steps else steps
    slowdown: dict[int, dict[int, float]] = {r: {} for r in ranks}
    stage = {r: layout.coords(r).pp for r in ranks}
    for s in steps:
        for r, score in stage_scores({r: compute_s[r].get(s) for r in ranks}, stage).items():
            slowdown[r][s] = score
    verdicts = []
    for r in ranks:
        values = [slowdown[r][s] for s in analysed if s in slowdown[r]]
        median = statistics.median(values) if values else 1.0
        slow = sum(v >= threshold for v in values)
        flagged = bool(values) and median >= threshold and 2 * slow >= len(values)
        verdicts.append(
            RankVerdict(r, nodes.get(r, "?"), layout.coords(r), median, slow, len(values), flagged)
        )
    by_node: dict[str, list[RankVerdict]] = {}
    for v in verdicts:
        by_node.setdefault(v.node, []).append(v)
    node_verdicts = [
        NodeVerdict(
            node=node,
            slowdown=max(v.slowdown for v in vs),
            ranks=tuple(v.rank for v in vs),
            flagged_ranks=tuple(v.rank for v in vs if v.flagged),
            flagged=any(v.flagged for v in vs),
        )
        for node, vs in sorted(by_node.items())
    ]
    return StragglerReport(
        threshold=threshold,
        ranks=ranks,
        steps=steps,
        analysed_steps=analysed,
        labels=dict(labels) if labels else {r: layout.describe(r) for r in ranks},
        compute_s={r: dict(compute_s[r]) for r in ranks},
        slowdown=slowdown,
        rank_verdicts=verdicts,
        node_verdicts=node_verdicts,
    )


def step_mfu(
    periods: Mapping[int, list[float]],
    tokens_per_step: int,
    flops_per_token: float,
    n_gpus: int,
    peak_tflops: float | None,
) -> list[StepMFU]:
    """Per step: the median period over ranks, tokens/s, and MFU against ``peak_tflops``."""
    out = []
    for step in sorted(periods):
        t = statistics.median(periods[step])
        tps = tokens_per_step / t if t > 0 else 0.0
        value = flops.mfu(tps, n_gpus, flops_per_token, peak_tflops) if peak_tflops else None
        out.append(StepMFU(step, t, tps, value))
    return out


def analyze_run(
    run_dir: str | Path, threshold: float | None = None, peak_tflops: float | None = None
) -> StragglerReport:
    """``analyze`` on a run directory's timeline, with MFU per step.

    ``threshold``: None reads ``fault_tolerance.straggler_threshold`` from ``RUN_DIR/config.toml``
    (1.10 without one). ``peak_tflops`` overrides the peak looked up from the GPU's name.
    """
    from megascale import config as config_mod

    run_dir = Path(run_dir)
    job = None
    if (run_dir / "config.toml").is_file():
        job = config_mod.load(run_dir / "config.toml")
    if threshold is None:
        threshold = job.fault_tolerance.straggler_threshold if job else DEFAULT_THRESHOLD
    ranks = load_run(run_dir)
    per_rank = {r.rank: breakdowns(r) for r in ranks}
    report = analyze(
        {r: {s: b.device_compute_s for s, b in steps.items()} for r, steps in per_rank.items()},
        ranks[0].layout,
        {r.rank: r.node for r in ranks},
        threshold,
        labels={r.rank: r.label() for r in ranks},
    )
    periods: dict[int, list[float]] = {}
    for steps in per_rank.values():
        for s, b in steps.items():
            periods.setdefault(s, []).append(b.period_s)
    recorded = recorded_peak(run_dir)
    peak, report.peak, report.mfu_note = _peak(ranks[0].device_name, peak_tflops, recorded)
    if job is None:
        report.mfu_note = f"no config.toml in {run_dir}: tokens per step unknown"
        return report
    tokens = job.train.global_batch_size * job.model.seq_length
    per_token = flops.flops_per_token(job.model).total
    report.mfu = step_mfu(periods, tokens, per_token, ranks[0].layout.world_size, peak)
    return report


def recorded_peak(run_dir: str | Path) -> tuple[float, str] | None:
    """(TFLOP/s, source) of the peak the run's MFU used, from the first line of
    ``metrics.jsonl`` that names one; None when the run recorded none."""
    try:
        with open(Path(run_dir) / "metrics.jsonl") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("mfu_peak_tflops"):
                    return float(record["mfu_peak_tflops"]), str(record.get("mfu_peak_source"))
    except OSError:
        return None
    return None


def _peak(
    device_name: str, peak_tflops: float | None, recorded: tuple[float, str] | None = None
) -> tuple[float | None, str | None, str]:
    """(TFLOP/s, how it is named, why there is none)."""
    if peak_tflops is not None:
        value, source = flops.resolve_peak(peak_tflops, None)
        return value, source, ""
    if recorded is not None and device_name in ("cpu", "?", ""):
        return recorded[0], f"{recorded[0]:.4g} TFLOP/s {recorded[1]} (recorded by the run)", ""
    if device_name in ("cpu", "?", ""):
        return (
            None,
            None,
            "the run was on CPU, which has no dense bf16 peak (pass a peak to compare)",
        )
    try:
        key, value = flops.lookup_peak(device_name)
    except ValueError:
        return None, None, f"no dense bf16 peak known for {device_name!r} (pass one)"
    return value, f"{key} dense bf16 {value:g} TFLOP/s", ""
