"""Exact top-k sparsification (the selection underneath residual gradient compression and LGC).

Each worker sends the ``k = ceil(density * n)`` entries of largest magnitude as (value, index)
pairs. Index sets differ between workers, so payloads are allgathered and scatter-added. Wrap it
in :class:`lgc.compressors.ErrorFeedback` so the unsent mass is not lost (Aji & Heafield 2017;
Lin et al. 2018, the "residual gradient compression" every sparsifier in this package builds on).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, Payload, view_bytes_as
from lgc.compressors.segment_topk import segment_topk
from lgc.compressors.segments import copy_segments_into
from lgc.compressors.selection import topk_indices
from lgc.validation import Density, check

__all__ = [
    "AGGREGATIONS",
    "ScatterAddAggregation",
    "SparseMeanAggregation",
    "SparsePayload",
    "TopKCompressor",
    "check_aggregation",
    "index_dtype_for",
    "num_selected",
    "scatter_add_sparse",
    "scatter_add_sparse_into",
    "scatter_add_sparse_many",
    "segment_starts",
    "sparse_mean",
    "subtract_sent",
    "wire_float_dtype",
]

_WIRE_FLOAT_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def wire_float_dtype(dtype: str | torch.dtype, name: str = "dtype") -> torch.dtype:
    """A float dtype for values on the wire, from a torch dtype or its name (``"float16"``, ``"bf16"``)."""
    resolved = _WIRE_FLOAT_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {dtype!r}")
    return resolved


def to_wire_float(values: Tensor, dtype: torch.dtype, terms: int = 1) -> Tensor:
    """``values`` cast to the wire's ``dtype``, finite values beyond its range saturated.

    A plain cast rounds a finite value above fp16's 65504 to inf; error feedback would then keep
    ``value - inf = -inf`` in its residual and every later step of that entry would be NaN.
    Saturated, the sent value is the largest the wire holds and the excess stays in the residual,
    sent over the next steps (no step is lost and nothing is clipped away). ``terms``: how many
    such values an allreduce in ``dtype`` adds (the world size), so that their sum stays in range
    too: each is saturated at the largest value over ``terms``. An inf or NaN already in
    ``values`` is cast as it is, so that the step guard's non-finite handling sees it.
    """
    if terms == 1 and (dtype == values.dtype or torch.finfo(dtype).max >= torch.finfo(values.dtype).max):
        return values.to(dtype)
    limit = torch.finfo(dtype).max / terms
    # Clamped in fp32: fp16's largest value rounds up to 65536 in bf16, which fp16 holds as inf.
    wide = values if values.dtype in (torch.float32, torch.float64) else values.float()
    return torch.where(wide.isinf(), wide, wide.clamp(-limit, limit)).to(dtype)


def index_dtype_for(numel: int) -> torch.dtype:
    """Smallest index dtype that addresses ``numel`` elements (int32 unless the tensor is huge)."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def num_selected(numel: int, density: float) -> int:
    """``k = ceil(density * numel)``, at least one element."""
    return max(1, math.ceil(density * numel))


@dataclass
class SparsePayload(Payload):
    """``values[i]`` belongs at position ``indices[i]`` of a tensor of ``numel`` elements."""

    values: Tensor
    indices: Tensor

    @classmethod
    def from_wire(cls, wire: Tensor, numel: int, value_dtype: torch.dtype = torch.float32) -> SparsePayload:
        """Parse what :meth:`to_wire` wrote; ``value_dtype`` is the writer's (its compressor's configuration)."""
        index_dtype = index_dtype_for(numel)
        value_size = value_dtype.itemsize
        pair_size = value_size + index_dtype.itemsize
        if wire.numel() % pair_size:
            raise ValueError(f"a sparse payload of {wire.numel()} bytes is not a whole number of pairs")
        k = wire.numel() // pair_size
        values = view_bytes_as(wire[: k * value_size], value_dtype)
        indices = view_bytes_as(wire[k * value_size :], index_dtype)
        return cls(numel=numel, values=values, indices=indices)

    def to_dense(self) -> Tensor:
        dense = self.values.new_zeros(self.numel, dtype=torch.float32)
        return dense.index_add_(0, self.indices.long(), self.values.float())

    def add_to(self, dense: Tensor) -> Tensor:
        """``dense += decode(self)`` in place, touching only the sent positions."""
        return dense.index_add_(0, self.indices, self.values.to(dense.dtype))

    def subtract_from(self, dense: Tensor) -> Tensor:
        """``dense -= decode(self)`` in place, touching only the sent positions (error feedback's update)."""
        return dense.index_add_(0, self.indices, self.values.to(dense.dtype), alpha=-1)


def scatter_add_sparse(payloads: list[SparsePayload]) -> Tensor:
    """Sum of several sparse payloads of the same length in fp32, each payload added in turn, in the order given.

    One payload at a time rather than one scatter over all of them: on a GPU ``index_add_`` adds
    the values that meet at a position in an unspecified order (atomics), and every rank must
    decode the same bits. On the CPU both give the same bits.
    """
    first = payloads[0]
    total = torch.zeros(first.numel, dtype=torch.float32, device=first.values.device)
    for payload in payloads:
        payload.add_to(total)
    return total


def scatter_add_sparse_into(payloads: list[SparsePayload], out: Tensor) -> None:
    """:func:`scatter_add_sparse` written into ``out``: zeroed, then each payload adds itself, no dense temporary.

    An fp32 ``out`` takes the sum directly; another dtype (a half-precision bucket) gets the fp32
    sum of several payloads cast once, so the workers' values are not added in half precision.
    """
    if out.dtype != torch.float32 and len(payloads) > 1:
        out.copy_(scatter_add_sparse(payloads))
        return
    out.zero_()
    for payload in payloads:  # each adds itself (positions, or a block's slices): no concatenated copy
        payload.add_to(out)


def subtract_sent(flat: Tensor, payloads: Sequence[SparsePayload], positions: Tensor) -> Sequence[SparsePayload]:
    """``flat -= decode(payloads)`` at ``positions`` (theirs in ``flat``, in payload order), one ``index_add_``;
    returns ``payloads``. Error feedback's subtraction for a bucket of sparse payloads."""
    values = torch.cat([payload.values for payload in payloads]) if len(payloads) > 1 else payloads[0].values
    flat.index_add_(0, positions, values.to(flat.dtype), alpha=-1)
    return payloads


def segment_starts(numels: Sequence[int], counts: Sequence[int], device: torch.device) -> Tensor:
    """Each of ``sum(counts)`` entries' segment start: segment ``i`` (``numels[i]`` long) has ``counts[i]`` entries.

    What turns positions local to each segment of a flat into positions in the flat (add it) and
    back (subtract it), for entries listed segment by segment.
    """
    starts = torch.tensor([0, *numels[:-1]], dtype=torch.int64).cumsum(0).to(device, non_blocking=True)
    repeats = torch.tensor(list(counts), dtype=torch.int64).to(device, non_blocking=True)
    return torch.repeat_interleave(starts, repeats, output_size=sum(counts))


def scatter_add_sparse_many(payloads: Sequence[list[SparsePayload]], outs: Sequence[Tensor]) -> None:
    """:func:`scatter_add_sparse_into` of every tensor of a bucket at once, in a fixed number of passes.

    ``payloads[i]`` holds every rank's payload of tensor ``i`` (the same ranks, in the same order,
    for every tensor). The sums are built in one zeroed fp32 flat: per rank, its values of every
    tensor are concatenated and added with one ``index_add_`` at their positions in the flat (a
    rank's positions are distinct, so the adds do not meet within one call, and the ranks are added
    in the order given). The flat's slices are then copied into ``outs`` (``torch._foreach_copy_``,
    one kernel on a GPU, cast once into a half-precision bucket). Every position gets the fp32 sum
    of the ranks' values in rank order, as the loop's, so the bits are the loop's.
    """
    if not payloads:
        return
    numels = [out.numel() for out in outs]
    first = payloads[0][0].values
    flat = torch.zeros(sum(numels), dtype=torch.float32, device=first.device)
    for rank in range(len(payloads[0])):
        mine = [received[rank] for received in payloads]
        indices = torch.cat([p.indices for p in mine]).long()
        indices += segment_starts(numels, [p.values.numel() for p in mine], first.device)
        flat.index_add_(0, indices, torch.cat([p.values for p in mine]).float())
    copy_segments_into(flat, outs)


class ScatterAddAggregation:
    """Mixin for compressors whose payloads are :class:`SparsePayload`: the workers' payloads sum by scatter-add.

    Top-k, DGC, RedSync and SBC put it before :class:`~lgc.compressors.base.Compressor` in their bases.
    """

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        return scatter_add_sparse(payloads)  # type: ignore[arg-type]

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        scatter_add_sparse_into(payloads, out)  # type: ignore[arg-type]

    def aggregate_many(self, payloads: Sequence[list[Payload]], outs: Sequence[Tensor]) -> None:
        """A bucket at once on a GPU (:func:`scatter_add_sparse_many`); tensor by tensor on the CPU (cheaper there).

        On the CPU the flat costs a pass over the bucket more than the loop's zeroing; on a GPU the
        loop's few kernels per tensor cost more than the arithmetic.
        """
        if len(outs) < 2 or outs[0].device.type == "cpu":
            super().aggregate_many(payloads, outs)  # type: ignore[misc]
            return
        scatter_add_sparse_many(payloads, outs)  # type: ignore[arg-type]


#: The values of the ``aggregate`` knob of :class:`SparseMeanAggregation` (see :func:`sparse_mean`).
AGGREGATIONS = ("sender_mean", "mean")


def sparse_mean(payloads: list[Payload], aggregation: str = "sender_mean", world_size: int = 1) -> Tensor:
    """The workers' sparse payloads combined position by position (fp32), as ``aggregation`` says.

    Every payload has ``indices`` (distinct within the payload) and ``values``; payloads are added
    one at a time in the order given (the ranks' order), so every rank decodes the same bits (one
    scatter over all workers' indices at once adds a position's values in an unspecified order on
    a GPU).

    * ``"mean"``: the sum of the payloads. The DDP hook divides every worker's tensor by the world
      size ``P`` before compressing, so this is the zero-filled mean ``sum_w v_w / P`` of the
      workers' own values, a position nobody sent counting as zero in every worker.
    * ``"sender_mean"``: at each position, the mean over the workers that sent it (zero where
      none did): ``P * sum / count``, the mean of the senders' own values (the hook's division
      undone). The references' ``scatter_reduce(..., reduce="mean", include_self=False)``.

    Where the workers' selections differ, the sender mean is up to ``P`` times the zero-filled mean.
    """
    first = payloads[0]
    sums = torch.zeros(first.numel, dtype=torch.float32, device=first.values.device)  # type: ignore[attr-defined]
    for payload in payloads:
        sums.index_add_(0, payload.indices, payload.values.float())  # type: ignore[attr-defined]
    if aggregation == "mean":
        return sums
    counts = torch.zeros_like(sums)
    for payload in payloads:
        values = payload.values  # type: ignore[attr-defined]
        counts.index_add_(0, payload.indices, torch.ones(values.numel(), device=sums.device))  # type: ignore[attr-defined]
    if world_size != 1:
        sums.mul_(world_size)  # before the division: exact for a power-of-two world size
    return sums.div_(counts.clamp_(min=1.0))


def check_aggregation(aggregate: str) -> str:
    """``aggregate`` if it is one of :data:`AGGREGATIONS`, else a ValueError naming it."""
    if aggregate not in AGGREGATIONS:
        raise ValueError(f"aggregate must be one of {', '.join(AGGREGATIONS)}, got {aggregate!r}")
    return aggregate


class SparseMeanAggregation:
    """Mixin: payloads with ``indices`` and ``values`` aggregate by :func:`sparse_mean` (the ``aggregate`` knob).

    Chunked top-k (SparseLoCo) and DeMo put it before :class:`~lgc.compressors.base.Compressor`
    in their bases and set :attr:`aggregation` in ``__init__``; the hook tells it the world size.
    """

    #: ``"sender_mean"`` or ``"mean"`` (:func:`sparse_mean`).
    aggregation: str = "sender_mean"
    #: Workers the hook divides every tensor by (:meth:`set_world_size`); 1 outside the hook.
    world_size: int = 1

    def set_world_size(self, world_size: int) -> None:
        self.world_size = int(world_size)

    def sparse_mean(self, payloads: list[Payload]) -> Tensor:
        """:func:`sparse_mean` with this compressor's aggregation and world size."""
        return sparse_mean(payloads, self.aggregation, self.world_size)

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        return self.sparse_mean(payloads)

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        """:meth:`aggregate` in fp32, cast once into ``out`` (a half-precision bucket slice is fine)."""
        out.copy_(self.aggregate(payloads))


class TopKCompressor(ScatterAddAggregation, Compressor):
    """Keeps the ``k = ceil(density * n)`` largest-magnitude entries, exactly (``torch.topk``).

    Wire cost: ``k`` values (fp32 by default) plus ``k`` int32 indices, i.e. 8 bytes per kept
    entry, so the compression ratio against dense fp32 is about ``1 / (2 * density)``.

    Args:
        density: fraction of entries sent, in (0, 1]. Typical values 0.001-0.01; with error
            feedback, 0.001 still trains ResNets on CIFAR-10 to dense accuracy (Lin et al. 2018).
        value_dtype: dtype of the values on the wire, whatever the gradient's dtype:
            ``"float32"`` (default, exact), ``"float16"`` or ``"bfloat16"`` (6 bytes per entry; with
            error feedback the rounding stays in the residual and is sent later; a value beyond
            fp16's range is sent as its largest, the excess kept likewise: :func:`to_wire_float`). Every worker
            parses the others' payloads with it, so it is configuration, not per-tensor data.

    Example::

        >>> payload = TopKCompressor(density=0.25).compress(torch.tensor([1., -4., 2., 3.]), key="w")
        >>> payload.indices.tolist(), payload.nbytes
        ([1], 8)
    """

    needs_error_feedback = True
    pure_encoding = True
    combine = CombineMode.GATHER

    def __init__(self, density: Density, value_dtype: str | torch.dtype = "float32") -> None:
        check("density", density, Density)
        self.density = float(density)
        self.value_dtype = wire_float_dtype(value_dtype, "value_dtype")

    def selected_count(self, numel: int, key: str | None = None) -> int:
        """Entries every payload of a ``numel``-entry tensor carries: ``ceil(density * numel)``."""
        return num_selected(numel, self.density)

    def compress(self, tensor: Tensor, key: str) -> SparsePayload:
        numel = tensor.numel()
        k = num_selected(numel, self.density)
        if k == numel:
            indices = torch.arange(numel, device=tensor.device)
        else:
            indices = topk_indices(tensor, k)
        # Always a copy in the configured dtype: the caller (error feedback) updates ``tensor`` in place.
        values = to_wire_float(tensor[indices], self.value_dtype)
        return SparsePayload(numel=numel, values=values, indices=indices.to(index_dtype_for(numel)))

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, SparsePayload)
        return payload.to_dense()

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> SparsePayload:
        return SparsePayload.from_wire(wire, numel, self.value_dtype)

    def select_segments(
        self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]
    ) -> tuple[list[SparsePayload], Tensor]:
        """Every segment's payload (:meth:`compress`'s, ``flat`` untouched) and the sent positions in ``flat``.

        Every segment's exact top-k at once (:func:`~lgc.compressors.segment_topk.segment_topk`), the
        values gathered in one pass, each payload a slice of them with its indices made local.
        """
        ks = [self.selected_count(numel) for numel in numels]
        positions = segment_topk(flat, numels, ks)
        values = to_wire_float(flat[positions], self.value_dtype)
        local = (positions - segment_starts(numels, ks, flat.device)).to(torch.int32)
        payloads = [
            SparsePayload(numel=numel, values=v, indices=i)
            for numel, v, i in zip(numels, values.split(ks), local.split(ks), strict=True)
        ]
        return payloads, positions

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[Payload]:
        """:meth:`select_segments`, what it sends subtracted from ``flat`` in one ``index_add_``
        (:class:`~lgc.compressors.segments.FeedsBackSegments`)."""
        payloads, positions = self.select_segments(flat, numels, keys)
        return list(subtract_sent(flat, payloads, positions))

    def __repr__(self) -> str:
        dtype = (
            "" if self.value_dtype == torch.float32 else f", value_dtype={str(self.value_dtype).removeprefix('torch.')}"
        )
        return f"TopKCompressor(density={self.density}{dtype})"
