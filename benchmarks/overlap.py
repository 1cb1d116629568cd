"""Communication/computation overlap: step time and communication per dimension with each overlap
off vs on, for the serial and the parallel block, measured in one run.

Every collective and p2p call is priced by a cost model and run on a communication thread
(``megascale.overlap.trace.CommTrace``; what each call did is read from an in-memory flight
recorder outside it), so communication is costly relative to compute on CPU:

* ``--cost bytes`` (default; CPU only): alpha + bytes / beta per link class (TP in the node, DP
  and PP across nodes) of a named fabric (``--fabric``, default H100 + NVLink 4 + 8x400 Gb/s), in
  GPU seconds scaled by the GPU's peak over the GEMM rate every rank measures here at once, so the
  communication/computation ratio of the layout matches the same shapes on the GPU. The latency
  term is scaled by the per-GEMM FLOPs of these shapes over those of the ``megascale-175b`` layout
  (a call's latency does not shrink with the shapes).
* ``--cost fixed``: the same latency for every call (``--latency-ms``); the only model with
  ``--device cuda``, where ``--latency-ms 0`` leaves the real NCCL links alone.

The default layout is ``megascale-175b``'s scaled down to 8 CPU ranks: TP2 x PP2 (VPP2) x DP2 +
sequence parallelism (175B: TP8 x PP8 (VPP6) x DP192 + SP), two micro-batches per pipeline stage and
DP rank. PP exposure is counted from both ends of each message (``megascale.overlap.pp_exposure``:
the part of its modelled transfer during which its receiver or sender waited); the receiver-side
bound is printed beside it ("PP bound"). Variants alternate within each round (noise lands on all
alike) and train the same steps from the same parameters, so their losses must match ("max loss
diff vs off").

    python benchmarks/overlap.py                       # bytes model, serial + parallel block
    python benchmarks/overlap.py --cost fixed --latency-ms 20
    python benchmarks/overlap.py --json                # one JSON object
    python benchmarks/overlap.py --breakdown           # + each dimension by kind and size of call
    python benchmarks/overlap.py --shapes 175b-tp      # TP bytes per FLOP of megascale-175b
    python benchmarks/overlap.py --shapes 175b --steps 1   # + its micro-batches per stage, DP
                                                           # buckets per chunk, 8 TP chunks
    python benchmarks/overlap.py --shapes 175b-dp --steps 1   # its DP bytes per FLOP (hidden 256)
    python benchmarks/overlap.py --device cuda --cost fixed --latency-ms 0   # 8 GPUs, real links
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import megatron.core  # noqa: F401  (import once, before forking the ranks)

from megascale.config import JobConfig, load, validate
from megascale.data.corpus import default_token_file
from megascale.launcher.local import run_local
from megascale.overlap.cost import FABRICS
from megascale.overlap.measure import measure_rank, with_overlap
from megascale.probes.flops import VOCAB_PAD_MULTIPLE, padded_vocab

DEFAULT_SETS = [
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.vpp=2",
    "parallel.sequence_parallel=true",
    "parallel.distributed_optimizer=true",
    "parallel.batch_p2p_comm=false",
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_heads=4",
    "model.seq_length=256",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "optim.warmup_steps=0",
    "overlap.bucket_size=40000",
]
VARIANTS = {
    "off": {"dp": False, "pp": False, "tp": False},
    "dp only": {"dp": True, "pp": False, "tp": False},
    "pp only": {"dp": False, "pp": True, "tp": False},
    "tp only": {"dp": False, "pp": False, "tp": True},
    "all on": {"dp": True, "pp": True, "tp": True},
}
LINKS = ("tp", "pp", "dp")


def _args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--cost", choices=("bytes", "fixed"), default="bytes")
    parser.add_argument("--fabric", choices=sorted(FABRICS), default="h100-nvlink4-8x400g")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="--cost fixed only")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default="off,all on", help=f"of: {', '.join(VARIANTS)}")
    parser.add_argument("--blocks", default="serial,parallel")
    parser.add_argument(
        "--shapes",
        choices=("small", "175b-tp", "175b", "175b-dp"),
        default="small",
        help="small: hidden 256, seq 256, mbs 4; 175b-tp: the hidden size whose TP bytes per "
        "FLOP is megascale-175b's (seq 256, mbs 1, gbs 4); 175b: that hidden size (seq 128) "
        "with megascale-175b's micro-batches per stage, DP buckets per chunk and 8 TP chunks; "
        "175b-dp: megascale-175b's tokens per DP rank and step at hidden 256; --set overrides",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="after the table: each dimension's communication by kind and size of call",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser.parse_args(argv)


def gemm_flops_per_call(job: JobConfig) -> float:
    """FLOPs of one QKV GEMM of one micro-batch on one GPU (the per-call compute the latency of a
    TP collective is measured against)."""
    m = job.model
    return 2.0 * m.seq_length * job.train.micro_batch_size * m.hidden_size**2 * 3 / job.parallel.tp


def tp_bytes_per_flop(job: JobConfig) -> float:
    """TP/SP bytes each GPU sends per FLOP it computes in one transformer layer's forward: the
    sequence-parallel all-gathers and reduce-scatters move ``(tp-1)/tp`` of an ``[s, b, h]``
    16-bit tensor each (two per layer in the parallel block, four in the serial one: the ratio
    below is the serial block's; the parallel block's is half of it at any shape) against the
    layer's GEMM and attention FLOPs divided by ``tp``. The backward doubles both sides alike."""
    m, tp = job.model, job.parallel.tp
    tokens = m.seq_length * job.train.micro_batch_size
    sent = 4 * (tp - 1) / tp * tokens * m.hidden_size * 2
    flops = (24 * tokens * m.hidden_size**2 + 4 * tokens * m.seq_length * m.hidden_size) / tp
    return sent / flops


def matched_shape_sets(job: JobConfig, reference: JobConfig) -> list[str]:
    """``--shapes 175b-tp``: the hidden size whose TP bytes per FLOP is ``reference``'s at
    ``job``'s TP degree (``(tp-1) / h`` held equal, rounded to a multiple of 64), on short
    sequences and one-sample micro-batches so the larger GEMMs still run in seconds on a CPU."""
    tp, ref_tp = job.parallel.tp, reference.parallel.tp
    if tp < 2:
        raise SystemExit(f"--shapes 175b-tp: parallel.tp={tp}; needs tp >= 2 (TP communication)")
    hidden = reference.model.hidden_size * (tp - 1) / (ref_tp - 1)
    hidden = max(64, round(hidden / 64) * 64)
    return [
        f"model.hidden_size={hidden}",
        "model.seq_length=256",
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
    ]


REFERENCE_WORLD = 12288
"""GPUs of the ``megascale-175b`` run (its preset's header): DP = 12288 / (TP8 x PP8) = 192."""


def chunk_params(job: JobConfig) -> float:
    """Transformer parameters of one model chunk on one GPU (attention 4h^2 + MLP 2h x ffn per
    layer, over TP; norms, biases and embeddings left out)."""
    m, p = job.model, job.parallel
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    layers = m.num_layers / (p.pp * p.vpp)
    return layers * (4 * m.hidden_size**2 + 2 * m.hidden_size * ffn) / p.tp


def microbatches_per_stage(job: JobConfig, dp: int) -> float:
    t = job.train
    return t.global_batch_size / (dp * t.micro_batch_size) / job.parallel.pp


def _bucket_sets(job: JobConfig, reference: JobConfig, changes: dict) -> str:
    """``overlap.bucket_size`` giving ``job`` (with ``changes`` to its model) ``reference``'s DP
    buckets per model chunk under megatron-core's default bucket at the reference's DP (max(40M,
    1M x DP192) = 192M parameters against 453M per chunk at 175B: 2.4 buckets)."""
    ref_dp = REFERENCE_WORLD // (reference.parallel.tp * reference.parallel.pp)
    per_chunk = chunk_params(reference) / max(40_000_000, 1_000_000 * ref_dp)
    here = dataclasses.replace(job, model=dataclasses.replace(job.model, **changes))
    return f"overlap.bucket_size={max(1, round(chunk_params(here) / per_chunk))}"


def _reference_microbatches(reference: JobConfig) -> float:
    ref_dp = REFERENCE_WORLD // (reference.parallel.tp * reference.parallel.pp)
    return microbatches_per_stage(reference, ref_dp)


def layers_per_chunk(job: JobConfig) -> float:
    return job.model.num_layers / (job.parallel.pp * job.parallel.vpp)


def output_bytes_per_flop(job: JobConfig) -> float:
    """The output layer's TP bytes per FLOP: its sequence-parallel all-gather moves ``(tp-1)/tp``
    of an ``[s, b, h]`` 16-bit tensor against a GEMM of ``s b h`` x the vocabulary over ``tp``."""
    m, tp = job.model, job.parallel.tp
    tokens = m.seq_length * job.train.micro_batch_size
    sent = (tp - 1) / tp * tokens * m.hidden_size * 2
    return sent / (2 * tokens * m.hidden_size * padded_vocab(m.vocab_size, tp) / tp)


def preset_175b_sets(job: JobConfig, reference: JobConfig, dp: int) -> list[str]:
    """``--shapes 175b``: ``reference``'s TP bytes per FLOP (``matched_shape_sets``'s hidden size,
    on 128-token one-sample micro-batches) in the layers and in the output layer (its vocabulary
    over TP, ``(tp-1) / vocab`` held equal), its layers per model chunk (2), its micro-batches per
    pipeline stage (32 per DP rank over PP8: 4), its DP buckets per model chunk, and 8 TP chunks.
    Not its DP bytes per FLOP: that needs its 65,536 tokens per DP rank and step (``--shapes
    175b-dp``)."""
    sets = matched_shape_sets(job, reference)
    hidden = int(sets[0].split("=")[1])
    per_stage = round(_reference_microbatches(reference))
    p, ref_p = job.parallel, reference.parallel
    layers = round(layers_per_chunk(reference)) * p.pp * p.vpp
    multiple = VOCAB_PAD_MULTIPLE * p.tp
    vocab = padded_vocab(reference.model.vocab_size, ref_p.tp) * (p.tp - 1) / (ref_p.tp - 1)
    changes = [
        *sets,  # later settings of the same field win
        "model.seq_length=128",
        f"model.num_layers={layers}",
        f"model.vocab_size={max(1, round(vocab / multiple)) * multiple}",
        f"train.global_batch_size={per_stage * p.pp * dp}",
        _bucket_sets(job, reference, {"hidden_size": hidden, "num_layers": layers}),
        "overlap.tp_chunks=8",
    ]
    return [f"{k}={v}" for k, v in dict(c.split("=", 1) for c in changes).items()]


def preset_175b_dp_sets(job: JobConfig, reference: JobConfig, dp: int) -> list[str]:
    """``--shapes 175b-dp``: ``reference``'s DP bytes per FLOP (its tokens per DP rank and step,
    32 x 2048 = 65,536) at the default hidden size, with its micro-batches per pipeline stage and
    its DP buckets per model chunk: large micro-batches of 256-token samples."""
    ref = reference.train
    ref_dp = REFERENCE_WORLD // (reference.parallel.tp * reference.parallel.pp)
    tokens = ref.global_batch_size // ref_dp * reference.model.seq_length
    microbatches = round(_reference_microbatches(reference)) * job.parallel.pp
    mbs = max(1, tokens // (microbatches * job.model.seq_length))
    return [
        f"train.micro_batch_size={mbs}",
        f"train.global_batch_size={mbs * microbatches * dp}",
        _bucket_sets(job, reference, {}),
    ]


SHAPES = {
    "175b-tp": lambda job, ref, _dp: matched_shape_sets(job, ref),
    "175b": preset_175b_sets,
    "175b-dp": preset_175b_dp_sets,
}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.device == "cuda" and args.cost == "bytes":
        raise SystemExit(
            "--cost bytes with --device cuda: the bytes model is calibrated on the CPU's GEMM rate "
            "and would add modelled delays to real NCCL links; use --cost fixed (--latency-ms 0 "
            "for the links alone)"
        )
    shape_sets: list[str] = []
    if args.shapes != "small":
        pre = load(args.config, [*DEFAULT_SETS, f"train.device={args.device}", *args.overrides])
        pre_dp = args.nproc // (pre.parallel.tp * pre.parallel.pp)
        shape_sets = SHAPES[args.shapes](pre, load("megascale-175b"), pre_dp)
    base = load(
        args.config,
        [*DEFAULT_SETS, *shape_sets, f"train.device={args.device}", *args.overrides],
    )
    backend = "nccl" if args.device == "cuda" else "gloo"
    names = [n.strip() for n in args.variants.split(",")]
    blocks = [b.strip() for b in args.blocks.split(",")]
    unknown = [n for n in names if n not in VARIANTS] + [
        b for b in blocks if b not in ("serial", "parallel")
    ]
    if unknown:
        raise SystemExit(
            f"--variants/--blocks: {unknown} unknown; variants: {list(VARIANTS)}, "
            "blocks: serial, parallel"
        )
    variants = {}
    for block in blocks:
        job = load(
            args.config,
            [
                *DEFAULT_SETS,
                *shape_sets,
                f"train.device={args.device}",
                f"model.parallel_block={block == 'parallel'}".lower(),
                *args.overrides,
            ],
        )
        for n in names:
            variants[f"{block}/{n}"] = validate(
                with_overlap(job, **VARIANTS[n]), args.nproc, backend
            )
    alpha_scale = min(1.0, gemm_flops_per_call(base) / gemm_flops_per_call(load("megascale-175b")))
    data_dir = Path(tempfile.mkdtemp(prefix="megascale-bench-"))
    default_token_file(data_dir)
    rank_fn = functools.partial(
        measure_rank,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        latency_s=args.latency_ms / 1e3,
        fabric=args.fabric if args.cost == "bytes" else None,
        alpha_scale=alpha_scale,
    )
    per_rank = run_local(rank_fn, args.nproc, (variants, data_dir), timeout_s=3600)
    summary = summarize(per_rank)
    if args.json:
        print(json.dumps({"command": " ".join(sys.argv), "layout": _layout(args, base), **summary}))
    else:
        print(report(args, base, summary))
    return 0


def _median_mean(per_rank, key: str, link: str, field: str, default: str = "") -> float:
    """Median over steps of the mean over ranks of ``by_link[link][field]`` (or ``default``'s)."""

    def value(result, i: int) -> float:
        d = result[key][i]["by_link"].get(link, {})
        return d.get(field, d.get(default, 0.0))

    steps = range(len(per_rank[0][key]))
    return statistics.median(statistics.fmean(value(r, i) for r in per_rank) for i in steps)


def _by_call(per_rank, key: str, link: str) -> dict[str, dict[str, float]]:
    """Per kind and size of call on ``link``: calls, modelled and exposed seconds per step, each
    the mean over ranks and steps (a rank without such calls counts 0), most exposed first."""
    rows = [row for result in per_rank for row in result[key]]
    totals: dict[str, list[float]] = {}
    for row in rows:
        for name, values in row["by_call"].get(link, {}).items():
            totals.setdefault(name, [0.0, 0.0, 0.0])
            for i, v in enumerate(values):
                totals[name][i] += v / len(rows)
    ranked = sorted(totals.items(), key=lambda item: -item[1][2])
    return {
        name: {"calls": n, "comm_s": comm, "exposed_comm_s": exposed}
        for name, (n, comm, exposed) in ranked
    }


def summarize(per_rank: list[dict]) -> dict:
    """Per block and variant: step time (median over steps of the slowest rank), and per
    dimension the modelled communication and the exposed part (medians over steps of the mean over
    ranks); hidden = 1 - exposed / comm; loss difference from the block's "off"."""
    out: dict = {"cost_model": per_rank[0][next(iter(per_rank[0]))][0]["cost_model"], "blocks": {}}
    for key in per_rank[0]:
        block, name = key.split("/", 1)
        steps = range(len(per_rank[0][key]))
        row = {
            "step_time_s": statistics.median(
                max(r[key][i]["time_s"] for r in per_rank) for i in steps
            )
        }
        for link in LINKS:
            comm = _median_mean(per_rank, key, link, "comm_s")
            exposed = _median_mean(per_rank, key, link, "exposed_s")
            row[link] = {"comm_s": comm, "exposed_comm_s": exposed}
            if link == "pp":  # both ends of each message; the receiver-side bound beside it
                row[link]["exposed_comm_s"] = _median_mean(
                    per_rank, key, link, "exposed_paired_s", "exposed_s"
                )
                row[link]["exposed_bound_s"] = exposed
                row[link]["hidden_bound"] = 1 - exposed / comm if comm > 0 else None
            hidden = 1 - row[link]["exposed_comm_s"] / comm if comm > 0 else None
            row[link]["hidden"] = hidden
            row[link]["by_call"] = _by_call(per_rank, key, link)
        ref = per_rank[0].get(f"{block}/off", per_rank[0][key])
        row["max_loss_diff_vs_off"] = max(
            abs(a["loss"] - b["loss"]) / abs(b["loss"])
            for a, b in zip(per_rank[0][key], ref, strict=True)
        )
        out["blocks"].setdefault(block, {})[name] = row
    for rows in out["blocks"].values():
        off = rows.get("off")
        for row in rows.values():
            row["vs_off"] = row["step_time_s"] / off["step_time_s"] if off else None
    return out


def _layout(args, base) -> str:
    p, m, t = base.parallel, base.model, base.train
    return (
        f"{args.nproc} {'GPU ranks (nccl)' if args.device == 'cuda' else 'CPU ranks (gloo)'}, "
        f"TP{p.tp} x PP{p.pp} (VPP{p.vpp}) x DP{args.nproc // (p.tp * p.pp)}, "
        f"sequence_parallel={p.sequence_parallel}; {m.num_layers} layers, hidden {m.hidden_size}, "
        f"seq {m.seq_length}, gbs {t.global_batch_size}, mbs {t.micro_batch_size}; "
        f"TP bytes/FLOP {tp_bytes_per_flop(base):.2e} "
        f"(megascale-175b: {tp_bytes_per_flop(load('megascale-175b')):.2e})"
    )


def report(args, base, summary: dict) -> str:
    lines = [
        f"# overlap benchmark — {datetime.date.today()}",
        f"command: {' '.join(sys.argv)}",
        f"layout: {_layout(args, base)}",
        f"cost model: {json.dumps(summary['cost_model'])}",
        "step time: median over steps of the slowest rank; comm / exposed: modelled communication "
        "and the part the caller waited for, per dimension, median over steps of the rank mean",
        "PP exposed: the part of each message's modelled transfer during which its receiver or "
        "sender waited (pipeline bubbles excluded); PP bound: the receiver-side bound (each "
        "receive's wait up to the message's cost, bubbles included)",
        "",
        "| block | variant | step time (s) | vs off | TP/SP comm / exposed (s) | hidden "
        "| PP comm / exposed (s) | hidden | PP bound: exposed (s) | hidden "
        "| DP comm / exposed (s) | hidden | loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # Over NCCL the communication is real, not modelled, and a wait() does not block the host:
    # neither "comm" nor "exposed" is measured there; only the step times compare.
    modelled = args.device != "cuda"
    if not modelled:
        lines.insert(
            -3,
            "comm / exposed / hidden: not measured over NCCL (real links, not modelled, and "
            "wait() does not block the host): compare the step times",
        )
    for block, rows in summary["blocks"].items():
        for name, row in rows.items():
            vs_off = "-" if row["vs_off"] is None else f"{row['vs_off']:.2f}x"  # no "off" run
            cells = [block, name, f"{row['step_time_s']:.3f}", vs_off]
            for link in LINKS:
                d = row[link]
                if not modelled:
                    cells += ["n/a", "n/a", "n/a", "n/a"] if link == "pp" else ["n/a", "n/a"]
                    continue
                cells.append(f"{d['comm_s']:.3f} / {d['exposed_comm_s']:.3f}")
                cells.append("-" if d["hidden"] is None else f"{d['hidden']:.0%}")
                if link == "pp":
                    cells.append(f"{d['exposed_bound_s']:.3f}")
                    cells.append("-" if d["hidden_bound"] is None else f"{d['hidden_bound']:.0%}")
            cells.append(f"{row['max_loss_diff_vs_off']:.1e}")
            lines.append("| " + " | ".join(cells) + " |")
    if args.breakdown:
        lines += _breakdown(summary)
    return "\n".join(lines)


def _breakdown(summary: dict) -> list[str]:
    """Per block, variant and dimension, where its communication and exposure come from."""
    lines = [
        "",
        "By kind and size of call (per step, mean over ranks; most exposed first):",
        "",
        "| block | variant | dim | call | calls | comm (s) | exposed (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for block, rows in summary["blocks"].items():
        for name, row in rows.items():
            for link in LINKS:
                for call, d in row[link]["by_call"].items():
                    lines.append(
                        f"| {block} | {name} | {link} | {call} | {d['calls']:.1f} "
                        f"| {d['comm_s']:.3f} | {d['exposed_comm_s']:.3f} |"
                    )
    return lines


if __name__ == "__main__":
    sys.exit(main())
