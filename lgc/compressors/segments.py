"""Tensors of a bucket laid end to end, each padded to a whole number of blocks, and back.

The bucket-level codecs (EF-signSGD's scaled sign, fp4) encode every tensor of a DDP bucket in a
fixed number of passes by laying the tensors end to end with each one zero-padded to whole bytes
or whole scaling buckets (:func:`pad_segments`), dropping the padding again when they decode
(:func:`unpad_segments`), and copying the decoded sums into the tensors' slices of the bucket at
once (:func:`copy_segments_into`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["DecodesSegments", "copy_segments_into", "pad_segments", "unpad_segments"]


class DecodesSegments:
    """Mixin for a compressor that sums a bucket's gathered payloads at once (``decode_segments``) where its
    ``batches_on`` says so, and tensor by tensor (the base's ``aggregate_many``) elsewhere. fp4, QSGD and
    TernGrad put it before :class:`~lgc.compressors.base.Compressor` in their bases."""

    def decode_segments(self, payloads: Sequence[Sequence[Any]], outs: Sequence[Tensor]) -> None:
        """Every rank's payloads of a bucket's tensors (``payloads[i]``: tensor ``i``'s) summed into ``outs``."""
        raise NotImplementedError

    def aggregate_many(self, payloads: Sequence[list[Any]], outs: Sequence[Tensor]) -> None:
        if len(outs) < 2 or not self.batches_on(outs[0].device):  # type: ignore[attr-defined]
            super().aggregate_many(payloads, outs)  # type: ignore[misc]
            return
        self.decode_segments(payloads, outs)


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
