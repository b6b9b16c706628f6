"""Half-precision casting: 2 bytes per element, summed in fp16 like PyTorch's ``fp16_compress_hook``."""

from __future__ import annotations

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

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DensePayload)
        return payload.values.float()

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> DensePayload:
        return DensePayload(numel=numel, values=view_bytes_as(wire, self.dtype))

    def __repr__(self) -> str:
        return f"FP16Compressor(dtype={self.dtype})"
