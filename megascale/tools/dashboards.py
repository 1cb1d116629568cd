"""Grafana dashboards as code: MFU/throughput and stragglers, over the metrics of ``metrics.py``.

Built with ``grafana-foundation-sdk`` (pinned ``1769699379!11.6.0``: Grafana 11.6 schema).
``megascale dashboards export --out k8s/dashboards`` writes one JSON file per dashboard (the
files committed under ``k8s/dashboards`` must equal a fresh export; a unit test checks);
``megascale dashboards push --url URL --token TOKEN`` uploads them with ``grafana-client``
(``POST /api/dashboards/db``, overwriting the same ``uid``).

Every panel queries Prometheus through the ``$datasource`` variable and filters on the job with
``megascale_job="$megascale_job"`` (never ``job``: that is the scrape job's label). A test runs
every query of every panel (``panel_queries``) against a real Prometheus scraping real exporters.

- ``megascale-mfu``: MFU, tokens/s, step, last durable checkpoint, effective training time,
  restarts (stats: the controller's job-wide series, one per job); MFU and tokens/s over time
  (rank 0's node's agent series); step time (median and slowest rank); the step-time breakdown (compute, exposed
  communication by group); memory (the highest rank's host RSS and peak CUDA memory); checkpoint
  stall; faults by kind; heartbeats per node.
- ``megascale-stragglers``: heat maps of rank x time of step time, compute time, and compute time
  over the job median; the top slow machines (straggler score and compute slowdown by node);
  straggler score by rank over time.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import heatmap as heatmap_m

logger = logging.getLogger(__name__)

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'megascale_job="$megascale_job"'
"""The label matcher every query carries."""


def _q(expr: str, legend: str = "", *, instant: bool = False, ref: str = "A") -> Any:
    """A Prometheus target; ``{JOB}`` in ``expr`` becomes the job matcher."""
    query = (
        prometheus.Dataquery()
        .expr(expr.replace("{JOB}", "{" + JOB + "}"))
        .ref_id(ref)
        .datasource(DATASOURCE)
    )
    if legend:
        query = query.legend_format(legend)
    if instant:
        query = query.instant().format(prometheus.prometheus.PromQueryFormat.TABLE)
    return query


def _variables(builder: dash_b.Dashboard) -> dash_b.Dashboard:
    return builder.with_variable(
        dash_b.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    ).with_variable(
        dash_b.QueryVariable("megascale_job")
        .label("job")
        .datasource(DATASOURCE)
        .query("label_values(megascale_step, megascale_job)")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
    )


def _stat(title: str, expr: str, unit: str, description: str) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(_q(expr))
        .unit(unit)
        .graph_mode(common.BigValueGraphMode.AREA)
        .height(4)
        .span(6)
    )


def _series(title: str, unit: str, description: str, *targets: Any) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(8)
        .span(12)
    )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def _heatmap(title: str, expr: str, unit: str, description: str) -> heatmap.Panel:
    """Rank x time: one row per rank (each series a row, values coloured; no bucketing)."""
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(_q(expr, "{{node}} r{{rank}}"))
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN))
        .color(
            heatmap.HeatmapColorOptions()
            .mode(heatmap_m.HeatmapColorMode.SCHEME)
            .scheme("RdYlGn")
            .reverse(True)
            .steps(64)
        )
        .y_axis(heatmap.YAxisConfig().axis_label("rank"))
        .cell_values(heatmap.CellValues().unit(unit))
        .unit(unit)
        .height(10)
        .span(24)
    )


def _dashboard(title: str, uid: str, panels: list[Any]) -> dash_b.Dashboard:
    """A megascale dashboard: its variables, the last hour refreshed every 30 s, ``panels`` in
    order (Grafana lays them out left to right, top to bottom)."""
    builder = _variables(
        dash_b.Dashboard(title).uid(uid).tags(["megascale"]).time("now-1h", "now").refresh("30s")
    )
    for panel in panels:
        builder = builder.with_panel(panel)
    return builder


def _job_stats() -> list[stat.Panel]:
    """The job-wide stats of the controller's job summary and its robustness counters."""
    return [
        _stat(
            "MFU",
            "max by (megascale_job) (megascale_job_mfu_ratio{JOB})",
            "percentunit",
            "Model FLOPs utilisation against the peak the trainer logs (the controller's "
            "job summary).",
        ),
        _stat(
            "Tokens / s",
            "max by (megascale_job) (megascale_job_tokens_per_second{JOB})",
            "short",
            "Job-wide training throughput (the controller's job summary).",
        ),
        _stat(
            "Step",
            "max by (megascale_job) (megascale_job_step{JOB})",
            "none",
            "The job's highest completed step (the controller's job summary).",
        ),
        _stat(
            "Last durable checkpoint",
            "max by (megascale_job) (megascale_job_last_checkpoint_step{JOB})",
            "none",
            "Step of the newest checkpoint saved completely (the controller's job summary).",
        ),
        _stat(
            "Effective training time",
            "max by (megascale_job) (megascale_effective_training_time_ratio{JOB})",
            "percentunit",
            "Productive time over wall time since the job started.",
        ),
        _stat(
            "Restarts",
            "sum by (megascale_job) (megascale_restarts_total{JOB})",
            "none",
            "Restarts after faults since the controller started.",
        ),
    ]


def _throughput_series() -> list[timeseries.Panel]:
    """MFU, tokens/s, step time and its breakdown, and memory over time."""
    return [
        _series(
            "MFU over time",
            "percentunit",
            "MFU over time.",
            _q("avg by (megascale_job) (megascale_mfu_ratio{JOB})", "MFU"),
        ),
        _series(
            "Tokens per second over time",
            "short",
            "Throughput over time.",
            _q("avg by (megascale_job) (megascale_tokens_per_second{JOB})", "tokens/s"),
        ),
        _series(
            "Step time",
            "s",
            "Median rank and slowest rank: a gap between them is a straggler.",
            _q("quantile by (megascale_job) (0.5, megascale_step_time_seconds{JOB})", "median"),
            _q("max by (megascale_job) (megascale_step_time_seconds{JOB})", "slowest", ref="B"),
        ),
        _series(
            "Step-time breakdown (mean over ranks)",
            "s",
            "Compute, communication not hidden behind compute by group, and data wait.",
            _q("avg by (megascale_job) (megascale_compute_time_seconds{JOB})", "compute"),
            _q(
                "avg by (megascale_job, group) (megascale_comm_time_seconds{JOB})",
                "comm {{group}}",
                ref="B",
            ),
            _q("avg by (megascale_job) (megascale_data_wait_seconds{JOB})", "data", ref="C"),
        ),
        _series(
            "Memory (highest rank)",
            "bytes",
            "The largest over ranks of: host memory (RSS) at the step's end, and the step's peak "
            "CUDA memory reserved by the caching allocator (what an OOM runs out of) and held by "
            "tensors. The CUDA series are absent on CPU. Per rank: the metrics' rank label.",
            _q("max by (megascale_job) (megascale_memory_rss_bytes{JOB})", "host RSS"),
            _q(
                "max by (megascale_job) (megascale_memory_max_reserved_bytes{JOB})",
                "CUDA reserved (peak)",
                ref="B",
            ),
            _q(
                "max by (megascale_job) (megascale_memory_max_allocated_bytes{JOB})",
                "CUDA allocated (peak)",
                ref="C",
            ),
        ),
    ]


def _robustness_series() -> list[timeseries.Panel]:
    """Checkpoint stall, faults and heartbeats over time."""
    return [
        _series(
            "Checkpoint stall",
            "s",
            "Training time blocked by checkpoint saves (p90 over the interval, and the "
            "last), and the last save's time until durable.",
            _q(
                "histogram_quantile(0.9, sum by (le, megascale_job) "
                "(rate(megascale_checkpoint_stall_seconds_bucket{JOB}[$__rate_interval])))",
                "p90",
            ),
            _q(
                "max by (megascale_job) (megascale_checkpoint_stall_last_seconds{JOB})",
                "last",
                ref="B",
            ),
            _q(
                "max by (megascale_job) (megascale_checkpoint_durable_seconds{JOB})",
                "durable",
                ref="C",
            ),
        ),
        _series(
            "Faults by kind",
            "short",
            "Faults the controller detected per interval.",
            _q(
                "sum by (megascale_job, kind) "
                "(increase(megascale_faults_total{JOB}[$__rate_interval]))",
                "{{kind}}",
            ),
        ),
        _series(
            "Heartbeats received per node",
            "hertz",
            "Heartbeats per second the controller receives from each node's agent.",
            _q(
                "sum by (megascale_job, node) "
                "(rate(megascale_heartbeats_total{JOB}[$__rate_interval]))",
                "{{node}}",
            ),
        ),
    ]


def mfu_dashboard() -> dash_b.Dashboard:
    """Throughput, MFU, step-time breakdown and robustness counters of one job."""
    return _dashboard(
        "megascale: MFU and throughput",
        "megascale-mfu",
        [*_job_stats(), *_throughput_series(), *_robustness_series()],
    )


_COMPUTE_SLOWDOWN = (
    "max by (node, rank) (megascale_compute_time_seconds{JOB}) "
    "/ scalar(quantile(0.5, megascale_compute_time_seconds{JOB}))"
)


def _rank_heatmaps() -> list[heatmap.Panel]:
    """Rank x time heat maps: step time, compute time, and compute time over the job median."""
    return [
        _heatmap(
            "Step time by rank",
            "max by (node, rank) (megascale_step_time_seconds{JOB})",
            "s",
            "One row per rank, one column per scrape: a row that stays hot is a straggler.",
        ),
        _heatmap(
            "Compute time by rank",
            "max by (node, rank) (megascale_compute_time_seconds{JOB})",
            "s",
            "Forward, backward and optimizer time per rank: slow hardware shows here.",
        ),
        _heatmap(
            "Compute time over the job median",
            _COMPUTE_SLOWDOWN,
            "none",
            "1.0 is the median rank; 1.1 is 10% slower than it.",
        ),
    ]


def _slow_machines() -> table.Panel:
    """The top slow nodes by straggler score, with their compute slowdown."""
    return (
        table.Panel()
        .title("Top slow machines")
        .description(
            "Nodes by straggler score (slowest rank's time over its peers' median) and compute "
            "slowdown against the job median. MegaScale found ~0.5% of machines slow this way."
        )
        .datasource(DATASOURCE)
        .with_target(
            _q(
                "topk(10, max by (node) (megascale_straggler_score{JOB}))",
                instant=True,
                ref="score",
            )
        )
        .with_target(
            _q(
                _COMPUTE_SLOWDOWN.replace("(node, rank)", "(node)"),
                instant=True,
                ref="compute",
            )
        )
        .with_transformation(dash_m.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            dash_m.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        "Value #score": "straggler score",
                        "Value #compute": "compute vs median",
                    },
                },
            )
        )
        .sort_by([common_b.TableSortByFieldState().display_name("straggler score").desc(True)])
        .decimals(3)
        .height(10)
        .span(12)
    )


def _straggler_scores() -> timeseries.Panel:
    """Each rank's straggler score over time, red above 1.1."""
    return _series(
        "Straggler score by rank",
        "none",
        "Each rank's time over its peers' median; above 1.1 is 10% slow.",
        _q("max by (node, rank) (megascale_straggler_score{JOB})", "{{node}} r{{rank}}"),
    ).thresholds(
        dash_b.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(None, "green"), dash_m.Threshold(1.1, "red")])
    )


def straggler_dashboard() -> dash_b.Dashboard:
    """Per-rank heat maps and the slowest machines of one job."""
    return _dashboard(
        "megascale: stragglers",
        "megascale-stragglers",
        [*_rank_heatmaps(), _slow_machines(), _straggler_scores()],
    )


DASHBOARDS = {"megascale-mfu": mfu_dashboard, "megascale-stragglers": straggler_dashboard}
"""uid -> builder of every dashboard."""


def build_all() -> dict[str, dict[str, Any]]:
    """uid -> the dashboard's JSON model (what Grafana stores)."""
    return {
        uid: json.loads(json.dumps(fn().build(), cls=JSONEncoder)) for uid, fn in DASHBOARDS.items()
    }


def to_json(model: dict[str, Any]) -> str:
    """The exported file's text: stable key order, so an unchanged dashboard is an unchanged file."""
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


def export(out: str | Path) -> list[Path]:
    """Write ``<uid>.json`` for every dashboard into ``out``; return the paths."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for uid, model in build_all().items():
        path = directory / f"{uid}.json"
        path.write_text(to_json(model))
        paths.append(path)
    return paths


def push(url: str, token: str | None, folder_uid: str | None = None) -> list[dict[str, Any]]:
    """Create or overwrite every dashboard in the Grafana at ``url``; return Grafana's answers.

    ``token``: a service-account token (``Authorization: Bearer``); None uses the user and
    password in ``url`` (``http://user:pass@host:3000``). Raises ``GrafanaException`` subclasses
    on HTTP errors (e.g. ``GrafanaUnauthorizedError`` for a bad token).
    """
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token)
    answers = []
    for uid, model in build_all().items():
        body: dict[str, Any] = {"dashboard": model, "overwrite": True, "message": "megascale"}
        if folder_uid:
            body["folderUid"] = folder_uid
        answers.append(api.dashboard.update_dashboard(body))
        logger.info("pushed dashboard %s to %s", uid, url)
    return answers


# -- the queries, for tests and for anyone checking a Prometheus ----------------------------------


def panel_queries(model: dict[str, Any]) -> Iterator[tuple[str, str, str, bool]]:
    """(panel title, refId, PromQL, instant) of every target of every panel in ``model``."""
    for panel in model.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:  # rows nest panels
            for target in inner.get("targets", []):
                yield inner["title"], target["refId"], target["expr"], bool(target.get("instant"))


def variable_queries(model: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(name, query) of every query-type template variable in ``model``."""
    for var in model.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            yield var["name"], query if isinstance(query, str) else query["query"]


def render(expr: str, variables: dict[str, str], rate_interval: str = "1m") -> str:
    """``expr`` with Grafana's variables substituted, as Grafana would send it to Prometheus."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), out)
