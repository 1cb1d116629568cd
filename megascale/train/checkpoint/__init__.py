"""Checkpoints that any parallel layout can load: a two-stage save written manifest-last, and a
restart from the newest checkpoint every rank can verify.

The parts: ``save`` (``Checkpointer``: the two-stage save, pruning), ``load`` (finding and
loading the newest complete checkpoint), ``shards`` (every tensor under its global name and shape),
``format`` (the DCP files on disk), ``storage`` (a directory or an fsspec URL, host snapshots,
broadcasts), ``paths`` (where a manifest's files may be) and ``legacy`` (the older, layout-bound
format).
"""

from megascale.train.checkpoint.save import Checkpointer, CheckpointError, CheckpointUnusable

__all__ = ["CheckpointError", "CheckpointUnusable", "Checkpointer"]
