"""Byte-level tokenizer: token id = byte value, byte 0x00 marks the end of a document.

Design note: the tiny presets use ``vocab_size = 256``, so the tokenizer must fit in 256 ids. Every
byte value 0..255 is its own token and byte 0x00 (NUL), which does not occur in text, is reserved as
the end-of-document token (``EOD``). Text that contains a NUL byte is refused rather than silently
changed. No merges, no normalisation, no downloads: ``decode(encode(s)) == s`` for every string
without NUL. A model may use a larger ``vocab_size`` with the same token files; ids >= 256 are then
simply never produced.
"""

from __future__ import annotations

from collections.abc import Iterable

VOCAB_SIZE = 256
"""Ids the tokenizer produces: 0..255."""
EOD = 0
"""End-of-document token id (the NUL byte)."""


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; ``EOD`` (0) separates documents."""

    vocab_size = VOCAB_SIZE
    eod = EOD

    def encode_bytes(self, data: bytes, *, source: str = "<text>") -> list[int]:
        """Token ids of raw bytes; raises ValueError naming ``source`` if a NUL byte occurs."""
        pos = data.find(b"\x00")
        if pos >= 0:
            raise ValueError(
                f"{source}: byte 0x00 at offset {pos}; the byte tokenizer reserves 0x00 as the "
                "end-of-document token, so input text must not contain NUL bytes"
            )
        return list(data)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes), without a trailing ``EOD``."""
        return self.encode_bytes(text.encode("utf-8"))

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
                raise ValueError(f"token id {i} is not a byte-tokenizer id (accepted: 0..255)")
        return out.decode("utf-8", errors="replace")
