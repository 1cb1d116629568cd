"""How much pipeline communication plain 1F1B can hide at best: its schedule run on an ideal machine.

Each stage runs megatron-core's non-interleaved 1F1B order (warm-up forwards, then one forward and
one backward per micro-batch, then the cool-down backwards) with what ``megascale.overlap.pp``
gives it: sends never waited for, receives posted ahead. Compute is exact (a forward takes ``F``, a
backward ``2F``), every message takes ``T`` on the wire, nothing else costs anything. The events
are then counted by the benchmark's own measure (``megascale.overlap.pp_exposure.paired_exposure``:
the part of a message's transfer during which its receiver waited).

What it shows: in the steady phase every receive a stage waits for is produced by its neighbour
from the message this stage sent one compute step before — a round trip per micro-batch on the
critical path — so that transfer cannot hide behind anything. Only the warm-up's and cool-down's
transfers can. With 8 micro-batches per step at PP2 (4 per stage) 1F1B hides 44% at best,
approaching 50% with many; interleaving (more micro-batches in flight per stage) is what breaks the cycle.

    python benchmarks/pp_1f1b_bound.py
"""

from __future__ import annotations

import argparse
import sys

from megascale.overlap.pp_exposure import paired_exposure


def one_f_one_b(stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """Each stage's compute order: megatron-core's plain 1F1B (forward_backward_pipelining_without_
    interleaving)."""
    order = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        ops = [("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            ops += [("F", warmup + i), ("B", i)]
        ops += [("B", i) for i in range(microbatches - warmup, microbatches)]
        order.append(ops)
    return order


def run(stages: int, microbatches: int, transfer: float, forward: float = 1.0) -> tuple:
    """Simulate one step; (per-rank events as the trace records them, step time)."""
    order = one_f_one_b(stages, microbatches)
    done: dict[tuple[int, str, int], float] = {}
    clock, position = [0.0] * stages, [0] * stages
    events: list[list[dict]] = [[] for _ in range(stages)]
    while any(position[s] < len(order[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(order[s]):
                kind, i = order[s][position[s]]
                peer = s - 1 if kind == "F" else s + 1
                start = clock[s]
                if 0 <= peer < stages:  # needs the neighbour's activation / gradient
                    if (peer, kind, i) not in done:
                        break
                    sent = done[(peer, kind, i)]
                    arrives = sent + transfer
                    message = {"nbytes": 1, "cost_s": transfer, "transfer_start": sent}
                    events[peer].append(
                        {"kind": "isend", "peer": s, "issued": sent, **message}
                    )  # never waited for
                    waited = {"wait_start": clock[s], "wait_end": max(clock[s], arrives)}
                    events[s].append(
                        {"kind": "irecv", "peer": peer, "issued": 0.0, **message, **waited}
                    )
                    start = max(clock[s], arrives)
                clock[s] = start + (forward if kind == "F" else 2 * forward)
                done[(s, kind, i)] = clock[s]
                position[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule deadlocked")
    return events, max(clock)


def hidden_share(stages: int, microbatches: int, transfer: float) -> float:
    events, _ = run(stages, microbatches, transfer)
    messages = 2 * microbatches * (stages - 1)
    return 1 - sum(paired_exposure(events)) / (messages * transfer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfer", type=float, default=0.2, help="T / F (a forward = 1)")
    args = parser.parse_args(argv)
    print(f"plain 1F1B, ideal machine, message transfer T = {args.transfer} x a forward's compute")
    print("| stages | micro-batches per step | hidden (best case) | step time vs no comm |")
    print("|---|---|---|---|")
    for stages, microbatches in ((2, 2), (2, 4), (2, 8), (2, 32), (8, 4), (8, 32)):
        _, with_comm = run(stages, microbatches, args.transfer)
        _, without = run(stages, microbatches, 0.0)
        hidden = hidden_share(stages, microbatches, args.transfer)
        print(f"| {stages} | {microbatches} | {hidden:.0%} | {with_comm / without:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
