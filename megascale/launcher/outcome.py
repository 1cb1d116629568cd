"""What a ``megascale launch`` run produced: ``RUN_DIR/final.json`` (``summarize``).

``final.json``::

    {"finished": true, "state": "finished", "reason": null, "final_step": 50, "steps": 50,
     "param_digest": "<sha256>", "digest_step": 50,
     "faults_injected": ["kill-worker:rank=1,step=25"],
     "faults_detected": {"worker_exit": 1},          # controller faults + notices, by kind
     "recoveries": 1, "generations": 2, "evicted": [],
     "fault_timings": [{"fault", "fired_at", "step", "decision", "detected_as", "node",
                        "rank", "detection_s", "resumed_s"}],
     "wall_time_s": 23.4, "nodes": 2, "nproc_per_node": 1, "spares": 1, ...}

Everything is read back from the run directory (events.jsonl, metrics.jsonl, faults/, the
checkpoints), so a run can be summarised again after the fact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from megascale.robustness import inject
from megascale.robustness.events import read_events
from megascale.train.checkpoint_paths import CheckpointPathError, resolve_file

logger = logging.getLogger(__name__)

NOTICES = ("checkpoint_fallback", "etcd_unavailable", "controller_takeover")
"""Events counted in ``faults_detected`` besides the controller's faults."""
DECISIONS = {
    "etcd-restart": ("etcd_unavailable",),
    "kill-controller": ("controller_takeover",),
    "corrupt-checkpoint": ("checkpoint_fallback",),
    "fail-selfcheck": ("evict",),
    "slow-rank": (),
}
"""Per injected kind, the events that count as the controller noticing it (default: a fault)."""


def current_step(metrics: Path) -> int:
    """The last step in ``metrics.jsonl`` (rank 0 writes one line per step), 0 if none."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def parameter_digest(run_dir: Path, job: Any) -> tuple[str | None, int | None]:
    """sha256 over the model weights in the newest complete checkpoint, in a canonical order
    (files by name; within a file, dict keys sorted; each tensor's path, dtype, shape and bytes),
    and that checkpoint's step. Equal for equal weights under the same layout; the model files
    are shared by data-parallel replicas, so the DP size does not change it either. A manifest
    naming a file outside its step directory (``checkpoint_paths.resolve_file``) gives no
    digest: nothing outside the checkpoint is opened."""
    from megascale.train.checkpoint_io import (
        MANIFEST,
        Storage,
        load_state_bytes,
        location,
        step_name,
    )

    storage = Storage(location(job.checkpoint, run_dir))
    steps = storage.complete_steps()
    if not steps:
        return None, None
    directory = step_name(steps[-1])
    manifest = storage.read_json(f"{directory}/{MANIFEST}")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    names = sorted(files) if isinstance(files, dict) else []
    digest = hashlib.sha256()
    for name in [n for n in names if n.startswith("model_")] or names:
        try:
            path = resolve_file(storage.path(directory), name, local=storage.local)
            data = storage.fs.cat_file(path)
        except (CheckpointPathError, OSError, ValueError) as e:
            logger.warning("no parameter digest of %s: %s", directory, e)
            return None, steps[-1]
        state = load_state_bytes(data)  # weights_only: tensors and plain data, never code
        if "model" in state:
            digest.update(name.encode())
            _hash_tree(digest, state["model"], ())
    return digest.hexdigest(), steps[-1]


def _hash_tree(digest: Any, tree: Any, path: tuple) -> None:
    import torch

    if isinstance(tree, torch.Tensor):
        t = tree.detach().cpu().contiguous()
        digest.update(f"{path}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            _hash_tree(digest, tree[key], (*path, str(key)))
    elif isinstance(tree, list | tuple):
        for i, item in enumerate(tree):
            _hash_tree(digest, item, (*path, i))
    elif isinstance(tree, bool | int | float | str) or tree is None:
        digest.update(f"{path}={tree!r}".encode())


def fault_timings(run_dir: Path, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fired fault: how long until the controller decided (the next event that counts, see
    ``DECISIONS``) and until training next completed a step (``metrics.jsonl``)."""
    metrics = []
    try:
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    except (OSError, ValueError):
        pass
    out = []
    for fault in inject.fired(run_dir):
        kinds, t0 = DECISIONS.get(fault["kind"], ("fault",)), fault["time"]
        found = [e for e in events if e["kind"] in kinds and e["time"] >= t0]
        decided = found[0] if found else None
        # The rank that names the cause: every rank reports a checkpoint it skipped, one says why.
        named = next((e for e in found if "another rank" not in str(e.get("detail"))), decided)
        resumed = next((m["time"] for m in metrics if m.get("time", 0) > t0), None)
        row = {"fault": fault["spec"], "fired_at": t0, "step": fault.get("step")}
        if decided is not None:
            row.update(
                decision=decided["kind"],
                detected_as=(decided.get("detail") or {}).get("fault", decided["kind"]),
                node=named.get("node"),
                rank=named.get("rank"),
                detection_s=round(decided["time"] - t0, 3),
            )
        if resumed is not None:
            row["resumed_s"] = round(resumed - t0, 3)
        out.append(row)
    return out


def faults_detected(events: list[dict[str, Any]]) -> dict[str, int]:
    """The controller's faults by kind, and the notices; a checkpoint fallback (every rank
    reports the checkpoint it skipped) counts once per generation."""
    detected: dict[str, int] = {}
    fallbacks = set()
    for e in events:
        kind = (e.get("detail") or {}).get("fault") if e["kind"] == "fault" else e["kind"]
        if kind == "checkpoint_fallback":
            if e.get("generation") in fallbacks:
                continue
            fallbacks.add(e.get("generation"))
        if e["kind"] == "fault" or kind in NOTICES:
            detected[str(kind)] = detected.get(str(kind), 0) + 1
    return detected


def summarize(
    run_dir: Path, job: Any, state: str, wall_s: float, opts: Any, reason: str | None = None
) -> dict[str, Any]:
    """The content of ``final.json`` (see the module docstring); ``reason``: why the launcher
    stopped the job (a signal, a timeout, etcd or the controller lost for good), else None."""
    events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
    digest, digest_step = parameter_digest(run_dir, job)
    return {
        "finished": state == "finished",
        "state": state,
        "reason": reason,
        "final_step": current_step(run_dir / "metrics.jsonl"),
        "steps": job.train.steps,
        "param_digest": digest,
        "digest_step": digest_step,
        "faults_injected": [f["spec"] for f in inject.fired(run_dir)],
        "faults_detected": faults_detected(events),
        "recoveries": sum(
            1 for e in events if e["kind"] == "generation_running" and e["generation"] > 1
        ),
        "generations": max((e.get("generation") or 0 for e in events), default=0),
        "evicted": [e["node"] for e in events if e["kind"] == "evict"],
        "fault_timings": fault_timings(run_dir, events),
        "wall_time_s": round(wall_s, 3),
        "nodes": opts.nodes,
        "nproc_per_node": opts.nproc_per_node,
        "spares": opts.spares,
        "heartbeat_interval_s": opts.heartbeat_interval,
        "job_id": opts.job_id,
        "run_dir": str(run_dir),
    }
