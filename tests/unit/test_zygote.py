"""The zygote's children (``megascale.agent.zygote``): what a forked worker inherits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Run in a fresh interpreter: in the test process, another test's leftover thread may open a pipe
# between the listing taken before the zygote's fork and the fork itself, and that pipe, inherited
# by the zygote and by its children, would pass for one of the zygote's own.
CHECK = textwrap.dedent(
    """
    import json, os, sys, threading
    from pathlib import Path
    from megascale.agent import zygote as zygote_mod
    from megascale.agent.zygote import Zygote

    def fds(pid="self"):
        found = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if int(fd) > 2:
                    found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue  # the listing's own descriptor, closed by now
        return found

    def write_fds(out):
        Path(out).write_text(json.dumps(sorted(fds())))
        return 0

    zygote_mod.TARGETS["fds"] = write_fds
    tmp = Path(sys.argv[1])
    before = fds()  # what the zygote inherits from this process
    zygote = Zygote(preload=())
    exited = threading.Event()
    zygote.on_exit = lambda pid, code: exited.set()
    try:
        zygote.spawn("fds", {"out": str(tmp / "child.json")}, {}, tmp / "child.log")
        assert exited.wait(30), "the child did not exit"
        own = {w for w in fds(zygote.pid) - before if w.startswith(("pipe:", "socket:"))}
    finally:
        zygote.close()
    print(json.dumps({"own": sorted(own), "child": json.loads((tmp / "child.json").read_text())}))
    """
)


def test_a_child_holds_neither_the_agents_connection_nor_the_exit_alarms_pipe(tmp_path):
    """A worker keeps no end of the zygote's own pipes: its connection to the agent (whose end
    tells the zygote the agent is gone) and the pipe its SIGCHLD handler writes to."""
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    own, inherited = set(found["own"]), set(found["child"])
    assert len(own) >= 2, own  # its connection, the alarm's pipe (one inode, two ends)
    assert not inherited & own, (inherited, own)


def _ignored(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)


def test_a_child_is_born_ignoring_the_pause_signal(tmp_path, monkeypatch):
    """The agent pauses workers with SIGUSR1: one that arrives in the instant after the fork,
    before the worker's trainer has its handler, must not kill it. The zygote ignores it, so its
    children ignore it from the fork on."""
    import threading

    from megascale.agent import zygote as zygote_mod
    from megascale.agent.zygote import Zygote
    from megascale.train.resident import PAUSE_SIGNAL

    monkeypatch.setitem(zygote_mod.TARGETS, "nothing", lambda: 0)
    zygote = Zygote(preload=())
    exited = threading.Event()
    zygote.on_exit = lambda pid, code: exited.set()
    try:
        # a spawn is answered from the zygote's loop, past its set-up
        zygote.spawn("nothing", {}, {}, tmp_path / "child.log")
        assert exited.wait(30)
        assert _ignored(zygote.pid) & (1 << (PAUSE_SIGNAL - 1))
    finally:
        zygote.close()
