"""Every field of the MegaScaleJob spec is read by something: a fault-tolerance field maps onto a
key of the config's ``fault_tolerance`` section, any other is named by the operator's code."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

from k8s_support import example_jobs

from megascale import config
from megascale.controller import fault_tolerance_flags
from megascale.controller.policy import policy_for
from megascale.k8s import crd, launch
from megascale.k8s.job import Job

K8S_DIR = Path(launch.__file__).parent
NOT_READERS = {"crd.py", "crd_status.py", "validation.py"}  # the schema and its checks
TABLES = {"FT_SETTINGS", "FT_OTHER_READERS"}


def _leaves(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[str]:
    """Dotted paths of the schema's leaf fields (a field with no ``properties``)."""
    props = node.get("properties")
    if not props:
        return [".".join(path)]
    return [leaf for name, sub in props.items() for leaf in _leaves(sub, (*path, name))]


def _spec_leaves() -> list[str]:
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return _leaves(schema["properties"]["spec"])


def _names_in_code() -> set[str]:
    """String constants in the operator's code, less docstrings and the field tables."""
    names: set[str] = set()
    for file in K8S_DIR.glob("*.py"):
        if file.name in NOT_READERS:
            continue
        tree = ast.parse(file.read_text())
        skip: set[int] = set()
        for node in ast.walk(tree):
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            if isinstance(node, ast.Assign | ast.AnnAssign) and any(
                isinstance(t, ast.Name) and t.id in TABLES for t in targets
            ):
                skip |= {id(n) for n in ast.walk(node)}
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                skip.add(id(node.value))  # a docstring
        names |= {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
        }
    return names


def test_every_spec_field_is_read():
    leaves = _spec_leaves()
    assert "faultTolerance.selfCheck.tests" in leaves and "etcd.managed" in leaves
    ft_leaves = {leaf.removeprefix("faultTolerance.") for leaf in leaves}
    ft_leaves = {leaf for leaf in ft_leaves if f"faultTolerance.{leaf}" in leaves}
    # the two tables cover faultTolerance exactly, once
    assert set(launch.FT_SETTINGS) | set(launch.FT_OTHER_READERS) == ft_leaves
    assert not set(launch.FT_SETTINGS) & set(launch.FT_OTHER_READERS)
    keys = {f.name for f in dataclasses.fields(config.FaultToleranceConfig)}
    assert set(launch.FT_SETTINGS.values()) <= keys
    # any other field is named by the operator's code (not only in its schema)
    code = _names_in_code()
    unread = [
        leaf
        for leaf in leaves
        if leaf.removeprefix("faultTolerance.") not in launch.FT_SETTINGS
        and leaf.rsplit(".", 1)[-1] not in code
    ]
    assert unread == []


def test_fault_tolerance_reaches_the_config_and_the_controller(tmp_path, monkeypatch):
    job = Job.from_body(example_jobs()["gpu-volcano"])
    settings = launch.fault_tolerance_settings(job.spec["faultTolerance"])
    assert settings == {
        "max_restarts": 10,
        "restart_window_s": 3600.0,
        "policy": "shrink",
        "selfcheck_tests": ["gpu", "host", "network"],
        "selfcheck_timeout_s": 240.0,
        "straggler_threshold": 1.15,
        "straggler_action": "evict",
    }
    cfg = config.load("tiny", launch.training_overrides(job)[: len(settings)])
    assert dataclasses.asdict(cfg.fault_tolerance) | settings == dataclasses.asdict(
        cfg.fault_tolerance
    )
    # the controller's pod: job.json is the section's base, its flags win
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(launch.job_policy(job)))
    monkeypatch.setenv(fault_tolerance_flags.JOB_SPEC_ENV, str(spec))
    args = _controller_args(job)
    ft = fault_tolerance_flags.fault_tolerance_of(
        args, fault_tolerance_flags.job_spec_fault_tolerance()
    )
    assert (ft.selfcheck_timeout_s, ft.selfcheck_tests) == (240.0, ["gpu", "host", "network"])
    assert (ft.policy, ft.straggler_action) == ("shrink", "evict")
    assert policy_for(4, 8, fault_tolerance=ft).selfcheck_timeout_s == 240.0


def _controller_args(job: Job) -> Any:
    from megascale.cli import build_parser

    argv = launch.controller_args(job)[1:]
    return build_parser().parse_args(["x" if a.startswith("$(") else a for a in argv])
