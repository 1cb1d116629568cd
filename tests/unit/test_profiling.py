"""Per-step memory figures and the profile window (``megascale.probes.profiling``): the pure parts,
and one-rank CPU runs of the tiny preset with ``train.profile_steps``, fresh and resumed."""

from __future__ import annotations

import io
import json
import re

from megascale import config
from megascale.launcher.local import run_local
from megascale.messages import StepMetrics
from megascale.probes.profiling import first_logged_step, peak_gib, trace_path, window_ahead
from megascale.train.run import Progress, run_rank

STEP_SPAN = re.compile(r"^megascale::train::step#(\d+)$")


def test_peak_gib_is_bytes_over_2_to_the_30_on_cuda_and_none_elsewhere():
    assert peak_gib("cuda", 3 * 2**30, 2**31 + 2**29) == (3.0, 2.5)
    assert peak_gib("cuda", 0, 1536 * 2**20) == (0.0, 1.5)
    assert peak_gib("cpu", 2**30, 2**30) == (None, None)


def test_memory_fields_are_left_out_of_the_line_when_none_and_shown_when_set():
    base = dict(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, step_time_s=0.1, tokens_per_s=10.0)
    cpu = StepMetrics(**base).encode()
    assert "mem_max_allocated_gib" not in cpu and "mem_max_reserved_gib" not in cpu
    gpu = StepMetrics(**base, mem_max_allocated_gib=12.5, mem_max_reserved_gib=17.25)
    assert StepMetrics.decode(gpu.encode()) == gpu
    shown = io.StringIO()
    Progress(1, 1, stream=shown).update(gpu)
    assert " tok/s mem 17.2 GiB" in shown.getvalue()  # the peak reserved; 17.25 rounds to even
    Progress(1, 1, stream=shown).update(StepMetrics(**base))
    assert shown.getvalue().count("GiB") == 1


def test_window_ahead_after_a_resume():
    assert window_ahead([], 0) is None
    assert window_ahead([2, 3], 0) == (2, 3)
    assert window_ahead([2, 4], 2) == (3, 4)
    assert window_ahead([2, 3], 3) is None


def test_memory_snapshot_step_is_the_first_logged_one():
    job = config.load("tiny", ["train.steps=12", "train.log_interval=5"])
    assert [first_logged_step(job, resumed) for resumed in (0, 4, 5, 10)] == [5, 5, 10, 12]


def _job(*sets: str):
    job = config.load(
        "tiny",
        ["train.steps=4", "optim.warmup_steps=1", "train.log_interval=100", *sets],
    )
    return config.validate(job, 1, "gloo")


def _profiled_steps(run_dir) -> set[int]:
    trace = json.loads(trace_path(run_dir, 0).read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    return {int(m.group(1)) for m in map(STEP_SPAN.match, names) if m}


def test_cpu_run_profiles_exactly_the_window_and_reports_no_memory(tmp_path):
    history = run_local(run_rank, 1, (_job("train.profile_steps=[2, 3]"), tmp_path), timeout_s=300)
    assert [m.step for m in history[0]] == [1, 2, 3, 4]
    assert _profiled_steps(tmp_path) == {2, 3}
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines and not any(
        "mem_max_allocated_gib" in r or "mem_max_reserved_gib" in r for r in lines
    )


def test_resumed_run_profiles_only_the_steps_still_ahead(tmp_path):
    job = _job("train.profile_steps=[2, 3]", "checkpoint.interval=2")
    run_local(run_rank, 1, (_job("checkpoint.interval=2"), tmp_path, 2), timeout_s=300)
    assert not (tmp_path / "profile").exists()
    history = run_local(run_rank, 1, (job, tmp_path), timeout_s=300)
    assert [m.step for m in history[0]] == [3, 4]
    assert _profiled_steps(tmp_path) == {3}
