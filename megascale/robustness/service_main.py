"""The controller process's entry: ``megascale controller``'s ``add_arguments``, ``main`` (its
options to a ``ServiceOptions``) and ``serve`` (one controller process, a
``service.ControllerService``, until the job ends). The process plumbing it shares with agents
and the launcher is in ``robustness.process``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
from pathlib import Path

from megascale.config import FaultToleranceConfig
from megascale.config_validate import NODE_LOSS_POLICIES, STRAGGLER_ACTIONS, straggler_problems
from megascale.robustness.process import (
    add_metrics_arguments,
    add_store_arguments,
    setup_logging,
    store_config,
)
from megascale.robustness.service import ControllerService
from megascale.robustness.service_options import ServiceOptions, policy_for, straggler_options
from megascale.robustness.store import Store, StoreConfig

logger = logging.getLogger(__name__)


# -- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="job id (the etcd key prefix)")
    parser.add_argument("--run-dir", required=True, help="where events.jsonl and logs go")
    parser.add_argument("--nodes", type=int, required=True, help="nodes per generation (M)")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node (K)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (names ranks)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--id", default=None, help="this controller's name (default host-pid)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="agents' (s)")
    add_fault_tolerance_arguments(parser)
    g = parser.add_argument_group("the training config (a shrink keeps its global batch)")
    g.add_argument("--vpp", type=int, default=1, help="parallel.vpp")
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="train.global_batch_size (default: any data-parallel size is accepted)",
    )
    g.add_argument("--micro-batch-size", type=int, default=1, help="train.micro_batch_size")
    parser.add_argument("--init-timeout", type=float, default=600.0, help="start-up stall (s)")
    add_metrics_arguments(parser)
    _add_controller_fault_tolerance_arguments(parser)
    add_store_arguments(parser)


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


def _add_controller_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
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


def main(args: argparse.Namespace) -> int:
    """``megascale controller``: lead (or stand by) until the job finishes or fails."""
    if args.straggler_threshold is not None and not args.straggler_threshold > 1.0:
        raise ValueError(f"--straggler-threshold {args.straggler_threshold}: must be > 1.0")
    ft = fault_tolerance_of(args, job_spec_fault_tolerance())
    policy = policy_for(
        args.nodes,
        args.nproc_per_node,
        tp=args.tp,
        pp=args.pp,
        heartbeat_interval=args.heartbeat_interval,
        fault_tolerance=ft,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        vpp=args.vpp,
        init_timeout_s=args.init_timeout,
        start_timeout_s=min(120.0, args.init_timeout),
    )
    name = args.id or f"{socket.gethostname()}-{os.getpid()}"
    opts = ServiceOptions(
        args.job,
        Path(args.run_dir),
        policy,
        name,
        args.heartbeat_interval,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        **straggler_options(ft),
    )
    return serve(opts, store_config(args), console_level=logging.INFO)


def serve(
    opts: ServiceOptions, store_cfg: StoreConfig, console_level: int = logging.WARNING
) -> int:
    """Run one controller process (logging to ``RUN_DIR/logs/controller_<id>.log``) until the
    job ends or SIGTERM/SIGINT; 0 iff the job finished."""
    log_file = opts.run_dir / "logs" / f"controller_{opts.candidate_id}.log"
    setup_logging(f"controller {opts.candidate_id}", log_file, console_level)
    retry = max(1.0, 2 * opts.heartbeat_interval)
    store = Store(dataclasses.replace(store_cfg, retry_s=retry, request_timeout_s=retry))
    service = ControllerService(store, opts)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stopping.set())
    return service.run()
