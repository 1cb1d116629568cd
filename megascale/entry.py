"""What every ``megascale`` command does around its work: logging to stderr, the known noise of
the libraries quieted, and a config error (or an unusable run directory) as one line, exit 2."""

from __future__ import annotations

import argparse
import logging
import sys

from megascale.config import ConfigError
from megascale.logs import quiet_expected_noise


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse ``argv`` with ``parser`` and run the parsed ``func``; its exit status, or 2 with a
    one-line message on stderr when it raised ``ConfigError``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_expected_noise()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        from megascale.launcher.runlock import RunDirError

        kind = "run directory" if isinstance(e, RunDirError) else "config error"
        print(f"megascale: {kind}: {e}", file=sys.stderr)
        return 2
