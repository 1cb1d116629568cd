"""Offline tools that simulate a cluster on one machine: the real controller and etcd against
many simulated node agents (``scenario.run_scenario``, ``benchmarks/scale.py``).

* ``agents``: the real ``Agent`` with simulated workers, as threads.
* ``agents_async``: the same agents driven by coroutines (hundreds per process).
* ``scenario``: one measured run for N nodes: steady-state load, then kills and recoveries.
"""
