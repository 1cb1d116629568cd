"""Pipeline-parallel overlap for plain 1F1B (``vpp = 1``): sends decoupled from receives, and every
receive posted one compute step ahead of its use.

megatron-core's non-interleaved schedule calls its ``P2PCommunicator`` synchronously: each call
returns only when its send and its receive are both done, so a stage waits for the slower of the two
and for its peer's readiness before every forward or backward. ``DecoupledP2PCommunicator`` keeps
that schedule (same calls, same order, same numbers) and changes what each call waits for:

* a send (``send_forward``, ``send_backward`` and the send half of the combined calls) is issued
  asynchronously and never waited for inside the schedule: in warm-up a stage sends micro-batch
  ``i``'s activations and goes straight on to receive ``i+1``; in cool-down it sends gradient ``i``
  and goes on to receive ``i+1``;
* receives are posted ahead: the first forward and backward receives when the schedule starts,
  and the next one of each direction as soon as the previous one is taken, so it arrives while the
  stage computes (steady phase: the next input arrives during the backward, the next gradient
  during the forward).

Exactly as many receives are posted per direction as the schedule takes (one per micro-batch), so
nothing is left pending between steps; ``finish()`` waits for the outstanding sends (the tensors
they read stay referenced until then). Messages in one direction between two stages are matched in
order, and each direction carries one kind of tensor, so posting early cannot mismatch them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, is_single_shape


class DecoupledP2PCommunicator(P2PCommunicator):
    """A ``P2PCommunicator`` for one run of the non-interleaved 1F1B schedule (see module doc).

    Contract: build one per schedule call with its ``num_microbatches`` and ``forward_only``; call
    ``finish()`` after the schedule returns (idempotent).
    """

    def __init__(
        self, pp_group, config, *, tensor_shape, num_microbatches: int, forward_only: bool
    ) -> None:
        super().__init__(pp_group, config)
        if config.deallocate_pipeline_outputs:
            raise ValueError(
                "deallocate_pipeline_outputs=True frees outputs that an asynchronous send still "
                "reads; accepted with pipeline overlap: False"
            )
        rank, size = pp_group.rank(), pp_group.size()
        self._shape, self._dtype = tuple(tensor_shape), config.pipeline_dtype
        self._left = {
            "prev": num_microbatches if rank > 0 else 0,
            "next": num_microbatches if rank < size - 1 and not forward_only else 0,
        }
        self._posted: dict[str, tuple[torch.Tensor, object] | None] = {"prev": None, "next": None}
        self._sends: list[tuple[torch.Tensor, object]] = []
        for direction in ("prev", "next"):
            self._post(direction)

    def _peer(self, direction: str) -> int:
        return self.prev_rank if direction == "prev" else self.next_rank

    def _post(self, direction: str) -> None:
        if self._left[direction] == 0:
            return
        self._left[direction] -= 1
        tensor = torch.empty(self._shape, dtype=self._dtype, requires_grad=True)
        handle = dist.irecv(tensor, src=self._peer(direction), group=self.pp_group)
        self._posted[direction] = (tensor, handle)

    def _take(self, direction: str) -> torch.Tensor:
        posted = self._posted[direction]
        if posted is None:
            raise RuntimeError(f"pipeline schedule took more receives from {direction} than posted")
        tensor, handle = posted
        self._posted[direction] = None
        handle.wait()
        self._post(direction)  # the next one arrives while this one's compute runs
        return tensor

    def _send(self, tensor: torch.Tensor, direction: str) -> None:
        tensor = tensor.contiguous()
        self._sends.append(
            (tensor, dist.isend(tensor, dst=self._peer(direction), group=self.pp_group))
        )

    def finish(self) -> None:
        """Wait for every send issued (collective order: after the schedule's last call)."""
        sends, self._sends = self._sends, []
        for _, handle in sends:
            handle.wait()

    # -- the schedule's calls ---------------------------------------------------------------------

    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        return _like(tensor_shapes, None if is_first_stage else self._take("prev"))

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        return _like(tensor_shapes, None if is_last_stage else self._take("next"))

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        if not is_last_stage:
            self._send(_single(output_tensors), "next")

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        if not is_first_stage:
            self._send(_single(input_tensor_grads), "prev")

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        if is_last_stage:
            return _like(tensor_shapes, None)
        self._send(_single(output_tensors), "next")
        return _like(tensor_shapes, self._take("next"))

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        if is_first_stage:
            return _like(tensor_shapes, None)
        self._send(_single(input_tensor_grads), "prev")
        return _like(tensor_shapes, self._take("prev"))


def _like(tensor_shapes, tensor):
    """Received tensors as megatron-core returns them: a list when it asked with a list."""
    return tensor if is_single_shape(tensor_shapes) else [tensor]


def _single(tensors):
    if isinstance(tensors, list):
        if len(tensors) != 1:
            raise ValueError(f"pipeline overlap sends one tensor per call, got {len(tensors)}")
        return tensors[0]
    return tensors


def overlapped_1f1b(groups):
    """megatron-core's non-interleaved 1F1B schedule run with a ``DecoupledP2PCommunicator``:
    same signature as the function ``get_forward_backward_func()`` returns."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )
    from megatron.core.utils import get_model_config

    def forward_backward(*, model, num_microbatches, seq_length, micro_batch_size, **kwargs):
        config = get_model_config(model[0] if isinstance(model, list) else model)
        tp = groups.pg_collection.tp.size() if config.sequence_parallel else 1
        shape = (seq_length // tp, micro_batch_size, config.hidden_size)
        comm = DecoupledP2PCommunicator(
            groups.pp,
            config,
            tensor_shape=shape,
            num_microbatches=num_microbatches,
            forward_only=kwargs.get("forward_only", False),
        )
        result = forward_backward_pipelining_without_interleaving(
            model=model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            p2p_communicator=comm,
            pg_collection=groups.pg_collection,
            **kwargs,
        )
        comm.finish()
        return result

    return forward_backward
