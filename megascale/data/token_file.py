"""The megascale token file: ``PREFIX.bin`` (token ids) + ``PREFIX.idx`` (header, offsets).

Layout, all integers little-endian:

``PREFIX.idx``::

    offset  size  field
    0       8     magic, the bytes b"MSTOKEN\\x00"
    8       4     version, uint32, currently 1
    12      4     dtype code, uint32: 1 = uint16 tokens, 2 = uint32 tokens
    16      8     vocab_size, uint64 (every token id is < vocab_size)
    24      8     num_documents, uint64 (call it n)
    32      8*(n+1)  document offsets, int64, in tokens: document i is tokens[off[i]:off[i+1]];
                  off[0] == 0, non-decreasing, off[n] == number of tokens in PREFIX.bin

``PREFIX.bin``: the token ids of all documents back to back, ``off[n]`` values of the dtype above
(2 bytes each for uint16, 4 for uint32), nothing else. The dtype is uint16 when vocab_size < 65536,
uint32 otherwise.

The format does not add separators; ``megascale.data.build`` ends every document with the
tokenizer's end-of-document id, so the concatenated stream is ready for GPT sampling.

Writes are atomic: both files are written under temporary names in the target directory and renamed
into place, ``.bin`` first and ``.idx`` last, so a reader that finds ``PREFIX.idx`` finds a complete
``PREFIX.bin`` (concurrent writers of identical content are safe).
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MSTOKEN\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, dtype code, vocab_size, num_documents
HEADER_SIZE = _HEADER.size  # 32
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


class TokenFileError(ValueError):
    """A token file is missing, corrupt, truncated or inconsistent; the message names the file."""


def bin_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.bin`` (the suffix is appended, never substituted: prefixes may contain dots)."""
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.idx``."""
    return Path(f"{os.fspath(prefix)}.idx")


def dtype_code_for_vocab(vocab_size: int) -> int:
    """1 (uint16) when vocab_size < 65536, else 2 (uint32)."""
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size={vocab_size} is out of range (accepted: 1..2**32)")
    return 1 if vocab_size < 65536 else 2


@dataclass(frozen=True)
class TokenFileStats:
    """What ``write_token_file`` wrote."""

    prefix: Path
    num_documents: int
    num_tokens: int
    vocab_size: int
    dtype: str


def write_token_file(
    prefix: str | os.PathLike, documents: Iterable[Sequence[int] | np.ndarray], vocab_size: int
) -> TokenFileStats:
    """Write ``documents`` (each a sequence of token ids) as ``PREFIX.bin`` + ``PREFIX.idx``.

    Raises ValueError if a token id is outside ``0..vocab_size-1``. Atomic (see the module
    docstring); the parent directory must exist.
    """
    code = dtype_code_for_vocab(vocab_size)
    dtype = _DTYPES[code]
    prefix = Path(prefix)
    directory = prefix.parent
    offsets = [0]
    tmp_bin = _temp_name(directory, prefix.name + ".bin")
    tmp_idx = _temp_name(directory, prefix.name + ".idx")
    try:
        with open(tmp_bin, "wb") as f:
            for i, doc in enumerate(documents):
                arr = np.asarray(doc, dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                    bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
                    raise ValueError(
                        f"document {i} has token id {bad}; accepted: 0..{vocab_size - 1} "
                        f"(vocab_size={vocab_size})"
                    )
                f.write(arr.astype(dtype).tobytes())
                offsets.append(offsets[-1] + arr.size)
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, code, vocab_size, len(offsets) - 1))
            f.write(np.asarray(offsets, dtype="<i8").tobytes())
        os.replace(tmp_bin, bin_path(prefix))
        os.replace(tmp_idx, idx_path(prefix))
    finally:
        for tmp in (tmp_bin, tmp_idx):
            if tmp.exists():
                tmp.unlink()
    return TokenFileStats(prefix, len(offsets) - 1, offsets[-1], vocab_size, dtype.name)


def _temp_name(directory: Path, name: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    return Path(path)


class TokenFile:
    """Read-only view of a token file; the tokens are a ``numpy.memmap``, never loaded eagerly.

    Attributes: ``prefix``, ``vocab_size``, ``dtype``, ``num_documents``, ``offsets`` (int64 array
    of length num_documents + 1) and ``tokens`` (1-D array of all token ids, the file's dtype).
    Raises ``TokenFileError`` naming the file and what was expected when a file is missing, has a
    bad magic/version/dtype, is truncated, or its offsets disagree with the ``.bin`` size.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        idx, binf = idx_path(prefix), bin_path(prefix)
        for p in (idx, binf):
            if not p.is_file():
                raise TokenFileError(
                    f"{p}: no such file; a token file is PREFIX.idx + PREFIX.bin "
                    "(make one with `megascale data build INPUT... --output PREFIX`)"
                )
        raw = idx.read_bytes()
        if len(raw) < HEADER_SIZE:
            raise TokenFileError(
                f"{idx}: truncated header: {len(raw)} bytes, expected at least {HEADER_SIZE}"
            )
        magic, version, code, vocab_size, n = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise TokenFileError(f"{idx}: bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise TokenFileError(f"{idx}: unsupported version {version}, expected {VERSION}")
        if code not in _DTYPES:
            raise TokenFileError(f"{idx}: unknown dtype code {code}, expected one of 1, 2")
        expected = HEADER_SIZE + 8 * (n + 1)
        if len(raw) != expected:
            raise TokenFileError(
                f"{idx}: {len(raw)} bytes, expected {expected} "
                f"(32-byte header + 8 * ({n} documents + 1) offsets)"
            )
        offsets = np.frombuffer(raw, dtype="<i8", offset=HEADER_SIZE).astype(np.int64)
        if offsets[0] != 0 or np.any(np.diff(offsets) < 0):
            raise TokenFileError(f"{idx}: document offsets must start at 0 and never decrease")
        self.dtype = _DTYPES[code]
        n_tokens = int(offsets[-1])
        bin_size = binf.stat().st_size
        if bin_size != n_tokens * self.dtype.itemsize:
            raise TokenFileError(
                f"{binf}: {bin_size} bytes, expected {n_tokens * self.dtype.itemsize} "
                f"({n_tokens} tokens of {self.dtype.name} per {idx})"
            )
        self.vocab_size = int(vocab_size)
        self.num_documents = int(n)
        self.offsets = offsets
        if n_tokens == 0:  # numpy cannot memory-map an empty file
            self.tokens = np.empty(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(binf, dtype=self.dtype, mode="r", shape=(n_tokens,))

    @property
    def num_tokens(self) -> int:
        """Tokens in the file (all documents, separators included)."""
        return int(self.offsets[-1])

    def document(self, i: int) -> np.ndarray:
        """The token ids of document ``i`` (a view into the memory map)."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range (file has {self.num_documents})")
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.prefix)!r}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, vocab_size={self.vocab_size}, dtype={self.dtype.name})"
        )
