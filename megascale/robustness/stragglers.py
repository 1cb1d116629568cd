"""Live straggler scoring from heartbeats (pure; the controller service feeds it).

Each heartbeat carries the node's compute time (``compute_time_s``: its slowest rank's last step
period minus the time it was blocked in communication; ``progress.py``). ``StragglerTracker`` keeps a
sliding window of the last ``window`` samples per node; a node's *score* is the median of its
window over the median of the other nodes' window medians (1.0 = even, 1.1 = 10% slow). Each time
every scored node has a full window, that is one *window*: a node above ``threshold`` in
``consecutive`` windows in a row is flagged once (``update`` returns it) until it recovers.

Why compute time: in synchronous training every rank's step *period* is the slowest one's; a
straggler shows as the rank that computes longest while its peers wait for it (as in the offline
analysis, ``megascale.diagnostics.straggler``). The tracker itself is agnostic: any per-node time.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping


def scores(samples: Mapping[str, float]) -> dict[str, float]:
    """Each node's value over the median of the others' (nodes with a positive value only)."""
    valid = {n: v for n, v in samples.items() if v and v > 0}
    out: dict[str, float] = {}
    for node, value in valid.items():
        others = [v for n, v in valid.items() if n != node]
        if others:
            out[node] = value / statistics.median(others)
    return out


class StragglerTracker:
    """Sliding-window straggler scores and persistent-straggler verdicts per node."""

    def __init__(self, threshold: float = 1.10, window: int = 4, consecutive: int = 3) -> None:
        if threshold <= 1.0 or window < 1 or consecutive < 1:
            raise ValueError(f"threshold {threshold} > 1, window {window}, consecutive >= 1")
        self.threshold, self.window, self.consecutive = threshold, window, consecutive
        self._samples: dict[str, deque[float]] = {}
        self._fresh: dict[str, int] = {}
        self._above: dict[str, int] = {}
        self._flagged: set[str] = set()
        self.scores: dict[str, float] = {}

    def reset(self) -> None:
        """Forget every sample (a new generation: the ranks and their speeds changed)."""
        self._samples.clear()
        self._fresh.clear()
        self._above.clear()
        self._flagged.clear()
        self.scores = {}

    def observe(self, node: str, seconds: float | None) -> list[str]:
        """One heartbeat's time; the nodes newly flagged as persistent stragglers."""
        if not seconds or seconds <= 0:
            return []
        self._samples.setdefault(node, deque(maxlen=self.window)).append(float(seconds))
        self._fresh[node] = self._fresh.get(node, 0) + 1
        if len(self._samples) < 2 or any(
            len(q) < self.window or self._fresh.get(n, 0) < 1 for n, q in self._samples.items()
        ):
            return []
        # Every node reported since the last window: close one window.
        self._fresh = {n: 0 for n in self._samples}
        self.scores = scores({n: statistics.median(q) for n, q in self._samples.items()})
        flagged = []
        for n, score in self.scores.items():
            if score >= self.threshold:
                self._above[n] = self._above.get(n, 0) + 1
                if self._above[n] >= self.consecutive and n not in self._flagged:
                    self._flagged.add(n)
                    flagged.append(n)
            else:
                self._above[n] = 0
                self._flagged.discard(n)
        return flagged

    def forget(self, node: str) -> None:
        """A node left (lost or evicted)."""
        for d in (self._samples, self._fresh, self._above, self.scores):
            d.pop(node, None)
        self._flagged.discard(node)
