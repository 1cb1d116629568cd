"""How much pipeline communication 1F1B can hide at best: its schedule run on an ideal machine.

Each stage runs megatron-core's order — plain 1F1B (warm-up forwards, one forward and one backward
per micro-batch, cool-down backwards) or interleaved 1F1B (model chunks, its schedule table and
warm-up) — with what megascale's PP overlap gives it: sends never waited for, each receive posted
ahead. Compute is exact (a model chunk's forward takes 1, its backward 2), every message takes
``T`` on the wire, nothing else costs anything. The events are then counted by the benchmark's own
measure (``megascale.overlap.pp_exposure.paired_exposure``: the part of a message's transfer during
which its receiver waited).

What it shows: a message is exposed whenever its receiver is already waiting for it — on the
pipeline's critical path — however short the transfer, so the best case depends on the schedule's
shape, not on bandwidth. In plain 1F1B's steady phase every receive a stage waits for is produced
by its neighbour from the message this stage sent one compute step before (a round trip per
micro-batch on the critical path): at most ~50% hides, whatever the micro-batch count.
Interleaving keeps more micro-batches in flight per stage and breaks that cycle; only its fill and
drain stay exposed, a share that shrinks with the micro-batches per step.

    python benchmarks/pp_schedule_bound.py [--transfer T]
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

from megascale.overlap.pp_exposure import paired_exposure


def schedule(stages: int, microbatches: int, chunks: int = 1) -> list[list[tuple[str, int, int]]]:
    """Each stage's compute order as megatron-core runs it: (``"F"`` or ``"B"``, model chunk,
    micro-batch). ``chunks = 1``: plain 1F1B; more: interleaved 1F1B with the default group of
    ``stages`` micro-batches per model chunk. The warm-up counts and the interleaved table are
    megatron-core's own (``get_pp_rank_microbatches``, ``get_schedule_table``)."""
    table = get_schedule_table(microbatches, chunks, stages)
    order = []
    for s in range(stages):
        group = SimpleNamespace(size=lambda: stages, rank=lambda s=s: s)
        pipeline = SimpleNamespace(
            pp_group=group, virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None
        )
        total, _, warmup, _ = get_pp_rank_microbatches(
            microbatches, chunks, stages, p2p_communicator=pipeline
        )

        def forward(k):
            return ("F", table[k][1], table[k][0])

        def backward(k):
            return ("B", chunks - 1 - table[k][1], table[k][0])

        ops = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [forward(k + warmup), backward(k)]
        ops += [backward(k) for k in range(total - warmup, total)]
        order.append(ops)
    return order


def run(stages: int, microbatches: int, transfer: float, chunks: int = 1) -> tuple:
    """Simulate one step (a chunk's forward takes 1, its backward 2); (per-rank events as the trace
    records them, step time)."""
    order = schedule(stages, microbatches, chunks)
    last = stages * chunks - 1  # the last global stage: its backward starts from the loss
    done: dict[tuple[int, str, int, int], float] = {}
    clock, position = [0.0] * stages, [0] * stages
    events: list[list[dict]] = [[] for _ in range(stages)]
    while any(position[s] < len(order[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(order[s]):
                kind, chunk, i = order[s][position[s]]
                stage = chunk * stages + s  # the global pipeline stage
                source = stage - 1 if kind == "F" else stage + 1
                start = clock[s]
                if 0 <= source <= last:  # needs the neighbour's activation / gradient
                    peer, peer_chunk = source % stages, source // stages
                    if (peer, kind, peer_chunk, i) not in done:
                        break
                    sent = done[(peer, kind, peer_chunk, i)]
                    arrives = sent + transfer
                    message = {"nbytes": 1, "cost_s": transfer, "transfer_start": sent}
                    events[peer].append({"kind": "isend", "peer": s, "issued": sent, **message})
                    waited = {"wait_start": clock[s], "wait_end": max(clock[s], arrives)}
                    events[s].append(
                        {"kind": "irecv", "peer": peer, "issued": 0.0, **message, **waited}
                    )
                    start = max(clock[s], arrives)
                clock[s] = start + (1.0 if kind == "F" else 2.0)
                done[(s, kind, chunk, i)] = clock[s]
                position[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule deadlocked")
    return events, max(clock)


def hidden_share(stages: int, microbatches: int, transfer: float, chunks: int = 1) -> float:
    events, _ = run(stages, microbatches, transfer, chunks)
    messages = sum(1 for rank in events for e in rank if e["kind"] == "isend")
    return 1 - sum(paired_exposure(events)) / (messages * transfer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfer", type=float, default=0.2, help="T / F (a forward = 1)")
    args = parser.parse_args(argv)
    print(f"ideal machine, message transfer T = {args.transfer} x a chunk's forward compute")
    print("| schedule | stages | model chunks | micro-batches per step | hidden (best case) |")
    print("|---|---|---|---|---|")
    cases = [(2, 1, 2), (2, 1, 8), (2, 1, 32), (8, 1, 32), (2, 2, 8), (2, 2, 32), (8, 6, 32)]
    for stages, chunks, microbatches in cases:
        name = "plain 1F1B" if chunks == 1 else "interleaved 1F1B"
        hidden = hidden_share(stages, microbatches, args.transfer, chunks)
        print(f"| {name} | {stages} | {chunks} | {microbatches} | {hidden:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
