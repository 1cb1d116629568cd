"""Tokenizers for ``megascale data build``: the byte tokenizer (default) and megatron-core's.

``--tokenizer`` (``load_tokenizer(spec)``) accepts:

- ``byte``: token id = byte value; byte 0x00 (NUL), which does not occur in text, is the
  end-of-document token (``EOD``); text containing a NUL byte is refused rather than silently
  changed. ``decode(encode(s)) == s`` for every string without NUL. It fits the tiny presets'
  vocab_size 256. It is megascale's own: megatron-core's ``byte-level`` library gives the same
  ids (EOS 0) but encodes a NUL byte in the text as that EOS id, silently splitting a document.
- a Hugging Face ``tokenizer.json``, or a directory holding one (with its
  ``tokenizer_config.json``, if any): megatron-core's ``huggingface`` library (transformers'
  ``AutoTokenizer``, fast tokenizer). Llama 3 and most models published on the Hub.
- a SentencePiece model (a ``*.model`` file): megatron-core's ``sentencepiece`` library
  (Llama 2's ``tokenizer.model``).
- a tiktoken vocabulary in megatron-core's format (a ``*.json`` file holding a list of
  ``{"rank", "token_bytes" (base64), "token_str"}``, the first 256 the single bytes, as NeMo and
  Mistral's Tekken write it): megatron-core's ``tiktoken`` library. Its ids are megatron-core's
  layout: ``TIKTOKEN_SPECIAL_TOKENS`` (1000) special ids first (``<unk>`` 0, ``<s>`` 1,
  ``</s>`` 2, ...), the ranks above them, split with its "v2" pattern. Llama 3's original
  ``tokenizer.model`` (base64 lines) is not that format and its ids put the special tokens last:
  build Llama 3 data with its Hugging Face ``tokenizer.json``, which gives Llama 3's own ids.
- ``LIBRARY:PATH`` with LIBRARY one of ``hf``, ``sentencepiece``, ``tiktoken`` names the library
  instead of going by the file name.

All but ``byte`` are built with ``megatron.core.tokenizers.MegatronTokenizer.from_pretrained``;
nothing is downloaded. The end-of-document id is ``eod_token`` when given, else the tokenizer's
own (its ``eos_token`` in ``tokenizer_config.json``, SentencePiece's ``</s>``, tiktoken's
``</s>``), else, for a bare ``tokenizer.json``, the first of ``EOD_CANDIDATES`` in its
vocabulary; a tokenizer with none is refused, since documents must be separated. ``vocab_size``
counts added tokens. Every error is one line naming ``--tokenizer``/``--eod-token``, the value and
what is accepted.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from megascale.data.indexed import DataError

VOCAB_SIZE = 256
"""Ids the byte tokenizer produces: 0..255."""
EOD = 0
"""The byte tokenizer's end-of-document id (the NUL byte)."""
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
"""End-of-document tokens looked up, in this order, when neither ``--eod-token`` is given nor
the tokenizer names an end-of-sequence token."""
LIBRARIES = {"hf": "huggingface", "sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}
"""``LIBRARY:`` prefixes of ``--tokenizer`` (as recorded in ``PREFIX.json``) -> megatron-core's
library name."""
PACKAGES = {"huggingface": "transformers", "sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}
"""The Python package each library needs (all in megascale's ``hf`` extra)."""
TIKTOKEN_SPECIAL_TOKENS = 1000
"""Special ids ahead of a tiktoken vocabulary's ranks: megatron-core's default."""
ACCEPTED = (
    "'byte', a Hugging Face tokenizer.json or a directory holding one, a SentencePiece *.model, "
    "a tiktoken *.json in megatron-core's format, or LIBRARY:PATH with LIBRARY one of "
    + ", ".join(LIBRARIES)
)
_TIKTOKEN_BASE64_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?\n")


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; ``EOD`` (0) separates documents."""

    name = "byte"
    vocab_size = VOCAB_SIZE
    eod = EOD
    path: Path | None = None

    def encode_bytes(self, data: bytes, *, source: str = "<text>") -> list[int]:
        """Token ids of raw bytes; raises DataError naming ``source`` if a NUL byte occurs."""
        pos = data.find(b"\x00")
        if pos >= 0:
            raise DataError(
                f"{source}: byte 0x00 at offset {pos}; the byte tokenizer reserves 0x00 as the "
                "end-of-document token, so input text must not contain NUL bytes"
            )
        return list(data)

    def encode(self, text: str, *, source: str = "<text>") -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes), without a trailing ``EOD``."""
        return self.encode_bytes(text.encode("utf-8"), source=source)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; ``EOD`` becomes a blank line, invalid UTF-8 becomes U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i == EOD:
                out += b"\n\n"
            elif 0 < i < 256:
                out.append(i)
            else:
                raise DataError(f"token id {i} is not a byte-tokenizer id (accepted: 0..255)")
        return out.decode("utf-8", errors="replace")


class MegatronTextTokenizer:
    """A megatron-core text tokenizer (``MegatronTokenizer.from_pretrained``) and its EOD id.

    ``name`` is the ``LIBRARIES`` key recorded in ``PREFIX.json``; ``path`` the file that
    ``megascale data build`` copies next to the dataset; ``mcore`` megatron-core's object.
    Raises DataError (one line) for a file the library cannot read, a missing package, and no
    end-of-document token.
    """

    def __init__(self, name: str, path: Path, spec: str, eod_token: str | None = None) -> None:
        self.name, self.path, self._spec = name, path, spec
        library = LIBRARIES[name]
        if importlib.util.find_spec(PACKAGES[library]) is None:
            raise DataError(
                f"--tokenizer {spec}: the {library} tokenizer needs the {PACKAGES[library]} "
                "package (pip install 'megascale[hf]')"
            )
        self.mcore = _from_pretrained(library, path, spec)
        self.vocab_size = int(self.mcore.vocab_size)
        self.eod = self._eod_id(eod_token)

    def _token_id(self, token: str) -> int | None:
        """The id of ``token`` as one vocabulary entry, or None."""
        lib = self.mcore._tokenizer  # megatron-core's library object (0.16 to 0.19: same name)
        if self.name == "hf":
            return lib.tokenizer.get_vocab().get(token)
        if self.name == "sentencepiece":
            token_id = lib.tokenizer.piece_to_id(token)
            return token_id if lib.tokenizer.id_to_piece(token_id) == token else None
        try:
            return lib.token_to_id(token)
        except KeyError:  # tiktoken: not a special token and not one rank
            return None

    def _eod_id(self, eod_token: str | None) -> int:
        if eod_token is not None:
            token_id = self._token_id(eod_token)
            if token_id is None:
                raise DataError(f"--eod-token {eod_token!r}: not in the vocabulary of {self.path}")
            return token_id
        own = self.mcore.eod
        if own is not None and own >= 0:
            return int(own)
        for name in EOD_CANDIDATES:
            token_id = self._token_id(name)
            if token_id is not None:
                return token_id
        raise DataError(
            f"--tokenizer {self._spec}: no end-of-document token (no eos token, none of "
            f"{', '.join(EOD_CANDIDATES)}); name one with --eod-token"
        )

    def encode(self, text: str, *, source: str = "<text>") -> list[int]:
        """Token ids of ``text`` by megatron-core's ``tokenize``: no BOS/EOS added."""
        return list(self.mcore.tokenize(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of many texts, the same ids (tests/unit/test_tokenizers.py checks it).
        Hugging Face: one ``encode_batch`` of the Rust tokenizer behind the ``AutoTokenizer``
        megatron-core loaded, parallel over the texts; megatron-core's per-text ``tokenize``
        made ``data build`` 1.5x slower (``benchmarks/data.py``). The others: ``encode`` each."""
        if self.name != "hf":
            return [self.encode(t) for t in texts]
        rust = self.mcore._tokenizer.tokenizer.backend_tokenizer
        return [e.ids for e in rust.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.mcore.detokenize([int(i) for i in ids])


def _from_pretrained(library: str, path: Path, spec: str):
    """megatron-core's tokenizer of ``library`` for ``path``; DataError (one line) if it fails."""
    from megatron.core.tokenizers import MegatronTokenizer

    kwargs: dict = {}
    if library == "tiktoken":
        kwargs["vocab_size"] = TIKTOKEN_SPECIAL_TOKENS + _tiktoken_ranks(path, spec)
        kwargs["num_special_tokens"] = TIKTOKEN_SPECIAL_TOKENS
    if library == "huggingface":
        # Explicit: the defaults changed between megatron-core 0.16 and 0.19 (use_fast False ->
        # True, include_special_tokens False -> True); data wants no BOS/EOS template.
        kwargs.update(use_fast=True, include_special_tokens=False)
    try:
        if library == "huggingface" and path.name != "tokenizer.json":
            # AutoTokenizer reads a directory: a file of another name is given one of its own.
            with tempfile.TemporaryDirectory() as tmp:
                shutil.copyfile(path, Path(tmp) / "tokenizer.json")
                return MegatronTokenizer.from_pretrained(tmp, {"library": library}, **kwargs)
        source = path.parent if library == "huggingface" else path
        return MegatronTokenizer.from_pretrained(str(source), {"library": library}, **kwargs)
    except Exception as e:  # the libraries raise bare Exception/RuntimeError/AssertionError
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise DataError(f"--tokenizer {spec}: not a {_KINDS[library]} ({first[:200]})") from e


_KINDS = {
    "huggingface": "Hugging Face tokenizer.json",
    "sentencepiece": "SentencePiece model",
    "tiktoken": "tiktoken vocabulary in megatron-core's format, a JSON list of {rank, "
    "token_bytes (base64), token_str} with ranks 0..n-1, the first 256 the single bytes",
}


def _tiktoken_ranks(path: Path, spec: str) -> int:
    """Entries of a tiktoken vocabulary JSON; DataError unless it is megatron-core's format."""
    accepted = (
        "accepted: a JSON list of {rank, token_bytes (base64), token_str}, ranks 0..n-1, the "
        "first 256 the single bytes"
    )
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"--tokenizer {spec}: not JSON ({e}); {accepted}") from e
    if not isinstance(vocab, list) or len(vocab) < 256:
        raise DataError(f"--tokenizer {spec}: not a list of at least 256 entries; {accepted}")
    return len(vocab)


def _resolve(spec: str) -> tuple[str, Path]:
    """(``LIBRARIES`` key, path) of a ``--tokenizer`` value other than ``byte``."""
    head, sep, rest = spec.partition(":")
    if sep and head in LIBRARIES:
        name, path = head, Path(rest)
    else:
        name, path = "", Path(spec)
    if path.is_dir():
        if name in ("", "hf") and (path / "tokenizer.json").is_file():
            return "hf", path / "tokenizer.json"
        what = "without tokenizer.json" if name in ("", "hf") else f"({name}: takes a file)"
        raise DataError(f"--tokenizer {spec}: a directory {what}; accepted: {ACCEPTED}")
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no such file; accepted: {ACCEPTED}")
    return (name or _library_of(path, spec)), path


def _library_of(path: Path, spec: str) -> str:
    """The library a file is for, by its name and first bytes."""
    with open(path, "rb") as f:
        head = f.read(256)
    if path.suffix == ".model":
        if _TIKTOKEN_BASE64_LINE.match(head):
            raise DataError(
                f"--tokenizer {spec}: a tiktoken file of base64 lines (Llama 3's tokenizer.model); "
                "megatron-core's tiktoken reads a JSON vocabulary, and Llama 3's ids need its "
                "Hugging Face tokenizer.json: pass that instead"
            )
        return "sentencepiece"
    if head.lstrip().startswith(b"["):
        return "tiktoken"
    if path.suffix == ".json" or head.lstrip().startswith(b"{"):
        return "hf"
    raise DataError(f"--tokenizer {spec}: unknown kind of file; accepted: {ACCEPTED}")


def load_tokenizer(
    spec: str | Path, eod_token: str | None = None
) -> ByteTokenizer | MegatronTextTokenizer:
    """``"byte"`` -> ByteTokenizer (``eod_token`` must then be None); anything else (see the
    module docstring) -> MegatronTextTokenizer."""
    spec = str(spec)
    if spec == "byte":
        if eod_token is not None:
            raise DataError(
                f"--eod-token {eod_token!r}: the byte tokenizer's end-of-document id is fixed "
                "(0x00); --eod-token needs --tokenizer PATH"
            )
        return ByteTokenizer()
    name, path = _resolve(spec)
    return MegatronTextTokenizer(name, path, spec, eod_token)


def train_bpe(
    texts: Iterable[str], vocab_size: int, path: str | Path, eod_token: str | None = "<|endoftext|>"
) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2 style) on ``texts`` and save it as ``path``.

    For a tokenizer without a download, e.g. on the built-in corpus (``corpus.generate_corpus``);
    ``eod_token`` (None: no special token) becomes a special token of the vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eod_token] if eod_token else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return Path(path)
