"""The ``megascale`` command. Thin: it parses arguments and calls into the package."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from megascale.entry import run_command
from megascale.train.command import add_arguments as add_train_arguments
from megascale.train.command import add_config_arguments
from megascale.train.command import run as run_train


def _mfu(args: argparse.Namespace) -> int:
    from megascale.probes import flops

    return flops.run(args)


def _timeline(args: argparse.Namespace) -> int:
    from megascale.tools import timeline_command

    return timeline_command.run(args)


def _report(args: argparse.Namespace) -> int:
    from megascale.tools import report

    return report.run(args)


def _selfcheck(args: argparse.Namespace) -> int:
    from megascale.agent.selfcheck import suite as selfcheck

    return selfcheck.run(args)


def _dashboards(args: argparse.Namespace) -> int:
    from megascale.tools import dashboards_command

    return dashboards_command.run(args)


def _agent(args: argparse.Namespace) -> int:
    from megascale.agent import service as agent

    try:
        return agent.run_from_args(args)
    except ValueError as e:  # a bad --inject or etcd option
        print(f"megascale agent: {e}", file=sys.stderr)
        return 2


def _etcd(args: argparse.Namespace) -> int:
    from megascale.etcd.server import EtcdStartError
    from megascale.launcher import etcd_command

    try:
        return etcd_command.main(args)
    except (ValueError, OSError, EtcdStartError) as e:  # bad --addr, --port, --run-dir; no etcd
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"megascale etcd: {first}", file=sys.stderr)
        return 2


def _controller(args: argparse.Namespace) -> int:
    from megascale.controller import command as controller_command

    try:
        return controller_command.main(args)
    except ValueError as e:
        print(f"megascale controller: {e}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    from megascale.launcher import cluster

    try:
        opts = cluster.options_from_args(args)
        if opts.slurm:
            from megascale.launcher import slurm

            return slurm.launch(opts)
        return cluster.launch(opts)
    except (cluster.LaunchError, cluster.inject.InjectError) as e:
        print(f"megascale launch: {e}", file=sys.stderr)
        return 2


def _export(args: argparse.Namespace) -> int:
    from megascale.tools import export

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


def _import(args: argparse.Namespace) -> int:
    from megascale.tools import hf_import

    try:
        done = hf_import.import_hf(args.hf_dir, args.out, args.config, args.overrides)
    except hf_import.ConversionError as e:
        print(f"megascale import: {e}", file=sys.stderr)
        return 2
    print(hf_import.model_section(done["job"]))
    print(
        f"imported {args.hf_dir} to {done['out']} (logits checked: max |diff| "
        f"{done['max_abs_diff']:.1e} <= {hf_import.TOLERANCE}); train it with: megascale train "
        f"{done['out']}/config.toml --run-dir {done['out']}"
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
    add_train_arguments(train)
    train.set_defaults(func=run_train)

    _add_tool_commands(sub)
    _add_process_commands(sub)
    return parser


def _add_tool_commands(sub: Any) -> None:
    """The node self-check and the tools that run on demand: mfu, selfcheck, dashboards, data,
    export, timeline, report."""
    mfu = sub.add_parser("mfu", help="model FLOPs per token and MFU for a config")
    from megascale.probes import flops

    flops.add_arguments(mfu)
    mfu.set_defaults(func=_mfu)

    selfcheck_p = sub.add_parser(
        "selfcheck", help="node self-check: GPU, host, network; exit code 0 iff the node is fit"
    )
    from megascale.agent.selfcheck import suite as selfcheck

    selfcheck.add_arguments(selfcheck_p)
    selfcheck_p.set_defaults(func=_selfcheck)

    dashboards_p = sub.add_parser("dashboards", help="Grafana dashboards: export JSON or push")
    from megascale.tools import dashboards_command

    dashboards_command.add_arguments(dashboards_p)
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
    from megascale.tools import export

    export.add_arguments(export_p)
    export_p.set_defaults(func=_export)
    import_p = sub.add_parser("import", help="a Hugging Face Llama model to a megascale run")
    from megascale.tools import hf_import

    hf_import.add_arguments(import_p)
    import_p.set_defaults(func=_import)

    from megascale.tools import report, timeline_command

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


def _add_process_commands(sub: Any) -> None:
    """The processes of a fault-tolerant job: launch, agent, controller, operator."""
    launch_p = sub.add_parser(
        "launch", help="local fault-tolerant cluster: etcd, controller, M(+S) agents x K workers"
    )
    add_config_arguments(launch_p)
    from megascale.launcher import cluster

    cluster.add_arguments(launch_p)
    launch_p.set_defaults(func=_launch)
    etcd_p = sub.add_parser(
        "etcd", help="the job's etcd on a cluster address, authenticated (a job across machines)"
    )
    from megascale.launcher import etcd_command

    etcd_command.add_arguments(etcd_p)
    etcd_p.set_defaults(func=_etcd)
    agent_p = sub.add_parser("agent", help="node agent: heartbeats, runs this node's workers")
    add_config_arguments(agent_p)
    from megascale.agent import service as agent

    agent.add_arguments(agent_p)
    agent_p.set_defaults(func=_agent)
    controller_p = sub.add_parser(
        "controller", help="robust-training controller (leader-elected; run 2 for a standby)"
    )
    from megascale.controller import command as controller_command

    controller_command.add_arguments(controller_p)
    controller_p.set_defaults(func=_controller)
    operator_p = sub.add_parser(
        "operator", help="Kubernetes: the MegaScaleJob operator, its CRD, the node self-check label"
    )
    from megascale.k8s import command  # parsing only; kopf and lightkube load when one runs

    command.add_arguments(operator_p)
    operator_p.set_defaults(func=command.main)


def main(argv: list[str] | None = None) -> int:
    """``megascale ARGV``: the sub-command's exit status; a config error is one line, exit 2."""
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
