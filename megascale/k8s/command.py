"""``megascale operator run|crd|selfcheck-label``: the sub-commands, parsed without kopf or
lightkube (they load when a command runs, in ``operator``)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``megascale operator`` sub-commands."""
    sub = parser.add_subparsers(dest="operator_command", required=True)
    run = sub.add_parser("run", help="run the operator (kopf) against the current kube context")
    run.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable; default: all namespaces)",
    )
    run.add_argument(
        "--interval", type=float, default=10.0, help="seconds between status syncs of a job"
    )
    run.add_argument(
        "--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    sub.add_parser("crd", help="print the MegaScaleJob CustomResourceDefinition (YAML)")
    label = sub.add_parser(
        "selfcheck-label",
        help="run the node self-check and label the node megascale.io/selfcheck=passed|failed",
    )
    label.add_argument("--node", required=True, help="the Kubernetes node to label")
    label.add_argument(
        "--interval", type=float, default=3600.0, help="seconds between checks (default 1 h)"
    )
    label.add_argument("--timeout", type=float, default=600.0, help="seconds a check may take")
    label.add_argument("--once", action="store_true", help="check once; exit 0 iff it passed")
    label.add_argument(
        "selfcheck",
        nargs=argparse.REMAINDER,
        help="the self-check command after `--` (default: megascale selfcheck --json)",
    )


def main(args: argparse.Namespace) -> int:
    from megascale.k8s import operator

    if getattr(args, "selfcheck", None) and args.selfcheck[0] == "--":
        args.selfcheck = args.selfcheck[1:]
    return operator.main(args)
