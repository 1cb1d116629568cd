"""``megascale report`` on a real 4-rank run with a slowed rank and controller events, opened in
headless Chromium: what a person sees (titles, rendered figures, the straggler named, the faults on
the time axis), and that the page fetches nothing from the network.

Needs Debian's ``chromium`` (scripts/install-test-deps.sh) and the ``playwright`` package (dev
extra); skipped without them, or failed when ``MEGASCALE_REQUIRE_TEST_DEPS=1`` (CI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from browser_support import CHROMIUM, browser_or_skip
from harness import with_changes

from megascale import cli
from megascale.config import load, validate
from megascale.controller.events import EventLog
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.probes.inject import ENV
from megascale.train.run import run_rank

pytestmark = pytest.mark.slow

WORLD, SLOW_RANK, FACTOR, STEPS = 4, 3, 3.0, 5


def _rank(job, run_dir):
    os.environ["MEGASCALE_NODE"] = f"node-{int(os.environ['RANK']) // 2}"
    os.environ[ENV] = f"slow-rank:rank={SLOW_RANK},factor={FACTOR}"
    run_rank(job, run_dir)


def _events(run_dir: Path) -> None:
    """What the controller would have logged around this run, through its own EventLog."""
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").open()]
    gap = times[3] - times[2]  # between steps 3 and 4: fault, eviction, restart, running
    moments = iter([times[0] - 1.0, *(times[2] + k * gap / 5 for k in (1, 2, 3, 4))])
    log = EventLog(run_dir, clock=lambda: next(moments))
    log.append("generation_start", generation=0)
    log.append("fault", generation=0, node="node-1", rank=3, detail={"fault": "stall"})
    log.append("evict", generation=0, node="node-1", detail={"reason": "slow"})
    log.append("generation_start", generation=1)
    log.append("generation_running", generation=1)


@pytest.fixture(scope="module")
def report_page(tmp_path_factory, data_dir):
    sync_playwright = browser_or_skip()
    run_dir = tmp_path_factory.mktemp("reported")
    job = with_changes(
        load("tiny"),
        parallel={"pp": 2},
        model={"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 32},
        train={"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2},
        optim={"warmup_steps": 1},
        data={"path": str(default_token_file(data_dir))},
        diagnostics={"straggler_threshold": 2.0},  # 2 shared cores: see test_timeline.py
    )
    run_local(_rank, WORLD, (validate(job, WORLD, "gloo"), run_dir), timeout_s=300)
    _events(run_dir)
    out = run_dir / "report.html"
    assert cli.main(["report", str(run_dir), "--out", str(out)]) == 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(out.as_uri())
        page.wait_for_load_state("load")
        page.screenshot(path=str(run_dir / "report.png"), full_page=True)
        yield page, requests, run_dir
        browser.close()


def test_titles_a_person_recognises(report_page):
    page, _, run_dir = report_page
    assert page.title() == f"megascale run report: {run_dir.name}"
    headings = page.locator("h2").all_inner_texts()
    for title in (
        "Summary",
        "Training loss",
        "Throughput and model FLOPs utilisation (MFU)",
        "Straggler heat map",
        "Step-time breakdown",
        "Faults and recoveries",
    ):
        assert title in headings


def test_every_figure_is_drawn(report_page):
    page, _, _ = report_page
    for section in ("loss", "mfu", "heatmap", "breakdown", "events"):
        svg = page.locator(f"#{section} svg").first
        assert svg.is_visible(), section
        box = svg.bounding_box()
        assert box["width"] > 300 and box["height"] > 100, (section, box)
    points = page.locator("#loss polyline").get_attribute("points").split()
    assert len(points) == STEPS
    assert page.locator("#heatmap rect.cell").count() == WORLD * STEPS
    colours = {page.locator("#heatmap rect.cell").nth(i).get_attribute("fill") for i in range(20)}
    assert len(colours) > 1  # not a blank grid
    assert page.locator("#breakdown rect.bar").count() >= WORLD
    assert page.locator("#mfu polyline").count() == 2  # tokens/s and MFU, on CPU too


def test_cpu_mfu_is_against_the_peak_the_run_measured(report_page):
    page, _, run_dir = report_page
    assert page.locator("#mfu-absent").count() == 0
    text = page.locator("#mfu").inner_text()
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["mfu_peak_source"] == "measured:cpu fp32" and 0 < first["mfu"] < 1
    assert f"{first['mfu_peak_tflops']:.4g} TFLOP/s measured:cpu fp32 (recorded by the run)" in text


def test_the_straggler_is_named(report_page):
    page, _, _ = report_page
    verdict = page.locator("#straggler-verdict").inner_text()
    assert "Straggler detected" in verdict
    assert "rank 3 (dp=1, pp=1, tp=0) on node-1" in verdict
    assert "node-1" in verdict and "node-0" not in verdict
    marks = page.locator("#heatmap .straggler-mark").all_text_contents()  # SVG text
    assert len(marks) == 1 and "straggler" in marks[0]
    flagged_rows = page.locator("#heatmap tr.flagged").all_inner_texts()
    assert len(flagged_rows) == 1 and "node-1" in flagged_rows[0]


def test_faults_and_recoveries_are_on_the_time_axis(report_page):
    page, _, _ = report_page
    section = page.locator("#events")
    assert section.locator("svg line[stroke-dasharray]").count() == 5  # one marker per event
    text = section.inner_text()
    for kind in ("fault", "evict", "generation_start", "generation_running"):
        assert kind in text


def test_the_page_fetches_nothing(report_page):
    _, requests, run_dir = report_page
    assert requests == [(run_dir / "report.html").as_uri()]
    html = (run_dir / "report.html").read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html
