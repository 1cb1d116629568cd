"""Job-fatal errors: a rank says the job itself cannot proceed, on any node.

Some errors would follow the job to every node it could be restarted on: a checkpoint that cannot
be loaded at this layout, a data file that does not exist, a config the ranks refuse. Restarting
(or evicting the node) cannot help; the controller must fail the job with the reason. The signal,
defined here only:

* the rank calls ``fail_job(reason)``: it writes ``RUN_DIR/fatal/rank_NNNNN.json``
  (``FatalRecord``) and exits with ``EXIT_JOB_FATAL``;
* the node agent, seeing a worker exit with that code, reads the record (``read_fatal``, matched
  by pid) and reports the reason in the heartbeat: ``workers["<rank>"]["fatal"]`` (a string, None
  for every other exit);
* the controller (``ControllerFSM.on_worker_exit``) then stops every node and fails the job with
  that reason (``failed`` event, ``final.json``'s ``fatal``, the MegaScaleJob status), evicting
  nobody and restarting nothing.

An error no rank declared fatal can still follow the job to any node (data that fails to
read at run time, a full shared disk, a bug). A worker that ends with an uncaught exception
writes an ``ExitError`` (``RUN_DIR/errors/rank_NNNNN.json``: the exception's one line and its
``error_signature``, the line with ranks, paths and numbers taken out); the agent reports it in
the heartbeat (``workers["<rank>"]["error"]``) and the controller fails the job when the same
signature ends every rank of a generation, or comes back after a restart (``ControllerFSM``).

This module imports nothing heavy: the agent and the controller read it too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from megascale import runfiles

logger = logging.getLogger(__name__)

EXIT_JOB_FATAL = 78
"""A rank's exit code for "the job cannot proceed" (sysexits' EX_CONFIG: misconfigured)."""
RUN_DIR_ENV = "MEGASCALE_RUN_DIR"
"""Where the agent tells its workers the run directory is (``fail_job``'s default)."""
VERSION = 1
MAX_REASON = 2000


@dataclass(frozen=True)
class FatalRecord:
    """``RUN_DIR/fatal/rank_NNNNN.json``: why rank ``rank`` (process ``pid``) ended the job."""

    rank: int
    pid: int
    reason: str
    time: float
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FatalRecord:
        if int(d.get("version", 0)) != VERSION:
            raise ValueError(f"fatal record version {d.get('version')!r}: expected {VERSION}")
        return cls(int(d["rank"]), int(d["pid"]), str(d["reason"]), float(d["time"]))


def fatal_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / "fatal" / f"rank_{rank:05d}.json"


def _write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename: never read torn."""
    runfiles.make_dir(path.parent)
    return runfiles.write_text(path, json.dumps(data))


def write_fatal(run_dir: Path | str, rank: int, reason: str) -> Path:
    """Write this process's ``FatalRecord``."""
    record = FatalRecord(rank, os.getpid(), reason[:MAX_REASON], time.time())
    return _write_json(fatal_path(run_dir, rank), record.to_json())


def read_fatal(run_dir: Path | str, rank: int, pid: int) -> str | None:
    """The reason rank ``rank``'s process ``pid`` gave, None when it wrote none (or another
    process of that rank did)."""
    try:
        record = FatalRecord.from_json(json.loads(fatal_path(run_dir, rank).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record.reason if record.pid == pid else None


def fail_job(reason: str, run_dir: Path | str | None = None, rank: int | None = None) -> NoReturn:
    """End this rank and, through the controller, the whole job: ``reason`` is what the user
    sees (one line: name the file, field or value, and what would work).

    Call it only for errors no restart can fix; a fault of this node (a GPU error, a lost peer)
    must raise instead, so that the controller restarts the job. Writes the reason to
    ``RUN_DIR/fatal/`` (``run_dir``, else ``$MEGASCALE_RUN_DIR``; with neither, only the log and
    the exit code carry it), logs it, flushes stdio and exits with ``EXIT_JOB_FATAL`` at once
    (``os._exit``: no atexit handler or collective may block the exit). Never returns."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    run_dir = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV)
    if run_dir is not None:
        try:
            write_fatal(run_dir, rank, reason)
        except OSError as e:
            logger.error("could not write the job-fatal reason to %s: %s", run_dir, e)
    logger.error("job-fatal (rank %d): %s", rank, reason)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_JOB_FATAL)


# -- errors at exit ---------------------------------------------------------------------------

_PATH = re.compile(r"\S*/\S*")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+\b")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def error_signature(type_name: str, message: str) -> str:
    """What identifies an error wherever it happens: the exception type and the first line of
    its message with paths, hexadecimal and decimal numbers (ranks, steps, pids, sizes) replaced
    by placeholders, so that every rank's copy of one error has one signature."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    line = _NUMBER.sub("<n>", _HEX.sub("<hex>", _PATH.sub("<path>", line)))
    return f"{type_name}: {' '.join(line.split())}"[:MAX_REASON]


@dataclass(frozen=True)
class ExitError:
    """``RUN_DIR/errors/rank_NNNNN.json``: the uncaught exception process ``pid`` of rank
    ``rank`` ended with (``text``: ``Type: first line of the message``) and its signature."""

    rank: int
    pid: int
    text: str
    signature: str
    version: int = VERSION

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExitError:
        if int(d.get("version", 0)) != VERSION:
            raise ValueError(f"exit error version {d.get('version')!r}: expected {VERSION}")
        return cls(int(d["rank"]), int(d["pid"]), str(d["text"]), str(d["signature"]))


def exit_error_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / "errors" / f"rank_{rank:05d}.json"


def write_exit_error(run_dir: Path | str, rank: int, error: BaseException) -> Path:
    """Record the exception this process is about to exit with."""
    name = type(error).__qualname__
    lines = str(error).strip().splitlines()
    text = f"{name}: {lines[0]}" if lines else name
    record = ExitError(rank, os.getpid(), text[:MAX_REASON], error_signature(name, str(error)))
    return _write_json(exit_error_path(run_dir, rank), asdict(record))


def read_exit_error(run_dir: Path | str, rank: int, pid: int) -> ExitError | None:
    """The exception rank ``rank``'s process ``pid`` exited with; None when it wrote none."""
    try:
        record = ExitError.from_json(json.loads(exit_error_path(run_dir, rank).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if record.pid == pid else None
