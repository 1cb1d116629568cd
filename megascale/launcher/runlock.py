"""One job per run directory: ``RUN_DIR/.lock``, held by the process that owns the job.

``prepare_run_dir`` creates the directory (refusing a path that is a file or not writable) and
takes an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` without waiting; a second job on the same
directory is refused at once with ``RunDirError`` naming the holder (pid, host, start time, as
the holder wrote them into the lock file after taking the lock). The lock belongs to the open file
and dies with the process (and with the forked children that share it), so a lock left by a
process that died is free again and is taken over: the file's old content is only a note.

Who takes it: the process that owns the job — the ``megascale launch`` parent, the ``megascale
train`` parent, or, under torchrun (or any launcher that sets RANK/WORLD_SIZE), global rank 0.
Ranks started by a megascale agent never take it (their launcher holds it). A torchrun restart of
the worker group takes it again: the old rank 0 is gone by then, and ``wait_s`` covers its exit.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from megascale import runfiles
from megascale.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class RunDirError(ConfigError):
    """The run directory cannot be used: not a directory, not writable, or in use by a job."""


class RunLock:
    """The held lock; ``release`` (or process exit) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def prepare_run_dir(run_dir: Path, flag: str = "--run-dir", wait_s: float = 0.0) -> RunLock:
    """Create ``run_dir`` and lock it for this job (see the module docstring). ``wait_s``: how
    long to wait for a holder to exit before refusing. Raises ``RunDirError`` (one line)."""
    try:
        run_dir = runfiles.check_dir_path(flag, run_dir)
    except ValueError as e:
        raise RunDirError(str(e)) from None
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{flag} = {str(run_dir)!r}: is a file; must be a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "permission denied")
        links = runfiles.planted_links(run_dir)
        if links:
            raise RunDirError(
                f"{flag} = {str(run_dir)!r}: {links[0]} is a symlink; a job never writes through "
                "one (remove it, or use another run directory)"
            )
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(run_dir / LOCK_NAME, flags, 0o644)
    except OSError as e:
        raise RunDirError(
            f"{flag} = {str(run_dir)!r}: cannot be created or written ({e.strerror or e}); "
            "must be a writable directory"
        ) from e
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES) or time.monotonic() >= deadline:
                holder = _describe(_read(fd))
                os.close(fd)
                raise RunDirError(
                    f"{flag} = {str(run_dir)!r}: in use by another job ({holder}); use another "
                    "run directory or stop that job"
                ) from e
            time.sleep(0.1)
    previous = _read(fd)
    if previous:
        logger.info("run directory lock taken over from a process that exited (%s)", previous)
    _write(fd, {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()})
    runfiles.pin_run_dir(run_dir)  # a job whose directory is moved aside stops writing there
    return RunLock(run_dir / LOCK_NAME, fd)


def owns_job(environ: dict[str, str] | None = None) -> bool:
    """Whether this ``megascale train`` process owns the job (takes the lock): a parent that
    starts its own ranks, or global rank 0 under an external launcher (torchrun, Slurm), but
    never a rank started by a megascale agent (``MEGASCALE_JOB`` set: its launcher owns it)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return True
    return env.get("RANK") == "0" and "MEGASCALE_JOB" not in env


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _write(fd: int, info: dict[str, object]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info, sort_keys=True) + "\n").encode(), 0)


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: the lock file is being written"
