"""The tiled orthonormal DCT-II whose coefficients DeMo sends (:class:`~lgc.compressors.DeMoCompressor`).

Peng, Quesnelle & Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870 (2024); the
reference (bloc97/DeMo, ``demo.py``) builds its basis by FFT and applies it with an einsum, lgc
with the closed-form matrix and matrix products: equal up to float rounding.

:func:`dct_matrix` is the orthonormal DCT-II matrix; :func:`dct_tiles` and :func:`idct_tiles` its
separable 2-D transform of square tiles; :class:`TiledDCT` transforms a tensor tile by tile as a
:class:`~lgc.compressors.tiles.TileLayout` cuts it (shape tiles, or flat runs with a partial last
tile) and caches the matrices per size, device and dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lgc.compressors.tiles import TileLayout

__all__ = ["TiledDCT", "dct_matrix", "dct_tiles", "idct_tiles"]


def dct_matrix(n: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> Tensor:
    """The ``(n, n)`` orthonormal DCT-II matrix: ``D[k, i] = sqrt((1 if k == 0 else 2) / n) * cos(pi (2i + 1) k / 2n)``.

    Built in float64 from the closed form, then cast. ``D @ x`` is ``scipy.fft.dct(x, norm="ortho")``
    and ``D.T`` is its inverse.
    """
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype=dtype, device=device)


def dct_tiles(tiles: Tensor, basis: Tensor) -> Tensor:
    """Separable 2-D DCT-II ``D X D^T`` of every tile of ``tiles`` (shape ``(..., chunk, chunk)``)."""
    return basis @ tiles @ basis.T


def idct_tiles(coefficients: Tensor, basis: Tensor) -> Tensor:
    """Inverse of :func:`dct_tiles` (the basis is orthonormal): ``D^T C D``."""
    return basis.T @ coefficients @ basis


class TiledDCT:
    """A tensor's 2-D DCT tile by tile (a vector chunk's 1-D DCT), with the matrices cached.

    Args:
        chunk: the side of a flat tile (``chunk**2`` consecutive entries; shape tiles carry their
            own shape in their layout).
    """

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        # DCT matrices by (size, device, dtype), built on first use (not state: pure functions of the size).
        self._bases: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}

    def basis(self, n: int, like: Tensor) -> Tensor:
        """The ``(n, n)`` DCT matrix on ``like``'s device, in fp32 (float64 for float64 input)."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        key = (n, like.device, dtype)
        basis = self._bases.get(key)
        if basis is None:
            basis = self._bases[key] = dct_matrix(n, dtype, like.device)
        return basis

    def apply(self, flat: Tensor, layout: TileLayout, inverse: bool) -> Tensor:
        """The flat tensor's coefficients in tile order (``inverse``: the flat tensor from them), a new tensor."""
        if layout.tile_shape is None:
            return self._flat_tiles(flat, inverse)
        if not layout.groups:
            return flat.clone()
        (h, w), tiles = layout.tile_shape, layout.groups[0].tiles
        if inverse:
            return layout.unorder(self.tiles(flat.view(tiles, h, w), inverse=True).reshape(-1))
        return self.tiles(layout.order(flat).view(tiles, h, w), inverse=False).reshape(-1)

    def tiles(self, blocks: Tensor, inverse: bool) -> Tensor:
        """The 2-D DCT (``inverse``: its inverse) of every ``(h, w)`` tile of ``blocks`` (``(tiles, h, w)``).

        One batched product per side, every tile its own ``h x w`` product with the basis (broadcast
        with a zero stride), on a copy of ``blocks`` unless they start a storage (whose start the
        allocator aligns): the CPU's BLAS rounded the same tiles differently when the batch started
        at another alignment (64-column tiles, a few rows each). On one thread a tile's coefficients
        were then the same bits whichever tiles were batched beside it, wherever they lay (tested on
        the tile shapes DeMo meets, moved in memory), so a bucket's tiles taken across tensors (DeMo's
        ``feed_back_segments``) equal each tensor's own. A folded ``(tiles * h, w) @ (w, w)``
        product does not: the BLAS rounds a one-row product (a vector's single chunk) differently
        from a many-row one. On several threads the BLAS may split a lone tile's product between
        threads where a batch gives each thread whole tiles, so the last bits of a batched tile can
        differ from its own; every rank runs the same batches, so the ranks still agree.
        """
        if blocks.storage_offset() or not blocks.is_contiguous():
            blocks = blocks.clone(memory_format=torch.contiguous_format)
        tiles, h, w = blocks.shape
        right = self.basis(w, blocks)
        out = torch.bmm(blocks, (right if inverse else right.T).expand(tiles, w, w))
        if h > 1:
            left = self.basis(h, blocks)
            out = torch.bmm((left.T if inverse else left).expand(tiles, h, h), out)
        return out

    def _flat_tiles(self, flat: Tensor, inverse: bool) -> Tensor:
        """Flat tiles: each ``chunk**2`` run's 2-D DCT, then the partial tile's rows and tail (see DeMo)."""
        if flat.storage_offset():  # the BLAS rounds a product starting at another alignment differently (tiles)
            flat = flat.clone()
        chunk = self.chunk
        tile = chunk * chunk
        full, rest = divmod(flat.numel(), tile)
        rows, tail = divmod(rest, chunk)
        two_d = idct_tiles if inverse else dct_tiles
        out = torch.empty_like(flat)
        if full:
            tiles = flat[: full * tile].view(full, chunk, chunk)
            out[: full * tile] = two_d(tiles, self.basis(chunk, flat)).reshape(-1)
        start = full * tile
        if rows:  # the partial tile's whole rows: (rows, chunk) with a (rows x rows) DCT down the columns
            block = flat[start : start + rows * chunk].view(rows, chunk)
            left, right = self.basis(rows, flat), self.basis(chunk, flat)
            block = left.T @ block @ right if inverse else left @ block @ right.T
            out[start : start + rows * chunk] = block.reshape(-1)
        if tail:
            basis = self.basis(tail, flat)
            piece = flat[start + rows * chunk :]
            out[start + rows * chunk :] = basis.T @ piece if inverse else basis @ piece
        return out

    def __getstate__(self) -> dict[str, Any]:
        # The cached matrices may live on this process's GPU: a spawned worker builds its own.
        return {**self.__dict__, "_bases": {}}
