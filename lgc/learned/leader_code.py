"""How the leader's positions and the values at them are laid out: order, chunks, scales, index code.

Common to LGC's compressed stage and its shared-index ablations: the *leader* selects top-k
positions ``I`` (``k = ceil(density * n)`` per parameter), so every worker's values are taken at
the same positions and line up. This module holds the pieces of that layout:

* **Order** (``value_order``): the values are sorted before they are chunked: ``"position"``
  (ascending), ``"magnitude"`` (the leader's ``|v|``, descending, as the authors' earlier DGC code
  sorted values) or ``"value"`` (the leader's signed ``v``, descending). Sorted by the leader's
  values, the leader's vector is a smooth monotone curve and every worker correlated with it a noisy
  version of that curve, which a small autoencoder compresses far better than values in position
  order, which look like noise (``lgc-bench autoencoder``).
* **Chunks and scales**: the ``K`` values are cut into rows of ``chunk`` values (zero-padded),
  each divided by the leader's chunk scale (its root mean square), so one small codec serves every
  layer of every model (:mod:`lgc.autoencoder.chunks`).
* **Index code** (``index_coding``): raw int32 (``"raw"``) or Golomb-coded (``"golomb"``, SBC's
  codec: about 11.5 bits per position at density 0.001; with an order other than positions, plus the
  permutation back to that order at ``ceil(log2 K)`` bits per position).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lgc.autoencoder import chunk_scales, divide_by_scales, from_chunks, to_chunks
from lgc.coding import GolombCode, golomb_decode, golomb_encode, pack_uint, packed_nbytes, unpack_uint
from lgc.validation import PositiveInt, check

__all__ = ["INDEX_CODINGS", "VALUE_ORDERS", "LeaderIndexCodec", "order_bits"]

INDEX_CODINGS = ("raw", "golomb")
VALUE_ORDERS = ("position", "magnitude", "value")


def order_bits(count: int) -> int:
    """Bits of one entry of a permutation of ``count`` items."""
    return max(1, math.ceil(math.log2(count))) if count > 1 else 1


class LeaderIndexCodec:
    """The wire layout of the leader's positions and of the values every worker takes there.

    Args:
        chunk: values per chunk (the codec's input length).
        value_order: ``"position"``, ``"magnitude"`` or ``"value"`` (see the module docstring).
        index_coding: ``"raw"`` (int32) or ``"golomb"``.
    """

    def __init__(self, chunk: PositiveInt, value_order: str = "value", index_coding: str = "raw") -> None:
        if value_order not in VALUE_ORDERS:
            raise ValueError(f"value_order must be one of {VALUE_ORDERS}, got {value_order!r}")
        if index_coding not in INDEX_CODINGS:
            raise ValueError(f"index_coding must be one of {INDEX_CODINGS}, got {index_coding!r}")
        check("chunk", chunk, PositiveInt)
        self.chunk = chunk
        self.value_order = value_order
        self.index_coding = index_coding

    def order(self, positions: Tensor, leader_values: Tensor) -> Tensor:
        """The permutation that puts the leader's positions in wire order (``value_order``)."""
        if self.value_order == "value":
            return torch.argsort(leader_values, descending=True, stable=True)
        if self.value_order == "magnitude":
            return torch.argsort(leader_values.abs(), descending=True, stable=True)
        return torch.argsort(positions)

    def in_wire_order(self, positions: Tensor, v: Tensor) -> Tensor:
        """``positions`` (cat space) reordered by the leader's values ``v`` there."""
        return positions[self.order(positions, v[positions])]

    def encode_positions(self, positions: Tensor, numel: int, ordered: bool = True) -> Tensor:
        """Wire form (uint8) of ``positions`` in ``[0, numel)``, kept in their order when ``ordered``.

        ``raw``: int32 in the given order. ``golomb``: the Golomb code of the sorted positions and,
        when the order matters (``value_order`` other than position), the permutation back to the
        given order first, as ``ceil(log2 K)``-bit codes: about 8 + 10 bits per position at density
        0.01 and K ~ 1000, against 32 raw.
        """
        if self.index_coding == "raw":
            return positions.to(torch.int32).view(torch.uint8)
        ascending, where = torch.sort(positions)
        code = golomb_encode(ascending, numel).to_wire()
        if not ordered or self.value_order == "position":
            return code
        order = torch.empty_like(where)
        order[where] = torch.arange(where.numel(), device=where.device)
        return torch.cat([pack_uint(order, order_bits(where.numel())).to(code.device), code])

    def decode_positions(self, wire: Tensor, count: int, ordered: bool = True) -> Tensor:
        """Inverse of :meth:`encode_positions` (``count`` positions, known to every worker); int64."""
        if self.index_coding == "raw":
            return wire.clone().view(torch.int32).long()
        if not ordered or self.value_order == "position":
            return golomb_decode(GolombCode.from_wire(wire))
        bits = order_bits(count)
        order_bytes = packed_nbytes(count * bits)
        order = unpack_uint(wire[:order_bytes], bits, count).to(wire.device)
        return golomb_decode(GolombCode.from_wire(wire[order_bytes:]))[order]

    def raw_position_bytes(self, count: int) -> int | None:
        """The position code's length when it does not depend on the positions (raw), else None."""
        return 4 * count if self.index_coding == "raw" else None

    def chunks(self, values: Tensor) -> Tensor:
        """``[K]`` -> ``[ceil(K / chunk), chunk]``, zero-padded."""
        return to_chunks(values, self.chunk)

    def chunk_scales(self, values: Tensor) -> Tensor:
        """The scale (root mean square) of every chunk of ``values`` (:func:`~lgc.autoencoder.chunk_scales`)."""
        return chunk_scales(to_chunks(values, self.chunk))

    def scaled_chunks(self, values: Tensor, scales: Tensor) -> Tensor:
        """The chunks of ``values``, each divided by its scale (:func:`~lgc.autoencoder.chunks.divide_by_scales`)."""
        return divide_by_scales(to_chunks(values, self.chunk), scales)

    def unscaled(self, chunks: Tensor, scales: Tensor, k: int) -> Tensor:
        """Inverse of :meth:`scaled_chunks`: the first ``k`` values."""
        return from_chunks(chunks * scales[:, None], k)
