"""Fault specs, exactly-once firing, and the agent's reading of worker output (no processes)."""

from __future__ import annotations

import pytest

from megascale.launcher.workers import LogScanner
from megascale.robustness import inject


def test_specs_parse_and_keep_a_stable_id():
    spec = inject.parse("kill-worker:rank=3,step=20")
    assert (spec.kind, dict(spec.params), spec.side) == (
        "kill-worker",
        {"rank": 3, "step": 20},
        "worker",
    )
    assert spec.id == inject.parse(" kill-worker:step=20,rank=3 ").id
    assert inject.parse("corrupt-checkpoint:latest").side == "agent"
    assert inject.parse("etcd-restart:step=4,downtime=0.5").get("downtime") == 0.5
    assert inject.parse("slow-rank:rank=2,factor=1.5").get("factor") == 1.5
    with pytest.raises(inject.InjectError, match="rank is given twice"):
        inject.parse("kill-worker:rank=1,rank=2,step=3")
    with pytest.raises(inject.InjectError, match="step=0 must be >= 1"):
        inject.parse("kill-worker:rank=1,step=0")


def test_worker_side_specs_travel_in_the_environment(monkeypatch, tmp_path):
    specs = [inject.parse(s) for s in ("kill-worker:rank=1,step=5", "kill-agent:node=1,step=5")]
    value = inject.to_env(specs)
    assert value == "kill-worker:rank=1,step=5"  # the launcher fires kill-agent itself
    monkeypatch.setenv(inject.ENV, value)
    assert [s.text for s in inject.worker_faults(1, tmp_path).specs] == [value]
    assert inject.worker_faults(0, tmp_path).specs == []  # another rank's fault
    monkeypatch.delenv(inject.ENV)
    faults = inject.worker_faults(1, tmp_path)
    faults.before_step(5)  # null object: nothing fires, nothing sleeps
    faults.after_step(10.0)


def test_a_fault_fires_once_across_restarts(tmp_path):
    spec = inject.parse("kill-worker:rank=1,step=5")
    assert inject.claim(tmp_path, spec, rank=1, step=5)
    assert not inject.claim(tmp_path, spec, rank=1, step=5)  # the replayed step after a restart
    [record] = inject.fired(tmp_path)
    assert record["spec"] == spec.text and record["rank"] == 1 and record["time"] > 0


def _scanner(path):
    path.write_text("")
    return LogScanner(path)


def test_log_scanner_finds_errors_and_tells_symptoms_from_causes(tmp_path):
    cause = _scanner(tmp_path / "a.out")
    with open(cause.path, "a") as f:
        f.write("step 5\nTraceback (most recent call last):\n  File 'x'\n")
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to alloc")  # no newline yet
    [match] = cause.scan()
    assert match.kind == "traceback" and not cause.peer_failure
    [oom] = cause.flush()  # the worker exited: its last line counts too
    assert oom.kind == "oom" and "CUDA out of memory" in oom.text

    symptom = _scanner(tmp_path / "b.out")
    with open(symptom.path, "a") as f:
        f.write("Traceback (most recent call last):\n  File 'y'\n")
        f.write("[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5\n")
        f.write("[rank 0] WARNING megascale.train.checkpoint: skipping checkpoint step_8: bad\n")
    matches = symptom.scan()
    assert [m.kind for m in matches] == ["traceback", "checkpoint_fallback"]
    assert "Connection closed by peer" in matches[0].text  # the exception line, not the header
    assert matches[1].notice and symptom.peer_failure
