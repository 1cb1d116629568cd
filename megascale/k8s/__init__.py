"""Kubernetes: the MegaScaleJob custom resource, its operator, and the objects it makes.

* ``crd``: the CustomResourceDefinition as data (and the committed YAML generated from it).
* ``validation``: what the API server would say, offline: defaults, schema, CEL rules.
* ``job``: the MegaScaleJob as the builders read it; the labels, names and metadata they share.
* ``launch``: what the processes in the pods are given: flags, environment, resolved config.
* ``builders``: pure functions, job -> manifest dicts (etcd, controller, workers, RBAC, ...).
* ``status``: pure decisions: the status mirrored from etcd, evictions and pod replacement.
* ``operator``: the kopf handlers and the Kubernetes client (needs the ``k8s`` extra).

``megascale operator run|crd|selfcheck-label`` is wired here so that parsing needs no kopf.
"""

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
