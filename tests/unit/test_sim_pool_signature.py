"""The simulated agents' worker pool stands in for the real one: the agent calls it the same way."""

from __future__ import annotations

import inspect

from megascale.agent.workers import WorkerPool
from megascale.tools.sim.agents import SimPool


def test_the_simulated_pool_takes_every_call_the_agent_makes_of_the_real_one():
    for name, method in inspect.getmembers(SimPool, inspect.isfunction):
        if name.startswith("_") or not hasattr(WorkerPool, name):
            continue
        real = inspect.signature(getattr(WorkerPool, name))
        assert inspect.signature(method).parameters.keys() == real.parameters.keys(), name
