"""``megascale etcd``: the job's etcd for a job across machines, on the cluster network.

``megascale launch`` keeps its embedded etcd on loopback (one machine). Across machines, one host
runs ``megascale etcd --addr ITS_ADDRESS --run-dir RUN_DIR`` (the run directory on the shared
file system): a single-member etcd whose client listener binds that address only, with
authentication on before it listens on TCP (``EmbeddedEtcd``'s bootstrap on a private unix
socket), and the job's password in ``RUN_DIR/etcd.password`` (0600). The controller and every
agent then run with ``--endpoints ADDRESS:PORT --user root --password-file RUN_DIR/etcd.password``;
a process without the password can neither read nor write the job's keys. It prints one line with
the endpoint once etcd is healthy and runs until SIGTERM or SIGINT (data in ``RUN_DIR/etcd-data``,
kept: a restart on the same run directory serves the same keys with the same password).
"""

from __future__ import annotations

import argparse
import secrets
import signal
import threading
from pathlib import Path

from megascale import runfiles
from megascale.launcher.cluster import ETCD_PASSWORD_FILE, ETCD_USER, write_secret
from megascale.process import check_listen_address

DATA_DIR = "etcd-data"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--addr", default="127.0.0.1", help="address etcd listens on (the cluster network's)"
    )
    parser.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    parser.add_argument(
        "--run-dir", required=True, help="the job's run directory (password and data go there)"
    )


def main(args: argparse.Namespace) -> int:
    check_listen_address("--addr", args.addr)
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: expected a TCP port in 1..65535")
    runfiles.check_dir_path("--run-dir", args.run_dir)
    run_dir = Path(args.run_dir).resolve()
    runfiles.make_dir(run_dir)
    password_file = run_dir / ETCD_PASSWORD_FILE
    data_dir = run_dir / DATA_DIR
    if (data_dir / "member").exists() and password_file.exists():
        password = password_file.read_text().strip()  # the same keys, the same password
    else:
        password = secrets.token_urlsafe(32)
        write_secret(password_file, password)
    from megascale.etcd.server import EmbeddedEtcd

    etcd = EmbeddedEtcd(
        data_dir=data_dir,
        credentials=(ETCD_USER, password),
        host=args.addr,
        client_port=args.port,
        startup_timeout_s=60.0,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    etcd.start()
    try:
        print(
            f"megascale etcd: serving {etcd.endpoint} (user {ETCD_USER}, password in "
            f"{password_file})",
            flush=True,
        )
        while not stop.wait(1.0):
            if not etcd.running:
                print(f"megascale etcd: etcd exited: {etcd.log_tail(400)}", flush=True)
                return 1
    finally:
        etcd.stop()
    return 0
