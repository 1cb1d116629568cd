"""One-command GPU validation: the GPU test tier and the GPU benchmarks, one Markdown block out.

Run ``scripts/gpu-check`` (no arguments) on a machine with NVIDIA GPUs and the ``gpu`` extra
installed (``make install`` does that where ``nvidia-smi -L`` lists a GPU). It runs, each as its
own process with its own time limit, and keeps going when one fails:

1. ``pytest -m gpu tests/gpu``: layouts on up to 8 GPUs vs the 1-GPU reference over NCCL, TE's
   spec (serial and parallel block), sliding window vs full attention and a banded mask, bf16,
   CUDA-event timers, per-collective timeline segments from the flight recorder's CUDA events
   (TP2 + SP over NCCL, ``tests/gpu/test_timeline_nccl.py``), the two-stage checkpoint from GPU
   memory, the self-check on the GPU.
2. ``benchmarks/mcore_loop.py`` on the ``h100-1b`` preset's layers (local spec): megascale's trainer
   beside a plain megatron-core loop, and selective / full recomputation (tokens/s, MFU, HFU,
   peak memory).
3. ``benchmarks/model_blocks.py`` on the ``h100-1b`` preset: serial vs parallel block, full vs
   sliding-window attention (tokens/s, MFU).
4. ``benchmarks/overlap.py --device cuda``: each overlap off vs on over NCCL (2+ GPUs), and TP
   overlap off vs on with the TE spec (Transformer Engine's userbuffers, TP2 + SP, bf16).
5. ``benchmarks/checkpoint.py --device cuda --stall-only``: the checkpoint stall with the state in
   GPU memory (synchronous vs two-stage).
6. ``megascale selfcheck --calibrate``: this node's self-check figures as a calibration file.

It prints one Markdown block headed by the device, driver, CUDA, torch, Transformer Engine and
megatron-core versions, the date, the commit and each command, ready to paste into
``benchmarks/RESULTS.md``; the block and every step's full output are also written under
``runs/gpu-check-<time>/``. Exit code: 0 when every step passed, 1 otherwise. On a machine
without a visible GPU it says why and exits 0 having done nothing.

The checking process never initialises CUDA (GPUs are counted through NVML); every GPU step runs in
a child process.

On a GPU machine without network or ``make install`` (an image with torch but no megatron-core):
``scripts/gpu-bundle`` (here, with network) writes the wheels that machine lacks into
``.gpu-bundle/``; there, ``scripts/gpu-check --bundle .gpu-bundle`` installs them into a scratch
target (``pip install --no-index --no-deps --target``) and puts it on every step's
``PYTHONPATH``. ``--max-step-s`` caps each step's limit (a short GPU lease), ``--out DIR`` writes
the block and the logs there, ``--only KEYS`` runs some steps (``STEP_KEYS``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    title: str
    argv: list[str]
    timeout_s: int
    skip: str | None = None
    """Why the step does not run on this machine (None: it runs)."""
    table: bool = False
    """The step prints Markdown itself: its output goes into the block as-is, not fenced."""
    attach: Path | None = None
    """A file the step writes, appended to its output (the calibration)."""
    key: str = ""
    """Its name for ``--only``."""


@dataclass
class Outcome:
    step: Step
    status: str  # "passed", "failed", "timed out", "skipped"
    seconds: float = 0.0
    output: str = ""


# The overlap benchmark on real NCCL links: no modelled cost (its bytes model is calibrated on the
# CPU's GEMM rate, and the benchmark refuses it with --device cuda).
REAL_LINKS = ["--cost", "fixed", "--latency-ms", "0"]

# The overlap benchmark's model on GPUs: big enough that GEMMs and NCCL transfers take real time.
OVERLAP_GPU_SETS = [
    "model.num_layers=8",
    "model.hidden_size=4096",
    "model.num_heads=32",
    "model.seq_length=2048",
    "model.params_dtype=bf16",
    "model.spec=local",
    "train.global_batch_size=16",
    "train.micro_batch_size=1",
]


def overlap_layout(gpus: int) -> tuple[int, list[str]] | None:
    """(ranks, extra --set values) for the overlap benchmark on ``gpus`` GPUs; None below 2."""
    if gpus >= 8:
        return 8, []  # the benchmark's own layout: TP2 x PP2 (VPP2) x DP2 + SP
    if gpus >= 4:
        return 4, []  # TP2 x PP2 (VPP2) + SP
    if gpus >= 2:
        return 2, ["parallel.pp=1", "parallel.vpp=1"]  # TP2 + SP
    return None


# TE's TP overlap (userbuffers): the same model on TP2 + SP with Transformer Engine's layer spec.
TE_OVERLAP_SETS = [
    *[s for s in OVERLAP_GPU_SETS if s != "model.spec=local"],
    "model.spec=te",
    "parallel.pp=1",
    "parallel.vpp=1",
]


def te_overlap_step(gpus: int, python: str) -> Step:
    """TP overlap off vs on with the TE spec on 2 GPUs (skipped below 2 GPUs or without TE)."""
    import importlib.util

    argv = [python, "benchmarks/overlap.py", "--device", "cuda", *REAL_LINKS]
    argv += ["--nproc", "2", "--variants", "off,tp only"]
    argv += [a for item in TE_OVERLAP_SETS for a in ("--set", item)]
    skip = None
    if gpus < 2:
        skip = "needs 2 or more GPUs"
    elif importlib.util.find_spec("transformer_engine") is None:
        skip = "Transformer Engine is not installed (the gpu extra)"
    title = "TE spec: TP overlap off vs on (userbuffers)"
    return Step(title, argv, 1800, skip=skip, table=True, key="te-overlap")


QUICK_BLOCKS = ["--steps", "5", "--warmup", "2", "--rounds", "1"]
QUICK_BATCH = ["--set", "train.global_batch_size=16"]
"""``--quick``: fewer timed steps per variant and 16 sequences per step (a short GPU lease)."""
QUICK_CHECKPOINT = ["--rounds", "2"]
QUICK_WINDOW = ["--set", "train.micro_batch_size=2"]
"""The sliding window on the local spec materialises every layer's [s, s] scores and mask (no
flash attention): 4 x 2048-token micro-batches of h100-1b need more than an 80 GB GPU."""
LOCAL_SPEC = ["--set", "model.spec=local"]
"""The plain megatron-core loop builds megatron-core's local spec: megascale's rows do too."""


def plan(gpus: int, python: str, out_dir: Path, quick: bool = False) -> list[Step]:
    """The steps for a machine with ``gpus`` visible GPUs, in the order they run (``quick``: fewer
    rounds in the benchmarks)."""
    sets = lambda items: [a for item in items for a in ("--set", item)]  # noqa: E731
    layout = overlap_layout(gpus)
    overlap = Step(
        "overlap off vs on (NCCL)",
        [python, "benchmarks/overlap.py", "--device", "cuda", *REAL_LINKS],
        1800,
        skip="needs 2 or more GPUs" if layout is None else None,
        table=True,
        key="overlap",
    )
    if layout is not None:
        ranks, extra = layout
        overlap = Step(
            overlap.title,
            [*overlap.argv, "--nproc", str(ranks), *sets(OVERLAP_GPU_SETS + extra)],
            overlap.timeout_s,
            table=True,
            key=overlap.key,
        )
    calibration = out_dir / "selfcheck-calibration.toml"
    return [
        Step(
            "GPU test tier",
            [python, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/gpu"],
            3600,
            key="tier",
        ),
        Step(
            "megascale vs a plain megatron-core loop; recomputation's memory (h100-1b, local spec)",
            [python, "benchmarks/mcore_loop.py", "--config", "h100-1b", *LOCAL_SPEC]
            + (QUICK_BLOCKS + QUICK_BATCH if quick else []),
            1800,
            table=True,
            key="mcore-loop",
        ),
        Step(
            "model blocks: serial vs parallel block, full vs window (the h100-1b preset)",
            [python, "benchmarks/model_blocks.py", "--config", "h100-1b"]
            + (QUICK_BLOCKS + QUICK_BATCH + QUICK_WINDOW if quick else []),
            3600,
            table=True,
            key="blocks",
        ),
        overlap,
        te_overlap_step(gpus, python),
        Step(
            "checkpoint stall from GPU memory",
            [python, "benchmarks/checkpoint.py", "--device", "cuda", "--stall-only"]
            + ["--nproc", str(min(gpus, 2))]
            + (QUICK_CHECKPOINT if quick else []),
            1800,
            table=True,
            key="checkpoint",
        ),
        Step(
            "self-check calibration",
            [
                python,
                "-m",
                "megascale.cli",
                "selfcheck",
                "--calibrate",
                "--output",
                str(calibration),
                "--dir",
                str(out_dir),
            ],
            900,
            attach=calibration,
            key="calibration",
        ),  # fmt: skip
    ]


STEP_KEYS = ("tier", "mcore-loop", "blocks", "overlap", "te-overlap", "checkpoint", "calibration")


def install_bundle(bundle: Path, target: Path) -> str | None:
    """Install every wheel of ``bundle`` into ``target`` offline; None, or why it failed."""
    wheels = sorted(str(w) for w in bundle.glob("*.whl"))
    if not wheels:
        return f"{bundle}: no wheels (run scripts/gpu-bundle where there is network)"
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    proc = subprocess.run(
        [*argv, "--target", str(target), *wheels], capture_output=True, text=True, check=False
    )
    return None if proc.returncode == 0 else proc.stderr[-2000:]


def run_step(step: Step, log: Path, max_s: int | None = None) -> Outcome:
    """Run one step from the repository root; its whole output goes to ``log``."""
    if step.skip:
        return Outcome(step, "skipped", output=step.skip)
    limit = step.timeout_s if max_s is None else min(step.timeout_s, max_s)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # parents that fork ranks must not init CUDA
    start = time.monotonic()
    try:
        proc = subprocess.run(
            step.argv,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=limit,
        )
        status, output = ("passed" if proc.returncode == 0 else "failed"), proc.stdout
        if proc.returncode:
            output += f"\n[exit code {proc.returncode}]\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired as e:
        status, partial = "timed out", e.stdout or ""
        output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    if step.attach is not None and step.attach.exists():
        output += f"\n{step.attach.name}:\n{step.attach.read_text()}"
    log.write_text(output)
    return Outcome(step, status, time.monotonic() - start, output)


def rehearsal_argv(step: Step) -> list[str]:
    """What proves ``step`` can start without a GPU: its script's ``--help``, or for pytest the
    collection of its tests (every import they make)."""
    argv = list(step.argv)
    if argv[1:3] == ["-m", "pytest"]:
        return [*argv, "--collect-only"]
    if argv[1:3] == ["-m", "megascale.cli"]:
        return [*argv[:4], "--help"]
    return [*argv[:2], "--help"]


def rehearse(steps: list[Step]) -> int:
    """Start every step's rehearsal (``rehearsal_argv``) here; 0 when all of them could."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    failed = []
    for step in steps:
        if step.skip:
            print(f"gpu-check rehearsal: {step.title}: skipped there ({step.skip})")
            continue
        argv = rehearsal_argv(step)
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        print(f"gpu-check rehearsal: {step.title}: {shlex.join(argv)}: {status}")
        if proc.returncode:
            failed.append(step.title)
            print((proc.stdout + proc.stderr)[-2000:])
    return 1 if failed else 0


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _run(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def machine_facts() -> dict[str, str]:
    """Device, driver and software versions, read without initialising CUDA."""
    import torch

    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    names = gpus.splitlines()
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "device": f"{len(names)} x {names[0]}" if names and gpus != "unknown" else "unknown",
        "driver": driver.splitlines()[0] if driver != "unknown" else driver,
        "CUDA (torch build)": str(torch.version.cuda),
        "torch": torch.__version__,
        "Transformer Engine": _version("transformer-engine"),
        "megatron-core": _version("megatron-core"),
        "commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "scripts/gpu-check",
    }


def render(facts: dict[str, str], outcomes: list[Outcome]) -> str:
    """The Markdown block for ``benchmarks/RESULTS.md``."""
    lines = [f"## GPU check: {facts.get('device', 'unknown')}", ""]
    lines += [f"- {key}: {value}" for key, value in facts.items()]
    lines += ["", "| step | result | time |", "|---|---|---:|"]
    lines += [f"| {o.step.title} | {o.status} | {o.seconds:.0f} s |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"### {o.step.title}", ""]
        if o.step.skip:
            lines.append(f"skipped: {o.step.skip}")
            continue
        lines += [f"`{shlex.join(o.step.argv)}` ({o.status})", ""]
        text = o.output.strip() or "(no output)"
        if o.step.table and o.status == "passed":
            lines.append(text)
        else:
            tail = "\n".join(text.splitlines()[-40:])
            lines += ["```", tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="print the steps for this machine; run nothing"
    )
    parser.add_argument("--bundle", type=Path, help="install these wheels first (offline)")
    parser.add_argument("--max-step-s", type=int, help="cap every step's time limit (seconds)")
    parser.add_argument("--out", type=Path, help="directory for the block and the step logs")
    parser.add_argument("--quick", action="store_true", help="fewer rounds in the benchmarks")
    parser.add_argument(
        "--only",
        metavar="KEYS",
        help="comma-separated steps to run, in plan order: " + ", ".join(STEP_KEYS),
    )
    parser.add_argument(
        "--rehearse",
        type=int,
        metavar="GPUS",
        help="no GPU needed: check that every step of a GPUS-GPU plan can start (imports, "
        "--help, test collection), as the GPU machine will run them",
    )
    args = parser.parse_args(argv)
    only = [k.strip() for k in (args.only or "").split(",") if k.strip()]
    unknown = [k for k in only if k not in STEP_KEYS]
    if unknown:
        parser.error(f"--only {args.only!r}: unknown step {unknown[0]!r}; expected {STEP_KEYS}")
    if args.bundle is not None:
        target = Path(os.environ.get("TMPDIR", "/tmp")) / "megascale-gpu-site"
        failed = install_bundle(args.bundle, target)
        if failed:
            print(f"gpu-check: installing {args.bundle} failed: {failed}")
            return 2
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p
        )
    sys.path.insert(0, str(REPO))
    try:
        from megascale.gpus import visible_gpu_count
    except ImportError as e:
        print(f"gpu-check: {sys.executable} cannot import megascale ({e}): run `make install`")
        return 2

    if args.rehearse is not None:
        return rehearse(plan(args.rehearse, sys.executable, REPO / "runs", quick=args.quick))
    gpus = visible_gpu_count()
    if not gpus:
        print(
            "gpu-check: no CUDA device visible here (NVML / nvidia-smi list none, or torch is a "
            "CPU build): nothing to check. Run it on a machine with NVIDIA GPUs and the gpu extra."
        )
        return 0
    out_dir = args.out or REPO / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    steps = [
        step
        for step in plan(gpus, sys.executable, out_dir, quick=args.quick)
        if not only or step.key in only
    ]
    if args.dry_run:
        for step in steps:
            print(f"{step.title}: {step.skip or shlex.join(step.argv)}")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for i, step in enumerate(steps, 1):
        print(f"gpu-check [{i}/{len(steps)}] {step.title} ...", file=sys.stderr, flush=True)
        outcomes.append(run_step(step, out_dir / f"step{i}.log", args.max_step_s))
        print(f"gpu-check [{i}/{len(steps)}] {outcomes[-1].status}", file=sys.stderr, flush=True)
    block = render(machine_facts(), outcomes)
    (out_dir / "RESULTS-block.md").write_text(block)
    print(block)
    print(f"(also in {out_dir / 'RESULTS-block.md'}; step logs beside it)", file=sys.stderr)
    return 0 if all(o.status in ("passed", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
