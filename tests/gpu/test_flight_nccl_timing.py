"""An asynchronous NCCL collective's device time in the flight record is its kernel's time on
NCCL's stream, as NCCL's process group timed it (``TORCH_NCCL_ENABLE_TIMING``, which
``init_distributed`` turns on), not the span between two polls of the watcher thread.

One GPU: a process group of one rank on NCCL still runs each collective as a kernel on NCCL's
stream, with the events around it. The compute stream is kept busy first (``torch.cuda._sleep``),
so the op's start is seen by a poll long after it was issued and its completion by a later poll:
without the kernel's own time the record's span would be the polls' spacing."""

from __future__ import annotations

import os
import time

import pytest
from gpu_jobs import in_child

from megascale.probes.flight.format import OpKind, flight_path, read_records

pytestmark = pytest.mark.gpu

ELEMENTS = 64 * 1024 * 1024  # 256 MiB of fp32: a copy kernel of ~0.2 ms on an H100


def _record_async_collectives(run_dir: str) -> list[tuple[float, float, float]]:
    import torch
    import torch.distributed as dist

    from megascale.parallel.groups import NCCL_TIMING_ENV, init_distributed
    from megascale.probes.flight.recorder import open_recorder

    os.environ.pop(NCCL_TIMING_ENV, None)  # what init_distributed sets, not the environment
    init_distributed("cuda")
    assert os.environ[NCCL_TIMING_ENV] == "1"
    recorder = open_recorder(run_dir, 0, 1)
    source = torch.ones(ELEMENTS, device="cuda")
    out = torch.empty(ELEMENTS, device="cuda")
    measured = []
    for _ in range(3):
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of the compute stream before the op is issued
        work = dist.all_gather_into_tensor(out, source, async_op=True)
        work.wait()
        torch.cuda.synchronize()
        measured.append(work._get_duration() / 1e3)  # the kernel's time, as NCCL's events say
    path = flight_path(run_dir, 0)

    def gathers():
        return [r for r in read_records(path) if r.kind == OpKind.ALL_GATHER_INTO_TENSOR]

    deadline = time.monotonic() + 5  # the watcher polls at least every MAX_INTERVAL_S
    while not all(r.done_mono for r in gathers()) and time.monotonic() < deadline:
        time.sleep(0.01)
    recorder.close()
    dist.destroy_process_group()
    records = gathers()
    return [(r.start_mono, r.done_mono, m) for r, m in zip(records, measured, strict=True)]


def test_an_async_nccl_collectives_record_spans_its_kernel_time(tmp_path):
    spans = in_child(_record_async_collectives, str(tmp_path))
    assert len(spans) == 3
    for start, done, kernel_s in spans:
        assert start and done, spans  # seen started and completed
        assert 0 < kernel_s < 0.02, spans  # a copy of 256 MiB, far below a poll interval's bound
        assert done - start == pytest.approx(kernel_s, abs=2e-6), spans
