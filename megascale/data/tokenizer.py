"""Tokenizers for ``megascale data build``: the byte tokenizer (default) and Hugging Face ones.

Byte tokenizer: token id = byte value and byte 0x00 (NUL), which does not occur in text, is the
end-of-document token (``EOD``); text containing a NUL byte is refused rather than silently changed.
``decode(encode(s)) == s`` for every string without NUL. It fits the tiny presets' vocab_size 256.

Hugging Face tokenizer: a ``tokenizer.json`` file (or a directory holding one) loaded with the
``tokenizers`` library; nothing is downloaded. Its end-of-document id is ``eod_token`` when given,
else the first of ``EOD_CANDIDATES`` in its vocabulary; a tokenizer with none is refused, since
documents must be separated. ``vocab_size`` counts added tokens.

``load_tokenizer(spec)`` returns either, with the same ``name``/``vocab_size``/``eod``/``encode``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from megascale.data.indexed import DataError

VOCAB_SIZE = 256
"""Ids the byte tokenizer produces: 0..255."""
EOD = 0
"""The byte tokenizer's end-of-document id (the NUL byte)."""
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
"""End-of-document tokens looked up, in this order, when ``--eod-token`` is not given."""


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; ``EOD`` (0) separates documents."""

    name = "byte"
    vocab_size = VOCAB_SIZE
    eod = EOD
    json_path: Path | None = None

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


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` read from ``tokenizer.json``.

    Raises DataError naming the file when it is missing or does not parse, and when no
    end-of-document token is found (naming ``eod_token`` or the candidates looked for).
    """

    name = "hf"

    def __init__(self, path: str | Path, eod_token: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"--tokenizer {path}: no such file; expected a Hugging Face tokenizer.json or a "
                "directory holding one, or 'byte'"
            )
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a file that is not JSON
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"--tokenizer {path}: not a Hugging Face tokenizer.json ({first})"
            ) from e
        self.json_path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._eod_id(eod_token)

    def _eod_id(self, eod_token: str | None) -> int:
        names = (eod_token,) if eod_token is not None else EOD_CANDIDATES
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        if eod_token is not None:
            raise DataError(f"--eod-token {eod_token!r}: not in the vocabulary of {self.json_path}")
        raise DataError(
            f"--tokenizer {self.json_path}: no end-of-document token (looked for "
            f"{', '.join(EOD_CANDIDATES)}); name one with --eod-token"
        )

    def encode(self, text: str, *, source: str = "<text>") -> list[int]:
        """Token ids of ``text`` without special tokens added (no BOS/EOS templates)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of many texts at once (the library parallelises over them)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str | Path, eod_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` -> ByteTokenizer (``eod_token`` must then be None); anything else is a path to a
    ``tokenizer.json`` or a directory holding one -> HFTokenizer."""
    if str(spec) == "byte":
        if eod_token is not None:
            raise DataError(
                f"--eod-token {eod_token!r}: the byte tokenizer's end-of-document id is fixed "
                "(0x00); --eod-token needs --tokenizer PATH"
            )
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token)


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
