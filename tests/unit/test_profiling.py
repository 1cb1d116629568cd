"""Per-step memory figures, the profile window, profiled ranks, NVTX and the OOM snapshot
(``megascale.probes.profiling``): the pure parts and their rules, and one-rank CPU runs of the tiny
preset with ``train.profile_steps`` (fresh and resumed) and with an out-of-memory error."""

from __future__ import annotations

import io
import json
import re

import pytest

from megascale import config
from megascale.launcher.local import run_local
from megascale.messages import StepMetrics
from megascale.probes.profiling import (
    NULL_NVTX,
    first_logged_step,
    open_nvtx,
    peak_gib,
    profiles_rank,
    trace_path,
    window_ahead,
)
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


def test_rss_is_the_process_resident_set_in_gib():
    import psutil

    from megascale.probes.profiling import rss_gib

    assert rss_gib() == pytest.approx(psutil.Process().memory_info().rss / 2**30, abs=0.05)


@pytest.mark.parametrize(
    ("sets", "world", "message"),
    [
        (["train.profile_ranks=[-1]"], 1, "train.profile_ranks = [-1]: must be distinct global"),
        (["train.profile_ranks=[0, 0]"], 2, "train.profile_ranks = [0, 0]: must be distinct"),
        (
            ["train.profile_ranks=[0, 2]"],
            2,
            "train.profile_ranks = [0, 2]: rank 2 is not in this job (global ranks 0 to 1)",
        ),
        (["train.nvtx=true"], 1, "train.nvtx = true: needs train.device = 'cuda'"),
    ],
)
def test_profile_ranks_and_nvtx_are_checked_in_one_line(sets, world, message):
    with pytest.raises(config.ConfigError) as err:
        config.validate(config.load("tiny", sets), world, "gloo")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_profile_ranks_default_to_rank_0_and_empty_means_every_rank():
    assert config.load("tiny").train.profile_ranks == [0] and not config.load("tiny").train.nvtx
    assert [profiles_rank([0], r) for r in (0, 1)] == [True, False]
    assert [profiles_rank([], r) for r in (0, 5)] == [True, True]
    config.validate(config.load("tiny", ["train.profile_ranks=[1]"]), 2, "gloo")
    job = config.load("tiny", ["train.device=auto", "train.nvtx=true"])  # may find a GPU
    assert open_nvtx(config.validate(job, 1, "gloo"), 0, "cpu") is NULL_NVTX  # it did not


def test_a_cuda_oom_in_a_real_run_dumps_the_memory_history_first(tmp_path, monkeypatch):
    """A one-rank CPU run whose second step raises ``torch.cuda.OutOfMemoryError``, with the
    allocator's recording functions faked (the CPU has none): the history is dumped to the
    ``_oom`` snapshot before the error ends the run, and not dumped again at close."""
    import pickle

    import torch

    from megascale.launcher.local import RankFailed
    from megascale.probes import profiling
    from megascale.train import run as run_module
    from megascale.train.trainer import Trainer

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": ["recorded"]})
    monkeypatch.setattr(
        run_module,
        "open_profiling",
        lambda job, run_dir, rank, device, resumed: profiling.Profiling(
            run_dir, rank, device, None, memory_history=True, dump_after=None
        ),
    )
    real_step = Trainer.step

    def step(self):
        if self.step_num == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(self)

    monkeypatch.setattr(Trainer, "step", step)  # the forked rank inherits the patches
    with pytest.raises(RankFailed, match="OutOfMemoryError"):
        run_local(run_rank, 1, (_job(), tmp_path), timeout_s=300)
    oom = profiling.snapshot_path(tmp_path, 0, oom=True)
    assert pickle.loads(oom.read_bytes()) == {"segments": ["recorded"]}
    assert not profiling.snapshot_path(tmp_path, 0).exists()
