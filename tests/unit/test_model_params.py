"""``count_parameters`` against the real model ``megascale.model.gpt.build_gpt`` builds.

The models are built on the CPU backend in one process, tp = pp = 1, exactly as the trainer builds
them (``transformer_config`` -> ``build_model_chunks``). Building needs ``torch.distributed``
(gloo, world size 1), megatron-core's parallel state and ``cpu_backend.activate()``: all process
globals. So everything happens in ONE forked child, which sends back plain data (counts, class
names, parameter names) and exits; the pytest process stays clean for the other tests.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest

from megascale import config
from megascale.probes.flops import count_parameters, padded_vocab

CASES: dict[str, list[str]] = {
    "tiny": [],
    # Plus a sliding window: no parameters, but it must reach megatron-core's TransformerConfig.
    "parallel_block": ["model.parallel_block=true", "model.window_size=16"],
    # A vocabulary that needs padding (300 -> 384 rows) as well.
    "swiglu_gqa": [
        "model.swiglu=true",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=96",
        "model.vocab_size=300",
    ],
    # Llama-style: RMSNorm (a weight only), no biases, an output layer of its own; both blocks.
    "llama_serial": [
        "model.normalization=RMSNorm",
        "model.bias=false",
        "model.tie_embeddings=false",
        "model.swiglu=true",
        "model.rotary_base=500000",
    ],
    "llama_parallel": [
        "model.normalization=RMSNorm",
        "model.bias=false",
        "model.tie_embeddings=false",
        "model.parallel_block=true",
    ],
}


def _inspect(overrides: list[str], groups) -> dict:
    """Build the 1-process model for ``tiny`` + overrides and describe it as plain data."""
    from megascale.model.gpt import padded_vocab_size, transformer_config
    from megascale.parallel.parallelize import build_model_chunks

    job = config.validate(config.load("tiny", overrides), 1, "gloo")
    tconf = transformer_config(job, "cpu")
    chunks = build_model_chunks(job, tconf, groups, use_te=False, device="cpu")
    (model,) = chunks
    layers = list(model.decoder.layers)
    return {
        "count": count_parameters(job.model, job.parallel.tp),
        "numel": sum(p.numel() for p in model.parameters()),
        "names": [name for name, _ in model.named_parameters()],
        "embedding_rows": model.embedding.word_embeddings.weight.shape[0],
        "padded_vocab_size": padded_vocab_size(job.model.vocab_size, job.parallel.tp),
        "output_layer_weight": model.output_layer.weight is not None,
        "share_embeddings": model.share_embeddings_and_output_weights,
        "position_embedding_type": model.position_embedding_type,
        "layer_classes": [type(layer).__name__ for layer in layers],
        "pre_mlp_norm_classes": [type(layer.pre_mlp_layernorm).__name__ for layer in layers],
        "pre_mlp_norm_params": [
            sum(p.numel() for p in layer.pre_mlp_layernorm.parameters()) for layer in layers
        ],
        "window_size": tconf.window_size,
        "num_layers": job.model.num_layers,
    }


def _child(conn, port: int) -> None:
    try:
        import torch.distributed as dist

        from megascale.parallel import cpu_backend
        from megascale.parallel.groups import build_groups

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        cpu_backend.activate()
        from megatron.core import parallel_state as ps

        groups = build_groups(config.load("tiny").parallel)
        cases = {name: _inspect(o, groups) for name, o in CASES.items()}
        created = {"dp_gloo": ps._DATA_PARALLEL_GROUP_GLOO is not None}
        conn.send(("ok", {"cases": cases, "groups": created}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


@pytest.fixture(scope="module")
def child() -> dict[str, dict]:
    """What the child built: ``cases`` (one entry per CASES) and the process ``groups``."""
    from megascale.launcher.local import free_port

    ctx = mp.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, free_port()))
    proc.start()
    sender.close()
    try:
        if not receiver.poll(300):
            pytest.fail("model-building child sent nothing within 300 s")
        status, value = receiver.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert status == "ok", f"model-building child failed:\n{value}"
    return value


@pytest.fixture(scope="module")
def built(child) -> dict[str, dict]:
    return child["cases"]


@pytest.mark.parametrize("case", list(CASES))
def test_count_parameters_matches_the_built_model(built, case):
    info = built[case]
    assert info["numel"] == info["count"], (case, info["names"])


def test_vocabulary_is_padded_and_tied(built):
    for case, info in built.items():
        untied = case.startswith("llama")  # model.tie_embeddings = false: its own output layer
        assert info["share_embeddings"] is not untied and info["output_layer_weight"] is untied
        assert info["embedding_rows"] == info["padded_vocab_size"]
    # flops.padded_vocab restates gpt.padded_vocab_size (mfu must not import torch): same numbers.
    assert built["tiny"]["embedding_rows"] == 256 == padded_vocab(256)
    assert built["swiglu_gqa"]["embedding_rows"] == 384 == padded_vocab(300)


def test_rope_has_no_position_parameters(built):
    for info in built.values():
        assert info["position_embedding_type"] == "rope"
        assert not [n for n in info["names"] if "position" in n], info["names"]


def test_serial_block_has_two_layernorms_per_layer(built):
    info = built["tiny"]
    assert set(info["layer_classes"]) == {"TransformerLayer"}
    assert info["pre_mlp_norm_params"] == [2 * 64] * info["num_layers"]  # weight + bias, h = 64
    assert info["window_size"] is None


def test_parallel_block_shares_one_layernorm(built):
    info = built["parallel_block"]
    assert set(info["layer_classes"]) == {"ParallelTransformerLayer"}
    assert set(info["pre_mlp_norm_classes"]) == {"IdentityOp"}
    assert info["pre_mlp_norm_params"] == [0] * info["num_layers"]
    assert not [n for n in info["names"] if "pre_mlp_layernorm" in n]
    # One LayerNorm (2h) fewer per layer than the serial block.
    assert built["tiny"]["numel"] - info["numel"] == info["num_layers"] * 2 * 64


def test_window_size_maps_to_megatron_left_right(built):
    # Ours: the token and the window_size - 1 before it; megatron-core: (left, right) excluding it.
    assert built["parallel_block"]["window_size"] == (15, 0)


def test_build_groups_creates_no_gloo_twins_of_the_data_parallel_groups(child):
    # Their full-mesh store connect is the N^2 term of default group setup (docs/scale.md).
    assert child["groups"] == {"dp_gloo": False}
