"""In-process recovery end to end: real ``megascale launch`` runs on a TP2 x PP2 x DP2 layout
(2 nodes x 4 ranks, and a spare node where the fault loses a node), a fault injected in each.

What each run must show: the healthy ranks kept their processes (their log says they rejoin, with
the pid they had), the state came back from memory (each rank of the next generation restored
the same step from its own memory or a peer's, and no checkpoint was read), and the job finished
with the fault-free run's parameters, bit for bit. The fault-free run is the module's reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megascale.train.checkpoint.storage import step_name
from tests.fault.test_cluster import Run

pytestmark = pytest.mark.slow

STEPS = 16
LAYOUT = [
    "--nodes", "2", "--nproc-per-node", "4", "--set", f"train.steps={STEPS}",
    "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "train.global_batch_size=8",
    "--set", "checkpoint.interval=4",
]  # fmt: skip
RESTORED = re.compile(r"restored step (\d+) from (own memory|rank (\d+)'s memory)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    run = Run(tmp_path_factory.mktemp("in-process-reference"), *LAYOUT)
    assert run.rc == 0, run.output[-6000:]
    return run


def restores(run_dir: Path, generation: int) -> dict[int, tuple[int, str]]:
    """rank -> (step restored, from where) in ``generation``, from the workers' output."""
    found = {}
    for out in sorted((run_dir / "logs").glob("node-*/rank_*.out")):
        rank = int(out.stem.split("_")[1])
        text = out.read_text().split(f"==== megascale generation {generation} rank {rank}")
        if len(text) < 2:
            continue
        match = RESTORED.search(text[1].split("==== megascale generation", 1)[0])
        if match:
            found[rank] = (int(match[1]), match[2])
    return found


def rejoined(run_dir: Path, generation: int) -> set[int]:
    """The ranks whose process joined ``generation`` as it was (their pid kept)."""
    kept = set()
    for out in (run_dir / "logs").glob("node-*/rank_*.out"):
        rank = int(out.stem.split("_")[1])
        if re.search(rf"==== megascale generation {generation} rank {rank} \(rejoins, pid \d+\)",
                     out.read_text()):  # fmt: skip
            kept.add(rank)
    return kept


def check_in_process(run: Run, reference: Run, generation: int, kept: set[int]) -> set[int]:
    """The run finished with the reference's parameters; some of the ranks ``kept`` names (at
    most those) joined ``generation`` in their own processes, and never the failed one. A healthy
    rank may still be killed when it does not pause in time (a peer's teardown freed its groups
    late); then it is a new process. When every rank's snapshot was within reach, each restored
    the same step, the kept ranks from their own memory and the new ones from a peer's, and no
    checkpoint was read. Returns the ranks that rejoined."""
    run.check_recovered(reference, generations=generation, steps=STEPS)
    rejoined_ranks = rejoined(run.dir, generation)
    assert rejoined_ranks and rejoined_ranks <= kept, (rejoined_ranks, kept)
    restored = restores(run.dir, generation)
    resumed = [e for e in run.of("resumed") if e.generation == generation]
    if set(restored) == set(range(8)):
        [step] = {s for s, _ in restored.values()}
        assert step > 0
        for rank, (_, where) in restored.items():
            assert (where == "own memory") == (rank in rejoined_ranks), restored
        assert not resumed, resumed  # no checkpoint was read
    else:  # a rank and the holder of its copy were both new: every rank read the checkpoint
        assert not restored and resumed, (restored, resumed)
    # every heartbeat of a rejoined rank was taken: its last generation's progress is not reported
    # as the next one's (a step backwards the controller would drop)
    assert "dropping its Heartbeat" not in run.output, run.output[-3000:]
    # the last checkpoint, saved after the rejoin (kept ranks through the host buffers their
    # processes kept, unless a write from before the fault still read them), holds the fault-free
    # run's tensors
    ever_rejoined = set().union(*(rejoined(run.dir, g) for g in range(2, generation + 1)))
    kept = kept_buffers(run.dir)
    assert kept and kept <= ever_rejoined, (kept, ever_rejoined)
    mine, theirs = final_checkpoint(run.dir), final_checkpoint(reference.dir)
    assert mine.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert not isinstance(tensor, torch.Tensor) or torch.equal(mine[key], tensor), key
    return rejoined_ranks


def kept_buffers(run_dir: Path) -> set[int]:
    """The ranks whose checkpointer reused its process's host buffers (their INFO logs)."""
    return {
        int(log.stem.split("_")[1])
        for log in (run_dir / "logs").glob("rank_*.log")
        if "checkpoint host buffers kept" in log.read_text()
    }


def final_checkpoint(run_dir: Path) -> dict:
    """The step-``STEPS`` checkpoint's state, read by torch's own DCP converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / "final-checkpoint.pt"
    if not out.exists():
        dcp_to_torch_save(run_dir / "checkpoints" / step_name(STEPS), out)
    return torch.load(out, weights_only=True)


def test_killed_worker_alone_is_a_new_process_and_comes_back_from_its_peers_copy(
    reference, tmp_path
):
    run = Run(tmp_path, *LAYOUT, "--inject", "kill-worker:rank=5,step=7")
    kept = check_in_process(run, reference, 2, kept={0, 1, 2, 3, 4, 6, 7})
    if 1 in kept:  # rank 5's copy is held by rank 1 (four ranks, one node, before it)
        assert restores(run.dir, 2)[5][1] == "rank 1's memory"


def test_lost_node_comes_back_on_the_spare_from_the_peer_copies(reference, tmp_path):
    run = Run(tmp_path, *LAYOUT, "--spares", "1", "--inject", "kill-agent:node=1,step=7")
    kept = check_in_process(run, reference, 2, kept={0, 1, 2, 3})
    assert run.of("generation_start")[-1].detail["replaced"] == {"node-1": "node-2"}
    if kept == {0, 1, 2, 3}:  # each of the lost node's ranks from the copy on node-0
        assert {r: w for r, (_, w) in restores(run.dir, 2).items() if r >= 4} == {
            r: f"rank {r - 4}'s memory" for r in range(4, 8)
        }


def test_a_stopped_rank_is_killed_and_its_peers_rejoin(reference, tmp_path):
    run = Run(tmp_path, *LAYOUT, "--inject", "hang-worker:rank=2,step=7")
    check_in_process(run, reference, 2, kept={0, 1, 3, 4, 5, 6, 7})
    [fault] = run.faults()
    assert fault.detail["fault"] == "stall" and fault.rank == 2


def test_two_faults_in_a_row(reference, tmp_path):
    run = Run(
        tmp_path, *LAYOUT,
        "--inject", "kill-worker:rank=1,step=5", "--inject", "kill-worker:rank=6,step=11",
    )  # fmt: skip
    check_in_process(run, reference, 3, kept={0, 1, 2, 3, 4, 5, 7})
    assert rejoined(run.dir, 2) and rejoined(run.dir, 2) <= {0, 2, 3, 4, 5, 6, 7}
