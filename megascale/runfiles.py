"""Writing files in a run directory without following symlinks planted there.

A run directory may be shared (a scratch file system, a path another user can write to). A symlink
placed at a name the job writes (``final.json -> ~/.bashrc``) must not make the job write, truncate
or chmod the link's target. Every writer of a file under a run directory goes through this module:

* ``write_text`` / ``write_bytes``: the whole file, atomically (a temporary file created with
  ``O_EXCL`` in the same directory, then renamed over the name: readers see the old or the new
  file, never a torn one);
* ``open_append``: a log opened for appending, with ``O_NOFOLLOW``;
* ``make_dir``: a subdirectory, created if missing.

Rule: neither the final name nor its directory may be a symlink; such a write raises
``UnsafePathError`` (an ``OSError``) naming the path, and nothing is written anywhere. The
directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` and every operation is relative to that
descriptor, so swapping the directory for a link between the check and the write does not help.

A run directory is also pinned by identity (``pin_run_dir``: its device and inode when the job
took its lock): a job whose directory was moved aside (``mv run run.old``) writes nothing at the
old path any more (``RunDirMovedError``), so a new job started there never gets the old one's
files. The check is made before each write, so a move in the middle of one write may let that
one write land in the moved directory (never in another job's).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import IO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A write under a run directory would go through a symlink (or to something not a file)."""


def _refuse(path: Path, what: str) -> UnsafePathError:
    return UnsafePathError(
        errno.ELOOP, f"refusing to write {path}: {what} (a run directory's files are never "
        "written through a symlink)", str(path),
    )  # fmt: skip


class RunDirMovedError(UnsafePathError):
    """The run directory at the job's path is no longer the one the job started in (moved
    aside, replaced by another job's): the job writes nothing there."""


_PINNED: dict[str, tuple[int, int]] = {}
"""Run directory (absolute path) -> (st_dev, st_ino) of the directory the job started in; set by
``pin_run_dir`` in the process that owns the job and inherited by the processes it forks."""


def pin_run_dir(run_dir: str | os.PathLike[str]) -> tuple[int, int]:
    """Remember ``run_dir``'s identity (its device and inode, now): from then on every writer
    of this module refuses to write under that path once another directory is there
    (``RunDirMovedError``), so a job whose run directory was moved aside never writes into a
    directory made at its old path (another job's). Returns the identity."""
    st = os.stat(run_dir, follow_symlinks=False)
    _PINNED[os.path.abspath(run_dir)] = identity = (st.st_dev, st.st_ino)
    return identity


def run_dir_moved(run_dir: str | os.PathLike[str]) -> str | None:
    """Why ``run_dir`` (pinned) is no longer the job's, in one line; None while it is (or when
    it was never pinned)."""
    root = os.path.abspath(run_dir)
    pinned = _PINNED.get(root)
    if pinned is None:
        return None
    try:
        st = os.stat(root, follow_symlinks=False)
    except FileNotFoundError:
        return f"the run directory {root} is gone (moved or removed since the job started)"
    if (st.st_dev, st.st_ino) != pinned:
        return (
            f"the run directory {root} is another directory than the job started in (moved "
            f"aside and replaced: device/inode {pinned[0]}/{pinned[1]}, now "
            f"{st.st_dev}/{st.st_ino})"
        )
    return None


def _check_pinned(path: Path) -> None:
    """``RunDirMovedError`` when ``path`` lies under a pinned run directory that moved."""
    text = os.path.abspath(path)
    for root in _PINNED:
        if text == root or text.startswith(root + os.sep):
            why = run_dir_moved(root)
            if why is not None:
                raise RunDirMovedError(
                    errno.ESTALE, f"refusing to write {path}: {why}; the job writes nothing "
                    "there", str(path),
                )  # fmt: skip


def _open_dir(directory: Path) -> int:
    _check_pinned(directory)
    try:
        return os.open(directory, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            raise _refuse(directory, "the directory is a symlink") from None
        raise


def _check_name(dir_fd: int, name: str, path: Path) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "it is a symlink")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "it is not a regular file")


def write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> Path:
    """Replace ``path`` with ``data`` atomically, with permission bits ``mode`` (see the module
    docstring for what is refused). Returns the path."""
    path = Path(path)
    dir_fd = _open_dir(path.parent)
    try:
        _check_name(dir_fd, path.name, path)
        tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
        try:
            try:
                os.fchmod(fd, mode)  # not narrowed or widened by the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            # rename replaces the name itself: a link planted since the check is replaced, not
            # followed.
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)
    return path


def write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> Path:
    """``write_bytes`` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"), mode)


def _open_nofollow(path: Path, flags: int) -> int:
    """A descriptor of ``path`` opened with ``flags`` relative to its directory (itself opened
    without following links); a symlink at the name is refused."""
    dir_fd = _open_dir(path.parent)
    try:
        return os.open(path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "it is a symlink") from None
        raise
    finally:
        os.close(dir_fd)


def open_append(path: str | os.PathLike[str], binary: bool = False) -> IO:
    """``path`` opened for appending (created 0644 if missing); a symlink at the name, or as its
    directory, is refused."""
    path = Path(path)
    fd = _open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(path, "it is not a regular file")
    return os.fdopen(fd, "ab" if binary else "a", encoding=None if binary else "utf-8")


def open_new(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` created (or truncated) for reading and writing in binary; a symlink at the name,
    or as its directory, is refused."""
    fd = _open_nofollow(Path(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    return os.fdopen(fd, "w+b")


JOB_WRITTEN = (
    ".lock", "config.toml", "etcd.password", "events.jsonl", "final.json", "job.toml",
    "metrics.jsonl", "report.html", "wandb_run_id",
    "faults", "fatal", "flight", "logs", "metrics", "profile", "progress", "selfcheck", "timeline",
)  # fmt: skip
"""The names a job writes at the top of its run directory (the last nine are directories). The
checkpoint and data directories are not among them: they may be links to other disks."""


def planted_links(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The symlinks at the names of ``JOB_WRITTEN`` in ``run_dir`` and inside its directories."""
    run_dir = Path(run_dir)
    found = []
    for name in JOB_WRITTEN:
        path = run_dir / name
        if path.is_symlink():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_symlink())
    return found


NAME_MAX = 255
"""Bytes in one path component (Linux file systems)."""
PATH_MAX = 4095


def check_dir_path(flag: str, path: str | os.PathLike[str]) -> Path:
    """``path`` if the file system can hold it, else ValueError naming ``flag``: a component over
    ``NAME_MAX`` bytes, a path over ``PATH_MAX`` or a control character (a newline in a path
    splits every log line that names it)."""
    text = os.fspath(path)
    shown = text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"{flag} = {shown!r}: contains a control character; must not")
    if len(os.fsencode(text)) > PATH_MAX:
        raise ValueError(f"{flag} = {shown!r}: longer than {PATH_MAX} bytes; must be at most that")
    for part in Path(text).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise ValueError(
                f"{flag} = {shown!r}: a component is {len(os.fsencode(part))} bytes long; each "
                f"must be at most {NAME_MAX}"
            )
    return Path(text)


def make_dir(path: str | os.PathLike[str]) -> Path:
    """Create the directory ``path`` (and missing parents); a symlink at ``path`` is refused."""
    path = Path(path)
    _check_pinned(path)  # never re-creates a moved run directory at its old path
    if path.is_symlink():
        raise _refuse(path, "the directory is a symlink")
    path.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or not path.is_dir():
        raise _refuse(path, "the directory is a symlink")
    return path


class LogFileHandler(logging.FileHandler):
    """A ``logging.FileHandler`` (append) whose file is opened with ``open_append``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, mode="a", encoding="utf-8")

    def _open(self) -> IO:
        return open_append(self.baseFilename)
