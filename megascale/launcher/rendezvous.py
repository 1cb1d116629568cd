"""Communication-group setup as store traffic: what megatron-core's group creation asks of the
rendezvous store, on PyTorch's default path and on ours, and a replay of it against a real store.

Every rank of a megatron-core job calls ``torch.distributed.new_group`` for *every* group of the
job, in the same order (``megatron_groups`` lists them, from ``Layout``). What each call costs the
default store (a ``TCPStore`` on rank 0) is modeled from torch's ``distributed_c10d`` (2.13):

* NCCL group of size g: the group's first rank ``set``s the NCCL unique id under the group's
  ``PrefixStore``; the other g - 1 members ``get`` it (a blocking get).
* gloo group of size g (megatron's ``*_GLOO`` data-parallel groups): gloo's full-mesh connect --
  every member ``set``s its address and ``get``s each of the g - 1 others: g^2 operations.
* with ``TORCH_DIST_INIT_BARRIER=1`` (torch < 2.1 always; what MegaScale measured): after each
  ``new_group`` a store-based barrier over the *whole world* (``_store_based_barrier``: per rank
  ``add(key, 1)``, ``add(key, 0)``, ``wait(last_worker)``), members or not: O(groups x world).

Ours (``ours_ops``): every rank computes every group from the layout (pure rank math), so the
store carries only what cannot be computed: one world barrier, one NCCL id per group of size > 1
(``set`` by its first rank), and one batched ``multi_get`` per rank of the ids of its own groups.
No gloo full mesh (megatron's ``create_gloo_process_groups=False``; gloo groups, where needed on
CPU, are created lazily for the groups that use them). O(world) operations in all.

``replay`` runs an operation stream against a live ``torch.distributed.TCPStore`` from a few
client threads (writes of a batch of groups first, then their reads, so no blocking read waits on
a write that has not been issued). Operation counts are exact; time for a stream too long to replay
is the replayed sample's time scaled by the count (``Replay.estimated_s``).
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from megascale.parallel.layout import Layout

logger = logging.getLogger(__name__)

NCCL_ID_BYTES = 128
"""Size of an ``ncclUniqueId``."""


@dataclass(frozen=True)
class GroupSpec:
    """One ``new_group`` call: which kind of group, its ranks, its backend."""

    kind: str
    ranks: tuple[int, ...]
    backend: str  # "nccl" | "gloo"


@dataclass(frozen=True)
class Op:
    """One store operation: ``set``/``get``/``add``/``wait``/``multi_get`` on ``keys``."""

    kind: str
    keys: tuple[str, ...]
    value: bytes = b""

    @property
    def is_write(self) -> bool:
        return self.kind in ("set", "add")


def megatron_groups(layout: Layout, *, gloo: bool = True) -> list[GroupSpec]:
    """The groups megatron-core 0.16 ``initialize_model_parallel`` creates for ``layout`` (context
    and expert parallelism 1; the expert groups, which repeat the data-parallel ones, left out),
    in its creation order: data-parallel with and without context parallelism (NCCL, and gloo
    twins unless ``gloo`` is False: ``create_gloo_process_groups=False``, as
    ``parallel.build_groups`` calls it), context-parallel (singletons), model-parallel,
    tensor-parallel, pipeline, embedding, position-embedding, tensor+data-parallel (twice, with
    and without cp)."""
    dp, tp, pp = layout.dp_groups(), layout.tp_groups(), layout.pp_groups()
    mp = [
        [layout.rank(dp=d, pp=p, tp=t) for p in range(layout.pp) for t in range(layout.tp)]
        for d in range(layout.dp)
    ]
    tp_dp = [
        [layout.rank(dp=d, pp=p, tp=t) for d in range(layout.dp) for t in range(layout.tp)]
        for p in range(layout.pp)
    ]
    twins = ("nccl", "gloo") if gloo else ("nccl",)
    kinds: list[tuple[str, list[list[int]], tuple[str, ...]]] = [
        ("dp-cp", dp, twins),
        ("dp", dp, twins),
        ("cp", [[r] for r in range(layout.world_size)], ("nccl",)),
        ("mp", mp, ("nccl",)),
        ("tp", tp, ("nccl",)),
        ("pp", pp, ("nccl",)),
        ("embd", layout.embedding_groups(), ("nccl",)),
        ("pos-embd", [[g[0]] for g in pp], ("nccl",)),
        ("tp-dp-cp", tp_dp, ("nccl",)),
        ("tp-dp", tp_dp, ("nccl",)),
    ]
    return [
        GroupSpec(kind, tuple(ranks), backend)
        for kind, groups, backends in kinds
        for ranks in groups
        for backend in backends
    ]


def groups_of(layout: Layout, rank: int) -> list[int]:
    """Indices (into ``megatron_groups``) of the groups ``rank`` belongs to, computed locally:
    what lets each rank skip the store for every group it is not in."""
    return [i for i, g in enumerate(megatron_groups(layout)) if rank in g.ranks]


def _world_barrier(tag: str, world: int) -> tuple[list[Op], list[Op]]:
    key = f"store_based_barrier_key:{tag}"
    writes = [Op("add", (key,), b"1") for _ in range(world)] + [Op("set", (f"{key}:last",), b"1")]
    reads = [
        op for _ in range(world) for op in (Op("add", (key,), b"0"), Op("wait", (f"{key}:last",)))
    ]
    return writes, reads


def default_ops(
    layout: Layout, *, barrier: bool, sample_every: int = 1, gloo: bool = True
) -> Iterator[tuple[list[Op], list[Op]]]:
    """The default path, per ``new_group`` call: (its writes, its reads). ``barrier``: with the
    world barrier after each call (``TORCH_DIST_INIT_BARRIER=1``). ``sample_every``: only every
    k-th group (a uniform sample, for streams too long to replay whole). ``gloo``: with the gloo
    twins of the data-parallel groups."""
    yield _world_barrier("init", layout.world_size)
    for i, g in enumerate(megatron_groups(layout, gloo=gloo)):
        if i % sample_every:
            continue
        pre, size = f"{i}/", len(g.ranks)
        if g.backend == "nccl":
            writes = [Op("set", (pre + "nccl_id",), b"x" * NCCL_ID_BYTES)]
            reads = [Op("get", (pre + "nccl_id",)) for _ in range(size - 1)]
        elif size > 1:
            writes = [Op("set", (f"{pre}gloo/{r}",), b"127.0.0.1:29500") for r in range(size)]
            reads = [
                Op("get", (f"{pre}gloo/{p}",)) for r in range(size) for p in range(size) if p != r
            ]
        else:
            writes, reads = [], []
        if barrier:
            bw, br = _world_barrier(str(i), layout.world_size)
            writes, reads = writes + bw, reads + br
        yield writes, reads


def ours_ops(layout: Layout) -> Iterator[tuple[list[Op], list[Op]]]:
    """Our path: one world barrier, one id per multi-rank NCCL group, one ``multi_get`` per rank."""
    yield _world_barrier("init", layout.world_size)
    groups = megatron_groups(layout)
    mine: list[list[str]] = [[] for _ in range(layout.world_size)]
    writes = []
    for i, g in enumerate(groups):
        if g.backend != "nccl" or len(g.ranks) < 2:
            continue
        writes.append(Op("set", (f"{i}/nccl_id",), b"x" * NCCL_ID_BYTES))
        for r in g.ranks[1:]:
            mine[r].append(f"{i}/nccl_id")
    yield writes, [Op("multi_get", tuple(keys)) for keys in mine if keys]


def count_ops(batches: Iterator[tuple[list[Op], list[Op]]]) -> Counter[str]:
    """Operations by kind (a ``multi_get`` counts once: one round trip)."""
    counts: Counter[str] = Counter()
    for writes, reads in batches:
        counts.update(op.kind for op in writes)
        counts.update(op.kind for op in reads)
    return counts


def default_op_count(layout: Layout, *, barrier: bool, gloo: bool = True) -> int:
    """Exact number of store round trips of the default path (closed form of ``default_ops``)."""
    world, total = layout.world_size, 3 * layout.world_size + 1
    for g in megatron_groups(layout, gloo=gloo):
        size = len(g.ranks)
        total += size if g.backend == "nccl" else (size * size if size > 1 else 0)
        if barrier:
            total += 3 * world + 1
    return total


@dataclass(frozen=True)
class Replay:
    """A replayed operation stream: ``ops`` issued in ``elapsed_s``, out of ``total_ops``."""

    ops: int
    total_ops: int
    elapsed_s: float

    @property
    def estimated_s(self) -> float:
        """Time for the whole stream at the replayed rate."""
        return self.elapsed_s * self.total_ops / max(self.ops, 1)


class _Clients:
    """One ``TCPStore`` client per thread (as each rank holds its own)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._local = threading.local()

    def get(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            from torch.distributed import TCPStore

            client = TCPStore(self.host, self.port, is_master=False, wait_for_workers=False)
            self._local.client = client
        return client


def _issue(clients: _Clients, prefix: str, ops: list[Op]) -> None:
    store = clients.get()
    for op in ops:
        keys = [prefix + k for k in op.keys]
        if op.kind == "set":
            store.set(keys[0], op.value)
        elif op.kind == "add":
            store.add(keys[0], int(op.value))
        elif op.kind == "get":
            store.get(keys[0])
        elif op.kind == "wait":
            store.wait(keys)
        else:
            store.multi_get(keys)


def replay(
    batches: Iterator[tuple[list[Op], list[Op]]],
    total_ops: int,
    *,
    threads: int = 4,
    prefix: str = "",
    chunk_ops: int = 20_000,
) -> Replay:
    """Issue ``batches`` against a fresh ``TCPStore`` server on loopback from ``threads`` client
    threads: the writes of about ``chunk_ops`` operations' worth of batches, then their reads."""
    from megascale.launcher.job_store import serve_store

    server = serve_store("127.0.0.1", 0, None, datetime.timedelta(seconds=300))
    clients = _Clients("127.0.0.1", server.port)
    done = 0
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: clients.get(), range(threads)))  # connect before timing
        start = time.perf_counter()
        writes: list[Op] = []
        reads: list[Op] = []
        for w, r in batches:
            writes += w
            reads += r
            if len(writes) + len(reads) >= chunk_ops:
                done += _run(pool, clients, prefix, writes, reads, threads)
                writes, reads = [], []
        done += _run(pool, clients, prefix, writes, reads, threads)
        elapsed = time.perf_counter() - start
    del server
    return Replay(done, total_ops, elapsed)


def _run(pool: Any, clients: _Clients, prefix: str, writes: list[Op], reads: list[Op], k: int):
    for ops in (writes, reads):  # every write of the batch is issued before any read
        step = math.ceil(len(ops) / k) or 1
        slices = [ops[s : s + step] for s in range(0, len(ops), step)]
        list(pool.map(lambda part: _issue(clients, prefix, part), slices))
    return len(writes) + len(reads)
