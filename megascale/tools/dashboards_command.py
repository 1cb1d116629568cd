"""``megascale dashboards export|push``: the command line of ``tools.dashboards``. Kept apart so
that building ``megascale``'s parser never imports the Grafana SDK (a node that only trains or
self-checks need not have it)."""

from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("megascale.tools.dashboards")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``megascale dashboards export --out DIR`` and ``megascale dashboards push --url --token``."""
    sub = parser.add_subparsers(dest="dashboards_command", required=True)
    exp = sub.add_parser("export", help="write the dashboards' JSON files")
    exp.add_argument("--out", default="k8s/dashboards", help="directory (default: k8s/dashboards)")
    psh = sub.add_parser("push", help="create or overwrite the dashboards in a Grafana")
    psh.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    psh.add_argument("--token", help="service-account token (default: user:pass in the URL)")
    psh.add_argument("--folder-uid", help="Grafana folder to put them in")


def run(args: argparse.Namespace) -> int:
    """Run ``megascale dashboards ...``; 1 with a logged error when Grafana refuses."""
    from megascale.tools.dashboards import export, push

    if args.dashboards_command == "export":
        for path in export(args.out):
            sys.stdout.write(f"{path}\n")
        return 0
    from grafana_client.client import GrafanaException

    try:
        answers = push(args.url, args.token, args.folder_uid)
    except (GrafanaException, OSError) as e:
        logger.error("megascale dashboards push %s: %s", args.url, e)
        return 1
    for answer in answers:
        sys.stdout.write(f"{answer.get('uid')} {answer.get('status')} {answer.get('url', '')}\n")
    return 0
