"""``megascale timeline RUN_DIR``: ``timeline.write_trace`` (the merged trace and the tables), then
the run's straggler summary (``straggler.analyze_run``), logged."""

from __future__ import annotations

import argparse
import logging
import sys

from megascale.tools import straggler
from megascale.tools.timeline import TimelineFileError, write_trace

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale timeline RUN_DIR [--out trace.json]``."""
    parser.add_argument("run_dir", help="the run directory (holds timeline/rank_*.jsonl)")
    parser.add_argument(
        "--out",
        default=None,
        help="trace file to write (default RUN_DIR/timeline/trace.json); the CSV tables go "
        "next to it",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``megascale timeline``; 1 with a logged error when the run has no timeline, 2 with one
    line when a file it would read is not a regular file."""
    try:
        trace, steps_csv, segments_csv = write_trace(args.run_dir, args.out)
    except FileNotFoundError as e:
        logger.error("megascale timeline: %s", e)
        return 1
    except TimelineFileError as e:
        print(f"megascale: timeline: {e}", file=sys.stderr)
        return 2
    logger.info("trace: %s (open in ui.perfetto.dev or chrome://tracing)", trace)
    logger.info("tables: %s, %s", steps_csv, segments_csv)
    for line in straggler.analyze_run(args.run_dir).describe():
        logger.info("%s", line)
    return 0
