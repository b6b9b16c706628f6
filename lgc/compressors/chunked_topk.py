"""Chunked top-k: the ``k`` largest-magnitude entries of every chunk, positions sent within their chunk.

The selection of SparseLoCo (Sarfi et al., "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706, 2025) and of its predecessors CCLoco and DeMo (Peng et al. 2024,
without the DCT): the flat tensor is cut into chunks of ``chunk`` consecutive entries and each
chunk sends its own top ``k``. Because every position lies inside a known chunk and the chunks'
payloads come in chunk order, a position costs ``ceil(log2(chunk))`` bits on the wire (12 bits for
SparseLoCo's 4,096-entry chunks) instead of a 32-bit index; the selection is also spread over the
whole tensor, not drawn from one region.

Wire cost, with ``K`` kept entries: ``K * value_size + ceil(K * ceil(log2 chunk) / 8)`` bytes
(:func:`chunked_topk_nbytes`). ``K = (n // chunk) * k + ceil(k * r / chunk)`` for ``n`` entries and
``r = n % chunk`` left over: the last, partial chunk keeps the same fraction as the full ones (at
least one entry), so a small tensor is not sent denser than a big one. Combine with
:class:`lgc.compressors.QuantizedValues` for SparseLoCo's 2-bit values and with
:class:`lgc.compressors.ErrorFeedback` (SparseLoCo: ``decay=0.95``).

Verified: the selection is the exact per-chunk top-k (tested against ``torch.topk`` per chunk);
wire size equals the formula. SparseLoCo chunks the rows and columns of its matrices
(64 x 64 tiles); lgc's compressors see flat tensors, so a chunk is 4,096 consecutive entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lgc.coding.bitpack import pack_uint, packed_nbytes, unpack_uint
from lgc.compressors.base import CombineMode, Compressor, Payload, view_bytes_as
from lgc.compressors.topk import ScatterAddAggregation, SparsePayload, wire_float_dtype

__all__ = [
    "ChunkedSparsePayload",
    "ChunkedTopKCompressor",
    "chunk_starts",
    "chunked_topk_count",
    "chunked_topk_nbytes",
    "position_bits",
    "topk_per_chunk",
]


def position_bits(chunk: int) -> int:
    """Bits of a position within a chunk of ``chunk`` entries: ``ceil(log2(chunk))``, at least 1."""
    return max(1, (chunk - 1).bit_length())


def chunked_topk_count(numel: int, chunk: int, k: int) -> int:
    """Entries kept from ``numel``: ``k`` per full chunk, the same fraction (at least one) of the partial one."""
    full, rest = divmod(numel, chunk)
    return full * min(k, chunk) + (min(rest, max(1, math.ceil(k * rest / chunk))) if rest else 0)


def chunked_topk_nbytes(numel: int, chunk: int, k: int, value_dtype: str | torch.dtype = "float32") -> int:
    """Exact wire bytes of a :class:`ChunkedTopKCompressor` payload: values, then packed positions."""
    count = chunked_topk_count(numel, chunk, k)
    value_size = torch.empty((), dtype=wire_float_dtype(value_dtype)).element_size()
    return count * value_size + packed_nbytes(count * position_bits(chunk))


def topk_per_chunk(values: Tensor, chunk: int, k: int) -> Tensor:
    """Chunk-relative positions of each chunk's largest magnitudes, chunk by chunk (int64).

    ``k`` from every full chunk of ``chunk`` entries, then :func:`chunked_topk_count`'s share from
    the partial chunk at the end. DeMo selects its DCT coefficients per tile with it too.
    """
    full, rest = divmod(values.numel(), chunk)
    parts = []
    if full:
        rows = values[: full * chunk].view(full, chunk)
        parts.append(torch.topk(rows.abs(), min(k, chunk), dim=1, sorted=False).indices.reshape(-1))
    if rest:
        parts.append(torch.topk(values[full * chunk :].abs(), chunked_topk_count(rest, chunk, k), sorted=False).indices)
    if not parts:  # an empty tensor
        return torch.zeros(0, dtype=torch.int64, device=values.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def chunk_starts(numel: int, chunk: int, k: int, device: torch.device | str | None = None) -> Tensor:
    """The first entry of the chunk of every position :func:`topk_per_chunk` returns, in its order."""
    full, rest = divmod(numel, chunk)
    starts = torch.arange(full, device=device).repeat_interleave(min(k, chunk))
    partial = chunked_topk_count(rest, chunk, k)
    if partial:
        starts = torch.cat([starts, torch.full((partial,), full, device=device, dtype=starts.dtype)])
    return starts.mul_(chunk)


def parse_values_and_positions(
    wire: Tensor, count: int, value_dtype: torch.dtype, bits: int, what: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Split ``count`` values and their packed ``bits``-bit positions: (values, packed positions, positions)."""
    value_bytes = count * torch.empty((), dtype=value_dtype).element_size()
    expected = value_bytes + packed_nbytes(count * bits)
    if wire.numel() != expected:
        raise ValueError(f"{what} has {expected} bytes, got {wire.numel()}")
    packed = wire[value_bytes:]
    return view_bytes_as(wire[:value_bytes], value_dtype), packed, unpack_uint(packed, bits, count)


@dataclass
class ChunkedSparsePayload(SparsePayload):
    """A sparse payload whose positions travel as chunk-relative codes (``positions``, packed bits).

    ``indices`` (global positions, for decoding) are rebuilt from ``positions`` by every receiver
    and are not sent.
    """

    positions: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.values, self.positions)


class ChunkedTopKCompressor(ScatterAddAggregation, Compressor):
    """Keeps the ``k`` largest-magnitude entries of every chunk of ``chunk`` entries (SparseLoCo's selection).

    Args:
        chunk: entries per chunk (SparseLoCo: 4,096, a 64 x 64 tile). Positions cost
            ``ceil(log2(chunk))`` bits each.
        k: entries kept per chunk, in ``[1, chunk]`` (SparseLoCo: 64 of 4,096, density 1.56 %; the
            paper reports 1-3 %).
        value_dtype: dtype of the values on the wire: ``"float32"`` (default), ``"float16"`` or
            ``"bfloat16"``; :class:`~lgc.compressors.QuantizedValues` replaces them with a few bits.

    Example::

        >>> payload = ChunkedTopKCompressor(chunk=4, k=1).compress(torch.tensor([1., -4., 2., 3., 0., 5.]), "w")
        >>> payload.indices.tolist(), payload.nbytes  # 4 bytes of values, 2 bits each of positions
        ([1, 5], 9)
    """

    combine = CombineMode.GATHER
    stateless = True

    def __init__(self, chunk: int = 4096, k: int = 64, value_dtype: str | torch.dtype = "float32") -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
            raise ValueError(f"chunk must be an integer >= 2, got {chunk!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk:
            raise ValueError(f"k must be an integer in [1, chunk={chunk}], got {k!r}")
        self.chunk = chunk
        self.k = k
        self.value_dtype = wire_float_dtype(value_dtype, "value_dtype")
        self.bits = position_bits(chunk)

    @property
    def density(self) -> float:
        """Fraction of the entries of a full chunk that is sent."""
        return self.k / self.chunk

    def selected_count(self, numel: int) -> int:
        """Entries every payload of a ``numel``-entry tensor carries (:func:`chunked_topk_count`)."""
        return chunked_topk_count(numel, self.chunk, self.k)

    def compress(self, tensor: Tensor, key: str) -> ChunkedSparsePayload:
        flat = tensor.reshape(-1)
        local = topk_per_chunk(flat, self.chunk, self.k)
        indices = chunk_starts(flat.numel(), self.chunk, self.k, flat.device).add_(local)
        return ChunkedSparsePayload(
            numel=flat.numel(),
            values=flat[indices].to(self.value_dtype),  # a copy: error feedback updates ``tensor`` in place
            indices=indices,
            positions=pack_uint(local, self.bits),
        )

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, SparsePayload)
        return payload.to_dense()

    def payload_from_wire(self, wire: Tensor, numel: int) -> ChunkedSparsePayload:
        values, positions, local = parse_values_and_positions(
            wire, self.selected_count(numel), self.value_dtype, self.bits, f"a chunked top-k payload of {numel} entries"
        )
        indices = chunk_starts(numel, self.chunk, self.k, local.device).add_(local)
        return ChunkedSparsePayload(numel=numel, values=values, indices=indices, positions=positions)

    def __repr__(self) -> str:
        dtype = (
            "" if self.value_dtype == torch.float32 else f", value_dtype={str(self.value_dtype).removeprefix('torch.')}"
        )
        return f"ChunkedTopKCompressor(chunk={self.chunk}, k={self.k}{dtype})"
