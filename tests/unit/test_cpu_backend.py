"""The CPU backend (megascale/parallel/cpu_backend.py) and the guard against new megatron-core CUDA
call sites (megascale/parallel/mcore_cuda_sites.py, one snapshot per series in mcore_sites/).

Three kinds of check:

* static: the installed megatron-core, scanned line by line, has no CUDA call site beyond the
  snapshot the backend was reviewed against (removed ones only warn);
* the backend's redirections, one by one;
* dynamic: a real 1-process training run (4-rank TP2 x PP2 + SP under ``-m slow``) with recorders
  above the backend: every megatron-core line where a CUDA request was redirected, or a replaced
  ``torch.cuda`` function was called, is a snapshot site, and every megatron-core file that ran is
  in ``MODULES``. This catches what a line regex cannot: a device held in a variable, a helper
  module that joins the path.

Activation is process-global (a TorchFunctionMode, ``torch.cuda`` attributes, megatron-core's RNG
tracker global), so everything that activates runs in a forked child; the parent imports
megatron-core once (~8 s) and every fork reuses it.
"""

from __future__ import annotations

import ast
import collections
import functools
import json
import multiprocessing as mp
import re
import sys
import threading
import traceback
import warnings
from pathlib import Path

import megatron.core
import pytest
import torch
from megatron.core.tensor_parallel import random as mcore_random
from torch.overrides import TorchFunctionMode

from megascale.parallel import cpu_backend, mcore_cuda_sites
from megascale.parallel.mcore_cuda_sites import MODULES, SNAPSHOT, Site
from megascale.versions import megatron_core_problem, series

MCORE_ROOT = Path(megatron.core.__file__).resolve().parent
TORCH_ROOT = Path(torch.__file__).resolve().parent
VERSION = megatron.core.__version__


def run_forked(fn, *args, timeout_s: float = 120.0):
    """``fn(*args)`` in a forked child; its return value, or pytest.fail with the child's traceback."""
    ctx = mp.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            sender.send(("ok", fn(*args)))
        except BaseException:  # report everything, including assertion failures, to the parent
            sender.send(("error", traceback.format_exc()))

    proc = ctx.Process(target=child)
    proc.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            pytest.fail(
                f"{fn.__name__} did not finish in {timeout_s} s (exit code {proc.exitcode})"
            )
        status, value = receiver.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if status == "error":
        pytest.fail(f"{fn.__name__} failed in the forked child:\n{value}", pytrace=False)
    return value


# --------------------------------------------------------------------------------------------------
# Static: the snapshot against the installed megatron-core
# --------------------------------------------------------------------------------------------------


def test_the_installed_series_has_a_snapshot_taken_from_it():
    assert series(VERSION) in mcore_cuda_sites.snapshot_series(), (
        f"megatron-core {VERSION}: no snapshot in megascale/parallel/mcore_sites/"
    )
    assert series(mcore_cuda_sites.MCORE_VERSION) == series(VERSION)
    assert set(SNAPSHOT) == set(MODULES) and MODULES


def test_every_snapshot_names_its_series_and_lies_in_the_supported_range():
    for name in mcore_cuda_sites.snapshot_series():
        version, sites = mcore_cuda_sites.load_snapshot(name)
        assert series(version) == name and megatron_core_problem(version) is None, version
        assert sites and all(isinstance(lines, dict) for lines in sites.values())


def test_every_module_on_the_path_still_exists():
    missing = [m for m in MODULES if not (MCORE_ROOT / m).is_file()]
    if missing:
        pytest.fail(
            f"megatron-core {VERSION} no longer has {', '.join(missing)} (under {MCORE_ROOT}); "
            "the code on our path moved. Re-measure which files run during CPU training (see "
            "the docstring of megascale/parallel/mcore_cuda_sites.py), review "
            "megascale/parallel/cpu_backend.py and regenerate the snapshot (its --write drops "
            "files that are gone)."
        )


def test_installed_megatron_core_has_no_new_cuda_call_sites():
    added = mcore_cuda_sites.new_sites(MCORE_ROOT)
    if added:
        pytest.fail(mcore_cuda_sites.describe_new_sites(VERSION, added), pytrace=False)
    gone = mcore_cuda_sites.removed_sites(MCORE_ROOT)
    if gone:
        listing = "; ".join(f"{m}: {sorted(lines)}" for m, lines in gone.items())
        warnings.warn(
            f"megatron-core {VERSION} dropped CUDA call sites recorded in the snapshot ({listing}); "
            f"harmless, but regenerate megascale/parallel/mcore_sites/{series(VERSION)}.json",
            stacklevel=1,
        )


def _fake_mcore(tmp_path: Path, module: str, extra: str) -> Path:
    target = tmp_path / module
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text((MCORE_ROOT / module).read_text() + extra)
    return tmp_path


def test_guard_reports_a_new_site_with_file_line_and_text(tmp_path):
    module = "tensor_parallel/layers.py"
    root = _fake_mcore(
        tmp_path,
        module,
        '\n\ndef added():\n    """device="cuda" in a docstring is no call."""\n'
        "    # torch.cuda.synchronize() in a comment is none either\n"
        '    return torch.empty(4, device="cuda")  # a new call site\n',
    )
    lineno = len((root / module).read_text().splitlines())
    added = mcore_cuda_sites.new_sites(root, modules=(module,))
    assert added == [Site(module, lineno, 'return torch.empty(4, device="cuda")')]
    message = mcore_cuda_sites.describe_new_sites("0.99.0", added)
    assert message.startswith(
        "megatron-core 0.99.0 has CUDA call sites the CPU backend was not checked against; "
        "review megascale/parallel/cpu_backend.py and regenerate "
        "megascale/parallel/mcore_sites/0.99.json"
    )
    assert f'megatron/core/{module}:{lineno}: return torch.empty(4, device="cuda")' in message


def test_guard_reports_one_more_copy_of_a_known_line(tmp_path):
    module = "pipeline_parallel/p2p_communication.py"
    known = SNAPSHOT[module]["torch.cuda.synchronize()"]
    root = _fake_mcore(tmp_path, module, "\n\ndef added():\n    torch.cuda.synchronize()\n")
    added = mcore_cuda_sites.new_sites(root, modules=(module,))
    assert [s.text for s in added] == ["torch.cuda.synchronize()"] * (known + 1)


def test_guard_ignores_removed_sites(tmp_path):
    module = "transformer/utils.py"
    (tmp_path / module).parent.mkdir(parents=True)
    (tmp_path / module).write_text("import torch\n")
    assert mcore_cuda_sites.new_sites(tmp_path, modules=(module,)) == []
    assert mcore_cuda_sites.removed_sites(tmp_path, modules=(module,)) == {module: SNAPSHOT[module]}


def test_scan_patterns():
    source = (
        "import torch\n"
        "a = torch.zeros(1, device='cuda:0')\n"
        "b = x.cuda()\n"
        "if t.is_cuda: pass\n"
        "c = torch.empty(2, pin_memory=True)\n"
        "d = torch.device(f'cuda:{i}')\n"
        "e = torch.device('cpu')\n"
        "import scaled_softmax_cuda\n"
    )
    assert [n for n, _ in mcore_cuda_sites.find_sites(source)] == [2, 3, 4, 5, 6]


def test_render_round_trips():
    data = json.loads(mcore_cuda_sites.render(VERSION, SNAPSHOT))
    assert data == {"version": VERSION, "sites": SNAPSHOT}


# --------------------------------------------------------------------------------------------------
# The backend's redirections
# --------------------------------------------------------------------------------------------------


def test_activate_refuses_a_megatron_core_series_without_a_snapshot(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.15.3")
    before = torch.cuda.current_device
    backend = cpu_backend.CpuBackend()
    checked = ", ".join(mcore_cuda_sites.snapshot_series())
    with pytest.raises(
        RuntimeError,
        match=rf"megatron-core 0\.15\.3 is installed; the CPU backend was checked against "
        rf"megatron-core {re.escape(checked)} \(megascale supports >=0\.16\.1,<0\.20\)",
    ):
        backend.activate()
    assert not backend.active and torch.cuda.current_device is before


def _device_redirects() -> None:
    cpu_backend.activate()
    cpu = torch.device("cpu")
    for device in ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0):
        assert torch.empty(3, device=device).device == cpu, device
        assert torch.zeros(2, 2, device=device).device == cpu, device
        assert torch.tensor([1.0], device=device).device == cpu, device
    assert torch.cuda.current_device() == cpu
    assert torch.zeros(2, device=torch.cuda.current_device()).device == cpu
    # A CUDA build of torch asks is_available() before touching CUDA (Optimizer.step's graph
    # capture check, torch.accelerator): it must hear no, whatever device_count says.
    assert torch.cuda.is_available() is False and torch.cuda.device_count() == 1
    assert torch.accelerator.current_accelerator(check_available=True) is None
    t = torch.ones(3)
    assert t.cuda() is t
    assert t.to("cuda").device == cpu and t.to(device="cuda:0").device == cpu
    assert t.to("cuda", torch.float64).dtype == torch.float64
    assert t.type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1, dtype=torch.int64).type() == "torch.cuda.LongTensor"
    assert t.type(torch.float64).dtype == torch.float64  # a conversion is still a conversion
    assert torch.cuda.device_count() == 1
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        assert torch.empty(1, device="cuda").device == cpu


def test_cuda_device_requests_land_on_cpu():
    run_forked(_device_redirects)


def _activate_then_deactivate() -> None:
    names = list(cpu_backend._TORCH_CUDA_REPLACEMENTS)
    originals = {name: getattr(torch.cuda, name) for name in names}
    modes_before = len(torch.overrides._get_current_function_mode_stack())
    cpu_backend.activate()
    cpu_backend.activate()  # idempotent: one mode, one set of replacements
    assert cpu_backend.is_active()
    replaced = [getattr(torch.cuda, name) for name in names]
    assert all(r is not originals[n] for r, n in zip(replaced, names, strict=True))
    # Two torch.cuda attributes sharing one function object crash torch._dynamo.
    assert len({id(r) for r in replaced}) == len(replaced)
    assert len(torch.overrides._get_current_function_mode_stack()) == modes_before + 1
    cpu_backend.deactivate()
    assert not cpu_backend.is_active()
    assert all(getattr(torch.cuda, n) is originals[n] for n in names)
    assert len(torch.overrides._get_current_function_mode_stack()) == modes_before
    t = torch.ones(1)
    assert t.type() == "torch.FloatTensor"


def test_deactivate_restores_torch_cuda():
    run_forked(_activate_then_deactivate)


def _rng_tracker_behaviour() -> None:
    cpu_backend.activate()

    def dropout_mask() -> torch.Tensor:
        with mcore_random.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(torch.ones(256), p=0.5, training=True)

    torch.manual_seed(7)
    outer_reference = torch.rand(4)

    cpu_backend.seed_rng_tracker(1234, tp_rank=0)
    torch.manual_seed(7)
    first, second = dropout_mask(), dropout_mask()
    # The fork neither consumed nor reset the outer (default CPU) stream.
    assert torch.equal(torch.rand(4), outer_reference)
    # The tracked stream advances: the next fork draws a different mask.
    assert not torch.equal(first, second)

    cpu_backend.seed_rng_tracker(1234, tp_rank=0)  # reproducible from the seed
    assert torch.equal(dropout_mask(), first) and torch.equal(dropout_mask(), second)

    cpu_backend.seed_rng_tracker(1234, tp_rank=1)  # each TP rank its own model-parallel stream
    assert not torch.equal(dropout_mask(), first)

    tracker = mcore_random.get_cuda_rng_tracker()
    with pytest.raises(ValueError, match="never added"):
        with tracker.fork("no-such-stream"):
            pass
    # get_states/set_states (checkpointing) round-trip the tracked streams.
    cpu_backend.seed_rng_tracker(1234, tp_rank=0)
    dropout_mask()
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    expected = dropout_mask()
    tracker.set_states(saved)
    assert torch.equal(dropout_mask(), expected)


def test_rng_tracker_fork_is_reproducible_and_restores_the_outer_stream():
    run_forked(_rng_tracker_behaviour)


# --------------------------------------------------------------------------------------------------
# Dynamic: what megatron-core actually asks for during training
# --------------------------------------------------------------------------------------------------


def _is_torch_frame(filename: str) -> bool:
    return filename.startswith(str(TORCH_ROOT)) or filename == __file__


class _RedirectRecorder(TorchFunctionMode):
    """Pushed *above* the backend's mode, so it sees each call before the rewrite. Records the
    megatron-core line behind every call the backend redirects (same conditions as
    ``cpu_backend._CpuDeviceMode``)."""

    def __init__(self, sites: collections.Counter) -> None:
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if (
            func is torch.Tensor.cuda
            or (func is torch.Tensor.type and len(args) == 1 and not kwargs)
            or (device is not None and cpu_backend._is_cuda_device(device))
            or (func is torch.Tensor.to and len(args) > 1 and cpu_backend._is_cuda_device(args[1]))
        ):
            frame = sys._getframe(1)
            while frame is not None and _is_torch_frame(frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None:
                self.sites[frame.f_code.co_filename, frame.f_lineno] += 1
        return func(*args, **kwargs)


def _record_torch_cuda_calls(sites: collections.Counter) -> None:
    """Wrap the backend's ``torch.cuda`` replacements (functions only: a class must stay a class)
    to record the line that calls them. Each wrapper is its own function object."""

    def wrap(name: str, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            caller = sys._getframe(1)
            sites[caller.f_code.co_filename, caller.f_lineno] += 1
            return fn(*args, **kwargs)

        return recorded

    for name in cpu_backend._TORCH_CUDA_REPLACEMENTS:
        fn = getattr(torch.cuda, name)
        if not isinstance(fn, type):
            setattr(torch.cuda, name, wrap(name, fn))


def _train_recorded(job, run_dir: Path) -> dict:
    """One rank of a training run with the recorders on; what megatron-core did, by file and line."""
    from megascale.train.run import run_rank

    redirects: collections.Counter = collections.Counter()
    cuda_calls: collections.Counter = collections.Counter()
    executed: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name != "<module>":  # not import-time code
            executed.add(frame.f_code.co_filename)

    cpu_backend.activate()  # first, so that the recorder's mode sits above the backend's
    _record_torch_cuda_calls(cuda_calls)
    recorder = _RedirectRecorder(redirects)
    recorder.__enter__()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        run_rank(job, run_dir)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        recorder.__exit__(None, None, None)

    def in_mcore(sites: collections.Counter) -> dict:
        return {
            (str(Path(f).resolve().relative_to(MCORE_ROOT)), n): count
            for (f, n), count in sites.items()
            if Path(f).resolve().is_relative_to(MCORE_ROOT)
        }

    return {
        "redirects": in_mcore(redirects),
        "cuda_calls": in_mcore(cuda_calls),
        "executed": sorted(
            str(Path(f).resolve().relative_to(MCORE_ROOT))
            for f in executed
            if Path(f).resolve().is_relative_to(MCORE_ROOT)
        ),
    }


@functools.cache
def _site_lines(module: str) -> tuple[frozenset[int], tuple[tuple[int, int], ...]]:
    """(line numbers of CUDA sites, statement spans) of an installed megatron-core module. The span
    of a compound statement is its header only (``if x.type() == ...:``, not the whole block)."""
    source = (MCORE_ROOT / module).read_text()
    sites = frozenset(n for n, _ in mcore_cuda_sites.find_sites(source))
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body:
                end = max(node.lineno, body[0].lineno - 1)
            else:
                end = node.end_lineno or node.lineno
            spans.append((node.lineno, end))
    return sites, tuple(spans)


def _covered(module: str, lineno: int) -> bool:
    """Whether the innermost statement around ``lineno`` holds a snapshot CUDA site."""
    if module not in SNAPSHOT:
        return False
    sites, spans = _site_lines(module)
    around = [s for s in spans if s[0] <= lineno <= s[1]]
    if not around:
        return lineno in sites
    start, end = min(around, key=lambda s: s[1] - s[0])
    return any(start <= n <= end for n in sites)


def _check_recorded(results: list[dict]) -> None:
    problems = []
    executed = sorted({m for r in results for m in r["executed"]})
    for module in (m for m in executed if m not in MODULES):
        problems.append(f"  megatron/core/{module}: runs during CPU training but is not in MODULES")
    for kind in ("redirects", "cuda_calls"):
        sites = collections.Counter()
        for r in results:
            sites.update(r[kind])
        for (module, lineno), count in sorted(sites.items()):
            if not _covered(module, lineno):
                text = (MCORE_ROOT / module).read_text().splitlines()[lineno - 1].strip()
                problems.append(
                    f"  megatron/core/{module}:{lineno}: {text}  ({kind}: {count} times; "
                    "no snapshot site in this statement)"
                )
    if problems:
        pytest.fail(
            f"megatron-core {VERSION} has CUDA call sites the CPU backend was not checked against; "
            "review megascale/parallel/cpu_backend.py and regenerate "
            f"megascale/parallel/mcore_sites/{series(VERSION)}.json (measured while training on "
            "CPU; python -m megascale.parallel.mcore_cuda_sites --write --add-module FILE):\n"
            + "\n".join(problems),
            pytrace=False,
        )
    # The recorders saw something: a silent recorder would make this test vacuous.
    assert any(r["redirects"] for r in results) and any(r["cuda_calls"] for r in results)


def _train_job(nprocs: int, *overrides: str):
    from megascale import config

    job = config.load(
        "tiny", ["train.steps=2", "optim.warmup_steps=1", "train.log_interval=100", *overrides]
    )
    return config.validate(job, nprocs, "gloo")


def _run_ranks(nprocs: int, job, run_dir: Path) -> list[dict]:
    from megascale.launcher.local import run_local

    return run_local(_train_recorded, nprocs, (job, run_dir), timeout_s=300)


def test_training_asks_for_cuda_only_at_snapshot_sites(tmp_path):
    _check_recorded(_run_ranks(1, _train_job(1), tmp_path))


@pytest.mark.slow
def test_tp2_pp2_sp_training_asks_for_cuda_only_at_snapshot_sites(tmp_path):
    job = _train_job(4, "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true")
    _check_recorded(_run_ranks(4, job, tmp_path))
