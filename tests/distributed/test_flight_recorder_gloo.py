"""The flight recorder on real gloo ranks: a stall read from outside names the rank that holds it
up, and a real training run leaves consistent records.

Stalls are made deterministic: the culprit rank waits for a file the test creates (or stops itself
with SIGSTOP) before a collective the others enter. The test process reads every rank's flight file
while the others are blocked, runs ``stall_suspects``, then releases the culprit so the run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import with_changes

from megascale.config import load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.probes import inject
from megascale.probes.flight.culprits import stall_culprits, stall_suspects
from megascale.probes.flight.format import (
    DeviceState,
    OpKind,
    OpState,
    RankState,
    flight_path,
    last_state,
    read_flight,
)
from megascale.probes.flight.recorder import open_recorder
from megascale.probes.progress import progress_path, read_progress
from megascale.train.run import run_rank

pytestmark = pytest.mark.slow

WORLD = 4


def _hold(run_dir: Path, how: str) -> None:
    """Keep this rank out of the next collective until the test releases it."""
    if how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT
        return
    while not (run_dir / "release").exists():
        time.sleep(0.01)


def _stall_world(run_dir: Path, culprit: int, how: str) -> bool:
    """Three all-reduces on the world group; the culprit holds back before the fourth."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    recorder = open_recorder(run_dir, rank, WORLD)
    recorder.set_step(1)
    t = torch.ones(8)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == culprit:
        _hold(run_dir, how)
    dist.all_reduce(t)
    recorder.close()
    dist.destroy_process_group()
    return True


def _stall_across_groups(run_dir: Path, culprit: int) -> bool:
    """TP-like pairs {0,1}, {2,3} and DP-like pairs {0,2}, {1,3}: a TP all-reduce, then a DP one.
    The culprit holds back before the TP one; its TP peer waits there, the others in DP."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp = [dist.new_group([0, 1], group_desc="TP"), dist.new_group([2, 3], group_desc="TP")]
    dp = [dist.new_group([0, 2], group_desc="DP"), dist.new_group([1, 3], group_desc="DP")]
    recorder = open_recorder(run_dir, rank, WORLD)
    t = torch.ones(4)
    dist.all_reduce(t, group=tp[rank // 2])
    dist.all_reduce(t, group=dp[rank % 2])
    if rank == culprit:
        _hold(run_dir, "file")
    dist.all_reduce(t, group=tp[rank // 2])
    handle = dist.all_reduce(t, group=dp[rank % 2], async_op=True)  # blocked in wait()
    handle.wait()
    recorder.close()
    dist.destroy_process_group()
    return True


def _read_while_stalled(run_dir: Path, target, args, ready, release) -> dict:
    """Run the ranks in the background; once ``ready(states)``, return the states and release."""
    outcome: dict = {}

    def ranks():
        try:
            outcome["results"] = run_local(target, WORLD, args, timeout_s=120)
        except BaseException as e:  # reported below
            outcome["error"] = e

    thread = threading.Thread(target=ranks)
    thread.start()
    deadline, states = time.monotonic() + 60, {}
    try:
        while time.monotonic() < deadline and "error" not in outcome:
            paths = [flight_path(run_dir, r) for r in range(WORLD)]
            if all(p.exists() for p in paths):
                states = {r: last_state(p) for r, p in enumerate(paths)}
                if ready(states):
                    break
            time.sleep(0.02)
    finally:
        release(states)
        thread.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["results"] == [True] * WORLD
    return states


def _blocked(states, ranks, seq: int) -> bool:
    """Every rank in ``ranks`` is blocked in its ``seq``-th op on some group (not an earlier one,
    where all four ranks may be blocked for a moment)."""
    return all(states[r].blocked and states[r].blocked[-1].seq == seq for r in ranks)


def _held_back(state, seq: int | None = None) -> bool:
    """The culprit is outside communication: blocked in nothing, its last op (``seq``-th if
    given) left. The others can block before its flight file says so."""
    if state.blocked or state.last is None or not state.last_left:
        return False
    return seq is None or state.last.seq == seq


def test_stall_names_the_rank_that_never_entered(tmp_path):
    states = _read_while_stalled(
        tmp_path,
        _stall_world,
        (tmp_path, 2, "file"),
        ready=lambda s: _blocked(s, (0, 1, 3), 4) and _held_back(s[2], seq=3),
        release=lambda s: (tmp_path / "release").touch(),
    )
    assert stall_suspects(states) == [2]
    waiting = states[0].blocked[0]
    assert (waiting.kind, waiting.seq, waiting.state) == (OpKind.ALL_REDUCE, 4, OpState.ENTERED)
    assert states[2].blocked == () and states[2].last.seq == 3 and states[2].last_left
    assert states[2].process in ("R", "S")  # alive, computing or sleeping
    assert states[0].groups[waiting.group].ranks == (0, 1, 2, 3)


def test_stall_names_a_rank_stopped_with_sigstop(tmp_path):
    def release(states):
        pid = states[2].pid if 2 in states else None
        for _ in range(500):  # make sure the stopped rank continues whatever happened
            if pid is None and flight_path(tmp_path, 2).exists():
                pid = last_state(flight_path(tmp_path, 2)).pid
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
                return
            time.sleep(0.01)

    states = _read_while_stalled(
        tmp_path,
        _stall_world,
        (tmp_path, 2, "sigstop"),
        ready=lambda s: _blocked(s, (0, 1, 3), 4) and s[2].stopped,
        release=release,
    )
    assert states[2].process == "T"
    assert stall_suspects(states) == [2]


def _blocked_in(states, where: dict[int, tuple[str, int]]) -> bool:
    """Every rank ``r`` in ``where`` is blocked in the ``seq``-th op of its group labelled
    ``label`` (seqs count per group, so a TP and a DP op can share one)."""

    def at(state, label, seq):
        return any(op.seq == seq and state.groups[op.group].label == label for op in state.blocked)

    return all(at(states[r], label, seq) for r, (label, seq) in where.items())


def test_stall_suspect_is_followed_across_groups(tmp_path):
    # 2 waits in TP for 3; 0 and 1 wait in DP for 2 and 3: only 3 never entered. (0 and 1 also
    # pass through their own second TP op, which completes: the condition must name the group.)
    stalled = {0: ("DP", 2), 1: ("DP", 2), 2: ("TP", 2)}
    states = _read_while_stalled(
        tmp_path,
        _stall_across_groups,
        (tmp_path, 3),
        ready=lambda s: _blocked_in(s, stalled) and _held_back(s[3]),
        release=lambda s: (tmp_path / "release").touch(),
    )
    assert _blocked_in(states, stalled) and _held_back(states[3])
    assert stall_suspects(states) == [3]


def _stall_async(run_dir: Path, culprit: int) -> bool:
    """The across-groups pattern in the NCCL-like mode: the culprit's communication halts (its
    host goes on issuing until it blocks in a wait); released by the test's file."""
    from megascale.parallel import async_comm, cpu_backend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp = [dist.new_group([0, 1], group_desc="TP"), dist.new_group([2, 3], group_desc="TP")]
    dp = [dist.new_group([0, 2], group_desc="DP"), dist.new_group([1, 3], group_desc="DP")]
    cpu_backend.activate()
    engine = async_comm.install()
    recorder = open_recorder(run_dir, rank, WORLD)  # over the engine: sees the host's calls
    t = torch.ones(4)
    dist.all_reduce(t, group=tp[rank // 2])
    dist.all_reduce(t, group=dp[rank % 2])
    if rank == culprit:
        t.add_(0)  # the host waits for the two ops above, then the link dies
        engine.halt()
        threading.Thread(target=lambda: (_hold(run_dir, "file"), engine.resume())).start()
    dist.all_reduce(t, group=tp[rank // 2])  # returns at once on every rank
    handle = dist.all_reduce(t, group=dp[rank % 2], async_op=True)
    handle.wait()
    total = t.sum().item()
    recorder.close()
    engine.uninstall()
    cpu_backend.deactivate()
    dist.destroy_process_group()
    return total == 4 * 16.0


def test_async_stall_names_the_rank_whose_communication_stopped(tmp_path):
    # NCCL-like records: the culprit entered every op (its host is not behind), but its device
    # never started the last two; 2 waits in a started TP op for it, 0 and 1 in started DP ops
    # for 2 (whose DP op is queued behind its stuck TP op) and for 3.
    def ready(states):
        started = {r: [op for op in states[r].blocked if op.device == DeviceState.STARTED]
                   for r in (0, 1, 2)}  # fmt: skip
        # and the watcher thread has written every rank's device states of the stall (it polls
        # every 2 ms: a read between two of its writes can see a half-updated picture)
        return all(started.values()) and bool(states[3].unstarted) and bool(stall_culprits(states))

    states = _read_while_stalled(
        tmp_path,
        _stall_async,
        (tmp_path, 3),
        ready=ready,
        release=lambda s: (tmp_path / "release").touch(),
    )
    assert all(op.left for op in states[3].blocked if op.seq == 2 and not op.is_async)
    assert states[3].seq(next(iter(states[3].unstarted))[0]) == 2  # entered, never started
    culprits = stall_culprits(states)
    assert [(c.rank, c.reason) for c in culprits] == [(3, "not-started")]
    assert culprits[0].seq == 2 and culprits[0].op == "all_reduce"


def test_training_run_leaves_plausible_records(tmp_path, data_dir):
    job = with_changes(
        load("tiny"),
        parallel={"tp": 2},
        data={"path": str(default_token_file(data_dir))},
        optim={"warmup_steps": 1},
        train={"steps": 2, "log_interval": 1},
        checkpoint={"interval": 0},
    )
    job = validate(job, 2, "gloo")
    run_local(run_rank, 2, (job, tmp_path), timeout_s=300)
    kinds_by_rank = []
    for rank in range(2):
        flight = read_flight(flight_path(tmp_path, rank))
        assert flight.header.section == "done" and flight.header.step == 2
        records = flight.records
        assert records and all(r.state == OpState.LEFT for r in records)
        assert {r.step for r in records} >= {1, 2}
        seqs = defaultdict(list)
        for r in records:
            seqs[r.group].append(r.seq)
        for gid, got in seqs.items():  # per group 1, 2, 3, ... (nothing overwritten yet)
            assert got == list(range(1, len(got) + 1)), flight.groups[gid].label
            assert flight.groups[gid].last_seq == got[-1]
        tp = [g for g in flight.groups.values() if g.label == "TENSOR_MODEL_PARALLEL_GROUP"]
        assert len(tp) == 1 and tp[0].ranks == (0, 1) and len(seqs[tp[0].gid]) > 10
        kinds_by_rank.append([(r.group, r.seq, r.kind) for r in records if r.group == tp[0].gid])
        progress = read_progress(progress_path(tmp_path, rank))
        assert (progress.section, progress.step) == ("done", 2)
        assert progress.tokens_per_s > 0 and {"init", "step"} <= set(progress.durations)
    assert kinds_by_rank[0] == kinds_by_rank[1]  # both TP ranks recorded the same calls


@pytest.mark.parametrize(
    ("mode", "kind"), [("gloo", "size"), ("nccl-like", "op")], ids=["gloo-size", "nccl-like-op"]
)
def test_a_mismatched_collective_hangs_and_is_named_from_the_flight_files(
    tmp_path, data_dir, monkeypatch, mode, kind
):
    # DP4 training, the real injection: rank 2's first collective of step 2 is issued with twice
    # the size (or another op) and hangs, as on NCCL (gloo would abort the process on a size
    # mismatch). Read from outside as the agent reads them, the flight files name rank 2 alone.
    job = with_changes(
        load("tiny"),
        parallel={"async_collectives": mode == "nccl-like"},
        data={"path": str(default_token_file(data_dir))},
        optim={"warmup_steps": 1},
        train={"steps": 3, "log_interval": 1},
        checkpoint={"interval": 0},
    )
    job = validate(job, WORLD, "gloo")
    monkeypatch.setenv(inject.ENV, f"mismatch-comm:rank=2,step=2,kind={kind}")
    outcome: dict = {}

    def ranks():
        try:
            outcome["results"] = run_local(run_rank, WORLD, (job, tmp_path), timeout_s=120)
        except BaseException as e:  # the test kills the hung ranks
            outcome["error"] = e

    def hung(states) -> bool:  # every rank blocked in the same op
        return len({(op.group, op.seq) for st in states.values() for op in st.blocked[:1]}) == 1

    thread = threading.Thread(target=ranks)
    thread.start()
    states, culprits = {}, []
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and not outcome and not culprits:
            paths = [flight_path(tmp_path, r) for r in range(WORLD)]
            if all(p.exists() for p in paths):
                states = {r: last_state(p) for r, p in enumerate(paths)}
                if all(st.blocked for st in states.values()) and hung(states):
                    culprits = stall_culprits(states)
            time.sleep(0.05)
    finally:
        for state in states.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.pid, signal.SIGKILL)
        thread.join(timeout=60)
    assert "results" not in outcome, "the mismatched collective completed"
    assert [(c.rank, c.reason) for c in culprits] == [(2, "mismatch")], (culprits, states)
    # alive and waiting when read, not aborted (a size mismatch aborts a plain gloo process)
    assert all(st.process in ("R", "S") for st in states.values()), states
    odd, peer = states[2].blocked[0], states[0].blocked[0]
    assert culprits[0].seq == odd.seq == peer.seq and culprits[0].group.endswith(" [0, 1, 2, 3]")
    if kind == "size":
        assert (odd.kind, odd.nbytes) == (peer.kind, 2 * peer.nbytes)
    else:
        assert odd.kind != peer.kind and odd.nbytes == peer.nbytes
    assert culprits[0].op == f"{odd.kind.name.lower()} of {odd.nbytes} bytes"
    # what the controller analyses: the states as the agents' heartbeats carry them
    carried = {
        r: RankState.from_json(json.loads(json.dumps(st.to_json()))) for r, st in states.items()
    }
    assert stall_culprits(carried) == culprits
    if mode == "nccl-like":  # every member's device started it; none completes
        assert {st.blocked[0].device for st in states.values()} == {DeviceState.STARTED}
