"""Where a file a checkpoint's manifest names may be: inside its step directory, and nowhere else.

A manifest is data read from disk (or a bucket) and may have been written by someone else: its file
names must never lead a reader out of the checkpoint. ``resolve_file`` is the one place that turns a
manifest name into a path; every reader (loading, the end-of-launch digest, fault injection) calls
it before it opens anything.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from pathlib import Path

_SEPARATORS = ("/", "\\", "\0")


class CheckpointPathError(ValueError):
    """A manifest names a file that is not a regular file inside its step directory."""


RANK_DIR = re.compile(r"rank_\d{5}")
"""The one directory level a checkpoint file may sit in: its rank's (``rank_00003/...``)."""


def check_name(name: object) -> str:
    """``name`` if it is a plain file name, or one inside a rank directory (``rank_00003/x``);
    CheckpointPathError otherwise: not a string, empty, ``.`` or ``..``, absolute, or with any
    other directory part, ``\\`` or NUL."""
    if isinstance(name, str) and name.count("/") == 1:
        folder, base = name.split("/")
        if RANK_DIR.fullmatch(folder):
            check_name(base)
            return name
    if not isinstance(name, str) or name in ("", ".", ".."):
        raise CheckpointPathError(f"checkpoint file name {name!r}: must be a plain file name")
    if os.path.isabs(name) or any(sep in name for sep in _SEPARATORS):
        raise CheckpointPathError(
            f"checkpoint file name {name!r}: must be a plain file name inside the step directory "
            "(no absolute path, no directory part but a rank's, no '..')"
        )
    return name


def resolve_file(step_dir: str | os.PathLike[str], name: object, *, local: bool = True) -> str:
    """The path of the file ``name`` (a manifest entry) in the checkpoint directory ``step_dir``.

    Refuses (``CheckpointPathError``) a name that ``check_name`` refuses and, for a local
    directory (``local=True``), one that does not exist, resolves through symlinks outside
    ``step_dir``, or is not a regular file (a directory, a device such as ``/dev/zero``, a FIFO).
    For a remote fsspec directory (``local=False``) only the name is checked: buckets have no
    symlinks. Returns the resolved path (local) or ``step_dir/name`` (remote)."""
    name = check_name(name)
    if not local:
        return posixpath.join(os.fspath(step_dir), name)
    root = Path(step_dir).resolve()
    try:
        target = (root / name).resolve(strict=True)
        mode = os.stat(target).st_mode
    except (OSError, RuntimeError) as e:  # missing, a symlink loop, permissions
        raise CheckpointPathError(
            f"checkpoint file {name!r} in {root}: cannot be read ({e})"
        ) from e
    if target.parent != root / posixpath.dirname(name):
        raise CheckpointPathError(
            f"checkpoint file {name!r} in {root}: resolves to {target}, outside the step directory"
        )
    if not stat.S_ISREG(mode):
        raise CheckpointPathError(
            f"checkpoint file {name!r} in {root}: is not a regular file ({target})"
        )
    return str(target)
