"""Every Grafana dashboard query, executed by a real Prometheus scraping real exporter processes.

The test starts Debian's ``prometheus`` (2.42) on loopback with a 0.5 s scrape interval and a
temporary TSDB, scraping three HTTP endpoints of one exporter process: two node agents
(``AgentMetrics``, ranks 0-3 and 4-7) and the controller (``ControllerMetrics``), fed with
synchronous-training figures in which rank 6 on node-b computes 20% slower than its peers.
Once data is present it runs each panel's PromQL through the HTTP API (``query_range`` for
time series and heat maps, ``query`` for instant tables) and fails on any query error or empty
result; then it checks that the straggler table names node-b first.

This file is also the exporter: ``python tests/fault/test_prometheus.py PORTS_FILE``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
JOB = "gpt-175b-demo"
SCRAPE = "500ms"
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval: >= 4 scrape intervals
STRAGGLER_RANK, SLOWDOWN = 6, 1.2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.access(PROMETHEUS, os.X_OK),
        reason="no prometheus binary: run scripts/install-test-deps.sh "
        "(apt-get install --no-install-recommends prometheus)",
    ),
]


# -- the exporter process -------------------------------------------------------------------------


def feed(ports_file: str, lifetime_s: float = 300.0) -> None:
    """Serve two agents and a controller and update them every 0.25 s, like a running job."""
    from megascale.diagnostics.metrics import AgentMetrics, ControllerMetrics

    rng = random.Random(0)
    nodes = {"node-a": range(0, 4), "node-b": range(4, 8)}
    agents = {node: AgentMetrics(JOB, node) for node in nodes}
    controller = ControllerMetrics(JOB)
    servers = {node: agent.serve() for node, agent in agents.items()}
    servers["controller"] = controller.serve()
    tmp = ports_file + ".tmp"
    Path(tmp).write_text(json.dumps({name: s.port for name, s in servers.items()}))
    os.replace(tmp, ports_file)  # the test reads a complete file or none
    controller.record_fault("worker_exit")
    controller.record_restart(generation=1)
    parent, start, step = os.getppid(), time.monotonic(), 100
    while os.getppid() == parent and time.monotonic() - start < lifetime_s:
        step += 1
        compute = {
            r: 0.80 * (SLOWDOWN if r == STRAGGLER_RANK else 1.0) * rng.uniform(0.99, 1.01)
            for r in range(8)
        }
        step_time = max(compute.values()) + 0.06  # synchronous: everyone waits for the slowest
        median = sorted(compute.values())[4]
        for node, ranks in nodes.items():
            exposed = {r: step_time - compute[r] for r in ranks}  # waiting shows up as comm
            agents[node].observe_heartbeat(
                {
                    "node": node,
                    "step": step,
                    "tokens_per_s": 8 * 4096 / step_time,
                    "mfu": 0.42 * 0.96 / step_time,
                    "checkpoint_stall_s": rng.uniform(0.5, 2.0) if step % 4 == 0 else None,
                    "ranks": {
                        str(r): {
                            "step": step,
                            "step_time_s": step_time,
                            "compute_time_s": compute[r],
                            "comm_time_s": {"dp": 0.6 * exposed[r], "tp": 0.4 * exposed[r]},
                        }
                        for r in ranks
                    },
                }
            )
            controller.observe_heartbeat(node)
        controller.set_straggler_scores(
            {(node, r): compute[r] / median for node, ranks in nodes.items() for r in ranks}
        )
        elapsed = time.monotonic() - start + 100.0
        controller.set_effective_training_time(0.93 * elapsed, elapsed)
        if step % 40 == 0:
            controller.record_fault("stall")
        time.sleep(0.25)


# -- the test -------------------------------------------------------------------------------------


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


@pytest.fixture
def exporter(tmp_path):
    ports_file = tmp_path / "ports.json"
    proc = subprocess.Popen([sys.executable, __file__, str(ports_file)])
    try:
        ports = _wait(
            "the exporter's ports",
            lambda: ports_file.exists() and json.loads(ports_file.read_text()),
            60,
        )
        yield ports
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def prometheus(tmp_path, exporter):
    targets = [f"127.0.0.1:{port}" for port in exporter.values()]
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


def test_every_dashboard_query_returns_data_from_a_real_prometheus(prometheus):
    from megascale.diagnostics import dashboards

    base = prometheus
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
            assert JOB in values, (uid, name, values)
        for title, ref, expr, instant in dashboards.panel_queries(model):
            rendered = dashboards.render(expr, {"megascale_job": JOB}, RATE_INTERVAL)
            pending.append((f"{uid} / {title} / {ref}", rendered, instant))
    assert len(pending) >= 20

    failures: dict[str, str] = {}
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
    assert not failures, "\n".join(f"{w}: {why}" for w, why in failures.items())

    # What a person would read off the straggler dashboard: node-b first, about 20% slow.
    top = _run(
        base, f'topk(10, max by (node) (megascale_straggler_score{{megascale_job="{JOB}"}}))', True
    )
    rows = sorted(top["data"]["result"], key=lambda s: -float(s["value"][1]))
    assert rows[0]["metric"]["node"] == "node-b"
    assert float(rows[0]["value"][1]) == pytest.approx(SLOWDOWN, abs=0.05)
    assert float(rows[1]["value"][1]) == pytest.approx(1.0, abs=0.05)
    slowdown_query = next(
        dashboards.render(e, {"megascale_job": JOB})
        for t, _, e, _ in dashboards.panel_queries(dashboards.build_all()["megascale-stragglers"])
        if t == "Compute time over the job median"
    )
    ranks = _run(base, slowdown_query, True)["data"]["result"]
    slowest = max(ranks, key=lambda s: float(s["value"][1]))
    assert slowest["metric"] == {"node": "node-b", "rank": str(STRAGGLER_RANK)}
    # Our job label survives scraping untouched: nothing was renamed to exported_job.
    assert _get(base, "/api/v1/label/exported_job/values")["data"] == []


if __name__ == "__main__":
    feed(sys.argv[1])
