"""Simulated node agents as coroutines: hundreds per process, on one asyncio event loop.

``AsyncSimAgent`` is the real agent (``SimAgent``: the ``Agent`` class with simulated workers)
whose five threads are replaced by five tasks on one event loop. Per node it makes the same etcd
requests as ``Agent.run``, over the same v3 JSON gateway as ``Store``:

* registration: ``/v3/lease/grant`` of ``lease_ttl(interval)`` s, then ``nodes/<node>`` put under
  it with ``Agent.registration()``; again under a new lease when etcd says the lease is gone (a
  put answering "lease not found", or a keep-alive answering TTL <= 0);
* keep-alive: ``/v3/lease/keepalive`` every TTL/3;
* heartbeat: ``heartbeats/<node>`` put every interval (and at once when woken), the payload built
  by ``Agent.heartbeat()``;
* two watches, each a long-lived ``/v3/watch`` stream: ``commands/<node>`` from the revision
  after a snapshot, and the controller's ``status`` key;
* commands: run by ``Agent.execute`` (``keys.is_current``, the done-id set, the ``_cmd_*``
  handlers), one at a time; the ack (``ack_message``) put and retried until etcd takes it.

The HTTP client (``GatewayClient``) is a minimal HTTP/1.1 client over asyncio streams: the
agents' CPU per request bounds how many simulated nodes fit beside etcd on one machine, and
aiohttp spent ~245 us per put (~135 us with 50 in flight) where this client spends ~110 us (~50
us). It shares one pool of keep-alive connections among a process's unary calls and opens one
connection per watch stream, so etcd sees two watch streams per node, as real agents do.

``kill()`` makes a node vanish as ``SimAgent.kill`` does: no more heartbeats, keep-alives or acks
and no revoke, so its lease expires. ``async_agents_main`` runs one process's agents for
``scenario.run_scenario``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from megascale.agent.service import TERMINAL_STATES, AgentOptions
from megascale.etcd.store import (
    KeyValue,
    Lease,
    LeaseNotFound,
    Snapshot,
    Store,
    StoreConfig,
    StoreError,
    StoreUnavailable,
    WatchEvent,
    encode,
)
from megascale.etcd.store.client import _RETRYABLE_CODES
from megascale.etcd.store.config import _split_endpoint
from megascale.etcd.store.values import _b64, _prefix_end
from megascale.messages import Command, ControllerStatus, GenerationRecord, decoded
from megascale.tools.sim.agents import SimAgent

logger = logging.getLogger(__name__)

# What a failed exchange with the gateway raises: refused or reset connections (OSError), a
# connection closed mid-answer (IncompleteReadError is an EOFError), a timeout, an oversized line.
_NETWORK_ERRORS = (OSError, EOFError, TimeoutError, asyncio.LimitOverrunError)


class _Http:
    """HTTP/1.1 POSTs of JSON to one etcd gateway, over asyncio streams.

    Only what the gateway sends is understood: a status line, then a body framed by
    ``Content-Length`` (unary answers) or chunked (``/v3/lease/keepalive`` and ``/v3/watch``, which
    grpc-gateway streams). ``post`` keeps up to ``pool_size`` connections open and reuses them; a
    connection is closed, never reused, after any error or cancellation in the middle of an
    exchange (its answer may still be on the way). Malformed answers raise ``ConnectionError``.
    """

    def __init__(self, host: str, port: int, pool_size: int) -> None:
        self.host, self.port = host, port
        self._head = f"HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(pool_size)

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """One request on a pooled connection: the status and the whole body."""
        async with self._slots:
            if self._idle:
                reader, writer = self._idle.pop()
                try:
                    return await self._exchange(reader, writer, path, payload)
                except (ConnectionError, EOFError):
                    pass  # etcd closed the idle connection: once more on a fresh one
            reader, writer = await asyncio.open_connection(self.host, self.port)
            return await self._exchange(reader, writer, path, payload)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, payload: bytes
    ) -> tuple[int, bytes]:
        try:
            writer.write(self.request(path, payload))
            status, fields = await self.read_head(reader)
            body = await self.read_body(reader, fields)
        except BaseException:
            writer.close()
            raise
        if b"\r\nconnection: close" in fields:
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, body

    def request(self, path: str, payload: bytes) -> bytes:
        head = f"POST {path} {self._head}Content-Length: {len(payload)}\r\n\r\n"
        return head.encode() + payload

    @staticmethod
    async def read_head(reader: asyncio.StreamReader) -> tuple[int, bytes]:
        """The status and the header fields, lower-cased (each line starts with CRLF)."""
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.") or not head[9:12].isdigit():
            raise ConnectionError(f"not an HTTP/1.x answer: {head[:80]!r}")
        return int(head[9:12]), head[head.find(b"\r\n") :].lower()

    @staticmethod
    async def read_body(reader: asyncio.StreamReader, fields: bytes) -> bytes:
        """The whole body of an answer whose header ``fields`` ``read_head`` returned."""
        if b"\r\ntransfer-encoding: chunked" in fields:
            return b"".join([chunk async for chunk in _Http.chunks(reader)])
        start = fields.find(b"\r\ncontent-length:")
        if start < 0:
            raise ConnectionError("answer has neither Content-Length nor chunked encoding")
        start += len(b"\r\ncontent-length:")
        return await reader.readexactly(int(fields[start : fields.index(b"\r\n", start)]))

    @staticmethod
    async def chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """The chunks of a chunked body, until its last chunk (trailers are skipped)."""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0], 16)
            except ValueError:
                raise ConnectionError(f"bad chunk size line {size_line[:80]!r}") from None
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()


class GatewayClient:
    """The etcd calls an agent makes, as coroutines over etcd's v3 JSON gateway (plain HTTP).

    Unary calls share a pool of ``pool_size`` keep-alive connections; each has
    ``request_timeout_s`` (waiting for a connection included) and, like ``Store``, is retried
    with backoff for ``retry_s`` while etcd is unreachable or has no leader, then raises
    ``StoreUnavailable``. Errors etcd answers with are raised as ``Store`` raises them
    (``LeaseNotFound``, ``StoreError``). Make and close it inside the event loop.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        pool_size: int = 32,
        request_timeout_s: float = 2.0,
        retry_s: float = 1.0,
    ) -> None:
        tls, host, port = _split_endpoint(endpoint)
        if tls:
            raise ValueError(f"GatewayClient endpoint {endpoint!r}: only http:// is supported")
        self._base = f"http://{host}:{port}"
        self.retry_s = retry_s
        self.request_timeout_s = request_timeout_s
        self._http = _Http(host, port, pool_size)

    async def close(self) -> None:
        self._http.close()

    async def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` (e.g. ``/v3/kv/put``); the decoded JSON answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_s
        payload = json.dumps(body).encode()
        backoff = 0.02
        while True:
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    status, data = await self._http.post(path, payload)
                if status == 200:
                    return json.loads(data) if data else {}
                error = Store._error(status, data)
                if error.code not in _RETRYABLE_CODES:
                    raise error
                reason: Exception = error
            except _NETWORK_ERRORS as e:
                reason = e
            if loop.time() + backoff > deadline:
                raise StoreUnavailable(
                    f"etcd at {self._base} unavailable for {self.retry_s} s ({path}): {reason}",
                    code=14,
                ) from reason
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    async def put(self, key: str, value: Any, lease: int = 0) -> int:
        """As ``Store.put``: the new store revision; LeaseNotFound when ``lease`` has ended."""
        body = {"key": _b64(key), "value": _b64(encode(value)), "lease": str(lease)}
        return int((await self.call("/v3/kv/put", body))["header"]["revision"])

    async def get(self, key: str) -> KeyValue | None:
        kvs = (await self.call("/v3/kv/range", {"key": _b64(key)})).get("kvs", [])
        return KeyValue._from(kvs[0]) if kvs else None

    async def snapshot(self, prefix: str) -> Snapshot:
        """As ``Store.snapshot``: the keys under ``prefix`` and the revision they were read at."""
        body = {
            "key": _b64(prefix),
            "range_end": _prefix_end(prefix),
            "sort_target": "KEY",
            "sort_order": "ASCEND",
        }
        reply = await self.call("/v3/kv/range", body)
        items = [KeyValue._from(kv) for kv in reply.get("kvs", [])]
        return Snapshot(items, int(reply["header"]["revision"]))

    async def grant(self, ttl: int) -> Lease:
        reply = await self.call("/v3/lease/grant", {"TTL": str(ttl)})
        if reply.get("error"):
            raise StoreError(f"lease grant failed: {reply['error']}")
        return Lease(id=int(reply["ID"]), ttl=int(reply["TTL"]))

    async def refresh(self, lease: int) -> int:
        """Renew the lease once; its TTL. LeaseNotFound when it has ended (etcd answers TTL 0)."""
        reply = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        ttl = int(reply.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseNotFound(f"lease {lease:x} not found", code=5)
        return ttl

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except LeaseNotFound:
            pass

    async def watch(
        self,
        key: str,
        start_revision: int | None,
        callback: Callable[[WatchEvent], None],
        created: asyncio.Event,
    ) -> None:
        """Call ``callback`` with each change of ``key`` from ``start_revision`` (None: changes
        after the watch is created) until cancelled; ``created`` is set once etcd confirmed the
        watch. A dropped stream is re-watched from the revision after the last event delivered,
        as ``Store``'s watches do."""
        next_revision = start_revision
        backoff = 0.02
        while True:
            request: dict[str, Any] = {"key": _b64(key)}
            if next_revision:
                request["start_revision"] = str(next_revision)
            body = json.dumps({"create_request": request}).encode()
            try:
                async with contextlib.aclosing(self._stream("/v3/watch", body)) as messages:
                    async for message in messages:
                        result = _watch_result(message)
                        if result.get("created"):
                            if not next_revision:
                                next_revision = int(result["header"]["revision"]) + 1
                            created.set()
                        for raw in result.get("events", ()):
                            kv = KeyValue._from(raw.get("kv", {}))
                            kind = "delete" if raw.get("type") == "DELETE" else "put"
                            next_revision = kv.mod_revision + 1
                            callback(WatchEvent(kind, kv.key, kv.value, kv.mod_revision, kv.lease))
                backoff = 0.02  # etcd closed the stream: watch again
            except (*_NETWORK_ERRORS, ValueError, StoreError) as e:
                logger.debug("watch on %s dropped (%s); re-watching", key, e)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    async def _stream(self, path: str, payload: bytes) -> AsyncIterator[dict]:
        """The JSON messages of one streamed answer (one per line), on a connection of its own,
        closed when the stream ends or the iterator is closed (use ``contextlib.aclosing``).
        Connecting has ``request_timeout_s``; the stream itself has no timeout."""
        http = self._http
        async with asyncio.timeout(self.request_timeout_s):
            reader, writer = await asyncio.open_connection(http.host, http.port)
        try:
            writer.write(http.request(path, payload))
            status, fields = await http.read_head(reader)
            if status != 200:
                raise Store._error(status, await http.read_body(reader, fields))
            if b"\r\ntransfer-encoding: chunked" not in fields:
                raise ConnectionError(f"{path} answered without streaming")
            pending = b""
            async for chunk in http.chunks(reader):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        finally:
            writer.close()


def _watch_result(message: dict) -> dict:
    """The ``result`` of one watch stream message; StoreError for an error or a cancelled watch
    (megascale never compacts, so a compacted start revision is an error here too)."""
    if "error" in message:
        raise Store._error(0, json.dumps(message["error"]).encode())
    result = message.get("result", {})
    if result.get("canceled") or int(result.get("compact_revision", 0)):
        raise StoreError(f"etcd cancelled the watch: {result}")
    return result


class AsyncSimAgent(SimAgent):
    """``SimAgent`` driven by coroutines (see the module docstring); start it with ``serve()``,
    never with the threaded ``run()``.

    All etcd calls go through ``etcd``; the synchronous ``store`` the base class holds is never
    used. Every method runs on the event loop's thread, so the base class's handlers (which call
    ``wake()``) run unchanged.
    """

    def __init__(self, etcd: GatewayClient, store: Store, opts: AgentOptions) -> None:
        super().__init__(store, opts)
        self.etcd = etcd
        self._woken = asyncio.Event()
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._keepalive_task: asyncio.Task | None = None
        self._refreshing = False  # a keep-alive request is on its way to etcd

    def wake(self) -> None:
        self._woken.set()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self) -> None:
        """Start the main loop and the command loop as tasks of the running event loop."""
        self._spawn(self.serve())
        self._spawn(self._command_loop_async())

    async def serve(self) -> int:
        """``Agent.run``'s loop: register when needed, heartbeat every interval (or when woken),
        end when the job's status is terminal and no worker runs."""
        while not self.stopping.is_set():
            if self._need_register.is_set():
                await self._register_async()
            if not self._need_register.is_set():
                await self._beat_async()
            if self._job_state in TERMINAL_STATES and not self.pool.running():
                return 0 if self._job_state == "finished" else 1
            try:
                async with asyncio.timeout(self.opts.heartbeat_interval):
                    await self._woken.wait()
            except TimeoutError:
                pass
            self._woken.clear()
        return 0

    async def kill(self) -> float:  # type: ignore[override]  # awaited on the agents' loop
        """The node vanishes: every task ends, the lease is not revoked (it expires); returns the
        wall time from which it is gone. A keep-alive already sent is let finish first, as the
        thread agent's ``kill`` joins its keep-alive thread: cancelling it would only close our
        end, and etcd could still renew the lease after the time returned."""
        self.killed = True
        self.stopping.set()
        in_flight = self._keepalive_task if self._refreshing else None
        for task in list(self._tasks):
            if task is not in_flight:
                task.cancel()
        if in_flight is not None:
            await asyncio.wait({in_flight}, timeout=5.0)  # the loop ends once it sees ``killed``
            in_flight.cancel()
        return time.time()

    async def shutdown(self) -> None:
        """Stop as an agent told to stop does: end every task, then revoke the lease."""
        self.stopping.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._lease is not None and not self.killed:
            try:
                await self.etcd.revoke(self._lease.id)
            except StoreError as e:
                logger.warning("could not revoke the lease: %s", e)

    async def _register_async(self) -> None:
        """As ``Agent._register``: watches (first time only), a new lease kept alive, the node
        key under it. On a store error, tried again at the next beat."""
        try:
            if not self._watches:
                await self._watch_commands_async()
            if self._keepalive_task is not None:
                self._keepalive_task.cancel()
            self._lease = await self.etcd.grant(self.opts.lease_ttl)
            self._keepalive_task = self._spawn(self._keep_alive(self._lease))
            node_key = self.keys.node(self.opts.node)
            await self.etcd.put(node_key, self.registration(), lease=self._lease.id)
        except StoreError as e:
            self._etcd_failed(e)
            return
        self._need_register.clear()
        self._etcd_back()

    async def _watch_commands_async(self) -> None:
        """As ``Agent._watch_commands``: commands from the revision after a snapshot of the key
        (an older command is never run), and the job status."""
        generation = await self.etcd.get(self.keys.generation)
        if generation is not None:
            self.generation = max(
                self.generation, GenerationRecord.decode(generation.json()).generation
            )
        command_key = self.keys.command(self.opts.node)
        start = (await self.etcd.snapshot(command_key)).revision + 1
        await self._watch(command_key, start, self._on_command)
        await self._watch(self.keys.status, None, self._on_status)
        status = await self.etcd.get(self.keys.status)
        if status is not None:
            self._job_state = ControllerStatus.decode(status.json()).state

    async def _watch(self, key: str, start: int | None, callback: Callable) -> None:
        created = asyncio.Event()
        task = self._spawn(self.etcd.watch(key, start, callback, created))
        try:
            async with asyncio.timeout(self.etcd.retry_s):
                await created.wait()
        except TimeoutError:
            task.cancel()
            raise StoreUnavailable(
                f"watch on {key} not established in {self.etcd.retry_s} s"
            ) from None
        self._watches.append(task)

    def _on_command(self, event: WatchEvent) -> None:
        if event.kind == "put":
            command = decoded(Command, event)
            if command is not None:
                self._inbox.put_nowait(command)

    async def _keep_alive(self, lease: Lease) -> None:
        """As ``KeepAlive``: refresh every TTL/3; when etcd says the lease is gone, register
        again (``Agent._lease_lost``); other failures are retried at the next refresh."""
        while not self.killed:
            await asyncio.sleep(max(lease.ttl / 3.0, 0.05))
            if self.killed:
                return
            self._refreshing = True
            try:
                await self.etcd.refresh(lease.id)
            except LeaseNotFound:
                self._lease_lost(lease)
                return
            except StoreError as e:
                logger.warning("lease %x keepalive failed, retrying: %s", lease.id, e)
            finally:
                self._refreshing = False

    async def _beat_async(self) -> None:
        """As ``Agent._beat``: put ``heartbeat()`` under the lease."""
        assert self._lease is not None
        payload = self.heartbeat().encode()
        try:
            await self.etcd.put(self.keys.heartbeat(self.opts.node), payload, self._lease.id)
        except LeaseNotFound:
            self._need_register.set()
        except StoreError as e:
            self._etcd_failed(e)
        else:
            self._etcd_back()

    async def _command_loop_async(self) -> None:
        """As ``Agent._command_loop``: one command at a time through ``Agent.execute``, its ack
        retried until written."""
        while True:
            ack = self.execute(await self._inbox.get())
            while ack is not None and not self.stopping.is_set():
                try:
                    await self.etcd.put(self.keys.ack(self.opts.node), ack)
                    ack = None
                except StoreError as e:
                    self._etcd_failed(e)
                    await asyncio.sleep(min(1.0, self.opts.heartbeat_interval))


def async_agents_main(
    endpoint: str,
    job: str,
    nodes: list[str],
    interval: float,
    run_dir: str,
    conn: Any,
) -> None:
    """One simulator process: run ``nodes`` as ``AsyncSimAgent``s on one event loop; obey
    ``("kill", node)`` and ``("exit",)`` from ``conn`` as ``agents.agents_main`` does."""
    logging.getLogger().setLevel(logging.ERROR)
    asyncio.run(_serve_agents(endpoint, job, nodes, interval, run_dir, conn))


async def _serve_agents(
    endpoint: str, job: str, nodes: list[str], interval: float, run_dir: str, conn: Any
) -> None:
    # As the real agent's client: each call gives up after max(0.5, interval), 2 s per request.
    etcd = GatewayClient(endpoint, retry_s=max(0.5, interval), request_timeout_s=2.0)
    store = Store(StoreConfig.parse(endpoint))
    agents: dict[str, AsyncSimAgent] = {}
    for node in nodes:
        opts = AgentOptions(
            job_id=job,
            node=node,
            run_dir=Path(run_dir),
            config=None,
            heartbeat_interval=interval,
            metrics_port=-1,  # no Prometheus server per simulated node
        )
        agents[node] = AsyncSimAgent(etcd, store, opts)
        agents[node].start()
        await asyncio.sleep(0.002)  # a ramp, as pods starting: not one burst of N lease grants
    conn.send(("ready", len(agents)))
    done = asyncio.Event()
    kills: set[asyncio.Task] = set()

    async def kill(node: str) -> None:
        conn.send(("killed", await agents[node].kill()))

    def on_message() -> None:
        message = conn.recv()
        if message[0] == "kill":
            task = asyncio.get_running_loop().create_task(kill(message[1]))
            kills.add(task)
            task.add_done_callback(kills.discard)
        else:
            done.set()

    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), on_message)
    await done.wait()
    loop.remove_reader(conn.fileno())
    try:
        async with asyncio.timeout(10):
            await asyncio.gather(*(agent.shutdown() for agent in agents.values()))
    except TimeoutError:
        logger.warning("not every simulated agent revoked its lease in 10 s")
    await etcd.close()


__all__ = ["AsyncSimAgent", "GatewayClient", "async_agents_main"]
