"""What ``megascale.parallel.groups`` hands torch and megatron-core, checked without a process
group: the timeout of the training groups, and the device a collective's tensors must be on."""

from __future__ import annotations

import pytest
import torch

from megascale.config import ParallelConfig
from megascale.parallel import groups


class _Stop(Exception):
    """Ends ``build_groups`` once megatron-core was called (there is no process group here)."""


@pytest.fixture
def mcore_call(monkeypatch):
    """The keyword arguments ``build_groups`` gives megatron-core's initialize_model_parallel."""
    from megatron.core import parallel_state as ps

    seen: dict = {}

    def initialize_model_parallel(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(ps, "initialize_model_parallel", initialize_model_parallel)
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(groups.dist, "get_rank", lambda group=None: 0)
    return seen


def test_training_groups_get_the_default_groups_timeout(mcore_call):
    with pytest.raises(_Stop):
        groups.build_groups(ParallelConfig())
    # megatron-core's own default is 30 minutes; the default group gets TIMEOUT_S (10 minutes)
    assert mcore_call.get("distributed_timeout_minutes") == 10.0
    assert groups.TIMEOUT_S == 600.0


def test_a_timeout_given_to_build_groups_reaches_megatron_core(mcore_call):
    with pytest.raises(_Stop):
        groups.build_groups(ParallelConfig(), timeout_s=90.0)
    assert mcore_call["distributed_timeout_minutes"] == 1.5


@pytest.mark.parametrize(
    ("backend", "expected"),
    [("nccl", torch.device("cuda", 2)), ("gloo", torch.device("cpu"))],
)
def test_a_collectives_tensors_go_where_the_groups_backend_takes_them(
    monkeypatch, backend, expected
):
    asked = []

    def get_backend(group=None):
        asked.append(group)
        return backend

    monkeypatch.setattr(groups.dist, "get_backend", get_backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    sentinel = object()
    assert groups.collective_device(sentinel) == expected
    assert groups.collective_device() == expected
    assert asked == [sentinel, None]
