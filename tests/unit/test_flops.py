"""megascale.probes.flops against hand computations.

Reference shape: GPT-3 175B as in Narayanan et al. 2021 (arXiv 2104.04473): l = 96 layers,
h = 12288, 96 heads (head dim d = 128), s = 2048, ffn 4h = 49152, and V = 51200 (GPT-2's 50257
tokens padded to 51200, the vocabulary that paper's formula is quoted with).

Useful products (exact):
    h^2         = 150,994,944
    l * h^2     = 14,495,514,624
    6 * s       = 12,288 = h, so the attention term 12*l*h*s = 2 * l * h^2 for this shape.
"""

from __future__ import annotations

import argparse
import dataclasses
from fractions import Fraction

import pytest

from megascale import config
from megascale.config import ModelConfig
from megascale.probes import flops as F
from megascale.probes.flops import (
    PEAK_TFLOPS,
    count_parameters,
    flops_per_token,
    lookup_peak,
    mean_keys_per_query,
    mfu,
    mfu_report,
    padded_vocab,
)

H, L, S, V = 12288, 96, 2048, 51200
LH2 = 14_495_514_624  # l * h^2
GPT3 = ModelConfig(num_layers=L, hidden_size=H, num_heads=96, seq_length=S, vocab_size=V)


def test_products_used_in_comments():
    assert H * H == 150_994_944 and L * H * H == LH2 and 6 * S == H


def test_gpt3_dense_convention_matches_narayanan_exactly():
    # Training FLOPs per token, dense s*s attention, every term = 3 passes x 2 FLOPs/MAC x l:
    #   qkv    6 * h * 3h * l = 18 l h^2 = 260,919,263,232
    #   QK^T   6 * h * s * l  =  2,415,919,104 * 6 = 14,495,514,624 (= l h^2, since 6s = h)
    #   AV     same           = 14,495,514,624
    #   proj   6 * h * h * l  =  6 l h^2 = 86,973,087,744
    #   mlp    6 * 2 * h * 4h * l = 48 l h^2 = 695,784,701,952
    #   head   6 * h * V      = 6 * 12288 * 51200 = 3,774,873,600
    #   total  74 l h^2 + 6 h V = 1,072,668,082,176 + 3,774,873,600 = 1,076,442,955,776
    # Narayanan et al. eq. (per batch of B*s tokens): 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    #   per token = 72 l h^2 + 12 l h s + 6 h V = 72 l h^2 + 2 l h^2 + 6 h V: the same number.
    f = flops_per_token(GPT3, dense_attention=True)
    assert f.qkv == 260_919_263_232
    assert f.attention_scores == f.attention_values == 14_495_514_624
    assert f.attention_output == 86_973_087_744
    assert f.mlp == 695_784_701_952
    assert f.lm_head == 3_774_873_600
    assert f.total == 1_076_442_955_776
    assert f.keys_per_query == S
    narayanan = 72 * S * L * H**2 * (1 + Fraction(S, 6 * H) + Fraction(V, 12 * L * H)) / S
    assert f.total == narayanan
    # 6N rule of thumb, N = 12 l h^2 non-embedding weights = 173,946,175,488: 6N = 72 l h^2 =
    # 1,043,677,052,928. We are 2 l h^2 (attention) + 6 h V (head) = 3.1% above it.
    assert f.total - 6 * 12 * LH2 == 2 * LH2 + 6 * H * V
    assert f.total / (6 * 12 * LH2) == pytest.approx(1.0314, abs=1e-4)


def test_gpt3_causal_counts_the_keys_each_query_sees():
    # Full causal: query i sees i + 1 keys; mean over s = (s + 1) / 2 = 1024.5.
    #   QK^T = AV = 6 * h * 1024.5 * l = 7,251,296,256 each (just over half the dense 14.5G).
    #   total = 1,076,442,955,776 - 2 * (14,495,514,624 - 7,251,296,256) = 1,061,954,519,040
    f = flops_per_token(GPT3)
    assert f.keys_per_query == 1024.5
    assert f.attention_scores == f.attention_values == 7_251_296_256
    assert f.total == 1_061_954_519_040
    dense = flops_per_token(GPT3, dense_attention=True)
    assert (f.qkv, f.attention_output, f.mlp, f.lm_head) == (
        dense.qkv,
        dense.attention_output,
        dense.mlp,
        dense.lm_head,
    )


def test_mean_keys_per_query_exact():
    assert mean_keys_per_query(4) == Fraction(1 + 2 + 3 + 4, 4)
    assert mean_keys_per_query(2048) == Fraction(2049, 2)
    # Window 512 of 2048: 1 + 2 + ... + 512 = 131,328 for the first 512 queries, then
    # 1536 queries x 512 keys = 786,432; total 917,760 keys, mean 448.125.
    assert mean_keys_per_query(2048, 512) == Fraction(917_760, 2048) == Fraction(3585, 8)
    assert mean_keys_per_query(5, 2) == Fraction(1 + 2 + 2 + 2 + 2, 5)
    assert mean_keys_per_query(7, 1) == 1
    assert mean_keys_per_query(7, 100) == mean_keys_per_query(7)
    for s in range(1, 40):  # brute force against the definition
        for w in range(1, s + 3):
            assert mean_keys_per_query(s, w) == Fraction(sum(min(i + 1, w) for i in range(s)), s)


def test_window_shrinks_only_attention_and_equals_causal_when_wide():
    full = flops_per_token(GPT3)
    win = flops_per_token(dataclasses.replace(GPT3, window_size=512))
    assert win.attention_scores == win.attention_values == 6 * H * 448.125 * L
    assert win.attention_scores < full.attention_scores
    assert (win.qkv, win.attention_output, win.mlp, win.lm_head) == (
        full.qkv,
        full.attention_output,
        full.mlp,
        full.lm_head,
    )
    for w in (S, S + 1, 10 * S):
        assert flops_per_token(dataclasses.replace(GPT3, window_size=w)) == full
    dense_win = flops_per_token(dataclasses.replace(GPT3, window_size=512), dense_attention=True)
    assert dense_win.attention_scores == 6 * H * 512 * L


def test_gqa_reduces_only_kv_projection():
    # 8 query groups of d = 128: K and V are 1024 wide each, so the fused QKV output is
    # h + 2 * 1024 = 14,336 instead of 3h = 36,864: qkv = 6 * h * 14336 * l.
    gqa = flops_per_token(dataclasses.replace(GPT3, num_query_groups=8))
    mha = flops_per_token(GPT3)
    assert gqa.qkv == 6 * H * 14_336 * L
    assert mha.qkv - gqa.qkv == 6 * H * 2 * (H - 1024) * L  # only the K/V columns went away
    assert dataclasses.replace(gqa, qkv=mha.qkv) == mha
    # Attention over keys is unchanged: every query head still attends with d = 128.
    assert gqa.attention_scores == mha.attention_scores


def test_swiglu_uses_three_matrices():
    gelu = flops_per_token(GPT3)
    swiglu = flops_per_token(dataclasses.replace(GPT3, swiglu=True))
    assert swiglu.mlp == 6 * 3 * H * 4 * H * L == 1.5 * gelu.mlp
    # The usual parameter-matched SwiGLU: f = 8h/3 (here 32768) gives the GeLU MLP's FLOPs.
    matched = flops_per_token(dataclasses.replace(GPT3, swiglu=True, ffn_hidden_size=32_768))
    assert matched.mlp == gelu.mlp
    explicit = flops_per_token(dataclasses.replace(GPT3, ffn_hidden_size=10_000))
    assert explicit.mlp == 6 * 2 * H * 10_000 * L


def test_recompute_adds_one_layer_forward_not_the_head():
    # Narayanan et al. with full recomputation: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)):
    # layers x 4/3, the head term stays 6 h V.
    f = flops_per_token(GPT3, dense_attention=True, include_recompute=True)
    expected = 96 * L * H**2 * (1 + Fraction(S, 6 * H) + Fraction(V, 16 * L * H))
    assert f.total == expected
    assert f.lm_head == 6 * H * V


def test_parameter_count_gpt3():
    # Per layer: 12 h^2 weights + 13 h (qkv bias 3h, proj bias h, fc1 bias 4h, fc2 bias h,
    # two LayerNorms 4h) = 1,811,939,328 + 159,744 = 1,812,099,072; x 96 = 173,961,510,912.
    # Tied embedding V h = 51,200 x 12,288 = 629,145,600 (51200 = 400 x 128: no padding at tp 1),
    # rotary positions: no parameters; final LayerNorm 2h = 24,576.
    # Total 174,590,681,088: the familiar "175B".
    assert count_parameters(GPT3) == 173_961_510_912 + 629_145_600 + 24_576
    assert count_parameters(GPT3) == 174_590_681_088
    # The parallel block shares one LayerNorm: 2h fewer per layer.
    parallel = dataclasses.replace(GPT3, parallel_block=True)
    assert count_parameters(GPT3) - count_parameters(parallel) == 96 * 2 * H
    # GPT-2's 50,257 tokens pad to 51,200 rows at tp 8 (a multiple of 1024), as in the
    # megascale-175b preset: the same count as V = 51200. At tp 1 (a multiple of 128) they pad to
    # 50,304 rows only: 896 rows fewer.
    gpt2_vocab = dataclasses.replace(GPT3, vocab_size=50_257)
    assert count_parameters(gpt2_vocab, 8) == 174_590_681_088
    assert count_parameters(gpt2_vocab) == 174_590_681_088 - (51_200 - 50_304) * H


def test_padded_vocab():
    assert padded_vocab(256) == 256 and padded_vocab(257) == 384 and padded_vocab(1) == 128
    assert (
        padded_vocab(256, 2) == 256 and padded_vocab(256, 4) == 512 and padded_vocab(257, 2) == 512
    )
    assert padded_vocab(50_257, 8) == 51_200 and padded_vocab(50_257, 3) == 50_304


def test_parameter_count_tiny_by_hand():
    # h = 8, 2 heads, 1 query group (d = 4), f = 16 SwiGLU, 2 layers, s = 5, V = 11.
    # qkv: 8 * (8 + 2*4) + 16 = 144; proj: 64 + 8 = 72; fc1: 8 * 32 + 32 = 288; fc2: 16 * 8 + 8
    # = 136; norms 2 * 16 = 32. Layer = 672; two layers 1344; + the embedding, V = 11 padded to
    # 128 rows: 128 * 8 = 1024 (256 rows, 2048, at tp 2) + final LayerNorm 16. No positions.
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=8,
        num_heads=2,
        num_query_groups=1,
        ffn_hidden_size=16,
        seq_length=5,
        vocab_size=11,
        swiglu=True,
    )
    assert count_parameters(cfg) == 1344 + 1024 + 16
    assert count_parameters(cfg, 2) == 1344 + 2048 + 16
    # The real model is checked against this in tests/unit/test_model_params.py.


def test_bad_shapes_name_the_field():
    with pytest.raises(ValueError, match="model.hidden_size=10 must be a multiple of "):
        flops_per_token(ModelConfig(hidden_size=10, num_heads=4))
    with pytest.raises(ValueError, match="model.num_query_groups=3 must divide"):
        flops_per_token(ModelConfig(num_query_groups=3))


def test_mfu_megascale_175b_at_12288_gpus():
    # MegaScale (NSDI'24): 1.984M tokens/s on 12,288 A100s (dense bf16 312 TFLOP/s) = 55.2% MFU.
    # (1.984M = 6144 samples x 2048 tokens / 6.34 s, rounded.) Peak: 12,288 x 312e12 =
    # 3.833856e18 FLOP/s.
    #   dense s*s convention: 1.984e6 x 1,076,442,955,776 = 2.1357e18 -> 55.71%
    #   our causal count:     1.984e6 x 1,061,954,519,040 = 2.1069e18 -> 54.96%
    #   6N rule of thumb:     1.984e6 x 1,043,677,052,928 = 2.0707e18 -> 54.01%
    # The paper's 55.2% lies between the two attention conventions; it does not publish its exact
    # formula or vocabulary padding, the throughput is rounded, and if its run used sliding-window
    # attention the attention work actually done was smaller still. We do not force agreement.
    peak = lookup_peak("A100")[1]
    dense = flops_per_token(GPT3, dense_attention=True).total
    causal = flops_per_token(GPT3).total
    assert mfu(1.984e6, 12_288, dense, peak) == pytest.approx(0.55705, abs=1e-5)
    assert mfu(1.984e6, 12_288, causal, peak) == pytest.approx(0.54956, abs=1e-5)
    assert mfu(1.984e6, 12_288, 72 * LH2, peak) == pytest.approx(0.54010, abs=1e-5)
    assert abs(mfu(1.984e6, 12_288, causal, peak) - 0.552) < 0.01


def test_mfu_arithmetic_and_errors():
    # 1000 tokens/s x 1e12 FLOP/token = 1e15 FLOP/s over 2 GPUs x 1000 TFLOP/s = 50%.
    assert mfu(1000, 2, 1e12, 1000) == 0.5
    with pytest.raises(ValueError, match="n_gpus >= 1"):
        mfu(1000, 0, 1e12, 1000)


@pytest.mark.parametrize(
    ("name", "key", "peak"),
    [
        ("H100", "H100 SXM", 989),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989),
        ("h100-sxm5-80gb", "H100 SXM", 989),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756),
        ("NVIDIA H200", "H200", 989),
        ("NVIDIA A100-SXM4-80GB", "A100", 312),
        ("NVIDIA A100 80GB PCIe", "A100", 312),
        ("NVIDIA L40S", "L40S", 362),
        ("NVIDIA B200", "B200", 2250),
    ],
)
def test_lookup_peak(name, key, peak):
    assert lookup_peak(name) == (key, peak)


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA H100 NVL", "V100", "GB200", "MI300X"])
def test_unknown_gpu_lists_accepted_names(name):
    with pytest.raises(ValueError) as e:
        lookup_peak(name)
    msg = str(e.value)
    assert repr(name) in msg and "--peak-tflops" in msg
    for key, value in PEAK_TFLOPS.items():
        assert f"{key} ({value:g})" in msg


def test_peak_table_is_dense_bf16():
    assert PEAK_TFLOPS["H100 SXM"] == 989 and PEAK_TFLOPS["A100"] == 312
    assert PEAK_TFLOPS["H200"] == 989 and PEAK_TFLOPS["H100 PCIe"] == 756


def test_report_names_the_peak_and_gives_mfu():
    text = mfu_report(GPT3, 1.984e6, 12_288, None, "NVIDIA A100-SXM4-80GB")
    assert "A100 dense bf16 312 TFLOP/s" in text
    assert "parameters: 174,590,681,088" in text
    assert "MFU: 55.0% (55.7% with the dense s*s attention convention)" in text
    assert "activation recomputation not counted" in text
    for label in ("qkv projection", "attention QK^T", "attention AV", "mlp", "lm head", "total"):
        assert label in text
    override = mfu_report(GPT3, 1.984e6, 12_288, 500.0, None)
    assert "peak: --peak-tflops 500" in override and "MFU: 34.3%" in override
    assert "MFU" not in mfu_report(GPT3, None, 1, None, None)
    assert "MFU: needs a peak" in mfu_report(GPT3, 1e6, 8, None, None)


def test_report_counts_the_padded_vocabulary_of_its_tp():
    gpt2_vocab = dataclasses.replace(GPT3, vocab_size=50_257)
    at_tp8 = mfu_report(gpt2_vocab, None, 1, None, None, tp=8)
    assert "vocab 50257 (embedding padded to 51200 rows for tp 8)" in at_tp8
    assert "parameters: 174,590,681,088" in at_tp8
    # Outside the embeddings: the same at any tp (the padding is all in the embedding).
    outside = f"{174_590_681_088 - 51_200 * H:,} outside the embeddings"
    assert outside in at_tp8 and outside in mfu_report(gpt2_vocab, None, 1, None, None)

    # The FLOPs use the unpadded vocabulary whatever tp is: the same breakdown lines.
    def flop_lines(text):
        return [line for line in text.splitlines() if line.startswith("  ")]

    assert flop_lines(at_tp8) == flop_lines(mfu_report(gpt2_vocab, None, 1, None, None))
    assert "lm head" in "".join(flop_lines(at_tp8))


def test_cli_run(capsys, caplog):
    parser = argparse.ArgumentParser()
    F.add_arguments(parser)
    args = parser.parse_args(
        ["tiny", "--set", "model.num_layers=2", "--tokens-per-s", "1e6", "--peak-tflops", "100"]
    )
    assert F.run(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: 2 layers") and "peak: --peak-tflops 100" in out
    expected = mfu(
        1e6, 1, flops_per_token(config.load("tiny", ["model.num_layers=2"]).model).total, 100
    )
    assert f"MFU: {100 * expected:.1f}%" in out
    assert F.run(parser.parse_args(["tiny", "--gpu", "L40"])) == 1
    assert "unknown GPU name 'L40'" in caplog.text
    with pytest.raises(SystemExit):  # --gpu and --peak-tflops exclude each other
        parser.parse_args(["--gpu", "H100", "--peak-tflops", "1"])
