"""Every Grafana dashboard query, executed by a real Prometheus scraping a live ``megascale launch``.

The test launches a real job on this machine -- 2 nodes x 2 CPU ranks, TP2, rank 2 (on node-1)
slowed 1.5x (``slow-rank``), a checkpoint every 5 steps, rank 1 killed once (``kill-worker``, so
the job restarts from its checkpoint), MFU against ``train.peak_tflops`` -- and starts Debian's
``prometheus`` (2.42) on loopback with a 0.5 s scrape interval, scraping the agents and the
controller found through ``RUN_DIR/metrics/*.url``. While the job trains it runs each panel's
PromQL through the HTTP API (``query_range`` for time series and heat maps, ``query`` for
instant tables) and fails on any query error or empty result; then it checks what a person would
read off the dashboards: the slow node first in the straggler table, the slow rank's compute time
highest, MFU in (0, 1), tokens/s equal to ``metrics.jsonl``'s, the controller's job-wide
series (step, tokens/s, MFU, last durable checkpoint) once per job, and each rank's host memory
(the CUDA memory series, and their queries, are empty on CPU). The same live run proves the
message contract (every field of the heartbeat, the progress record, the metrics line, the
controller's commands, acks, state, status, generation and summary in etcd, and its events, that
a consumer reads is produced) and, in headless Chromium, that its HTML report shows MFU, the
communication breakdown and the memory chart.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE = "500ms"
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval: >= 4 scrape intervals
SLOW_RANK, SLOW_NODE = 2, "node-1"
LAUNCH = [
    "--nodes", "2", "--nproc-per-node", "2", "--heartbeat-interval", "0.5",
    "--selfcheck", "builtin", "--timeout", "300",
    "--set", "parallel.tp=2", "--set", "train.steps=2000", "--set", "checkpoint.interval=5",
    "--set", "train.peak_tflops=0.05", "--set", "train.log_interval=50",
    "--set", "train.eval_interval=10",
    "--inject", f"slow-rank:rank={SLOW_RANK},factor=1.5", "--inject", "kill-worker:rank=1,step=8",
]  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.access(PROMETHEUS, os.X_OK),
        reason="no prometheus binary: run scripts/install-test-deps.sh "
        "(apt-get install --no-install-recommends prometheus)",
    ),
]


def _get(base: str, path: str, **params: str) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:  # 400/422: a bad query, with Prometheus's reason
        return json.loads(e.read() or b"{}") | {"status": "error", "http": e.code}


def _wait(what: str, predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except (OSError, ValueError):  # not up yet, or a half-written answer
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def _start_prometheus(tmp_path: Path, config: Path) -> tuple[subprocess.Popen, str]:
    """Prometheus on a free loopback port, ready; a port taken meanwhile (tests share the
    machine) is retried with another."""
    from megascale.launcher.local import free_port

    for attempt in range(3):
        port, log = free_port(), tmp_path / f"prometheus-{attempt}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                    if response.status == 200 and proc.poll() is None:
                        return proc, base
            except OSError:
                time.sleep(0.1)
        proc.kill()
        proc.wait()
        if "address already in use" not in log.read_text():
            raise AssertionError(f"prometheus did not start: {log.read_text()[-2000:]}")
    raise AssertionError("prometheus: no free port in 3 tries")


def _has_data(result: dict) -> bool:
    """True when some series has a non-NaN value (an all-NaN ``histogram_quantile`` is empty)."""
    for series in result["data"]["result"]:
        values = series.get("values") or [series["value"]]
        if any(not math.isnan(float(v)) for _, v in values):
            return True
    return False


def _run(base: str, expr: str, instant: bool) -> dict:
    if instant:
        return _get(base, "/api/v1/query", query=expr)
    now = time.time()
    return _get(
        base, "/api/v1/query_range", query=expr, start=str(now - 30), end=str(now), step="1"
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A running ``megascale launch`` (see the module docstring): (run_dir, job id, etcd
    endpoint, metrics URLs by name), once it restarted after the killed worker and trains again."""
    run_dir = tmp_path_factory.mktemp("live")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MEGASCALE_INJECT", None)
    cmd = [sys.executable, "-m", "megascale.cli", "launch", *LAUNCH, "--run-dir", str(run_dir)]
    log = open(run_dir.parent / "launch.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:

        def started():
            if proc.poll() is not None:
                raise AssertionError(f"launch exited {proc.returncode}: {_tail(log)}")
            found = re.search(r"job (\S+): .* etcd at (\S+);", Path(log.name).read_text())
            urls = {p.stem: p.read_text().strip() for p in (run_dir / "metrics").glob("*.url")}
            return found and len(urls) == 3 and (found.group(1), found.group(2), urls)

        job, endpoint, urls = _wait("the job's metrics URLs", started, 120)
        _wait("the restart after the killed worker", lambda: _restarted(run_dir, proc, log), 180)
        yield run_dir, job, endpoint, urls
    finally:
        proc.send_signal(signal.SIGTERM)  # its agents, controller and etcd die with it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _tail(log) -> str:
    return Path(log.name).read_text()[-3000:]


def _restarted(run_dir: Path, proc: subprocess.Popen, log) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"launch exited {proc.returncode}: {_tail(log)}")
    from megascale.messages import read_metrics

    text = Path(log.name).read_text()
    if "generation 2 running" not in text:
        return False
    # two saves after the kill (step 8): the first of them is durable once the second is taken
    # (a save waits for the one before), so rank 0's progress of generation 2 reports it
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    saves = [m for m in read_metrics(lines) if m.checkpoint_stall_s is not None and m.step > 8]
    return len(saves) >= 2


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, live):
    tmp_path = tmp_path_factory.mktemp("prometheus")
    targets = [urllib.parse.urlsplit(url).netloc for url in live[3].values()]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # YAML is a superset of JSON
            {
                "global": {"scrape_interval": SCRAPE, "scrape_timeout": "400ms"},
                "scrape_configs": [
                    {"job_name": "megascale", "static_configs": [{"targets": targets}]}
                ],
            }
        )
    )
    proc, base = _start_prometheus(tmp_path, config)
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited {proc.returncode}: see {tmp_path}")
            result = _get(base, "/api/v1/query", query="up == 1")
            return len(result.get("data", {}).get("result", [])) == len(targets)

        _wait("prometheus to scrape every target", up, 60)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def _panel_failures(base: str, job: str) -> dict[str, str]:
    """Each dashboard variable and panel query that errs or stays empty (retried for 60 s)."""
    from megascale.tools import dashboards

    pending = []
    for uid, model in dashboards.build_all().items():
        for name, query in dashboards.variable_queries(model):
            metric, label = query.removeprefix("label_values(").rstrip(")").split(", ")
            values = _wait(
                f"variable ${name}",
                lambda m=metric, lb=label: _get(
                    base, f"/api/v1/label/{lb}/values", **{"match[]": m}
                ).get("data"),
                30,
            )
            assert job in values, (uid, name, values)
        for title, ref, expr, instant in dashboards.panel_queries(model):
            rendered = dashboards.render(expr, {"megascale_job": job}, RATE_INTERVAL)
            pending.append((f"{uid} / {title} / {ref}", rendered, instant))
    assert len(pending) >= 20
    failures: dict[str, str] = {}
    # CPU: no CUDA memory series; those queries must run, and may be empty
    cuda_only = [(w, e, i) for w, e, i in pending if _only_cuda_metrics(e)]
    for where, expr, instant in cuda_only:
        result = _run(base, expr, instant)
        if result.get("status") != "success":
            failures[where] = f"query error {result.get('error')!r}: {expr}"
    pending = [q for q in pending if q not in cuda_only]
    deadline = time.monotonic() + 60  # rate() needs a few scrapes: retry empty results a while
    while pending:
        still = []
        for where, expr, instant in pending:
            result = _run(base, expr, instant)
            if result.get("status") != "success":
                failures[where] = f"query error {result.get('error')!r}: {expr}"
            elif not _has_data(result):
                still.append((where, expr, instant))
        pending = still
        if pending and time.monotonic() > deadline:
            failures.update({w: f"empty result: {e}" for w, e, _ in pending})
            break
        if pending:
            time.sleep(0.5)
    return failures


def _only_cuda_metrics(expr: str) -> bool:
    from megascale.agent.metrics import CUDA_ONLY

    used = set(re.findall(r"\b(megascale_[a-z_]+)\s*\{", expr))
    return bool(used) and used <= CUDA_ONLY


def _instant(base: str, expr: str) -> list[dict]:
    return _run(base, expr, True)["data"]["result"]


def test_every_dashboard_query_returns_data_from_a_live_launch(prometheus, live):
    from megascale.messages import read_metrics
    from megascale.tools import dashboards

    base, (run_dir, job, _, _) = prometheus, live
    failures = _panel_failures(base, job)
    assert not failures, "\n".join(f"{w}: {why}" for w, why in failures.items())

    # What a person reads off the straggler dashboard: the slow node first, its slow rank.
    top = _instant(
        base, f'topk(10, max by (node) (megascale_straggler_score{{megascale_job="{job}"}}))'
    )
    rows = sorted(top, key=lambda s: -float(s["value"][1]))
    assert rows[0]["metric"]["node"] == SLOW_NODE and float(rows[0]["value"][1]) > 1.1, rows
    slowdown_query = next(
        dashboards.render(e, {"megascale_job": job})
        for t, _, e, _ in dashboards.panel_queries(dashboards.build_all()["megascale-stragglers"])
        if t == "Compute time over the job median"
    )
    # The heat map's row that stays hot: each rank's mean over the panel's window (one step's
    # figure alone, the latest, is within noise of another rank's on 2 shared cores).
    rows = _run(base, slowdown_query, False)["data"]["result"]
    mean = {
        (r["metric"]["node"], r["metric"]["rank"]): sum(float(v) for _, v in r["values"])
        / len(r["values"])
        for r in rows
    }
    assert max(mean, key=mean.get) == (SLOW_NODE, str(SLOW_RANK)), mean

    # MFU a fraction; tokens/s one job-wide figure: the panel shows, at every moment of the
    # window, a figure rank 0 logged in metrics.jsonl (not a sum or mean over ranks or nodes).
    # Compared value by value: the gauge goes through progress file, heartbeat, exporter and
    # scrape, each of which carries the float exactly, while medians over a window drift apart
    # by the heartbeat's lag on a loaded machine.
    mfu = _instant(base, f'avg by (megascale_job) (megascale_mfu_ratio{{megascale_job="{job}"}})')
    assert 0 < float(mfu[0]["value"][1]) < 1, mfu
    series = _instant(base, f'megascale_tokens_per_second{{megascale_job="{job}"}}')
    assert len(series) == 1, series  # rank 0's node alone exports the job's figure
    start = time.time() - 20

    def changed() -> set[float] | None:
        """The figures the panel showed since ``start``, once it saw more than one: it is live
        (a loaded machine may take longer than a window to log the next figure)."""
        tokens = _get(
            base, "/api/v1/query_range", step="0.5", start=str(start), end=str(time.time()),
            query=f'avg by (megascale_job) (megascale_tokens_per_second{{megascale_job="{job}"}})',
        )["data"]["result"]  # fmt: skip
        shown = {float(v) for _, v in tokens[0]["values"]} if tokens else set()
        return shown if len(shown) > 1 else None

    shown = _wait("the tokens/s panel to show a new figure", changed, 180)
    logged = [
        m.tokens_per_s for m in read_metrics((run_dir / "metrics.jsonl").read_text().splitlines())
    ]
    unmatched = [v for v in shown if not any(v == pytest.approx(x, rel=1e-9) for x in logged)]
    assert not unmatched, (unmatched, logged[-10:])
    # The controller's job-wide series: one per job, the figures rank 0 logged, never summed.
    job_sel = f'{{megascale_job="{job}"}}'
    [controller_tokens] = _instant(base, f"megascale_job_tokens_per_second{job_sel}")
    value = float(controller_tokens["value"][1])
    assert any(value == pytest.approx(x, rel=1e-9) for x in logged), (value, logged[-10:])
    [controller_mfu] = _instant(base, f"megascale_job_mfu_ratio{job_sel}")
    assert 0 < float(controller_mfu["value"][1]) < 1, controller_mfu
    [step] = _instant(base, f"megascale_job_step{job_sel}")
    [saved] = _instant(base, f"megascale_job_last_checkpoint_step{job_sel}")
    assert 0 < float(saved["value"][1]) <= float(step["value"][1]) and (
        float(saved["value"][1]) % 5 == 0  # checkpoint.interval
    ), (saved, step)
    # Memory: one host-RSS series per rank, in bytes; no CUDA series on CPU.
    rss = _instant(base, f"megascale_memory_rss_bytes{job_sel}")
    assert {s["metric"]["rank"] for s in rss} == {"0", "1", "2", "3"}, rss
    assert all(5e7 < float(s["value"][1]) < 64 * 2**30 for s in rss), rss
    assert _instant(base, f"megascale_memory_max_reserved_bytes{job_sel}") == []
    # Our job label survives scraping untouched: nothing was renamed to exported_job.
    assert _get(base, "/api/v1/label/exported_job/values")["data"] == []


def test_every_field_a_consumer_reads_is_produced_by_the_live_run(live):
    """The message contract on the live run's own messages: the heartbeats in etcd, the
    progress records and metrics.jsonl decode (schema checked, no undeclared field), and every
    declared field is produced -- except the few this CPU run cannot have, named here."""
    from megascale.etcd.keys import JobKeys
    from megascale.etcd.store import Store
    from megascale.launcher.cluster import local_store_config
    from megascale.messages import Heartbeat, RankProgress, read_metrics
    from megascale.probes.progress import read_progress

    run_dir, job, endpoint, _ = live
    store = Store(local_store_config(run_dir, endpoint, retry_s=5.0))
    try:
        beats = [
            Heartbeat.decode(kv.json()) for kv in store.get_prefix(JobKeys(job).heartbeats_prefix)
        ]
        _assert_controller_messages_produced(store, JobKeys(job), run_dir)
    finally:
        store.close()
    assert {b.node for b in beats} == {"node-0", "node-1"}
    absent_on_cpu = {"gpus"}  # NVML only
    cuda_memory = {"mem_max_allocated_gib", "mem_max_reserved_gib"}  # CUDA's allocator only
    quiet = {"errors", "error_events", "notices"}  # none in this generation unless a fault
    # carried by rank 0's node only: rank 0 writes the manifest that makes a checkpoint durable
    job_wide = {"tokens_per_s", "mfu", "mfu_peak", "durable"}
    for beat in beats:
        _assert_produced(beat, absent_on_cpu | quiet | (set() if "0" in beat.ranks else job_wide))
        if "0" not in beat.ranks:
            assert beat.tokens_per_s is None and beat.mfu is None, beat
        for figures in beat.ranks.values():
            _assert_produced(figures, cuda_memory)
            assert {"dp", "tp"} <= set(figures.comm_time_s)
    for path in sorted((run_dir / "progress").glob("rank_*.json")):
        record: RankProgress = read_progress(path)
        _assert_produced(record, cuda_memory | (set() if record.rank == 0 else {"durable"}))
    lines = read_metrics((run_dir / "metrics.jsonl").read_text().splitlines())
    for field in ("val_loss", "checkpoint_stall_s"):  # on their steps only
        assert any(getattr(m, field) is not None for m in lines), field
    _assert_produced(lines[-1], {"val_loss", "checkpoint_stall_s"} | cuda_memory)


def _assert_controller_messages_produced(store, keys, run_dir: Path) -> None:
    """The controller's messages of the live run (restarted once, healthy again): commands
    and acks, its state, status, generation and summary, and the events, in etcd and in
    events.jsonl, decode and carry every field a consumer reads."""
    from megascale.controller.events import read_events
    from megascale.messages import (
        Ack,
        Command,
        ControllerState,
        ControllerStatus,
        Event,
        GenerationRecord,
        JobSummaryRecord,
    )

    def read(kind, key):
        kv = store.get(key)
        assert kv is not None, key
        return kind.decode(kv.json())

    commands = {
        keys.name_of(kv.key): Command.decode(kv.json())
        for kv in store.get_prefix(keys.commands_prefix)
    }
    assert {c.kind for c in commands.values()} == {"start"}, commands  # the restart's
    for node, command in commands.items():
        # a self-check's only; a stop's after a fault that leaves ranks blocked only
        _assert_produced(command, {"neighbours", "pause_wait_s"})
        _assert_produced(command.rank_assignment, set())
        ack = read(Ack, keys.ack(node))
        _assert_produced(ack, {"suspects"})  # a self-check's only
        assert (ack.id, ack.ok) == (command.id, True), (ack, command)
    # healthy again: no fault in hand, nothing awaited, no failure, nobody evicted or blamed
    quiet = {"fault", "failure", "awaiting", "awaiting_kind", "blocklist", "culprits"}
    state = read(ControllerState, keys.state)
    learned = {"samples", "restart_ages_s"}  # the learned timeouts, the restart budget's window
    # written with decisions: the step of the last one (None from a generation's start until
    # a decision); the job's current step is the summary's, refreshed while it trains
    decided = {"step"}
    _assert_produced(state, quiet | learned | decided | {"spares", "error_signatures", "topology"})
    assert state.state == "running" and state.generation >= 2 and state.restarts >= 1, state
    status = read(ControllerStatus, keys.status)
    assert (status.state, status.generation) == (state.state, state.generation)
    _assert_produced(read(GenerationRecord, keys.generation), set())
    summary = read(JobSummaryRecord, keys.summary)
    _assert_produced(summary, set())
    for nested in (summary.last_checkpoint, summary.effective):
        _assert_produced(nested, set())
    events = read_events(run_dir)
    mirrored = [Event.decode(kv.json()) for kv in store.get_prefix(keys.events_prefix)]
    assert {e.seq for e in events} <= {e.seq for e in mirrored}  # the file after etcd
    kinds = {e.kind for e in events}
    assert {"fault", "generation_start", "generation_running"} <= kinds, kinds
    fault = next(e for e in events if e.kind == "fault")
    _assert_produced(fault, set())  # node, rank, detail, term: every field of a rank's fault


def _assert_produced(message, allowed_empty: set[str]) -> None:
    empty = {
        name
        for name in message.field_names()
        if getattr(message, name) in (None, {}, [], "") and name not in allowed_empty
    }
    assert not empty, f"{type(message).__name__}: never produced: {sorted(empty)}"


def test_the_live_runs_report_shows_mfu_and_the_comm_breakdown(live, tmp_path):
    """``megascale report`` of the live run, opened in headless Chromium: the step figures show
    MFU as a percentage in (0, 100) and the exposed communication of each group, and the fault
    of the live run (the killed worker) is on the events' time axis."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from browser_support import CHROMIUM, browser_or_skip

    from megascale import cli

    sync_playwright = browser_or_skip()
    out = tmp_path / "report.html"
    assert cli.main(["report", str(live[0]), "--out", str(out)]) == 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(out.as_uri())
            page.wait_for_load_state("load")
            table = page.locator("#figures-table")
            assert table.is_visible()
            rows = dict(
                row.split("\t", 1) for row in table.locator("tr").all_inner_texts()[1:]
            )  # figure -> mean, as shown
            for group in ("dp", "tp"):
                assert float(rows[f"exposed comm {group}"].removesuffix(" ms")) >= 0, rows
            assert float(rows["compute"].removesuffix(" ms")) > 0, rows
            assert 0 < float(rows["MFU"].removesuffix("%")) < 100, rows
            assert page.locator("#memory svg").is_visible()  # rank 0's host RSS per step
            events = page.locator("#events")
            assert events.locator("svg line[stroke-dasharray]").count() >= 1
            assert "fault" in events.inner_text()
        finally:
            browser.close()
