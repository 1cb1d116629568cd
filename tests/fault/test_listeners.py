"""Every store a megascale process serves listens on the address it was told (loopback by
default), never on every interface: the self-check's intra-node all-to-all (run by ``megascale
selfcheck`` and by a node's self-check before it rejoins) and the neighbour all-reduce. The
listening sockets are read from /proc/net/tcp while each store is up: in this process for the
functions (as each store starts listening, and every 5 ms), and for the ``megascale selfcheck``
command in its process tree (every 5 ms while it runs)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_exits import _check_nothing_on_every_interface, _cli, _descendants, _listening

from megascale.agent.selfcheck import net
from megascale.launcher.local import free_port

pytestmark = pytest.mark.slow


class Listeners(threading.Thread):
    """This process's listening TCP sockets, sampled every 5 ms until ``stop``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen: set[tuple[str, int]] = set()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.005):
            self.seen.update(_listening([os.getpid()]))

    def __enter__(self) -> Listeners:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_event.set()
        self.join()


@pytest.fixture
def listeners(monkeypatch):
    """``Listeners``, which also read this process's sockets as each store the self-check makes
    starts listening (the store is up then: a short-lived one is not missed between samples)."""
    watch, serve = Listeners(), net.serve_store

    def serve_and_read(*args, **kwargs):
        store = serve(*args, **kwargs)
        watch.seen.update(_listening([os.getpid()]))
        return store

    monkeypatch.setattr(net, "serve_store", serve_and_read)
    with watch:
        yield watch


def test_intranode_alltoall_store_listens_on_loopback_only(listeners):
    bandwidth = net.intranode_alltoall(2, 1 << 16, "gloo", timeout_s=60.0, iters=1)
    assert bandwidth.value > 0
    _check_nothing_on_every_interface(sorted(listeners.seen))


def test_neighbour_allreduce_store_listens_on_the_first_endpoint_only(listeners):
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    results: dict[str, object] = {}

    def node(me: str, peer: str) -> None:
        try:
            results[me] = net.neighbour_allreduce(me, [peer], 1 << 16, timeout_s=30.0, iters=1)
        except Exception as e:  # reported below
            results[me] = e

    threads = [threading.Thread(target=node, args=p) for p in ((a, b), (b, a))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, net.Bandwidth) for r in results.values()), results
    store_port = int(min(a, b).rsplit(":", 1)[1])
    assert ("127.0.0.1", store_port) in listeners.seen, listeners.seen
    _check_nothing_on_every_interface(sorted(listeners.seen))


def test_megascale_selfcheck_listens_on_loopback_only():
    proc = _cli(
        "selfcheck", "--only", "net.intranode_alltoall", "--local-procs", "2", "--quick", "--json"
    )
    seen: set[tuple[str, int]] = set()
    while proc.poll() is None:  # sampled until it exits: its store lives while its ranks run
        seen.update(_listening(_descendants(proc.pid)))
        time.sleep(0.005)
    output = proc.communicate()[0]
    assert proc.returncode == 0, output[-3000:]
    assert "net.intranode_alltoall" in output, output[-3000:]
    assert any(address == "127.0.0.1" for address, _ in seen), seen  # its store was seen
    _check_nothing_on_every_interface(sorted(seen))
