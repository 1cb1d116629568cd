"""The largest-id check of a ``.bin`` is read once per file and machine (``data.scan_cache``)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megascale.config import load
from megascale.data import scan_cache
from megascale.data.dataset import check_data
from megascale.data.indexed import DataError, bin_path, idx_path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "megascale"


@pytest.fixture
def reads(tmp_path, monkeypatch) -> Path:
    """A file with a line per real read of a ``.bin`` (from any process forked after)."""
    log = tmp_path / "reads"
    real = scan_cache.scan_max_token

    def counted(prefix, limit):
        with open(log, "a") as f:
            f.write(f"{prefix}\n")
        return real(prefix, limit=limit)

    monkeypatch.setattr(scan_cache, "scan_max_token", counted)
    return log


def _megatron_made(prefix: Path, tokens: list[int]) -> Path:
    """A dataset as Megatron's preprocessing makes it: no ``PREFIX.json``, so all of it is read.
    ``tokens`` is repeated as documents enough for every split of the tiny preset."""
    builder = IndexedDatasetBuilder(str(bin_path(prefix)), dtype=np.uint16)
    for _ in range(200):
        builder.add_document(np.array(tokens * 20), [len(tokens) * 20])
    builder.finalize(str(idx_path(prefix)))
    return prefix


def _job(prefix: Path):
    return load("tiny", [f"data.path={prefix}"])


def _count(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_dataset_is_read_once_and_again_when_it_changes(tmp_path, cache, reads):
    prefix = _megatron_made(tmp_path / "m", [1, 2, 3, 0])
    for _ in range(3):  # the job's start, then two replacements
        check_data(_job(prefix), None, scan=True)
    assert _count(reads) == 1
    _megatron_made(prefix, [1, 300, 0])  # rewritten in place, with an id beyond the vocabulary
    with pytest.raises(DataError, match=r"m\.bin: token id 300 >= model.vocab_size = 256"):
        check_data(_job(prefix), None, scan=True)
    assert _count(reads) == 2


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path, monkeypatch, reads):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    prefix = _megatron_made(tmp_path / "m", [1, 300, 0])
    for _ in range(2):
        with pytest.raises(DataError, match="token id 300"):
            check_data(_job(prefix), None, scan=True)
    assert _count(reads) == 2  # read each time


def _check(prefix: str) -> None:
    check_data(_job(Path(prefix)), None, scan=True)
    os._exit(0)


def test_the_ranks_of_a_machine_that_start_together_read_it_once(tmp_path, cache, reads):
    prefix = _megatron_made(tmp_path / "m", list(range(200)))
    ranks = [mp.get_context("fork").Process(target=_check, args=(str(prefix),)) for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(60)
    assert [rank.exitcode for rank in ranks] == [0] * 4
    assert _count(reads) == 1
    assert (cache / "token_scans.json").exists()
