"""Scaled sign compression, the compressor of EF-SGD (Karimireddy et al., ICML 2019).

"Error Feedback Fixes SignSGD and other Gradient Compression Schemes" shows that signSGD
(send ``sign(v)``) can fail to converge and generalizes worse than SGD because the sign is a
*biased* compressor, and that error feedback fixes both. Their EF-signSGD (Algorithm 2) compresses

    ``C(p) = (||p||_1 / d) * sign(p)``

per tensor of ``d`` entries and keeps ``e = p - C(p)`` for the next step. This module is ``C``:
one fp32 scale ``||v||_1 / d`` (the mean ``|v|``) and one sign bit per entry (bit 1 = negative),
packed MSB-first with :func:`lgc.coding.bitpack.pack_bits`: ``4 + ceil(d / 8)`` bytes, about
32x smaller than fp32.

``C`` is biased (``E[C(v)] != v``); it is a ``delta``-approximate compressor with
``delta = ||v||_1^2 / (d ||v||_2^2)``, which is what the paper's analysis needs. The error
feedback itself is :class:`~lgc.compressors.ErrorFeedback` (the yaml's ``error_feedback: true``,
the default): without it this is plain scaled signSGD, which the paper shows can stall.

Choices the paper leaves open:

* ``sign(0) = +1``: one bit has no room for a third symbol. A zero entry thus decodes to
  ``+scale``; with error feedback the residual becomes ``-scale`` there and is sent back on the
  next step, so the bias does not accumulate (the residual stays bounded). A random sign would be
  unbiased but needs random numbers and is noisier; exact zeros are rare except in parameters
  that receive no gradient, where the deterministic choice just oscillates around zero.
* Error feedback acts on the gradient before the optimizer's learning rate; the paper folds the
  step size into ``p = gamma g + e``. The two agree for a constant learning rate; after a decay
  the residual carries gradients that are applied at the new rate.

Several workers: each worker compresses its own error-corrected gradient and the decoded payloads
are averaged (the allgather of :attr:`CombineMode.GATHER`, summed by :meth:`aggregate`), as in the
distributed EF-signSGD variants; no randomness, so nothing to seed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lgc.coding.bitpack import pack_bits, packed_nbytes, unpack_bits
from lgc.compressors.base import CombineMode, Compressor, DecodesInto, Payload, view_bytes_as
from lgc.compressors.segments import copy_segments_into, pad_segments, unpad_segments

__all__ = ["SignPayload", "SignSGDCompressor", "decode_signs_many", "l1_means"]


def l1_means(flats: Sequence[Tensor]) -> Tensor:
    """Every flat fp32 tensor's mean magnitude ``||v||_1 / d`` (0 for an empty one), stacked.

    One multi-tensor kernel on a GPU (``torch._foreach_norm``, each tensor reduced on its own, so a
    tensor's mean is the same bits alone or in a bucket); tensor by tensor on the CPU. The per-tensor
    and the bucket paths both take their scales from here.
    """
    norms = torch.stack(torch._foreach_norm(list(flats), 1)).float()
    numels = torch.tensor([max(1, f.numel()) for f in flats], dtype=torch.float32).to(norms.device)
    return norms / numels


def decode_signs_many(payloads: Sequence[Sequence[SignPayload]], outs: Sequence[Tensor]) -> None:
    """The workers' decoded sum of every tensor of a bucket at once: ``payloads[i]`` (every rank's) into ``outs[i]``.

    Per rank, every tensor's sign bytes are unpacked together (one table lookup) and their padding
    dropped (one ``cat``); each entry becomes ``+-scale`` exactly, as the per-tensor decoding's table
    gives it, and the ranks are added in order in one fp32 flat, whose slices are copied into
    ``outs`` (one multi-tensor copy). The same fp32 operations, in the same order, as
    :meth:`SignSGDCompressor.aggregate_into` tensor by tensor: the same bits.
    """
    if not outs:
        return
    numels = [out.numel() for out in outs]
    device = outs[0].device
    table = _negative_bits(device)
    padded = [8 * packed_nbytes(n) for n in numels]
    total: Tensor | None = None
    for rank in range(len(payloads[0])):
        mine = [received[rank] for received in payloads]
        negative = unpad_segments(table[torch.cat([p.signs for p in mine]).long()].reshape(-1), padded, numels)
        scales = torch.cat([p.scale.float().reshape(1) for p in mine]).repeat_interleave(
            torch.tensor(numels, device=device), output_size=sum(numels)
        )
        decoded = torch.where(negative, -scales, scales)
        total = decoded if total is None else total.add_(decoded)
    assert total is not None
    copy_segments_into(total, outs)


@functools.cache
def _negative_bits(device: torch.device) -> Tensor:
    """``(256, 8)`` bool: the 8 sign bits (MSB first) of every byte value, read by the wire format's own reader."""
    return unpack_bits(torch.arange(256, dtype=torch.uint8), 8 * 256).view(256, 8).to(device)


@dataclass
class SignPayload(Payload):
    """``scale * (+1 or -1)`` per entry. Wire order: ``scale`` then ``signs``."""

    #: fp32, one element: ``||v||_1 / numel``.
    scale: Tensor
    #: uint8, ``ceil(numel / 8)`` bytes; bit ``i`` (MSB-first) is 1 where entry ``i`` is negative.
    signs: Tensor


class SignSGDCompressor(DecodesInto, Compressor):
    """EF-SGD's scaled sign: ``(||v||_1 / d) * sign(v)`` per tensor, 1 bit per entry.

    Use it with error feedback (the yaml default, ``error_feedback: true``): the scaled sign is
    biased and error feedback is what makes it converge like SGD (Karimireddy et al., 2019).
    No knobs: the scale is the paper's. Per-tensor scaling matters: with the DDP hook every
    parameter (``key``) gets its own scale, so layers of different gradient magnitude keep their
    relative step sizes. Lower ``comm.min_numel`` with care: tiny tensors (biases) gain little
    and lose a lot to the sign.

    Example::

        >>> sign = SignSGDCompressor()
        >>> payload = sign.compress(torch.tensor([1.0, -3.0, 0.0, 2.0]), key="w")
        >>> sign.decompress(payload).tolist(), payload.nbytes
        ([1.5, -1.5, 1.5, 1.5], 5)
    """

    needs_error_feedback = True
    pure_encoding = True
    combine = CombineMode.GATHER
    codes_every_entry = True
    variable_size = False

    def payload_nbytes(self, numel: int) -> int:
        """Exact wire size for ``numel`` entries: ``4 + ceil(numel / 8)``."""
        return 4 + packed_nbytes(numel)

    def compress(self, tensor: Tensor, key: str) -> SignPayload:
        flat = tensor.reshape(-1).float()
        return SignPayload(numel=flat.numel(), scale=l1_means([flat]), signs=pack_bits(flat < 0))

    def compress_segments(self, flat: Tensor, numels: Sequence[int]) -> tuple[list[SignPayload], Tensor]:
        """Every segment of ``flat`` (fp32, segments of ``numels`` end to end) at once, and what they decode to.

        A fixed number of passes whatever the number of segments: the scales in one multi-tensor
        norm (:func:`l1_means`), the signs of the whole flat packed once with every segment padded
        to whole bytes (one ``cat``), and the decoded flat (``+-scale`` per entry) for error feedback
        to subtract. Each payload is :meth:`compress`'s of its segment, bit for bit.
        """
        segments = flat.split(list(numels))
        scales = l1_means(segments)
        negative = flat < 0
        bits = pad_segments(negative.split(list(numels)), [8 * packed_nbytes(n) for n in numels])
        signs = pack_bits(bits).split([packed_nbytes(n) for n in numels])
        payloads = [
            SignPayload(numel=n, scale=scale.reshape(1), signs=bytes_)
            for n, scale, bytes_ in zip(numels, scales, signs, strict=True)
        ]
        spread = scales.repeat_interleave(torch.tensor(list(numels), device=flat.device), output_size=flat.numel())
        return payloads, torch.where(negative, -spread, spread)

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[SignPayload]:
        """:meth:`compress_segments` and what the payloads decode to subtracted from ``flat`` at once
        (:class:`~lgc.compressors.segments.FeedsBackSegments`)."""
        payloads, sent = self.compress_segments(flat, numels)
        flat.sub_(sent)
        return payloads

    def batches_on(self, device: torch.device) -> bool:
        """On a GPU, where a few kernels per tensor cost more than the arithmetic (the CPU's loop is cheaper)."""
        return device.type != "cpu"

    def compress_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """A bucket at once on a GPU (:meth:`compress_segments` of the tensors laid end to end); else the loop."""
        if len(tensors) < 2 or not self.batches_on(tensors[0].device):
            return super().compress_many(tensors, keys)
        flat = torch.cat([t.reshape(-1) for t in tensors]).float()
        return list(self.compress_segments(flat, [t.numel() for t in tensors])[0])

    def aggregate_many(self, payloads: Sequence[list[Payload]], outs: Sequence[Tensor]) -> None:
        """A bucket at once on a GPU (:func:`decode_signs_many`); tensor by tensor on the CPU."""
        if len(outs) < 2 or not self.batches_on(outs[0].device):
            super().aggregate_many(payloads, outs)
            return
        decode_signs_many(payloads, outs)  # type: ignore[arg-type]

    @staticmethod
    def _decode(payload: SignPayload, out: Tensor) -> Tensor:
        numel = payload.numel
        scale = payload.scale.float().reshape(())
        # Exactly +-scale for the 8 bits of every byte value: one table lookup per byte decodes it,
        # several times faster than unpacking the bits and selecting.
        table = torch.where(_negative_bits(out.device), -scale, scale)
        signs = payload.signs.contiguous()
        full = numel // 8
        if full:
            torch.index_select(table, 0, signs[:full].int(), out=out[: full * 8].view(full, 8))
        if numel > full * 8:
            out[full * 8 :].copy_(table[signs[full].long()][: numel - full * 8])
        return out

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> SignPayload:
        expected = self.payload_nbytes(numel)
        if wire.numel() != expected:
            raise ValueError(f"{self!r} payload for {numel} elements has {expected} bytes, got {wire.numel()}")
        return SignPayload(numel=numel, scale=view_bytes_as(wire[:4], torch.float32), signs=wire[4:])

    def __repr__(self) -> str:
        return "SignSGDCompressor()"
