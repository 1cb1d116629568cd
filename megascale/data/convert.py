"""``megascale data convert OLD_PREFIX --output NEW_PREFIX``: megascale's former token format
(``MSTOKEN``) -> a Megatron indexed dataset, same documents and token ids.

The old ``PREFIX.idx``: a 32-byte little-endian header (magic ``MSTOKEN\\x00``, version uint32 = 1,
dtype code uint32: 1 = uint16, 2 = uint32, vocab_size uint64, document count n uint64) and n + 1
int64 document offsets in tokens; ``PREFIX.bin``: the tokens back to back. This module is the only
reader of that format left; training reads Megatron's format only. The old files are never changed.
"""

from __future__ import annotations

import argparse
import logging
import os
import struct
from pathlib import Path

import numpy as np

from megascale.data.indexed import (
    LEGACY_MAGIC,
    DataError,
    DatasetInfo,
    bin_path,
    idx_path,
    write_indexed,
)
from megascale.data.tokenizer import EOD

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


def read_legacy(prefix: str | os.PathLike) -> tuple[int, np.ndarray, np.ndarray]:
    """(vocab_size, document offsets, tokens) of an ``MSTOKEN`` file; DataError naming the file."""
    idx, binf = idx_path(prefix), bin_path(prefix)
    for p in (idx, binf):
        if not p.is_file():
            raise DataError(f"{p}: no such file (convert reads OLD_PREFIX.idx + OLD_PREFIX.bin)")
    raw = idx.read_bytes()
    if len(raw) < _HEADER.size or not raw.startswith(LEGACY_MAGIC):
        raise DataError(f"{idx}: not an MSTOKEN token file (header {raw[:8]!r})")
    _magic, version, code, vocab_size, n = _HEADER.unpack_from(raw)
    if version != 1 or code not in _DTYPES or len(raw) != _HEADER.size + 8 * (n + 1):
        raise DataError(f"{idx}: corrupt MSTOKEN header (version {version}, dtype code {code})")
    offsets = np.frombuffer(raw, "<i8", offset=_HEADER.size)
    tokens = np.fromfile(binf, dtype=_DTYPES[code])
    if tokens.size != offsets[-1]:
        raise DataError(f"{binf}: {tokens.size} tokens, expected {offsets[-1]} per {idx.name}")
    return int(vocab_size), offsets, tokens


def convert(old_prefix: str | os.PathLike, new_prefix: str | os.PathLike) -> DatasetInfo:
    """Write ``new_prefix`` (Megatron format + sidecar) from the ``MSTOKEN`` file ``old_prefix``.

    The old files were built with the byte tokenizer (EOD 0), which the sidecar records.
    """
    if Path(os.fspath(old_prefix)).resolve() == Path(os.fspath(new_prefix)).resolve():
        raise DataError(f"--output {new_prefix}: must differ from OLD_PREFIX (the old files stay)")
    vocab_size, offsets, tokens = read_legacy(old_prefix)
    docs = (tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1))
    Path(new_prefix).parent.mkdir(parents=True, exist_ok=True)
    stats = write_indexed(new_prefix, docs, vocab_size)
    info = DatasetInfo("byte", vocab_size, EOD, stats.documents, stats.tokens, stats.max_token)
    info.write(new_prefix)
    logger.info(
        "megascale::data::convert %s -> %s: %d documents, %d tokens",
        old_prefix,
        new_prefix,
        stats.documents,
        stats.tokens,
    )
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale data convert``."""
    parser.add_argument("old_prefix", type=Path, metavar="OLD_PREFIX", help="an MSTOKEN token file")
    parser.add_argument(
        "--output", "-o", required=True, type=Path, metavar="NEW_PREFIX",
        help="writes NEW_PREFIX.bin, NEW_PREFIX.idx (Megatron's format) and NEW_PREFIX.json",
    )  # fmt: skip


def run(args: argparse.Namespace) -> None:
    """Run ``megascale data convert``; raises DataError or OSError (the CLI prints one line)."""
    convert(args.old_prefix, args.output)
