"""Checkpoint plumbing: storage (a directory or any fsspec URL), host snapshots, and broadcasts.

- ``Storage``: the checkpoint root on a local directory or an fsspec filesystem (``file://``,
  ``memory://``, ``s3://`` with s3fs, ...). Every file is written under a temporary name and renamed,
  so a reader sees a whole file or none; writes hash the bytes as they stream out (sha256), reads
  return the bytes so that verifying and loading read storage once.
- ``HostCopier``: stage 1 of a save. Copies a state tree's tensors into host buffers (pinned when
  the source is on a GPU) that are reused from one save to the next; from a GPU on a stream of its
  own, beside the next step's compute.
- ``broadcast_tree``: one rank of a group sends a loaded state tree to its peers (restart
  read-once-and-broadcast). Tensors travel as one byte buffer; the tree's shape goes with
  ``broadcast_object_list``, which only ever carries what the sending rank built itself (data read
  from storage is only ever unpickled by ``torch.load(weights_only=True)``).
- ``check_config``: the checkpoint section's rules (the location's protocol exists, and so on).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import io
import json
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from megascale.config.error import ConfigError

if TYPE_CHECKING:
    from megascale.config import CheckpointConfig

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DONE_DIR = "done"
STEP_PREFIX = "step_"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """``step_00000020`` -> 20; None for any other name."""
    digits = name.removeprefix(STEP_PREFIX)
    if name.startswith(STEP_PREFIX) and len(digits) == 8 and digits.isdigit():
        return int(digits)
    return None


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


def location(cfg: CheckpointConfig, run_dir: Path) -> str:
    """Where this job's checkpoints live: ``checkpoint.url``, else ``RUN_DIR/checkpoints``.

    A URL (``proto://...``) or an absolute directory is used as is; a relative directory is taken
    relative to the run directory.
    """
    if cfg.url is None:
        return str(Path(run_dir) / "checkpoints")
    if "://" in cfg.url or Path(cfg.url).is_absolute():
        return cfg.url
    return str(Path(run_dir) / cfg.url)


def check_config(cfg: CheckpointConfig, world_size: int, *, check_installed: bool = True) -> None:
    """Raise ConfigError naming the field when the checkpoint section cannot work for this job.

    ``check_installed=False`` skips what depends on this machine (whether the URL's fsspec
    protocol's package is installed): for validating a config where it will not run, e.g. in the
    Kubernetes operator; the ranks check it again where they run.
    """
    problems = []
    if cfg.url is not None:
        problems += _url_problems(cfg.url, world_size, check_installed)
    if not cfg.write_timeout_s > 0:
        problems.append(f"checkpoint.write_timeout_s = {cfg.write_timeout_s}: must be > 0")
    if cfg.keep < 1:
        problems.append(
            f"checkpoint.keep = {cfg.keep}: must be >= 1 (the newest complete checkpoint is kept)"
        )
    if cfg.interval < 0:
        problems.append(f"checkpoint.interval = {cfg.interval}: must be >= 0 (0: no checkpoints)")
    if problems:
        raise ConfigError("invalid checkpoint config:\n" + "\n".join(f"  - {p}" for p in problems))


def _url_problems(url: str, world_size: int, check_installed: bool) -> list[str]:
    if not url.strip():
        return [f"checkpoint.url = {url!r}: must be a directory or an fsspec URL, or left out"]
    protocol, _ = fsspec.core.split_protocol(url)
    protocol = protocol or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return [
            f"checkpoint.url = {url!r}: unknown fsspec protocol {protocol!r} (e.g. file://, "
            f"memory://, s3://, gcs://, hdfs://, or a plain directory)"
        ]
    except ImportError as e:
        if check_installed:
            return [f"checkpoint.url = {url!r}: protocol {protocol!r} needs a package: {e}"]
    if protocol == "memory" and world_size > 1:
        return [
            f"checkpoint.url = {url!r}: memory:// lives inside one process, so {world_size} "
            f"ranks cannot share it; use a directory or a shared filesystem URL"
        ]
    return []


# --------------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------------


class RecordingStream:
    """A write stream that keeps the first OSError its writes raised (``error``): ``torch.save``
    turns one into a RuntimeError without its errno (``unexpected pos``), so the caller re-raises
    the real one (``real_error``). Everything else is the wrapped stream's."""

    def __init__(self, sink) -> None:
        self.sink, self.error = sink, None

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            self.error = self.error or e
            raise

    def write(self, data) -> int:
        return self._call(self.sink.write, data)

    def flush(self) -> None:
        self._call(self.sink.flush)

    def close(self) -> None:
        self._call(self.sink.close)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)


def real_error(error: OSError | None, path: str) -> OSError | None:
    """The OSError a write to ``path`` raised, with the path (None when there was none)."""
    if error is None or not error.errno:
        return error
    return OSError(error.errno, os.strerror(error.errno), error.filename or path)


class _HashingWriter(RecordingStream):
    """A write-only stream that hashes and counts what passes through it."""

    def __init__(self, sink) -> None:
        super().__init__(sink)
        self.sha256, self.bytes = hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)  # hashlib releases the GIL for large buffers
        self.bytes += len(data)
        return super().write(data)


class Storage:
    """A checkpoint root: a local directory or an fsspec URL. Paths below are relative to it.

    ``reads`` records every file this process read (relative paths), so tests and benchmarks can
    check who opened what. Thread-safety: one writer thread per process at a time (the caller's
    contract); reads happen outside saves.
    """

    def __init__(self, url: str | Path) -> None:
        self.url = str(url)
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/") or "/"
        # Plain local files: write with fsync, so a manifest never outlives its shards' bytes.
        self.local = type(self.fs) is LocalFileSystem
        self.reads: list[str] = []

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str) -> str:
        """``rel`` for another library: a local path, or a URL with this storage's protocol."""
        return self.path(rel) if self.local else self.fs.unstrip_protocol(self.path(rel))

    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    def _write(self, rel: str, tmp_suffix: str, fill: Callable[[Any], None]) -> tuple[str, int]:
        """Write via ``fill(stream)`` under a temporary name, then rename. Returns (sha256, bytes)."""
        final = self.path(rel)
        tmp = f"{final}.{tmp_suffix}.tmp"
        self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        stream = None
        try:
            if self.local:
                with open(tmp, "wb") as f:
                    stream = _HashingWriter(f)
                    fill(stream)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)  # atomic within a directory
            else:
                with self.fs.open(tmp, "wb") as f:
                    stream = _HashingWriter(f)
                    fill(stream)
                self.fs.mv(tmp, final)
        except BaseException as e:
            self._discard(tmp)  # a failed write (a full disk) leaves nothing behind
            cause = real_error(stream.error if stream is not None else None, tmp)
            if cause is not None and not isinstance(e, OSError):
                raise cause from e  # the errno torch.save dropped (ENOSPC, EIO)
            raise
        return stream.sha256.hexdigest(), stream.bytes

    def _discard(self, path: str) -> None:
        try:
            if self.fs.exists(path):
                self.fs.rm(path)
        except (OSError, ValueError) as e:
            logger.warning("could not remove the partial file %s: %s", path, e)

    def check_writable(self) -> None:
        """Raise OSError (with its errno) unless a file can be written, synced and removed at the
        root: checked before training starts, not at the first save."""
        probe = f".write-probe-{os.getpid()}"
        self._write(probe, "probe", lambda stream: stream.write(b"megascale"))
        self.fs.rm(self.path(probe))

    def write_state(self, rel: str, state: dict, tmp_suffix: str) -> tuple[str, int]:
        """``torch.save`` a state tree to ``rel``; returns (sha256, bytes) of what was written."""
        return self._write(rel, tmp_suffix, lambda stream: torch.save(state, stream))

    def write_bytes(self, rel: str, data: bytes, tmp_suffix: str) -> tuple[str, int]:
        return self._write(rel, tmp_suffix, lambda stream: stream.write(data))

    def write_json(self, rel: str, obj: Any, tmp_suffix: str) -> None:
        data = json.dumps(obj, indent=1, sort_keys=True).encode()
        self._write(rel, tmp_suffix, lambda stream: stream.write(data))

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's bytes; None when it does not exist or cannot be read."""
        self.reads.append(rel)
        try:
            return self.fs.cat_file(self.path(rel))
        except (OSError, ValueError) as e:  # missing, permissions, a broken remote
            logger.debug("cannot read %s: %s", self.path(rel), e)
            return None

    def read_json(self, rel: str) -> dict | None:
        data = self.read_bytes(rel)
        if data is None:
            return None
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        return obj if isinstance(obj, dict) else None

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) in directory ``rel``; [] when it does not exist."""
        self.fs.invalidate_cache(self.path(rel))
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Best effort: a file or directory that is already gone is not an error."""
        try:
            self.fs.rm(self.path(rel), recursive=recursive)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("could not remove %s: %s", self.path(rel), e)

    def steps(self) -> list[int]:
        """Steps that have a checkpoint directory, complete or not, oldest first."""
        found = (parse_step(name) for name in self.listdir(""))
        return sorted(s for s in found if s is not None)

    def complete_steps(self) -> list[int]:
        """Steps whose directory has a manifest, oldest first (the manifest is written last)."""
        return [s for s in self.steps() if self.exists(f"{step_name(s)}/{MANIFEST}")]


def rng_state() -> dict:
    """This rank's RNG states: CPU, megatron's model-parallel tracker, CUDA where present."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def os_cause(error: BaseException) -> str:
    """The operating-system cause in an exception's chain, in one line (``No space left on device
    (ENOSPC): /ckpt/step_00000010/...``); '' when none is an OSError with an errno."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            name = errno.errorcode.get(error.errno, str(error.errno))
            where = f": {error.filename}" if error.filename else ""
            return f"{os.strerror(error.errno)} ({name}){where}"
        error = error.__cause__ or error.__context__
    return ""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_state_bytes(data: bytes) -> dict:
    """Tensors and plain data only: ``weights_only`` never runs code from the file."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------------------------------
# State trees: host copies (stage 1) and broadcasts (restart)
# --------------------------------------------------------------------------------------------------


def _map_tree(tree: Any, fn: Callable[[tuple, torch.Tensor], Any], path: tuple = ()) -> Any:
    """``tree`` with every tensor leaf replaced by ``fn(path, tensor)``; other leaves copied."""
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map_tree(v, fn, (*path, k))) for k, v in tree.items())
    if isinstance(tree, list | tuple):
        items = [_map_tree(v, fn, (*path, i)) for i, v in enumerate(tree)]
        return type(tree)(items) if isinstance(tree, list) else tuple(items)
    if tree is None or isinstance(tree, bool | int | float | str | bytes | torch.dtype):
        return tree
    return copy.deepcopy(tree)


def tree_bytes(tree: Any) -> int:
    total = 0

    def count(_path: tuple, t: torch.Tensor) -> None:
        nonlocal total
        total += t.numel() * t.element_size()

    _map_tree(tree, count)
    return total


class HostCopier:
    """Stage 1 of a save: copy a state tree to host memory, into buffers reused from save to save.

    Contract: the previous copy must no longer be in use (its stage 2 finished) when ``copy`` is
    called again, because the buffers are overwritten. Buffers are pinned when a tensor comes from a
    GPU, so the device-to-host copies run at full bandwidth and without paging.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None
        self.writer: threading.Thread | None = None
        """The stage 2 reading the buffers of the latest copy (None: none yet)."""

    @property
    def free(self) -> bool:
        """Whether no stage 2 reads the buffers any more: a copier kept from an earlier trainer
        of this process (a rank that rejoined after a fault) may be reused only then."""
        return self.writer is None or not self.writer.is_alive()

    def _buffer(self, path: tuple, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            buf = buf.pin_memory() if t.is_cuda else buf.zero_()  # zero_: fault the pages in now
            self._buffers[path] = buf
        return buf

    def reserve(self, tree: Any) -> None:
        """Allocate (and pin) the buffers for trees shaped like ``tree`` ahead of the first save,
        so that its stall is a copy like every later one's."""
        _map_tree(tree, self._buffer)

    def copy(self, tree: Any) -> tuple[Any, torch.cuda.Event | None]:
        """The host copy of ``tree``, and from a GPU the event after which it holds the data
        (None: copied already). GPU tensors are copied on a stream of this copier's, after what
        the current stream has queued: the caller returns to training at once, and must not
        change those tensors before the event (``Trainer.reading_state``: the next update waits
        for it) nor read the copy before it (stage 2 waits for it)."""
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []

        def to_host(path: tuple, t: torch.Tensor) -> torch.Tensor:
            buf = self._buffer(path, t)
            if t.is_cuda:
                pending.append((buf, t.detach()))
            else:
                buf.copy_(t.detach())
            return buf

        host = _map_tree(tree, to_host)
        if not pending:
            return host, None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=pending[0][1].device)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for buf, t in pending:
                buf.copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # a temporary's memory is not reused before this
        copied = torch.cuda.Event()
        copied.record(self._stream)
        return host, copied

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sits in a broadcast byte buffer."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


_ALIGN = 64  # every tensor starts on a 64-byte boundary, so any dtype can view its bytes


def _flatten(tree: Any) -> tuple[Any, list[torch.Tensor], int]:
    tensors: list[torch.Tensor] = []
    offset = 0

    def slot(_path: tuple, t: torch.Tensor) -> _Slot:
        nonlocal offset
        tensors.append(t)
        s = _Slot(offset, tuple(t.shape), t.dtype)
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return s

    return _map_tree(tree, slot), tensors, offset


def _slots(tree: Any) -> Iterator[_Slot]:
    if isinstance(tree, _Slot):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _slots(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _slots(v)


def _unflatten(skeleton: Any, buffer: torch.Tensor) -> Any:
    def view(s: _Slot) -> torch.Tensor:
        nbytes = s.dtype.itemsize * int(torch.Size(s.shape).numel())
        return buffer[s.offset : s.offset + nbytes].view(s.dtype).reshape(s.shape)

    def walk(node: Any) -> Any:
        if isinstance(node, _Slot):
            return view(node)
        if isinstance(node, dict):
            return type(node)((k, walk(v)) for k, v in node.items())
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return node

    return walk(skeleton)


def broadcast_tree(tree: Any, src: int, group: dist.ProcessGroup, device: str) -> Any:
    """Send ``tree`` from global rank ``src`` to every rank of ``group``; return it everywhere.

    The source passes the tree, the others pass None. Tensors arrive on ``device`` (views into one
    received byte buffer); the structure and plain values arrive as they were. Collective on
    ``group``: two broadcasts (the structure, then one byte buffer).
    """
    is_src = dist.get_rank() == src
    if is_src:
        skeleton, tensors, total = _flatten(tree)
        header = [skeleton, total]
    else:
        header = [None, None]
    dist.broadcast_object_list(header, src=src, group=group, device=torch.device(device))
    skeleton, total = header
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    if is_src:
        for s, t in zip(_slots(skeleton), tensors, strict=True):
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[s.offset : s.offset + flat.numel()].copy_(flat)
    if total:
        dist.broadcast(buffer, src=src, group=group)
    return _unflatten(skeleton, buffer)
