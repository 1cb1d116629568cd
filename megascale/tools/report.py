"""``megascale report RUN_DIR``: one self-contained HTML page about a run.

What a person sees, top to bottom: a summary (layout, device, steps, loss, throughput, MFU, the
straggler verdict); training loss; throughput and MFU (on CPU the page says why MFU is absent);
the straggler heat map (rank x step, each cell the rank's compute time over its pipeline-stage
peers' median); slow machines; the step-time breakdown per rank (compute vs time blocked in DP,
PP, TP communication); memory per step (rank 0's host RSS, and its peak CUDA memory on a GPU);
faults and recoveries from ``RUN_DIR/events.jsonl`` on the run's time axis.

The figures are inline SVG drawn by ``report_charts``; the page loads nothing from the network and needs no
JavaScript. Inputs: ``metrics.jsonl`` (rank 0's per-step loss), ``timeline/`` (the straggler and
breakdown data, via ``megascale.tools.straggler``), ``events.jsonl`` (optional),
``config.toml``. A run without a timeline still gets its loss curve and events.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import statistics
from pathlib import Path
from string import Template

from megascale import config, runfiles
from megascale.controller.events import EVENTS_FILE, read_events
from megascale.messages import Event, StepMetrics, read_metrics
from megascale.tools import straggler
from megascale.tools.report_charts import (
    _BLUE,
    _GREEN,
    _GREY,
    _ORANGE,
    _RED,
    esc,
    heatmap,
    line_chart,
    stacked_bars,
)
from megascale.tools.timeline import breakdowns, load_run

logger = logging.getLogger(__name__)

TEMPLATE = Path(__file__).with_name("report.html")
_EVENT_COLOURS = {
    "fault": _RED,
    "failed": _RED,
    "node_lost": _RED,
    "evict": _ORANGE,
    "generation_start": _GREEN,
    "generation_running": _GREEN,
    "finished": _GREEN,
}


# --------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------


def _section(title: str, caption: str, content: str, ident: str) -> str:
    return (
        f'<section id="{ident}"><h2>{esc(title)}</h2><p class="caption">{esc(caption)}</p>'
        f"{content}</section>"
    )


def _card(key: str, value: str) -> str:
    return (
        f'<div class="card"><div class="k">{esc(key)}</div><div class="v">{esc(value)}</div></div>'
    )


def _verdict(report: straggler.StragglerReport | None) -> str:
    if report is None:
        return '<div class="note">No timeline in this run: straggler analysis unavailable.</div>'
    if report.flagged_ranks:
        items = "".join(f"<li>{esc(v.describe())}</li>" for v in report.flagged_ranks)
        nodes = ", ".join(f"{n.node} ({n.slowdown:.2f}x)" for n in report.flagged_nodes)
        return (
            f'<div class="verdict bad" id="straggler-verdict"><strong>Straggler detected'
            f"</strong> (threshold {report.threshold:.2f}x its pipeline-stage peers):"
            f"<ul>{items}</ul>Slow machine(s): <strong>{esc(nodes)}</strong></div>"
        )
    return (
        f'<div class="verdict" id="straggler-verdict"><strong>No straggler</strong>: every '
        f"rank is within {report.threshold:.2f}x of its pipeline-stage peers.</div>"
    )


def _loss_section(metrics: list[StepMetrics]) -> str:
    points = [(m.step, m.loss) for m in metrics]
    if not points:
        return _section("Training loss", "No metrics.jsonl in this run.", "", "loss")
    chart = line_chart(
        [("loss", _BLUE, points)],
        label="training loss per step",
        x_label="step",
        y_label="loss",
        y_format="{:.3f}",
        width=1020,
        height=260,
    )
    off = [f"{step} ({loss})" for step, loss in points if not math.isfinite(loss)]
    caption = "Mean cross-entropy per optimizer step (rank 0's metrics.jsonl)."
    if off:  # marked in red at the top of the chart, off its scale
        caption += f" Not finite at step {', '.join(off[:10])}{' ...' if len(off) > 10 else ''}."
    return _section("Training loss", caption, chart, "loss")


def _throughput_section(report: straggler.StragglerReport | None) -> str:
    if report is None or not report.mfu:
        return _section(
            "Throughput and MFU",
            "",
            '<div class="note">No timeline: throughput and MFU per step unavailable.</div>',
            "mfu",
        )
    tps = line_chart(
        [("tokens/s", _GREEN, [(m.step, m.tokens_per_s) for m in report.mfu])],
        label="throughput in tokens per second",
        x_label="step",
        y_label="tokens / s",
        y_format="{:,.0f}",
    )
    mfu_points = [(m.step, 100 * m.mfu) for m in report.mfu if m.mfu is not None]
    if mfu_points:
        mfu = line_chart(
            [("MFU", _ORANGE, mfu_points)],
            label="model FLOPs utilisation",
            x_label="step",
            y_label=f"MFU % of {report.peak}",
            y_format="{:.1f}",
        )
        note = f"MFU against {report.peak}, activation recomputation not counted."
    else:
        mfu = (
            f'<div class="note" id="mfu-absent"><strong>MFU not available:</strong> '
            f"{esc(report.mfu_note)}.</div>"
        )
        note = "MFU needs a peak: the GPU's dense bf16 peak, or the CPU peak the run measured."
    content = f'<div class="grid2"><div>{tps}</div><div>{mfu}</div></div>'
    return _section(
        "Throughput and model FLOPs utilisation (MFU)",
        f"Tokens per second per step (step period, median over ranks). {note}",
        content,
        "mfu",
    )


def _nodes_table(report: straggler.StragglerReport) -> str:
    rows = []
    for n in sorted(report.node_verdicts, key=lambda n: -n.slowdown):
        cls = ' class="flagged"' if n.flagged else ""
        flagged = ", ".join(str(r) for r in n.flagged_ranks) or "-"
        rows.append(
            f"<tr{cls}><td>{esc(n.node)}</td><td class=num>{n.slowdown:.2f}x</td>"
            f"<td>{esc(', '.join(str(r) for r in n.ranks))}</td><td>{esc(flagged)}</td>"
            f"<td>{'slow: report / evict' if n.flagged else 'ok'}</td></tr>"
        )
    return (
        "<table><tr><th>machine</th><th class=num>slowest rank vs peers</th><th>ranks</th>"
        f"<th>straggler ranks</th><th>verdict</th></tr>{''.join(rows)}</table>"
    )


def _breakdown_rows(run_ranks, report: straggler.StragglerReport) -> list:
    flagged = {v.rank for v in report.flagged_ranks}
    rows = []
    for r in run_ranks:
        bs = [b for s, b in breakdowns(r).items() if s in report.analysed_steps]
        if not bs:
            continue

        def mean(key: str, bs=bs) -> float:
            return statistics.fmean(getattr(b, key) for b in bs)

        groups = [mean(f"comm_{g}_s") for g in ("dp", "pp", "tp", "other")]
        wait = mean("comm_wait_s")
        scale = wait / sum(groups) if sum(groups) > 0 else 0.0
        values = [mean("compute_s"), *(g * scale for g in groups), mean("checkpoint_s")]
        rows.append((r.label(), values, r.rank in flagged))
    return rows


def _figures_section(metrics: list[StepMetrics]) -> str:
    """Rank 0's figures from metrics.jsonl (no timeline needed): mean step time and its parts,
    job-wide tokens/s and MFU, and the checkpoint stalls."""
    timed = [m for m in metrics if m.compute_time_s is not None]
    if not timed:
        return ""

    def mean(values: list[float]) -> str:
        return f"{1e3 * statistics.fmean(values):.1f} ms" if values else "-"

    groups = sorted({g for m in timed for g in m.comm_time_s})
    rows = [("step time", mean([m.step_time_s for m in timed]))]
    rows.append(("compute", mean([m.compute_time_s or 0.0 for m in timed])))
    rows += [
        (f"exposed comm {g}", mean([m.comm_time_s.get(g, 0.0) for m in timed])) for g in groups
    ]
    rows.append(("data wait", mean([m.data_wait_s for m in timed if m.data_wait_s is not None])))
    stalls = [m.checkpoint_stall_s for m in metrics if m.checkpoint_stall_s is not None]
    rows.append((f"checkpoint stall ({len(stalls)} saves)", mean(stalls)))
    rows.append(("tokens / s", f"{statistics.fmean(m.tokens_per_s for m in timed):,.0f}"))
    mfus = [m.mfu for m in timed if m.mfu is not None]
    rows.append(("MFU", f"{100 * statistics.fmean(mfus):.1f}%" if mfus else "n/a (no peak)"))
    body = "".join(f"<tr><td>{esc(k)}</td><td class=num>{esc(v)}</td></tr>" for k, v in rows)
    return _section(
        "Step figures (rank 0)",
        "Means over the steps of metrics.jsonl that report them: the step's compute, the "
        "communication it waited for by group, data wait, checkpoint stalls, throughput and MFU.",
        f'<table id="figures-table"><tr><th>figure</th><th class=num>mean</th></tr>{body}</table>',
        "figures",
    )


_MEMORY_SERIES = (
    ("host RSS", _BLUE, "mem_rss_gib"),
    ("CUDA reserved (peak)", _ORANGE, "mem_max_reserved_gib"),
    ("CUDA allocated (peak)", _GREEN, "mem_max_allocated_gib"),
)
"""The memory figures of ``metrics.jsonl`` the report draws: (legend, colour, field)."""


def _memory_section(metrics: list[StepMetrics]) -> str:
    """Rank 0's memory per step: host RSS at the step's end, and on CUDA the step's peak
    reserved and allocated memory (``probes.profiling``); a note when the run has none."""
    series = [
        (name, colour, [(m.step, getattr(m, key)) for m in metrics if getattr(m, key) is not None])
        for name, colour, key in _MEMORY_SERIES
    ]
    series = [s for s in series if s[2]]
    if not series:
        content = '<div class="note" id="memory-absent">No memory figures in metrics.jsonl.</div>'
    else:
        content = line_chart(
            series,
            label="memory per step",
            x_label="step",
            y_label="GiB",
            y_format="{:.2f}",
            width=1020,
            height=260,
        )
        peaks = "".join(
            f"<tr><td>{esc(name)}</td><td class=num>{max(y for _, y in points):.3f} GiB</td></tr>"
            for name, _c, points in series
        )
        content += (
            f'<table id="memory-table"><tr><th>figure</th><th class=num>highest</th></tr>'
            f"{peaks}</table>"
        )
    return _section(
        "Memory (rank 0)",
        "Host memory (RSS) of rank 0's process at each step's end, and on CUDA the step's peak "
        "memory reserved by the caching allocator and held by tensors (metrics.jsonl).",
        content,
        "memory",
    )


def _events_section(events: list[Event], metrics: list[StepMetrics]) -> str:
    title = "Faults and recoveries"
    if not events:
        return _section(
            title,
            "From the controller's events.jsonl.",
            '<div class="note" '
            'id="no-events">No faults or recoveries recorded in this run (no '
            "events.jsonl).</div>",
            "events",
        )
    timed = [m for m in metrics if m.time is not None]
    t0 = min([m.time - m.step_time_s for m in timed] + [e.time for e in events])
    series = [("step time", _BLUE, [(m.time - t0, m.step_time_s) for m in timed])]
    markers = []
    for e in events:
        where = e.node or (f"rank {e.rank}" if e.rank is not None else "")
        text = f"{e.kind}{' ' + str(where) if where else ''}"
        markers.append((e.time - t0, _EVENT_COLOURS.get(e.kind, _GREY), text))
    chart = line_chart(
        series,
        label="faults and recoveries over time",
        x_label="seconds since the run started",
        y_label="step time (s)",
        markers=markers,
        width=1020,
        height=280,
    )
    rows = "".join(
        f"<tr><td class=num>{e.time - t0:.1f}</td><td>{esc(e.kind)}</td>"
        f"<td class=num>{esc(e.generation)}</td><td>{esc(e.node or '')}</td>"
        f"<td class=num>{esc('' if e.rank is None else e.rank)}</td>"
        f"<td>{esc(e.detail)}</td></tr>"
        for e in events
    )
    table = (
        "<table><tr><th class=num>t (s)</th><th>kind</th><th class=num>generation</th>"
        f"<th>node</th><th class=num>rank</th><th>detail</th></tr>{rows}</table>"
    )
    return _section(
        title,
        "Step time on the run's time axis with every controller event "
        "(red: faults, orange: evictions, green: restarts and recovery).",
        chart + table,
        "events",
    )


def _read_metrics(path: Path) -> list[StepMetrics]:
    try:
        return read_metrics(path.read_text().splitlines())
    except FileNotFoundError:
        return []


def _configured_peak(run_dir: Path) -> float | None:
    """``train.peak_tflops`` of the run's ``config.toml`` (None: not set, or no config)."""
    try:
        return config.load(run_dir / "config.toml").train.peak_tflops
    except (OSError, config.ConfigError):
        return None


def build(run_dir: str | Path, peak_tflops: float | None = None) -> str:
    """The report's HTML for ``run_dir``."""
    run_dir = Path(run_dir)
    metrics = _read_metrics(run_dir / "metrics.jsonl")
    events = read_events(run_dir) if (run_dir / EVENTS_FILE).is_file() else []
    if peak_tflops is None:
        peak_tflops = _configured_peak(run_dir)
    try:
        run_ranks = load_run(run_dir)
        report = straggler.analyze_run(run_dir, peak_tflops=peak_tflops)
    except FileNotFoundError:
        run_ranks, report = [], None
    cards = [_card("steps", str(len(metrics)))]
    if run_ranks:
        lay = run_ranks[0].layout
        nodes = {r.node for r in run_ranks}
        cards.insert(0, _card("layout", f"TP{lay.tp} x PP{lay.pp} x DP{lay.dp}"))
        cards.append(_card("ranks / machines", f"{lay.world_size} / {len(nodes)}"))
        cards.append(_card("device", run_ranks[0].device_name))
    if metrics:
        cards.append(_card("final loss", f"{metrics[-1].loss:.4f}"))
    if report is not None and report.mfu:
        cards.append(
            _card(
                "median step time",
                f"{statistics.median(m.step_time_s for m in report.mfu) * 1e3:.0f} ms",
            )
        )
        mfus = [m.mfu for m in report.mfu if m.mfu is not None]
        cards.append(_card("MFU", f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a"))
    elif any(m.mfu is not None for m in metrics):
        mfus = [m.mfu for m in metrics if m.mfu is not None]
        cards.append(_card("MFU", f"{100 * statistics.median(mfus):.1f}%"))
    parts = [
        f'<section id="summary"><h2>Summary</h2><div class="cards">{"".join(cards)}</div>'
        f"{_verdict(report)}</section>",
        _loss_section(metrics),
        _throughput_section(report),
        _figures_section(metrics),
        _memory_section(metrics),
    ]
    if report is not None:
        parts.append(
            _section(
                "Straggler heat map",
                "Each cell: the rank's compute time in that step (step time minus time blocked in "
                "communication) over the median of its peers in the same pipeline stage. Red rows "
                "are persistently slow ranks.",
                heatmap(report) + _nodes_table(report),
                "heatmap",
            )
        )
        parts.append(
            _section(
                "Step-time breakdown",
                "Mean per step over the analysed steps: compute, and time blocked waiting in each kind "
                "of communication. A straggler computes longer; its peers wait for it.",
                stacked_bars(_breakdown_rows(run_ranks, report)),
                "breakdown",
            )
        )
    parts.append(_events_section(events, metrics))
    page = Template(TEMPLATE.read_text(encoding="utf-8"))
    return page.substitute(
        title=esc(f"megascale run report: {run_dir.name}"),
        subtitle=esc(str(run_dir.resolve())),
        body="\n".join(parts),
        generated=esc(datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")),
    )


def write(
    run_dir: str | Path, out: str | Path | None = None, peak_tflops: float | None = None
) -> Path:
    """Write the report (default ``RUN_DIR/report.html``) and return its path."""
    out = Path(out) if out is not None else Path(run_dir) / "report.html"
    runfiles.write_text(out, build(run_dir, peak_tflops))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale report RUN_DIR [--out report.html] [--peak-tflops P]``."""
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("--out", default=None, help="HTML file (default RUN_DIR/report.html)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak per GPU for MFU (default: from the GPU's name)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``megascale report``; 1 with a logged error when RUN_DIR is not a directory."""
    if not Path(args.run_dir).is_dir():
        logger.error("megascale report: %s is not a run directory", args.run_dir)
        return 1
    try:
        out = write(args.run_dir, args.out, args.peak_tflops)
    except ValueError as e:
        logger.error("megascale report: %s", e)
        return 1
    logger.info("report: %s", out)
    return 0
