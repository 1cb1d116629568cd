"""megascale.data.dataset: blends and splits through megatron-core's builder, the layout-free sample
order (DP1 = DP2 = DP4 at every global step), resume, and bounded per-rank memory (mmapped indices).

megatron-core's blended dataset asks torch.distributed for the rank, so the module runs in a
one-process gloo group (torn down at the end).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megascale.config import ConfigError, load, validate
from megascale.data.blend import parse_blend, parse_split
from megascale.data.build import build
from megascale.data.dataset import ShardedBatches, build_splits, split_sizes
from megascale.data.indexed import DataError

WEIGHTS = (0.7, 0.3)
SHARE_TOLERANCE = 0.02
"""megatron-core's blending picks, at every sample, the corpus furthest behind its weight, so the
observed share after N samples is within about 1/N of it; 0.02 is generous for 800 samples."""


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two byte-level corpora told apart by their letters: A lowercase, B uppercase."""
    d = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(3)
    for name, letters in (("a", "abcdefgh"), ("b", "ABCDEFGH")):
        paras = [
            " ".join("".join(rng.choice(list(letters), 5)) for _ in range(int(n)))
            for n in rng.integers(5, 40, 300)
        ]
        (d / f"{name}.txt").write_text("\n\n".join(paras) + "\n")
        build([d / f"{name}.txt"], d / name)
    return d


def _job(corpora, *overrides: str, steps: int = 100, gbs: int = 8):
    blend = f'["{WEIGHTS[0]}", "{corpora / "a"}", "{WEIGHTS[1]}", "{corpora / "b"}"]'
    return load(
        None,
        [
            f"data.blend={blend}",
            f"train.steps={steps}",
            f"train.global_batch_size={gbs}",
            "train.micro_batch_size=2",
            "model.seq_length=32",
            *overrides,
        ],
    )


def _corpus_of(tokens: torch.Tensor) -> str:
    """'a' or 'b' by the letters in a sample (spaces, newlines and EOD are shared)."""
    lower = int(((tokens >= ord("a")) & (tokens <= ord("h"))).sum())
    upper = int(((tokens >= ord("A")) & (tokens <= ord("H"))).sum())
    assert (lower == 0) != (upper == 0), tokens  # a blend sample comes from one corpus
    return "a" if lower else "b"


def _steps(train, job, steps: int, dp: int, state=None, first: int = 0) -> list[list[torch.Tensor]]:
    """Per step: the samples' tokens in global order (rank 0's micro-batches, then rank 1's...)."""
    t = job.train
    loaders = [
        ShardedBatches(train, t.global_batch_size, t.micro_batch_size, r, dp, t.seed)
        for r in range(dp)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        samples = []
        for loader in loaders:
            for batch in loader.next_step():
                samples.extend(batch["tokens"])
        out.append(samples)
    return out


def test_blend_shares_match_the_weights(corpora, tmp_path):
    from megatron.core.datasets import helpers_cpp  # the compiled blending/sample-index helpers

    assert hasattr(helpers_cpp, "build_blending_indices")
    job = _job(corpora)
    train, _valid = build_splits(job, None, tmp_path / "cache")
    samples = [s for step in _steps(train, job, job.train.steps, dp=1) for s in step]
    assert len(samples) == 800
    share_a = sum(_corpus_of(s) == "a" for s in samples) / len(samples)
    assert abs(share_a - WEIGHTS[0]) <= SHARE_TOLERANCE, share_a
    # The table form {PREFIX = weight} is the same blend.
    table = f'{{"{corpora / "a"}" = 0.7, "{corpora / "b"}" = 0.3}}'
    assert parse_blend(_job(corpora, f"data.blend={table}").data.blend) == parse_blend(
        job.data.blend
    )


def test_same_samples_for_dp1_dp2_dp4_and_after_resume(corpora, tmp_path):
    job = _job(corpora, steps=12, gbs=16)
    train, _ = build_splits(job, None, tmp_path / "cache")
    reference = _steps(train, job, 12, dp=1)
    for dp in (2, 4):
        got = _steps(train, job, 12, dp=dp)
        for step, (a, b) in enumerate(zip(reference, got, strict=True)):
            assert torch.equal(torch.stack(a), torch.stack(b)), (dp, step)
    # Resume after 5 steps, with another layout: the same samples as the uninterrupted run.
    loader = ShardedBatches(train, 16, 2, 0, 2, job.train.seed)
    for _ in range(5):
        loader.next_step()
    state = loader.state_dict()
    assert state == {"step": 5, "consumed_samples": 80, "seed": job.train.seed}
    resumed = _steps(train, job, 7, dp=4, state=state)
    for a, b in zip(reference[5:], resumed, strict=True):
        assert torch.equal(torch.stack(a), torch.stack(b))
    # A rebuild from the cache (another process, a restart) gives the same order.
    again, _ = build_splits(job, None, tmp_path / "cache")
    assert torch.equal(again[37]["tokens"], train[37]["tokens"])


def test_indices_are_memory_mapped_from_the_cache(corpora, tmp_path):
    job = _job(corpora, "train.eval_interval=10")
    train, valid = build_splits(job, None, tmp_path / "cache")
    assert isinstance(train.dataset_index, np.memmap)
    for mid in train.datasets:
        assert isinstance(mid.shuffle_index, np.memmap)
        assert isinstance(mid.sample_index, np.memmap)
    assert len(valid) >= split_sizes(job)[1] == job.train.eval_steps * 8
    assert any(p.name.endswith("shuffle_index.npy") for p in (tmp_path / "cache").iterdir())


def test_splits_hold_disjoint_documents(corpora, tmp_path):
    job = load(
        None,
        [f"data.path={corpora / 'a'}", "data.split=80,20,0", "train.eval_interval=5",
         "train.steps=10", "model.seq_length=32"],
    )  # fmt: skip
    train, valid = build_splits(job, None, tmp_path / "cache")
    train_docs = set(np.asarray(train.document_index).tolist())
    valid_docs = set(np.asarray(valid.document_index).tolist())
    assert train_docs and valid_docs and not train_docs & valid_docs


def test_parse_split_and_blend_errors():
    assert parse_split("98,1,1") == pytest.approx([0.98, 0.01, 0.01])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("a,b", "1,-1,0", "0,0,0", "1,1,1,1"):
        with pytest.raises(DataError, match=f"data.split = {bad!r}"):
            parse_split(bad)
    assert parse_blend(["A", "B"]) == (["A", "B"], None)
    with pytest.raises(DataError, match=r"data.blend = \['0.7', 'A', '0.3'\]: 3 entries"):
        parse_blend(["0.7", "A", "0.3"])
    with pytest.raises(DataError, match=r"data.blend\[0\] = '-1': not a positive number"):
        parse_blend(["-1", "A"])


def test_config_validation_of_data_fields():
    def problems(*overrides: str) -> str:
        with pytest.raises(ConfigError) as e:
            validate(load(None, list(overrides)), 1, "gloo")
        return str(e.value)

    assert "data.split = 'x'" in problems("data.split=x")
    assert "set one" in problems("data.path=/p", 'data.blend=["/p"]')
    assert "train.eval_interval = 5: needs a valid share" in problems(
        "train.eval_interval=5", "data.split=100,0,0"
    )
    assert "train.eval_steps = 0: must be >= 1" in problems("train.eval_steps=0")
    with pytest.raises(ConfigError, match="data.blend = True .*expected a list"):
        load(None, ["data.blend=true"])


def test_samples_are_shifted_windows_with_full_masks(corpora, tmp_path):
    job = load(None, [f"data.path={corpora / 'a'}", "train.steps=5", "model.seq_length=32"])
    train, _ = build_splits(job, None, tmp_path / "cache")
    batch = ShardedBatches(train, 8, 4, 0, 1, job.train.seed).next_step()[0]
    assert batch["tokens"].shape == batch["labels"].shape == (4, 32)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["loss_mask"], torch.ones(4, 32))
    assert torch.equal(batch["position_ids"], torch.arange(32).expand(4, 32))


def test_order_depends_on_the_seed_and_runs_across_epochs(corpora, tmp_path):
    def first_step_tokens(seed: int, steps: int):
        job = load(
            None,
            [f"data.path={corpora / 'b'}", f"train.seed={seed}", f"train.steps={steps}",
             "model.seq_length=32"],
        )  # fmt: skip
        train, _ = build_splits(job, None, tmp_path / "cache")
        return train, ShardedBatches(train, 8, 2, 0, 1, seed).next_step()[0]["tokens"]

    one, a = first_step_tokens(1, 5)
    _, b = first_step_tokens(2, 5)
    assert not torch.equal(a, b)
    # Corpus b is ~2k samples of 32 tokens; 2,000 steps of 8 need several epochs.
    many, _ = first_step_tokens(1, 2000)
    assert len(many) >= 16_000 > 2 * len(one)


def test_bad_batch_sizes(corpora, tmp_path):
    job = load(None, [f"data.path={corpora / 'a'}", "train.steps=5", "model.seq_length=32"])
    train, _ = build_splits(job, None, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"global_batch_size=6 must be a positive multiple"):
        ShardedBatches(train, 6, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):
        ShardedBatches(train, 8, 2, 2, 2, 0)


def test_a_split_too_small_for_one_sample_is_refused(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a b c d e f g h i j k l m n o p q\n\nsecond doc with words\n\nthird doc\n")
    build([src], tmp_path / "d")
    job = load(None, [f"data.path={tmp_path / 'd'}", "train.eval_interval=2", "model.seq_length=8"])
    with pytest.raises(DataError, match=r"the valid split of .*d is 0 of 3 documents, 0 tokens"):
        build_splits(job, None, tmp_path / "cache")
    # Without evaluation the valid share is never built, so the same data trains.
    job = load(None, [f"data.path={tmp_path / 'd'}", "model.seq_length=8"])
    train, valid = build_splits(job, None, tmp_path / "cache")
    assert valid is None and len(train) > 0
