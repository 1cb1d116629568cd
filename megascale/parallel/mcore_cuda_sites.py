"""The CUDA call sites of megatron-core on megascale's CPU paths: a snapshot and the scanner behind it.

``megascale/parallel/cpu_backend.py`` redirects megatron-core's CUDA assumptions to the CPU. It was
checked against the call sites recorded here, so a megatron-core upgrade that adds one must fail
loudly instead of training on CPU with a path nobody redirected. ``tests/unit/test_cpu_backend.py``
scans the installed megatron-core and compares it with ``SNAPSHOT``.

What is recorded:

* ``MODULES``: the megatron-core files (relative to ``megatron/core``) whose functions execute
  during CPU training. Measured with a call tracer on the ``tiny`` preset: 1 process; TP2 x PP2 x
  DP2 with sequence parallelism and the distributed optimizer (8 ranks); the same with interleaving
  (VPP2, unbatched p2p); PP2 with the parallel block, a sliding window and the plain optimizer (2
  ranks). All of the union, helpers included: a helper module that starts allocating on CUDA is as
  much a problem as ``schedules.py`` doing it. ``tests/unit/test_cpu_backend.py`` re-measures a
  1-process and a TP2 x PP2 + SP run and fails when megatron-core executes code in a file not
  listed here, or asks for CUDA on a line that is not a snapshot site.
* ``SNAPSHOT``: for every file in ``MODULES``, each source line matching ``CUDA_SITE`` (comments
  and docstrings blanked first), stripped, with how many times that exact line occurs. Keyed by text,
  not line number, so unrelated edits that shift lines do not trip the guard; a new line, or one more
  copy of a known line, does. Files with no site map to ``{}`` (checked, nothing found).

One snapshot per supported megatron-core series, in ``mcore_sites/<series>.json`` (``version``:
the release it was taken from; ``sites``: ``{module: {line: count}}``, its keys being ``MODULES``).
``MODULES``, ``SNAPSHOT`` and ``MCORE_VERSION`` below are those of the installed megatron-core's
series (empty when it has none: ``cpu_backend.activate`` then refuses).

Regenerate after reviewing ``cpu_backend.py`` against a new megatron-core::

    python -m megascale.parallel.mcore_cuda_sites --write [--add-module FILE ...]

which writes ``mcore_sites/<series>.json`` of the installed release; its modules are those of the
series' existing snapshot (or of the newest older one), plus ``--add-module`` files (the ones the
dynamic test reports as running but unlisted), minus files the release no longer has. Without
``--write`` the snapshot is printed.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from megascale.versions import megatron_core_version, release, series

CUDA_SITE = re.compile(
    r"\bcuda\.\w"  # torch.cuda.X, torch.backends.cuda.X, "torch.cuda.FloatTensor", cuda.bindings
    r"|\btorch\.cuda\b"  # torch.cuda itself: imported, passed around
    r"|\.cuda\("  # Tensor.cuda() / Module.cuda()
    r"|\.is_cuda\b"
    r"|\b_cuda_\w"  # torch._C._cuda_setRNGState and friends
    r"|f?[\"']cuda(?::[^\"']*)?[\"']"  # "cuda", 'cuda:0', f"cuda:{i}" (device=, device_type=)
    r"|pin_memory\s*=\s*True|\.pin_memory\("  # pinned host memory needs a CUDA runtime
)
"""A line that assumes CUDA. Deliberately broad: a false positive costs one snapshot line."""

SNAPSHOT_DIR = Path(__file__).with_name("mcore_sites")
"""One ``<series>.json`` per supported megatron-core series."""


def snapshot_series() -> list[str]:
    """The megatron-core series with a snapshot, oldest first (``["0.16", "0.19"]``)."""
    names = [p.stem for p in SNAPSHOT_DIR.glob("*.json")]
    return sorted(names, key=release)


def load_snapshot(series_name: str) -> tuple[str, dict[str, dict[str, int]]]:
    """``(version, {module: {line: count}})`` of ``series_name``'s snapshot; FileNotFoundError
    when that series has none."""
    data = json.loads((SNAPSHOT_DIR / f"{series_name}.json").read_text())
    return data["version"], data["sites"]


def _installed() -> tuple[str, dict[str, dict[str, int]]]:
    version = megatron_core_version()
    if version is None or series(version) not in snapshot_series():
        return "", {}
    return load_snapshot(series(version))


MCORE_VERSION, SNAPSHOT = _installed()
"""The snapshot of the installed megatron-core's series ("" and {} when it has none)."""
MODULES: tuple[str, ...] = tuple(SNAPSHOT)
"""megatron-core files (relative to ``megatron/core``) that run during CPU training (see above)."""


@dataclass(frozen=True)
class Site:
    """One CUDA call line in one file: ``path`` relative to ``megatron/core``, 1-based ``lineno``."""

    path: str
    lineno: int
    text: str


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers covered by string-only expression statements (docstrings and the like)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def code_lines(source: str) -> list[str]:
    """``source`` split into lines with comments removed and docstring lines emptied."""
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    for lineno in _docstring_lines(ast.parse(source)):
        lines[lineno - 1] = ""
    return lines


def find_sites(source: str) -> list[tuple[int, str]]:
    """``(lineno, stripped code)`` for every line of ``source`` that matches ``CUDA_SITE``."""
    return [
        (i, line.strip())
        for i, line in enumerate(code_lines(source), start=1)
        if CUDA_SITE.search(line)
    ]


def scan(mcore_root: str | Path, modules: tuple[str, ...] = MODULES) -> dict[str, dict[str, int]]:
    """``{module: {stripped line: count}}`` for ``modules`` under ``mcore_root`` (the directory of
    ``megatron/core``). Raises FileNotFoundError naming a module that is not there."""
    root = Path(mcore_root)
    result: dict[str, dict[str, int]] = {}
    for module in modules:
        sites = find_sites((root / module).read_text())
        result[module] = dict(sorted(Counter(text for _, text in sites).items()))
    return result


def new_sites(
    mcore_root: str | Path,
    snapshot: dict[str, dict[str, int]] | None = None,
    modules: tuple[str, ...] = MODULES,
) -> list[Site]:
    """Sites of the installed megatron-core that ``snapshot`` does not account for: a line text
    that is new, or more copies of a known one (then every copy is listed, since which one is new
    cannot be told). Sites that disappeared are not reported (see ``removed_sites``)."""
    snapshot = SNAPSHOT if snapshot is None else snapshot
    root = Path(mcore_root)
    found: list[Site] = []
    for module in modules:
        sites = find_sites((root / module).read_text())
        known = snapshot.get(module, {})
        counts = Counter(text for _, text in sites)
        found.extend(
            Site(module, lineno, text)
            for lineno, text in sites
            if counts[text] > known.get(text, 0)
        )
    return found


def removed_sites(
    mcore_root: str | Path,
    snapshot: dict[str, dict[str, int]] | None = None,
    modules: tuple[str, ...] = MODULES,
) -> dict[str, dict[str, int]]:
    """``{module: {line: copies gone}}``: snapshot sites no longer in the installed megatron-core."""
    snapshot = SNAPSHOT if snapshot is None else snapshot
    current = scan(mcore_root, modules)
    gone: dict[str, dict[str, int]] = {}
    for module in modules:
        now = current[module]
        lost = {
            t: n - now.get(t, 0) for t, n in snapshot.get(module, {}).items() if n > now.get(t, 0)
        }
        if lost:
            gone[module] = lost
    return gone


def describe_new_sites(version: str, sites: list[Site]) -> str:
    """The failure message for ``sites`` found in megatron-core ``version``."""
    listing = "\n".join(f"  megatron/core/{s.path}:{s.lineno}: {s.text}" for s in sites)
    return (
        f"megatron-core {version} has CUDA call sites the CPU backend was not checked against; "
        "review megascale/parallel/cpu_backend.py and regenerate "
        f"megascale/parallel/mcore_sites/{series(version)}.json "
        "(python -m megascale.parallel.mcore_cuda_sites --write):\n" + listing
    )


def render(version: str, snapshot: dict[str, dict[str, int]]) -> str:
    """The text of ``mcore_sites/<series>.json`` for ``snapshot`` taken from ``version``."""
    sites = {module: dict(sorted(snapshot[module].items())) for module in sorted(snapshot)}
    return json.dumps({"version": version, "sites": sites}, indent=1) + "\n"


def _modules_for(version: str, added: list[str], mcore_root: Path) -> tuple[str, ...]:
    """The modules of ``version``'s new snapshot: its series' (or the newest older series'),
    plus ``added``, minus files ``mcore_root`` no longer has."""
    older = [s for s in snapshot_series() if release(s) <= release(series(version))]
    base = list(load_snapshot(older[-1])[1]) if older else []
    return tuple(sorted(m for m in {*base, *added} if (mcore_root / m).is_file()))


def main(argv: list[str] | None = None) -> int:
    """Print (or with ``--write`` install) the snapshot of the installed megatron-core."""
    parser = argparse.ArgumentParser(prog="python -m megascale.parallel.mcore_cuda_sites")
    parser.add_argument("--write", action="store_true", help="write mcore_sites/<series>.json")
    parser.add_argument(
        "--add-module", action="append", default=[], metavar="FILE", help="a file to add"
    )
    args = parser.parse_args(argv)
    import megatron.core

    root = Path(megatron.core.__file__).parent
    version = megatron.core.__version__
    text = render(version, scan(root, _modules_for(version, args.add_module, root)))
    if not args.write:
        sys.stdout.write(text)
        return 0
    (SNAPSHOT_DIR / f"{series(version)}.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
