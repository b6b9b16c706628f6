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
from dataclasses import dataclass

import torch
from torch import Tensor

from lgc.coding.bitpack import pack_bits, packed_nbytes, unpack_bits
from lgc.compressors.base import CombineMode, Compressor, DecodesInto, Payload, view_bytes_as

__all__ = ["SignPayload", "SignSGDCompressor"]


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
    variable_size = False

    def payload_nbytes(self, numel: int) -> int:
        """Exact wire size for ``numel`` entries: ``4 + ceil(numel / 8)``."""
        return 4 + packed_nbytes(numel)

    def compress(self, tensor: Tensor, key: str) -> SignPayload:
        flat = tensor.reshape(-1).float()
        numel = flat.numel()
        if numel:
            scale = (torch.linalg.vector_norm(flat, ord=1) / numel).reshape(1)
        else:
            scale = flat.new_zeros(1)
        return SignPayload(numel=numel, scale=scale, signs=pack_bits(flat < 0))

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
