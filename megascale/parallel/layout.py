"""Where each rank sits in the 3D (data x pipeline x tensor) grid: pure rank math, no process groups.

The order is megatron-core's default ``"tp-cp-ep-dp-pp"`` with context and expert parallelism of
size 1: tensor-parallel rank varies fastest, then data-parallel, then pipeline::

    rank = tp + TP * (dp + DP * pp)

so the ranks of a tensor-parallel group are adjacent (one node's NVLink domain) and a pipeline
spans the whole job. Every ``*_groups()`` list equals, group for group and in the same order, what
``megatron.core.parallel_state.RankGenerator(...).get_ranks(...)`` returns for that order, so a
``Coord`` computed here names the same groups that ``parallel_state`` builds (golden-tested in
``tests/unit/test_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Coord(NamedTuple):
    """A rank's position: its index within its data-parallel, pipeline and tensor-parallel group."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """The 3D process layout of a job: ``world_size == tp * pp * dp``, validated on construction."""

    world_size: int
    """Number of training processes."""
    tp: int
    """Tensor-parallel size (fastest-varying in the rank number)."""
    pp: int
    """Pipeline-parallel size (slowest-varying)."""
    dp: int
    """Data-parallel size."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} = {value!r}: must be a positive integer")
        if self.tp * self.pp * self.dp != self.world_size:
            raise ValueError(
                f"Layout.world_size = {self.world_size}: must equal tp * pp * dp = "
                f"{self.tp} * {self.pp} * {self.dp} = {self.tp * self.pp * self.dp}"
            )

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> Layout:
        """The layout with ``dp = world_size / (tp * pp)``; ValueError when that does not divide."""
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise ValueError(
                f"tp * pp = {tp} * {pp}: must be positive and divide world_size = {world_size}"
            )
        return cls(world_size=world_size, tp=tp, pp=pp, dp=world_size // (tp * pp))

    def coords(self, rank: int) -> Coord:
        """The (dp, pp, tp) coordinates of global ``rank``."""
        self._check("rank", rank, self.world_size)
        return Coord(
            dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp), tp=rank % self.tp
        )

    def rank(self, *, dp: int, pp: int, tp: int) -> int:
        """The global rank at the given coordinates (the inverse of ``coords``)."""
        self._check("dp", dp, self.dp)
        self._check("pp", pp, self.pp)
        self._check("tp", tp, self.tp)
        return tp + self.tp * (dp + self.dp * pp)

    def tp_groups(self) -> list[list[int]]:
        """Tensor-parallel groups: ranks that split each layer's weights (adjacent ranks)."""
        return [
            [self.rank(dp=d, pp=p, tp=t) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Data-parallel groups: ranks that hold the same weights and average gradients."""
        return [
            [self.rank(dp=d, pp=p, tp=t) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """Pipelines: the ranks of each pipeline, first stage first."""
        return [
            [self.rank(dp=d, pp=p, tp=t) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def embedding_groups(self) -> list[list[int]]:
        """Per pipeline, its first and last stage (which share the tied word embedding's gradient);
        just the one rank when pp == 1, as megatron-core's ``default_embedding_ranks``."""
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.pp_groups()]

    def describe(self, rank: int) -> str:
        """``"rank 5 (dp=0, pp=1, tp=1)"``: how logs and reports name a rank."""
        c = self.coords(rank)
        return f"rank {rank} (dp={c.dp}, pp={c.pp}, tp={c.tp})"

    @staticmethod
    def _check(name: str, value: int, size: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
            raise ValueError(f"{name} = {value!r}: must be an integer in [0, {size})")
