"""A dataset's index checked against its own ``.bin`` (sizes, pointers, document indices, the
tokens' real largest id) before any rank trains, whatever its ``PREFIX.json`` says: one line
naming the file, exit code 2."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from megascale import cli
from megascale.data.build import build
from megascale.data.indexed import bin_path, idx_path

HEAD = 9 + 8 + 1 + 16  # magic, version, dtype code, sequence and document counts


def _train_error(capsys, tmp_path, *overrides: str) -> str:
    args = ["train", "--run-dir", str(tmp_path / "run")]
    for item in overrides:
        args += ["--set", item]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    return err


@pytest.fixture
def data(tmp_path) -> Path:
    """A byte-tokenized dataset of three documents (three sequences), enough tokens to train."""
    src = tmp_path / "in.txt"
    src.write_text("\n\n".join(f"paragraph {i} " * 40 for i in range(3)) + "\n")
    build([src], tmp_path / "d")
    return tmp_path / "d"


def _patch_idx(prefix: Path, offset: int, fmt: str, value: int) -> None:
    raw = bytearray(idx_path(prefix).read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    idx_path(prefix).write_bytes(bytes(raw))


def _counts(prefix: Path) -> tuple[int, int]:
    return struct.unpack_from("<QQ", idx_path(prefix).read_bytes(), HEAD - 16)


def test_an_index_of_another_version_is_refused(capsys, tmp_path, data):
    _patch_idx(data, 9, "<Q", 2)
    err = _train_error(capsys, tmp_path, f"data.path={data}")
    assert f"{data}.idx: index version 2" in err and "accepted 1" in err


def test_token_ids_beyond_the_vocabulary_are_found_when_the_sidecar_is_stale(
    capsys, tmp_path, data
):
    tokens = np.fromfile(bin_path(data), dtype=np.uint16)
    tokens[3] = 300  # the sidecar still says the largest id is a byte
    tokens.tofile(bin_path(data))
    err = _train_error(capsys, tmp_path, f"data.path={data}")
    assert f"{data}.bin: token id 300 >= model.vocab_size = 256" in err


def test_a_sequence_longer_than_the_bin_is_refused(capsys, tmp_path, data):
    _patch_idx(data, HEAD, "<i", 10_000)  # the first sequence's length; the last one is intact
    err = _train_error(capsys, tmp_path, f"data.path={data}")
    assert f"{data}.idx: sequence 0" in err and "length 10000" in err
    assert f"past the end of {data.name}.bin" in err


def test_a_negative_pointer_is_refused(capsys, tmp_path, data):
    n_seq, _ = _counts(data)
    _patch_idx(data, HEAD + 4 * n_seq + 8, "<q", -8)  # the second sequence's byte offset
    err = _train_error(capsys, tmp_path, f"data.path={data}")
    assert f"{data}.idx: sequence 1" in err and "pointer -8" in err


def test_a_document_index_past_the_end_is_refused(capsys, tmp_path, data):
    n_seq, n_doc = _counts(data)
    _patch_idx(data, HEAD + 12 * n_seq + 8 * (n_doc - 2), "<q", n_seq + 5)
    err = _train_error(capsys, tmp_path, f"data.path={data}")
    assert f"{data}.idx: document index {n_doc - 2} is {n_seq + 5}" in err
    assert f"0..{n_seq}" in err
