"""Dashboards as code and the metrics they query: structure, the committed JSON, and a real push.

The push goes over real HTTP to a small server on 127.0.0.1 that records what Grafana would
receive (no Grafana server can be installed here). Every query is executed against a real
Prometheus in tests/fault/test_prometheus.py.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from megascale.agent.metrics import (
    FAULT_KINDS,
    METRICS,
    AgentMetrics,
    ControllerMetrics,
    MetricSpec,
    metric_names,
)
from megascale.cli import main
from megascale.messages import CheckpointFigures, Heartbeat, RankFigures
from megascale.tools import dashboards

REPO = Path(__file__).resolve().parents[2]
MODELS = dashboards.build_all()


def test_two_dashboards_with_the_panels_users_look_at():
    assert set(MODELS) == {"megascale-mfu", "megascale-stragglers"}
    for uid, model in MODELS.items():
        assert model["uid"] == uid and model["title"].startswith("megascale: ")
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["megascale_job"]["query"] == "label_values(megascale_step, megascale_job)"
    mfu_titles = {p["title"] for p in MODELS["megascale-mfu"]["panels"]}
    assert {"MFU", "Tokens / s", "Step-time breakdown (mean over ranks)", "Checkpoint stall"} <= (
        mfu_titles
    )
    panels = {p["title"]: p for p in MODELS["megascale-stragglers"]["panels"]}
    heat = panels["Step time by rank"]
    assert heat["type"] == "heatmap" and heat["options"]["calculate"] is False
    assert heat["targets"][0]["legendFormat"] == "{{node}} r{{rank}}"
    assert panels["Compute time by rank"]["type"] == "heatmap"
    table = panels["Top slow machines"]
    assert table["type"] == "table" and all(t["instant"] for t in table["targets"])
    assert "topk(10" in table["targets"][0]["expr"]


def test_every_query_filters_on_the_job_and_never_uses_the_job_label():
    queries = [q for model in MODELS.values() for q in dashboards.panel_queries(model)]
    assert len(queries) >= 20
    known = set(metric_names())
    for title, ref, expr, _ in queries:
        assert 'megascale_job="$megascale_job"' in expr, (title, ref)
        assert not re.search(r"(?<![\w])job\s*(=|!=|=~|!~)", expr), expr
        assert not re.search(r"\bby\s*\([^)]*(?<!_)\bjob\b", expr), expr
        used = set(re.findall(r"\b(megascale_[a-z_]+)\s*\{", expr))
        assert used and used <= known, (title, used - known)
    for model in MODELS.values():
        for panel in model["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]


def test_committed_json_equals_a_fresh_export(tmp_path, capsys):
    committed = REPO / "k8s" / "dashboards"
    assert main(["dashboards", "export", "--out", str(tmp_path)]) == 0
    fresh = sorted(tmp_path.glob("*.json"))
    assert capsys.readouterr().out.split() == [str(p) for p in fresh]
    assert sorted(p.name for p in committed.glob("*.json")) == sorted(p.name for p in fresh)
    for path in fresh:
        assert (committed / path.name).read_text() == path.read_text(), (
            f"k8s/dashboards/{path.name} is stale: run `megascale dashboards export`"
        )


def test_render_substitutes_grafana_variables():
    expr = 'rate(x{megascale_job="$megascale_job"}[$__rate_interval]) / ${scale}'
    assert dashboards.render(expr, {"megascale_job": "j1", "scale": "2"}, "5s") == (
        'rate(x{megascale_job="j1"}[5s]) / 2'
    )


# -- push over real HTTP --------------------------------------------------------------------------


class _FakeGrafana(BaseHTTPRequestHandler):
    """Records each request; answers like Grafana's POST /api/dashboards/db (or 401)."""

    requests: list[dict] = []
    status = 200

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(
            {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
        )
        if self.status == 200:
            uid = body["dashboard"]["uid"]
            answer = {"id": 1, "uid": uid, "url": f"/d/{uid}", "status": "success", "version": 1}
        else:
            answer = {"message": "invalid API key"}
        data = json.dumps(answer).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def grafana():
    _FakeGrafana.requests = []
    _FakeGrafana.status = 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", _FakeGrafana
    server.shutdown()
    server.server_close()


def test_push_posts_every_dashboard_with_the_token(grafana, capsys):
    url, handler = grafana
    code = main(["dashboards", "push", "--url", url, "--token", "glsa_test", "--folder-uid", "ml"])
    assert code == 0
    assert [r["path"] for r in handler.requests] == ["/api/dashboards/db"] * 2
    assert {r["auth"] for r in handler.requests} == {"Bearer glsa_test"}
    bodies = {r["body"]["dashboard"]["uid"]: r["body"] for r in handler.requests}
    assert set(bodies) == set(MODELS)
    for uid, body in bodies.items():
        assert body["overwrite"] is True and body["folderUid"] == "ml"
        assert body["dashboard"] == MODELS[uid]
    assert "megascale-mfu success /d/megascale-mfu" in capsys.readouterr().out


def test_push_with_a_bad_token_returns_1(grafana, caplog):
    url, handler = grafana
    handler.status = 401
    assert main(["dashboards", "push", "--url", url, "--token", "wrong"]) == 1
    assert len(handler.requests) == 1  # stops at the first refusal
    assert "megascale dashboards push" in caplog.text


# -- metrics --------------------------------------------------------------------------------------


def test_no_metric_has_a_label_named_job():
    for spec in METRICS.values():
        assert "job" not in spec.labels
    with pytest.raises(ValueError, match="must not name 'job'"):
        MetricSpec("x_seconds", object, "help", ("job",))


def _samples(registry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_agent_exports_a_heartbeat_and_forgets_a_departed_rank():
    agent = AgentMetrics("job-1", "node-a")
    agent.observe_heartbeat(
        Heartbeat(
            node="node-a",
            step=7,
            tokens_per_s=5000.0,
            mfu=0.42,
            val_loss=2.5,
            checkpoint=CheckpointFigures(step=6, stall_s=2.0, durable_s=3.5),
            ranks={
                "0": RankFigures(7, 1.5, 1.2, {"dp": 0.2}, data_wait_s=0.01),
                "1": RankFigures(7, 1.6, None, {"dp": 0.1, "tp": 0.3}),
            },
        )
    )
    s = _samples(agent.registry)
    job, node = ("megascale_job", "job-1"), ("node", "node-a")
    assert s[("megascale_step_time_seconds", frozenset({job, node, ("rank", "1")}))] == 1.6
    assert s[("megascale_compute_time_seconds", frozenset({job, node, ("rank", "0")}))] == 1.2
    comm = frozenset({job, node, ("rank", "1"), ("group", "tp")})
    assert s[("megascale_comm_time_seconds", comm)] == 0.3
    assert s[("megascale_mfu_ratio", frozenset({job, node}))] == 0.42
    assert s[("megascale_validation_loss", frozenset({job, node}))] == 2.5
    assert s[("megascale_checkpoint_stall_seconds_count", frozenset({job, node}))] == 1
    assert s[("megascale_checkpoint_durable_seconds", frozenset({job, node}))] == 3.5
    assert s[("megascale_data_wait_seconds", frozenset({job, node, ("rank", "0")}))] == 0.01
    agent.observe_heartbeat(  # the same save again (observed once), and no ranks any more
        Heartbeat(node="node-a", checkpoint=CheckpointFigures(step=6, stall_s=2.0))
    )
    s = _samples(agent.registry)
    assert s[("megascale_checkpoint_stall_seconds_count", frozenset({job, node}))] == 1
    assert s[("megascale_heartbeats_sent_total", frozenset({job, node}))] == 2
    assert not [k for k in s if ("rank", "1") in k[1]]
    assert {name for name, _ in s if not name.endswith("_created")} <= set(metric_names("agent"))


def test_controller_counts_faults_by_kind_and_replaces_straggler_scores():
    ctl = ControllerMetrics("job-1")
    ctl.record_fault("stall")
    ctl.record_stall_culprit(3, "not-started")
    ctl.record_restart(generation=2)
    ctl.observe_heartbeat("node-a", Heartbeat(node="node-a"))
    ctl.set_straggler_scores({("node-a", 0): 1.0, ("node-b", 5): 1.3})
    ctl.set_straggler_scores({("node-b", 5): 1.25})
    ctl.set_effective_training_time(95.0, 100.0)
    s = _samples(ctl.registry)
    job = ("megascale_job", "job-1")
    for kind in FAULT_KINDS:
        expected = 1 if kind == "stall" else 0
        assert s[("megascale_faults_total", frozenset({job, ("kind", kind)}))] == expected
    culprit = frozenset({job, ("rank", "3"), ("reason", "not-started")})
    assert s[("megascale_stall_culprit_total", culprit)] == 1
    assert s[("megascale_restarts_total", frozenset({job}))] == 1
    assert s[("megascale_generation", frozenset({job}))] == 2
    scores = {k: v for k, v in s.items() if k[0] == "megascale_straggler_score"}
    assert scores == {
        ("megascale_straggler_score", frozenset({job, ("node", "node-b"), ("rank", "5")})): 1.25
    }
    assert s[("megascale_effective_training_time_ratio", frozenset({job}))] == 0.95
