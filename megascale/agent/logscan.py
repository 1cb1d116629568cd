"""Reading the workers' output: error keywords, a peer's failure, notices.

Error keywords (``ERROR_PATTERNS``: CUDA error, NCCL error, segfault, OOM, a full disk, Python
traceback) are looked for only where an error can be (``error_text``): tracebacks, exception
lines, what the runtime prints, ERROR/CRITICAL log lines; never the job's own DEBUG/INFO/WARNING log lines (they
name the run directory, the data, the config), and never inside a path or a name (a run directory
``repro-OOM-fix`` is no fault). Notices (``NOTICE_PATTERNS``: a checkpoint that failed
verification) are read from every line. A line saying that a *peer* went away (``PEER_PATTERNS``:
gloo's "Connection closed by peer", NCCL's remote errors) marks the worker's errors and exit as
secondary: a symptom of another rank's fault, not a cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_B, _E = r"(?<![\w.-])", r"(?![\w-]|\.\w)"
"""Keyword boundaries: not inside an identifier, a dotted name or a hyphenated name
(``repro-OOM-fix``, ``OOM_set``, ``data.OOM.bin``)."""
ERROR_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        (
            "cuda_error",
            rf"{_B}CUDA error{_E}|{_B}(CUBLAS|CUDNN)_STATUS_[A-Z_]+{_E}|{_B}cudaError\w*{_E}",
        ),
        (
            "nccl_error",
            rf"{_B}(NCCL error|nccl(Internal|System|UnhandledCuda|Remote|InvalidUsage)Error){_E}",
        ),
        ("segfault", rf"{_B}(Segmentation fault|SIGSEGV|Fatal Python error){_E}"),
        ("oom", rf"{_B}([Oo]ut of memory|OOM){_E}|(?<![\w-])OutOfMemoryError{_E}"),
        ("storage_full", r"No space left on device|ENOSPC|\[Errno 28\]|Disk quota exceeded"),
        ("traceback", r"Traceback \(most recent call last\)"),
    )
)
"""Scanned only in lines that can carry an error (``error_text``), paths taken out first."""
STORAGE_FULL = dict(ERROR_PATTERNS)["storage_full"]
"""A full disk or quota (ENOSPC, EDQUOT): the job's storage, never evidence against a node; a
traceback whose exception says so is this kind too (``LogScanner``), and the controller ends the
job with it (a job-level fault: a spare would write to the same storage)."""
DEVICE_ERRORS = frozenset({"cuda_error", "nccl_error", "segfault", "oom"})
"""The ``ERROR_PATTERNS`` that are evidence against the node (its device, its memory)."""
PEER_PATTERNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crash|"
    r"remote process exited|NCCL communicator was aborted|Broken pipe"
)
NOTICE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("checkpoint_fallback", re.compile(r"skipping checkpoint")),
    ("resumed", re.compile(r"resumed from ")),  # the agent reports rank 0's only
)
EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
"""The line that ends a Python traceback (``RuntimeError: ...``), torch's ``[rankN]:`` prefix
allowed."""
OWN_LINE = re.compile(r"^\[rank \d+\] \S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
"""megascale's own log line (``megascale.logs``): ``[rank N] date time LEVEL name: message``."""
OWN_PREFIX = re.compile(r"^\[rank \d+\] \S+ \S+ [A-Z]+ [\w.]+: ")
"""``OWN_LINE``'s head with the logger's name: what comes before the message."""
_PATH = re.compile(r"\S*/\S*")


def error_text(line: str, paths: tuple[str, ...] = ()) -> str | None:
    """The part of a worker's output line that may carry an error, None when it cannot: the
    job's own DEBUG/INFO/WARNING log lines never do (they name the run directory, the data,
    the config). Other lines (ERROR/CRITICAL log lines, tracebacks, exception lines, what the
    runtime prints) come back without ``paths`` (the run directory...) and without any
    path-like token, so that a keyword inside a path cannot match."""
    own = OWN_LINE.match(line)
    if own and own.group(1) in ("DEBUG", "INFO", "WARNING"):
        return None
    for path in paths:
        if path:
            line = line.replace(path, " ")
    return _PATH.sub(" ", line)


def storage_full(text: str) -> bool:
    """Whether an error's text says its storage is full (``STORAGE_FULL``)."""
    return STORAGE_FULL.search(text) is not None


def error_kind(line: str, paths: tuple[str, ...] = ()) -> str | None:
    """The ``ERROR_PATTERNS`` name a worker's output line matches (see ``error_text``)."""
    text = error_text(line, paths)
    return None if text is None else _first_kind(text)


def _first_kind(text: str) -> str | None:
    return next((kind for kind, pattern in ERROR_PATTERNS if pattern.search(text)), None)


@dataclass
class LogMatch:
    kind: str  # an ERROR_PATTERNS or NOTICE_PATTERNS name
    text: str
    notice: bool = False


class LogScanner:
    """Reads what a worker appended to its output file since the last ``scan``."""

    def __init__(self, path: Path, max_bytes: int = 1 << 20, paths: tuple[str, ...] = ()) -> None:
        """``paths``: the job's own paths (its run directory), never read as keywords."""
        self.path, self.max_bytes = path, max_bytes
        self.paths = tuple(sorted(set(paths), key=len, reverse=True))
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = ""
        self.peer_failure = False
        """Whether the worker said a peer went away (its errors are then secondary)."""

    def scan(self) -> list[LogMatch]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(self.max_bytes)
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.partial + data.decode(errors="replace")).split("\n")
        self.partial = lines.pop()[-4096:]
        return self._match(lines)

    def flush(self) -> list[LogMatch]:
        """``scan`` plus the last line even if it has no newline (the worker has exited)."""
        matches = self.scan()
        last, self.partial = self.partial, ""
        return matches + self._match([last] if last else [])

    def _match(self, lines: list[str]) -> list[LogMatch]:
        matches = []
        for i, line in enumerate(lines):
            text = error_text(line, self.paths)
            if text is not None and PEER_PATTERNS.search(text):
                self.peer_failure = True
            kind = None if text is None else _first_kind(text)
            if kind is not None:
                if kind == "traceback":  # say which exception, if it is in this chunk
                    line = next((x for x in lines[i + 1 :] if EXCEPTION.match(x)), line)
                    kind = "storage_full" if storage_full(line) else kind
                if kind == "storage_full":  # the cause alone: it becomes the job's reason
                    line = OWN_PREFIX.sub("", line)
                matches.append(LogMatch(kind, line.strip()[:500]))
            for kind, pattern in NOTICE_PATTERNS:
                if pattern.search(line):
                    matches.append(LogMatch(kind, line.strip()[:500], notice=True))
        return matches
