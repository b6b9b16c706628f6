"""4-bit floating point (E3M0) with a scale per bucket: Streaming DiLoCo's quantized outer gradients.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch" (arXiv 2501.18512, 2025), Sec. 2.3: the workers exchange their outer gradients in 4-bit
floating point, E3M0 (a sign bit, three exponent bits, no mantissa), and accumulate them in fp32;
the paper measured no loss against exchanging them in fp32. Under ``comm=streaming_diloco`` the compressor
sees exactly those outer gradients (each worker's ``W_sync - W_local``, divided by the world size;
``experiment=streaming_diloco``).

Code of one element (4 bits, packed two per byte, most significant first): bit 3 the sign, bits
0-2 the exponent field ``e``. ``e = 0`` is zero (the subnormal of a format without mantissa bits);
``e = 1 .. 7`` is ``2**(e - 7)`` times the bucket's scale, i.e. ``scale * {1/64, ..., 1/2, 1}``.
The scale is the bucket's largest magnitude, sent in fp32, so the largest entry of every bucket
is exact.

Rounding: to the nearest of the 15 values in linear distance, ties away from zero, deterministic
(what a cast to a float format does). An entry ``|v| = r * scale`` becomes ``2**k * scale``
with ``2**k`` the nearer of the two powers of two around ``r`` (the upper one from ``1.5 * 2**(k -
1)`` on), and zero below ``2**-7`` (half the smallest power). The relative error of an entry is
at most a third; on Gaussian buckets of 256 the error's norm is 0.19 of the input's (cosine
0.98), 1.9 % of the entries go to zero.

Combining (:attr:`CombineMode.GATHER`): the payloads are allgathered and every rank decodes each
worker's payload and sums them in fp32: one quantization per outer gradient, and the sum the
paper accumulates in fp32. The ring allgather sends ``(P - 1)`` payloads per worker, so against
a dense fp32 ring allreduce (``2 (P - 1) / P`` of the model) the saving is ``7.76 / (P / 2)``:
7.8x with 2 workers, 3.9x with 4.

What departs from the paper, and why: the paper does not give the scale's granularity or how the
quantized gradients travel. The scale per bucket of ``bucket_size`` entries is lgc's choice
(without one the format's range of ``2**6`` would zero most of a tensor with heavy tails: 94 % of
a Student-t(3) tensor of 2**20 entries). torchft's quantized allreduce (fp8, not 4-bit: its
``should_quantize``) instead reduce-scatters quantized rows, sums them in fp32, quantizes the sums
again and allgathers them, which costs ``2 (P - 1) / P`` payloads per worker at any ``P`` but
quantizes twice; it is not implemented here.

Non-finite inputs: a bucket holding an inf or NaN gets a non-finite scale and decodes to NaN
entirely, so an overflow stays visible after aggregation (the communication delay's exchange guard
skips such an exchange before it reaches the compressor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lgc.coding.bitpack import byte_table, decode_bytes, pack_uint, packed_nbytes
from lgc.compressors.base import CombineMode, Compressor, Payload, view_bytes_as
from lgc.compressors.qsgd import Buckets
from lgc.compressors.segments import DecodesSegments, copy_segments_into, pad_segments, unpad_segments
from lgc.validation import PositiveInt, check

__all__ = ["E3M0_EXPONENT_BIAS", "FP4Compressor", "FP4Payload", "e3m0_values"]

#: ``e = 7`` decodes to the scale itself: magnitudes ``2**(e - 7)`` for the exponent fields 1 .. 7.
E3M0_EXPONENT_BIAS = 7
_CODE_BITS = 4
#: fp32's fraction bits, its exponent bias, and the fraction's top bit (1.5 = 1.1 in binary).
_FRACTION_BITS, _FLOAT_BIAS = 23, 127
_HALF_FRACTION = 1 << (_FRACTION_BITS - 1)
#: The bits of 2**-7 (half the smallest nonzero magnitude, 2**-6): a ratio below it codes zero.
_BELOW_SMALLEST = (_FLOAT_BIAS - E3M0_EXPONENT_BIAS) << _FRACTION_BITS


def e3m0_values() -> Tensor:
    """The 16 codes' values for a scale of 1 (fp32): codes 0-7 positive (0 is zero), 8-15 their negatives."""
    exponent = torch.arange(8)
    magnitude = torch.where(exponent > 0, torch.exp2((exponent - E3M0_EXPONENT_BIAS).float()), 0.0)
    return torch.cat([magnitude, -magnitude])


def _e3m0_codes(ratio: Tensor, flat: Tensor) -> Tensor:
    """The 4-bit codes (uint8) of ``|flat| / scale`` (``ratio``, fp32, overwritten) and of ``flat``'s signs."""
    # 0/0 in an all-zero bucket, and anything in a bucket with an inf or NaN (its scale carries it).
    ratio.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    # The nearer power of two, from the float's bits: a ratio 1.f * 2**p (ratio >= 0, so the bits
    # are its exponent and fraction) is nearer 2**(p + 1) from 1.f = 1.5 on (ties away from
    # zero), i.e. where the fraction's top bit is set; adding that bit carries into the exponent.
    bits = ratio.view(torch.int32)
    field = bits.add(_HALF_FRACTION).bitwise_right_shift_(_FRACTION_BITS).sub_(_FLOAT_BIAS - E3M0_EXPONENT_BIAS)
    field.clamp_(1, E3M0_EXPONENT_BIAS).masked_fill_(bits < _BELOW_SMALLEST, 0)  # below half of 2**-6: zero
    return field.add_(flat < 0, alpha=8).to(torch.uint8)  # the sign bit


@dataclass
class FP4Payload(Payload):
    """One fp32 scale per bucket, then one 4-bit E3M0 code per element (two per byte). Wire order as listed."""

    #: fp32, one per bucket: its largest magnitude.
    scales: Tensor
    #: uint8, the codes packed MSB-first by :func:`lgc.coding.bitpack.pack_uint`.
    codes: Tensor


class FP4Compressor(DecodesSegments, Compressor):
    """4-bit E3M0 floats with an fp32 scale per bucket, decoded and summed in fp32 (see the module docstring).

    Args:
        bucket_size: entries per bucket with their own scale (default 256: 4.125 bits per element);
            None: one scale per tensor. Smaller buckets follow the magnitudes more closely (relative
            error 0.18 at 32 against 0.19 at 256 on Gaussian data, much more on heavy tails) and cost
            ``32 / bucket_size`` bits per element.

    Example::

        >>> fp4 = FP4Compressor(bucket_size=256)
        >>> payload = fp4.compress(torch.randn(1000), key="w")
        >>> payload.nbytes  # four fp32 scales + 1000 four-bit codes
        516
    """

    combine = CombineMode.GATHER
    stateless = True
    codes_every_entry = True
    variable_size = False
    # Streaming DiLoCo quantizes every outer gradient, biases and norm layers included.
    default_min_numel = 1

    def __init__(self, bucket_size: PositiveInt | None = 256) -> None:
        check("bucket_size", bucket_size, PositiveInt | None)
        self.bucket_size = bucket_size
        # Per device: the two values of every byte (two codes), for decoding a byte at a time.
        self._tables: dict[str, Tensor] = {}

    def payload_nbytes(self, numel: int) -> int:
        """Exact wire size for a tensor of ``numel`` entries: the scales, then ``ceil(numel / 2)`` bytes."""
        return 4 * Buckets(numel, self.bucket_size).count + packed_nbytes(numel * _CODE_BITS)

    def compress(self, tensor: Tensor, key: str) -> FP4Payload:
        flat = tensor.reshape(-1).contiguous().float()
        numel = flat.numel()
        buckets = Buckets(numel, self.bucket_size)
        scales = buckets.reduce(flat, lambda rows: rows.abs().amax(dim=1)) if numel else flat.new_zeros(0)
        ratio = torch.empty_like(flat)
        for out, values, scale in zip(buckets.views(ratio), buckets.views(flat), buckets.columns(scales), strict=True):
            torch.div(values.abs(), scale, out=out)
        codes = _e3m0_codes(ratio, flat)
        return FP4Payload(numel=numel, scales=scales.float(), codes=pack_uint(codes, _CODE_BITS))

    def segments_supported(self) -> bool:
        """Buckets of an even size: a tensor's codes, padded to whole buckets, then end on a byte."""
        return self.bucket_size is not None and self.bucket_size % 2 == 0

    def compress_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        if len(tensors) < 2 or not self.batches_on(tensors[0].device):
            return super().compress_many(tensors, keys)
        return list(self.compress_segments(tensors))

    def compress_segments(self, tensors: Sequence[Tensor]) -> list[FP4Payload]:
        """Every tensor of a bucket at once, in a fixed number of passes: :meth:`compress`'s payloads, bit for bit.

        The tensors are laid end to end, each zero-padded to whole buckets (one ``cat``), so every
        bucket is a row of one matrix: one ``amax`` gives every scale (zeros change no maximum), one
        division and the code arithmetic every code (a padded entry codes 0, as the zero nibble that
        ends an odd-length tensor's last byte), one packing every byte; each tensor's payload is its
        rows' scales and the first ``ceil(numel / 2)`` bytes of its section. Needs an even
        ``bucket_size`` (a section ends on a byte).
        """
        size = self.bucket_size
        if size is None or size % 2:
            raise ValueError(f"compress_segments needs an even bucket_size, got {size!r}")
        numels = [t.numel() for t in tensors]
        rows = [-(-n // size) for n in numels]
        flat = pad_segments([t.reshape(-1) for t in tensors], [r * size for r in rows]).float()
        matrix = flat.view(-1, size)
        scales = matrix.abs().amax(dim=1) if matrix.numel() else flat.new_zeros(0)
        ratio = torch.div(matrix.abs(), scales[:, None]).reshape(-1)
        packed = pack_uint(_e3m0_codes(ratio, flat), _CODE_BITS)
        sections = packed.split([r * size // 2 for r in rows])
        return [
            FP4Payload(numel=n, scales=scale, codes=section[: packed_nbytes(n * _CODE_BITS)])
            for n, scale, section in zip(numels, scales.split(rows), sections, strict=True)
        ]

    def decode_segments(self, payloads: Sequence[Sequence[FP4Payload]], outs: Sequence[Tensor]) -> None:
        """Every rank's payloads of every tensor of a bucket (``payloads[i]``: tensor ``i``'s) summed into ``outs``.

        Per rank, its codes of every tensor padded to whole buckets (one ``cat``), looked up a byte at
        a time, multiplied by their rows' scales as one matrix and the padding dropped (one ``cat``);
        the ranks added in order in fp32, the slices copied into ``outs`` at once. The same fp32
        products and sums, in the same order, as :meth:`aggregate` tensor by tensor: the same bits.
        """
        size = self.bucket_size
        if size is None or size % 2 or not outs:
            raise ValueError(f"decode_segments needs an even bucket_size and tensors, got {size!r}")
        numels = [out.numel() for out in outs]
        rows = [-(-n // size) for n in numels]
        table = self._byte_table(outs[0].device)
        total: Tensor | None = None
        for rank in range(len(payloads[0])):
            mine = [received[rank] for received in payloads]
            codes = pad_segments([p.codes for p in mine], [r * size // 2 for r in rows])
            values = table[codes.long()].view(-1, size) * torch.cat([p.scales.float() for p in mine])[:, None]
            decoded = unpad_segments(values.reshape(-1), [r * size for r in rows], numels)
            total = decoded if total is None else total.add_(decoded)
        assert total is not None
        copy_segments_into(total, outs)

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, FP4Payload)
        out = torch.empty(payload.numel, dtype=torch.float32, device=payload.codes.device)
        decode_bytes(payload.codes, self._byte_table(out.device), payload.numel, out)
        return Buckets(payload.numel, self.bucket_size).scale_(out, payload.scales.float())

    def _byte_table(self, device: torch.device) -> Tensor:
        """``(256, 2)`` fp32: the values (scale 1) of the two codes packed in each byte value."""
        name = str(device)
        if name not in self._tables:
            self._tables[name] = byte_table(e3m0_values(), _CODE_BITS).to(device)
        return self._tables[name]

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> FP4Payload:
        scale_bytes = 4 * Buckets(numel, self.bucket_size).count
        expected = self.payload_nbytes(numel)
        if wire.numel() != expected:
            raise ValueError(f"{self!r} payload for {numel} elements has {expected} bytes, got {wire.numel()}")
        return FP4Payload(
            numel=numel, scales=view_bytes_as(wire[:scale_bytes], torch.float32), codes=wire[scale_bytes:]
        )

    # The decoding tables are a cache: rebuilt where the compressor is unpickled.
    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_tables": {}}

    def __repr__(self) -> str:
        return f"FP4Compressor(bucket_size={self.bucket_size})"
