"""Chunked top-k: the ``k`` largest-magnitude entries of every tile, positions sent within their tile.

The selection of SparseLoCo (Sarfi et al., "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706, 2025) and of its predecessor CCLoco; DeMo makes the same selection
among DCT coefficients (:mod:`lgc.compressors.demo`). Every parameter is cut into tiles
(:mod:`lgc.compressors.tiles`) and each tile sends its own top ``k``. Because every position lies in
a tile every worker knows and the tiles' payloads come in tile order, a position costs
``ceil(log2(tile size))`` bits on the wire (12 bits for a 64 x 64 tile) instead of a 32-bit index,
and the selection is spread over the whole tensor.

Reference code: tplr-ai/templar ``src/tplr/compress.py`` (``ChunkingTransformer`` and
``TopKCompressor``, SparseLoCo's production code; ``hparams/hparams.json``: ``target_chunk=64``,
``topk_compression=64``). With ``tiling="shape"`` (default) the tiles are the reference's: a
matrix gets tiles of ``split(rows) x split(cols)`` (largest divisors not above ``chunk``, so 64 x 64
tiles of 4,096 entries for dimensions that are multiples of 64, the paper's "chunks of 4096"), a
vector chunks of ``split(n)`` with ``k`` clamped to the chunk, so a bias or norm vector of at most
64 entries is sent whole. ``tiling="flat"`` takes runs of ``chunk**2`` consecutive entries instead
(a partial last run keeps the same fraction, at least one entry).

The workers' payloads combine by the ``aggregate`` knob (:func:`~lgc.compressors.topk.sparse_mean`):
``"sender_mean"`` (default) averages each position over the workers that sent it, as the
reference's ``batch_decompress`` (``scatter_reduce(..., reduce="mean", include_self=False)``) and
the code that produced SparseLoCo's published numbers do; ``"mean"`` is the zero-filled mean
``sum / P``, the paper's aggregation as it is restated elsewhere. Where the workers' selections
differ the sender mean is larger, up to ``P`` times, an outer step that grows with the number of
workers: with SparseLoCo's settings on a 1024 x 1024 matrix it is 1.99x, 3.93x and 7.68x the
zero-filled mean in norm at 2, 4 and 8 workers whose tensors are independent, and 1.84x, 3.18x and
5.08x when they share half their variance. Both send the same bytes.

Wire cost, with ``K`` kept entries (:attr:`~lgc.compressors.tiles.TileLayout.count`):
``K * value_size + ceil(K * bits / 8)`` bytes (:func:`chunked_topk_nbytes`), ``bits`` the
tensor's position width. Combine with :class:`lgc.compressors.QuantizedValues` for SparseLoCo's
2-bit values and with :class:`lgc.compressors.ErrorFeedback` (SparseLoCo: ``decay=0.95``).

Verified (``tests/compressors/test_sparseloco.py``): the selection is each tile's exact top-k; wire size equals
the formula; at 2, 4 and 8 workers, on matrices and vectors, the aggregate of
``QuantizedValues(ChunkedTopKCompressor())`` after the hook's division by the world size equals a
transcription of templar's compress / quantize / ``batch_decompress`` / decode to float rounding.

Departures from the reference:

* **Matrix tiles, not rows.** templar's ``encode`` makes real tiles (``"(y h) (x w) -> y x h w"``),
  which lgc follows. CCLoco's non-DCT path (tplr-ai/CCLoco ``src/tplr/ccloco.py``) rearranges
  ``"(y h) (x w) -> y h x w"`` and then flattens the last two axes, so each chunk there is a
  whole matrix row (``cols`` entries), not a tile.
* **Conv weights** (4-D) are the matrix ``(out, in * kh * kw)``; the reference tiles only matrices
  and vectors.
* **Even counts.** templar's ``_clamp_topk`` rounds ``k`` down to an even number of at least 2
  (its 12-bit indices are packed in pairs): a tile of odd size at most ``k`` sends all but one
  entry there, all of them here. The positions are packed at ``ceil(log2(tile size))`` bits, not
  always 12.
* **No norm clipping.** templar's ``batch_decompress`` scales each peer's values down to the median
  norm of the peers' (``clip_norm=True``), a defence against untrusted peers of its
  incentivised network; CCLoco's does not, nor does lgc.
* **Every tensor by default.** The reference compresses every parameter; so does the DDP hook
  here by default (:attr:`default_min_numel` is 1). A ``min_numel`` given to the hook or to
  ``lgc.compress`` sends smaller tensors dense instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, Payload
from lgc.compressors.tiles import TileChunk, TiledCompressorMixin, rows_topk, tile_layout
from lgc.compressors.topk import (
    SparseMeanAggregation,
    SparsePayload,
    check_aggregation,
    subtract_sent,
    to_wire_float,
    wire_float_dtype,
)
from lgc.validation import PositiveInt

__all__ = ["ChunkedSparsePayload", "ChunkedTopKCompressor", "chunked_topk_count", "chunked_topk_nbytes"]


def chunked_topk_count(shape: int | Sequence[int], chunk: int = 64, k: int = 64, tiling: str = "shape") -> int:
    """Entries a :class:`ChunkedTopKCompressor` payload of a tensor of ``shape`` carries (an int: a vector)."""
    return tile_layout(shape, chunk, k, tiling).count


def chunked_topk_nbytes(
    shape: int | Sequence[int],
    chunk: int = 64,
    k: int = 64,
    tiling: str = "shape",
    value_dtype: str | torch.dtype = "float32",
) -> int:
    """Exact wire bytes of a :class:`ChunkedTopKCompressor` payload: values, then packed positions."""
    value_size = wire_float_dtype(value_dtype).itemsize
    return tile_layout(shape, chunk, k, tiling).nbytes(value_size)


@dataclass
class ChunkedSparsePayload(SparsePayload):
    """A sparse payload whose positions travel as tile-relative codes (``positions``, packed bits).

    ``indices`` (flat positions, for decoding) are rebuilt from ``positions`` and the tensor's
    shape by every receiver and are not sent.
    """

    positions: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.values, self.positions)


class ChunkedTopKCompressor(TiledCompressorMixin, SparseMeanAggregation, Compressor):
    """Keeps the ``k`` largest-magnitude entries of every tile (SparseLoCo's selection).

    Args:
        chunk: the target tile side (reference: 64). ``tiling="shape"``: a matrix's tiles are at
            most ``chunk x chunk``, a vector's chunks at most ``chunk`` long; ``"flat"``: runs of
            ``chunk**2`` consecutive entries.
        k: entries kept per tile, in ``[1, chunk**2]``, clamped to a smaller tile's size
            (SparseLoCo: 64 of a 64 x 64 tile, density 1.56 %; the paper reports 1-3 %).
        tiling: ``"shape"`` (default, the reference's tiles) or ``"flat"`` (see the module docstring).
        aggregate: ``"sender_mean"`` (default, the reference's decode: each position averaged over
            the workers that sent it) or ``"mean"`` (the zero-filled mean, ``sum / P``).
        value_dtype: dtype of the values on the wire: ``"float32"`` (default), ``"float16"`` or
            ``"bfloat16"``; :class:`~lgc.compressors.QuantizedValues` replaces them with a few bits.

    Example::

        >>> compressor = ChunkedTopKCompressor(chunk=2, k=1)  # a 6-entry vector: chunks of 2, one kept each
        >>> payload = compressor.compress(torch.tensor([1., -4., 2., 3., 0., 5.]), "w")
        >>> payload.indices.tolist(), payload.nbytes  # 12 bytes of values, 1 bit each of positions
        ([1, 3, 5], 13)
    """

    needs_error_feedback = True
    combine = CombineMode.GATHER
    stateless = True
    # The reference sends every parameter through SparseLoCo.
    default_min_numel = 1
    #: :meth:`select_segments` lists every tile's positions as :meth:`compress` does (its rows' own
    #: top-k), so what is computed over a payload's values (SparseLoCo's table) has the same bits.
    selects_in_compress_order = True

    def __init__(
        self,
        chunk: TileChunk = 64,
        k: PositiveInt = 64,
        tiling: str = "shape",
        aggregate: str = "sender_mean",
        value_dtype: str | torch.dtype = "float32",
    ) -> None:
        self._init_tiles(chunk, k, tiling)
        self.aggregation = check_aggregation(aggregate)
        self.value_dtype = wire_float_dtype(value_dtype, "value_dtype")

    def selected_count(self, numel: int, key: str | None = None) -> int:
        """Entries every payload of the ``numel``-entry tensor ``key`` carries."""
        return self.layout(key, numel).count

    def compress(self, tensor: Tensor, key: str) -> ChunkedSparsePayload:
        layout = self.layout_of(tensor, key)
        flat = tensor.reshape(-1)
        local = layout.select(layout.order(flat))
        indices = layout.to_flat(layout.starts(flat.device).add_(local))
        return ChunkedSparsePayload(
            numel=flat.numel(),
            values=to_wire_float(flat[indices], self.value_dtype),  # a copy: error feedback updates ``tensor`` in place
            indices=indices,
            positions=layout.pack(local),
        )

    def select_segments(
        self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]
    ) -> tuple[list[ChunkedSparsePayload], Tensor]:
        """Every segment's payload (``keys[i]``'s tiles; :meth:`compress`'s, ``flat`` untouched) at once, and
        the sent positions in ``flat`` (error feedback's bucket path: :meth:`feed_back_segments`).

        The tiles of every tensor that share a size and a count to keep are selected by one top-k
        (:func:`~lgc.compressors.tiles.rows_topk` over all their rows: a 64 x 64 tile is one row of
        4,096 whatever tensor it comes from), so a bucket takes one selection per distinct tile
        shape, not one per tensor; a tile's selection depends on its row alone. The values are
        gathered from the flat at once. The positions are each tensor's, packed at its own width.
        """
        layouts = [self.layout(key, n) for key, n in zip(keys, numels, strict=True)]
        ordered = [layout.order(segment) for layout, segment in zip(layouts, flat.split(list(numels)), strict=True)]
        # Every tile group of every tensor, grouped by (entries per tile, entries kept).
        groups: dict[tuple[int, int], list[tuple[int, int, Tensor]]] = {}
        for index, (layout, tiles) in enumerate(zip(layouts, ordered, strict=True)):
            start = 0
            for number, group in enumerate(layout.groups):
                rows = tiles[start : start + group.tiles * group.size].view(group.tiles, group.size)
                groups.setdefault((group.size, group.keep), []).append((index, number, rows))
                start += group.tiles * group.size
        selected: dict[tuple[int, int], Tensor] = {}
        for (size, keep), members in groups.items():
            if keep == size:
                chosen = [torch.arange(size, device=flat.device).repeat(rows.shape[0]) for _, _, rows in members]
            else:
                rows = torch.cat([rows for _, _, rows in members]) if len(members) > 1 else members[0][2]
                found = rows_topk(rows, keep)
                chosen = [part.reshape(-1) for part in found.split([r.shape[0] for _, _, r in members])]
            selected.update({(index, number): c for (index, number, _), c in zip(members, chosen, strict=True)})
        offsets = [0, *itertools.accumulate(numels)]
        kept: list[tuple[Tensor, Tensor]] = []  # every tensor's indices and packed positions
        for index, layout in enumerate(layouts):
            parts = [selected[(index, number)] for number in range(len(layout.groups))]
            local = torch.cat(parts) if len(parts) > 1 else parts[0]
            kept.append((layout.to_flat(layout.starts(flat.device).add_(local)), layout.pack(local)))
        everywhere = torch.cat([indices + offset for (indices, _), offset in zip(kept, offsets, strict=False)])
        values = to_wire_float(flat[everywhere], self.value_dtype)
        payloads = [
            ChunkedSparsePayload(numel=numel, values=part, indices=indices, positions=packed)
            for numel, (indices, packed), part in zip(
                numels, kept, values.split([indices.numel() for indices, _ in kept]), strict=True
            )
        ]
        return payloads, everywhere

    def feed_back_segments(
        self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]
    ) -> list[ChunkedSparsePayload]:
        """:meth:`select_segments`, what it sends subtracted from ``flat`` in one ``index_add_``
        (:class:`~lgc.compressors.segments.FeedsBackSegments`)."""
        payloads, positions = self.select_segments(flat, numels, keys)
        return list(subtract_sent(flat, payloads, positions))

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, SparsePayload)
        return payload.to_dense()

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> ChunkedSparsePayload:
        layout = self.layout(key, numel)
        what = f"the chunked top-k payload of {key!r} ({numel} entries)"
        values, positions, local = layout.parse(wire, self.value_dtype, what)
        indices = layout.to_flat(layout.starts(local.device).add_(local))
        return ChunkedSparsePayload(numel=numel, values=values, indices=indices, positions=positions)

    def __repr__(self) -> str:
        return f"ChunkedTopKCompressor(chunk={self.chunk}, k={self.k}{self._knobs_repr()})"
