"""The node's GPUs (``AgentOptions.visible_devices``, several "nodes" sharing one machine) reach
every process the agent starts on the node: its workers and its self-check processes alike, so a
node's self-check tests the GPUs its workers will train on, not the machine's first ones.

A fake zygote stands in for the fork server: it records each child's environment and reports the
child done at once with a passing result."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megascale.agent.commands import CommandRunner
from megascale.agent.workers import WorkerPool


class FakeZygote:
    """``zygote.Zygote``'s interface: spawn a target, report its exit through ``on_exit``."""

    def __init__(self) -> None:
        self.spawned: list[tuple[str, dict[str, str]]] = []
        self.on_exit = self.on_death = None

    def spawn(self, target, kwargs, env, log, nice=0) -> int:
        pid = 1000 + len(self.spawned)
        self.spawned.append((target, dict(env)))
        Path(kwargs["out"]).write_text(json.dumps({"detail": "passed", "seconds": 0.0}))
        self.on_exit(pid, 0)  # before the pid is returned, as a fast child can
        return pid


def _agent(tmp_path, visible_devices: str | None) -> tuple[CommandRunner, FakeZygote]:
    """A ``CommandRunner`` with the agent fields a built-in self-check reads."""
    zygote = FakeZygote()
    runner = CommandRunner()
    runner.opts = SimpleNamespace(
        selfcheck="builtin", nproc_per_node=2, visible_devices=visible_devices
    )
    runner.pool = WorkerPool(zygote, tmp_path, "node-1", on_change=lambda: None)
    return runner, zygote


@pytest.mark.parametrize("devices", ["4,5", None], ids=["node's GPUs", "machine's GPUs"])
def test_self_check_processes_get_the_nodes_gpus(tmp_path, devices):
    runner, zygote = _agent(tmp_path, devices)
    ok, detail, _ = runner._run_selfcheck()
    assert ok, detail
    assert [target for target, _ in zygote.spawned] == ["selfcheck", "selfcheck"]
    expected = {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}
    for _target, env in zygote.spawned:
        assert {k: v for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES"} == expected
    assert runner._device_env() == expected  # what the node's workers are started with
