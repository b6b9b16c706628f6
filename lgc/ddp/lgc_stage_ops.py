"""What the compressed stages of LGC-RAR, LGC-PS and the shared-index codecs share.

A mixin of :class:`~lgc.ddp.lgc_base.LGCHookState`: the leader's broadcast of its positions (and
scales, and values), the allreduce of the small parameters sent dense, the latent's wire form,
rank 0's weights sent to the workers, and the bookkeeping (payload bytes per parameter, the
diagnostic error against the exact sum). It holds no state of its own; it reads the hook state's
``stats``, ``process_group``, ``leader``, ``leader_code``, ``autoencoder``, ``latent_dtype``,
``measure_error``, ``error_sums`` and ``last_metrics``.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.autoencoder import num_chunks
from lgc.ddp import collectives as counted
from lgc.ddp.lgc_plan import StepPlan

__all__ = ["LATENT_DTYPES", "CompressedStageOps"]

LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CompressedStageOps:
    """The compressed stage's collectives and bookkeeping (a mixin: no state of its own)."""

    __slots__ = ()
    # Provided by the hook state this is mixed into.
    stats: Any
    process_group: Any
    leader: int
    leader_code: Any
    latent_dtype: str
    measure_error: bool
    error_sums: list[float]
    last_metrics: dict[str, float]
    has_server: bool
    autoencoder: Any
    book_layer: Any

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def _count_payload(self, sent: int, plan: StepPlan) -> None:
        """Book what this worker sent for the compressed parameters (its own compression ratio).

        The parameters share one code, so each is booked the share of its selected values.
        """
        self.stats.payload_bytes += sent
        self.stats.payload_dense_equivalent_bytes += plan.numel * plan.compressed[0].grad.element_size()
        for part, k in zip(plan.compressed, plan.ks, strict=True):
            self.book_layer(part.name, part.grad.numel(), True, round(sent * k / plan.k))

    def _allreduce_dense(self, plan: StepPlan, extra: list[Tensor]) -> Tensor | None:
        """Sum the dense parameters (and ``extra`` tensors appended to them) in one allreduce.

        Writes the dense parameters' sums into their gradients; returns the summed ``extra`` part.
        """
        for part in plan.dense:
            self.book_layer(part.name, part.grad.numel(), False, part.grad.numel() * part.grad.element_size())
        pieces = [part.grad for part in plan.dense] + extra
        if not pieces:
            return None
        flat = torch.cat([piece.reshape(-1).float() for piece in pieces])
        counted.all_reduce(self.stats, flat, self.process_group).wait()
        sizes = [piece.numel() for piece in pieces]
        for part, summed in zip(plan.dense, flat.split(sizes), strict=False):
            part.grad.copy_(summed)
        return flat[sum(sizes[: len(plan.dense)]) :]

    def _measure_error(self, own: Tensor, delivered: Tensor) -> None:
        """With ``measure_error``: the relative error of ``delivered`` against the workers' exact sum of ``own``.

        ``own``: this worker's values at the leader's positions; ``delivered``: the sum the codec
        delivered there. The exact sum costs an fp32 allreduce that is deliberately not counted.
        """
        if not self.measure_error:
            return
        exact = own.detach().to(torch.float32, copy=True)
        dist.all_reduce(exact, group=self.process_group)
        error, norm = float((delivered.float() - exact).square().sum()), float(exact.square().sum())
        self.error_sums[0] += error
        self.error_sums[1] += norm
        self.last_metrics["lgc/true_error"] = error / norm if norm > 0 else 0.0

    def _leader_message(
        self, plan: StepPlan, v: Tensor, *, scales: bool = True, values: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Broadcast the leader's positions (wire order), chunk scales and values there; returns them everywhere.

        The message is the leader's chunk scales (fp32, one per chunk; ``scales``), its values at
        the positions in dtype ``values`` (``None``: not sent) and the positions' code. With raw
        positions its length is known to every rank; Golomb-coded, it is sent first.
        """
        rows = num_chunks(plan.k, self.leader_code.chunk)
        scale_bytes = 4 * rows if scales else 0
        value_bytes = 0 if values is None else plan.k * torch.empty((), dtype=values).itemsize
        wire = None
        if self.rank == self.leader:
            positions = self.leader_code.in_wire_order(plan.top_positions(v), v)
            pieces = [self.leader_code.chunk_scales(v[positions]).view(torch.uint8)] if scales else []
            if values is not None:
                pieces.append(v[positions].to(values).view(torch.uint8))
            wire = torch.cat([*pieces, self.leader_code.encode_positions(positions, plan.numel)])
        if self.index_coding == "golomb":
            wire = counted.broadcast_bytes(self.stats, wire, self.leader, self.process_group)
        else:
            if wire is None:
                wire = torch.empty(scale_bytes + value_bytes + 4 * plan.k, dtype=torch.uint8, device=v.device)
            counted.broadcast(self.stats, wire, self.leader, self.process_group)
        positions = self.leader_code.decode_positions(wire[scale_bytes + value_bytes :], plan.k)
        leader_scales = wire[:scale_bytes].clone().view(torch.float32) if scales else None
        leader_values = None if values is None else wire[scale_bytes : scale_bytes + value_bytes].clone().view(values)
        return positions, leader_scales, leader_values

    @property
    def latent_torch_dtype(self) -> torch.dtype:
        return LATENT_DTYPES[self.latent_dtype]

    def _wire_latent(self, latent: Tensor) -> Tensor:
        return latent.to(self.latent_torch_dtype).reshape(-1)

    def _latent_bytes(self, rows: int) -> int:
        """Wire size of the latent code of ``rows`` chunks."""
        return math.prod(self.autoencoder.latent_shape(rows)) * torch.empty((), dtype=self.latent_torch_dtype).itemsize

    def _send_flat_parameters(self, params: list[torch.nn.Parameter], dst: int | None) -> None:
        """Rank 0's ``params`` to rank ``dst`` (``None``: every rank); server traffic where rank 0 is a server."""
        flat = torch.nn.utils.parameters_to_vector(params).detach()
        server = self.has_server
        if dst is None:
            counted.broadcast(self.stats, flat, 0, self.process_group, as_server=server)
        elif self.rank == 0:
            counted.send(self.stats, flat, dst, self.process_group, as_server=server)
        elif self.rank == dst:
            counted.recv(self.stats, flat, 0, self.process_group)
        if dst is None or self.rank == dst:
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(flat, params)
