"""Tensors of a bucket laid end to end, each padded to a whole number of blocks, and back.

The bucket-level codecs (EF-signSGD's scaled sign, fp4) encode every tensor of a DDP bucket in a
fixed number of passes by laying the tensors end to end with each one zero-padded to whole bytes
or whole scaling buckets (:func:`pad_segments`), dropping the padding again when they decode
(:func:`unpad_segments`), and copying the decoded sums into the tensors' slices of the bucket at
once (:func:`copy_segments_into`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "CodesBuckets",
    "DecodesSegments",
    "FeedsBackSegments",
    "copy_segments_into",
    "feeds_back_segments",
    "one_bucket",
    "pad_segments",
    "unpad_segments",
]


@runtime_checkable
class FeedsBackSegments(Protocol):
    """A compressor whose error feedback can encode a whole bucket at once
    (:meth:`~lgc.compressors.ErrorFeedback.compress_many` with ``bucketed``): top-k, SBC, EF-signSGD's scaled
    sign, chunked top-k, SparseLoCo's quantized values (:func:`feeds_back_segments` asks)."""

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[Any]:
        """Every segment's payload (``numels[i]`` entries of ``flat`` for ``keys[i]``), and what they send
        subtracted from ``flat`` in place, which is left holding the new residuals.

        ``flat`` is fp32, the segments end to end. Each payload and residual is :meth:`compress`'s of
        its segment followed by error feedback's subtraction, bit for bit (a sparse payload's pairs
        may come in another order; entries tied at a top-k's cut may be chosen differently).
        """
        ...


def feeds_back_segments(compressor: object) -> bool:
    """Whether ``compressor``'s bucket path (:class:`FeedsBackSegments`) encodes what its ``compress`` does.

    A subclass that overrides ``compress`` but inherits ``feed_back_segments`` would encode a bucket
    by its parent's rule: it is taken tensor by tensor. The method must come from the class that
    defines ``compress`` or from a subclass of it.
    """
    if not isinstance(compressor, FeedsBackSegments):
        return False
    mro = type(compressor).__mro__
    owner_of = {name: next(k for k in mro if name in vars(k)) for name in ("compress", "feed_back_segments")}
    return issubclass(owner_of["feed_back_segments"], owner_of["compress"])


class CodesBuckets:
    """Mixin for a compressor whose ``compress_many`` encodes a bucket at once where :meth:`batches_on` says
    so, tensor by tensor (the base's loop) elsewhere: DGC, and through :class:`DecodesSegments` fp4,
    QSGD and TernGrad.

    ``bucketed`` chooses where: None (default) on a GPU, where a few kernels per tensor cost more
    than the arithmetic, and tensor by tensor on the CPU, whose loop is the faster one
    (``lgc-bench compressors`` measures both); True everywhere (the test matrix runs it on the CPU
    through the hook), False nowhere. Both paths give the same payloads and state, bit for bit.
    """

    #: Where a bucket is coded at once: None (a GPU), True (everywhere) or False (nowhere).
    bucketed: bool | None = None

    def segments_supported(self) -> bool:
        """Whether this configuration has a bucket-level path at all (every one, unless a compressor says)."""
        return True

    def batches_on(self, device: Any) -> bool:
        """Whether :meth:`compress_many` (and :meth:`aggregate_many`, where the codec decodes a bucket at once)
        takes a bucket at once on ``device``."""
        if not self.segments_supported():
            return False
        return self.bucketed if self.bucketed is not None else device.type != "cpu"


class DecodesSegments(CodesBuckets):
    """:class:`CodesBuckets` for a codec that also sums a bucket's gathered payloads at once
    (``decode_segments``, from :meth:`aggregate_many`) where :meth:`batches_on` says so. fp4, QSGD and
    TernGrad put it before :class:`~lgc.compressors.base.Compressor` in their bases.
    """

    def decode_segments(self, payloads: Sequence[Sequence[Any]], outs: Sequence[Tensor]) -> None:
        """Every rank's payloads of a bucket's tensors (``payloads[i]``: tensor ``i``'s) summed into ``outs``."""
        raise NotImplementedError

    def aggregate_many(self, payloads: Sequence[list[Any]], outs: Sequence[Tensor]) -> None:
        if len(outs) < 2 or not self.batches_on(outs[0].device):  # type: ignore[attr-defined]
            super().aggregate_many(payloads, outs)  # type: ignore[misc]
            return
        self.decode_segments(payloads, outs)


def one_bucket(tensors: Sequence[Tensor], keys: Sequence[str], batches_on: Callable[[Any], bool]) -> bool:
    """Whether ``tensors`` (named ``keys``) go as one flat: two or more, none empty, all on one device on
    which ``batches_on`` says so, and no key twice (the per-tensor loop applies a repeated key in turn)."""
    if len(tensors) < 2 or len(set(keys)) != len(keys) or not batches_on(tensors[0].device):
        return False
    device = tensors[0].device
    return all(t.device == device and t.numel() > 0 for t in tensors)


def pad_segments(pieces: Sequence[Tensor], lengths: Sequence[int]) -> Tensor:
    """``pieces`` end to end, each zero-padded to its entry of ``lengths`` (at least its size), in one ``cat``."""
    parts: list[Tensor] = []
    for piece, length in zip(pieces, lengths, strict=True):
        parts.append(piece)
        if length > piece.numel():
            parts.append(piece.new_zeros(length - piece.numel()))
    return torch.cat(parts)


def unpad_segments(padded: Tensor, lengths: Sequence[int], numels: Sequence[int]) -> Tensor:
    """:func:`pad_segments` undone: the first ``numels[i]`` entries of every padded segment, in one ``cat``."""
    return torch.cat([piece[:n] for piece, n in zip(padded.split(list(lengths)), numels, strict=True)])


def copy_segments_into(flat: Tensor, outs: Sequence[Tensor]) -> None:
    """``flat``'s consecutive slices into ``outs`` (cast to their dtype), one multi-tensor copy."""
    pieces = flat.split([out.numel() for out in outs])
    torch._foreach_copy_(list(outs), [piece.view_as(out) for piece, out in zip(pieces, outs, strict=True)])
