"""``megascale train``: the training room's command. ``run`` is what ``megascale train`` does;
``main`` is the same command as a process entry point (the workers a node agent forks call it).
Heavy imports (torch, megatron) happen when it runs, not when it is parsed."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
from pathlib import Path

from megascale.config import ConfigError
from megascale.entry import refuse, run_command


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The job config of a command: ``CONFIG`` (file or preset) and repeatable ``--set``."""
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``megascale train``'s arguments."""
    add_config_arguments(parser)
    parser.add_argument(
        "--nproc-per-node", type=_positive_int, default=1, help="local ranks to start"
    )
    parser.add_argument("--run-dir", default=None, help="output directory (default: runs/DATE)")


def main(argv: list[str]) -> int:
    """``megascale train ARGV`` in this process (a worker's entry point)."""
    parser = argparse.ArgumentParser(prog="megascale train")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return run_command(parser, argv)


def _one_line_failure(failed: Exception) -> str:
    """The one-line reason when the ranks refused to start on checkpoints they cannot load,
    stopped because a checkpoint could not be written (a full or read-only disk), or found no
    room for the machine's data segment (a full /dev/shm); '' otherwise."""
    markers = (
        ("CheckpointUnusable: ", "cannot start: "),
        ("CheckpointError: ", ""),
        ("LoaderError: ", ""),
    )
    for marker, prefix in markers:
        for why in getattr(failed, "failures", {}).values():
            if marker in why:
                return prefix + why.rsplit(marker, 1)[1].strip().splitlines()[0]
    return ""


def run(args: argparse.Namespace) -> int:
    """``megascale train``: N local ranks, or this process as one rank under torchrun (its
    environment); 0 when training finished, 2 with one line when the checkpoints cannot be
    loaded or written or the data segment finds no room (``_one_line_failure``; under torchrun
    the rank's own error, also written to torchrun's error file)."""
    from megascale import config as config_mod
    from megascale import gpus
    from megascale.launcher import runlock
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

    from megascale.data.node_loader import LoaderError
    from megascale.launcher.local import RankFailed, Stopped, run_local
    from megascale.probes.fatal import RUN_DIR_ENV
    from megascale.train.checkpoint import CheckpointError, CheckpointUnusable
    from megascale.train.resident import REJOIN_DIR_ENV, run_resident
    from megascale.train.run import run_rank

    try:
        if launched and os.environ.get(REJOIN_DIR_ENV):  # a node agent's, in-process recovery
            run_resident(job, run_dir)
            return 0
        if launched:
            run_rank(job, run_dir)
            return 0
        run_local(run_rank, world, (job, run_dir))
    except CheckpointUnusable as e:
        return refuse(f"cannot start: {e}")
    except (CheckpointError, LoaderError) as e:
        if os.environ.get(RUN_DIR_ENV):  # a node agent's worker: its exit record tells the
            raise  # controller the job's error (the same exception on every rank)
        return refuse(str(e))  # under torchrun: this process is the rank
    except Stopped as e:
        logging.getLogger("megascale").error("%s", e)
        return 128 + e.signum
    except RankFailed as e:
        why = _one_line_failure(e)
        if why:
            return refuse(why)
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
