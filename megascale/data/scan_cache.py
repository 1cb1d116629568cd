"""The largest token id of a ``.bin``, read once per file and machine, not at every start.

``megascale train`` refuses a dataset whose ids reach ``model.vocab_size`` before any rank starts
(``dataset.check_data``), which reads the ``.bin``: all of it when the dataset has no
``PREFIX.json`` (one made by Megatron's own ``preprocess_data.py``), else 2^28 tokens. Every
worker process makes that check when it starts: each of a node's ranks at the job's start, and
a replacement rank on the recovery's path. A 1 GiB ``.bin`` read from a cold page cache took
10 s here; a pretraining corpus is hundreds of times larger.

So the result is kept in ``$XDG_CACHE_HOME/megascale/token_scans.json`` (default ``~/.cache``),
keyed by the file's real path, size, modification time and inode (and those of its ``.idx``) and
by how much of it was read: a dataset rewritten since is read again. The ranks of one machine that start
together take a lock around the read (``token_scans.lock``): one reads, the others wait for its
result. A cache that cannot be read, written or locked is ignored (the file is read, never an
error).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from megascale import runfiles
from megascale.data.indexed import bin_path, idx_path, scan_max_token
from megascale.probes.peak import cache_path

logger = logging.getLogger(__name__)

KEPT = 256
"""Scans kept in the cache (the most recent)."""


def scan_key(prefix: str | os.PathLike, limit: int | None) -> str:
    """What a cached scan is valid for: both files as they are now, and the tokens read."""
    parts = []
    for path in (bin_path(prefix), idx_path(prefix)):
        st = os.stat(path)
        parts.append(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
    return " | ".join([*parts, f"limit {limit}"])


def cached_max_token(prefix: str | os.PathLike, limit: int | None) -> int:
    """``indexed.scan_max_token(prefix, limit)``, from the cache when this file was read before."""
    key = scan_key(prefix, limit)
    directory = cache_path().parent  # beside the measured CPU peaks
    with _locked(directory) as usable:
        found = _read(directory).get(key) if usable else None
        if isinstance(found, int):
            return found
        top = scan_max_token(prefix, limit=limit)
        if usable:
            _write(directory, key, top)
        return top


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[bool]:
    """Hold the cache's lock; yields False (and holds nothing) when it cannot be had."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / "token_scans.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        logger.info("the token-scan cache in %s is not usable: %s", directory, e)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # the lock goes with it


def _read(directory: Path) -> dict:
    try:
        found = json.loads((directory / "token_scans.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write(directory: Path, key: str, top: int) -> None:
    entries = _read(directory)
    entries.pop(key, None)
    entries[key] = top  # the newest last: the oldest go first
    kept = dict(list(entries.items())[-KEPT:])
    try:
        runfiles.write_text(directory / "token_scans.json", json.dumps(kept))
    except OSError as e:
        logger.info("could not write the token-scan cache in %s: %s", directory, e)
