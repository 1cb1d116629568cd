"""Fault specs, exactly-once firing, and the agent's reading of worker output (no processes)."""

from __future__ import annotations

import pytest

from megascale.agent.logscan import LogScanner, error_kind
from megascale.probes import inject


def test_specs_parse_and_keep_a_stable_id():
    spec = inject.parse("kill-worker:rank=3,step=20")
    assert (spec.kind, dict(spec.params), spec.side) == (
        "kill-worker",
        {"rank": 3, "step": 20},
        "worker",
    )
    assert spec.id == inject.parse(" kill-worker:step=20,rank=3 ").id
    assert inject.parse("corrupt-checkpoint:latest").side == "agent"
    assert inject.parse("etcd-restart:step=4,downtime=0.5").get("downtime") == 0.5
    assert inject.parse("slow-rank:rank=2,factor=1.5").get("factor") == 1.5
    with pytest.raises(inject.InjectError, match="rank is given twice"):
        inject.parse("kill-worker:rank=1,rank=2,step=3")
    with pytest.raises(inject.InjectError, match="step=0 must be >= 1"):
        inject.parse("kill-worker:rank=1,step=0")


def test_a_mismatch_spec_takes_a_kind_word_and_refuses_others_in_one_line():
    spec = inject.parse("mismatch-comm:rank=2,step=3,kind=op")
    assert (spec.side, dict(spec.params)) == ("worker", {"rank": 2, "step": 3, "kind": "op"})
    assert inject.parse("mismatch-comm:rank=2,step=3").get("kind", "size") == "size"
    with pytest.raises(inject.InjectError) as bad:
        inject.parse("mismatch-comm:rank=2,step=3,kind=shape")
    assert str(bad.value) == (
        "--inject 'mismatch-comm:rank=2,step=3,kind=shape': kind='shape' must be size or op"
    )
    with pytest.raises(inject.InjectError, match=r"takes rank=N, step=N, optional kind=size\|op"):
        inject.parse("mismatch-comm:rank=2,step=3,size=4")
    with pytest.raises(inject.InjectError, match="rank=4 is not one of the job's 4 ranks"):
        inject.check_fits([inject.parse("mismatch-comm:rank=4,step=3")], nodes=2, world_size=4,
                          steps=9)  # fmt: skip


def test_worker_side_specs_travel_in_the_environment(monkeypatch, tmp_path):
    specs = [inject.parse(s) for s in ("kill-worker:rank=1,step=5", "kill-agent:node=1,step=5")]
    value = inject.to_env(specs)
    assert value == "kill-worker:rank=1,step=5"  # the launcher fires kill-agent itself
    monkeypatch.setenv(inject.ENV, value)
    assert [s.text for s in inject.worker_faults(1, tmp_path).specs] == [value]
    assert inject.worker_faults(0, tmp_path).specs == []  # another rank's fault
    monkeypatch.delenv(inject.ENV)
    faults = inject.worker_faults(1, tmp_path)
    faults.before_step(5)  # null object: nothing fires
    assert faults.slow == 1


def test_a_fault_fires_once_across_restarts(tmp_path):
    spec = inject.parse("kill-worker:rank=1,step=5")
    assert inject.claim(tmp_path, spec, rank=1, step=5)
    assert not inject.claim(tmp_path, spec, rank=1, step=5)  # the replayed step after a restart
    [record] = inject.fired(tmp_path)
    assert record["spec"] == spec.text and record["rank"] == 1 and record["time"] > 0


def _scanner(path):
    path.write_text("")
    return LogScanner(path)


def test_log_scanner_finds_errors_and_tells_symptoms_from_causes(tmp_path):
    cause = _scanner(tmp_path / "a.out")
    with open(cause.path, "a") as f:
        f.write("step 5\nTraceback (most recent call last):\n  File 'x'\n")
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to alloc")  # no newline yet
    [match] = cause.scan()
    assert match.kind == "traceback" and not cause.peer_failure
    [oom] = cause.flush()  # the worker exited: its last line counts too
    assert oom.kind == "oom" and "CUDA out of memory" in oom.text

    symptom = _scanner(tmp_path / "b.out")
    with open(symptom.path, "a") as f:
        f.write("Traceback (most recent call last):\n  File 'y'\n")
        f.write("[rank0]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5\n")
        f.write("[rank 0] WARNING megascale.train.checkpoint: skipping checkpoint step_8: bad\n")
    matches = symptom.scan()
    assert [m.kind for m in matches] == ["traceback", "checkpoint_fallback"]
    assert "Connection closed by peer" in matches[0].text  # the exception line, not the header
    assert matches[1].notice and symptom.peer_failure


RUN_DIR = "/tmp/repro-OOM-fix/NCCL-error-ECC"
"""A run directory that names every kind of fault, as a user reproducing one would."""


def test_keywords_in_the_jobs_own_lines_paths_and_names_are_no_error():
    info = "[rank 0] 2026-11-25 09:48:01,123 INFO megascale.train.run:"
    quiet = [
        f"{info} run directory {RUN_DIR}/ckpt, data {RUN_DIR}/data/OOM_corpus",
        f"{info} CUDA error rate 0, out of memory retries 0, SIGSEGV handler on",
        "[rank 0] 2026-11-25 09:48:01,123 WARNING megascale.data: NCCL error budget 3",
        f"> building dataset {RUN_DIR}/Segmentation-fault/cudaErrorSet.bin",
        "[rank 3] 2026-11-25 09:48:01,123 ERROR megascale.train.checkpoint: cannot write "
        f"{RUN_DIR}/step_8/OutOfMemoryError.pt",
        "dataset repro-OOM-NCCL-error blend OOM_set data.OOM.bin CUBLAS_STATUS_x-y",
        '  File "/tmp/CUDA error/OOM/train.py", line 3, in <module>',
    ]
    for line in quiet:
        assert error_kind(line) is None, line
    spaced = "/tmp/my runs/repro out of memory"  # a run directory with spaces: stripped by name
    assert error_kind(f"RuntimeError: cannot open {spaced}/x", (spaced,)) is None

    real = {
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": "oom",
        "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered": "cuda_error",
        "RuntimeError: NCCL error in: /opt/torch/c10d/NCCLUtils.hpp:219, unhandled": "nccl_error",
        "Fatal Python error: Segmentation fault": "segfault",
        "[rank 1] 2026-11-25 09:48:01,123 ERROR megascale.train.run: OOM at step 5": "oom",
        f"RuntimeError: cudaErrorIllegalAddress while reading {RUN_DIR}/x": "cuda_error",
        "Traceback (most recent call last):": "traceback",
    }
    for line, kind in real.items():
        assert error_kind(line, (RUN_DIR,)) == kind, line


def test_the_scanner_reads_past_the_run_directory_to_the_real_error(tmp_path):
    scanner = LogScanner(tmp_path / "a.out", paths=(RUN_DIR,))
    with open(scanner.path, "a") as f:
        f.write(f"[rank 0] 2026-11-25 09:48:01,123 INFO megascale.cli: run dir {RUN_DIR}\n")
        f.write(f"saving to {RUN_DIR}/Broken pipe/step_5\n")  # a peer's failure only by name
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    [match] = scanner.scan()
    assert match.kind == "oom" and match.text.startswith("torch.OutOfMemoryError")
    assert not scanner.peer_failure
