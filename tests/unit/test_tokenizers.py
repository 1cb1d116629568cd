"""``megascale data build`` with megatron-core's tokenizers: a SentencePiece model and a tiktoken
vocabulary trained here with their own libraries' trainers, and a Hugging Face tokenizer.json. The
dataset's ids must be the library's own encoding of each document followed by the tokenizer's
end-of-document id; bad ``--tokenizer`` values are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm
import tiktoken
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2
from tokenizer_files import corpus_texts, train_sentencepiece, write_tiktoken_vocab
from tokenizers import Tokenizer

from megascale import cli
from megascale.data.indexed import DataError, DatasetInfo, tokenizer_copy_path
from megascale.data.tokenizer import TIKTOKEN_SPECIAL_TOKENS, load_tokenizer, train_bpe

DOCS = [
    "the red fox sees the dog. 3 + 4 = 7.",
    "Ünïcödé text, tabs\tand  double  spaces.",
    "a third paragraph\nwith two lines",
]


def _build(tmp_path: Path, spec: str, *extra: str) -> tuple[Path, list[list[int]]]:
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(DOCS) + "\n")
    prefix = tmp_path / "out"
    assert (
        cli.main(["data", "build", str(src), "--tokenizer", spec, "-o", str(prefix), *extra]) == 0
    )
    ds = IndexedDataset(str(prefix))
    return prefix, [ds[i].tolist() for i in range(len(ds))]


def test_sentencepiece_build_is_the_library_encoding(tmp_path):
    model = train_sentencepiece(tmp_path / "tokenizer.model")
    prefix, docs = _build(tmp_path, str(model))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert sp.id_to_piece(sp.eos_id()) == "</s>"
    assert docs == [sp.encode(d) + [sp.eos_id()] for d in DOCS]
    info = DatasetInfo.read(prefix)
    assert (info.tokenizer, info.vocab_size, info.eod) == ("sentencepiece", 400, sp.eos_id())
    assert tokenizer_copy_path(prefix, "sentencepiece").read_bytes() == model.read_bytes()
    tok = load_tokenizer(f"sentencepiece:{model}", eod_token="<unk>")
    assert tok.eod == sp.unk_id() and tok.decode(sp.encode(DOCS[0])) == sp.decode(
        sp.encode(DOCS[0])
    )


def test_tiktoken_build_is_the_library_encoding(tmp_path):
    vocab = tmp_path / "tiktoken.json"
    ranks = write_tiktoken_vocab(vocab)
    prefix, docs = _build(tmp_path, str(vocab))
    enc = tiktoken.Encoding(
        "t", pat_str=_PATTERN_TIKTOKEN_V2, mergeable_ranks=ranks, special_tokens={}
    )
    shift, eos = TIKTOKEN_SPECIAL_TOKENS, 2  # megatron-core: special ids first, "</s>" is 2
    assert docs == [[i + shift for i in enc.encode(d)] + [eos] for d in DOCS]
    assert any(i >= shift + 256 for d in docs for i in d)  # merges were used, not only bytes
    info = DatasetInfo.read(prefix)
    assert (info.tokenizer, info.vocab_size, info.eod) == ("tiktoken", shift + 300, eos)
    assert tokenizer_copy_path(prefix, "tiktoken").read_bytes() == vocab.read_bytes()
    assert load_tokenizer(vocab).decode(docs[0][:-1]) == DOCS[0]


def test_hf_tokenizer_json_build_is_the_library_encoding(tmp_path):
    path = train_bpe(corpus_texts(), 400, tmp_path / "bpe.json")  # not named tokenizer.json
    prefix, docs = _build(tmp_path, f"hf:{path}")
    lib = Tokenizer.from_file(str(path))
    eod = lib.token_to_id("<|endoftext|>")
    assert docs == [lib.encode(d, add_special_tokens=False).ids + [eod] for d in DOCS]
    assert DatasetInfo.read(prefix).tokenizer == "hf"
    assert tokenizer_copy_path(prefix, "hf").read_bytes() == path.read_bytes()


def _one_line_error(capsys, tmp_path: Path, spec: str, *extra: str) -> str:
    src = tmp_path / "in.txt"
    src.write_text("some text\n")
    rc = cli.main(
        ["data", "build", str(src), "--tokenizer", spec, "-o", str(tmp_path / "o"), *extra]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0, err
    return err


def test_bad_tokenizer_specs_are_one_line_errors(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, tmp_path, str(tmp_path / "empty"))
    assert "a directory without tokenizer.json; accepted: 'byte'" in err
    err = _one_line_error(capsys, tmp_path, str(tmp_path / "nope.model"))
    assert f"--tokenizer {tmp_path / 'nope.model'}: no such file; accepted:" in err
    llama3 = tmp_path / "tokenizer.model"
    llama3.write_text("IQ== 0\nIg== 1\n")  # tiktoken's own file format (Llama 3's original)
    err = _one_line_error(capsys, tmp_path, str(llama3))
    assert "a tiktoken file of base64 lines" in err and "tokenizer.json" in err
    short = tmp_path / "short.json"
    short.write_text('[{"rank": 0, "token_bytes": "AA==", "token_str": ""}]')
    err = _one_line_error(capsys, tmp_path, str(short))
    assert f"--tokenizer {short}: not a list of at least 256 entries; accepted:" in err
    bad_first = json.loads(short.read_text()) * 300  # rank 0 again and again
    short.write_text(json.dumps(bad_first))
    err = _one_line_error(capsys, tmp_path, str(short))
    assert "not a tiktoken vocabulary in megatron-core's format, a JSON list of {rank" in err
    err = _one_line_error(capsys, tmp_path, f"sentencepiece:{tmp_path / 'empty'}")
    assert "a directory (sentencepiece: takes a file); accepted:" in err
    err = _one_line_error(capsys, tmp_path, f"sentencepiece:{short}")
    assert f"--tokenizer sentencepiece:{short}: not a SentencePiece model (" in err
    other = tmp_path / "vocab.txt"
    other.write_text("hello\n")
    err = _one_line_error(capsys, tmp_path, str(other))
    assert "unknown kind of file; accepted:" in err


def test_sentencepiece_without_eos_and_unknown_eod_token(capsys, tmp_path):
    model = train_sentencepiece(tmp_path / "noeos.model", eos_id=-1)
    err = _one_line_error(capsys, tmp_path, str(model))
    assert "no end-of-document token" in err and "--eod-token" in err
    err = _one_line_error(capsys, tmp_path, str(model), "--eod-token", "<nope>")
    assert f"--eod-token '<nope>': not in the vocabulary of {model}" in err
    with pytest.raises(DataError, match="--eod-token '<nope>': not in the vocabulary"):
        load_tokenizer(write_tiktoken_vocab(tmp_path / "t.json") and tmp_path / "t.json", "<nope>")


def test_hf_directory_eos_from_its_config_and_batch_encoding_equals_megatron_core(tmp_path):
    """A transformers tokenizer directory: the EOD is its configured eos token (not the first
    candidate), and ``encode_batch`` (used by data build) gives megatron-core's ``tokenize`` ids."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    lib = Tokenizer.from_file(str(train_bpe(corpus_texts(), 400, tmp_path / "bpe.json")))
    lib.add_special_tokens(["</s>"])
    saved = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=lib, eos_token="</s>").save_pretrained(saved)
    tok = load_tokenizer(saved)
    assert tok.eod == lib.token_to_id("</s>") != lib.token_to_id("<|endoftext|>")
    texts = [*DOCS, "two documents<|endoftext|>in one line", "", "</s> at the start"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    auto = AutoTokenizer.from_pretrained(saved)
    assert tok.encode_batch(texts) == [auto.encode(t, add_special_tokens=False) for t in texts]
    prefix, docs = _build(tmp_path, str(saved))
    assert docs == [auto.encode(d, add_special_tokens=False) + [tok.eod] for d in DOCS]
