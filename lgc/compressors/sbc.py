"""Sparse Binary Compression (SBC): one mean value and Golomb-coded positions per tensor.

Sattler, Wiedemann, Müller & Samek, "Sparse Binary Compression: Towards Distributed Deep Learning
with minimal Communication" (IJCNN 2019, arXiv:1805.08768). SBC combines three ideas; this module
is the compressor in the middle, the other two live elsewhere in the package:

* **Communication delay** (each worker runs ``n`` local SGD steps, then sends its weight update
  ``dW``) is :mod:`lgc.ddp.local_sgd`, switched on by ``comm=local_sgd comm.delay=n``
  (``comm=every_step``, the default: compress the gradient every step). This compressor
  compresses whatever flat tensor it is given: a gradient or, with delay, a weight update.
* **Residual accumulation** ``A += dW; ...; A -= sent`` is exactly error feedback:
  :class:`lgc.compressors.ErrorFeedback`, the yaml's ``error_feedback: true``.
* **Sparse binarization and Golomb coding**, per tensor ``v`` (here):

  1. Take the ``k = ceil(density * n)`` largest entries of ``v`` and the ``k`` smallest (most
     negative) ones; let ``mu+`` be the mean of the first set and ``mu-`` minus the mean of the
     second (both mean magnitudes).
  2. Keep only the side with the larger mean magnitude (``mu+ >= mu-`` keeps the positive side):
     every one of its ``k`` positions gets the same value, ``+mu+`` or ``-mu-``: the signed mean
     of the kept entries.
  3. Send that value as one fp32 and the ``k`` positions Golomb-Rice coded
     (:mod:`lgc.coding.golomb`) with SBC's parameter ``b*`` for ``p = k / n``: about 8.1 bits per
     position at ``p = 0.01`` and 11.5 at ``p = 0.001``, against 32 for a raw index.

Wire format per tensor: the mean (4 bytes, fp32, little-endian), then the Golomb code's wire bytes
(a 5-byte header with the count and ``b``, then the bit stream). Payload sizes differ between
workers, so payloads are allgathered with their sizes exchanged first (``variable_size``); the
receiver decodes every worker's positions and scatter-adds the means.

Selection without a full top-k: each side is found exactly through a bound on blocks of
consecutive entries (:func:`lgc.compressors.selection.extreme_sides`, whose docstring proves it),
equal to two full ``torch.topk`` calls up to which of several equal entries is taken.

Error feedback stores ``r = fl(v - mu)`` at the sent positions (and ``v`` itself elsewhere), so
``v == decoded + r`` holds bit for bit at unsent positions and up to that one rounding, half an ulp
of ``|v - mu|``, at sent ones; it is exact wherever ``mu / 2 <= v <= 2 mu`` (Sterbenz' lemma).

Deviations from the paper, all at the edges:

* **Ties** are cut to exactly ``k`` positions (in a tensor below 32,768 entries the first ones in
  memory order; above, the block bound may keep later tied entries; a bucket at once, the first
  ones); the paper's mask ``A >= min(val+)`` would send every tied entry. A tie of ``mu+`` and
  ``mu-`` keeps the positive side.
* **Fewer than k entries of one sign**: the paper's ``top_k(A)`` then includes zeros (or entries of
  the other sign) and so does this implementation. The kept side's signed mean never has the wrong
  sign (``mu+ >= mu-`` implies ``mu+ >= 0``), it only shrinks.
* **density = 1** sends every position and both sides are the whole tensor: the decoded tensor is
  the tensor's mean everywhere (sign included), and the Golomb code is ``n`` bits (``b* = 0``, every
  gap 1). Error feedback keeps ``v - mean(v)``. This is SBC's definition taken literally, not a
  useful setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, NamedTuple

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from lgc.coding.golomb import MAX_GOLOMB_PARAMETER, GolombCode, golomb_decode, golomb_encode
from lgc.coding.golomb_segments import golomb_decode_segments, golomb_encode_segments
from lgc.compressors.base import CombineMode, Compressor, Payload, view_bytes_as
from lgc.compressors.segment_topk import segment_topk
from lgc.compressors.selection import extreme_sides
from lgc.compressors.topk import (
    ScatterAddAggregation,
    SparsePayload,
    num_selected,
    scatter_add_sparse_into,
    segment_starts,
)
from lgc.validation import Density, check

__all__ = [
    "MEAN_BYTES",
    "GolombParameter",
    "SBCCompressor",
    "SBCPayload",
    "SBCSelection",
    "sbc_select",
    "sbc_select_segments",
]

#: Bytes of the one value sent per tensor (fp32).
MEAN_BYTES = 4
#: A forced Rice parameter ``b`` of the position code.
GolombParameter = Annotated[
    int, Field(ge=0, le=MAX_GOLOMB_PARAMETER, description=f"an integer in [0, {MAX_GOLOMB_PARAMETER}]")
]


class SBCSelection(NamedTuple):
    """What SBC keeps of one tensor (see :func:`sbc_select`)."""

    #: The ``k`` kept positions, ascending, int64.
    positions: Tensor
    #: The value sent at every kept position: the signed mean of the kept entries (1 fp32 element).
    mean: Tensor
    #: ``mu+``: mean of the ``k`` largest entries.
    mean_positive: float
    #: ``mu-``: minus the mean of the ``k`` smallest entries (a magnitude).
    mean_negative: float

    @property
    def positive(self) -> bool:
        """Whether the positive side won (``mu+ >= mu-``)."""
        return self.mean_positive >= self.mean_negative


@dataclass
class SBCPayload(SparsePayload):
    """SBC's message for one tensor: ``mean`` at every position coded in ``code``.

    Only ``mean`` and ``code`` go on the wire (in that order): ``nbytes = 4 + code.numel()``.
    ``indices`` (the decoded positions, int64, ascending) and ``values`` (``mean`` repeated, a
    zero-copy expand) are implied by them and rebuilt on arrival. Being a :class:`SparsePayload`
    lets every consumer treat it as (values, indices) pairs, the error-feedback wrapper's O(k)
    residual update included (instead of a dense decode and subtraction of the whole tensor).
    """

    #: ``+mu+`` or ``-mu-``: one fp32 element.
    mean: Tensor
    #: The Golomb code of the positions, :meth:`GolombCode.to_wire` bytes (uint8, header included).
    code: Tensor

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.mean, self.code)

    @property
    def golomb(self) -> GolombCode:
        """The position code, parsed (to read ``b``, ``num_bits`` or ``bits_per_position``)."""
        return GolombCode.from_wire(self.code)

    @classmethod
    def from_wire(cls, wire: Tensor, numel: int, value_dtype: torch.dtype = torch.float32) -> SBCPayload:
        """Parse ``mean`` and ``code`` and decode the positions.

        Raises:
            ValueError: on a buffer that is too short, a corrupt code, or positions outside
                ``[0, numel)``.
        """
        if value_dtype != torch.float32:
            raise ValueError(f"SBC sends its mean in float32, not {value_dtype}")
        if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() < MEAN_BYTES:
            raise ValueError(f"an SBC payload is a 1-D uint8 buffer of >= {MEAN_BYTES} bytes, got {wire.numel()}")
        mean = view_bytes_as(wire[:MEAN_BYTES], torch.float32)
        code = wire[MEAN_BYTES:]
        positions = golomb_decode(GolombCode.from_wire(code))
        if positions.numel() and int(positions[-1]) >= numel:
            raise ValueError(f"SBC payload has position {int(positions[-1])} in a tensor of {numel} elements")
        return cls(numel=numel, values=mean.expand(positions.numel()), indices=positions, mean=mean, code=code)


def sbc_select(tensor: Tensor, k: int) -> SBCSelection:
    """SBC's selection: the side (``k`` largest or ``k`` smallest entries) of larger mean magnitude.

    Exactly equivalent to ``torch.topk(v, k)`` and ``torch.topk(-v, k)`` over the whole tensor
    followed by a comparison of the two means (:func:`~lgc.compressors.selection.extreme_sides` avoids
    both full top-k calls; the module docstring says how ties are handled).

    Args:
        tensor: any floating tensor (flattened).
        k: entries per side, ``1 <= k <= tensor.numel()``.

    Returns:
        The kept positions (ascending) and the signed mean sent for them, with both sides' means.
    """
    values = tensor.detach().reshape(-1)
    numel = values.numel()
    if not 1 <= k <= numel:
        raise ValueError(f"k must be in [1, {numel}] for a tensor of {numel} elements, got {k}")
    positive, negative = extreme_sides(values, k)
    mean_positive, mean_negative = positive.total / k, -negative.total / k
    sent = positive if mean_positive >= mean_negative else negative
    mean = torch.tensor([sent.total / k], dtype=torch.float32, device=values.device)
    return SBCSelection(sent.positions(), mean, mean_positive, mean_negative)


def sbc_select_segments(flat: Tensor, numels: Sequence[int], ks: Sequence[int]) -> tuple[Tensor, Tensor]:
    """:func:`sbc_select` of every segment of ``flat`` at once (a DDP bucket's tensors laid end to end).

    Both sides of every segment from two signed :func:`~lgc.compressors.segment_topk.segment_topk`
    calls (the ``k`` largest of ``flat`` and of ``-flat``), their sums in float64 with one
    ``index_add_`` each, the side of larger mean magnitude kept per segment (a tie keeps the
    positive one). The positions and means are :func:`sbc_select`'s where its sides are unique
    (entries tied at a side's ``k``-th value may be chosen differently, as between any two exact
    top-k); the sides' float64 sums are formed in another order than :func:`sbc_select`'s, which
    reaches the fp32 mean, or the choice of side, only where the exact sum lies within a float64
    rounding of a boundary. ``flat`` holding an inf or a NaN takes :func:`sbc_select` segment by
    segment.

    Args:
        flat: the segments end to end (any floating dtype).
        numels: each segment's length; they sum to ``flat.numel()``.
        ks: entries per side of each segment, ``1 <= k <= numel``.

    Returns:
        int64 positions in ``flat``, ascending (so segment by segment, ``ks[i]`` each), and every
        segment's signed mean (fp32, one per segment).
    """
    values = flat.detach().reshape(-1)
    bad = [(i, k, n) for i, (k, n) in enumerate(zip(ks, numels, strict=True)) if not 1 <= k <= n]
    if bad or sum(numels) != values.numel():
        raise ValueError(f"every k must lie in [1, numel] and the numels sum to {values.numel()}: {bad[:1]}")
    if not bool(torch.isfinite(values).all()):
        selections = [sbc_select(piece, k) for piece, k in zip(values.split(list(numels)), ks, strict=True)]
        starts = segment_starts(numels, ks, values.device)
        return torch.cat([s.positions for s in selections]) + starts, torch.cat([s.mean for s in selections])
    device = values.device
    high = segment_topk(values, numels, ks, signed=True)
    low = segment_topk(values.neg(), numels, ks, signed=True)
    k = torch.tensor(list(ks), dtype=torch.float64, device=device)
    owner = torch.repeat_interleave(torch.arange(len(ks), device=device), k.long(), output_size=sum(ks))
    totals = torch.zeros(2, len(ks), dtype=torch.float64, device=device)
    totals[0].index_add_(0, owner, values[high].double())
    totals[1].index_add_(0, owner, values[low].double())
    positive = totals[0] / k >= -totals[1] / k
    chosen = torch.where(positive[owner], high, low)
    means = (torch.where(positive, totals[0], totals[1]) / k).float()
    return chosen.sort().values, means


def _check_payloads(payloads: list[Payload]) -> None:
    for payload in payloads:
        if not isinstance(payload, SBCPayload):
            raise TypeError(f"SBCCompressor aggregates SBCPayload, got {type(payload).__name__}")


def _zeros(numel: int, device: torch.device) -> Tensor:
    """A dense fp32 zero tensor to scatter a few entries into.

    On CPU it comes from ``np.zeros``, i.e. ``calloc``: a large block is mapped from the kernel's
    zero pages, so only the pages that are written (or later read) are ever touched, where
    ``torch.zeros`` first writes every byte. Decoding 25 M entries into it and copying the result
    into a gradient bucket takes about a third of the time with ``torch.zeros``.
    """
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(numel, dtype=np.float32))
    return torch.zeros(numel, dtype=torch.float32, device=device)


class SBCCompressor(ScatterAddAggregation, Compressor):
    """Sparse Binary Compression (Sattler et al. 2019): the stronger sign side as one mean + Golomb-coded positions.

    Wire cost per tensor: ``4 + 5 + ceil(bits / 8)`` bytes, ``bits ~= k * (b* + 1 / (1 - (1 - p)^(2^b*)))``
    for ``k = ceil(density * n)`` random positions: about ``density * (b* + 1.5)`` bits per element,
    i.e. a compression ratio of ~2800 at density 0.001 (11.5 bits per position) where top-k
    (64 bits per entry) reaches 500. Use it with error feedback (yaml ``error_feedback: true``):
    SBC's residual accumulation is exactly that, and without it the unsent side is lost. For SBC's
    communication delay set ``comm=local_sgd comm.delay=n`` in the training config
    (:mod:`lgc.ddp.local_sgd`); the compressor then sees weight updates instead of gradients and
    needs no change.

    Args:
        density: fraction ``p`` of entries sent, in (0, 1]; ``k = ceil(p * n)`` positions per
            tensor (at least one). The paper combines gradient sparsity of about 1 % down to 0.1 %
            with communication delay [?: typical values remembered, not re-checked]. Lower density
            saves bytes almost linearly (positions cost ``b* + ~1.5`` bits each, ``b*`` growing by
            one bit per halving of ``p``), but each step moves only one sign side by one common
            magnitude, so convergence per step is slower than top-k at the same density; the
            residual carries the rest. Start at 0.01, go to 0.001 for large layers with delay.
        golomb_parameter: Rice parameter ``b`` of the position code, an int in ``[0, 48]``, or
            ``None`` (default) for SBC's optimum ``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p)))``,
            within about 1 % of the entropy bound for random positions. Forcing a value only helps
            experiments, e.g. measuring the cost of a mismatched ``b``.

    Example::

        >>> compressor = SBCCompressor(density=0.25)
        >>> payload = compressor.compress(torch.tensor([3.0, -1.0, 0.5, 2.0, -4.0, 1.0, 0.0, 2.5]), key="w")
        >>> payload.mean.tolist(), payload.indices.tolist(), payload.nbytes
        ([2.75], [0, 7], 10)
    """

    needs_error_feedback = True
    pure_encoding = True
    combine = CombineMode.GATHER
    variable_size = True

    def __init__(self, density: Density = 0.01, golomb_parameter: GolombParameter | None = None) -> None:
        check("density", density, Density)
        check("golomb_parameter", golomb_parameter, GolombParameter | None)
        self.density = float(density)
        self.golomb_parameter = golomb_parameter

    def compress(self, tensor: Tensor, key: str) -> SBCPayload:
        numel = tensor.numel()
        if numel == 0:
            raise ValueError(f"SBC cannot compress the empty tensor {key!r}")
        k = num_selected(numel, self.density)
        selection = sbc_select(tensor, k)
        code = golomb_encode(selection.positions, numel, b=self.golomb_parameter)
        return SBCPayload(
            numel=numel,
            values=selection.mean.expand(k),
            indices=selection.positions,
            mean=selection.mean,
            code=code.to_wire(),
        )

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[SBCPayload]:
        """Every segment's payload (:func:`sbc_select_segments`: the selection at once), and each segment's
        mean subtracted at its positions in one ``index_add_``, as error feedback subtracts a payload
        (:class:`~lgc.compressors.segments.FeedsBackSegments`). Every segment's positions are Golomb
        coded at once (:func:`~lgc.coding.golomb_segments.golomb_encode_segments`)."""
        ks = [num_selected(numel, self.density) for numel in numels]
        positions, means = sbc_select_segments(flat, numels, ks)
        local = positions - segment_starts(numels, ks, positions.device)
        codes = golomb_encode_segments(local, numels, ks, b=self.golomb_parameter)
        payloads = []
        for numel, k, index, mean, code in zip(numels, ks, local.split(ks), means.split(1), codes, strict=True):
            payloads.append(SBCPayload(numel=numel, values=mean.expand(k), indices=index, mean=mean, code=code))
        repeats = torch.tensor(ks, device=means.device)
        flat.index_add_(0, positions, means.repeat_interleave(repeats, output_size=sum(ks)).to(flat.dtype), alpha=-1)
        return payloads

    def decompress(self, payload: Payload) -> Tensor:
        if not isinstance(payload, SBCPayload):
            raise TypeError(f"SBCCompressor decodes SBCPayload, got {type(payload).__name__}")
        dense = _zeros(payload.numel, payload.mean.device)
        return dense.index_fill_(0, payload.indices, payload.mean[0])  # positions are distinct

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        """Sum of all workers' decoded payloads (positions may overlap), one payload at a time in rank order.

        Not one scatter over all of them: on a GPU that adds a position's values in an unspecified
        order, and every rank must decode the same bits.
        """
        if len(payloads) == 1:
            return self.decompress(payloads[0])
        _check_payloads(payloads)
        total = _zeros(payloads[0].numel, payloads[0].mean.device)  # type: ignore[attr-defined]
        for payload in payloads:
            payload.add_to(total)  # type: ignore[attr-defined]
        return total

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        """:meth:`aggregate` written into ``out`` (the tensor's slice of the DDP bucket) without a dense temporary.

        ``out`` is zeroed in place and every payload adds its mean at its positions, in rank
        order: the sum :meth:`aggregate` gives, without allocating and copying a whole tensor.
        """
        _check_payloads(payloads)
        scatter_add_sparse_into(payloads, out)  # type: ignore[arg-type]

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> SBCPayload:
        return SBCPayload.from_wire(wire, numel)

    def payloads_from_wire_many(
        self, wires: Sequence[Tensor], numels: Sequence[int], keys: Sequence[str]
    ) -> list[Payload]:
        """One rank's payloads of a bucket at once: the means read together and every tensor's positions
        decoded in a fixed number of passes (:func:`~lgc.coding.golomb_segments.golomb_decode_segments`), with
        :meth:`SBCPayload.from_wire`'s checks and payloads."""
        if len(wires) < 2:
            return super().payloads_from_wire_many(wires, numels, keys)
        for wire in wires:
            if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() < MEAN_BYTES:
                raise ValueError(f"an SBC payload is a 1-D uint8 buffer of >= {MEAN_BYTES} bytes, got {wire.numel()}")
        codes = [wire[MEAN_BYTES:] for wire in wires]
        decoded = golomb_decode_segments(codes)
        lasts = torch.stack([p[-1] if p.numel() else p.new_full((), -1) for p in decoded]).tolist()
        for last, numel in zip(lasts, numels, strict=True):
            if last >= numel:
                raise ValueError(f"SBC payload has position {last} in a tensor of {numel} elements")
        payloads: list[Payload] = []
        for wire, numel, positions, code in zip(wires, numels, decoded, codes, strict=True):
            mean = view_bytes_as(wire[:MEAN_BYTES], torch.float32)
            payloads.append(
                SBCPayload(numel=numel, values=mean.expand(positions.numel()), indices=positions, mean=mean, code=code)
            )
        return payloads

    def __repr__(self) -> str:
        return f"SBCCompressor(density={self.density}, golomb_parameter={self.golomb_parameter})"
