"""The straggler model, one for the live controller and the offline analysis (pure).

The measure is each rank's *compute time* per step: its forward and backward compute measured on
the device (``megascale.probes.compute_time``), which holds neither pipeline bubbles nor time
waiting for peers, whether or not the host blocks in communication (it does not on NCCL). Ranks of
one pipeline stage (the same ``pp`` coordinate: the same layers and share of the batch) do the same
work; other stages may be naturally heavier (the embedding on the first, the LM head and loss on
the last). So:

* a rank's *score* is its compute time over the median of the *other* ranks of its stage
  (1.0 = even, 1.1 = 10% slow; ``stage_scores``). A rank alone in its stage (PP with DP = TP = 1)
  has no peer doing the same work and is not scored: never against another stage.
* a machine (node) is as slow as its slowest scored rank (the job runs at its pace;
  ``node_scores``). When a stage lies on one node, its ranks are still compared across DP and TP:
  a slow GPU is found; a whole machine evenly slow cannot be told from a heavier stage.

``StragglerTracker`` is the live use: a sliding window of the last ``window`` samples per rank
(fed through the heartbeats); each time every rank has a full window and a new sample, the scores
of the window medians are one *window*; a node above ``threshold`` in ``consecutive`` windows in
a row is flagged once (``observe`` returns it) until it recovers. The offline use
(``megascale.tools.straggler.analyze``) scores every step with ``stage_scores`` and flags a
rank slow in most analysed steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Mapping
from typing import TypeVar

from megascale.config import FaultToleranceConfig

_FT = FaultToleranceConfig()  # the defaults

K = TypeVar("K", bound=Hashable)


def stage_scores(
    compute: Mapping[K, float | None], stage: Mapping[K, int | None]
) -> dict[K, float]:
    """Each rank's compute time over the median of the other ranks' of its stage.

    ``compute[rank]`` in seconds, ``stage[rank]`` its pipeline stage. Ranks without a positive
    time or a stage, and ranks alone in their stage, get no score.
    """
    valid = {r: float(v) for r, v in compute.items() if v and v > 0 and stage.get(r) is not None}
    members: dict[int, list[K]] = {}
    for r in valid:
        members.setdefault(stage[r], []).append(r)
    out: dict[K, float] = {}
    for r, value in valid.items():
        others = [valid[p] for p in members[stage[r]] if p != r]
        if others:
            out[r] = value / statistics.median(others)
    return out


def node_scores(
    rank_scores: Mapping[K, float], node: Mapping[K, str]
) -> dict[str, tuple[float, K]]:
    """Node -> (its slowest scored rank's score, that rank)."""
    out: dict[str, tuple[float, K]] = {}
    for r, score in rank_scores.items():
        n = node[r]
        if n not in out or score > out[n][0]:
            out[n] = (score, r)
    return out


class StragglerTracker:
    """Sliding-window per-rank scores and persistent-straggler verdicts per node (live)."""

    def __init__(
        self,
        threshold: float = _FT.straggler_threshold,
        window: int = _FT.straggler_window,
        consecutive: int = _FT.straggler_consecutive,
    ) -> None:
        if threshold <= 1.0 or window < 1 or consecutive < 1:
            raise ValueError(f"threshold {threshold} > 1, window {window}, consecutive >= 1")
        self.threshold, self.window, self.consecutive = threshold, window, consecutive
        self._samples: dict[int, deque[float]] = {}
        self._fresh: dict[int, int] = {}
        self._node: dict[int, str] = {}
        self._stage: dict[int, int] = {}
        self._above: dict[str, int] = {}
        self._flagged: set[str] = set()
        self.rank_scores: dict[int, float] = {}
        """The last window's score of every scored rank."""
        self.scores: dict[str, float] = {}
        """The last window's score of every node with a scored rank (its slowest rank's)."""
        self.slowest: dict[str, int] = {}
        """Node -> its slowest scored rank in the last window."""

    def reset(self) -> None:
        """Forget every sample (a new generation: the ranks and their speeds changed)."""
        for d in (self._samples, self._fresh, self._node, self._stage, self._above):
            d.clear()
        self._flagged.clear()
        self.rank_scores, self.scores, self.slowest = {}, {}, {}

    def rank_nodes(self) -> dict[int, str]:
        """Rank -> the node it last reported from."""
        return dict(self._node)

    def observe(self, rank: int, node: str, stage: int | None, seconds: float | None) -> list[str]:
        """One new compute time of ``rank`` (on ``node``, in pipeline stage ``stage``); the
        nodes newly flagged as persistent stragglers."""
        if not seconds or seconds <= 0 or stage is None:
            return []
        self._node[rank], self._stage[rank] = node, int(stage)
        self._samples.setdefault(rank, deque(maxlen=self.window)).append(float(seconds))
        self._fresh[rank] = self._fresh.get(rank, 0) + 1
        if len(self._samples) < 2 or any(
            len(q) < self.window or self._fresh[r] < 1 for r, q in self._samples.items()
        ):
            return []
        # Every rank reported since the last window: close one window.
        self._fresh = dict.fromkeys(self._samples, 0)
        medians = {r: statistics.median(q) for r, q in self._samples.items()}
        self.rank_scores = stage_scores(medians, self._stage)
        by_node = node_scores(self.rank_scores, self._node)
        self.scores = {n: s for n, (s, _) in by_node.items()}
        self.slowest = {n: r for n, (_, r) in by_node.items()}
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
        """A node left (lost or evicted): its ranks' samples go too."""
        for rank in [r for r, n in self._node.items() if n == node]:
            for d in (self._samples, self._fresh, self._node, self._stage, self.rank_scores):
                d.pop(rank, None)
        for d in (self._above, self.scores, self.slowest):
            d.pop(node, None)
        self._flagged.discard(node)
