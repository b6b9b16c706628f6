"""Tiles of a parameter: where chunked top-k (SparseLoCo) and DeMo select their ``k`` per tile.

Both methods cut every parameter into tiles and keep the ``k`` largest entries (SparseLoCo) or DCT
coefficients (DeMo) of each tile, so a position costs ``ceil(log2(tile size))`` bits instead of a
full index and the selection is spread over the whole tensor. This module says where the tiles
are; :class:`~lgc.compressors.ChunkedTopKCompressor` and :class:`~lgc.compressors.DeMoCompressor`
share it.

``tiling="shape"`` is the references' rule (tplr-ai/templar ``src/tplr/compress.py``,
``ChunkingTransformer``, SparseLoCo's production code; bloc97/DeMo ``demo.py``, ``TransformDCT``):
every dimension ``n`` is cut into pieces of ``split(n)``, its largest divisor not above the target
``chunk`` (:func:`smaller_split`, the references' ``_get_smaller_split``; ``n`` itself when
``n <= chunk``). A matrix of ``rows x cols`` gets ``split(rows) x split(cols)`` tiles, a vector
chunks of ``split(n)`` entries, and every tile keeps ``min(k, tile size)``: with ``chunk=64`` a
64-entry BatchNorm vector keeps 32 of its 64 entries under DeMo's ``k=32`` and all of them under
SparseLoCo's ``k=64``, and a ``10 x 64`` classifier keeps ``k`` of its 640. A dimension without a
divisor in ``[2, chunk]`` (a prime above ``chunk``) is not cut (tiles of side 1 along it), as in
the references. Tensors of more dimensions (conv weights ``(out, in, kh, kw)``) are the matrix
``(out, in * kh * kw)``: the references handle only matrices and vectors (they train
transformers), so this is lgc's rule.

``tiling="flat"`` cuts the flat tensor into runs of ``chunk**2`` consecutive entries, whatever its
shape (one tile of ``4096`` for ``chunk=64``); a last, partial run of ``L`` entries keeps the same
fraction as the full ones, ``ceil(k * L / chunk**2)`` (at least one), so a small tensor is not
sent denser than a big one, and every position costs ``ceil(log2(chunk**2))`` bits.

The tiles are taken in order, row of tiles by row of tiles, and a tile's entries row-major (the
references' ``"(y h) (x w) -> y x (h w)"``): the *tile order*. A payload lists each tile's kept
positions (within the tile) tile after tile, so every receiver rebuilds the indices from the
shape, which every worker knows, and the positions alone.

Example::

    >>> layout = tile_layout((96, 40), chunk=64, k=32)  # split(96) = 48, split(40) = 40
    >>> layout.tile_shape, layout.count, layout.bits  # two 48 x 40 tiles keep 32 each, 11-bit positions
    ((48, 40), 64, 11)
    >>> tile_layout((64,), chunk=64, k=32).count, tile_layout((64,), chunk=64, k=32, tiling="flat").count
    (32, 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, NamedTuple

import torch
from pydantic import Field
from torch import Tensor

from lgc.coding.bitpack import pack_uint, packed_nbytes, unpack_uint
from lgc.compressors.base import view_bytes_as
from lgc.compressors.selection import group_maxima
from lgc.validation import PositiveInt, check

__all__ = [
    "TILINGS",
    "TileChunk",
    "TileGroup",
    "TileLayout",
    "TiledCompressorMixin",
    "index_bits",
    "rows_topk",
    "smaller_split",
    "tile_layout",
]

#: The values of the ``tiling`` knob.
TILINGS = ("shape", "flat")
#: The side of a square tile.
TileChunk = Annotated[int, Field(ge=2, description="an integer >= 2")]


def smaller_split(n: int, target: int) -> int:
    """The largest divisor of ``n`` not above ``target`` (``n`` itself when ``n <= target``).

    The references' ``_get_smaller_split`` (bloc97/DeMo ``demo.py``, tplr-ai/templar
    ``src/tplr/compress.py``): the side of the tiles along a dimension of ``n`` entries.

    >>> smaller_split(96, 64), smaller_split(40, 64), smaller_split(576, 64), smaller_split(67, 64)
    (48, 40, 64, 1)
    """
    if n <= target:
        return n
    return max(d for d in range(1, target + 1) if n % d == 0)


def index_bits(size: int) -> int:
    """Bits of a position within a tile of ``size`` entries: ``ceil(log2(size))`` (none for a 1-entry tile)."""
    return max(0, (size - 1).bit_length())


class TileGroup(NamedTuple):
    """Consecutive tiles of one size (the tile order holds one group, or two for a flat partial tile)."""

    #: Number of tiles.
    tiles: int
    #: Entries per tile.
    size: int
    #: Entries kept per tile.
    keep: int


@dataclass(frozen=True)
class TileLayout:
    """Where the tiles of one tensor lie and how many entries each keeps (:func:`tile_layout` builds it).

    The tensor is flat (row-major); :meth:`order` lists its entries in tile order, :meth:`unorder`
    undoes that, :meth:`select` picks each tile's largest magnitudes, and :meth:`to_flat` turns
    tile-order indices back into flat ones.
    """

    #: Entries of the tensor.
    numel: int
    #: The tiles in tile order.
    groups: tuple[TileGroup, ...]
    #: Bits of every position on the wire.
    bits: int
    #: ``(h, w)``: rows and columns of a tile (a vector's chunk is ``(1, w)``); ``None`` for flat tiles.
    tile_shape: tuple[int, int] | None = None
    #: ``(y, x)``: tiles down and across a matrix whose tiles are not runs of consecutive entries
    #: (several tiles across, several rows each); ``None`` when the tile order is the flat order.
    grid: tuple[int, int] | None = None

    @property
    def count(self) -> int:
        """Entries (or coefficients) a payload carries."""
        return sum(group.tiles * group.keep for group in self.groups)

    def nbytes(self, value_size: int) -> int:
        """Wire bytes of ``count`` values of ``value_size`` bytes and their packed positions."""
        return self.count * value_size + packed_nbytes(self.count * self.bits)

    def order(self, flat: Tensor) -> Tensor:
        """The entries of the flat tensor in tile order (a view when that is the flat order)."""
        if self.grid is None:
            return flat
        (y, x), (h, w) = self.grid, self.tile_shape
        return flat.view(y, h, x, w).transpose(1, 2).reshape(-1)

    def unorder(self, ordered: Tensor) -> Tensor:
        """Inverse of :meth:`order`: a tensor in tile order back in the flat order."""
        if self.grid is None:
            return ordered
        (y, x), (h, w) = self.grid, self.tile_shape
        return ordered.view(y, x, h, w).transpose(1, 2).reshape(-1)

    def select(self, ordered: Tensor) -> Tensor:
        """Positions (within their tile, int64) of each tile's ``keep`` largest magnitudes, tile by tile.

        Each tile's exact top-``keep`` (:func:`rows_topk`); a tile that keeps all its entries lists
        them in order.
        """
        parts, start = [], 0
        for group in self.groups:
            rows = ordered[start : start + group.tiles * group.size].view(group.tiles, group.size)
            if group.keep == group.size:
                parts.append(torch.arange(group.size, device=ordered.device).repeat(group.tiles))
            else:
                parts.append(rows_topk(rows, group.keep).reshape(-1))
            start += group.tiles * group.size
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=ordered.device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def starts(self, device: torch.device | str | None = None) -> Tensor:
        """The tile-order index of the first entry of the tile of every position :meth:`select` returns."""
        parts, start = [], 0
        for group in self.groups:
            first = torch.arange(group.tiles, device=device).mul_(group.size).add_(start)
            parts.append(first.repeat_interleave(group.keep))
            start += group.tiles * group.size
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def to_flat(self, index: Tensor) -> Tensor:
        """Tile-order indices as indices of the flat tensor (in place when the orders differ)."""
        if self.grid is None:
            return index
        x, (h, w) = self.grid[1], self.tile_shape
        tile, within = index.div(h * w, rounding_mode="floor"), index.remainder(h * w)
        row = tile.div(x, rounding_mode="floor").mul_(h).add_(within.div(w, rounding_mode="floor"))
        column = tile.remainder(x).mul_(w).add_(within.remainder(w))
        return row.mul_(x * w).add_(column)

    def pack(self, positions: Tensor) -> Tensor:
        """The positions at :attr:`bits` bits each (no bytes for 1-entry tiles)."""
        if self.bits == 0:
            return torch.empty(0, dtype=torch.uint8, device=positions.device)
        return pack_uint(positions, self.bits)

    def parse(self, wire: Tensor, value_dtype: torch.dtype, what: str) -> tuple[Tensor, Tensor, Tensor]:
        """Split a wire of :attr:`count` values and packed positions: (values, packed positions, positions)."""
        count = self.count
        value_bytes = count * value_dtype.itemsize
        expected = value_bytes + packed_nbytes(count * self.bits)
        if wire.numel() != expected:
            raise ValueError(f"{what} has {expected} bytes, got {wire.numel()}")
        packed = wire[value_bytes:]
        if self.bits == 0:
            positions = torch.zeros(count, dtype=torch.int64, device=wire.device)
        else:
            positions = unpack_uint(packed, self.bits, count)
        return view_bytes_as(wire[:value_bytes], value_dtype), packed, positions


#: Columns per tile row in :func:`rows_topk`'s bound (measured best of 4, 8 and 16 on ResNet-50's tiles).
_ROW_GROUP_HEIGHT = 8


def rows_topk(rows: Tensor, keep: int) -> Tensor:
    """Every row's ``keep`` largest magnitudes, exactly: their positions in the row, ``(rows, keep)`` int64.

    The magnitudes ``torch.topk(rows.abs(), keep, dim=1)`` selects; where entries tie at the
    ``keep``-th magnitude (common in bf16 and fp16 gradients) either may be taken, of either sign,
    and the positions come in another order within a row (so a sum over a payload's values, as
    SparseLoCo's quantizer table takes, may differ in its last bits). By the bound
    :func:`~lgc.compressors.selection.topk_indices`
    uses, row by row: each row of ``n`` entries is viewed as ``8 x (n / 8)`` and its columns (8
    entries ``n / 8`` apart) are the groups. A row's ``keep`` largest entries lie in its ``keep``
    columns of largest maxima (those maxima are ``keep`` distinct entries, so the ``keep``-th
    largest entry is at least the ``keep``-th largest column maximum, and a column holding a
    larger entry has a larger maximum). So one streaming pass (the column maxima, ``amax`` and
    ``amin`` along memory), a top-``keep`` of ``n / 8`` maxima and a top-``keep`` of the
    ``8 * keep`` gathered candidates replace the top-``keep`` of ``n`` magnitudes and the
    ``abs()`` copy of the rows. A NaN ranks highest in both, as in ``torch.topk``, so the same
    entries are chosen when a row holds one.

    On ResNet-50's DeMo tiles (one CPU thread, loaded machine) 1.7-2.3x faster than ``torch.topk``
    of the magnitudes; used on the CPU where the candidates are at most a quarter of the row, and
    ``torch.topk`` otherwise (on a GPU its batched selection has not been measured against this).
    """
    tiles, size = rows.shape
    height = _ROW_GROUP_HEIGHT
    if rows.device.type != "cpu" or size % height or 4 * height * keep > size:
        return torch.topk(rows.abs(), keep, dim=1, sorted=False).indices
    width = size // height
    grid = rows.view(tiles, height, width)
    column_max = group_maxima(grid, 1)
    columns = torch.topk(column_max, keep, dim=1, sorted=False).indices
    candidates = grid.gather(2, columns.unsqueeze(1).expand(tiles, height, keep)).view(tiles, height * keep)
    best = torch.topk(candidates.abs_(), keep, dim=1, sorted=False).indices
    row, column = best.div(keep, rounding_mode="floor"), best.remainder(keep)
    return row.mul_(width).add_(columns.gather(1, column))


def tile_layout(shape: int | Sequence[int], chunk: int, k: int, tiling: str = "shape") -> TileLayout:
    """The tiles of a tensor of ``shape`` (an int: a vector) for a target ``chunk`` and ``k`` kept per tile.

    See the module docstring for the two tilings.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
    numel = math.prod(shape)
    if tiling == "flat":
        size = chunk * chunk
        full, rest = divmod(numel, size)
        groups = [TileGroup(full, size, min(k, size))] if full else []
        if rest:
            groups.append(TileGroup(1, rest, min(rest, max(1, math.ceil(k * rest / size)))))
        return TileLayout(numel, tuple(groups), index_bits(size))
    if tiling != "shape":
        raise ValueError(f"tiling must be one of {', '.join(TILINGS)}, got {tiling!r}")
    if numel == 0:
        return TileLayout(0, (), 0, (1, 1))
    rows = shape[0] if len(shape) > 1 else 1
    cols = numel // rows
    h, w = smaller_split(rows, chunk), smaller_split(cols, chunk)
    y, x = rows // h, cols // w
    # Tiles one row high, or as wide as the matrix, are runs of consecutive entries already.
    grid = (y, x) if h > 1 and x > 1 else None
    return TileLayout(numel, (TileGroup(y * x, h * w, min(k, h * w)),), index_bits(h * w), (h, w), grid)


class TiledCompressorMixin:
    """The knobs and layouts of a compressor that selects per tile (chunked top-k, DeMo).

    Call :meth:`_init_tiles` from ``__init__``. The hook attaches the model's parameters
    (:meth:`attach_parameters`), so a tensor's ``key`` gives its shape; a key never attached is a
    vector (a flat tensor of its length), on the sending and on the receiving side alike.
    """

    chunk: int
    k: int
    tiling: str
    #: Set by the compressor's ``__init__``: how payloads combine, and the values' wire dtype.
    aggregation: str
    value_dtype: torch.dtype

    def _init_tiles(self, chunk: TileChunk, k: PositiveInt, tiling: str) -> None:
        check("chunk", chunk, TileChunk)
        # Bounded by the tile's size, so spelled out here rather than in an alias.
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk * chunk:
            raise ValueError(f"k must be an integer in [1, chunk**2={chunk * chunk}], got {k!r}")
        if tiling not in TILINGS:
            raise ValueError(f"tiling must be one of {', '.join(TILINGS)}, got {tiling!r}")
        self.chunk = chunk
        self.k = k
        self.tiling = tiling
        # Parameter name -> shape (attach_parameters); configuration of the model, not state.
        self._shapes: dict[str, tuple[int, ...]] = {}
        # Shape -> its layout, built on first use.
        self._layouts: dict[tuple[int, ...], TileLayout] = {}

    @property
    def density(self) -> float:
        """Fraction of a full ``chunk x chunk`` tile that is sent."""
        return self.k / (self.chunk * self.chunk)

    def _knobs_repr(self) -> str:
        """The knobs shared with the other tiled compressor that differ from their defaults, for ``repr``."""
        extra = "" if self.tiling == "shape" else f", tiling={self.tiling!r}"
        extra += "" if self.aggregation == "sender_mean" else f", aggregate={self.aggregation!r}"
        if self.value_dtype != torch.float32:
            extra += f", value_dtype={str(self.value_dtype).removeprefix('torch.')}"
        return extra

    def attach_parameters(self, parameters: Mapping[str, Tensor]) -> None:
        """Learn every parameter's shape by name (the hook calls this; the ``key`` of ``compress`` is the name)."""
        self._shapes = {name: tuple(p.shape) for name, p in parameters.items()}

    def layout(self, key: str | None, numel: int) -> TileLayout:
        """The tiles of the ``numel``-entry tensor named ``key`` (a vector when its shape was not attached)."""
        shape = self._shapes.get(key) if key is not None else None
        if shape is None:
            shape = (numel,)
        elif math.prod(shape) != numel:
            raise ValueError(f"{key!r} was attached with shape {shape}, but a tensor of {numel} entries came")
        layout = self._layouts.get(shape)
        if layout is None:
            layout = self._layouts[shape] = tile_layout(shape, self.chunk, self.k, self.tiling)
        return layout

    def layout_of(self, tensor: Tensor, key: str) -> TileLayout:
        """:meth:`layout` for the tensor ``compress`` received; a shaped tensor needs its shape attached."""
        if tensor.dim() > 1 and key not in self._shapes:
            raise ValueError(
                f"{type(self).__name__} tiles by the parameter's shape, but {key!r} came as a {tuple(tensor.shape)} "
                f"tensor without attach_parameters({{{key!r}: ...}}) (the DDP hook attaches the model's); "
                "pass it flat to tile it as a vector"
            )
        return self.layout(key, tensor.numel())
