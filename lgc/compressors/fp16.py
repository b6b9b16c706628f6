"""Half-precision casting: 2 bytes per element, summed in fp16 like PyTorch's ``fp16_compress_hook``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, Payload, view_bytes_as
from lgc.compressors.none import DensePayload

__all__ = ["FP16Compressor"]


class FP16Compressor(Compressor):
    """Casts to ``float16`` (or ``bfloat16``) before the allreduce and back to fp32 after.

    The DDP hook divides gradients by the world size before compressing, so the fp16 sum stays in
    range as in PyTorch's own hook.

    Args:
        dtype: ``torch.float16`` (default) or ``torch.bfloat16``; bf16 keeps fp32's range at a
            coarser mantissa.
    """

    combine = CombineMode.SUM
    stateless = True
    codes_every_entry = True

    def __init__(self, dtype: torch.dtype | str = "float16") -> None:
        if isinstance(dtype, str):
            dtype = {
                "float16": torch.float16,
                "fp16": torch.float16,
                "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16,
            }.get(dtype, dtype)  # type: ignore[arg-type]
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FP16Compressor dtype must be float16 or bfloat16, got {dtype!r}")
        self.dtype = dtype

    def compress(self, tensor: Tensor, key: str) -> DensePayload:
        return DensePayload(numel=tensor.numel(), values=tensor.to(self.dtype))

    def compress_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """Every tensor cast into one flat half-precision buffer, each payload a view of its slice.

        The exchange then allreduces the views, which lie back to back, in place (no ``cat``), as
        PyTorch's hook casts its bucket once.
        """
        if len(tensors) < 2 or len({(t.device, t.dtype) for t in tensors}) > 1 or tensors[0].dtype == self.dtype:
            # One tensor, mixed ones, or no cast at all (a half-precision model's payloads are the bucket's
            # own slices, allreduced in place): tensor by tensor.
            return super().compress_many(tensors, keys)
        numels = [t.numel() for t in tensors]
        pieces = torch.empty(sum(numels), dtype=self.dtype, device=tensors[0].device).split(numels)
        for piece, tensor in zip(pieces, tensors, strict=True):
            piece.copy_(tensor.reshape(-1))
        return [DensePayload(numel=t.numel(), values=p.view(t.shape)) for p, t in zip(pieces, tensors, strict=True)]

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DensePayload)
        return payload.values.float()

    def decompress_into(self, payload: Payload, out: Tensor) -> None:
        """One casting copy into ``out``: the half-precision sum widened exactly, no fp32 temporary."""
        assert isinstance(payload, DensePayload)
        out.copy_(payload.values.reshape(-1))

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> DensePayload:
        return DensePayload(numel=numel, values=view_bytes_as(wire, self.dtype))

    def __repr__(self) -> str:
        return f"FP16Compressor(dtype={self.dtype})"
