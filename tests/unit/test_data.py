"""megascale.data: token file format, build tool, built-in corpus, sampling order, DP sharding."""

from __future__ import annotations

import argparse
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from megascale.data import build as build_mod
from megascale.data.build import build, split_documents
from megascale.data.corpus import (
    CORPUS_VERSION,
    corpus_sha256,
    default_token_file,
    generate_corpus,
)
from megascale.data.dataset import GPTDataset, ShardedBatches, epoch_order
from megascale.data.token_file import (
    HEADER_SIZE,
    MAGIC,
    TokenFile,
    TokenFileError,
    bin_path,
    idx_path,
    write_token_file,
)
from megascale.data.tokenizer import EOD, ByteTokenizer

# ---------------------------------------------------------------------------------------------
# format


@pytest.mark.parametrize(
    ("vocab_size", "dtype"),
    [(256, "uint16"), (65535, "uint16"), (65536, "uint32"), (200_000, "uint32")],
)
def test_round_trip(tmp_path, vocab_size, dtype):
    docs = [[1, 2, 3], [], [vocab_size - 1, 0], [7]]
    stats = write_token_file(tmp_path / "t.v1", docs, vocab_size)
    assert (stats.num_documents, stats.num_tokens, stats.dtype) == (4, 6, dtype)
    tf = TokenFile(tmp_path / "t.v1")  # a dot in the prefix is kept, not taken as a suffix
    assert (tf.vocab_size, tf.num_documents, tf.num_tokens, tf.dtype.name) == (
        vocab_size,
        4,
        6,
        dtype,
    )
    assert [tf.document(i).tolist() for i in range(4)] == docs
    assert bin_path(tmp_path / "t.v1").stat().st_size == 6 * tf.dtype.itemsize
    assert isinstance(tf.tokens, np.memmap)


def test_header_layout_is_as_documented(tmp_path):
    write_token_file(tmp_path / "t", [[5, 6], [7]], 256)
    raw = idx_path(tmp_path / "t").read_bytes()
    assert raw[:8] == b"MSTOKEN\x00" == MAGIC
    assert struct.unpack_from("<IIQQ", raw, 8) == (1, 1, 256, 2)
    assert np.frombuffer(raw, "<i8", offset=32).tolist() == [0, 2, 3]
    assert bin_path(tmp_path / "t").read_bytes() == bytes([5, 0, 6, 0, 7, 0])  # uint16 LE


def test_write_refuses_out_of_vocab_ids(tmp_path):
    with pytest.raises(ValueError, match=r"document 1 has token id 256; accepted: 0\.\.255"):
        write_token_file(tmp_path / "t", [[1], [256]], 256)
    assert list(tmp_path.iterdir()) == []  # no partial files or temporaries left behind


def _corrupt_idx(tmp_path, mutate):
    prefix = tmp_path / "t"
    write_token_file(prefix, [[1, 2, 3], [4]], 256)
    raw = bytearray(idx_path(prefix).read_bytes())
    idx_path(prefix).write_bytes(bytes(mutate(raw)))
    return prefix


def test_bad_magic(tmp_path):
    prefix = _corrupt_idx(tmp_path, lambda r: b"NOTATOKN" + r[8:])
    with pytest.raises(TokenFileError, match=r"t\.idx: bad magic b'NOTATOKN', expected b'MSTOKEN"):
        TokenFile(prefix)


def test_bad_version(tmp_path):
    prefix = _corrupt_idx(tmp_path, lambda r: r[:8] + struct.pack("<I", 9) + r[12:])
    with pytest.raises(TokenFileError, match=r"t\.idx: unsupported version 9, expected 1"):
        TokenFile(prefix)


def test_bad_dtype_code(tmp_path):
    prefix = _corrupt_idx(tmp_path, lambda r: r[:12] + struct.pack("<I", 7) + r[16:])
    with pytest.raises(TokenFileError, match=r"t\.idx: unknown dtype code 7"):
        TokenFile(prefix)


def test_truncated_header(tmp_path):
    prefix = _corrupt_idx(tmp_path, lambda r: r[:20])
    with pytest.raises(TokenFileError, match=r"t\.idx: truncated header: 20 bytes, expected at"):
        TokenFile(prefix)


def test_truncated_offsets(tmp_path):
    prefix = _corrupt_idx(tmp_path, lambda r: r[:-8])
    expected = HEADER_SIZE + 8 * 3
    with pytest.raises(TokenFileError, match=rf"t\.idx: {expected - 8} bytes, expected {expected}"):
        TokenFile(prefix)


def test_truncated_bin(tmp_path):
    prefix = tmp_path / "t"
    write_token_file(prefix, [[1, 2, 3], [4]], 256)
    bin_path(prefix).write_bytes(bin_path(prefix).read_bytes()[:-2])
    with pytest.raises(TokenFileError, match=r"t\.bin: 6 bytes, expected 8 \(4 tokens of uint16"):
        TokenFile(prefix)


def test_missing_file(tmp_path):
    with pytest.raises(TokenFileError, match=r"nope\.idx: no such file.*megascale data build"):
        TokenFile(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# tokenizer and build tool


def test_tokenizer_round_trip_and_nul():
    tok = ByteTokenizer()
    text = "héllo, wörld 1 + 2 = 3"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("AB") == [65, 66]
    with pytest.raises(ValueError, match="offset 1.*0x00"):
        tok.encode("a\x00b")


def test_split_documents():
    data = b"  \nfirst line\nsecond\n\n \t\r\nthird\r\n\n\n"
    assert split_documents(data) == [b"first line\nsecond", b"third\r"]
    assert split_documents(data, "file") == [data]
    assert split_documents(b"\n\n") == []


def test_build_tool_on_temp_text(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text("hello world\nsecond line\n\nnext paragraph\n")
    b.write_text("other file\n")
    stats = build([a, b], tmp_path / "out" / "corpus", 256)
    tf = TokenFile(tmp_path / "out" / "corpus")
    docs = [ByteTokenizer().decode(tf.document(i)[:-1]) for i in range(tf.num_documents)]
    assert docs == ["hello world\nsecond line", "next paragraph", "other file"]
    assert all(tf.document(i)[-1] == EOD for i in range(tf.num_documents))
    assert stats.num_tokens == sum(len(d) + 1 for d in docs)

    stats = build([a, b], tmp_path / "per_file", 50_000, split="file")
    assert (stats.num_documents, stats.vocab_size) == (2, 50_000)


def test_build_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        build([tmp_path / "missing.txt"], tmp_path / "o", 256)
    with pytest.raises(ValueError, match="vocab_size=100: the byte tokenizer needs"):
        build([], tmp_path / "o", 100)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"ab\x00c")
    with pytest.raises(ValueError, match=r"nul\.txt: byte 0x00 at offset 2"):
        build([nul], tmp_path / "o", 256)


def test_build_cli(tmp_path, caplog):
    src = tmp_path / "in.txt"
    src.write_text("one\n\ntwo\n")
    parser = argparse.ArgumentParser()
    build_mod.add_arguments(parser)
    args = parser.parse_args([str(src), "--output", str(tmp_path / "p")])
    assert build_mod.run(args) == 0
    assert TokenFile(tmp_path / "p").num_documents == 2
    args = parser.parse_args([str(tmp_path / "absent.txt"), "-o", str(tmp_path / "q")])
    assert build_mod.run(args) == 1
    assert "absent.txt: no such file" in caplog.text


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


def test_default_corpus_builds_once(tmp_path):
    prefix = default_token_file(tmp_path / "cache")
    assert prefix.name == f"megascale-corpus-v{CORPUS_VERSION}"
    tf = TokenFile(prefix)
    assert (tf.num_documents, tf.num_tokens, tf.vocab_size) == (
        CORPUS_DOCUMENTS,
        CORPUS_TOKENS,
        256,
    )
    mtime = idx_path(prefix).stat().st_mtime_ns
    assert default_token_file(tmp_path / "cache") == prefix
    assert idx_path(prefix).stat().st_mtime_ns == mtime  # reused, not rebuilt
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    assert leftovers == []


# ---------------------------------------------------------------------------------------------
# sampling, order, sharding


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "t"
    rng = np.random.default_rng(0)
    write_token_file(
        prefix, [rng.integers(1, 256, size=int(n)) for n in rng.integers(5, 50, 40)], 256
    )
    return GPTDataset(TokenFile(prefix), seq_length=8)


def test_samples_are_shifted_windows(dataset):
    stream = np.asarray(dataset.token_file.tokens, np.int64)
    assert len(dataset) == (len(stream) - 1) // 8
    for i in (0, 1, len(dataset) - 1):
        assert dataset[i].tolist() == stream[i * 8 : i * 8 + 9].tolist()
    sb = ShardedBatches(dataset, 4, 2, 0, 1, seed=3)
    mb = sb.next_step()[0]
    assert torch.equal(mb["tokens"][:, 1:], mb["labels"][:, :-1])
    assert mb["tokens"].dtype == mb["labels"].dtype == mb["position_ids"].dtype == torch.int64
    assert mb["loss_mask"].dtype == torch.float32 and bool((mb["loss_mask"] == 1).all())
    assert mb["position_ids"].tolist() == [list(range(8))] * 2


def test_too_short_for_one_sample(tmp_path):
    write_token_file(tmp_path / "s", [[1, 2, 3]], 256)
    with pytest.raises(TokenFileError, match="3 tokens, need at least 9 for one sample"):
        GPTDataset(TokenFile(tmp_path / "s"), 8)


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(100, 7, 0)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, np.random.default_rng((7, 0)).permutation(100))
    assert not np.array_equal(a, epoch_order(100, 7, 1))
    assert not np.array_equal(a, epoch_order(100, 8, 0))


def _run(dataset, steps, gbs=8, mbs=2, rank=0, dp=1, seed=11, state=None):
    sb = ShardedBatches(dataset, gbs, mbs, rank, dp, seed)
    if state is not None:
        sb.load_state_dict(state)
    return [sb.next_step() for _ in range(steps)], sb


def _tokens(step_batches):
    return torch.cat([mb["tokens"] for mb in step_batches])


def test_deterministic_and_seed_dependent(dataset):
    a, _ = _run(dataset, 3)
    b, _ = _run(dataset, 3)
    c, _ = _run(dataset, 3, seed=12)
    assert all(torch.equal(_tokens(x), _tokens(y)) for x, y in zip(a, b, strict=True))
    assert not torch.equal(_tokens(a[0]), _tokens(c[0]))


def test_runs_across_epochs(dataset):
    steps = 2 * len(dataset) // 8 + 2  # more than two epochs
    batches, _ = _run(dataset, steps)
    seen = torch.cat([_tokens(s) for s in batches])
    first_epoch = seen[: len(dataset)]
    expected = torch.stack([torch.from_numpy(dataset[i][:-1]) for i in range(len(dataset))])
    assert sorted(map(tuple, first_epoch.tolist())) == sorted(map(tuple, expected.tolist()))


def test_resume_equals_uninterrupted(dataset):
    full, _ = _run(dataset, 7)
    _, sb = _run(dataset, 4)
    state = sb.state_dict()
    assert state == {"step": 4, "consumed_samples": 32, "seed": 11}
    assert all(type(v) is int for v in state.values())
    rest, _ = _run(dataset, 3, seed=999, state=dict(state))  # the saved seed wins
    for x, y in zip(full[4:], rest, strict=True):
        for mx, my in zip(x, y, strict=True):
            assert all(torch.equal(mx[k], my[k]) for k in mx)


@pytest.mark.parametrize(("dp", "mbs"), [(2, 2), (4, 1), (2, 1), (8, 1)])
def test_dp_union_equals_one_process_reference(dataset, dp, mbs):
    reference, _ = _run(dataset, 3, gbs=8, mbs=2)
    ranks = [_run(dataset, 3, gbs=8, mbs=mbs, rank=r, dp=dp)[0] for r in range(dp)]
    for step in range(3):
        assert all(len(ranks[r][step]) == 8 // (dp * mbs) for r in range(dp))
        union = torch.cat([_tokens(ranks[r][step]) for r in range(dp)])
        assert torch.equal(union, _tokens(reference[step]))


def test_resume_with_another_dp_layout(dataset):
    full, _ = _run(dataset, 5)
    _, sb = _run(dataset, 2, rank=1, dp=2)
    state = sb.state_dict()
    ranks = [_run(dataset, 3, mbs=1, rank=r, dp=4, state=state)[0] for r in range(4)]
    for k in range(3):
        assert torch.equal(
            torch.cat([_tokens(ranks[r][k]) for r in range(4)]), _tokens(full[2 + k])
        )


def test_bad_batch_sizes(dataset):
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=6 must be a positive multiple of "
        r"dp_size \* micro_batch_size = 2 \* 2",
    ):
        ShardedBatches(dataset, 6, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):
        ShardedBatches(dataset, 8, 2, 2, 2, 0)


def test_default_corpus_concurrent_builders(tmp_path):
    # Every rank may call default_token_file at once: all must get a complete, identical file.
    with ThreadPoolExecutor(4) as pool:
        prefixes = list(pool.map(lambda _: default_token_file(tmp_path), range(4)))
    assert len(set(prefixes)) == 1
    assert TokenFile(prefixes[0]).num_tokens == CORPUS_TOKENS
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
