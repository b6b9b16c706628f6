"""DeMo's transform and selection: the top-k DCT coefficients of every tile, averaged over their senders.

Peng, Quesnelle & Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870 (2024);
reference code bloc97/DeMo (``demo.py``). Per step and per parameter the reference

1. accumulates a momentum ``delta = decay * delta + lr * grad``;
2. transforms ``delta`` with a chunked orthonormal DCT-II (a matrix: a 2-D DCT over tiles of
   ``chunk x chunk`` entries; a vector: a 1-D DCT over chunks);
3. keeps the ``k`` largest-magnitude coefficients of every tile and subtracts what they decode to
   from ``delta`` (the rest stays in the momentum);
4. allgathers the (index, value) pairs and averages every coefficient over the workers that sent
   it (``scatter_reduce(reduce="mean", include_self=False)``; zero where none did);
5. inverts the DCT and takes a plain SGD step with ``sign()`` of the result.

In lgc, steps 1 and 3's subtraction are error feedback with a decay, so the compressor is used as
``ErrorFeedback(DeMoCompressor(), decay=0.999)``: the residual ``r`` *is* DeMo's ``delta``
(``v = decay * r + g``, then ``r = v - decompress(payload)``). This module does steps 2 to 5.

Knobs (reference defaults: ``compression_chunk=64``, ``compression_topk=32``,
``compression_decay=0.999``, the last being :class:`~lgc.compressors.ErrorFeedback`'s ``decay``):
``chunk`` (tile side; a tile holds ``chunk**2`` entries), ``k`` (coefficients kept per tile, so
the density is ``k / chunk**2``, 0.78 % by default), ``sign`` and ``value_dtype``.

Wire cost, with ``K`` kept coefficients: ``K * value_size + ceil(K * ceil(log2(chunk**2)) / 8)``
bytes (:func:`demo_payload_nbytes`): the values, then every coefficient's position within its tile
in 12 bits (for ``chunk=64``) instead of the reference's int64 index. A tensor of ``n`` entries
has ``n // chunk**2`` full tiles keeping ``k`` each and, if ``L = n % chunk**2 > 0``, one partial
tile keeping ``ceil(k * L / chunk**2)`` (at least one), so ``K = (n // chunk**2) * k +
ceil(k * L / chunk**2)``: a small tensor is not sent denser than a big one.

The partial tile (the last ``L`` entries, or the whole of a tensor smaller than one tile) is not
zero-padded: its ``q = L // chunk`` whole rows get the 2-D DCT of a ``(q, chunk)`` matrix and its
last ``L % chunk`` entries a 1-D DCT, which is orthonormal with exactly ``L`` coefficients. Padding
to a full tile would give ``chunk**2`` dense coefficients for ``L`` entries (the padding's edge
leaks energy into every frequency), so keeping ``ceil(k * L / chunk**2)`` of them would capture
less of the tile than ``k`` captures of a full one, and even ``k = chunk**2`` would not be lossless.
The coefficients of a tensor therefore number exactly ``n``, laid out like the tensor (tile ``t``
holds coefficients ``t * chunk**2`` onwards), and every DCT matrix is at most ``chunk x chunk``.

What is verified (``tests/test_demo.py``): the DCT matrix is orthonormal and equals
``scipy.fft.dct`` / ``dctn`` with ``norm="ortho"``; keeping every coefficient round-trips to float
precision (and to 1e-12 in float64) for tensors below one tile, of one tile and of many tiles plus
a remainder; the kept coefficients are each tile's largest; wire size equals the formula; error
feedback's invariant ``v == decompress(payload) + r`` holds; the aggregate is the per-coefficient
mean over senders, then the sign.

Deviations from the reference, and what they mean for training:

* **Flat tiles.** lgc's compressors see flat tensors, not shapes, so a tile is ``chunk**2``
  *consecutive* entries viewed as a ``chunk x chunk`` matrix; the reference tiles a matrix's rows
  and columns (with the largest divisor of each dimension not above ``chunk``) and uses a 1-D DCT
  over chunks of at most 64 for vectors (keeping ``k`` of 64, half of a bias). A row-major
  matrix with exactly ``chunk`` columns (and a multiple of ``chunk`` rows) gets the reference's
  tiles (tested); a wider one gets each row folded into ``chunk``-entry rows instead. Conv
  weights are not matrices in the reference at all. The partial tile is transformed as above.
* **No learning rate inside.** The reference accumulates ``lr * grad``; the compressor never
  sees the lr, so the momentum here accumulates ``grad`` (divided by the world size, as the DDP
  hook does for every compressor). Under a constant lr the two are the same update, since
  ``sign()`` ignores scale; under a schedule the reference weighs past gradients by the lr they
  were taken at, lgc does not.
* **The optimizer.** The momentum lives in the error feedback's residual, so the optimizer must
  be plain SGD with no momentum (``momentum=0``, as the reference's ``torch.optim.SGD`` base).
  With ``sign=True`` the update is sign-SGD: every entry moves by exactly ``lr`` (or not at
  all), so the lr is a per-element step size, like Adam's and unlike SGD's: tune it on that
  scale. The reference's decoupled ``weight_decay`` is ``torch.optim.SGD(weight_decay=wd)``:
  the optimizer adds ``wd * p`` to the aggregated (signed) gradient after the hook, so
  ``p -= lr * (sign + wd * p)``, which is the reference's ``p *= 1 - lr * wd`` and its step.
* **Small tensors.** The hook sends tensors below its ``min_numel`` dense (plain average, no
  momentum, no sign); set ``min_numel=1`` for every parameter to take DeMo's path.
* **Determinism.** The aggregate adds the workers' payloads one at a time in rank order (each
  payload's positions are distinct), so every rank decodes bitwise the same gradient; the
  reference's ``scatter_reduce`` over all workers' indices at once is flagged nondeterministic
  on CUDA in its own code, and a sign flip of a near-zero entry would make replicas drift.
* **``sign=False``** returns the per-coefficient sender mean multiplied by the world size (from
  :meth:`set_world_size`, 1 outside the hook): the hook divides each gradient by the world size
  before compressing, so this undoes it, and a coefficient every worker sent decodes to the
  average gradient, as every other lgc compressor's aggregate does.

Non-finite inputs are not special-cased: the hook skips such steps before compressing. An inf
does not crash the compressor; it turns its tile's coefficients into inf/NaN, which pass through.
Precision: the transform runs in fp32 (half-precision inputs are cast); with TF32 matmuls enabled
on a GPU it keeps only about three significant digits, which error feedback absorbs (the residual
is computed with the same decoder), but the round trip is then no longer exact to fp32.

Example::

    >>> compressor = ErrorFeedback(DeMoCompressor(chunk=64, k=32), decay=0.999)
    >>> payload = compressor.compress(torch.randn(10_000), key="w")  # 2 full tiles + 1 partial
    >>> payload.values.numel(), payload.nbytes  # 32 + 32 + ceil(32 * 1808 / 4096) = 79 values, 12-bit positions
    (79, 435)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lgc.coding.bitpack import pack_uint
from lgc.compressors.base import CombineMode, Compressor, Payload, compressor_chain
from lgc.compressors.chunked_topk import (
    chunk_starts,
    chunked_topk_count,
    chunked_topk_nbytes,
    parse_values_and_positions,
    position_bits,
    topk_per_chunk,
)
from lgc.compressors.topk import wire_float_dtype

__all__ = [
    "DCTPayload",
    "DeMoCompressor",
    "check_demo_optimizer",
    "dct_matrix",
    "dct_tiles",
    "demo_coefficient_count",
    "demo_payload_nbytes",
    "idct_tiles",
]


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


def demo_coefficient_count(numel: int, chunk: int, k: int) -> int:
    """Coefficients ``K`` a payload of ``numel`` entries carries: ``k`` per full tile, fewer for a partial one.

    A partial tile of ``L`` entries keeps ``ceil(k * L / chunk**2)``, at least one: chunked top-k's
    count with tiles of ``chunk**2`` coefficients as its chunks.
    """
    return chunked_topk_count(numel, chunk * chunk, k)


def demo_payload_nbytes(numel: int, chunk: int, k: int, value_dtype: str | torch.dtype = "float32") -> int:
    """Exact wire bytes of a :class:`DeMoCompressor` payload.

    ``K * value_size + ceil(K * ceil(log2(chunk**2)) / 8)`` with ``K`` from :func:`demo_coefficient_count`.
    """
    return chunked_topk_nbytes(numel, chunk * chunk, k, value_dtype)


@dataclass
class DCTPayload(Payload):
    """``values[i]`` is the DCT coefficient at flat coefficient index ``indices[i]`` (tile * chunk**2 + position).

    On the wire: ``values``, then ``positions`` (every coefficient's position within its tile,
    packed at ``ceil(log2(chunk**2))`` bits). ``indices`` are rebuilt by every receiver and not sent.
    Not a :class:`~lgc.compressors.SparsePayload`: its entries live in coefficient space, so error
    feedback must subtract the decoded tensor, not the values at their indices.
    """

    values: Tensor
    positions: Tensor
    #: Global coefficient indices (int64); implied by the tile order and ``positions``, not sent.
    indices: Tensor

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.values, self.positions)


class DeMoCompressor(Compressor):
    """DeMo: the ``k`` largest DCT coefficients of every ``chunk x chunk`` tile, aggregated by sender mean and sign.

    Wrap it in :class:`~lgc.compressors.ErrorFeedback` with DeMo's ``decay=0.999`` (the residual is
    DeMo's momentum) and train with plain SGD (no momentum); see the module docstring for the
    deviations from the reference.

    Args:
        chunk: tile side, at least 2; a tile is ``chunk**2`` consecutive entries (reference: 64).
            Larger tiles select over more coefficients (a more global frequency decomposition) at
            ``ceil(log2(chunk**2))`` bits per position and ``O(chunk)`` flops per entry.
        k: coefficients kept per tile, in ``[1, chunk**2]`` (reference: 32, density 0.78 %). More
            ``k`` sends more of the momentum per step, at ``value_size + 1.5`` bytes per
            coefficient (chunk 64).
        sign: whether the aggregate is the ``sign()`` of the decoded sender mean (default, as the
            reference's sign-SGD). ``False`` returns the decoded sender mean itself (scaled back by
            the world size; see the module docstring), for a plain SGD step.
        value_dtype: dtype of the coefficients on the wire: ``"float32"`` (default), ``"float16"``
            or ``"bfloat16"`` (the rounding stays in error feedback's residual).

    Example::

        >>> payload = DeMoCompressor(chunk=2, k=1).compress(torch.tensor([1.0, 1.0, 1.0, 1.0]), "w")
        >>> payload.indices.tolist(), round(payload.values.item(), 4), payload.nbytes  # only the DC coefficient
        ([0], 2.0, 5)
    """

    combine = CombineMode.GATHER
    # The momentum lives in ErrorFeedback; the compressor keeps only cached DCT matrices.
    stateless = True

    def __init__(self, chunk: int = 64, k: int = 32, sign: bool = True, value_dtype: str | torch.dtype = "float32"):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
            raise ValueError(f"chunk must be an integer >= 2, got {chunk!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk * chunk:
            raise ValueError(f"k must be an integer in [1, chunk**2={chunk * chunk}], got {k!r}")
        self.chunk = chunk
        self.k = k
        self.sign = bool(sign)
        self.value_dtype = wire_float_dtype(value_dtype, "value_dtype")
        #: Coefficients per tile.
        self.tile = chunk * chunk
        #: Bits of a within-tile position on the wire.
        self.bits = position_bits(self.tile)
        #: Workers the hook divides gradients by (:meth:`set_world_size`); rescales ``sign=False``.
        self.world_size = 1
        # DCT matrices by (size, device, dtype), built on first use (not state: pure functions of the size).
        self._bases: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}

    @property
    def density(self) -> float:
        """Fraction of a full tile's coefficients that is sent."""
        return self.k / self.tile

    def set_world_size(self, world_size: int) -> None:
        self.world_size = int(world_size)

    def _basis(self, n: int, like: Tensor) -> Tensor:
        """The ``(n, n)`` DCT matrix on ``like``'s device, in fp32 (float64 for float64 input)."""
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        key = (n, like.device, dtype)
        basis = self._bases.get(key)
        if basis is None:
            basis = self._bases[key] = dct_matrix(n, dtype, like.device)
        return basis

    def transform(self, tensor: Tensor) -> Tensor:
        """The flat tensor's DCT coefficients, as many as its entries (fp32; float64 stays float64).

        Full tiles: the 2-D DCT of each ``chunk x chunk`` tile, row-major. The partial tile of
        ``L`` entries: the 2-D DCT of its ``(L // chunk, chunk)`` whole rows, then the 1-D DCT of
        its last ``L % chunk`` entries. Always a new tensor.
        """
        flat = tensor.reshape(-1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        return self._apply(flat, inverse=False)

    def inverse_transform(self, coefficients: Tensor) -> Tensor:
        """Inverse of :meth:`transform` (the transform is orthonormal)."""
        return self._apply(coefficients.reshape(-1), inverse=True)

    def _apply(self, flat: Tensor, inverse: bool) -> Tensor:
        chunk, tile = self.chunk, self.tile
        full, rest = divmod(flat.numel(), tile)
        rows, tail = divmod(rest, chunk)
        two_d = idct_tiles if inverse else dct_tiles
        out = torch.empty_like(flat)
        if full:
            tiles = flat[: full * tile].view(full, chunk, chunk)
            out[: full * tile] = two_d(tiles, self._basis(chunk, flat)).reshape(-1)
        start = full * tile
        if rows:  # the partial tile's whole rows: (rows, chunk) with a (rows x rows) DCT down the columns
            block = flat[start : start + rows * chunk].view(rows, chunk)
            left, right = self._basis(rows, flat), self._basis(chunk, flat)
            block = left.T @ block @ right if inverse else left @ block @ right.T
            out[start : start + rows * chunk] = block.reshape(-1)
        if tail:
            basis = self._basis(tail, flat)
            piece = flat[start + rows * chunk :]
            out[start + rows * chunk :] = basis.T @ piece if inverse else basis @ piece
        return out

    # ----------------------------------------------------------------------------------------

    def compress(self, tensor: Tensor, key: str) -> DCTPayload:
        flat = tensor.reshape(-1).float()  # the transform writes a new tensor: nothing aliases ``tensor``
        numel = flat.numel()
        coefficients = self.transform(flat)
        local = topk_per_chunk(coefficients, self.tile, self.k)
        indices = chunk_starts(numel, self.tile, self.k, flat.device).add_(local)
        return DCTPayload(
            numel=numel,
            values=coefficients[indices].to(self.value_dtype),
            positions=pack_uint(local, self.bits),
            indices=indices,
        )

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DCTPayload)
        coefficients = torch.zeros(payload.numel, dtype=torch.float32, device=payload.values.device)
        coefficients[payload.indices] = payload.values.float()
        return self.inverse_transform(coefficients)

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        """DeMo's aggregate: every coefficient averaged over the workers that sent it, inverse DCT, then ``sign()``."""
        first = payloads[0]
        assert isinstance(first, DCTPayload)
        sums = torch.zeros(first.numel, dtype=torch.float32, device=first.values.device)
        counts = torch.zeros_like(sums)
        ones = torch.ones(first.values.numel(), dtype=torch.float32, device=sums.device)
        for payload in payloads:  # one at a time, in rank order: the same bits on every rank
            assert isinstance(payload, DCTPayload)
            sums.index_add_(0, payload.indices, payload.values.float())
            counts.index_add_(0, payload.indices, ones)
        mean = sums.div_(counts.clamp_(min=1.0))  # sums are zero where nobody sent: the mean is 0 there
        decoded = self.inverse_transform(mean)
        if self.sign:
            return decoded.sign_()
        return decoded.mul_(self.world_size) if self.world_size != 1 else decoded

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        """:meth:`aggregate` computed in fp32, cast into ``out`` (a half-precision bucket slice is fine)."""
        out.copy_(self.aggregate(payloads))

    def payload_from_wire(self, wire: Tensor, numel: int) -> DCTPayload:
        count = demo_coefficient_count(numel, self.chunk, self.k)
        values, positions, local = parse_values_and_positions(
            wire, count, self.value_dtype, self.bits, f"a DeMo payload of {numel} entries"
        )
        return DCTPayload(
            numel=numel,
            values=values,
            positions=positions,
            indices=chunk_starts(numel, self.tile, self.k, local.device).add_(local),
        )

    # ----------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # The cached matrices may live on this process's GPU: a spawned worker builds its own.
        state = self.__dict__.copy()
        state["_bases"] = {}
        return state

    def __repr__(self) -> str:
        dtype = (
            "" if self.value_dtype == torch.float32 else f", value_dtype={str(self.value_dtype).removeprefix('torch.')}"
        )
        return f"DeMoCompressor(chunk={self.chunk}, k={self.k}, sign={self.sign}{dtype})"


def check_demo_optimizer(compressor: Any, optimizer_momentum: float) -> None:
    """Refuse DeMo next to an optimizer with momentum: DeMo's momentum is its error feedback's residual.

    Args:
        compressor: a compressor, a wrapper such as ``ErrorFeedback``, or a hook state.
        optimizer_momentum: the optimizer's momentum factor (Adam's first beta counts).

    Raises:
        ValueError: if a :class:`DeMoCompressor` meets a nonzero optimizer momentum.
    """
    if not any(isinstance(c, DeMoCompressor) for c in compressor_chain(compressor)):
        return
    if float(optimizer_momentum) != 0.0:
        raise ValueError(
            f"optimizer momentum is {optimizer_momentum!r} but DeMo keeps its momentum in the error feedback's "
            "residual (compressor.error_decay, the reference's compression_decay) and sends only its fast "
            "components; a second momentum in the optimizer would smooth the signed updates again: set "
            "optimizer.momentum=0 (plain SGD, as the reference's torch.optim.SGD base)"
        )
