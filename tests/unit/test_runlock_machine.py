"""The run-directory lock (who owns a job, a holder that dies) and the machine checks."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple

import pytest

from megascale.config import ConfigError, load, validate
from megascale.launcher.runlock import LOCK_NAME, RunDirError, owns_job, prepare_run_dir
from megascale.machine_check import (
    check_memory,
    check_tmpdir,
    estimate_rank_bytes,
    host_memory_bytes,
)


def test_the_lock_is_exclusive_and_freed_when_its_holder_dies(tmp_path):
    run_dir = tmp_path / "run"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the holder: take the lock, say so, wait to be killed
        try:
            os.close(read)
            prepare_run_dir(run_dir)
            os.write(write, b"x")
            os.pause()
        finally:
            os._exit(1)
    os.close(write)
    assert os.read(read, 1) == b"x"
    try:
        with pytest.raises(RunDirError, match=f"in use by another job \\(pid {pid} on "):
            prepare_run_dir(run_dir)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    lock = prepare_run_dir(run_dir)  # the dead holder's lock is taken over
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_who_owns_the_job():
    assert owns_job({})  # a parent that starts its own ranks
    assert owns_job({"RANK": "0", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"})
    assert not owns_job({"RANK": "3", "WORLD_SIZE": "8"})
    assert not owns_job({"RANK": "0", "WORLD_SIZE": "2", "MEGASCALE_JOB": "j"})  # agent's rank


def test_tmpdir_rules(tmp_path, monkeypatch):
    check_tmpdir({})  # unset: the system default
    check_tmpdir({"TMPDIR": str(tmp_path)})
    with pytest.raises(ConfigError, match="does not exist"):
        check_tmpdir({"TMPDIR": str(tmp_path / "missing")})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(ConfigError, match=r"TMPDIR = .*: only 1 MB free"):
        check_tmpdir({"TMPDIR": str(tmp_path)})


def test_memory_estimate_by_layout():
    tiny = validate(load("tiny"), 1, "gloo")
    small = estimate_rank_bytes(tiny, "cpu")
    assert 0 < small.total < 1 << 30
    big = load("tiny", ["model.num_layers=64", "model.hidden_size=1024", "model.num_heads=8"])
    one = estimate_rank_bytes(validate(big, 1, "gloo"), "cpu")
    split = estimate_rank_bytes(validate(big, 4, "gloo"), "cpu")  # dp 4: optimizer sharded
    assert split.params == one.params and split.optimizer < one.optimizer
    layout = ["parallel.tp=2", "parallel.pp=2", "model.num_layers=64"]
    tp_pp = load("tiny", [*layout, "model.hidden_size=1024", "model.num_heads=8"])
    assert estimate_rank_bytes(validate(tp_pp, 4, "gloo"), "cpu").params < one.params / 3


def test_a_model_larger_than_the_machine_is_refused():
    available = host_memory_bytes()
    assert 0 < (available or 0) <= (host_memory_bytes("MemTotal") or 0)
    cfg = validate(load("tiny", ["model.num_layers=1000000"]), 1, "gloo")
    with pytest.raises(ConfigError, match=r"model.num_layers = 1000000.*GiB available"):
        check_memory(cfg, "cpu", ranks_here=1)
    check_memory(validate(load("tiny"), 1, "gloo"), "cpu", ranks_here=8)
