"""The agent's part of the neighbour all-reduce (``megascale.controller.neighbours``): where this
node listens, where its neighbours listen, and the self-check process that runs the tests.

Each agent reserves ``CHANNELS`` consecutive free ports on its address when it starts and publishes
the first as ``neighbour_port`` in its ``nodes/<node>`` registration. The test on channel ``c``
between two nodes uses ``HOST:port+c`` of each (the lower endpoint hosts the pair's store there);
a node's tests have distinct channels, so it runs them at once and never hosts two stores on one
port. A port can be taken by another program between the
reservation and the test; that test then fails like a broken link would, naming the pair.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.controller.neighbours import (
    ABSENT,
    NeighbourResult,
    NeighbourTest,
    judge,
    suspected,
)
from megascale.messages.job import NeighbourEntry

logger = logging.getLogger(__name__)


class TopologyError(ValueError):
    """A ``--topology`` file that cannot be read or names unknown nodes."""


CHANNELS = 3  # the most a ring needs (an odd ring's closing edge has the third)
NBYTES = 4 << 20  # per all-reduce: big enough for a bandwidth figure, small for a self-check


def reserve_ports(host: str) -> int:
    """``free_port_block`` on ``host``, the address this agent was told to listen on; never on
    every interface (``options_from_args`` has already refused an address this machine cannot
    bind, so an OSError here is a real error)."""
    return free_port_block(host)


def free_port_block(host: str, count: int = CHANNELS, attempts: int = 50) -> int:
    """The first of ``count`` consecutive ports free on ``host`` now; OSError if none found."""
    for _ in range(attempts):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            with ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise OSError(f"no {count} consecutive free ports on {host} in {attempts} attempts")


def neighbour_job(
    neighbours: Iterable[NeighbourEntry],
    registration: Callable[[str], Mapping[str, Any] | None],
    *,
    host: str,
    port: int,
    timeout_s: float,
    down: str | None = None,
) -> dict[str, Any] | None:
    """``run_selfcheck_neighbours``'s arguments (but ``out``) for a self-check command's
    ``neighbours``; None when there are none."""
    tests = [NeighbourTest(n.node, n.channel) for n in neighbours]
    if not tests:
        return None
    resolved = resolve(tests, registration)
    return {"host": host, "port": port, "tests": resolved, "timeout_s": timeout_s, "down": down}


def resolve(
    tests: Iterable[NeighbourTest], registration: Callable[[str], Mapping[str, Any] | None]
) -> list[dict[str, Any]]:
    """The tests with each neighbour's address and port from ``registration(node)`` (its
    ``nodes/<node>`` value, None when it is not registered): a neighbour without one gets
    ``host`` None, and its test fails naming it."""
    out = []
    for test in tests:
        reg = registration(test.node) or {}
        port = reg.get("neighbour_port")
        out.append(
            {
                "node": test.node,
                "channel": test.channel,
                "host": reg.get("addr") if port else None,
                "port": int(port) if port else None,
            }
        )
    return out


def run_selfcheck_neighbours(
    host: str,
    port: int,
    tests: list[dict[str, Any]],
    timeout_s: float,
    out: str,
    down: str | None = None,
) -> int:
    """Zygote target: this node's neighbour all-reduces, all at once (one thread each, on port
    ``port + channel``), judged by ``judge``; writes ``{"ok", "detail", "seconds"}`` to ``out``;
    exit 0 = pass. ``down``: an injected network fault (the node joins no test; its neighbours
    wait for it in vain)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(tests))) as pool:
        results = list(pool.map(lambda t: _one_test(host, port, t, timeout_s, down), tests))
    ok, detail = judge(results)
    seconds = round(time.perf_counter() - start, 3)
    result = {"ok": ok, "detail": detail, "seconds": seconds, "suspects": suspected(results)}
    runfiles.write_text(out, json.dumps(result))
    return 0 if ok else 1


def _one_test(
    host: str, port: int, test: dict[str, Any], timeout_s: float, down: str | None
) -> NeighbourResult:
    from megascale.agent.selfcheck.net import NetCheckError, neighbour_allreduce

    peer, channel = str(test["node"]), int(test["channel"])
    if down:
        return NeighbourResult(peer, False, down)
    if test["host"] is None:
        return NeighbourResult(peer, False, ABSENT)
    mine, theirs = f"{host}:{port + channel}", f"{test['host']}:{int(test['port']) + channel}"
    try:
        bw = neighbour_allreduce(mine, [theirs], NBYTES, timeout_s)
    except (NetCheckError, ValueError) as e:
        return NeighbourResult(peer, False, str(e)[:300])
    return NeighbourResult(peer, True, f"{bw.value:.2f} {bw.unit}")


def load_topology(path: str | None, nodes: Iterable[str]) -> dict[str, str]:
    """``megascale launch --topology FILE``: node -> switch/rack label, from TOML
    (``node-0 = "tor-1"``) or ``.json``; TopologyError naming the entry for a node not in
    ``nodes`` or a label that is not a non-empty string."""
    if path is None:
        return {}
    import tomllib

    try:
        text = Path(path).read_text()
        table = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (OSError, ValueError) as e:
        raise TopologyError(f"--topology = {path!r}: cannot read it ({e})") from e
    names = list(nodes)
    if not isinstance(table, dict):
        raise TopologyError(f"--topology = {path!r}: expected a table of node = label")
    for node, label in table.items():
        if node not in names:
            raise TopologyError(
                f"--topology: node {node!r} is not one of this launch's nodes ({', '.join(names)})"
            )
        if not isinstance(label, str) or not label:
            raise TopologyError(f"--topology: {node} = {label!r}: must be a non-empty string")
    return table
