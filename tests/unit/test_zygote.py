"""The zygote's children (``megascale.agent.zygote``): what a forked worker inherits."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from megascale.agent import zygote as zygote_mod
from megascale.agent.zygote import Zygote


def _fds(pid: int | str = "self") -> set[str]:
    """What the descriptors above stderr of process ``pid`` are open on."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if int(fd) > 2:
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return found


def _write_fds(out: str) -> int:
    Path(out).write_text(json.dumps(sorted(_fds())))
    return 0


def test_a_child_holds_neither_the_agents_connection_nor_the_exit_alarms_pipe(
    tmp_path, monkeypatch
):
    """A worker keeps no end of the zygote's own pipes: its connection to the agent (whose end
    tells the zygote the agent is gone) and the pipe its SIGCHLD handler writes to."""
    monkeypatch.setitem(zygote_mod.TARGETS, "fds", _write_fds)
    before = _fds()  # what the zygote inherits from this process (taken right before its fork)
    zygote = Zygote(preload=())
    exited = threading.Event()
    zygote.on_exit = lambda pid, code: exited.set()
    try:
        out = tmp_path / "fds.json"
        zygote.spawn("fds", {"out": str(out)}, {}, tmp_path / "child.log")
        assert exited.wait(30)
        # the zygote's own: what it has open that it did not inherit from this process
        own = {what for what in _fds(zygote.pid) - before if what.startswith(("pipe:", "socket:"))}
    finally:
        zygote.close()
    assert len(own) >= 2, own  # its connection, the alarm's pipe (one inode, two ends)
    inherited = set(json.loads(out.read_text()))
    assert not inherited & own, (inherited, own)
