"""The config's ``fault_tolerance`` section: the one home of the fault-tolerance settings, read by
``megascale launch``, ``megascale controller`` (flags override it) and old keys still read."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from megascale import config
from megascale.cli import build_parser
from megascale.controller import fault_tolerance_flags
from megascale.controller.policy import policy_for

CONTROLLER = ["controller", "--job", "j", "--run-dir", "r", "--nodes", "2", "--nproc-per-node", "1"]
CONTROLLER += ["--endpoints", "127.0.0.1:2379"]


def test_old_straggler_keys_are_read_into_the_section_with_a_warning(tmp_path, caplog):
    path = tmp_path / "old.toml"
    path.write_text('[diagnostics]\nstraggler_threshold = 1.3\nstraggler_action = "evict"\n')
    with caplog.at_level(logging.WARNING, logger="megascale.config"):
        cfg = config.load(path)
    ft = cfg.fault_tolerance
    assert (ft.straggler_threshold, ft.straggler_action) == (1.3, "evict")
    assert (cfg.diagnostics.straggler_threshold, cfg.diagnostics.straggler_action) == (1.3, "evict")
    warnings = [r.getMessage() for r in caplog.records]
    assert f"{path}: diagnostics.straggler_threshold is deprecated, use " in warnings[0]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    text = config.to_toml(cfg)  # written under the new key only, and read back equal
    assert "[fault_tolerance]" in text and text.count("straggler_threshold") == 1
    again = tmp_path / "again.toml"
    again.write_text(text)
    assert config.load(again) == cfg


def test_the_new_key_wins_over_the_old_one(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text(
        "[diagnostics]\nstraggler_threshold = 1.3\n[fault_tolerance]\nstraggler_threshold = 1.2\n"
    )
    cfg = config.load(path, ["diagnostics.straggler_action=evict"])
    assert cfg.fault_tolerance.straggler_threshold == 1.2
    assert cfg.diagnostics.straggler_threshold == 1.2
    assert cfg.fault_tolerance.straggler_action == "evict"


def test_bad_fault_tolerance_values_are_named():
    cfg = config.load("tiny", ["fault_tolerance.straggler_threshold=0.9"])
    with pytest.raises(config.ConfigError, match=r"fault_tolerance.straggler_threshold = 0.9"):
        config.validate(cfg, 1, "gloo")
    cfg = config.load("tiny", ['fault_tolerance.selfcheck_tests=["gpu", "disk"]'])
    with pytest.raises(config.ConfigError, match=r"selfcheck_tests: 'disk' names no check"):
        config.validate(cfg, 1, "gloo")
    cfg = config.load("tiny", ['fault_tolerance.selfcheck_tests=["network", "host.disk_*"]'])
    config.validate(cfg, 1, "gloo")


def test_controller_flags_override_the_section_defaults():
    parser = build_parser()
    args = parser.parse_args(CONTROLLER)
    assert fault_tolerance_flags.fault_tolerance_of(args) == config.FaultToleranceConfig()
    args = parser.parse_args(
        [*CONTROLLER, "--max-restarts", "3", "--straggler-window", "6", "--selfcheck-timeout", "9"]
    )
    ft = fault_tolerance_flags.fault_tolerance_of(args)
    assert ft == dataclasses.replace(
        config.FaultToleranceConfig(), max_restarts=3, straggler_window=6, selfcheck_timeout_s=9.0
    )
    policy = policy_for(2, 1, fault_tolerance=ft)
    assert (policy.max_restarts, policy.selfcheck_timeout_s) == (3, 9.0)
    with pytest.raises(ValueError, match=r"^fault_tolerance.straggler_consecutive = 0: must be"):
        fault_tolerance_flags.fault_tolerance_of(
            parser.parse_args([*CONTROLLER, "--straggler-consecutive", "0"])
        )


def test_policy_defaults_are_the_sections():
    ft, policy = config.FaultToleranceConfig(), policy_for(2, 1)
    assert (policy.max_restarts, policy.restart_window_s, policy.node_loss_policy) == (
        ft.max_restarts,
        ft.restart_window_s,
        ft.policy,
    )
    assert (policy.evict_repeat_culprit, policy.selfcheck_timeout_s) == (
        ft.evict_repeat_culprit,
        ft.selfcheck_timeout_s,
    )
