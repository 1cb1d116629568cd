"""``launcher.local.free_port``: the rendezvous port of a job started from this process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from megascale.launcher.local import free_port


def test_jobs_started_side_by_side_never_get_one_port():
    """The kernel hands a port closed a moment ago out again; two jobs started at once from one
    process (the stall matrix runs its cells two by two) must not share a rendezvous."""
    with ThreadPoolExecutor(4) as pool:
        ports = list(pool.map(lambda _: free_port(), range(1000)))
    assert len(set(ports)) == len(ports)
