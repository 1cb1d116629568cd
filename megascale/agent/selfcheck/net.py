"""The self-check's network measurements: loopback TCP, intra-node all-to-all, neighbour all-reduce.

Nothing here sends to an address that is not this node's own: the loopback test connects to
127.0.0.1 and to each local interface address (the kernel routes a packet to one's own address
through ``lo``, so this measures the TCP stack and memory path of each configured address, not the
NIC wire; an RNIC loopback needs RDMA perftest), the all-to-all runs among processes on 127.0.0.1,
and the neighbour all-reduce connects only to the endpoints the caller (the controller) passes.

Every measurement has a deadline: a peer that never answers makes it raise ``NetCheckError`` with
what was waited for, instead of hanging.

Bus bandwidth follows nccl-tests: all-to-all ``bytes / t * (n - 1) / n``, all-reduce
``bytes / t * 2 * (n - 1) / n``, where ``bytes`` is one rank's buffer.

This module is also the all-to-all worker: ``python -m megascale.agent.selfcheck.net
alltoall --rank R --world K --port P --bytes B --backend gloo|nccl --timeout S`` (started by
``intranode_alltoall``; rank 0 prints the result as one JSON line).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

# torch at import, not inside the measurements: importing it takes seconds (more on a loaded
# node), which the callers' timed windows (a check's duration_s) must not include.
import torch
from torch import distributed as dist
from torch.distributed import ProcessGroupGloo

from megascale.launcher.job_store import serve_store

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class NetCheckError(RuntimeError):
    """A network measurement could not complete (peer unreachable, timed out, worker failed)."""


@dataclass(frozen=True)
class Bandwidth:
    """A measured bandwidth and how it was measured."""

    value: float
    unit: str
    detail: str


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every interface that has one, loopback included."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:  # no IPv4 address
                continue
            out.append((name, socket.inet_ntoa(packed[20:24])))
    return out


def loopback_addresses() -> list[tuple[str, str]]:
    """127.0.0.1 first, then every non-loopback local IPv4 address: the loopback test's targets."""
    others = [(i, a) for i, a in interface_addresses() if not a.startswith("127.")]
    return [("lo", "127.0.0.1"), *others]


def tcp_bandwidth(address: str, nbytes: int, timeout_s: float) -> Bandwidth:
    """Gbit/s of one TCP stream from this process to a listener on ``address`` (a local one)."""
    chunk = memoryview(bytearray(1 << 20))
    received = [0]
    with socket.create_server((address, 0)) as server:
        server.settimeout(timeout_s)
        port = server.getsockname()[1]

        def receive() -> None:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(timeout_s)
                buf = bytearray(1 << 20)
                while received[0] < nbytes:
                    n = conn.recv_into(buf)
                    if not n:
                        break
                    received[0] += n

        receiver = threading.Thread(target=receive, daemon=True)
        receiver.start()
        with socket.create_connection((address, port), timeout=timeout_s) as client:
            start = time.perf_counter()
            sent = 0
            while sent < nbytes:
                client.sendall(chunk[: min(len(chunk), nbytes - sent)])
                sent += min(len(chunk), nbytes - sent)
            receiver.join(timeout_s)
            elapsed = time.perf_counter() - start
    if received[0] < nbytes:
        raise NetCheckError(
            f"TCP {address}:{port}: {received[0]} of {nbytes} bytes arrived within {timeout_s} s"
        )
    return Bandwidth(
        nbytes * 8 / elapsed / 1e9, "Gbit/s", f"{nbytes >> 20} MiB over {address}:{port}"
    )


# -- intra-node all-to-all ----------------------------------------------------------------------


def intranode_alltoall(
    nprocs: int, nbytes: int, backend: str, timeout_s: float, iters: int = 3
) -> Bandwidth:
    """Bus bandwidth (GB/s) of ``all_to_all_single`` among ``nprocs`` local worker processes.

    The caller's process hosts the rendezvous store on 127.0.0.1; the workers are fresh Python
    processes (``backend`` "nccl": worker r uses GPU r). All are killed at ``timeout_s``.
    """
    store = serve_store("127.0.0.1", 0, None, datetime.timedelta(seconds=300))
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
    args = (
        f"alltoall --world {nprocs} --port {store.port} --bytes {nbytes} --backend {backend} "
        f"--iters {iters} --timeout {timeout_s}"
    ).split()
    # Files, not pipes: a worker that logs a lot must not block on a full pipe nobody reads.
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nprocs)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __name__, *args, "--rank", str(r)],
            stdout=logs[r][0],
            stderr=logs[r][1],
            text=True,
            env=env,
        )
        for r in range(nprocs)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        outs = []
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            outs.append((out.read(), err.read()))
    except subprocess.TimeoutExpired as e:
        raise NetCheckError(
            f"all-to-all among {nprocs} local {backend} processes did not finish in {timeout_s} s"
        ) from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in logs:
            out.close()
            err.close()
    failed = [(r, p.returncode, outs[r][1]) for r, p in enumerate(procs) if p.returncode]
    if failed:
        r, code, err = failed[0]
        tail = err.strip().splitlines()[-1:] or ["no stderr"]
        raise NetCheckError(f"all-to-all worker {r} exited {code}: {tail[0][:300]}")
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    busbw = nbytes / result["seconds"] * (nprocs - 1) / nprocs / 1e9
    return Bandwidth(
        busbw,
        "GB/s",
        f"{backend}, {nprocs} processes, {nbytes >> 20} MiB per rank, "
        f"{result['seconds'] * 1e3:.2f} ms per all-to-all (slowest rank)",
    )


def _alltoall_worker(args: argparse.Namespace) -> int:
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", args.port, None, False, timeout=timeout)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend,
        store=dist.PrefixStore("selfcheck/alltoall/", store),
        rank=args.rank,
        world_size=args.world,
        timeout=timeout,
    )
    count = args.bytes // 4 // args.world * args.world
    inp = torch.ones(count, dtype=torch.float32, device=device)
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)  # warm-up: connections, buffers
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_to_all_single(out, inp)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64)
    elapsed = elapsed.to(device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the bandwidth
    if args.rank == 0:
        sys.stdout.write(json.dumps({"seconds": float(elapsed.item())}) + "\n")
    dist.destroy_process_group()
    return 0


# -- neighbour all-reduce -----------------------------------------------------------------------


def _split(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r}: expected HOST:PORT, e.g. 10.0.0.2:29600")
    return host, int(port)


def neighbour_allreduce(
    self_endpoint: str, peers: list[str], nbytes: int, timeout_s: float, iters: int = 3
) -> Bandwidth:
    """Bus bandwidth (GB/s) of a gloo all-reduce over TCP between this node and ``peers``.

    Every node of the group calls this with its own endpoint and the others' (the controller
    picks the groups, e.g. nodes under one switch). Endpoints are ``HOST:PORT``: the group's
    ranks follow the sorted endpoints, the first one hosts the rendezvous store on its port, and
    each node's gloo transport binds its own ``HOST``. Runs in a daemon thread of this process (no
    global process group is created, so the node agent can call it); raises ``NetCheckError``
    naming the peers when the group does not form or finish within ``timeout_s`` (a peer that
    never comes fails it after about ``timeout_s``).
    """
    members = sorted({self_endpoint, *peers})
    if len(members) < 2:
        raise ValueError(f"neighbour all-reduce needs at least one peer besides {self_endpoint}")
    for endpoint in members:
        _split(endpoint)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["seconds"] = _allreduce_in_group(
                members, members.index(self_endpoint), nbytes, timeout_s, iters
            )
        except NetCheckError as e:
            outcome["why"] = str(e)
        except Exception as e:  # reported to the caller below
            outcome["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"

    thread = threading.Thread(target=work, name="selfcheck-neighbour-allreduce", daemon=True)
    thread.start()
    thread.join(2.5 * timeout_s + 5.0)  # the store's own timeouts end it well before this
    others = ", ".join(p for p in members if p != self_endpoint)
    if "seconds" not in outcome:
        error = str(outcome.get("error", ""))
        if "why" in outcome:
            why = str(outcome["why"])
        elif "DistNetworkError" in error:  # a client that cannot reach the store's host
            why = f"cannot reach {members[0]} (it hosts the group's store) within {timeout_s:g} s"
            why += f" ({error})"
        elif "DistStoreError" in error:  # the store's host, waiting for peers that never join
            why = f"peers did not join within {timeout_s:g} s ({error})"
        elif error:  # e.g. a peer that left in the middle of the all-reduce
            why = error
        else:
            why = f"hung: no result within {2.5 * timeout_s + 5.0:g} s"
        raise NetCheckError(f"all-reduce with {others} failed: {why}")
    n = len(members)
    seconds = float(outcome["seconds"])
    return Bandwidth(
        nbytes / seconds * 2 * (n - 1) / n / 1e9,
        "GB/s",
        f"gloo over TCP with {others}, {nbytes >> 20} MiB, {seconds * 1e3:.2f} ms per all-reduce",
    )


def _wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; NetCheckError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), max(0.1, deadline - time.monotonic())):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise NetCheckError(
                    f"cannot reach {host}:{port} (it hosts the group's store) within "
                    f"{timeout_s:g} s: {e}"
                ) from e
            time.sleep(0.2)


def _allreduce_in_group(
    members: list[str], rank: int, nbytes: int, timeout_s: float, iters: int
) -> float:
    """Form a gloo group of ``members`` (this node is ``rank``) and time an all-reduce."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store_host, store_port = _split(members[0])
    if rank != 0:  # fail within timeout_s, not after the store client's retries (~2x)
        _wait_reachable(store_host, store_port, timeout_s)
    if rank == 0:  # on the group's first endpoint's host only, not on every interface
        store = serve_store(store_host, store_port, len(members), timeout)
    else:
        store = dist.TCPStore(
            store_host, store_port, len(members), False, timeout=timeout, wait_for_workers=False
        )
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=_split(members[rank])[0])]
    options._timeout = timeout
    group = ProcessGroupGloo(
        dist.PrefixStore("selfcheck/allreduce/", store), rank, len(members), options
    )
    try:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32)
        group.allreduce([tensor]).wait()  # warm-up
        start = time.perf_counter()
        for _ in range(iters):
            group.allreduce([tensor]).wait()
        slowest = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        group.allreduce([slowest], opts).wait()
        # The store's host must outlive the others' last use of it.
        group.barrier().wait()
        return float(slowest.item())
    finally:
        group.shutdown()  # without it, destroying the group at exit can abort the process
        del group, store


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker processes (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m megascale.agent.selfcheck.net")
    sub = parser.add_subparsers(dest="command", required=True)
    a2a = sub.add_parser("alltoall")
    for name in ("--rank", "--world", "--port", "--bytes", "--iters"):
        a2a.add_argument(name, type=int, required=True)
    a2a.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    a2a.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv)
    return _alltoall_worker(args)


if __name__ == "__main__":
    sys.exit(main())
