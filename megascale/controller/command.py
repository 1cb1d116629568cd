"""The controller process's entry: ``megascale controller``'s ``add_arguments``, ``main`` (its
options to a ``ServiceOptions``; the ``[fault_tolerance]`` flags are ``fault_tolerance_flags``)
and ``serve`` (one controller process, a
``service.ControllerService``, until the job ends). The process plumbing it shares with agents
and the launcher is in ``process``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
from pathlib import Path

from megascale import runfiles
from megascale.controller.fault_tolerance_flags import (
    add_controller_fault_tolerance_arguments,
    add_fault_tolerance_arguments,
    fault_tolerance_of,
    job_spec_fault_tolerance,
)
from megascale.controller.policy import policy_for, straggler_options
from megascale.controller.service import ControllerService, ServiceOptions
from megascale.etcd.keys import check_name
from megascale.etcd.store import Store, StoreConfig
from megascale.process import (
    add_metrics_arguments,
    add_store_arguments,
    setup_logging,
    store_config,
)

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
    parser.add_argument(
        "--train-steps", type=int, default=None, help="train.steps (a heartbeat beyond is dropped)"
    )
    parser.add_argument(
        "--config-hash",
        default=None,
        help="the job's config hash (agents of another are refused; none: not checked)",
    )
    add_metrics_arguments(parser)
    add_controller_fault_tolerance_arguments(parser)
    add_store_arguments(parser)


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
    # Names that reach the file system (logs/controller_<id>.log) are checked before any write.
    check_name("--job", args.job)
    check_name("--id", name)
    runfiles.check_dir_path("--run-dir", args.run_dir)
    opts = ServiceOptions(
        args.job,
        Path(args.run_dir),
        policy,
        name,
        args.heartbeat_interval,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        **straggler_options(ft),
        train_steps=args.train_steps,
        config_hash=args.config_hash,
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
