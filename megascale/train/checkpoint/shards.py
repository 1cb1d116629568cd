"""What a layout-independent checkpoint holds: every tensor under its global name and global shape,
each rank contributing the pieces (boxes) of it that it holds.

The names and shapes come from megatron-core: ``sharded_state_dict()`` of each model chunk gives, for
every parameter, its checkpoint key (``module.decoder.layers.self_attention.linear_qkv.weight``, the
layers stacked along a leading axis whatever the pipeline split), its global shape, the offset of
this rank's tensor-parallel shard and whether this rank holds the main replica. The optimizer state
follows the model: for every parameter, ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``
with the parameter's global shape.

With the distributed optimizer a data-parallel rank holds a contiguous range of each parameter's
*flattened* local shard, which is not a box of the parameter in general. ``flat_range_boxes`` cuts
such a range into at most three boxes (a partial first row, whole rows, a partial last row), so
the saved optimizer state is a plain tensor of the parameter's shape that any layout can read: with
or without the distributed optimizer, at any TP, PP, VPP or DP size. (megatron-core 0.16's own
``fully_sharded_model_space`` format does this with a ``flattened_range`` that its torch backend no
longer accepts, and its ``fully_reshardable`` format gathers all optimizer state on DP rank 0.)

``Entry`` is one tensor of the checkpoint as this rank sees it; ``training_entries`` lists them for
a trainer, with live tensors (views into the parameters and optimizer state: loading copies into
them in place). ``to_dcp`` turns entries into torch ``ShardedTensor`` values that
``torch.distributed.checkpoint`` saves and loads.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

if TYPE_CHECKING:
    from megascale.train.trainer import Trainer

OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")


class LayoutError(ValueError):
    """The model or optimizer has something this checkpoint format cannot place (a message for the
    user names it)."""


@dataclass
class Entry:
    """One global tensor of the checkpoint: ``pieces`` are (global offset, live tensor) boxes this
    rank holds; ``main`` is False where another rank saves the same boxes (a replica)."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    main: bool = True


# --------------------------------------------------------------------------------------------------
# Boxes
# --------------------------------------------------------------------------------------------------


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple, tuple]]:
    """Cut the range ``[start, end)`` of a row-major tensor of ``shape`` into boxes.

    Returns (offset, size) per box, in range order; at most 3 boxes per dimension level (a partial
    leading block, whole blocks, a partial trailing block), recursively for more than 2 dims.
    """
    if start >= end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = 1
    for d in shape[1:]:
        inner *= d
    boxes: list[tuple[tuple, tuple]] = []
    row, pos = divmod(start, inner)
    if pos:  # partial first row
        stop = min(end, (row + 1) * inner)
        for off, size in flat_range_boxes(shape[1:], pos, stop - row * inner):
            boxes.append(((row, *off), (1, *size)))
        row, start = row + 1, stop
    whole = (end - start) // inner
    if whole and start < end:
        boxes.append(((row, *([0] * (len(shape) - 1))), (whole, *shape[1:])))
        row, start = row + whole, start + whole * inner
    if start < end:  # partial last row
        for off, size in flat_range_boxes(shape[1:], 0, end - start):
            boxes.append(((row, *off), (1, *size)))
    return boxes


def complement(shape: tuple[int, ...], boxes: list[tuple[tuple, tuple]]) -> Iterator[tuple]:
    """Boxes (offset, size) covering ``shape`` minus the given non-overlapping ``boxes``."""
    if not shape:
        return
    cuts = sorted({0, shape[0], *(o[0] for o, _ in boxes), *(o[0] + s[0] for o, s in boxes)})
    for lo, hi in itertools.pairwise(cuts):
        if lo >= hi or hi > shape[0]:
            continue
        inside = [(o[1:], s[1:]) for o, s in boxes if o[0] <= lo and hi <= o[0] + s[0]]
        if not inside:
            yield (lo, *([0] * (len(shape) - 1))), (hi - lo, *shape[1:])
        elif len(shape) > 1:
            for off, size in complement(shape[1:], inside):
                yield (lo, *off), (hi - lo, *size)


def to_dcp(entries: list[Entry], rank: int, world: int) -> dict[str, ShardedTensor]:
    """Entries as torch ShardedTensors (this rank's pieces as its local shards); built without
    communication. The rest of each tensor is described as held elsewhere, as torch requires a
    covering metadata; DCP writes and reads only the local shards.

    Each local shard is described as torch will find its tensor, or torch refuses it: placed on
    the piece's own device (``rank:{rank}/cuda:0`` for live GPU tensors, a synchronous save or a
    load; ``rank:{rank}/cpu`` for host copies), and pinned where the pieces are (the asynchronous
    save's host snapshot of GPU state). Raises ``LayoutError`` for an entry whose pieces differ in
    pinning (one ``TensorProperties`` describes them all)."""
    other = f"rank:{(rank + 1) % world}/cpu"  # metadata only: DCP never reads remote placements
    out = {}
    for entry in entries:
        shards, metas = [], []
        for offset, tensor in entry.pieces:
            meta = ShardMetadata(list(offset), list(tensor.shape), f"rank:{rank}/{tensor.device}")
            shards.append(Shard(tensor, meta))
            metas.append(meta)
        pinned = {tensor.is_pinned() for _, tensor in entry.pieces}
        if len(pinned) > 1:
            raise LayoutError(
                f"checkpoint entry {entry.key!r}: some of its pieces are in pinned memory and "
                "some are not; all or none must be"
            )
        boxes = [(tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in metas]
        for off, size in complement(entry.global_shape, boxes):
            metas.append(ShardMetadata(list(off), list(size), other))
        properties = TensorProperties(
            dtype=entry.dtype, layout=torch.strided, pin_memory=pinned == {True}
        )
        metadata = ShardedTensorMetadata(metas, torch.Size(entry.global_shape), properties)
        out[entry.key] = ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, sharded_tensor_metadata=metadata
        )
    return out


# --------------------------------------------------------------------------------------------------
# The model and optimizer as entries
# --------------------------------------------------------------------------------------------------


def _model_tensors(trainer: Trainer) -> Iterator:
    """(parameter, [(megatron-core ShardedTensor, its flat offset in the parameter)]) of every
    model chunk (keys are global across chunks).

    A SwiGLU fc1 weight comes as megatron-core's ``ShardedTensorFactory``: its local rows are this
    TP rank's gate rows then its up rows, which lie in two places of the global ``[gate; up]``
    tensor; the factory's two ShardedTensors (one key, views of the parameter's two halves)
    describe them."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    for chunk in trainer.model:
        for sh in nested_values(chunk.sharded_state_dict()):
            if isinstance(sh, ShardedObject):
                continue  # ``_extra_state`` of local modules: empty (TE's fp8 state is not kept)
            if isinstance(sh, ShardedTensorFactory) and sh.flattened_range is None:
                parts, offset = [], 0
                for part in sh.build():
                    if not isinstance(part, ShardedTensor) or part.key != sh.key:
                        break
                    parts.append((part, offset))
                    offset += part.data.numel()
                if offset == sh.data.numel():
                    yield sh.data, parts
                    continue
            if not isinstance(sh, ShardedTensor):
                raise LayoutError(
                    f"model state {getattr(sh, 'key', sh)!r} is a {type(sh).__name__}; this "
                    "checkpoint format places plain sharded tensors only"
                )
            yield sh.data, [(sh, 0)]


def _is_main(replica_id) -> bool:
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return all(i == 0 for i in ids)


def _local_origin(sh) -> tuple[int, ...]:
    return tuple(sh.global_offset)


def _box_entry(sh, key: str, tensor: torch.Tensor, boxes, main: bool) -> Entry:
    """An entry for ``key`` shaped like model tensor ``sh``; ``boxes`` are (offset, size) in
    ``sh``'s local shape, ``tensor`` holds their elements in flat order from the first box."""
    origin, prepend = _local_origin(sh), sh.prepend_axis_num
    entry = Entry(key, tuple(sh.global_shape), tensor.dtype, main=main)
    flat, pos = tensor.view(-1), 0  # a view: loading copies into the live tensor
    for off, size in boxes:
        n = 1
        for d in size:
            n *= d
        view = flat[pos : pos + n].view((1,) * prepend + tuple(size))
        glob = tuple(origin[:prepend]) + tuple(
            o + b for o, b in zip(origin[prepend:], off, strict=True)
        )
        entry.pieces.append((glob, view))
        pos += n
    return entry


VOCABULARY_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Tensors whose rows are the vocabulary, padded to a multiple of 128 x TP (with their optimizer
state): their padded size depends on the layout that saved them."""


def fit_vocabulary_rows(
    entries: list[Entry], saved: dict[str, tuple[int, ...]], vocab_size: int, alone: bool = False
) -> tuple[list[Entry], str]:
    """Entries to read a checkpoint whose vocabulary was padded to another size than here's (another
    TP): each vocabulary tensor is read with its saved shape, its rows clipped to the rows both
    paddings have; rows only this run's padding has are zeroed (padding rows take no part in the
    loss: ``model.gpt.mask_padded_vocabulary``). ``saved``: the checkpoint's global shapes by key.
    ``alone``: this is the only process (torch needs every part of a tensor placed on a rank, so the
    saved rows beyond this run's padding are read into a scratch piece here). Returns the entries (the others unchanged) and a note for the log ('' when nothing differed)."""
    out, note = [], ""
    for entry in entries:
        shape = saved.get(entry.key)
        here = entry.global_shape
        if (
            shape is None
            or tuple(shape) == here
            or not entry.key.endswith(VOCABULARY_ROWS)
            or tuple(shape[1:]) != here[1:]
            or min(shape[0], here[0]) < vocab_size
        ):
            out.append(entry)
            continue
        keep = min(shape[0], here[0])
        fitted = Entry(entry.key, tuple(shape), entry.dtype, main=entry.main)
        for offset, view in entry.pieces:
            rows = max(0, min(view.shape[0], keep - offset[0]))
            view[rows:].zero_()
            if rows:
                fitted.pieces.append((offset, view[:rows]))
        if alone and shape[0] > keep and entry.pieces:
            like = entry.pieces[0][1]
            scratch = torch.empty(
                (shape[0] - keep, *shape[1:]), dtype=like.dtype, device=like.device
            )
            fitted.pieces.append(((keep, *([0] * (len(shape) - 1))), scratch))
        out.append(fitted)
        note = (
            f"the vocabulary was padded to {shape[0]} rows there and {here[0]} here: rows from "
            f"{keep} on start at zero (padding rows are masked out of the loss)"
            if here[0] > shape[0]
            else f"the vocabulary was padded to {shape[0]} rows there and {here[0]} here: "
            f"padding rows from {keep} on are dropped"
        )
    return out, note


def training_entries(trainer: Trainer, *, saving: bool = False) -> list[Entry]:
    """The model parameters and the optimizer state of this rank, as live views (the optimizer
    state is allocated first if no step has been taken).

    Loading (``saving=False``): every model parameter whole, as every rank needs it. Saving: a
    parameter the distributed optimizer shards is saved by each DP rank for the range it updates
    (its part of the parameter buffer is current right after ``optimizer.step()``), so a save needs
    no parameter all-gather and no DP rank writes more than its share."""
    ensure_optimizer_state(trainer)
    inners = list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))
    optimizer = [(inner, *item) for inner in inners for item in _optimizer_states(inner)]
    sharded = {id(p): r for inner, p, r, _ in optimizer if saving and hasattr(inner, "gbuf_ranges")}
    by_range = saving and any(hasattr(inner, "gbuf_ranges") for inner in inners)
    params, entries = {}, []
    for data, parts in _model_tensors(trainer):
        params[data] = parts
        if by_range:  # no range of this parameter here: other DP ranks save it
            start, end = sharded.get(id(data), (0, 0))
            flat = data.detach().view(-1)
        else:
            start, end, flat = 0, data.numel(), data.detach().view(-1)
        for sh, lo, hi, at in _part_ranges(parts, start, end):
            main = _is_main(tuple(sh.replica_id)[:2] if by_range else sh.replica_id)
            boxes = flat_range_boxes(tuple(sh.local_shape), lo, hi)
            entries.append(_box_entry(sh, sh.key, flat[start + at : end], boxes, main))
    for _inner, param, (start, end), states in optimizer:
        parts = params.get(param)
        if parts is None:
            raise LayoutError(
                f"an optimizer parameter of shape {tuple(param.shape)} is not "
                "in the model's sharded state dict"
            )
        for sh, lo, hi, at in _part_ranges(parts, start, end):
            main = _is_main(tuple(sh.replica_id)[:2])  # DP ranks hold different ranges
            boxes = flat_range_boxes(tuple(sh.local_shape), lo, hi)
            for name, tensor in states.items():
                key = f"optimizer.state.{name}.{sh.key}"
                view = tensor.detach().view(-1)[at:]
                entries.append(_box_entry(sh, key, view, boxes, main))
    return _merge(entries)


def _part_ranges(parts: list, start: int, end: int) -> Iterator[tuple]:
    """For the flat range ``[start, end)`` of a parameter: (ShardedTensor, its own flat range lo,
    hi, where that part begins in the range) for each part the range touches."""
    for sh, offset in parts:
        lo, hi = max(start, offset), min(end, offset + sh.data.numel())
        if lo < hi:
            yield sh, lo - offset, hi - offset, lo - start


def _merge(entries: list[Entry]) -> list[Entry]:
    """One entry per key (a parameter's optimizer state can come from several buckets)."""
    merged: dict[str, Entry] = {}
    for e in entries:
        if e.key in merged:
            merged[e.key].pieces.extend(e.pieces)
        else:
            merged[e.key] = e
    return list(merged.values())


def _optimizer_states(inner) -> Iterator[tuple[torch.Tensor, tuple[int, int], dict]]:
    """(model param, (start, end) of its flat local shard held here, {state name: flat tensor})."""
    if hasattr(inner, "gbuf_ranges"):  # megatron-core's DistributedOptimizer
        for gbuf_range_maps in inner.gbuf_ranges:
            for range_maps in gbuf_range_maps.values():
                for range_map in range_maps:
                    for param, ranges in range_map["param_map"].items():
                        r = ranges["param"]
                        got = inner._get_main_param_and_optimizer_states(param)
                        states = {"fp32_param": got["param"]}
                        states.update({k: got[k] for k in OPTIMIZER_STATES})
                        yield param, (r.start, r.end), states
        return
    for param, main in _main_param_pairs(inner):
        state = inner.optimizer.state[main]
        states = {"fp32_param": main, **{k: state[k] for k in OPTIMIZER_STATES}}
        yield param, (0, param.numel()), states


def _main_param_pairs(inner) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(model param, its fp32 main param) of a non-distributed megatron-core optimizer."""
    if hasattr(inner, "float16_groups"):  # Float16OptimizerWithFloat16Params
        for low, main in zip(inner.float16_groups, inner.fp32_from_float16_groups, strict=True):
            yield from zip(low, main, strict=True)
        for group in inner.fp32_from_fp32_groups:
            yield from ((p, p) for p in group)
        return
    for group in inner.optimizer.param_groups:  # FP32Optimizer: the model params are the main ones
        yield from ((p, p) for p in group["params"])


def _inner_optimizers(trainer: Trainer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers under megatron-core's wrapper (one per chained optimizer)."""
    for inner in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        yield inner.optimizer


# Where the step count lives depends on the optimizer: torch's Adam/AdamW and megascale's LAMB keep
# it per parameter (``state[p]["step"]``, a tensor); Transformer Engine's FusedAdam (what
# megatron-core builds when TE imports) and apex's keep it per group only (``group["step"]``, an
# int, created by the first step and never written per parameter). Each reads its own place and
# ignores the other, so the functions below write both and read the larger: the place the
# optimizer advances is ahead of the one it never touches.


def ensure_optimizer_state(trainer: Trainer) -> None:
    """Allocate the optimizer's state where no step has made it yet, as the first step would
    (zero moments, step 0), so that a save or load has tensors to copy from or into. The group's
    count is left as it is: an optimizer that counts per group creates it at its first step."""
    for opt in _inner_optimizers(trainer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                for name in OPTIMIZER_STATES:
                    if name not in state:
                        state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)


def optimizer_step_count(trainer: Trainer) -> float:
    """The optimizer's step count (every parameter has taken the same steps); 0 before any. The
    larger of the per-parameter and the per-group counts (see above), so an optimizer that counts
    per group is read right although ``ensure_optimizer_state`` planted per-parameter zeros."""
    count = 0.0
    for opt in _inner_optimizers(trainer):
        for group in opt.param_groups:
            if group["params"] and "step" in group:  # TE does not count for an empty group
                count = max(count, float(group["step"]))
            for p in group["params"]:
                if "step" in opt.state.get(p, {}):
                    count = max(count, float(opt.state[p]["step"]))
    return count


def set_optimizer_step_count(trainer: Trainer, step: float) -> None:
    """Set the step count in both places (see above), a fresh group's included: every group's
    ``step`` (an int), and every parameter's as separate tensors (torch's AdamW increments in
    place). Call after ``ensure_optimizer_state``, before the next step."""
    for opt in _inner_optimizers(trainer):
        for group in opt.param_groups:
            group["step"] = int(step)
            for p in group["params"]:
                opt.state[p]["step"] = torch.tensor(step, dtype=torch.float32)
