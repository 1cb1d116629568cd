"""``megascale report RUN_DIR``: one self-contained HTML page about a run.

What a person sees, top to bottom: a summary (layout, device, steps, loss, throughput, MFU, the
straggler verdict); training loss; throughput and MFU (on CPU the page says why MFU is absent);
the straggler heat map (rank x step, each cell the rank's compute time over its pipeline-stage
peers' median); slow machines; the step-time breakdown per rank (compute vs time blocked in DP,
PP, TP communication); faults and recoveries from ``RUN_DIR/events.jsonl`` on the run's time axis.

The figures are inline SVG drawn here; the page loads nothing from the network and needs no
JavaScript. Inputs: ``metrics.jsonl`` (rank 0's per-step loss), ``timeline/`` (the straggler and
breakdown data, via ``megascale.diagnostics.straggler``), ``events.jsonl`` (optional),
``config.toml``. A run without a timeline still gets its loss curve and events.
"""

from __future__ import annotations

import argparse
import datetime
import html
import logging
import math
import statistics
from pathlib import Path
from string import Template
from typing import Any

from megascale import config
from megascale.diagnostics import straggler
from megascale.diagnostics.timeline import breakdowns, load_run
from megascale.messages import Event, StepMetrics, read_metrics
from megascale.robustness.events import EVENTS_FILE, read_events

logger = logging.getLogger(__name__)

TEMPLATE = Path(__file__).with_name("report.html")
_BLUE, _ORANGE, _RED, _GREEN, _GREY = "#1f77b4", "#f28e2b", "#c62828", "#2e7d32", "#8d99a6"
_BREAKDOWN = (  # (label, colour) of the stacked step-time bars
    ("compute", "#4e79a7"),
    ("blocked in DP comm", "#f28e2b"),
    ("blocked in PP comm", "#e15759"),
    ("blocked in TP comm", "#76b7b2"),
    ("blocked in other comm", "#bab0ac"),
    ("checkpoint", "#59a14f"),
)
_EVENT_COLOURS = {
    "fault": _RED,
    "failed": _RED,
    "node_lost": _RED,
    "evict": _ORANGE,
    "generation_start": _GREEN,
    "generation_running": _GREEN,
    "finished": _GREEN,
}


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


# --------------------------------------------------------------------------------------------------
# SVG figures
# --------------------------------------------------------------------------------------------------


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values, the first <= lo and the last >= hi."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def line_chart(
    series: list[tuple[str, str, list[tuple[float, float]]]],
    *,
    label: str,
    x_label: str,
    y_label: str,
    y_format: str = "{:.3g}",
    markers: list[tuple[float, str, str]] = (),
    width: int = 520,
    height: int = 250,
) -> str:
    """An SVG line chart: ``series`` of (name, colour, points); ``markers`` vertical lines at x
    (x, colour, text). The figure's accessible name is ``label``."""
    left, right, top, bottom = 64, 14, 16, 42
    lanes = _label_lanes(markers, width - left - right)
    top += 13 * (max(lanes, default=-1) + 1)  # marker labels sit in lanes above the plot
    xs = [x for _n, _c, pts in series for x, _ in pts] + [m[0] for m in markers]
    ys = [y for _n, _c, pts in series for _, y in pts]
    x_ticks = nice_ticks(min(xs, default=0), max(xs, default=1))
    y_ticks = nice_ticks(min(ys, default=0), max(ys, default=1))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * pw

    def py(y: float) -> float:
        return top + ph - (y - y0) / ((y1 - y0) or 1) * ph

    out = [_svg_open(width, height, label)]
    for t in y_ticks:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
            'stroke="#e4e7eb"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end" '
            f'font-size="11">{esc(y_format.format(t))}</text>'
        )
    for t in x_ticks:
        out.append(
            f'<text x="{px(t):.1f}" y="{top + ph + 16}" text-anchor="middle" '
            f'font-size="11">{esc(f"{t:g}")}</text>'
        )
    out.append(
        f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="#9aa5b1"/>'
    )
    out.append(
        f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" '
        f'font-size="12">{esc(x_label)}</text>'
    )
    out.append(
        f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" text-anchor="middle" '
        f'font-size="12">{esc(y_label)}</text>'
    )
    for (x, colour, text), lane in zip(markers, lanes, strict=True):
        label_y = 14 + 13 * lane
        out.append(
            f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{label_y + 2}" y2="{top + ph}" '
            f'stroke="{colour}" stroke-width="2" stroke-dasharray="4 3">'
            f"<title>{esc(text)}</title></line>"
        )
        out.append(
            f'<text x="{px(x) + 3:.1f}" y="{label_y}" font-size="11" '
            f'fill="{colour}" style="fill:{colour}">{esc(text)}</text>'
        )
    for name, colour, pts in series:
        if not pts:
            continue
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in pts:
            out.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}">'
                f"<title>{esc(name)} at {esc(f'{x:g}')}: {esc(y_format.format(y))}</title>"
                "</circle>"
            )
    out.append("</svg>")
    return "\n".join(out)


def _label_lanes(markers, plot_width: float) -> list[int]:
    """A lane (row) per marker label so that labels in one lane do not overlap (about 6 px per
    character at 11 px), in x order, each in the first lane that is free at its x."""
    xs = [m[0] for m in markers]
    lo, hi = min(xs, default=0.0), max(xs, default=1.0)
    lane_end: list[float] = []
    lanes = [0] * len(markers)
    for i in sorted(range(len(markers)), key=lambda i: xs[i]):
        x = (xs[i] - lo) / ((hi - lo) or 1) * plot_width
        lane = next((k for k, end in enumerate(lane_end) if end < x), len(lane_end))
        if lane == len(lane_end):
            lane_end.append(0.0)
        lane_end[lane] = x + 6 * len(markers[i][2]) + 8
        lanes[i] = lane
    return lanes


def _svg_open(width: int, height: int, label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{esc(label)}">'
    )


def slowdown_colour(value: float, threshold: float) -> str:
    """Blue below 1 (faster than the peers), near white at 1, orange at the threshold, red at 2x."""
    stops = [
        (0.7, (66, 133, 244)),
        (1.0, (247, 247, 247)),
        (threshold, (253, 174, 97)),
        (max(2.0, threshold + 0.1), (198, 40, 40)),
    ]
    if value <= stops[0][0]:
        rgb = stops[0][1]
    elif value >= stops[-1][0]:
        rgb = stops[-1][1]
    else:
        for (a, ca), (b, cb) in zip(stops, stops[1:], strict=False):
            if a <= value <= b:
                f = (value - a) / ((b - a) or 1)
                rgb = tuple(round(ca[i] + f * (cb[i] - ca[i])) for i in range(3))
                break
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def heatmap(report: straggler.StragglerReport, width: int = 1020) -> str:
    """Rank x step cells coloured by slowdown; flagged ranks marked."""
    steps, ranks = report.steps, report.ranks
    label_w, top, row_h = 300, 26, 24
    cell_w = max(10.0, min(60.0, (width - label_w - 160) / max(1, len(steps))))
    height = top + row_h * len(ranks) + 52
    flagged = {v.rank: v for v in report.flagged_ranks}
    out = [_svg_open(width, height, "straggler heat map: slowdown per rank and step")]
    for j, step in enumerate(steps):
        if len(steps) <= 40 or j % max(1, len(steps) // 20) == 0:
            out.append(
                f'<text x="{label_w + (j + 0.5) * cell_w:.1f}" y="{top - 8}" '
                f'text-anchor="middle" font-size="11">{step}</text>'
            )
    for i, rank in enumerate(ranks):
        y = top + i * row_h
        colour = _RED if rank in flagged else "#1f2933"
        out.append(
            f'<text x="{label_w - 8}" y="{y + row_h * 0.68:.1f}" text-anchor="end" '
            f'font-size="12" style="fill:{colour}" font-weight="{700 if rank in flagged else 400}">'
            f"{esc(report.labels.get(rank, f'rank {rank}'))}</text>"
        )
        if rank in flagged:
            out.append(
                f'<text x="{label_w + len(steps) * cell_w + 8:.1f}" y="{y + row_h * 0.68:.1f}" '
                f'font-size="12" font-weight="700" style="fill:{_RED}" class="straggler-mark">'
                f"\u25c0 straggler {flagged[rank].slowdown:.2f}x</text>"
            )
        for j, step in enumerate(steps):
            value = report.slowdown[rank].get(step)
            x = label_w + j * cell_w
            fill = "#eceff1" if value is None else slowdown_colour(value, report.threshold)
            seconds = report.compute_s[rank].get(step)
            tip = f"rank {rank}, step {step}: " + (
                "no data"
                if value is None
                else f"{value:.2f}x peers, compute {seconds * 1e3:.0f} ms"
            )
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{cell_w - 1:.1f}" height="{row_h - 2}" '
                f'fill="{fill}" class="cell"><title>{esc(tip)}</title></rect>'
            )
            if value is not None and cell_w >= 34:
                out.append(
                    f'<text x="{x + cell_w / 2:.1f}" y="{y + row_h * 0.66:.1f}" '
                    f'text-anchor="middle" font-size="10">{value:.2f}</text>'
                )
    y = top + row_h * len(ranks) + 14
    out.append(
        f'<text x="{label_w}" y="{y + 10}" font-size="11">step \u2192   colour: slowdown '
        f"vs the median of the rank's pipeline-stage peers</text>"
    )
    legend = sorted({0.8, 1.0, 1.5, report.threshold, max(2.0, report.threshold + 0.5)})
    for k, value in enumerate(legend):
        x = label_w + 420 + k * 62
        out.append(
            f'<rect x="{x}" y="{y}" width="16" height="12" '
            f'fill="{slowdown_colour(value, report.threshold)}" stroke="#9aa5b1"/>'
        )
        out.append(f'<text x="{x + 20}" y="{y + 10}" font-size="11">{value:.2f}x</text>')
    out.append("</svg>")
    return "\n".join(out)


def stacked_bars(rows: list[tuple[str, list[float], bool]], width: int = 1020) -> str:
    """One horizontal bar per rank: the mean seconds per step in each ``_BREAKDOWN`` part."""
    label_w, top, row_h = 300, 8, 22
    total = max((sum(v) for _l, v, _f in rows), default=1.0) or 1.0
    plot_w = width - label_w - 80
    height = top + row_h * len(rows) + 40
    out = [_svg_open(width, height, "step-time breakdown per rank")]
    for i, (label, values, flagged) in enumerate(rows):
        y = top + i * row_h
        colour = _RED if flagged else "#1f2933"
        out.append(
            f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end" font-size="12" '
            f'style="fill:{colour}">{esc(label)}</text>'
        )
        x = float(label_w)
        for (part, fill), value in zip(_BREAKDOWN, values, strict=True):
            w = value / total * plot_w
            if w > 0:
                out.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 4}" '
                    f'fill="{fill}" class="bar"><title>{esc(label)}: {esc(part)} '
                    f"{value * 1e3:.1f} ms per step</title></rect>"
                )
            x += w
        out.append(
            f'<text x="{x + 6:.1f}" y="{y + 15}" font-size="11">{sum(values) * 1e3:.0f} ms</text>'
        )
    y = top + row_h * len(rows) + 12
    x = label_w
    for part, fill in _BREAKDOWN:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{fill}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}" font-size="11">{esc(part)}</text>')
        x += 30 + 6 * len(part)  # about 6 px per character at 11 px
    out.append("</svg>")
    return "\n".join(out)


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
    return _section(
        "Training loss",
        "Mean cross-entropy per optimizer step (rank 0's metrics.jsonl).",
        chart,
        "loss",
    )


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
    out.write_text(build(run_dir, peak_tflops), encoding="utf-8")
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
