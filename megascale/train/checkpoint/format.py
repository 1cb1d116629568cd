"""The files of a layout-independent checkpoint: torch.distributed.checkpoint (DCP) on disk.

Layout of ``step_NNNNNNNN/``::

    rank_00003/__0_0.distcp   rank 3's pieces of the global tensors (DCP's file format)
    rank_00003/.metadata      which pieces, where (a DCP metadata file)
    rank_00003/rng.pt         rank 3's RNG state (restored only at the same layout)
    common.pt                 the job's scalars: step, scheduler, data position, optimizer step count
    .metadata                 the union of every rank's metadata, written by rank 0 after all
                              ranks' files: the step directory is a plain DCP checkpoint that
                              ``torch.distributed.checkpoint`` (or its ``format_utils``) reads
    manifest.json             written LAST: layout, every file's sha256 and size

Why one DCP checkpoint per rank, merged, instead of one collective ``dcp.save``: a collective save
plans with all-gathers on a process group, so in the background it needs a process group of its
own, and every rank must reach the same save before any file is final. Per-rank saves
(``no_dist``) need no communication at all; stage 2 stays a pure background write, and the
manifest protocol (done markers, manifest last) decides when the checkpoint is complete.

Reading never runs code from the checkpoint: DCP's own reader unpickles ``.metadata`` with plain
``pickle``; ``MergedReader`` unpickles it with an allow-list of DCP's metadata classes, and tensor
data is read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megascale.train.checkpoint.storage import RecordingStream, real_error

METADATA = ".metadata"

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch", "strided"),
    ("torch", "float32"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("torch", "float64"),
    ("torch", "int64"),
    ("torch", "int32"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("torch._utils", "_rebuild_tensor_v2"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: refused")


_DATA_FILE = re.compile(r"(rank_\d{5}/)?__\d+_\d+\.distcp")


def load_metadata(data: bytes) -> Metadata:
    """A DCP ``.metadata`` file's content, unpickled with an allow-list (never runs code). Every
    data file it names must be one this format writes (``rank_NNNNN/__R_I.distcp``): a name
    leaving the step directory is refused, so a reader never opens a file outside it."""
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"checkpoint metadata is a {type(metadata).__name__}")
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not _DATA_FILE.fullmatch(path):
            raise pickle.UnpicklingError(f"checkpoint metadata names data file {path!r}: refused")
    return metadata


def merge_metadata(parts: dict[str, Metadata]) -> Metadata:
    """One Metadata from per-rank ones: {subdirectory: its metadata}. Chunks of the same tensor
    from different ranks are concatenated; storage paths become relative to the step directory."""
    tensors: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for subdir, md in sorted(parts.items()):
        for fqn, item in md.state_dict_metadata.items():
            if fqn in tensors and isinstance(item, TensorStorageMetadata):
                tensors[fqn].chunks.extend(item.chunks)
            else:
                tensors[fqn] = item
        for index, info in (md.storage_data or {}).items():
            info.relative_path = f"{subdir}/{info.relative_path}"
            storage[index] = info
    return Metadata(state_dict_metadata=tensors, storage_data=storage)


def _local(path: str) -> str | None:
    """The local directory of a path or ``file://`` URL; None for another fsspec URL."""
    if path.startswith("file://"):
        return path.removeprefix("file://")
    return None if "://" in path else path


def _reader(path: str, metadata: Metadata) -> FileSystemReader:
    """A DCP reader for a step directory whose metadata is given (merged from the ranks', already
    verified against the manifest) rather than unpickled from storage."""
    local = _local(path)
    base = FileSystemReader if local is not None else FsspecReader

    class MergedReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return metadata

    return MergedReader(local if local is not None else path)


def write_pieces(state: dict[str, Any], path: str) -> None:
    """This rank's pieces as a standalone DCP checkpoint in directory ``path`` (no communication)."""
    local = _local(path)
    kwargs = {"single_file_per_rank": True, "sync_files": True, "thread_count": 1}
    if local is not None:
        writer = FileSystemWriter(local, **kwargs)
    else:
        writer = FsspecWriter(path, **kwargs)
    opened = _record_streams(writer.fs)
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        # DCP reports a failed write (a full disk) without its errno: raise the OSError itself
        errors = [real_error(s.error, str(p)) for p, s in opened if s.error is not None]
        if errors and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise errors[0] from e
        raise


def _record_streams(fs: Any) -> list[tuple[Any, RecordingStream]]:
    """Make ``fs`` (a DCP writer's file system) hand out RecordingStreams; the list of (path,
    stream) it opened, to find the OSError of a failed save."""
    opened: list[tuple[Any, RecordingStream]] = []
    create = fs.create_stream

    @contextmanager
    def create_stream(path: Any, mode: str) -> Iterator[Any]:
        with create(path, mode) as stream:
            recording = RecordingStream(stream)
            opened.append((path, recording))
            yield recording

    fs.create_stream = create_stream
    return opened


def read_pieces(state: dict[str, Any], path: str, metadata: Metadata) -> None:
    """Fill ``state``'s ShardedTensors (in place) from the step directory ``path``."""
    dcp.load(state, storage_reader=_reader(path, metadata), no_dist=True)


def metadata_bytes(metadata: Metadata) -> bytes:
    return pickle.dumps(metadata)


def dtype_ok(metadata: Metadata, key: str, dtype: torch.dtype) -> bool:
    item = metadata.state_dict_metadata.get(key)
    return isinstance(item, TensorStorageMetadata) and item.properties.dtype == dtype


def read_whole(path: str, metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named global tensors, whole, read from the step directory ``path`` in this process."""
    state = {}
    for key in keys:
        item = metadata.state_dict_metadata[key]
        state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # DCP notes that it loads in one process: that is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_reader(path, metadata), no_dist=True)
    return state
