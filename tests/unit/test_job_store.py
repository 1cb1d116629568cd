"""The ranks of a worker group agree on a fresh key prefix in a store that an earlier group of
the same job used (torchrun's shared agent store), and rank 0's own store listens on
MASTER_ADDR only."""

from __future__ import annotations

import datetime
import socket
from concurrent.futures import ThreadPoolExecutor

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
