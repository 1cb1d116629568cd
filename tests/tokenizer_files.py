"""Tokenizer files made in a test by each library's own trainer, on the built-in corpus (nothing is
downloaded): a SentencePiece model and a tiktoken vocabulary in megatron-core's JSON format.
Importable as ``tokenizer_files`` (pytest puts ``tests/``, the conftest's folder, on sys.path)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import sentencepiece as spm
from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2
from tiktoken._educational import bpe_train

from megascale.data.corpus import generate_corpus


def corpus_texts() -> list[str]:
    """The first 400 paragraphs of the built-in corpus: enough for vocabularies of a few hundred."""
    return generate_corpus().split("\n\n")[:400]


def train_sentencepiece(path: Path, vocab: int = 400, **options) -> Path:
    """A BPE SentencePiece model trained on the built-in corpus (Llama 2's kind of model)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts()),
        model_writer=model,
        vocab_size=vocab,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        **options,
    )
    path.write_bytes(model.getvalue())
    return path


def write_tiktoken_vocab(path: Path, vocab: int = 300) -> dict[bytes, int]:
    """Ranks trained by tiktoken's own BPE trainer, written in megatron-core's JSON format."""
    text = "\n\n".join(corpus_texts()[:60])
    ranks = bpe_train(text, vocab, _PATTERN_TIKTOKEN_V2, visualise=None)
    entries = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode(),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    path.write_text(json.dumps(entries))
    return ranks
