"""megascale.data: Megatron's indexed format both ways, tokenizers, the build and convert tools, the
built-in corpus, and the one-line errors for bad data before any rank trains."""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tokenizers import Tokenizer

from megascale import cli
from megascale.data.build import build, split_documents
from megascale.data.corpus import (
    CORPUS_VERSION,
    corpus_sha256,
    default_token_file,
    generate_corpus,
)
from megascale.data.indexed import (
    LEGACY_MAGIC,
    DataError,
    DatasetInfo,
    bin_path,
    check_prefix,
    idx_path,
    open_indexed,
    write_indexed,
)
from megascale.data.tokenizer import EOD, ByteTokenizer, MegatronTextTokenizer, load_tokenizer
from megascale.data.tokenizer import train_bpe as train_bpe_tokenizer

BPE_VOCAB = 400


def train_bpe(path: Path, special: str | None = "<|endoftext|>", vocab: int = BPE_VOCAB) -> Path:
    """A tiny byte-level BPE tokenizer trained on the built-in corpus, saved as ``path``."""
    return train_bpe_tokenizer(generate_corpus().split("\n\n"), vocab, path, special)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _tokens(prefix) -> list[list[int]]:
    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


# ---------------------------------------------------------------------------------------------
# format: ours read by megatron-core, megatron-core's read by us


@pytest.mark.parametrize(("vocab_size", "dtype"), [(256, np.uint16), (100_000, np.int32)])
def test_write_indexed_is_read_by_megatron_core(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, size=int(n)).tolist() for n in rng.integers(1, 40, 25)]
    stats = write_indexed(tmp_path / "p", docs, vocab_size)
    assert (stats.documents, stats.tokens) == (25, sum(map(len, docs)))
    ds = IndexedDataset(str(tmp_path / "p"))
    assert ds.index.dtype == dtype
    assert _tokens(tmp_path / "p") == docs
    assert idx_path(tmp_path / "p").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_megatron_core_builder_output_is_read_by_megascale(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 256, size=int(n)) for n in rng.integers(1, 30, 12)]
    builder = IndexedDatasetBuilder(str(bin_path(tmp_path / "m")), dtype=np.int32)
    for d in docs:
        builder.add_document(d, [d.size])
    builder.finalize(str(idx_path(tmp_path / "m")))
    check_prefix(tmp_path / "m")  # no complaint
    ds = open_indexed(tmp_path / "m")
    assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in docs]


def test_write_refuses_out_of_vocab_ids_and_empty(tmp_path):
    with pytest.raises(DataError, match=r"document 1: token id 300; accepted 0\.\.255"):
        write_indexed(tmp_path / "p", [[1, 2], [300]], 256)
    with pytest.raises(DataError, match="no documents"):
        write_indexed(tmp_path / "p", [], 256)
    assert list(tmp_path.iterdir()) == []


def test_old_mstoken_file_points_at_convert_and_converts(tmp_path):
    old = tmp_path / "old"
    docs = [[5, 6, EOD], [7, EOD], [8, 9, 10, EOD]]
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype("<i8")
    header = struct.pack("<8sIIQQ", LEGACY_MAGIC, 1, 1, 256, len(docs))
    idx_path(old).write_bytes(header + offsets.tobytes())
    bin_path(old).write_bytes(np.array(sum(docs, []), "<u2").tobytes())
    with pytest.raises(DataError) as e:
        check_prefix(old)
    msg = str(e.value)
    assert "MSTOKEN" in msg and f"megascale data convert {old} --output NEW_PREFIX" in msg
    assert "\n" not in msg
    assert cli.main(["data", "convert", str(old), "--output", str(tmp_path / "new")]) == 0
    assert _tokens(tmp_path / "new") == docs
    assert DatasetInfo.read(tmp_path / "new").tokenizer == "byte"
    assert idx_path(old).read_bytes()[:8] == LEGACY_MAGIC  # the old files stay


# ---------------------------------------------------------------------------------------------
# tokenizers and the build tool


def test_byte_tokenizer_round_trip_and_nul():
    tok = ByteTokenizer()
    text = "héllo, wörld 1 + 2 = 3"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("AB") == [65, 66]
    with pytest.raises(DataError, match="offset 1.*0x00"):
        tok.encode("a\x00b")


def test_split_documents():
    text = "  \nfirst line\nsecond\n\n \t\r\nthird\r\n\n\n"
    assert split_documents(text) == ["first line\nsecond", "third\r"]
    assert split_documents(text, "file") == [text]
    assert split_documents("\n\n") == []


def test_build_byte_text(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("hello world\nsecond line\n\nnext paragraph\n")
    b.write_text("other file\n")
    info = build([a, b], tmp_path / "out" / "corpus")
    docs = _tokens(tmp_path / "out" / "corpus")
    assert [ByteTokenizer().decode(d[:-1]) for d in docs] == [
        "hello world\nsecond line",
        "next paragraph",
        "other file",
    ]
    assert all(d[-1] == EOD for d in docs)
    assert (info.tokenizer, info.vocab_size, info.eod, info.documents) == ("byte", 256, EOD, 3)
    assert info.tokens == sum(map(len, docs)) and info.max_token == max(map(max, docs))


def test_hf_tokenizer_eod(tmp_path, bpe):
    tok = load_tokenizer(bpe)
    assert isinstance(tok, MegatronTextTokenizer) and tok.name == "hf"
    lib = Tokenizer.from_file(str(bpe))
    assert tok.vocab_size == BPE_VOCAB and tok.eod == lib.token_to_id("<|endoftext|>")
    text = "the cat sees the dog. 3 + 4 = 7."
    assert tok.decode(tok.encode(text)) == text
    assert load_tokenizer(bpe.parent).path == bpe  # a directory holding tokenizer.json
    no_eod = train_bpe(tmp_path / "t.json", special=None, vocab=300)
    with pytest.raises(DataError, match=r"no end-of-document token .*--eod-token"):
        load_tokenizer(no_eod)
    with_eod = load_tokenizer(no_eod, eod_token="the")
    assert with_eod.eod == Tokenizer.from_file(str(no_eod)).token_to_id("the")
    with pytest.raises(DataError, match="--eod-token 'nope': not in the vocabulary"):
        load_tokenizer(bpe, "nope")


def test_build_jsonl_with_hf_tokenizer(tmp_path, bpe, caplog):
    src = tmp_path / "in.jsonl"
    records = [{"body": "the red fox sees the dog.", "id": 1}, {"body": "1 + 2 = 3."}, {"body": ""}]
    src.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    caplog.set_level("INFO")
    info = build([src], tmp_path / "j", bpe, json_key="body")
    tok = load_tokenizer(bpe)
    assert _tokens(tmp_path / "j") == [
        tok.encode(records[0]["body"]) + [tok.eod],
        tok.encode(records[1]["body"]) + [tok.eod],
    ]
    assert (info.tokenizer, info.vocab_size, info.documents) == ("hf", BPE_VOCAB, 2)
    assert Path(f"{tmp_path / 'j'}.tokenizer.json").read_bytes() == bpe.read_bytes()
    assert "tokens/s" in caplog.text
    with pytest.raises(DataError, match=r"in\.jsonl line 1: no string under --json-key 'text'"):
        build([src], tmp_path / "k", bpe)


def test_build_refuses_missing_input_and_nul_bytes(tmp_path):
    with pytest.raises(DataError, match=r"input .*missing\.txt: no such file"):
        build([tmp_path / "missing.txt"], tmp_path / "o")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"ab\x00c")
    with pytest.raises(DataError, match=r"nul\.txt: byte 0x00 at offset 2"):
        build([nul], tmp_path / "o")


def test_check_prefix_refuses_another_format(tmp_path):
    idx_path(tmp_path / "x").write_bytes(b"NOTMEGATRON" + bytes(40))
    bin_path(tmp_path / "x").write_bytes(b"")
    with pytest.raises(DataError, match=r"x\.idx: not a Megatron indexed dataset \(header"):
        check_prefix(tmp_path / "x")


def test_build_refuses_empty_input_keeping_existing_data(tmp_path):
    good, empty = tmp_path / "good.txt", tmp_path / "empty.txt"
    good.write_text("keep me\n")
    empty.write_text("\n \n")
    build([good], tmp_path / "p")
    before = bin_path(tmp_path / "p").read_bytes()
    with pytest.raises(DataError, match=r"inputs .*empty\.txt: no documents"):
        build([empty], tmp_path / "p")
    assert bin_path(tmp_path / "p").read_bytes() == before


# ---------------------------------------------------------------------------------------------
# bad input: one line naming the file or field, before any rank starts (megascale train)


def _train_error(capsys, tmp_path, *overrides: str, one_line: bool = True) -> str:
    args = ["train", "--run-dir", str(tmp_path / "run")]
    for item in overrides:
        args += ["--set", item]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    if one_line:  # config validation lists every broken rule, one per line
        assert err.count("\n") == 0, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return err


@pytest.fixture
def byte_data(tmp_path) -> Path:
    src = tmp_path / "in.txt"
    src.write_text("one paragraph\n\nanother one\n")
    build([src], tmp_path / "d")
    return tmp_path / "d"


def test_train_refuses_truncated_bin(capsys, tmp_path, byte_data):
    data = bin_path(byte_data).read_bytes()
    bin_path(byte_data).write_bytes(data[:-4])
    err = _train_error(capsys, tmp_path, f"data.path={byte_data}")
    assert f"{byte_data}.bin: {len(data) - 4} bytes, expected {len(data)}" in err
    assert "truncated" in err


def test_train_refuses_idx_of_another_dtype(capsys, tmp_path, byte_data):
    raw = bytearray(idx_path(byte_data).read_bytes())
    raw[17] = 4  # the dtype code: uint16 (8) -> int32 (4)
    idx_path(byte_data).write_bytes(bytes(raw))
    err = _train_error(capsys, tmp_path, f"data.path={byte_data}")
    assert f"{byte_data}.bin" in err and "int32" in err and "another dtype" in err


def test_train_refuses_missing_prefix(capsys, tmp_path):
    err = _train_error(capsys, tmp_path, f"data.path={tmp_path / 'absent'}")
    assert f"data.path='{tmp_path / 'absent'}'" in err and "absent.idx does not exist" in err


def test_train_refuses_vocab_larger_than_model(capsys, tmp_path, bpe):
    src = tmp_path / "in.txt"
    src.write_text("the cat\n")
    build([src], tmp_path / "h", bpe)
    err = _train_error(capsys, tmp_path, f"data.path={tmp_path / 'h'}", "model.vocab_size=256")
    assert f"vocabulary {BPE_VOCAB}" in err and "model.vocab_size = 256" in err


def test_train_refuses_token_id_beyond_vocab(capsys, tmp_path):
    # A dataset made elsewhere (no PREFIX.json): the .bin is scanned.
    builder = IndexedDatasetBuilder(str(bin_path(tmp_path / "m")), dtype=np.uint16)
    builder.add_document(np.array([1, 2, 300, 0]), [4])
    builder.finalize(str(idx_path(tmp_path / "m")))
    err = _train_error(capsys, tmp_path, f"data.path={tmp_path / 'm'}")
    assert f"{tmp_path / 'm'}.bin: token id 300 >= model.vocab_size = 256" in err


def test_train_refuses_blend_weights_that_do_not_parse(capsys, tmp_path, byte_data):
    blend = f'data.blend=["0.7", "{byte_data}", "x", "{byte_data}"]'
    err = _train_error(capsys, tmp_path, blend, one_line=False)
    assert "data.blend[2] = 'x': not a positive number" in err


def test_bad_tokenizer_file_and_empty_build_input_via_cli(capsys, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    src = tmp_path / "in.txt"
    src.write_text("text\n")
    rc = cli.main(["data", "build", str(src), "--tokenizer", str(bad), "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0
    assert f"--tokenizer {bad}: not a Hugging Face tokenizer.json" in err
    src.write_text("")
    assert cli.main(["data", "build", str(src), "-o", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"inputs {src}: no documents" in err


# ---------------------------------------------------------------------------------------------
# built-in corpus

# Pinned output of the generator: a change here changes every tiny run's data, so it must come
# with a CORPUS_VERSION bump (the version is in the cache file name).
CORPUS_SHA256 = "8e34ee88ee91a140c1ab7aee1db9beb18c4228ec07af7fa4bc7db01d52af9fcf"
CORPUS_BYTES = 300_250
CORPUS_DOCUMENTS = 1377
# Tokens = bytes - 2 per "\n\n" separator - the final "\n" + one EOD per document.
CORPUS_TOKENS = CORPUS_BYTES - 2 * (CORPUS_DOCUMENTS - 1) - 1 + CORPUS_DOCUMENTS


def test_default_corpus_is_pinned():
    text = generate_corpus()
    assert len(text) == CORPUS_BYTES
    assert text.isascii() and "\x00" not in text
    assert corpus_sha256() == CORPUS_SHA256
    assert generate_corpus(seed=1) != text


def test_default_corpus_builds_once_in_megatron_format(tmp_path):
    prefix = default_token_file(tmp_path / "cache")
    assert prefix.name == f"megascale-corpus-v{CORPUS_VERSION}"
    ds = IndexedDataset(str(prefix))
    assert (len(ds), int(ds.sequence_lengths.sum())) == (CORPUS_DOCUMENTS, CORPUS_TOKENS)
    assert DatasetInfo.read(prefix).vocab_size == 256
    mtime = idx_path(prefix).stat().st_mtime_ns
    assert default_token_file(tmp_path / "cache") == prefix
    assert idx_path(prefix).stat().st_mtime_ns == mtime  # reused, not rebuilt
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_default_corpus_concurrent_builders(tmp_path):
    # Every rank may call default_token_file at once: all must get a complete, identical file.
    with ThreadPoolExecutor(4) as pool:
        prefixes = list(pool.map(lambda _: default_token_file(tmp_path), range(4)))
    assert len(set(prefixes)) == 1
    ds = IndexedDataset(str(prefixes[0]))  # its memory map must outlive the lengths' view
    assert int(ds.sequence_lengths.sum()) == CORPUS_TOKENS
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_check_prefix_refuses_a_truncated_index(tmp_path, byte_data):
    raw = idx_path(byte_data).read_bytes()
    idx_path(byte_data).write_bytes(raw[:-3])
    with pytest.raises(DataError, match=r"d\.idx: truncated index"):
        check_prefix(byte_data)
