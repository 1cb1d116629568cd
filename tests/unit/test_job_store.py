"""The ranks of a worker group agree on a fresh key prefix in a store that an earlier group of
the same job used (torchrun's shared agent store), and rank 0's own store listens on
MASTER_ADDR only."""

from __future__ import annotations

import ast
import datetime
import socket
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch.distributed as dist

from megascale.launcher import job_store
from megascale.launcher.local import free_port


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), False)


def _group(port: int, world: int) -> list[str]:
    def rank(r: int) -> str:
        client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
        return job_store._agree_on_prefix(client, r, world, timeout_s=30)

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank, range(world)))


def test_each_group_agrees_on_a_prefix_no_earlier_group_used():
    server = _server()
    first = _group(server.port, 4)
    assert len(set(first)) == 1 and first[0].startswith(job_store.PREFIX)
    # What a dead group leaves behind: its hellos and acks, and a stale nonce of rank 2.
    server.set(f"{job_store.PREFIX}hello/2", "0123456789abcdef")
    second = _group(server.port, 4)
    assert len(set(second)) == 1 and second[0] != first[0]


def test_rank0_store_listens_on_master_addr_only():
    port = free_port()
    fd, bound = job_store._listen("127.0.0.1", port)
    assert bound == port
    with socket.socket(fileno=fd) as listening:
        assert listening.getsockname() == ("127.0.0.1", port)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        job_store._listen("127.0.0.1", taken.getsockname()[1])
    except OSError as e:  # local.run_local recognises this and retries on another port
        assert "EADDRINUSE" in str(e) and str(taken.getsockname()[1]) in str(e)
    else:
        raise AssertionError("listening on a taken port did not fail")
    finally:
        taken.close()


def _server_stores(tree: ast.AST, where: str = "") -> list[str]:
    """The functions (dotted) holding a ``TCPStore(...)`` call whose ``is_master`` is not False."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found += _server_stores(node, f"{where}.{node.name}".lstrip("."))
            continue
        for call in ast.walk(node):
            func = getattr(call, "func", None)
            if not isinstance(call, ast.Call) or "TCPStore" not in (
                getattr(func, "attr", None),
                getattr(func, "id", None),
            ):
                continue
            master = call.args[3] if len(call.args) > 3 else None
            master = next((k.value for k in call.keywords if k.arg == "is_master"), master)
            if not (isinstance(master, ast.Constant) and master.value is False):
                found.append(where or "<module>")
    return found


def test_every_store_megascale_serves_is_made_by_serve_store():
    """torch's ``TCPStore(addr, ..., is_master=True)`` binds every interface whatever ``addr``
    is: a server store made anywhere but ``serve_store`` (which gives it a bound socket) would
    listen wide. Clients (``is_master`` False) may be made anywhere."""
    package = Path(job_store.__file__).resolve().parents[1]
    servers = {
        f"{path.relative_to(package.parent)}::{name}"
        for path in sorted(package.rglob("*.py"))
        for name in _server_stores(ast.parse(path.read_text(), str(path)))
    }
    assert servers == {"megascale/launcher/job_store.py::serve_store"}, servers


def test_gloo_uses_loopback_on_one_machine_and_the_nodes_interface_across_machines():
    import psutil

    assert job_store.gloo_interface("127.0.0.1", None).startswith("lo")
    assert job_store.gloo_interface("localhost", "10.0.0.1").startswith("lo")
    own = [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    for name, addr in own:  # the interface holding the node's address, whatever the host name
        assert job_store.gloo_interface("192.0.2.1", addr) == name
    assert job_store.gloo_interface("192.0.2.1", "198.51.100.9") is None  # not this machine's
    assert job_store.gloo_interface("192.0.2.1", None) is None  # gloo's own choice


def test_a_rank_ahead_of_rank_0_joins_its_store_once_it_listens(monkeypatch):
    """A rank whose process is up before rank 0 serves the store (a rejoining rank) waits for
    the port to accept (``wait_listening``), not through the store client's own retry backoff,
    and then joins it."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(job_store.wait_listening, "127.0.0.1", port, 30.0)
        client = pool.submit(job_store.job_store, 1, 2, 30.0)  # ahead of rank 0
        assert waiting in wait([waiting], timeout=0.1).not_done  # nothing listens yet
        server = job_store.job_store(0, 2, 30.0)
        waiting.result(timeout=30)
        client.result(timeout=30).set("rank1", "here")
    assert server.get("rank1") == b"here"


def test_a_store_that_never_comes_up_is_named_in_one_line():
    port = free_port()  # nothing listens there
    try:
        job_store.wait_listening("127.0.0.1", port, 0.05)
    except dist.DistNetworkError as e:  # what the store client raises: a rank's pause handles it
        assert f"127.0.0.1:{port}" in str(e) and "\n" not in str(e), e
    else:
        raise AssertionError("waiting for a port nothing listens on returned")
