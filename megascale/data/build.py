"""``megascale data build INPUT... --output PREFIX``: text or JSONL -> a Megatron indexed dataset.

Inputs: a file ending in ``.jsonl`` or ``.json`` is JSON Lines, one document per line, its text
under ``--json-key`` (default ``text``); blank lines are skipped. Any other file is text: with
``--split paragraph`` (the default) every maximal run of non-blank lines is one document (the
newlines inside a paragraph are kept, blank lines between paragraphs dropped); with ``--split file``
the whole file is one document. Text is UTF-8.

Every document is tokenized (``--tokenizer``: ``byte``, the default, or a Hugging Face
``tokenizer.json``, a SentencePiece model or a tiktoken vocabulary through megatron-core's
tokenizers: ``megascale.data.tokenizer``) and followed by the tokenizer's end-of-document id
(``--eod-token`` picks another); empty documents are skipped. The output is written with
megatron-core's builder (``megascale.data.indexed.write_indexed``), plus ``PREFIX.json``
(tokenizer, vocab size, EOD id, counts, largest id) and, for a tokenizer read from a file, a copy of
that file (``megascale.data.indexed.tokenizer_copy_path``). A progress line (documents, tokens/s) is
logged every few seconds, never per document.

``megascale data convert OLD_PREFIX --output NEW_PREFIX`` rewrites a token file in megascale's
former ``MSTOKEN`` format as a Megatron indexed dataset (same documents, same ids).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from megascale.data.indexed import (
    DataError,
    DatasetInfo,
    EmptyDatasetError,
    tokenizer_copy_path,
    write_indexed,
)
from megascale.data.tokenizer import ByteTokenizer, MegatronTextTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

SPLITS = ("paragraph", "file")
JSONL_SUFFIXES = (".jsonl", ".json")
PROGRESS_INTERVAL_S = 5.0
_BATCH = 512  # documents encoded per call of a megatron-core tokenizer


def split_documents(text: str, split: str = "paragraph") -> list[str]:
    """The documents of one text file (see the module docstring); never empty ones."""
    if split == "file":
        return [text] if text else []
    if split != "paragraph":
        raise DataError(f"--split {split!r}; accepted: {', '.join(SPLITS)}")
    docs: list[str] = []
    para: list[str] = []
    for line in text.split("\n") + [""]:  # the sentinel blank line ends the last paragraph
        if line.strip():
            para.append(line)
        elif para:
            docs.append("\n".join(para))
            para = []
    return docs


def build(
    input_paths: list[Path],
    output_prefix: Path,
    tokenizer: str | Path = "byte",
    *,
    split: str = "paragraph",
    json_key: str = "text",
    eod_token: str | None = None,
) -> DatasetInfo:
    """Tokenize ``input_paths`` into ``output_prefix.{bin,idx,json}``; returns the sidecar.

    Raises DataError (one line, naming the file or option) for a missing or unreadable input, a
    JSONL line without ``json_key``, a tokenizer that does not load, no end-of-document token, or
    inputs without a single document (nothing is written then).
    """
    if split not in SPLITS:
        raise DataError(f"--split {split!r}; accepted: {', '.join(SPLITS)}")
    paths = [Path(p) for p in input_paths]
    for p in paths:
        if not p.is_file():
            raise DataError(f"input {p}: no such file")
    tok = load_tokenizer(tokenizer, eod_token)
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    progress = _Progress()
    documents = progress.count(_token_documents(tok, paths, split, json_key))
    try:
        stats = write_indexed(output_prefix, documents, tok.vocab_size)
    except EmptyDatasetError:
        raise DataError(
            f"inputs {', '.join(map(str, paths))}: no documents (empty or blank"
            + (f", or no {json_key!r} text in the JSONL lines)" if _any_jsonl(paths) else ")")
        ) from None
    if tok.path is not None:
        shutil.copyfile(tok.path, tokenizer_copy_path(output_prefix, tok.name))
    info = DatasetInfo(
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eod=tok.eod,
        documents=stats.documents,
        tokens=stats.tokens,
        max_token=stats.max_token,
    )
    info.write(output_prefix)
    rate = stats.tokens / max(progress.elapsed(), 1e-9)
    logger.info(
        "megascale::data::build wrote %s.{bin,idx,json}: %d documents, %d tokens (%s, %s "
        "tokenizer, vocab %d), %.0f tokens/s",
        output_prefix,
        stats.documents,
        stats.tokens,
        stats.dtype,
        tok.name,
        tok.vocab_size,
        rate,
    )
    return info


def _any_jsonl(paths: list[Path]) -> bool:
    return any(p.suffix in JSONL_SUFFIXES for p in paths)


def _texts(paths: list[Path], split: str, json_key: str) -> Iterator[tuple[str, str]]:
    """(source, document text) for every document of every input, in order."""
    for p in paths:
        if p.suffix in JSONL_SUFFIXES:
            yield from _jsonl_texts(p, json_key)
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"input {p}: not UTF-8 text ({e})") from e
        for doc in split_documents(text, split):
            yield str(p), doc


def _jsonl_texts(path: Path, json_key: str) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"input {path} line {n}: not JSON ({e})") from e
            text = record.get(json_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"input {path} line {n}: no string under --json-key {json_key!r} "
                    f"(keys: {', '.join(record) if isinstance(record, dict) else 'none'})"
                )
            if text:
                yield f"{path}:{n}", text


def _token_documents(
    tok: ByteTokenizer | MegatronTextTokenizer, paths: list[Path], split: str, json_key: str
) -> Iterator[np.ndarray]:
    """Token ids of every document, each followed by the tokenizer's EOD id; a document that
    encodes to no ids is skipped. megatron-core's tokenizers get ``_BATCH`` documents a call."""
    batch: list[str] = []
    for source, text in _texts(paths, split, json_key):
        if isinstance(tok, ByteTokenizer):
            yield np.array(tok.encode(text, source=source) + [tok.eod], dtype=np.int64)
            continue
        batch.append(text)
        if len(batch) == _BATCH:
            yield from _encode_batch(tok, batch)
            batch = []
    if batch:
        yield from _encode_batch(tok, batch)


def _encode_batch(tok: MegatronTextTokenizer, texts: list[str]) -> Iterator[np.ndarray]:
    for ids in tok.encode_batch(texts):
        if ids:
            yield np.array(list(ids) + [tok.eod], dtype=np.int64)


class _Progress:
    """Counts documents and tokens passing through; logs one line every PROGRESS_INTERVAL_S."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.documents = self.tokens = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def count(self, documents: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        for doc in documents:
            self.documents += 1
            self.tokens += doc.size
            now = time.monotonic()
            if now - self.last >= PROGRESS_INTERVAL_S:
                self.last = now
                logger.info(
                    "megascale::data::build %d documents, %d tokens, %.0f tokens/s",
                    self.documents,
                    self.tokens,
                    self.tokens / (now - self.start),
                )
            yield doc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale data build``."""
    parser.add_argument(
        "inputs", nargs="+", type=Path, metavar="INPUT", help="text files, or .jsonl/.json files"
    )
    parser.add_argument(
        "--output", "-o", required=True, type=Path, metavar="PREFIX",
        help="writes PREFIX.bin, PREFIX.idx (Megatron's format) and PREFIX.json",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", default="byte", metavar="T",
        help="'byte' (default), a Hugging Face tokenizer.json or a directory holding one, a "
        "SentencePiece *.model, a tiktoken *.json (megatron-core's format), or LIBRARY:PATH "
        "(LIBRARY: hf, sentencepiece, tiktoken)",
    )  # fmt: skip
    parser.add_argument(
        "--json-key", default="text", help="key of the document text in JSONL lines (default text)"
    )
    parser.add_argument(
        "--eod-token", default=None, metavar="TOKEN",
        help="end-of-document token of a tokenizer read from a file (default: its eos token, "
        "else <|endoftext|>, </s>, ... when present)",
    )  # fmt: skip
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="paragraph",
        help="text files: one document per blank-line-separated paragraph (default) or per file",
    )


def run(args: argparse.Namespace) -> None:
    """Run ``megascale data build``; raises DataError or OSError (the CLI prints one line)."""
    build(
        args.inputs,
        args.output,
        args.tokenizer,
        split=args.split,
        json_key=args.json_key,
        eod_token=args.eod_token,
    )
