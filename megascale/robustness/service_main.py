"""The controller process's entry: ``megascale controller``'s ``add_arguments``, ``main`` (its
options to a ``ServiceOptions``) and ``serve`` (one controller process, a
``service.ControllerService``, until the job ends). The process plumbing it shares with agents
and the launcher is in ``robustness.process``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
from pathlib import Path

from megascale.config_validate import NODE_LOSS_POLICIES, STRAGGLER_ACTIONS
from megascale.robustness.process import (
    add_metrics_arguments,
    add_store_arguments,
    setup_logging,
    store_config,
)
from megascale.robustness.service import ControllerService
from megascale.robustness.service_options import ServiceOptions, policy_for
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
    add_fault_tolerance_arguments(parser, defaults=True)
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
    parser.add_argument(
        "--straggler-threshold",
        type=float,
        default=1.10,
        help="a node whose rank computes this many times its pipeline stage's median is a "
        "straggler (> 1)",
    )
    parser.add_argument(
        "--straggler-action",
        choices=STRAGGLER_ACTIONS,
        default="report",
        help="what to do about a persistent straggler: record a 'straggler' event (report), and "
        "also replace it with a spare node, restarting from the last checkpoint (evict)",
    )
    add_store_arguments(parser)


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """``--fault-policy``, ``--max-restarts``, ``--restart-window``, ``--node-wait-timeout``
    (the config's ``fault_tolerance`` section). ``defaults=False`` leaves them None, for
    ``megascale launch``, where the config file supplies what is not given."""
    g = parser.add_argument_group("fault tolerance (the config's [fault_tolerance])")
    g.add_argument(
        "--fault-policy",
        choices=NODE_LOSS_POLICIES,
        default="wait" if defaults else None,
        help="a node lost with no spare: wait for a replacement, shrink to the nodes left (the "
        "largest data-parallel size allowed; grows back at the next restart), or fail",
    )
    g.add_argument(
        "--max-restarts",
        type=int,
        default=10 if defaults else None,
        help="restarts allowed within any --restart-window",
    )
    g.add_argument(
        "--restart-window",
        type=float,
        default=3600.0 if defaults else None,
        help="the window --max-restarts counts restarts in (s)",
    )
    g.add_argument(
        "--node-wait-timeout", type=float, default=None, help="fail after waiting this long (s)"
    )


def check_fault_tolerance_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the first bad ``add_fault_tolerance_arguments`` option."""
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: must be an integer >= 0")
    if args.restart_window is not None and not args.restart_window > 0:
        raise ValueError(f"--restart-window {args.restart_window}: must be > 0 seconds")
    if args.node_wait_timeout is not None and not args.node_wait_timeout > 0:
        raise ValueError(f"--node-wait-timeout {args.node_wait_timeout}: must be > 0 seconds")


def main(args: argparse.Namespace) -> int:
    """``megascale controller``: lead (or stand by) until the job finishes or fails."""
    check_fault_tolerance_arguments(args)
    policy = policy_for(
        args.nodes,
        args.nproc_per_node,
        tp=args.tp,
        pp=args.pp,
        heartbeat_interval=args.heartbeat_interval,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window,
        node_loss_policy=args.fault_policy,
        node_wait_timeout_s=args.node_wait_timeout,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        vpp=args.vpp,
        init_timeout_s=args.init_timeout,
        start_timeout_s=min(120.0, args.init_timeout),
    )
    name = args.id or f"{socket.gethostname()}-{os.getpid()}"
    if not args.straggler_threshold > 1.0:
        raise ValueError(f"--straggler-threshold {args.straggler_threshold}: must be > 1.0")
    opts = ServiceOptions(
        args.job,
        Path(args.run_dir),
        policy,
        name,
        args.heartbeat_interval,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        straggler_threshold=args.straggler_threshold,
        straggler_action=args.straggler_action,
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
