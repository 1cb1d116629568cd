"""The ``megascale`` command. Thin: it parses arguments and calls into the package."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path

from megascale.config import ConfigError
from megascale.logs import quiet_expected_noise


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", default=None, help="TOML file or preset name (default: tiny)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable; wins over the file)",
    )


def _unusable_checkpoint(failed: Exception) -> str:
    """The one-line reason when the ranks refused to start on checkpoints they cannot load."""
    marker = "CheckpointUnusable: "
    for why in getattr(failed, "failures", {}).values():
        if marker in why:
            return why.split(marker, 1)[1].strip().splitlines()[0]
    return ""


def _train(args: argparse.Namespace) -> int:
    from megascale import config as config_mod
    from megascale.launcher import gpus, runlock
    from megascale.machine_check import check_machine, resolve_device

    gpus.prefer_nvml_checks()  # the ranks are forked from here: no CUDA init in this process

    job = config_mod.load(args.config, args.overrides)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # torchrun
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc_per_node
    try:
        device = resolve_device(job.train.device)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    # Refuse bad config before any process group starts.
    job = config_mod.validate(job, world, "nccl" if device == "cuda" else "gloo")
    _check_data(job)
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else world
    check_machine(job, device, ranks_here=here, started=launched)
    run_dir = Path(args.run_dir or _default_run_dir())
    if runlock.owns_job():  # held until this process exits; a torchrun restart waits for it
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        runlock.prepare_run_dir(run_dir, wait_s=30.0 if restarted else 0.0)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)

    from megascale.launcher.local import RankFailed, Stopped, run_local
    from megascale.train.checkpoint import CheckpointUnusable
    from megascale.train.run import run_rank

    try:
        if launched:
            run_rank(job, run_dir)
            return 0
        run_local(run_rank, world, (job, run_dir))
    except CheckpointUnusable as e:
        print(f"megascale: cannot start: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        logging.getLogger("megascale").error("%s", e)
        return 128 + e.signum
    except RankFailed as e:
        unusable = _unusable_checkpoint(e)
        if unusable:
            print(f"megascale: cannot start: {unusable}", file=sys.stderr)
            return 2
        logging.getLogger("megascale").error("%s", e)
        return 1
    print(f"run directory: {run_dir}")
    return 0


def _check_data(job) -> None:
    """Refuse unusable datasets (missing, truncated, another tokenizer, ids >= model.vocab_size)
    before any rank starts; the built-in corpus is checked by the ranks that build it."""
    if job.data.path is None and job.data.blend is None:
        return
    from megascale.data.dataset import check_data
    from megascale.data.indexed import DataError

    try:
        check_data(job, None, scan=True)
    except DataError as e:
        raise ConfigError(str(e)) from e


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def _default_run_dir() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{os.getpid()}")


def _mfu(args: argparse.Namespace) -> int:
    from megascale.diagnostics import flops

    return flops.run(args)


def _timeline(args: argparse.Namespace) -> int:
    from megascale.diagnostics import timeline_command

    return timeline_command.run(args)


def _report(args: argparse.Namespace) -> int:
    from megascale.diagnostics import report

    return report.run(args)


def _selfcheck(args: argparse.Namespace) -> int:
    from megascale.diagnostics import selfcheck

    return selfcheck.run(args)


def _dashboards(args: argparse.Namespace) -> int:
    from megascale.diagnostics import dashboards

    return dashboards.run(args)


def _agent(args: argparse.Namespace) -> int:
    from megascale.launcher import agent

    try:
        return agent.run_from_args(args)
    except ValueError as e:  # a bad --inject or etcd option
        print(f"megascale agent: {e}", file=sys.stderr)
        return 2


def _controller(args: argparse.Namespace) -> int:
    from megascale.robustness import service_main

    try:
        return service_main.main(args)
    except ValueError as e:
        print(f"megascale controller: {e}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    from megascale.launcher import cluster

    try:
        return cluster.launch(cluster.options_from_args(args))
    except (cluster.LaunchError, cluster.inject.InjectError) as e:
        print(f"megascale launch: {e}", file=sys.stderr)
        return 2


def _export(args: argparse.Namespace) -> int:
    from megascale import export

    try:
        done = export.export(args.run_dir, args.output, args.step)
    except export.ExportError as e:
        print(f"megascale export: {e}", file=sys.stderr)
        return 2
    print(
        f"exported step {done['step']} as {done['architecture']} to {done['output']} "
        f"(logits checked: max |diff| {done['max_abs_diff']:.1e} <= {export.TOLERANCE})"
    )
    return 0


def _data(args: argparse.Namespace) -> int:
    """``megascale data build|convert``: 0, or 1 with a one-line error naming the file/option."""
    from megascale.data import build, convert
    from megascale.data.indexed import DataError

    try:
        {"build": build.run, "convert": convert.run}[args.data_command](args)
    except (OSError, DataError) as e:
        print(f"megascale data {args.data_command}: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megascale", description="Fault-tolerant LLM pretraining on megatron-core."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a GPT (N local ranks, or one rank under torchrun)")
    _add_config_args(train)
    train.add_argument(
        "--nproc-per-node", type=_positive_int, default=1, help="local ranks to start"
    )
    train.add_argument("--run-dir", default=None, help="output directory (default: runs/DATE)")
    train.set_defaults(func=_train)

    mfu = sub.add_parser("mfu", help="model FLOPs per token and MFU for a config")
    from megascale.diagnostics import flops

    flops.add_arguments(mfu)
    mfu.set_defaults(func=_mfu)

    selfcheck_p = sub.add_parser(
        "selfcheck", help="node self-check: GPU, host, network; exit code 0 iff the node is fit"
    )
    from megascale.diagnostics import selfcheck

    selfcheck.add_arguments(selfcheck_p)
    selfcheck_p.set_defaults(func=_selfcheck)

    dashboards_p = sub.add_parser("dashboards", help="Grafana dashboards: export JSON or push")
    from megascale.diagnostics import dashboards

    dashboards.add_arguments(dashboards_p)
    dashboards_p.set_defaults(func=_dashboards)

    data = sub.add_parser("data", help="datasets in Megatron-LM's indexed format")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    build_p = data_sub.add_parser(
        "build", help="tokenize text/JSONL files (byte or Hugging Face tokenizer) into a dataset"
    )
    from megascale.data import build, convert

    build.add_arguments(build_p)
    build_p.set_defaults(func=_data)
    convert_p = data_sub.add_parser(
        "convert", help="rewrite an old megascale MSTOKEN token file in Megatron's format"
    )
    convert.add_arguments(convert_p)
    convert_p.set_defaults(func=_data)

    export_p = sub.add_parser("export", help="a trained run to a Hugging Face transformers model")
    from megascale import export

    export.add_arguments(export_p)
    export_p.set_defaults(func=_export)

    from megascale.diagnostics import report, timeline_command

    timeline_p = sub.add_parser(
        "timeline", help="merge every rank's timeline into one Chrome/Perfetto trace + CSV tables"
    )
    timeline_command.add_arguments(timeline_p)
    timeline_p.set_defaults(func=_timeline)
    report_p = sub.add_parser(
        "report", help="a self-contained HTML report: loss, MFU, stragglers, faults"
    )
    report.add_arguments(report_p)
    report_p.set_defaults(func=_report)

    launch_p = sub.add_parser(
        "launch", help="local fault-tolerant cluster: etcd, controller, M(+S) agents x K workers"
    )
    _add_config_args(launch_p)
    from megascale.launcher import cluster

    cluster.add_arguments(launch_p)
    launch_p.set_defaults(func=_launch)
    agent_p = sub.add_parser("agent", help="node agent: heartbeats, runs this node's workers")
    _add_config_args(agent_p)
    from megascale.launcher import agent

    agent.add_arguments(agent_p)
    agent_p.set_defaults(func=_agent)
    controller_p = sub.add_parser(
        "controller", help="robust-training controller (leader-elected; run 2 for a standby)"
    )
    from megascale.robustness import service_main

    service_main.add_arguments(controller_p)
    controller_p.set_defaults(func=_controller)
    operator_p = sub.add_parser(
        "operator", help="Kubernetes: the MegaScaleJob operator, its CRD, the node self-check label"
    )
    from megascale.k8s import command  # parsing only; kopf and lightkube load when one runs

    command.add_arguments(operator_p)
    operator_p.set_defaults(func=command.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_expected_noise()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        from megascale.launcher.runlock import RunDirError

        kind = "run directory" if isinstance(e, RunDirError) else "config error"
        print(f"megascale: {kind}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
