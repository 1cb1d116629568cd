"""``megascale data build INPUT... --output PREFIX``: text files -> a token file.

Documents: with ``--split paragraph`` (the default) every maximal run of non-blank lines in an input
file is one document (a blank line is empty or whitespace only; the newlines inside a paragraph are
kept, the blank lines between paragraphs are dropped). With ``--split file`` each input file is one
document, byte for byte. Every document is tokenized with the byte tokenizer and followed by the
end-of-document id (``megascale.data.tokenizer.EOD``); empty documents are skipped. Input files are
read as bytes: any encoding passes through unchanged, but a NUL byte is an error (it is the EOD id).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

from megascale.data.token_file import TokenFileError, TokenFileStats, write_token_file
from megascale.data.tokenizer import EOD, ByteTokenizer

logger = logging.getLogger(__name__)

SPLITS = ("paragraph", "file")


def split_documents(data: bytes, split: str = "paragraph") -> list[bytes]:
    """The documents of one input file's bytes (see the module docstring); never empty ones."""
    if split == "file":
        return [data] if data else []
    if split != "paragraph":
        raise ValueError(f"split={split!r}; accepted: {', '.join(SPLITS)}")
    docs: list[bytes] = []
    para: list[bytes] = []
    for line in data.split(b"\n") + [b""]:  # the sentinel blank line ends the last paragraph
        if line.strip():
            para.append(line)
        elif para:
            docs.append(b"\n".join(para))
            para = []
    return docs


def build(
    input_paths: list[Path],
    output_prefix: Path,
    vocab_size: int = 256,
    *,
    split: str = "paragraph",
) -> TokenFileStats:
    """Tokenize ``input_paths`` into ``output_prefix.bin`` / ``.idx``; returns what was written.

    ``vocab_size`` is recorded in the header and must be >= 256 (the byte tokenizer's ids); it also
    picks the token dtype. Raises FileNotFoundError for a missing input and ValueError for a NUL
    byte in an input or a bad argument.
    """
    if vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size}: the byte tokenizer needs vocab_size >= "
            f"{ByteTokenizer.vocab_size}"
        )
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; accepted: {', '.join(SPLITS)}")
    paths = [Path(p) for p in input_paths]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {p}: no such file")
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    stats = write_token_file(output_prefix, _documents(paths, split), vocab_size)
    logger.info(
        "megascale::data::build wrote %s.{bin,idx}: %d documents, %d tokens (%s) from %d files",
        output_prefix,
        stats.num_documents,
        stats.num_tokens,
        stats.dtype,
        len(paths),
    )
    return stats


def _documents(paths: list[Path], split: str) -> Iterator[list[int]]:
    tok = ByteTokenizer()
    for p in paths:
        for doc in split_documents(p.read_bytes(), split):
            ids = tok.encode_bytes(doc, source=str(p))
            ids.append(EOD)
            yield ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale data build``."""
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text files")
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        type=Path,
        metavar="PREFIX",
        help="writes PREFIX.bin and PREFIX.idx",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="vocabulary size recorded in the header (>= 256; default 256)",
    )
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="paragraph",
        help="one document per blank-line-separated paragraph (default) or per file",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``megascale data build``; 0 on success, 1 with a logged error on bad input."""
    try:
        build(args.inputs, args.output, args.vocab_size, split=args.split)
    except (OSError, ValueError, TokenFileError) as e:
        logger.error("megascale data build: %s", e)
        return 1
    return 0
