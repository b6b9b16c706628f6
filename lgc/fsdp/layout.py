"""Which columns of an FSDP2 reduce-scatter input are which parameter's gradient.

FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) reduces a parameter group's gradients in one
reduce-scatter whose input is a ``world x row`` matrix (``foreach_reduce_scatter_copy_in``): row
``r`` holds, parameter after parameter, the chunk of each gradient that rank ``r`` owns. A
gradient is chunked along dim 0 after padding dim 0 to a multiple of the world size, so its
``world`` chunks, read row after row, are the padded gradient in its own memory order: the
gradient itself is the first ``numel`` entries of ``input.view(world, row)[:, a:b]`` read in
order, the rest zero padding. The output of the reduce-scatter is one row: this rank's chunks.

:class:`GroupLayout` records, for one parameter group, where each gradient's columns lie (``a``,
``b``) and how many of its padded entries are real, so that the compressed reduce-scatter
(:mod:`lgc.fsdp.reduce_scatter`) can rebuild every unsharded gradient, compress it as the DDP
hook would (keyed by the parameter's name), and keep this rank's chunk of the sum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lgc.ddp.exchange import Segment

__all__ = ["GroupLayout", "ParamColumns"]


@dataclass(frozen=True)
class ParamColumns:
    """One parameter's place in a reduce-scatter input: its columns ``[offset, offset + chunk)`` of every row."""

    name: str
    #: Elements of the unsharded gradient.
    numel: int
    #: Elements of one rank's chunk (the gradient padded along dim 0 to a multiple of the world size, over it).
    chunk: int
    #: Where its chunk starts in a row.
    offset: int
    #: Whether the compressor codes it (at least ``min_numel`` elements), else it is reduced dense.
    compressed: bool


class GroupLayout:
    """The columns of one FSDP parameter group's reduce-scatter input, parameter by parameter.

    Args:
        params: ``(name, shape)`` of every parameter the group reduces, in the group's order.
        world: the size of the reduce-scatter's group.
        min_numel: parameters with fewer elements are reduced dense, as the DDP hook allreduces them.
    """

    def __init__(self, params: Sequence[tuple[str, Sequence[int]]], world: int, min_numel: int) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        columns = []
        offset = 0
        for name, shape in params:
            if len(shape) == 0:
                raise ValueError(f"{name}: FSDP2 shards along dim 0; a 0-dim parameter has none")
            numel = math.prod(shape)
            padded_rows = -(-shape[0] // world) * world
            chunk = padded_rows * math.prod(shape[1:]) // world
            columns.append(ParamColumns(name, numel, chunk, offset, numel >= min_numel and numel > 0))
            offset += chunk
        self.params: tuple[ParamColumns, ...] = tuple(columns)
        self.world = world
        #: Elements of one row (the reduce-scatter's output).
        self.row = offset

    @classmethod
    def of_group(cls, group: Any, names: Mapping[int, str], world: int, min_numel: int) -> GroupLayout:
        """The layout of an ``FSDPParamGroup`` (``fsdp_params``), its parameters named by ``names`` (by ``id``).

        Every parameter that takes a gradient, as if all had one; refuses a parameter sharded on
        another dim than 0. (A reduce-scatter carries those with a gradient in the step:
        :class:`~lgc.fsdp.reduce_scatter.CompressedReduceScatter` lays out what FSDP2 chose.)
        """
        params = []
        for fsdp_param in group.fsdp_params:
            sharded = fsdp_param.sharded_param
            if not sharded.requires_grad:
                continue
            if fsdp_param.fsdp_placement.dim != 0:
                raise ValueError(
                    f"{names.get(id(sharded), '?')}: sharded on dim {fsdp_param.fsdp_placement.dim}; lgc compresses "
                    "FSDP2 gradients sharded on dim 0 (fully_shard's default shard_placement_fn=None)"
                )
            params.append((names[id(sharded)], tuple(fsdp_param._orig_size)))
        return cls(params, world, min_numel)

    def check(self, input_numel: int, output_numel: int) -> None:
        """Refuse a reduce-scatter whose sizes are not this layout's (a parameter reduced that it does not know)."""
        if input_numel != self.world * self.row or output_numel != self.row:
            raise RuntimeError(
                f"FSDP reduce-scatter of {input_numel} -> {output_numel} elements does not match its parameter group's "
                f"layout ({self.world} x {self.row}: {', '.join(p.name for p in self.params)}); was a parameter's "
                "requires_grad changed after lgc.compress?"
            )

    def gather_unsharded(self, rows: Tensor, out: Tensor) -> tuple[Segment, ...]:
        """Every parameter's unsharded gradient, from ``rows`` (``world x row``) into the flat ``out``.

        ``out`` holds ``world * chunk`` elements per parameter (its padded gradient, the padding
        included so that one strided copy moves it); returns the segments of ``out`` that are the
        gradients themselves, compressed or not as the layout says.
        """
        segments = []
        start = 0
        for p in self.params:
            out[start : start + self.world * p.chunk].view(self.world, p.chunk).copy_(
                rows[:, p.offset : p.offset + p.chunk]
            )
            segments.append(Segment(p.name, start, p.numel, p.compressed))
            start += self.world * p.chunk
        return tuple(segments)

    def own_segments(self, rank: int) -> tuple[Segment, ...]:
        """The segments of a reduce-scatter's output on ``rank``: each parameter's chunk, its real entries.

        A chunk's entries past the gradient's end are padding (the last ranks' chunks of a tensor
        whose dim 0 does not divide evenly), left out; a chunk of padding only is an empty segment,
        kept so that every rank lists the parameters it carries.
        """
        return tuple(
            Segment(p.name, p.offset, real := max(0, min(p.chunk, p.numel - rank * p.chunk)), p.compressed and real > 0)
            for p in self.params
        )

    def unsharded_numel(self) -> int:
        """Elements of :meth:`gather_unsharded`'s ``out``: ``world x row``."""
        return self.world * self.row

    def scatter_own(self, unsharded: Tensor, output: Tensor, rank: int) -> None:
        """This rank's chunk of every parameter of ``unsharded`` (as :meth:`gather_unsharded` laid it out) into its
        columns of ``output``: what a reduce-scatter leaves on this rank."""
        start = 0
        for p in self.params:
            output[p.offset : p.offset + p.chunk].copy_(
                unsharded[start + rank * p.chunk : start + (rank + 1) * p.chunk]
            )
            start += self.world * p.chunk
