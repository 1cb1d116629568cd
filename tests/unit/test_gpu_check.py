"""``scripts/gpu-check``, the one-command GPU validation kit, on a machine without a GPU: it says
why it does nothing and exits 0; its plan for 1, 2, 4 and 8 GPUs; its Markdown block; one step run
for real (pass, fail, time-out)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from script_loader import REPO, load_script

from megascale import gpus

gpu_check = load_script("scripts/gpu_check.py", "gpu_check")


@pytest.mark.skipif(gpus.visible_gpu_count() > 0, reason="a GPU is visible: it would run the kit")
def test_without_a_gpu_it_says_why_and_exits_zero():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu-check")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device visible here" in proc.stdout
    assert "nothing to check" in proc.stdout


def test_dry_run_lists_the_steps_for_eight_gpus(monkeypatch, capsys):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 8)
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "pytest -q -rs -m gpu tests/gpu" in out
    assert "benchmarks/model_blocks.py --config h100-1b" in out
    assert "benchmarks/overlap.py --device cuda --cost fixed --latency-ms 0 --nproc 8" in out
    assert "benchmarks/checkpoint.py --device cuda --stall-only" in out
    assert "selfcheck --calibrate --output" in out
    assert "benchmarks/mcore_loop.py --config h100-1b --set model.spec=local" in out


def test_only_runs_the_named_steps_in_plan_order(monkeypatch, capsys):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 1)
    assert gpu_check.main(["--dry-run", "--quick", "--only", "checkpoint,mcore-loop"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    assert "mcore_loop.py" in lines[0] and "train.global_batch_size=16" in lines[0]
    assert "checkpoint.py" in lines[1]
    assert {s.key for s in gpu_check.plan(8, "python", REPO)} == set(gpu_check.STEP_KEYS)
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--only", "tier,nonsense"])
    assert "--only 'tier,nonsense': unknown step 'nonsense'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("count", "ranks", "extra"),
    [(1, None, None), (2, 2, ["parallel.pp=1", "parallel.vpp=1"]), (4, 4, []), (16, 8, [])],
)
def test_overlap_layout_fits_the_gpus(count, ranks, extra, tmp_path):
    layout = gpu_check.overlap_layout(count)
    assert layout == (None if ranks is None else (ranks, extra))
    steps = {s.title: s for s in gpu_check.plan(count, "python", tmp_path)}
    overlap = steps["overlap off vs on (NCCL)"]
    assert (overlap.skip is not None) == (ranks is None)
    te = steps["TE spec: TP overlap off vs on (userbuffers)"]
    assert te.skip is not None  # no TE in this environment, and none below 2 GPUs
    assert "model.spec=te" in te.argv and "--variants" in te.argv
    for step in (overlap, te):  # real links only: the CPU-calibrated cost model is refused
        assert step.argv[step.argv.index("--cost") + 1] == "fixed", step.argv
    for step in steps.values():  # every script and preset the plan names exists
        for arg in step.argv:
            if arg.endswith(".py") or arg.startswith("tests/"):
                assert (REPO / arg).exists(), arg
    assert (REPO / "megascale" / "config" / "presets" / "h100-1b.toml").exists()


def test_run_step_passes_fails_times_out_and_attaches(tmp_path):
    attach = tmp_path / "figures.toml"
    ok = gpu_check.Step(
        "ok",
        [sys.executable, "-c", f"open({str(attach)!r}, 'w').write('x = 1'); print('| a |')"],
        60,
        table=True,
        attach=attach,
    )
    bad = gpu_check.Step("bad", [sys.executable, "-c", "import sys; sys.exit(3)"], 60)
    slow = gpu_check.Step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1)
    skipped = gpu_check.Step("skipped", ["true"], 1, skip="needs 2 or more GPUs")
    outcomes = [gpu_check.run_step(s, tmp_path / f"{s.title}.log") for s in (ok, bad, slow)]
    outcomes.append(gpu_check.run_step(skipped, tmp_path / "skipped.log"))
    assert [o.status for o in outcomes] == ["passed", "failed", "timed out", "skipped"]
    assert "x = 1" in outcomes[0].output and "[exit code 3]" in outcomes[1].output
    assert (tmp_path / "ok.log").read_text() == outcomes[0].output

    block = gpu_check.render({"device": "8 x NVIDIA H100", "torch": "2.13.0"}, outcomes)
    assert block.startswith("## GPU check: 8 x NVIDIA H100")
    assert "- torch: 2.13.0" in block
    assert "| ok | passed |" in block and "| bad | failed |" in block
    assert "\n| a |\n" in block  # a passing table step's Markdown goes in as-is
    assert "```\n[exit code 3]" in block  # a failure's output is fenced
    assert "skipped: needs 2 or more GPUs" in block


def test_the_rehearsal_starts_every_step_of_the_plan_without_a_gpu(capsys):
    """``--rehearse N``: each step of an N-GPU plan started as it starts there (pytest collects,
    the scripts and the CLI parse their arguments), here, with the environment of this run."""
    assert gpu_check.main(["--rehearse", "1", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "GPU test tier" in out and "--collect-only: ok" in out
    assert "benchmarks/checkpoint.py --help: ok" in out
    assert "megascale.cli selfcheck --help: ok" in out
    assert "overlap off vs on (NCCL): skipped there (needs 2 or more GPUs)" in out


def test_a_checkpoint_step_never_asks_for_more_ranks_than_gpus(tmp_path):
    for gpus_here, ranks in ((1, "1"), (2, "2"), (8, "2")):
        (step,) = [
            s for s in gpu_check.plan(gpus_here, "python", tmp_path) if "checkpoint" in s.title
        ]
        assert step.argv[step.argv.index("--nproc") + 1] == ranks
