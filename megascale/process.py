"""Process plumbing shared by the agent, the controller and the launcher: the etcd command-line
options (``add_store_arguments``, ``store_config``, ``PASSWORD_ENV``), ``setup_logging``, the
``/metrics`` options (``add_metrics_arguments``), ``write_metrics_url`` (a process's
``/metrics`` URL published under RUN_DIR) and ``check_listen_address``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from megascale import runfiles
from megascale.etcd.store import StoreConfig

logger = logging.getLogger(__name__)

PASSWORD_ENV = "MEGASCALE_ETCD_PASSWORD"


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("etcd")
    g.add_argument("--endpoints", required=True, help="etcd endpoints: host:port or https://...")
    g.add_argument("--ca-file", default=None, help="PEM CA bundle of the etcd server (https)")
    g.add_argument("--cert-file", default=None, help="PEM client certificate (client-cert-auth)")
    g.add_argument("--key-file", default=None, help="PEM private key of --cert-file")
    g.add_argument(
        "--user",
        default=None,
        help=f"etcd user; the password is read from ${PASSWORD_ENV} or --password-file",
    )
    g.add_argument("--password-file", default=None, help="file holding the etcd password")


def store_config(args: argparse.Namespace, **kwargs: Any) -> StoreConfig:
    """The StoreConfig of ``add_store_arguments``' options (ValueError names a bad one)."""
    password = None
    if args.user is not None:
        if args.password_file:
            password = Path(args.password_file).read_text().strip()
        else:
            password = os.environ.get(PASSWORD_ENV)
        if password is None:
            raise ValueError(f"--user {args.user}: give the password in ${PASSWORD_ENV} or a file")
    return StoreConfig.parse(
        args.endpoints,
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
        username=args.user,
        password=password,
        **kwargs,
    )


def setup_logging(label: str, log_file: Path | None, console_level: int = logging.INFO) -> None:
    """``[label] time LEVEL name: message`` to stderr and, at INFO, to ``log_file``."""
    fmt = logging.Formatter(f"[{label}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(console_level)
    console.setFormatter(fmt)
    root.addHandler(console)
    if log_file is not None:
        runfiles.make_dir(log_file.parent)
        to_file = runfiles.LogFileHandler(log_file)
        to_file.setFormatter(fmt)
        root.addHandler(to_file)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-addr`` of ``megascale agent`` and ``megascale
    controller``: loopback and a free port by default (the local cluster); in a pod the operator
    passes a fixed, declared port on the pod's IP so that a cluster's Prometheus can scrape it."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus /metrics port (0: a free one, -1: disabled)",
    )
    parser.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address /metrics listens on (default 127.0.0.1; a pod's IP or 0.0.0.0 to be scraped)",
    )


def write_metrics_url(run_dir: Path, name: str, url: str) -> None:
    """Publish a process's ``/metrics`` URL as ``RUN_DIR/metrics/<name>.url`` (best effort).
    Written whole (``runfiles``): a reader never sees it empty or partial."""
    directory = run_dir / "metrics"
    try:
        runfiles.make_dir(directory)
        runfiles.write_text(directory / f"{name}.url", url + "\n")
    except OSError as e:
        logger.warning("could not write the metrics URL of %s: %s", name, e)


def check_listen_address(flag: str, addr: str) -> str:
    """``addr`` if this machine can listen on it, else ValueError (one line): every listener of a
    megascale process binds the address it is given, never every interface."""
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((addr, 0))
    except (OSError, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ValueError(
            f"{flag} {addr!r}: this machine cannot listen on it ({why}); give one of its own "
            "addresses (127.0.0.1 for a job on one machine)"
        ) from None
    return addr
