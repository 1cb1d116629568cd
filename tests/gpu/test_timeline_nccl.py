"""Per-collective timeline segments on GPUs: a TP2 + SP run over NCCL, where every collective call
returns to the host at once. Each TP collective is a segment of its own, timed by the flight
recorder's CUDA events recorded on the stream before and after it, and lies inside its step."""

from __future__ import annotations

import json

import pytest
from gpu_jobs import small_job

from megascale.launcher.local import run_local
from megascale.probes.flight.format import flight_path, read_records
from megascale.probes.timers import rank_file
from megascale.train.run import run_rank

pytestmark = pytest.mark.gpu(2)

STEPS = 3


def _rank(job, run_dir):
    return [m.step for m in run_rank(job, run_dir)]


def _steps(run_dir, rank: int) -> list[dict]:
    lines = (json.loads(line) for line in rank_file(run_dir, rank).read_text().splitlines())
    return [line for line in lines if line["type"] == "step" and line["step"]]


def test_tp_collectives_are_device_timed_segments_inside_their_step(tmp_path):
    job = small_job(
        parallel={"tp": 2, "sequence_parallel": True},
        train={"steps": STEPS},
        checkpoint={"interval": 0},
        diagnostics={"timeline": True, "flush_interval_steps": 1},
    )
    assert run_local(_rank, 2, (job, tmp_path), timeout_s=900) == [list(range(1, STEPS + 1))] * 2
    for rank in range(2):
        device = {  # (start ns, duration ns) of every op the watcher saw run, from the flight file
            (round(r.start_mono * 1e9), round(r.done_mono * 1e9) - round(r.start_mono * 1e9))
            for r in read_records(flight_path(tmp_path, rank))
            if r.start_mono and r.done_mono
        }
        assert device, rank  # the CUDA events gave device times
        steps = _steps(tmp_path, rank)
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), rank
        for record in steps:
            (step,) = [s for s in record["spans"] if s[0] == "megascale::train::step"]
            begin, end = step[2], step[2] + step[3]
            tp = [s for s in record["spans"] if s[1] == "comm.tp"]
            names = {s[0] for s in tp}
            assert "megascale::tp::all_gather_into_tensor" in names, (rank, names)
            assert "megascale::tp::reduce_scatter_tensor" in names, (rank, names)
            # On a GPU only device-timed records are drawn: every segment is an op seen to run.
            assert all((s[2], s[3]) in device for s in tp), rank
            assert all(s[3] >= 0 and s[2] >= begin for s in tp), rank  # after the step began
            inside = [s for s in tp if s[2] + s[3] <= end]
            # The last ops of a step may be seen complete just after the host's step ended (the
            # watcher polls); the TP collectives of the forward and backward are inside it.
            assert len(inside) >= len(tp) // 2, (rank, record["step"], len(inside), len(tp))
            assert sum(s[3] for s in tp) <= step[3], rank
