"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read and written by megatron-core.

The format is the one Megatron-LM's ``tools/preprocess_data.py`` writes: ``PREFIX.idx`` starts with
``MMIDIDX\\x00\\x00``, a version (1), a dtype code and the sequence lengths, byte pointers and
document indices; ``PREFIX.bin`` holds the token ids of every sequence back to back in that dtype.
megascale writes one sequence per document, each ending with the tokenizer's end-of-document id,
exactly as ``preprocess_data.py --append-eod`` does.

Reading and writing go through megatron-core (``IndexedDataset`` / ``IndexedDatasetBuilder``); this
module only adds what a user needs before that: a one-line ``DataError`` naming the file for a
missing prefix, a file in another format (an old megascale ``MSTOKEN`` file gets the command that
converts it), a truncated ``.bin``, an ``.idx`` of another version or dtype, or whose sequences
or document indices point outside the ``.bin`` (every entry checked, in chunks); atomic writes;
and the small ``PREFIX.json`` sidecar that records the tokenizer (``PREFIX.tokenizer.json`` is
its copy).

megatron-core is imported inside the functions that need it, so the CLI parser starts without it.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"MSTOKEN\x00"
"""The header of megascale's former token format; such files are converted, never read."""
# megatron-core's DType codes (indexed_dataset.DType), for messages without importing it.
_DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                7: "float32", 8: "uint16"}  # fmt: skip
_CHUNK = 1 << 24  # tokens per chunk when scanning a .bin or an index
SCAN_TOKENS = 1 << 28
"""At most this many tokens of a ``.bin`` are read to find its largest id (``scan_max_token``):
all of a smaller file; of a larger one, evenly spread chunks (its first and last included)."""
INDEX_VERSION = 1


class DataError(ValueError):
    """A dataset, tokenizer or data setting is missing or unusable; the message names the file or
    field, the value, and what is accepted (one line)."""


class EmptyDatasetError(DataError):
    """``write_indexed`` got no documents (nothing was written)."""


def bin_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.bin`` (the suffix is appended, never substituted: prefixes may contain dots)."""
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.idx``."""
    return Path(f"{os.fspath(prefix)}.idx")


def sidecar_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.json``: what built the dataset (see ``DatasetInfo``)."""
    return Path(f"{os.fspath(prefix)}.json")


TOKENIZER_FILES = {
    "hf": "tokenizer.json",
    "sentencepiece": "tokenizer.model",
    "tiktoken": "tiktoken.json",
}
"""The file name of each tokenizer kind (``DatasetInfo.tokenizer``) read from a file: its copy
next to a dataset is ``PREFIX.<name>``, in a run directory ``RUN_DIR/tokenizer/<name>``."""


def tokenizer_copy_path(prefix: str | os.PathLike, tokenizer: str = "hf") -> Path:
    """``PREFIX.tokenizer.json`` (``PREFIX.tokenizer.model``, ``PREFIX.tiktoken.json``): the
    tokenizer file the dataset was built with."""
    return Path(f"{os.fspath(prefix)}.{TOKENIZER_FILES[tokenizer]}")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """megatron-core's choice (``DType.optimal_dtype``): uint16 below 65500 ids, else int32."""
    if not 0 < vocab_size < 2**31:
        raise DataError(f"vocab_size={vocab_size}: accepted 1..2**31-1")
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


@dataclass(frozen=True)
class DatasetInfo:
    """``PREFIX.json``, written by ``megascale data build`` next to the dataset.

    ``tokenizer`` is ``"byte"``, ``"hf"``, ``"sentencepiece"`` or ``"tiktoken"`` (then
    ``tokenizer_copy_path(PREFIX, tokenizer)`` is the tokenizer);
    ``max_token`` is the largest id in ``PREFIX.bin`` (checked against ``model.vocab_size``).
    """

    tokenizer: str
    vocab_size: int
    eod: int
    documents: int
    tokens: int
    max_token: int

    def write(self, prefix: str | os.PathLike) -> None:
        _atomic_write_text(sidecar_path(prefix), json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, prefix: str | os.PathLike) -> DatasetInfo | None:
        """The sidecar of ``prefix``, or None when there is none (a dataset made elsewhere)."""
        path = sidecar_path(prefix)
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise DataError(f"{path}: not a megascale dataset sidecar ({e})") from e


def check_prefix(prefix: str | os.PathLike, field: str = "data.path") -> None:
    """Raise DataError (one line, naming the file) unless ``prefix`` is a readable Megatron
    indexed dataset whose ``.bin`` matches its ``.idx``. Reads the header and sizes only."""
    idx, binf = idx_path(prefix), bin_path(prefix)
    for p in (idx, binf):
        if not p.is_file():
            raise DataError(
                f"{field}={os.fspath(prefix)!r}: {p} does not exist; a dataset is PREFIX.idx + "
                "PREFIX.bin (make one with `megascale data build INPUT... --output PREFIX`)"
            )
    with open(idx, "rb") as f:
        head = f.read(len(MEGATRON_MAGIC) + 9)
    if head.startswith(LEGACY_MAGIC):
        raise DataError(
            f"{idx}: an old megascale token file (MSTOKEN); convert it with "
            f"`megascale data convert {os.fspath(prefix)} --output NEW_PREFIX`"
        )
    if not head.startswith(MEGATRON_MAGIC) or len(head) < len(MEGATRON_MAGIC) + 9:
        raise DataError(
            f"{idx}: not a Megatron indexed dataset (header {head[:9]!r}, expected "
            f"{MEGATRON_MAGIC!r})"
        )
    (version,) = struct.unpack_from("<Q", head, len(MEGATRON_MAGIC))
    if version != INDEX_VERSION:
        raise DataError(
            f"{idx}: index version {version}; accepted {INDEX_VERSION} (Megatron-LM's "
            "MMIDIDX format): rebuild it with `megascale data build`"
        )
    code = head[len(MEGATRON_MAGIC) + 8]
    if code not in _DTYPE_CODES:
        raise DataError(f"{idx}: unknown dtype code {code}; accepted {sorted(_DTYPE_CODES)}")
    expected = _expected_bin_bytes(idx, code)
    actual = binf.stat().st_size
    if actual != expected:
        itemsize = np.dtype(_DTYPE_CODES[code]).itemsize
        raise DataError(
            f"{binf}: {actual} bytes, expected {expected} ({expected // itemsize} tokens of "
            f"{_DTYPE_CODES[code]} per {idx.name}): the .bin is truncated or the .idx was "
            "written for another dtype"
        )
    _check_index(idx, binf, np.dtype(_DTYPE_CODES[code]).itemsize, actual)


def _check_index(idx: Path, binf: Path, itemsize: int, bin_bytes: int) -> None:
    """Raise DataError unless every sequence of ``idx`` lies inside the ``.bin`` (a length >= 0,
    a pointer >= 0, ending by its last byte) and the document indices rise from 0 to the number
    of sequences. Reads the index in chunks (12 bytes per sequence, 8 per document)."""
    head = len(MEGATRON_MAGIC) + 8 + 1 + 16
    with open(idx, "rb") as f:
        f.seek(head - 16)
        n_seq, n_doc = struct.unpack("<QQ", f.read(16))
    if n_seq:
        lengths = np.memmap(idx, np.int32, "r", head, (n_seq,))
        pointers = np.memmap(idx, np.int64, "r", head + 4 * n_seq, (n_seq,))
    for start in range(0, n_seq, _CHUNK):
        length = lengths[start : start + _CHUNK].astype(np.int64)
        pointer = pointers[start : start + _CHUNK]
        bad = np.flatnonzero(
            (length < 0) | (pointer < 0) | (pointer + length * itemsize > bin_bytes)
        )
        if bad.size:
            i = int(bad[0])
            where = f"{idx}: sequence {start + i} (pointer {int(pointer[i])}, length {length[i]})"
            if pointer[i] < 0 or length[i] < 0:
                raise DataError(f"{where}: accepted >= 0; a corrupt index, rebuild the dataset")
            raise DataError(
                f"{where} ends past the end of {binf.name} ({bin_bytes} bytes): the index does "
                "not belong to this .bin; rebuild the dataset"
            )
    if n_doc == 0:
        return
    docs = np.memmap(idx, np.int64, "r", head + 12 * n_seq, (n_doc,))
    previous = 0
    for start in range(0, n_doc, _CHUNK):
        chunk = docs[start : start + _CHUNK]
        steps = np.diff(chunk, prepend=previous)
        bad = np.flatnonzero((chunk < 0) | (chunk > n_seq) | (steps < 0))
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{idx}: document index {start + i} is {int(chunk[i])}; accepted 0..{n_seq} "
                "(the number of sequences), never decreasing: a corrupt index; rebuild the dataset"
            )
        previous = int(chunk[-1])


def _expected_bin_bytes(idx: Path, code: int) -> int:
    """Bytes the ``.bin`` must have per the ``.idx``: the last pointer + the last length. Reads
    the header and those two numbers only (an index holds 12+ bytes per sequence)."""
    head = len(MEGATRON_MAGIC) + 8 + 1 + 16  # magic, version, dtype code, counts
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        f.seek(head - 16)
        counts = f.read(16)
        if len(counts) < 16:
            raise DataError(f"{idx}: truncated index ({size} bytes, header needs {head})")
        n_seq, n_doc = struct.unpack("<QQ", counts)
        if size < head + 12 * n_seq + 8 * n_doc:
            raise DataError(
                f"{idx}: truncated index ({size} bytes, expected {head + 12 * n_seq + 8 * n_doc} "
                f"for {n_seq} sequences and {n_doc} document indices)"
            )
        if n_seq == 0:
            return 0
        f.seek(head + 4 * (n_seq - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(head + 4 * n_seq + 8 * (n_seq - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
    return last_pointer + last_length * np.dtype(_DTYPE_CODES[code]).itemsize


def open_indexed(prefix: str | os.PathLike, field: str = "data.path"):
    """megatron-core's ``IndexedDataset`` for ``prefix`` (memory-mapped), after ``check_prefix``."""
    check_prefix(prefix, field)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(os.fspath(prefix), multimodal=False, mmap=True)


def token_count(prefix: str | os.PathLike) -> int:
    """The number of tokens ``PREFIX.bin`` holds (its size over the index's dtype)."""
    with open(idx_path(prefix), "rb") as f:
        code = f.read(len(MEGATRON_MAGIC) + 9)[-1]
    return bin_path(prefix).stat().st_size // np.dtype(_DTYPE_CODES.get(code, "uint8")).itemsize


def scan_max_token(prefix: str | os.PathLike, limit: int | None = SCAN_TOKENS) -> int:
    """The largest token id found in ``PREFIX.bin``'s own content (-1 when empty), whatever
    ``PREFIX.json`` says. ``limit``: read at most that many tokens (``SCAN_TOKENS``: evenly spread
    chunks of a larger file, its first and last included); None reads the whole file."""
    check_prefix(prefix)
    with open(idx_path(prefix), "rb") as f:
        code = f.read(len(MEGATRON_MAGIC) + 9)[-1]
    tokens = _memmap(bin_path(prefix), np.dtype(_DTYPE_CODES[code]))
    starts = range(0, len(tokens), _CHUNK)
    if limit is not None and len(tokens) > limit:
        chunks = max(2, limit // _CHUNK)
        last = len(tokens) - _CHUNK
        starts = sorted({round(k * last / (chunks - 1)) for k in range(chunks)})
    return max((int(tokens[i : i + _CHUNK].max()) for i in starts), default=-1)


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot memory-map an empty file
        return np.empty(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


@dataclass(frozen=True)
class WriteStats:
    """What ``write_indexed`` wrote."""

    prefix: Path
    documents: int
    tokens: int
    max_token: int
    dtype: str


def write_indexed(
    prefix: str | os.PathLike,
    documents: Iterable[Sequence[int] | np.ndarray],
    vocab_size: int,
) -> WriteStats:
    """Write ``documents`` (token id sequences) with megatron-core's ``IndexedDatasetBuilder``.

    One sequence per document (the caller appends the end-of-document id). The dtype follows
    ``vocab_size`` (``dtype_for_vocab``). Raises DataError for an id outside ``0..vocab_size-1``.
    Atomic: both files are written under temporary names in the target directory and renamed into
    place, ``.bin`` first and ``.idx`` last, so a reader that finds ``PREFIX.idx`` finds a complete
    ``PREFIX.bin``; nothing is left behind on failure, and no documents at all raise
    EmptyDatasetError before an existing dataset at ``prefix`` is touched. The parent directory must exist.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = dtype_for_vocab(vocab_size)
    prefix = Path(prefix)
    tmp = _temp_prefix(prefix)
    n_docs = n_tokens = 0
    top = -1
    try:
        builder = IndexedDatasetBuilder(os.fspath(bin_path(tmp)), dtype=dtype.type)
        for i, doc in enumerate(documents):
            arr = np.asarray(doc, dtype=np.int64)
            if arr.size:
                lo, hi = int(arr.min()), int(arr.max())
                if lo < 0 or hi >= vocab_size:
                    raise DataError(
                        f"document {i}: token id {lo if lo < 0 else hi}; accepted "
                        f"0..{vocab_size - 1} (vocab_size={vocab_size})"
                    )
                top = max(top, hi)
            builder.add_document(arr, [arr.size])
            n_docs, n_tokens = n_docs + 1, n_tokens + arr.size
        if n_docs == 0:
            raise EmptyDatasetError(f"{prefix}: no documents to write")
        builder.finalize(os.fspath(idx_path(tmp)))
        os.replace(bin_path(tmp), bin_path(prefix))
        os.replace(idx_path(tmp), idx_path(prefix))
    finally:
        for p in (bin_path(tmp), idx_path(tmp), tmp):
            p.unlink(missing_ok=True)
    return WriteStats(prefix, n_docs, n_tokens, top, dtype.name)


def _temp_prefix(prefix: Path) -> Path:
    fd, path = tempfile.mkstemp(prefix=f".{prefix.name}.", suffix=".tmp", dir=prefix.parent)
    os.close(fd)
    return Path(path)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
