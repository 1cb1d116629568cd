"""NCCL-like collectives on CPU: every collective and p2p call returns to the host at once and runs
later on a communication thread, one per process group, in issue order (as an NCCL stream does).

``AsyncComm().install()`` stands in front of torch.distributed's collective and p2p functions,
``batch_isend_irecv`` and megatron-core's aliases (``megascale.parallel.comm_hooks``). Install it
*before* the flight recorder, so that the recorder (stacked on top) sees the host's calls and the
handles they return. Each call becomes a ``CommOp`` queued on its group's thread; that thread runs
the real gloo call and marks the op started and completed. The numerics are gloo's: the same ops
run on each group in the same order.

Ordering, the CUDA stream model mapped onto a CPU host that is its own compute stream:

* a synchronous call (``async_op=False``) is "on the current stream": it returns at once, and the
  host's next torch call (the CPU backend's ``TorchFunctionMode`` calls ``compute_gate``) waits for
  it, as a kernel queued behind it would on a GPU. Inside autograd's backward, where its output
  goes straight into C++ kernels, the call waits before returning;
* an asynchronous call (``async_op=True``, ``isend``/``irecv``, ``batch_isend_irecv``, an
  ``async_ops`` coalescing block) returns a handle; ``wait()`` blocks until it completed;
* every op first waits for the synchronous ops issued before it (an NCCL op's stream waits for the
  current stream); ops on one group run in issue order; ``torch.cuda.synchronize()`` drains all.

A cost model (``set_cost``, used by ``megascale.overlap.trace``) prices each op when the host
issues it; its thread then waits out that time before running the op, as a transfer of that
length would keep an NCCL stream busy, while the host computes on.

``halt()`` makes every communication thread stop before its next op, forever: a dead NIC or a stuck
NCCL kernel; the host goes on issuing until it blocks on a result (``hang-comm`` injection).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megascale.parallel import cpu_backend
from megascale.parallel.comm_hooks import CommWrapper, Patches, comm_thread_flag

logger = logging.getLogger(__name__)

# The functions routed through the communication threads (object collectives call these).
ROUTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
_ALWAYS_ASYNC = ("isend", "irecv")
_monotonic = time.monotonic


class CommOp:
    """One queued op (or a batch / coalescing block): a work handle as torch's ``Work`` is.

    ``enqueued``, ``started``, ``completed`` are monotonic seconds (0.0: not yet). ``wait()``
    blocks until completion and re-raises the op's error; ``is_completed()`` never blocks;
    ``observe(fn)`` has the communication thread call ``fn(op)`` when it starts and completes it.
    """

    def __init__(
        self,
        name: str,
        run: Callable[[], object],
        deps: list[CommOp],
        cost_s: float = 0.0,
        on_cost: Callable[[float, float], None] | None = None,
    ) -> None:
        self.name, self._run, self.deps = name, run, deps
        self.cost_s, self._on_cost = cost_s, on_cost
        self.enqueued, self.started, self.completed = _monotonic(), 0.0, 0.0
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._observers: list[Callable[[CommOp], None]] = []

    def is_completed(self) -> bool:
        return self._done.is_set()

    @property
    def duration(self) -> float | None:
        """Seconds from its start to its completion on the communication thread (None before)."""
        return self.completed - self.started if self.completed and self.started else None

    def is_success(self) -> bool:
        return self._done.is_set() and self.error is None

    def exception(self) -> BaseException | None:
        return self.error

    def observe(self, fn: Callable[[CommOp], None]) -> None:
        """Call ``fn(self)`` on the communication thread when the op starts and when it completes
        (before ``wait()`` returns), and at once here if it has started already. ``fn`` may be
        called twice for one state (racing with the thread): it must be idempotent, and it must
        not block (it delays the group's next op)."""
        self._observers.append(fn)
        if self.started:
            fn(self)

    def _notify(self) -> None:
        for fn in self._observers:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - an observer must not stop the communication thread
                logger.exception("observer of %s failed", self.name)

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"{self.name} failed on its communication thread") from self.error
        return True

    def execute(self) -> None:
        """Run on the group's thread: wait for the ops it depends on, run, mark completion."""
        for dep in self.deps:
            dep._done.wait()
        self.deps = []
        self.started = _monotonic()  # the stream begins the op: its modelled transfer is part of it
        if self._observers:
            self._notify()
        if self.cost_s > 0:  # the modelled transfer: this stream is busy for that long
            start = _monotonic()
            time.sleep(self.cost_s)
            if self._on_cost is not None:
                self._on_cost(start, _monotonic())
        try:
            work = self._run()
            for w in work if isinstance(work, list) else [work]:
                if w is not None and hasattr(w, "wait"):
                    w.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised on the host by wait()
            self.error = e
            logger.exception("%s failed on its communication thread", self.name)
        self.completed = _monotonic()
        self._run = None
        if self._observers:
            self._notify()  # before wait() returns: the record says completed when the host goes on
        self._done.set()


class _Channel:
    """A process group's communication thread (daemon: a halted one never ends)."""

    def __init__(self, engine: AsyncComm, label: str) -> None:
        self.engine = engine
        self.queue: queue.SimpleQueue[CommOp] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"comm-{label}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        comm_thread_flag.active = True
        # Collectives are not differentiable; the host issues most of them inside autograd
        # Functions, where grad mode is off, and gloo's in-place writes must not trip its checks.
        torch.set_grad_enabled(False)
        while True:
            op = self.queue.get()
            if self.engine.halted.is_set():
                self.engine.resumed.wait()  # a dead link: this op and the ones after never run
            op.execute()


class _Routed(CommWrapper):
    """Host side of one routed function: queue the call, return at once."""

    def __init__(self, name: str, original: Callable, engine: AsyncComm) -> None:
        super().__init__(name, original)
        self.engine = engine
        params = list(inspect.signature(original).parameters)
        self.group_at = params.index("group") if "group" in params else -1
        self.async_at = params.index("async_op") if "async_op" in params else -1

    def __call__(self, *args, **kwargs):
        engine = self.engine
        if comm_thread_flag.active or not engine.active:
            return self.original(*args, **kwargs)
        n = len(args)
        group = args[self.group_at] if 0 <= self.group_at < n else kwargs.get("group")
        capture = engine.local.capture
        if capture is not None and capture[0] == _key(group):  # inside a coalescing block
            capture[1].append((self.name, self.original, args, kwargs))
            return capture[2]
        at = self.async_at
        is_async = self.name in _ALWAYS_ASYNC or (
            at >= 0 and bool(args[at] if n > at else kwargs.get("async_op"))
        )
        original = self.original
        cost = engine.price(self.name, group, args, kwargs)
        op = engine.submit(self.name, group, lambda: original(*args, **kwargs), is_async, cost)
        if self.name == "barrier":
            op.wait()  # a barrier holds the host (NCCL's synchronises the device too)
        return op if is_async else None


def p2p_name(op) -> str:
    """``"isend"`` or ``"irecv"``: the name of a ``P2POp``'s function, wrapped or not."""
    fn = op.op
    return getattr(fn, "name", None) or fn.__name__


def _key(group) -> object:
    return distributed_c10d.GroupMember.WORLD if group is None else group


class _Local(threading.local):
    capture: tuple[object, list, CommOp] | None = None
    last: CommOp | None = None


class AsyncComm:
    """The NCCL-like mode of one process: ``install()`` once (after megatron-core is imported,
    before the flight recorder), ``uninstall()`` to restore (ops already queued still run)."""

    def __init__(self) -> None:
        self.active = False
        self.halted = threading.Event()
        self.resumed = threading.Event()  # set only by tests (``resume``)
        self.local = _Local()
        self._channels: dict[object, _Channel] = {}
        self._stream: list[CommOp] = []  # synchronous ops the host's next compute waits for
        self._lock = threading.Lock()
        self._patches = Patches()
        self._price: Callable[[str, object, tuple, dict], float] | None = None
        self._on_cost: Callable[[object, float, float], None] | None = None

    def set_cost(
        self,
        price: Callable[[str, object, tuple, dict], float] | None,
        on_cost: Callable[[object, float, float], None] | None = None,
    ) -> None:
        """Price every op the host issues from now on: ``price(name, group, args, kwargs)`` is
        its modelled seconds (0: none), waited out on its group's thread just before it runs;
        ``on_cost(group, start, end)`` is called there with each such wait (``time.monotonic``
        seconds). ``None`` removes the model."""
        self._price, self._on_cost = price, on_cost

    def price(self, name: str, group, args: tuple, kwargs: dict) -> float:
        """The modelled seconds of one call (0 without a cost model)."""
        return self._price(name, group, args, kwargs) if self._price is not None else 0.0

    # -- host side ---------------------------------------------------------------------------

    def submit(
        self, name: str, group, run: Callable[[], object], is_async: bool, cost_s: float = 0.0
    ) -> CommOp:
        """Queue ``run`` on ``group``'s thread behind the synchronous ops issued so far; the
        thread waits ``cost_s`` (the modelled transfer) before running it."""
        stream = self._stream
        if stream:
            stream[:] = [op for op in stream if not op.is_completed()]
        on_cost = self._on_cost
        report = (lambda start, end: on_cost(group, start, end)) if on_cost else None
        op = CommOp(name, run, list(stream), cost_s, report)
        self._channel(group).queue.put(op)
        self.local.last = op
        if not is_async:
            if torch._C._current_graph_task_id() != -1:
                op.wait()  # in backward the result goes straight into C++ kernels
            else:
                stream.append(op)
        return op

    def last_op(self) -> CommOp | None:
        """The op this thread queued last (what a synchronous call that returned None issued)."""
        return self.local.last

    def compute_gate(self) -> None:
        """Block until the synchronous ops issued so far completed (the host is the compute
        stream). Called by the CPU backend before every torch call of the host thread."""
        stream = self._stream
        if stream:
            pending, stream[:] = list(stream), []
            for op in pending:
                op.wait()

    def drain(self) -> None:
        """Wait for every op queued so far on every group (``torch.cuda.synchronize``)."""
        self.compute_gate()
        with self._lock:
            channels = list(self._channels)
        for group in channels:
            self.submit("synchronize", group, lambda: None, True).wait()

    def halt(self) -> None:
        """Stop every communication thread before its next op, for good (fault injection)."""
        logger.warning("communication halted: no op on this rank completes from now on")
        self.halted.set()

    def resume(self) -> None:
        """Let halted communication go on (tests only: a dead link does not come back)."""
        self.halted.clear()
        self.resumed.set()

    def _channel(self, group) -> _Channel:
        key = _key(group)
        channel = self._channels.get(key)
        if channel is None:
            with self._lock:
                channel = self._channels.get(key)
                if channel is None:
                    label = getattr(key, "group_desc", "") or str(len(self._channels))
                    channel = self._channels[key] = _Channel(self, label)
        return channel

    # -- installation --------------------------------------------------------------------------

    def install(self) -> AsyncComm:
        wrappers = {
            name: _Routed(name, getattr(dist, name), self) for name in ROUTED if hasattr(dist, name)
        }
        self.active = True
        self._patches.install(
            wrappers,
            in_c10d=[n for n in wrappers if getattr(distributed_c10d, n, None) is dist.__dict__[n]],
            batch=self._batch,
            coalescing=self._coalescing,
        )
        cpu_backend.set_comm_hooks(self.compute_gate, self.drain)
        return self

    def uninstall(self) -> None:
        self.compute_gate()
        self.active = False
        cpu_backend.set_comm_hooks(None, None)
        self._patches.restore()

    def _batch(self, original: Callable) -> Callable:
        engine = self

        def batch_isend_irecv(p2p_op_list):
            if comm_thread_flag.active or not engine.active or not p2p_op_list:
                return original(p2p_op_list)
            ops = list(p2p_op_list)
            cost = sum(engine.price(p2p_name(o), o.group, (o.tensor,), {}) for o in ops)
            op = engine.submit("batch_isend_irecv", ops[0].group, lambda: original(ops), True, cost)
            return [op] * len(ops)

        return batch_isend_irecv

    def _coalescing(self, original: Callable) -> Callable:
        engine = self

        @contextlib.contextmanager
        def coalescing_manager(group=None, device=None, async_ops=False):
            local = engine.local
            if comm_thread_flag.active or not engine.active or local.capture is not None:
                with original(group, device, async_ops) as cm:
                    yield cm
                return
            calls: list = []
            handle = _CoalescedHandle()
            local.capture = (_key(group), calls, handle)
            try:
                yield handle
            finally:
                local.capture = None

            def run():
                with original(group, device, True) as cm:
                    for _name, fn, args, kwargs in calls:
                        fn(*args, **kwargs)
                return cm

            cost = sum(engine.price(name, group, args, kwargs) for name, _, args, kwargs in calls)
            handle.op = engine.submit("coalesced", group, run, async_ops, cost)

        return coalescing_manager


class _CoalescedHandle:
    """What ``with _coalescing_manager(...) as cm`` yields: ``cm.wait()`` after the block."""

    op: CommOp | None = None

    def wait(self, timeout=None) -> bool:
        return self.op.wait() if self.op is not None else True

    def is_completed(self) -> bool:
        return self.op is None or self.op.is_completed()

    @property
    def started(self) -> float:
        """``CommOp.started`` of the block's op (0.0: not yet). Its presence tells the flight
        recorder that this handle knows when the op starts: without it the block's record would
        say "started" when issued, even on a rank whose communication never runs it."""
        return self.op.started if self.op is not None else 0.0

    def observe(self, fn: Callable[[CommOp], None]) -> None:
        """``CommOp.observe`` of the block's op (nothing to observe if the block was empty)."""
        if self.op is not None:
            self.op.observe(fn)

    def append(self, work) -> None:
        pass

    @property
    def works(self) -> list:
        return [self.op] if self.op is not None else []


_ENGINE: AsyncComm | None = None


def install() -> AsyncComm:
    """This process's NCCL-like mode, installed once (idempotent)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = AsyncComm().install()
    return _ENGINE


def installed() -> AsyncComm | None:
    """The installed engine, or None (gloo's synchronous mode)."""
    return _ENGINE if _ENGINE is not None and _ENGINE.active else None


def halt() -> bool:
    """Halt this process's communication (``hang-comm``); False when the mode is not on."""
    engine = installed()
    if engine is None:
        return False
    engine.halt()
    return True
