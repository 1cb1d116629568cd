"""What every ``megascale`` command does around its work: logging to stderr, the known noise of
the libraries quieted, and a config error (or an unusable run directory) as one line, exit 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from megascale.config import ConfigError
from megascale.logs import quiet_expected_noise

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Set by torchrun for each worker: the file whose message its failure summary shows."""


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
        return refuse(f"{kind}: {e}")


def refuse(why: str) -> int:
    """Print ``megascale: WHY`` on stderr and return 2: one line, or one line per problem for
    a config with several (``config.validate``). Under torchrun the text is also this worker's
    error file, so torchrun's failure summary names it as the root cause instead of "To enable
    traceback see ..."."""
    line = f"megascale: {why.strip() or why}"
    # one write of the whole text: the ranks under torchrun share one stderr pipe, and print's
    # two writes (unbuffered under PYTHONUNBUFFERED) interleave with another rank's line
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        try:
            with open(error_file, "w") as f:  # torchrun's own file, not the run directory
                # torchrun's format: it shows "message" when there is no "py_callstack"
                info = {"timestamp": str(int(time.time()))}
                json.dump({"message": {"message": line, "extraInfo": info}}, f)
        except OSError as e:  # the line above is what matters; torchrun then says less
            logging.getLogger("megascale").warning("cannot write %s: %s", error_file, e)
    return 2
