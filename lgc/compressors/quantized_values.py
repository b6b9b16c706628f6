"""Quantized values for any sparsifier: the kept entries' values in a few bits each.

A sparsifier sends (value, position) pairs; at 1-3 % density the values are most of what remains
(32 bits each against 12 for a chunk-relative position). SparseLoCo (Sarfi et al.,
"Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706, 2025) sends them in
2 bits. :class:`QuantizedValues` wraps a sparsifier (:class:`~lgc.compressors.TopKCompressor`,
:class:`~lgc.compressors.ChunkedTopKCompressor`) and replaces its values by ``bits``-bit codes, so
quantization composes with the selection instead of needing a class per pair; wrap the result in
:class:`~lgc.compressors.ErrorFeedback` and the rounding error is fed back with the unsent entries.

The quantizer is the statistical one of the Templar team's CCLoco/SparseLoCo code (deterministic,
per tensor): with ``B = 2**bits`` bins, the values' mean ``mu`` and standard deviation ``sigma``,
a value ``v`` gets the code ``clamp(round((v - mu) / s + B // 2), 0, B - 1)`` where the bin width is
``s = range_sigmas * sigma / B``; the receiver looks the code up in a table of ``B`` fp32 numbers,
each the mean of the values that got that code (so every bin decodes to its own centroid, not to
its midpoint). Top-k values are two clusters of large magnitudes, one per sign, and the centroids
follow them.

Wire: ``ceil(K * bits / 8)`` bytes of codes, ``4 * 2**bits`` bytes of table, then the sparsifier's
own positions; with :class:`~lgc.compressors.ChunkedTopKCompressor` that is
:func:`quantized_values_nbytes`.

Verified: codes and table reproduce the centroids exactly; the payload size equals the formula;
error feedback keeps ``v == decode(payload) + r`` exactly; with SparseLoCo's production settings
(tplr-ai/templar ``hparams/hparams.json``: ``quantization_bins=4``, ``quantization_range=6``) the
decoded values equal templar's ``_quantize_values`` / ``_dequantize_values``
(``src/tplr/compress.py``) to float rounding (``tests/compressors/test_sparseloco.py``). The reference's table
holds the centroids of the centred values and the mean beside them (20 bytes for 2 bits); lgc's
holds the centroids themselves (16 bytes), the same numbers up to rounding.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, runtime_checkable

import torch
from pydantic import Field
from torch import Tensor

from lgc.coding.bitpack import pack_uint, packed_nbytes, unpack_uint
from lgc.compressors.base import CombineMode, Compressor, ForwardsHookCalls, Payload, view_bytes_as
from lgc.compressors.tiles import tile_layout
from lgc.compressors.topk import SparsePayload, subtract_sent
from lgc.validation import PositiveFloat, check

__all__ = ["FixedCountSparsifier", "QuantizedPayload", "QuantizedValues", "quantize_values", "quantized_values_nbytes"]

#: A code width :class:`QuantizedValues` accepts.
Bits = Annotated[int, Field(ge=1, le=8, description="an integer from 1 to 8")]


def quantized_values_nbytes(
    shape: int | Sequence[int], chunk: int = 64, k: int = 64, bits: int = 2, tiling: str = "shape"
) -> int:
    """Exact wire bytes of ``QuantizedValues(ChunkedTopKCompressor(chunk, k, tiling), bits)`` for a tensor of ``shape``.

    ``ceil(K * bits / 8)`` code bytes + ``4 * 2**bits`` table bytes + ``ceil(K * p / 8)`` position
    bytes, with ``K`` the kept count and ``p`` the bits of a position in the tensor's tiles
    (:func:`~lgc.compressors.tiles.tile_layout`). An int ``shape`` is a vector.
    """
    layout = tile_layout(shape, chunk, k, tiling)
    return packed_nbytes(layout.count * bits) + 4 * (1 << bits) + packed_nbytes(layout.count * layout.bits)


#: Bins summed per reduction on a GPU: (bins, n) masks of at most this many rows.
_BINS_PER_PASS = 16


def _bin_sums(values: Tensor, codes: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """Each bin's sum and count of ``values`` (fp32), the same bits on every call.

    On the CPU ``index_add_`` adds in order. On a GPU it adds a bin's many values with atomics in
    no fixed order, so the table (and every decoded value) would differ in its last bits from call
    to call on the same input: there each bin's sum is a reduction over a mask, up to
    :data:`_BINS_PER_PASS` bins per pass.
    """
    if values.device.type == "cpu":
        sums = values.new_zeros(bins).index_add_(0, codes, values)
        return sums, values.new_zeros(bins).index_add_(0, codes, torch.ones_like(values))
    sums, counts = [], []
    for first in range(0, bins, _BINS_PER_PASS):
        ids = torch.arange(first, min(first + _BINS_PER_PASS, bins), device=codes.device)
        members = codes.unsqueeze(0) == ids.unsqueeze(1)
        sums.append(torch.where(members, values, 0.0).sum(1))
        counts.append(members.sum(1).to(values.dtype))
    return torch.cat(sums), torch.cat(counts)


def quantize_values(values: Tensor, bits: int, range_sigmas: float) -> tuple[Tensor, Tensor]:
    """The codes (int64, in ``[0, 2**bits)``) and the fp32 table of bin centroids for ``values``."""
    bins = 1 << bits
    values = values.float()
    mean = values.mean() if values.numel() else values.new_zeros(())
    centered = values - mean
    std = centered.norm() / (values.numel() - 1) ** 0.5 if values.numel() > 1 else values.new_zeros(())
    width = range_sigmas * std / bins
    # All values equal (or one value): every code is the middle bin, whose centroid is exact.
    width = torch.where((width > 0) & torch.isfinite(width), width, torch.ones_like(width))
    codes = torch.round(centered / width + bins // 2).clamp_(0, bins - 1).long()
    sums, counts = _bin_sums(values, codes, bins)
    table = torch.where(counts > 0, sums / counts.clamp(min=1), mean.expand(bins))
    return codes, table


@runtime_checkable
class FixedCountSparsifier(Protocol):
    """A sparsifier whose count of kept (value, position) pairs follows from the tensor's length.

    :class:`~lgc.compressors.TopKCompressor` and :class:`~lgc.compressors.ChunkedTopKCompressor`
    are; :class:`QuantizedValues` wraps only such a one (and one whose payloads are gathered).
    """

    value_dtype: torch.dtype

    def selected_count(self, numel: int, key: str | None = None) -> int:
        """How many pairs a tensor of ``numel`` entries (the parameter ``key``) sends."""
        ...


@dataclass
class QuantizedPayload(Payload):
    """A sparsifier's payload with its values replaced by ``bits``-bit codes and a table of centroids.

    ``inner`` is the sparsifier's payload with the decoded values (what the codes stand for); only
    ``codes``, ``table`` and the inner payload's tensors other than its values are sent.
    """

    codes: Tensor
    table: Tensor
    inner: SparsePayload

    def tensors(self) -> tuple[Tensor, ...]:
        rest = tuple(t for t in self.inner.tensors() if t is not self.inner.values)
        return (self.codes, self.table, *rest)


class QuantizedValues(ForwardsHookCalls, Compressor):
    """Wraps a sparsifier and sends its kept values in ``bits`` bits each (SparseLoCo: 2).

    Args:
        sparsifier: a compressor whose payloads are (value, position) pairs and whose count of
            kept entries follows from the tensor's length (``selected_count``):
            :class:`~lgc.compressors.ChunkedTopKCompressor` or :class:`~lgc.compressors.TopKCompressor`.
            A mapping ``{"_target_": "lgc.compressors.ChunkedTopKCompressor", **knobs}`` builds one
            (what the yaml and ``lgc.compress(..., sparsifier={"k": 32})`` pass).
        bits: code width, 1 to 8 (SparseLoCo: 2, four bins).
        range_sigmas: the bins together span this many standard deviations of the values (the
            CCLoco code's default 6); values beyond the span take the outermost bins.

    Example::

        >>> q = QuantizedValues(ChunkedTopKCompressor(chunk=64, k=64), bits=2)
        >>> q.attach_parameters({"w": torch.empty(128, 64)})  # what the DDP hook does with the model's parameters
        >>> q.compress(torch.randn(128 * 64), "w").nbytes  # 2 tiles of 64 x 64 keep 64 each: 32 + 16 + 192 bytes
        240
    """

    combine = CombineMode.GATHER

    def __init__(
        self, sparsifier: Compressor | Mapping[str, Any], bits: Bits = 2, range_sigmas: PositiveFloat = 6.0
    ) -> None:
        sparsifier = _build_sparsifier(sparsifier)
        if not isinstance(sparsifier, FixedCountSparsifier) or sparsifier.combine is not CombineMode.GATHER:
            raise ValueError(
                f"QuantizedValues needs a sparsifier that sends a known number of (value, position) pairs, "
                f"ChunkedTopKCompressor or TopKCompressor; got {sparsifier!r}"
            )
        check("bits", bits, Bits)
        check("range_sigmas", range_sigmas, PositiveFloat)
        self.sparsifier = sparsifier
        self.bits = bits
        self.range_sigmas = float(range_sigmas)
        self.stateless = sparsifier.stateless
        self.pure_encoding = sparsifier.pure_encoding

    @property
    def compressor(self) -> Compressor:
        """The wrapped sparsifier (the hook's calls reach it: :class:`~lgc.compressors.base.ForwardsHookCalls`)."""
        return self.sparsifier

    @property
    def density(self) -> float:
        return float(self.sparsifier.density)  # type: ignore[attr-defined]

    def compress(self, tensor: Tensor, key: str) -> QuantizedPayload:
        inner = self.sparsifier.compress(tensor, key)
        assert isinstance(inner, SparsePayload), f"{self.sparsifier!r} did not return a sparse payload"
        return self._quantized(inner)

    def _quantized(self, inner: SparsePayload) -> QuantizedPayload:
        """``inner`` with its values replaced by codes and a table (the decoded values kept in ``inner``)."""
        codes, table = quantize_values(inner.values, self.bits, self.range_sigmas)
        return QuantizedPayload(
            numel=inner.numel,
            codes=pack_uint(codes, self.bits),
            table=table,
            inner=dataclasses.replace(inner, values=table[codes]),
        )

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[QuantizedPayload]:
        """A bucket at once under error feedback (:class:`~lgc.compressors.segments.FeedsBackSegments`), where the
        sparsifier selects a bucket at once in :meth:`compress`'s order (``select_segments`` with
        ``selects_in_compress_order``: chunked top-k): its selection over the bucket, every tensor's
        values quantized (a table per tensor, as :meth:`compress`), and what the codes stand for
        subtracted from ``flat`` in one ``index_add_``. Each payload and residual is the per-tensor
        path's, bit for bit. Otherwise (top-k, whose pairs come in another order there, so a table's
        sums could round differently; a sparsifier of one's own) error feedback's loop, tensor by tensor."""
        select = getattr(self.sparsifier, "select_segments", None)
        if select is None or not getattr(self.sparsifier, "selects_in_compress_order", False):
            payloads = []
            for segment, key in zip(flat.split(list(numels)), keys, strict=True):
                payloads.append(self.compress(segment, key))
                payloads[-1].inner.subtract_from(segment)
            return payloads
        inners, positions = select(flat, numels, keys)
        payloads = [self._quantized(inner) for inner in inners]
        subtract_sent(flat, [payload.inner for payload in payloads], positions)
        return payloads

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, QuantizedPayload)
        return self.sparsifier.decompress(payload.inner)

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        return self.sparsifier.aggregate([p.inner for p in payloads])  # type: ignore[attr-defined]

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        self.sparsifier.aggregate_into([p.inner for p in payloads], out)  # type: ignore[attr-defined]

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> QuantizedPayload:
        count = self.sparsifier.selected_count(numel, key)  # type: ignore[attr-defined]
        code_bytes, table_bytes = packed_nbytes(count * self.bits), 4 * (1 << self.bits)
        codes = wire[:code_bytes]
        table = view_bytes_as(wire[code_bytes : code_bytes + table_bytes], torch.float32)
        values = table[unpack_uint(codes, self.bits, count)]
        # The sparsifier parses its positions behind placeholder values of its own wire dtype.
        placeholder = torch.zeros(count, dtype=self.sparsifier.value_dtype, device=wire.device).view(torch.uint8)
        inner = self.sparsifier.payload_from_wire(
            torch.cat([placeholder, wire[code_bytes + table_bytes :]]), numel, key=key
        )
        assert isinstance(inner, SparsePayload)
        return QuantizedPayload(numel=numel, codes=codes, table=table, inner=dataclasses.replace(inner, values=values))

    def state_dict(self) -> dict[str, Any]:
        return self.sparsifier.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sparsifier.load_state_dict(state)

    def __repr__(self) -> str:
        sigmas = "" if self.range_sigmas == 6.0 else f", range_sigmas={self.range_sigmas:g}"
        return f"QuantizedValues({self.sparsifier!r}, bits={self.bits}{sigmas})"


def _build_sparsifier(spec: Compressor | Mapping[str, Any]) -> Compressor:
    """A compressor as it is, or built from ``{"_target_": "lgc.compressors.X", **knobs}``."""
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, Mapping) or not isinstance(spec.get("_target_"), str):
        raise ValueError(f"sparsifier must be a Compressor or a mapping with a '_target_', got {spec!r}")
    knobs = dict(spec)
    target = knobs.pop("_target_")
    module_name, _, class_name = target.rpartition(".")
    if not module_name.startswith("lgc.compressors"):
        raise ValueError(f"sparsifier's _target_ must be an lgc.compressors class, got {target!r}")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise ValueError(f"sparsifier's _target_ {target!r} is not an lgc compressor")
    return cls(**knobs)
