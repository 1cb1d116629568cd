"""Node self-check: is this machine fit to train? The tests MegaScale runs before a node (re)joins.

Python API (the node agent runs it when the controller sends a ``selfcheck`` command)::

    from megascale.agent.selfcheck import SelfCheckOptions, run_selfcheck

    report = run_selfcheck(SelfCheckOptions(
        directory="/ckpt/job",                  # checkpoint directory: its disk is tested
        self_endpoint="10.0.0.5:29600",         # where this node listens for the neighbour test
        peers=["10.0.0.6:29600"],               # neighbours the controller paired it with
        overrides=["net.loopback_tcp=20"],      # thresholds, as --set
    ))
    report.ok            # True iff no check failed (skipped checks do not fail a node)
    report.failed        # names of the failed checks
    report.to_dict()     # {"node", "time", "profile", "ok", "failed", "checks": [CheckResult]}

``run_selfcheck`` blocks for a few seconds (``quick``: ~2x less; most of it is starting the
all-to-all worker processes), never raises for a failing check (an exception inside a check is
that check's ``fail`` with the error as detail), and raises ValueError before measuring anything
when a threshold file or override is invalid. Every network wait is bounded by ``net_timeout_s``.
It creates no global torch process group, so it is safe inside a long-lived process.

Neighbour all-reduce: every node of a group must be asked within ``net_timeout_s`` of the others,
each with its own ``self_endpoint`` and the others' as ``peers`` (the same set everywhere). The
group's ranks follow the sorted endpoints; the first endpoint's node hosts the rendezvous on that
port, so each node's ``PORT`` must be free there. A peer that never comes fails the check after
about ``net_timeout_s`` with a detail naming it.

Checks (``CheckResult.name``; thresholds in ``selfcheck.thresholds``, one per name):

- ``gpu.*`` (CUDA only, else ``skipped`` "no CUDA device"): ``count``, ``model``, ``ecc_errors``,
  ``retired_pages``, ``temperature``, ``clocks``, ``pcie_width``, ``pcie_gen``, ``nvlink`` from
  NVML (``nvidia-ml-py``; skipped with a reason when it is not installed), ``matmul`` (bf16
  TFLOP/s vs a fraction of the dense peak of ``flops.lookup_peak``) and ``memory_bandwidth``.
- ``host.memory_bandwidth`` (GB/s), ``host.disk_write`` (MB/s, fsync'd, in ``directory``),
  ``host.disk_free`` (GB).
- ``net.loopback_tcp@<address>`` (Gbit/s) for 127.0.0.1 and each local interface address;
  ``net.intranode_alltoall`` (GB/s bus bandwidth among ``local_procs`` processes: NCCL on GPUs,
  gloo on CPU); ``net.neighbour_allreduce`` (GB/s, gloo over TCP with ``peers``; skipped without).

Command line: ``megascale selfcheck [--json] [--quick] [--thresholds FILE] [--set K=V] ...``;
exit code 0 iff no check failed, 2 for bad arguments. ``--json`` prints ``to_dict()``.
``megascale selfcheck --calibrate --output FILE [--safety-factor 0.8]`` measures and writes the
figures as a thresholds file (``selfcheck.calibration``); it exits 0 once the file is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megascale.agent.check_result import (  # noqa: F401  (re-exported)
    FAIL,
    PASS,
    SKIPPED,
    CheckResult,
    judged,
    skipped,
)
from megascale.agent.selfcheck.names import (  # noqa: F401 (re-exported)
    CHECK_GROUPS,
    CHECK_NAMES,
    GPU_BENCH_CHECKS,
    GPU_NVML_CHECKS,
    check_patterns,
    selected,
    selected_checks,
)
from megascale.agent.selfcheck.thresholds import Thresholds, load_thresholds, profile_for_gpu

logger = logging.getLogger(__name__)

NO_CUDA = "no CUDA device"


@dataclass
class SelfCheckReport:
    """All results of one self-check run of one node."""

    node: str
    time: str
    """ISO 8601 UTC time the run started."""
    profile: str
    """the threshold profile (``cpu``, ``H100 SXM``, ...)."""
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "time": self.time,
            "profile": self.profile,
            "ok": self.ok,
            "failed": self.failed,
            "checks": [asdict(c) for c in self.checks],
        }

    def summary(self) -> str:
        """One line for an ack or a log: ``ok`` or the failed checks with their details."""
        if self.ok:
            return f"ok ({len(self.checks)} checks, profile {self.profile})"
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if c.status == FAIL)

    def table(self) -> str:
        """The human-readable report of ``megascale selfcheck``."""
        rows = [("check", "status", "measured", "threshold", "time", "detail")]
        for c in self.checks:
            value = "" if c.value is None else _fmt(c.value, c.unit)
            threshold = "" if c.threshold is None else f"{c.op} {_fmt(c.threshold, c.unit)}"
            detail = c.detail if len(c.detail) <= 90 else c.detail[:87] + "..."
            rows.append(
                (c.name, c.status.upper(), value, threshold, f"{c.duration_s:.2f}s", detail)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [f"self-check of {self.node} at {self.time} (thresholds: {self.profile})"]
        lines += ["  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows]
        verdict = "PASS" if self.ok else f"FAIL ({len(self.failed)}: {', '.join(self.failed)})"
        return "\n".join([*lines, f"result: {verdict}"])


def _fmt(value: float | str, unit: str) -> str:
    text = f"{value:.4g}" if isinstance(value, float | int) else str(value)
    return f"{text} {unit}".strip()


@dataclass
class SelfCheckOptions:
    """What to check and against what (see the module docstring for an example)."""

    quick: bool = False
    """smaller buffers and fewer iterations (about half the time, noisier figures)."""
    directory: str = "."
    """the checkpoint/run directory whose disk is tested (its nearest existing parent if absent)."""
    thresholds_file: str | None = None
    overrides: list[str] = field(default_factory=list)
    """``SECTION.KEY=VALUE`` threshold overrides; win over the file."""
    profile: str | None = None
    """threshold profile; None: from the hardware (``profile_for_gpu``)."""
    only: list[str] = field(default_factory=list)
    """shell patterns over check names (``net.*``); empty: every check."""
    local_procs: int | None = None
    """processes in the intra-node all-to-all; None: one per GPU, or 2 on CPU."""
    self_endpoint: str | None = None
    """``HOST:PORT`` this node uses for the neighbour all-reduce."""
    peers: list[str] = field(default_factory=list)
    """``HOST:PORT`` of the neighbours (pairs chosen by the controller); empty: skipped."""
    net_timeout_s: float = 30.0
    """deadline of each network measurement's rendezvous and transfer."""
    node: str = field(default_factory=socket.gethostname)


@dataclass
class _Context:
    options: SelfCheckOptions
    thresholds: Thresholds
    gpu_name: str | None
    gpu_count: int


def _nvml_gpu() -> tuple[str | None, int]:
    """(name of GPU 0, GPU count) from NVML, which creates no CUDA context (the GPUs may be busy
    training); (None, 0) without ``nvidia-ml-py``, a driver or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # not installed, no driver
        return None, 0
    try:
        count = pynvml.nvmlDeviceGetCount()
        if not count:
            return None, 0
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return (name.decode() if isinstance(name, bytes) else str(name)), count
    except pynvml.NVMLError:
        return None, 0
    finally:
        pynvml.nvmlShutdown()


def _uses_gpus(only: list[str]) -> bool:
    """Whether the selected checks use the GPUs themselves (CUDA, NCCL), not just NVML facts."""
    names = [n for names, _ in CHECKS for n in names]
    return any(
        selected((n,), only) for n in names if n.startswith("gpu.") or n == "net.intranode_alltoall"
    )


def _detect_gpu() -> tuple[str | None, int]:
    """(name of GPU 0, GPU count), or (None, 0) without CUDA; torch only where a driver is."""
    if not os.path.exists("/dev/nvidiactl"):
        return None, 0
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None, 0
    return torch.cuda.get_device_name(0), torch.cuda.device_count()


# -- host -----------------------------------------------------------------------------------------


def _host_memory_bandwidth(ctx: _Context) -> list[CheckResult]:
    import numpy as np

    start = time.perf_counter()
    nbytes = (64 if ctx.options.quick else 256) << 20
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)  # both touched: page faults are not measured
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return [
        judged(
            "host.memory_bandwidth",
            2 * nbytes / best / 1e9,
            "GB/s",
            ">=",
            ctx.thresholds.host.memory_bandwidth,
            f"numpy copy of {nbytes >> 20} MiB, read + write, best of 3",
            time.perf_counter() - start,
        )
    ]


def _existing(directory: str) -> Path:
    path = Path(directory).resolve()
    while not path.exists():
        path = path.parent
    return path


def _host_disk_write(ctx: _Context) -> list[CheckResult]:
    start = time.perf_counter()
    directory = _existing(ctx.options.directory)
    nbytes, block = (16 if ctx.options.quick else 64) << 20, os.urandom(4 << 20)
    fd, path = tempfile.mkstemp(prefix=".megascale-selfcheck-", dir=directory)
    try:
        t0 = time.perf_counter()
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return [
        judged(
            "host.disk_write",
            nbytes / elapsed / 1e6,
            "MB/s",
            ">=",
            ctx.thresholds.host.disk_write,
            f"{nbytes >> 20} MiB fsync'd to {directory}",
            time.perf_counter() - start,
        )
    ]


def _host_disk_free(ctx: _Context) -> list[CheckResult]:
    directory = _existing(ctx.options.directory)
    return [
        judged(
            "host.disk_free",
            shutil.disk_usage(directory).free / 1e9,
            "GB",
            ">=",
            ctx.thresholds.host.disk_free,
            str(directory),
        )
    ]


# -- network --------------------------------------------------------------------------------------


def _net_loopback(ctx: _Context) -> list[CheckResult]:
    import megascale.agent.selfcheck.net as selfcheck_net

    results = []
    nbytes = (32 if ctx.options.quick else 128) << 20
    for iface, address in selfcheck_net.loopback_addresses():
        start = time.perf_counter()
        name = f"net.loopback_tcp@{address}"
        try:
            bw = selfcheck_net.tcp_bandwidth(address, nbytes, ctx.options.net_timeout_s)
        except (OSError, selfcheck_net.NetCheckError) as e:
            results.append(CheckResult(name, FAIL, detail=f"{iface}: {e}"))
            continue
        results.append(
            judged(
                name,
                bw.value,
                bw.unit,
                ">=",
                ctx.thresholds.net.loopback_tcp,
                f"{iface}: {bw.detail}",
                time.perf_counter() - start,
            )
        )
    return results


def _bandwidth_check(name: str, threshold: float, measure: Callable[[], Any]) -> CheckResult:
    """Time ``measure()`` (a ``selfcheck_net.Bandwidth``); its NetCheckError is a failed check."""
    from megascale.agent.selfcheck.net import NetCheckError

    start = time.perf_counter()
    try:
        bw = measure()
    except NetCheckError as e:
        return CheckResult(name, FAIL, detail=str(e), duration_s=time.perf_counter() - start)
    return judged(name, bw.value, bw.unit, ">=", threshold, bw.detail, time.perf_counter() - start)


def _net_alltoall(ctx: _Context) -> list[CheckResult]:
    import megascale.agent.selfcheck.net as selfcheck_net

    name = "net.intranode_alltoall"
    gpus = ctx.gpu_count
    nprocs = ctx.options.local_procs or (gpus if gpus else 2)
    if nprocs < 2:
        return [skipped(name, f"{nprocs} local device(s): no all-to-all peers")]
    backend = "nccl" if gpus else "gloo"
    per_rank = ((256 if gpus else 4) if ctx.options.quick else (1024 if gpus else 16)) << 20
    return [
        _bandwidth_check(
            name,
            ctx.thresholds.net.intranode_alltoall,
            lambda: selfcheck_net.intranode_alltoall(
                nprocs, per_rank, backend, ctx.options.net_timeout_s
            ),
        )
    ]


def _net_neighbours(ctx: _Context) -> list[CheckResult]:
    import megascale.agent.selfcheck.net as selfcheck_net

    name = "net.neighbour_allreduce"
    o = ctx.options
    if not o.peers:
        return [skipped(name, "no neighbour endpoints given (the controller chooses them)")]
    if not o.self_endpoint:
        return [CheckResult(name, FAIL, detail="peers given without this node's self_endpoint")]
    nbytes = (4 if o.quick else 16) << 20
    return [
        _bandwidth_check(
            name,
            ctx.thresholds.net.neighbour_allreduce,
            lambda: selfcheck_net.neighbour_allreduce(
                o.self_endpoint, o.peers, nbytes, o.net_timeout_s
            ),
        )
    ]


# -- gpu ------------------------------------------------------------------------------------------


def _gpu_nvml(ctx: _Context) -> list[CheckResult]:
    if ctx.gpu_name is None:
        return [skipped(n, NO_CUDA) for n in GPU_NVML_CHECKS]
    import megascale.agent.selfcheck.gpu as selfcheck_gpu

    start = time.perf_counter()
    try:
        facts = selfcheck_gpu.read_nvml()
    except ImportError:
        return [skipped(n, "nvidia-ml-py is not installed") for n in GPU_NVML_CHECKS]
    return selfcheck_gpu.judge_facts(facts, ctx.thresholds.gpu, start)


def _gpu_bench(ctx: _Context) -> list[CheckResult]:
    if ctx.gpu_name is None:
        return [skipped(n, NO_CUDA) for n in GPU_BENCH_CHECKS]
    import megascale.agent.selfcheck.gpu as selfcheck_gpu

    return selfcheck_gpu.benchmark_checks(ctx.thresholds.gpu, ctx.gpu_name, ctx.options.quick)


CHECKS: list[tuple[tuple[str, ...], Callable[[_Context], list[CheckResult]]]] = [
    (GPU_NVML_CHECKS, _gpu_nvml),
    (GPU_BENCH_CHECKS, _gpu_bench),
    (("host.memory_bandwidth",), _host_memory_bandwidth),
    (("host.disk_write",), _host_disk_write),
    (("host.disk_free",), _host_disk_free),
    (("net.loopback_tcp",), _net_loopback),
    (("net.intranode_alltoall",), _net_alltoall),
    (("net.neighbour_allreduce",), _net_neighbours),
]
"""Every check, in the order it runs: (the names it reports, the function); the names are
``selfcheck_names.CHECK_NAMES``."""


def run_selfcheck(options: SelfCheckOptions | None = None) -> SelfCheckReport:
    """Run the selected checks and return the report (contract in the module docstring)."""
    options = options or SelfCheckOptions()
    # Host-only selections (the DaemonSet on a node that trains) never create a CUDA context.
    gpu_name, gpu_count = _detect_gpu() if _uses_gpus(options.only) else _nvml_gpu()
    profile = options.profile or profile_for_gpu(gpu_name)
    thresholds = load_thresholds(profile, options.thresholds_file, options.overrides)
    ctx = _Context(options, thresholds, gpu_name, gpu_count)
    report = SelfCheckReport(
        node=options.node,
        time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        profile=profile,
    )
    for names, fn in CHECKS:
        if not selected(names, options.only):
            continue
        start = time.perf_counter()
        try:
            results = fn(ctx)
        except Exception as e:  # a check that cannot measure is a failed check, not a crash
            logger.warning("self-check %s raised", names[0], exc_info=True)
            detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
            results = [CheckResult(names[0], FAIL, detail=detail)]
        for r in results:
            if not r.duration_s:
                r.duration_s = time.perf_counter() - start
            log = logger.warning if r.status == FAIL else logger.debug
            log("self-check %s: %s %s", r.name, r.status, r.detail)
        report.checks += results
    return report


# -- command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megascale selfcheck``."""
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true", help="smaller, faster measurements")
    parser.add_argument("--thresholds", metavar="FILE", help="TOML file of threshold overrides")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="CHECK=VALUE",
        help="override one threshold, e.g. host.disk_write=500 (repeatable; wins over the file)",
    )
    parser.add_argument("--profile", help="threshold profile (default: from the hardware)")
    parser.add_argument("--dir", default=".", help="checkpoint directory whose disk is tested")
    parser.add_argument(
        "--only", action="append", default=[], metavar="PATTERN", help="run matching checks"
    )
    parser.add_argument("--local-procs", type=int, help="processes in the intra-node all-to-all")
    parser.add_argument("--self-endpoint", metavar="HOST:PORT", help="this node, for neighbours")
    parser.add_argument(
        "--peer", action="append", default=[], metavar="HOST:PORT", help="a neighbour node"
    )
    parser.add_argument(
        "--net-timeout", type=float, default=30.0, help="seconds per network rendezvous"
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="write the measured figures to --output as a thresholds file (run on a healthy node)",
    )
    parser.add_argument("--output", metavar="FILE", help="where --calibrate writes")
    parser.add_argument(
        "--safety-factor",
        type=float,
        default=None,
        help="with --calibrate: thresholds = measured x this (default 0.8)",
    )


def run(args: argparse.Namespace) -> int:
    """``megascale selfcheck``: 0 iff no check failed, 1 if one did, 2 for bad arguments."""
    options = SelfCheckOptions(
        quick=args.quick,
        directory=args.dir,
        thresholds_file=args.thresholds,
        overrides=args.overrides,
        profile=args.profile,
        only=args.only,
        local_procs=args.local_procs,
        self_endpoint=args.self_endpoint,
        peers=args.peer,
        net_timeout_s=args.net_timeout,
    )
    try:
        if args.calibrate != bool(args.output) or (args.safety_factor and not args.calibrate):
            raise ValueError(
                "--calibrate needs --output FILE (and --output, --safety-factor need --calibrate)"
            )
        report = run_selfcheck(options)
        if args.calibrate:
            _write_calibration(report, args)
    except (ValueError, OSError) as e:  # bad thresholds file or override
        logger.error("megascale selfcheck: %s", e)
        return 2
    text = json.dumps(report.to_dict(), indent=2) if args.json else report.table()
    sys.stdout.write(text + "\n")
    if args.calibrate:  # a calibration run measures; it does not judge the node
        sys.stdout.write(f"calibration written to {args.output}\n")
        return 0
    return 0 if report.ok else 1


def _write_calibration(report: SelfCheckReport, args: argparse.Namespace) -> None:
    """``megascale selfcheck --calibrate``: the report's figures as a thresholds file."""
    import megascale.agent.selfcheck.calibration as cal

    factor = cal.DEFAULT_SAFETY_FACTOR if args.safety_factor is None else args.safety_factor
    cal.check_factor(factor, "--safety-factor")
    figures = cal.measured_figures(report.checks)
    if not figures:
        raise ValueError("--calibrate: no check measured a figure to calibrate")
    text = cal.calibration_toml(
        figures,
        safety_factor=factor,
        node=report.node,
        time=report.time,
        profile=report.profile,
        command="megascale selfcheck --calibrate" + (" --quick" if args.quick else ""),
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
