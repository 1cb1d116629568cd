"""Memory figures and profiled ranks on a real run: one 2-rank CPU run of the tiny preset (DP2)
with the TensorBoard sink on and ``train.profile_ranks = [1]``, read back through every place a
memory figure is shown off the live exporter: metrics.jsonl, each rank's progress record, the
TensorBoard event file, the HTML report. (The Prometheus gauges and the dashboard panel are
checked on a live launch in tests/fault/test_prometheus.py.)"""

from __future__ import annotations

import json

import pytest

from megascale import config
from megascale.launcher.local import run_local
from megascale.probes.profiling import trace_path
from megascale.probes.progress import progress_path, read_progress
from megascale.tools import report
from megascale.train.run import run_rank

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run directory of the 2-rank run (see the module docstring)."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    run_dir = tmp_path_factory.mktemp("memory")
    job = config.load(
        "tiny",
        [
            f"train.steps={STEPS}",
            "optim.warmup_steps=1",
            "train.log_interval=100",
            "train.profile_steps=[2, 3]",
            "train.profile_ranks=[1]",
            "metrics.tensorboard=true",
            "metrics.tensorboard_dir='tb'",
        ],
    )
    history = run_local(run_rank, 2, (config.validate(job, 2, "gloo"), run_dir), timeout_s=300)
    assert [[m.step for m in h] for h in history] == [[1, 2, 3, 4]] * 2
    return run_dir


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rss_in_metrics_jsonl_and_each_ranks_progress_record_and_no_cuda_figures(run):
    lines = _lines(run)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for record in lines:
        assert 0.05 < record["mem_rss_gib"] < 64, record  # a tiny model in a torch process
        assert "mem_max_allocated_gib" not in record and "mem_max_reserved_gib" not in record
    for rank in (0, 1):
        progress = read_progress(progress_path(run, rank))
        assert progress.step == STEPS and 0.05 < progress.mem_rss_gib < 64, progress
        assert progress.mem_max_allocated_gib is None and progress.mem_max_reserved_gib is None


def test_tensorboard_event_file_holds_the_memory_figure_of_every_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert "train/mem_rss_gib" in events.Tags()["scalars"]
    shown = {e.step: e.value for e in events.Scalars("train/mem_rss_gib")}
    logged = {r["step"]: r["mem_rss_gib"] for r in _lines(run)}
    assert shown == pytest.approx(logged)  # float32 in event files


def test_only_the_chosen_rank_is_profiled(run):
    assert trace_path(run, 1).is_file() and not trace_path(run, 0).exists()
    names = {e.get("name") for e in json.loads(trace_path(run, 1).read_text())["traceEvents"]}
    assert {"megascale::train::step#2", "megascale::train::step#3"} <= names


def test_report_draws_memory_per_step(run):
    page = report.build(run)
    section = page[page.index('<section id="memory">') :]
    section = section[: section.index("</section>")]
    assert "host RSS" in section and "<svg" in section and "CUDA" not in section.split("<svg")[1]
    highest = max(r["mem_rss_gib"] for r in _lines(run))
    assert f"<td>host RSS</td><td class=num>{highest:.3f} GiB</td>" in section
