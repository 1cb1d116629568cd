"""The store a job's ranks rendezvous through (``torch.distributed``'s key-value store).

Two cases, decided from the environment the launcher gave the rank:

* **torchrun with its agent store** (``TORCHELASTIC_USE_AGENT_STORE=True``, the default of its
  c10d rendezvous): every rank is a client of the store torchrun's agent serves at
  MASTER_ADDR:MASTER_PORT. That one store outlives the worker group and is reused when
  ``--max-restarts`` restarts it, so the keys the dead group wrote (gloo's and NCCL's addresses)
  are still there, and a restarted rank reading them connects to a dead peer (``connectFullMesh
  ... Connection refused``). ``TORCHELASTIC_RESTART_COUNT`` does not tell groups apart either: it
  counts the restarts each node's agent caused, not the group's. So the ranks agree on a fresh
  prefix with a handshake (``_agree_on_prefix``) and use the store under it.
* **otherwise** (``megascale train --nproc-per-node``, the agents of ``megascale launch``, any
  launcher that sets MASTER_ADDR/MASTER_PORT): rank 0 serves the store, listening on MASTER_ADDR
  only — loopback for local runs — instead of every interface as torch's ``env://`` does.

With a loopback MASTER_ADDR (a job on one machine) gloo's own sockets are bound to the loopback
interface too (``GLOO_SOCKET_IFNAME``, unless set).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import time
import uuid

import torch.distributed as dist

logger = logging.getLogger(__name__)

PREFIX = "megascale/group/"
_POLL_S = 0.05


def job_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """This rank's store (see the module docstring); blocks until rank 0 serves it, or for a
    torchrun worker group until every rank has joined (``TimeoutError`` after ``timeout_s``)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    _gloo_on_loopback(addr)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        client = dist.TCPStore(addr, port, world, False, timeout)
        prefix = _agree_on_prefix(client, rank, world, timeout_s)
        return dist.PrefixStore(prefix, client)
    if rank != 0:
        wait_listening(addr, port, timeout_s, world)
        return dist.TCPStore(addr, port, world, False, timeout)
    return serve_store(addr, port, world, timeout)


def wait_listening(addr: str, port: int, timeout_s: float, world: int = 1) -> None:
    """Return once ``addr:port`` accepts a connection (rank 0's store is up).

    A ``TCPStore`` client whose first connect is refused retries only after a backoff of ~0.7 s,
    so a rank that arrives a millisecond before rank 0 (a rejoining rank, whose process is
    already up) would wait that long. This tries after 2, 4, 8 ... ms, at most every 50 ms (every
    0.5 s in a world of over 1024 ranks, whose connection attempts all go to one host); the
    probe connection is closed at once, and the store server takes it as a client that left.
    ``DistNetworkError`` naming the address after ``timeout_s``."""
    deadline, pause, most = time.monotonic() + timeout_s, 0.002, 0.05 if world <= 1024 else 0.5
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() + pause > deadline:  # as the store client's own would: a
                raise dist.DistNetworkError(  # rank that pauses on it, pauses on this
                    f"rank 0's store at {addr}:{port} did not accept a connection in "
                    f"{timeout_s:.0f} s ({e})"
                ) from None
            time.sleep(pause)
            pause = min(2 * pause, most)


def serve_store(
    addr: str, port: int, world: int | None, timeout: datetime.timedelta
) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``addr:port`` only (``port`` 0: a free one, then read
    ``.port``). Every store this package serves is made here: torch's ``TCPStore(addr, ...,
    is_master=True)`` binds every interface whatever ``addr`` is, so it is given a socket bound
    here instead (``master_listen_fd``)."""
    fd, port = _listen(addr, port)
    return dist.TCPStore(
        addr, port, world, True, timeout, wait_for_workers=False, master_listen_fd=fd
    )


NODE_ADDR_ENV = "MEGASCALE_NODE_ADDR"
"""The address of the node a worker runs on, as its agent was told (``megascale agent --addr``)."""


def gloo_interface(master_addr: str, node_addr: str | None) -> str | None:
    """The network interface gloo's sockets should use, or None to leave gloo's choice alone:
    loopback for a job on one machine (a loopback MASTER_ADDR), else the interface that holds this
    node's address. Without it gloo resolves the host name, which on many clusters (and in network
    namespaces) gives 127.0.1.1 or nothing, and every rank then dials peers at loopback."""
    if _is_loopback(master_addr):
        return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if not node_addr or _is_loopback(node_addr):
        return None
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == node_addr for a in addrs):
            return name
    return None


def _gloo_on_loopback(addr: str) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` (unless set) to ``gloo_interface``'s answer."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    name = gloo_interface(addr, os.environ.get(NODE_ADDR_ENV))
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _listen(addr: str, port: int) -> tuple[int, int]:
    """A socket listening on ``addr:port`` only; its file descriptor (owned by the caller) and
    port. The
    error names the port and says EADDRINUSE when it is taken (``local.run_local`` retries)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        host = str(ipaddress.ip_address(addr))
    except ValueError:
        host = socket.getaddrinfo(addr, port, family, socket.SOCK_STREAM)[0][4][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        taken = " (EADDRINUSE)" if e.errno == 98 else ""
        raise OSError(e.errno, f"rank 0 cannot listen on {host}:{port}: {e.strerror}{taken}") from e
    port = sock.getsockname()[1]
    return sock.detach(), port


def _agree_on_prefix(store: dist.Store, rank: int, world: int, timeout_s: float) -> str:
    """A key prefix no earlier worker group used, agreed by all ranks of this one.

    Rank 0 draws a random token. Every other rank writes a random nonce of its own to
    ``hello/<rank>`` once and waits for ``ack/<nonce>`` (the token, written by rank 0 for the
    nonce it read), then confirms with ``<token>/joined/<rank>``. Rank 0 reads every unconfirmed
    rank's ``hello`` until that rank has confirmed, answering each nonce it has not answered yet.
    A stale ``hello`` or ``ack`` of a dead group is harmless: no live rank waits for an old
    nonce, and the confirmations live under the new token. Store traffic: O(1) per rank, and
    O(unconfirmed ranks) per poll of rank 0."""
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{PREFIX}hello/{rank}", nonce)
        while not store.check([f"{PREFIX}ack/{nonce}"]):
            _check_deadline(deadline, "rank 0's answer")
            time.sleep(_POLL_S)
        token = store.get(f"{PREFIX}ack/{nonce}").decode()
        store.set(f"{PREFIX}{token}/joined/{rank}", "1")
        return f"{PREFIX}{token}/"
    token = uuid.uuid4().hex
    answered: dict[int, str] = {}
    pending = set(range(1, world))
    while pending:
        _check_deadline(deadline, f"ranks {sorted(pending)[:8]} to join")
        for r in sorted(pending):
            if store.check([f"{PREFIX}{token}/joined/{r}"]):
                pending.discard(r)
            elif store.check([f"{PREFIX}hello/{r}"]):
                nonce = store.get(f"{PREFIX}hello/{r}").decode()
                if answered.get(r) != nonce:
                    store.set(f"{PREFIX}ack/{nonce}", token)
                    answered[r] = nonce
        time.sleep(_POLL_S if pending else 0)
    logger.info("worker group store prefix %s%s/", PREFIX, token)
    return f"{PREFIX}{token}/"


def _check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"worker group rendezvous: timed out waiting for {what}")
