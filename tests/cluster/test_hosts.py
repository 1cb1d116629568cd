"""The multi-host harness itself: hosts reach each other over TCP, and each fault verb blocks
(or slows) exactly what it says, until ``heal``. A few seconds in all."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_hosts import Cluster, HostsError, reap_stale

PORT = 7000
SERVER = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((__import__('sys').argv[1], {PORT}))
s.listen(64)
while True:
    c, _ = s.accept()
    c.sendall(b'ok')
    c.close()
"""
CLIENT = """
import socket, sys, time
t0 = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        assert s.recv(2) == b'ok'
except OSError as e:
    print('fail', type(e).__name__); sys.exit(1)
print('ok', time.monotonic() - t0)
"""


def serve(net: Cluster, host: str) -> subprocess.Popen:
    proc = net.run(host, [sys.executable, "-c", SERVER, net.addr(host)])
    deadline = time.monotonic() + 10
    while (net.addr(host), PORT) not in net.listeners(host):
        assert proc.poll() is None and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    return proc


def reaches(net: Cluster, src: str, dst: str, timeout: float = 0.5) -> float | None:
    """Seconds ``src`` took to get a reply from ``dst``'s server; None if it could not."""
    out = net.exec(src, [sys.executable, "-c", CLIENT, net.addr(dst), str(PORT), str(timeout)],
                   check=False)  # fmt: skip
    return float(out.split()[1]) if out.startswith("ok") else None


def test_hosts_have_their_own_name_address_and_no_default_route(net):
    for host in net.names:
        assert net.exec(host, ["hostname"]).strip() == host
        assert f"inet {net.addr(host)}/24" in net.exec(host, ["ip", "-4", "addr", "show", "eth0"])
        assert "default" not in net.exec(host, ["ip", "route"])
        for other in net.names:  # every host name resolves, as a cluster's DNS would
            assert net.exec(host, ["getent", "hosts", other]).split()[0] == net.addr(other)
    net.check_route()  # the root namespace reaches them through the bridge only


def test_tcp_between_hosts_and_partition_until_heal(net):
    serve(net, "node1")
    assert reaches(net, "node2", "node1") is not None
    assert reaches(net, "ctl", "node1") is not None
    net.partition("node1")
    assert reaches(net, "node2", "node1") is None
    assert reaches(net, "ctl", "node1") is None
    net.heal()
    assert reaches(net, "node2", "node1") is not None


def test_cut_blocks_only_the_pair(net):
    serve(net, "node1")
    net.cut("node1", "node2")
    assert reaches(net, "node2", "node1") is None
    assert reaches(net, "node3", "node1") is not None
    assert reaches(net, "ctl", "node1") is not None
    net.heal()
    assert reaches(net, "node2", "node1") is not None


def test_total_loss_blocks_and_delay_slows(net):
    serve(net, "node1")
    net.loss("node1", 100)
    assert reaches(net, "node2", "node1") is None
    net.heal()
    fast = reaches(net, "node2", "node1")
    assert fast is not None
    net.delay("node1", 150)
    slow = reaches(net, "node2", "node1", timeout=5.0)
    # the SYN-ACK and the reply are both node1's packets: at least one 150 ms hold
    assert slow is not None and slow >= 0.15 > fast, (fast, slow)
    net.heal()
    assert reaches(net, "node2", "node1") < 0.15


def test_crash_kills_the_hosts_processes(net):
    server = serve(net, "node3")
    net.crash("node3")
    assert server.wait(5) is not None
    assert net.pids("node3") == []
    assert reaches(net, "node2", "node3") is None
    net.heal()  # the link is up again, with nothing running behind it
    serve(net, "node3")
    assert reaches(net, "node2", "node3") is not None


def test_bad_host_names_the_choices(net):
    with pytest.raises(ValueError, match="not one of"):
        net.partition("nodeX")


def test_a_cluster_comes_up_and_goes_without_a_trace():
    started = time.monotonic()
    cluster = Cluster(["a", "b"], prefix=f"mt{time.monotonic_ns() % 100000}")
    with cluster:
        up_s = time.monotonic() - started
        cluster.run("a", ["sleep", "60"])
        cluster.partition("b")
        cluster.cut("a", "b")
        assert cluster.pids("a")
    assert cluster.leftovers() == []
    assert up_s < 10 and time.monotonic() - started < 20
    with pytest.raises(HostsError, match="not via"):  # a route that is not the bridge's is refused
        Cluster(["a"], prefix="mtx", subnet="10.77.255").check_route()


def test_a_killed_run_s_hosts_are_reaped():
    """A test process SIGKILLed with its hosts up (no teardown ran) leaves them; the next
    session's ``reap_stale`` removes them, processes included."""
    prefix = f"mk{time.monotonic_ns() % 100000}"
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from netns_hosts import Cluster; "
        f"c = Cluster(['a', 'b'], prefix='{prefix}').up(); c.run('a', ['sleep', '300']); "
        "c.partition('b'); print('up', flush=True); time.sleep(300)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(Path(__file__).parent)], stdout=subprocess.PIPE
    )
    try:
        assert owner.stdout.readline() == b"up\n"
    finally:
        owner.kill()
        owner.wait()
    stale = Cluster(["a", "b"], prefix=prefix)
    assert any(item.startswith("pid ") for item in stale.leftovers())
    assert prefix in reap_stale()
    assert stale.leftovers() == []
