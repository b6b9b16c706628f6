"""DeMo's transform and selection: the top-k DCT coefficients of every tile, averaged over their senders.

Peng, Quesnelle & Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870 (2024);
reference code bloc97/DeMo (``demo.py``). Per step and per parameter the reference

1. accumulates a momentum ``delta = decay * delta + lr * grad``;
2. transforms ``delta`` with a tiled orthonormal DCT-II: each dimension is cut by its largest
   divisor not above ``chunk`` (``_get_smaller_split``), a matrix gets a 2-D DCT of every
   ``h x w`` tile, a vector a 1-D DCT of every chunk;
3. keeps the ``k`` largest-magnitude coefficients of every tile (``k`` clamped to the tile's
   size) and subtracts what they decode to from ``delta`` (the rest stays in the momentum);
4. allgathers the (index, value) pairs and averages every coefficient over the workers that sent
   it (``scatter_reduce(reduce="mean", include_self=False)``; zero where none did);
5. inverts the DCT and takes a plain SGD step with ``sign()`` of the result.

In lgc, steps 1 and 3's subtraction are error feedback with a decay, so the compressor is used as
``ErrorFeedback(DeMoCompressor(), decay=0.999)``: the residual ``r`` *is* DeMo's ``delta``
(``v = decay * r + g``, then ``r = v - decompress(payload)``). This module does steps 2 to 5, the
transform by matrix products with the closed-form DCT matrix (:mod:`lgc.compressors.dct`; the
reference's einsum with an FFT-built basis is equal up to float rounding).

Knobs: ``chunk``, ``k``, ``tiling``, ``aggregate``, ``sign``, ``value_dtype`` (reference defaults:
``compression_chunk=64``, ``compression_topk=32``; its ``compression_decay=0.999`` is error feedback's).

Tiles (:mod:`lgc.compressors.tiles`). ``tiling="shape"`` (default) is the reference's: a
``96 x 40`` matrix gets two ``48 x 40`` tiles, a ``10 x 64`` classifier one tile of 640 keeping
32, a 64-entry BatchNorm vector one chunk keeping 32 (half of it), a 10-entry bias all 10. On
lgc's CIFAR ResNet-8 (10 classes, 1 input channel) that is 1,386 coefficients per step, the
reference's count. ``tiling="flat"`` cuts the flat tensor into tiles of ``chunk**2`` consecutive
entries viewed as ``chunk x chunk`` matrices (one per 4,096 entries): a partial last tile of ``L``
entries keeps ``ceil(k * L / chunk**2)`` (at least one), so vectors keep one coefficient and the
ResNet-8 598; its ``q = L // chunk`` whole rows get the 2-D DCT of a ``(q, chunk)`` matrix and its
last ``L % chunk`` entries a 1-D DCT, orthonormal with exactly ``L`` coefficients (zero padding
would leak energy into every frequency). Flat tiles mix the rows of a wider matrix: where the rows'
scales differ they keep less of its energy than the reference's tiles.

Wire cost, with ``K`` kept coefficients: ``K * value_size + ceil(K * b / 8)`` bytes
(:func:`~lgc.compressors.chunked_topk.chunked_topk_nbytes` with DeMo's ``chunk``, ``k`` and
``tiling``): the values, then every coefficient's position within its tile in
``b = ceil(log2(tile size))`` bits (11 for a ``48 x 40`` tile, 6 for a 64-entry vector, 12 for a
64 x 64 or flat tile) instead of the reference's int64 index. Every worker knows the shapes, so
the payload's size and layout follow from them.

The workers' payloads combine by the ``aggregate`` knob, shared with chunked top-k
(:func:`~lgc.compressors.topk.sparse_mean`): ``"sender_mean"`` (default, the reference) or
``"mean"`` (the zero-filled mean ``sum / P``); then the inverse DCT and the sign.

What is verified (``tests/compressors/test_demo.py``): the DCT matrix is orthonormal and equals
``scipy.fft.dct`` / ``dctn`` with ``norm="ortho"``; keeping every coefficient round-trips to float
precision for every tiling; the kept coefficients are each tile's largest; wire size equals the
formula; error feedback's invariant ``v == decompress(payload) + r`` holds; and, for 2 and 4
workers over several steps on a ``96 x 40`` matrix, a 64-vector and a ``10 x 64`` classifier,
``ErrorFeedback(DeMoCompressor(), 0.999)`` behind the hook's ``1 / P`` plus ``torch.optim.SGD``
gives the same parameters, bit for bit, as a transcription of bloc97/DeMo's ``DeMo.step``.
A bucket encoded and decoded at once gives the per-tensor path's payloads, momenta and aggregates
bit for bit on one thread (``tests/compressors/test_bucket_codecs.py``, ``tests/ddp/test_hook.py``).

Deviations from the reference, and what they mean for training:

* **Conv weights.** The reference handles matrices and vectors only (it trains transformers); a
  tensor of more dimensions (a conv weight ``(out, in, kh, kw)``) is tiled here as the matrix
  ``(out, in * kh * kw)``.
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
* **From the first step.** The reference compresses every step; so does the DDP hook by default
  (:attr:`DeMoCompressor.default_start_iter` is 0, where other methods take one plain allreduce
  first). ``start_iter=1`` (``comm.start_iter=1``) makes the first step a plain average.
* **Every tensor, unless told otherwise.** The reference sends every parameter through DeMo; so
  does the DDP hook by default (:attr:`DeMoCompressor.default_min_numel` is 1, on every entry
  point). A ``min_numel`` given to the hook or ``lgc.compress`` (``comm.min_numel``) sends the
  smaller tensors as a plain average instead: no momentum, no sign.
* **Determinism.** The aggregate adds the workers' payloads one at a time in rank order (each
  payload's positions are distinct), so every rank decodes bitwise the same gradient; the
  reference's ``scatter_reduce`` over all workers' indices at once is flagged nondeterministic
  on CUDA in its own code, and a sign flip of a near-zero entry would make replicas drift.
* **``sign=False``** returns the aggregate itself (for a plain SGD step): the sender mean of the
  workers' own momenta, the hook's division by the world size undone (:meth:`set_world_size`).

Non-finite inputs are not special-cased: the hook skips such steps before compressing. Called
directly, an inf turns its tile's coefficients into inf/NaN, which reach the aggregate: ``sign()``
keeps a NaN as NaN (torch's maps it to 0, which would hide the bad input as a zero update; the
reference's ``sign_()`` does that, lgc departs there only).
Precision: the transform runs in fp32 (half-precision inputs are cast); with TF32 matmuls enabled
on a GPU it keeps only about three significant digits, which error feedback absorbs (the residual
is computed with the same decoder), but the round trip is then no longer exact to fp32.

Why one module: DeMo's transform of the reference's tiles, its per-tile selection, the payload those
fix (positions at the tile's bit width) and the sender-mean aggregate with its sign are one algorithm
whose per-tensor path and bucket path must give the same bits; the transform itself is
:mod:`lgc.compressors.dct`, the tiling :mod:`lgc.compressors.tiles`.

Example::

    >>> compressor = ErrorFeedback(DeMoCompressor(chunk=64, k=32), decay=0.999)
    >>> compressor.attach_parameters({"w": torch.empty(96, 40)})  # the hook attaches the model's parameters
    >>> payload = compressor.compress(torch.randn(96 * 40), key="w")  # two 48 x 40 tiles
    >>> payload.values.numel(), payload.nbytes  # 2 * 32 coefficients, 4 bytes + 11 bits each
    (64, 344)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lgc.compressors.base import OPTIMIZER_SOURCES, CombineMode, Compressor, Payload
from lgc.compressors.dct import TiledDCT
from lgc.compressors.segments import DecodesSegments, copy_segments_into
from lgc.compressors.tiles import TileChunk, TiledCompressorMixin, TileLayout, rows_topk
from lgc.compressors.topk import (
    SparseMeanAggregation,
    SparsePayload,
    check_aggregation,
    to_wire_float,
    wire_float_dtype,
)
from lgc.validation import PositiveInt, check

__all__ = [
    "DCTPayload",
    "DeMoCompressor",
]


def _sign_keeping_nan(tensor: Tensor) -> Tensor:
    """``tensor.sign_()`` in place, a NaN left NaN (torch's ``sign`` maps it to 0)."""
    nan = tensor.isnan()
    return tensor.sign_().masked_fill_(nan, float("nan"))


@dataclass
class DCTPayload(Payload):
    """``values[i]`` is the DCT coefficient at tile-order index ``indices[i]`` (tile start + position in the tile).

    On the wire: ``values``, then ``positions`` (every coefficient's position within its tile,
    packed at the layout's bits). ``indices`` and ``layout`` follow from the tensor's shape, which
    every receiver knows, and are not sent. Not a :class:`~lgc.compressors.SparsePayload`: its
    entries live in coefficient space, so error feedback must subtract the decoded tensor, not the
    values at their indices.
    """

    values: Tensor
    positions: Tensor
    #: Coefficient indices in tile order (int64); implied by the layout and ``positions``, not sent.
    indices: Tensor
    #: The tensor's tiles (its shape, DeMo's chunk, k and tiling): how to invert the coefficients.
    layout: TileLayout

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.values, self.positions)


class DeMoCompressor(DecodesSegments, TiledCompressorMixin, SparseMeanAggregation, Compressor):
    """DeMo: the ``k`` largest DCT coefficients of every tile, aggregated by sender mean and sign.

    Wrap it in :class:`~lgc.compressors.ErrorFeedback` with DeMo's ``decay=0.999`` (the residual is
    DeMo's momentum) and train with plain SGD (no momentum); see the module docstring for the
    deviations from the reference.

    Args:
        chunk: the target tile side, at least 2 (reference: 64). ``tiling="shape"``: a matrix's
            tiles are at most ``chunk x chunk`` (largest divisors of its dimensions), a vector's
            chunks at most ``chunk``; ``"flat"``: ``chunk**2`` consecutive entries. Larger tiles
            select over more coefficients (a more global frequency decomposition) at
            ``ceil(log2(tile size))`` bits per position and ``O(chunk)`` flops per entry.
        k: coefficients kept per tile, in ``[1, chunk**2]``, clamped to a smaller tile's size
            (reference: 32, density 0.78 % of a 64 x 64 tile, half of a 64-entry vector). More
            ``k`` sends more of the momentum per step, at ``value_size`` plus the position's bits
            per coefficient.
        sign: whether the aggregate is the ``sign()`` of the decoded mean (default, as the
            reference's sign-SGD). ``False`` returns the decoded mean itself, for a plain SGD step.
        tiling: ``"shape"`` (default, the reference's tiles) or ``"flat"`` (see the module docstring).
        aggregate: ``"sender_mean"`` (default, the reference: each coefficient averaged over the
            workers that sent it) or ``"mean"`` (zero-filled, ``sum / P``).
        value_dtype: dtype of the coefficients on the wire: ``"float32"`` (default), ``"float16"``
            or ``"bfloat16"`` (the rounding stays in error feedback's residual).

    Example::

        >>> payload = DeMoCompressor(chunk=2, k=1).compress(torch.tensor([1.0, 1.0, 1.0, 1.0]), "w")
        >>> payload.indices.tolist(), round(payload.values[0].item(), 4), payload.nbytes  # DC of each chunk of 2
        ([0, 2], 1.4142, 9)
    """

    needs_error_feedback = True
    combine = CombineMode.GATHER
    # The momentum lives in ErrorFeedback; the compressor keeps only cached DCT matrices.
    stateless = True
    # The reference sends every parameter through DeMo; a plain average would leave small tensors
    # without momentum and sign, stepping at a sign-SGD lr: effectively frozen.
    default_min_numel = 1
    #: The reference compresses from the first step; the hook's state is keyed by parameter, not by
    #: bucket, so DDP's rebuild of its buckets after that step changes nothing.
    default_start_iter = 0

    def __init__(
        self,
        chunk: TileChunk = 64,
        k: PositiveInt = 32,
        sign: bool = True,
        tiling: str = "shape",
        aggregate: str = "sender_mean",
        value_dtype: str | torch.dtype = "float32",
    ):
        self._init_tiles(chunk, k, tiling)
        self.sign = check("sign", sign, bool)
        self.aggregation = check_aggregation(aggregate)
        self.value_dtype = wire_float_dtype(value_dtype, "value_dtype")
        self._dct = TiledDCT(chunk)

    def check_optimizer(
        self, momentum: float, weight_decay: float | None, *, sources: tuple[str, str] = OPTIMIZER_SOURCES
    ) -> None:
        """Refuse momentum in the optimizer: DeMo's momentum is its error feedback's residual.

        Wrappers and hook states forward the call here (``state.check_optimizer(...)``).

        Args:
            momentum: the optimizer's momentum factor (Adam's first beta counts).
            weight_decay: not checked (DeMo applies no weight decay of its own).
            sources: where the two values come from.

        Raises:
            ValueError: on a nonzero optimizer momentum.
        """
        if float(momentum) != 0.0:
            raise ValueError(
                f"optimizer momentum is {momentum!r} but DeMo keeps its momentum in the error feedback's "
                "residual (compressor.error_decay, the reference's compression_decay) and sends only its fast "
                "components; a second momentum in the optimizer would smooth the signed updates again: set "
                "optimizer.momentum=0 (plain SGD, as the reference's torch.optim.SGD base)"
            )

    def transform(self, tensor: Tensor, layout: TileLayout | None = None) -> Tensor:
        """The tensor's DCT coefficients in tile order, as many as its entries (fp32; float64 stays float64).

        ``layout`` (default: the tensor as a vector, :meth:`layout`) gives the tiles: each tile's
        2-D DCT (a vector chunk's 1-D DCT), tile after tile, each row-major. Always a new tensor.
        """
        flat = tensor.reshape(-1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        return self._dct.apply(flat, layout or self.layout(None, flat.numel()), inverse=False)

    def inverse_transform(self, coefficients: Tensor, layout: TileLayout | None = None) -> Tensor:
        """Inverse of :meth:`transform` (the transform is orthonormal): the flat tensor."""
        flat = coefficients.reshape(-1)
        return self._dct.apply(flat, layout or self.layout(None, flat.numel()), inverse=True)

    # ----------------------------------------------------------------------------------------

    def compress(self, tensor: Tensor, key: str) -> DCTPayload:
        layout = self.layout_of(tensor, key)
        flat = tensor.reshape(-1).float()  # the transform writes a new tensor: nothing aliases ``tensor``
        coefficients = self._dct.apply(flat, layout, inverse=False)
        local = layout.select(coefficients)
        indices = layout.starts(flat.device).add_(local)
        return DCTPayload(
            numel=flat.numel(),
            values=to_wire_float(coefficients[indices], self.value_dtype),
            positions=layout.pack(local),
            indices=indices,
            layout=layout,
        )

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DCTPayload)
        coefficients = torch.zeros(payload.numel, dtype=torch.float32, device=payload.values.device)
        coefficients[payload.indices] = payload.values.float()
        return self._dct.apply(coefficients, payload.layout, inverse=True)

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        """DeMo's aggregate: the coefficients' mean (:attr:`aggregation`), inverse DCT, then ``sign()``."""
        first = payloads[0]
        assert isinstance(first, DCTPayload)
        decoded = self._dct.apply(self.sparse_mean(payloads), first.layout, inverse=True)
        return _sign_keeping_nan(decoded) if self.sign else decoded

    # -- a bucket at once ---------------------------------------------------------------------------

    def segments_supported(self) -> bool:
        """Shape tiles only: flat tiles' partial tiles differ tensor by tensor (:meth:`feed_back_segments`)."""
        return self.tiling == "shape"

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[DCTPayload]:
        """Every segment's payload (``keys[i]``'s, :meth:`compress`'s) and what it decodes to subtracted from
        ``flat`` in place: error feedback's bucket path (:class:`~lgc.compressors.segments.FeedsBackSegments`),
        ``flat`` left holding DeMo's momentum ``delta`` of every tensor.

        The tiles of every tensor that share a shape are transformed by one batched product each
        way (:meth:`~lgc.compressors.dct.TiledDCT.tiles`: each tile its own product, so on one thread
        the per-tensor path's bits; on several the last bits may differ), selected by one top-k over
        their rows (a tile's selection depends on its row alone), gathered, scattered back, decoded
        and subtracted at once: a pass per distinct tile shape (five on ResNet-50), not per tensor.
        Flat tiles (``tiling="flat"``) have no bucket pass (their partial tiles differ tensor by
        tensor): error feedback keeps its own loop for them (its ``batches_on``); a direct call is refused.
        """
        if not self.segments_supported():
            raise ValueError(f"tiling={self.tiling!r} has no bucket pass: only tiling='shape' tiles a bucket at once")
        segments = flat.split(list(numels))
        layouts = [self.layout(key, numel) for key, numel in zip(keys, numels, strict=True)]
        payloads: list[DCTPayload | None] = [None] * len(layouts)
        decoded: list[Tensor | None] = [segment if not segment.numel() else None for segment in segments]
        for i in (i for i, segment in enumerate(segments) if not segment.numel()):
            payloads[i] = self.compress(segments[i], keys[i])
        for (h, w, keep), members in _by_tile_shape(layouts).items():
            tiles = [layouts[i].groups[0].tiles for i in members]
            blocks = [layouts[i].order(segments[i]).view(t, h, w) for i, t in zip(members, tiles, strict=True)]
            coefficients = self._dct.tiles(torch.cat(blocks), inverse=False)  # a fresh, aligned batch
            rows = coefficients.view(-1, h * w)
            if keep == h * w:
                local = torch.arange(keep, device=flat.device).expand(rows.shape[0], keep)
            else:
                local = rows_topk(rows, keep)
            values = to_wire_float(rows.gather(1, local), self.value_dtype)
            sent = torch.zeros_like(rows).scatter_(1, local, values.float())
            inverse = self._dct.tiles(sent.view(-1, h, w), inverse=True).view(-1)
            for i, part, kept, back in zip(
                members,
                local.split(tiles),
                values.split(tiles),
                inverse.split([t * h * w for t in tiles]),
                strict=True,
            ):
                layout, positions = layouts[i], part.reshape(-1)
                payloads[i] = DCTPayload(
                    numel=numels[i],
                    values=kept.reshape(-1),
                    positions=layout.pack(positions),
                    indices=layout.starts(flat.device).add_(positions),
                    layout=layout,
                )
                decoded[i] = layout.unorder(back)
        flat.sub_(torch.cat(decoded))  # type: ignore[arg-type]
        return payloads  # type: ignore[return-value]

    def decode_segments(self, payloads: Sequence[Sequence[Payload]], outs: Sequence[Tensor]) -> None:
        """Every rank's payloads of a bucket's tensors (``payloads[i]``: tensor ``i``'s) aggregated into ``outs``
        as :meth:`aggregate_into` does tensor by tensor, bit for bit on one thread.

        The coefficients' mean (:attr:`aggregation`) of the whole bucket at once, each rank's
        payloads added in rank order as :func:`~lgc.compressors.topk.sparse_mean` adds them; then
        one batched inverse transform per tile shape, the ``sign()`` and one copy into ``outs``.
        """
        firsts = [received[0] for received in payloads]
        assert all(isinstance(p, DCTPayload) for p in firsts)
        layouts = [p.layout for p in firsts]  # type: ignore[attr-defined]
        numels = [out.numel() for out in outs]
        starts = [0, *itertools.accumulate(numels[:-1])]
        shifted = [
            SparsePayload(
                numel=sum(numels),
                values=torch.cat([received[rank].values for received in payloads]),  # type: ignore[attr-defined]
                indices=torch.cat(
                    [received[rank].indices + start for received, start in zip(payloads, starts, strict=True)]  # type: ignore[attr-defined]
                ),
            )
            for rank in range(len(payloads[0]))
        ]
        mean = self.sparse_mean(shifted)  # type: ignore[arg-type]
        segments = mean.split(numels)
        decoded: list[Tensor | None] = [segment if not segment.numel() else None for segment in segments]
        for (h, w, _), members in _by_tile_shape(layouts).items():
            blocks = [segments[i].view(-1, h, w) for i in members]
            inverse = self._dct.tiles(torch.cat(blocks), inverse=True)
            if self.sign:
                _sign_keeping_nan(inverse)
            for i, back in zip(members, inverse.view(-1).split([numels[i] for i in members]), strict=True):
                decoded[i] = layouts[i].unorder(back)
        copy_segments_into(torch.cat(decoded), outs)  # type: ignore[arg-type]

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> DCTPayload:
        layout = self.layout(key, numel)
        what = f"the DeMo payload of {key!r} ({numel} entries)"
        values, positions, local = layout.parse(wire, self.value_dtype, what)
        return DCTPayload(
            numel=numel,
            values=values,
            positions=positions,
            indices=layout.starts(local.device).add_(local),
            layout=layout,
        )

    # ----------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"DeMoCompressor(chunk={self.chunk}, k={self.k}, sign={self.sign}{self._knobs_repr()})"


def _by_tile_shape(layouts: Sequence[TileLayout]) -> dict[tuple[int, int, int], list[int]]:
    """The tensors (their places in ``layouts``) by tile shape and coefficients kept per tile, in order; empty
    tensors (no tiles) left out."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, layout in enumerate(layouts):
        if not layout.numel:
            continue
        assert layout.tile_shape is not None and len(layout.groups) == 1, "shape tiles: one group of tiles"
        (h, w), keep = layout.tile_shape, layout.groups[0].keep
        groups.setdefault((h, w, keep), []).append(i)
    return groups
