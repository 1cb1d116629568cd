"""The report's figures as inline SVG, drawn from plain lists (no plotting library, no
JavaScript): ``line_chart`` (series over steps, with event markers on the time axis),
``heatmap`` (the straggler heat map: rank x step, each cell the rank's slowdown against its
pipeline stage) and ``stacked_bars`` (the step-time breakdown per rank), with their helpers
(``esc``, ``nice_ticks``, ``slowdown_colour``).
"""

from __future__ import annotations

import html
import math
from typing import Any

from megascale.tools import straggler

_BLUE, _ORANGE, _RED, _GREEN, _GREY = "#1f77b4", "#f28e2b", "#c62828", "#2e7d32", "#8d99a6"
_BREAKDOWN = (  # (label, colour) of the stacked step-time bars
    ("compute", "#4e79a7"),
    ("blocked in DP comm", "#f28e2b"),
    ("blocked in PP comm", "#e15759"),
    ("blocked in TP comm", "#76b7b2"),
    ("blocked in other comm", "#bab0ac"),
    ("checkpoint", "#59a14f"),
)


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
    xs = [x for x in xs if math.isfinite(x)]
    ys = [y for _n, _c, pts in series for _, y in pts if math.isfinite(y)]  # inf/nan: marked
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
        for run in _finite_runs(pts):  # the line breaks where a value is inf or nan
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
        for x, y in pts:
            if not math.isfinite(x):
                continue
            title = f"<title>{esc(name)} at {esc(f'{x:g}')}: {esc(y_format.format(y))}</title>"
            if math.isfinite(y):
                out.append(
                    f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}">'
                    f"{title}</circle>"
                )
                continue
            edge = top + ph if y == -math.inf else top + 10  # off the scale: at its edge
            out.append(
                f'<text x="{px(x):.1f}" y="{edge:.1f}" text-anchor="middle" font-size="11" '
                f'fill="#c81e1e" style="fill:#c81e1e">{esc(y_format.format(y))}{title}</text>'
            )
    out.append("</svg>")
    return "\n".join(out)


def _finite_runs(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """The stretches of consecutive points whose x and y are both finite."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if math.isfinite(x) and math.isfinite(y):
            runs[-1].append((x, y))
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


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
