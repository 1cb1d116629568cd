"""The ``[fault_tolerance]`` section as command-line flags: ``add_fault_tolerance_arguments``
(shared by ``megascale launch`` and ``megascale controller``), the controller's own
(``add_controller_fault_tolerance_arguments``), ``fault_tolerance_of`` (the section with the
flags given applied) and the operator's job spec as the section's base
(``job_spec_fault_tolerance``, ``$MEGASCALE_JOB_SPEC``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from megascale.config import FaultToleranceConfig
from megascale.config.rules import NODE_LOSS_POLICIES, STRAGGLER_ACTIONS, straggler_problems

_FT = FaultToleranceConfig()  # the defaults, shown in --help

_SECTION_FLAGS = {
    "fault_policy": "policy",
    "max_restarts": "max_restarts",
    "restart_window": "restart_window_s",
    "node_wait_timeout": "node_wait_timeout_s",
    "straggler_threshold": "straggler_threshold",
    "straggler_action": "straggler_action",
    "straggler_window": "straggler_window",
    "straggler_consecutive": "straggler_consecutive",
    "evict_repeat_culprit": "evict_repeat_culprit",
    "selfcheck_timeout": "selfcheck_timeout_s",
}
"""Option (argparse dest) -> its key in the config's ``fault_tolerance`` section."""


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    """``--fault-policy``, ``--max-restarts``, ``--restart-window``, ``--node-wait-timeout``:
    overrides of the config's ``fault_tolerance`` section (None when not given; the section's
    defaults are its dataclass's, ``config.FaultToleranceConfig``)."""
    g = parser.add_argument_group("fault tolerance (overrides of the config's [fault_tolerance])")
    g.add_argument(
        "--fault-policy",
        choices=NODE_LOSS_POLICIES,
        help="a node lost with no spare: wait for a replacement, shrink to the nodes left (the "
        "largest data-parallel size allowed; grows back at the next restart), or fail "
        f"(default {_FT.policy})",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        help=f"restarts allowed within any --restart-window (default {_FT.max_restarts})",
    )
    g.add_argument(
        "--restart-window",
        type=float,
        help=f"the window --max-restarts counts restarts in (s; default {_FT.restart_window_s})",
    )
    g.add_argument("--node-wait-timeout", type=float, help="fail after waiting this long (s)")


def add_controller_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    """The rest of the ``fault_tolerance`` section, for ``megascale controller``."""
    g = parser.add_argument_group("stragglers and self-check (the config's [fault_tolerance])")
    g.add_argument(
        "--straggler-threshold",
        type=float,
        help="a node whose rank computes this many times its pipeline stage's median is a "
        f"straggler (> 1; default {_FT.straggler_threshold})",
    )
    g.add_argument(
        "--straggler-action",
        choices=STRAGGLER_ACTIONS,
        help="what to do about a persistent straggler: record a 'straggler' event (report), and "
        "also replace it with a spare node, restarting from the last checkpoint (evict) "
        f"(default {_FT.straggler_action})",
    )
    g.add_argument(
        "--straggler-window",
        type=int,
        help=f"compute times per rank in the sliding window (default {_FT.straggler_window})",
    )
    g.add_argument(
        "--straggler-consecutive",
        type=int,
        help=f"windows in a row a straggler must be slow (default {_FT.straggler_consecutive})",
    )
    g.add_argument(
        "--evict-repeat-culprit",
        type=int,
        help="evict a node named culprit in this many faults even if its self-check passes "
        f"(default {_FT.evict_repeat_culprit})",
    )
    g.add_argument(
        "--selfcheck-timeout",
        type=float,
        help=f"a node's self-check must report within this (s; default {_FT.selfcheck_timeout_s})",
    )


def fault_tolerance_of(
    args: argparse.Namespace, base: FaultToleranceConfig | None = None
) -> FaultToleranceConfig:
    """``base`` (default: the defaults) with the fault-tolerance options given in ``args``;
    ValueError naming the first bad one."""
    check_fault_tolerance_arguments(args)
    given = {
        key: getattr(args, dest)
        for dest, key in _SECTION_FLAGS.items()
        if getattr(args, dest, None) is not None
    }
    ft = dataclasses.replace(base or FaultToleranceConfig(), **given)
    problems = straggler_problems(ft, "fault_tolerance.")
    if problems:
        raise ValueError(problems[0])
    return ft


def check_fault_tolerance_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the first bad ``add_fault_tolerance_arguments`` option."""
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: must be an integer >= 0")
    if args.restart_window is not None and not args.restart_window > 0:
        raise ValueError(f"--restart-window {args.restart_window}: must be > 0 seconds")
    if args.node_wait_timeout is not None and not args.node_wait_timeout > 0:
        raise ValueError(f"--node-wait-timeout {args.node_wait_timeout}: must be > 0 seconds")


JOB_SPEC_ENV = "MEGASCALE_JOB_SPEC"
"""Set by the operator: its ``job.json`` (``k8s.launch.job_policy``), whose ``faultTolerance``
is the base of the controller's ``fault_tolerance`` section (its flags win)."""


def job_spec_fault_tolerance() -> FaultToleranceConfig | None:
    """The ``fault_tolerance`` section of ``$MEGASCALE_JOB_SPEC`` (None when unset); ValueError
    naming the file when it cannot be read."""
    path = os.environ.get(JOB_SPEC_ENV)
    if not path:
        return None
    from megascale.k8s.launch import fault_tolerance_settings

    try:
        spec = json.loads(Path(path).read_text())
        return FaultToleranceConfig(**fault_tolerance_settings(spec["faultTolerance"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"${JOB_SPEC_ENV} = {path!r}: not a readable job.json ({e})") from e
