"""The stall analysis on real stalls: every (layout, rank, way a rank stops) names that rank and
no other.

Each cell is one short real run (``stall_cells.stall``: ranks forked from this process, the fault
injected before step 2, the flight files read from outside once nothing moves), so the matrix
costs ~2 s a cell. The layouts are the ones whose waits differ: tensor, pipeline (interleaved
too) and data parallel alone and combined, sequence parallel, and the distributed optimizer with
and without its overlapped gathers (``overlap.dp``), and a plain DDP. The test prints the matrix
and its score; a failing cell shows what the analysis named and each rank's state.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from stall_cells import KINDS, Layout, stall

from megascale.probes.flight.culprits import analyse_stall

pytestmark = pytest.mark.slow

LAYOUTS = (
    Layout("TP2xDP2", tp=2),
    Layout("DP4"),
    Layout("TP4", tp=4),
    Layout("PP2xDP2", pp=2),
    Layout("PP4", pp=4),
    Layout("TP2xPP2xDP2", tp=2, pp=2, world=8),
    Layout("PP2xVPP2xDP2", pp=2, vpp=2),
    Layout("TP2xDP2+SP", tp=2, sp=True),
    Layout("TP2xPP2xDP2+SP", tp=2, pp=2, sp=True, world=8),
    Layout("TP2xDP2 no overlap", tp=2, overlap_dp=False),
    Layout("DP4 DDP", distributed_optimizer=False),
)


def _verdict(states, rank: int, kind: str) -> str:
    """ "" when the analysis names ``rank`` alone, for the right reason; else what went wrong."""
    analysis = analyse_stall(states)
    named = [(c.rank, c.reason) for c in analysis.culprits]
    expected = {
        # its host blocks on a result: waiting for a queued op, or before issuing the awaited one
        "hang-comm": {"not-started", "not-entered"},
        "hang-worker": {"stopped"},
        "mismatch-comm": {"mismatch"},
        "hang-host": {"not-entered"},
    }[kind]
    if [r for r, _ in named] == [rank] and named[0][1] in expected:
        return ""
    undecided = [u.describe() for u in analysis.undecided]
    blocked = {
        r: [(st.groups[o.group].label, o.seq, o.kind.name, o.device.name) for o in st.blocked]
        for r, st in states.items()
    }
    return f"named {named}, undecided {undecided}; blocked: {blocked}"


def test_every_cell_of_the_matrix_names_the_stopped_rank_alone(tmp_path, data_dir):
    _matrix(LAYOUTS, True, tmp_path, data_dir)


def test_in_the_blocking_gloo_mode_too(tmp_path, data_dir):
    # the host call is the op there (untracked device states): the host view alone decides
    _matrix((Layout("TP2xDP2", tp=2),), False, tmp_path, data_dir)


def _matrix(layouts, nccl_like: bool, tmp_path, data_dir) -> None:
    """Run every cell of ``layouts``, print the matrix and its score, and fail with each wrong
    cell's evidence. NCCL-like cells run two side by side (a cell idles while its stall
    settles); blocking gloo's ranks wait in gloo, which side by side slows both cells down."""
    started = time.monotonic()
    cells = [
        (layout, kind, rank)
        for layout in layouts
        for kind, rank in itertools.product(KINDS, range(layout.world))
    ]

    def run(cell) -> str:
        layout, kind, rank = cell
        run_dir = tmp_path / f"{layout.name}-{kind}-{rank}".replace(" ", "_")
        return _verdict(stall(layout, rank, kind, data_dir, run_dir, nccl_like), rank, kind)

    with ThreadPoolExecutor(max_workers=2 if nccl_like else 1) as pool:
        verdicts = dict(zip(cells, pool.map(run, cells), strict=True))
    wrong = {f"{c[0].name} {c[1]} rank {c[2]}": why for c, why in verdicts.items() if why}
    rows = [
        f"  {layout.name:<20} "
        + "".join(
            "X" if verdicts[(layout, k, r)] else "."
            for k, r in itertools.product(KINDS, range(layout.world))
        )  # fmt: skip
        for layout in layouts
    ]
    mode = "NCCL-like" if nccl_like else "blocking gloo"
    print(
        f"\nstall matrix, {mode} ({', '.join(KINDS)}; a mark per rank, '.' named alone, 'X' not):\n"
        + "\n".join(rows)
        + f"\n{len(cells) - len(wrong)}/{len(cells)} cells named correctly in "
        + f"{time.monotonic() - started:.0f} s"
    )
    assert not wrong, "\n".join(f"{cell}: {why}" for cell, why in wrong.items())
