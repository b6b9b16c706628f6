"""The identity compressor: every gradient in its own dtype, what plain DDP sends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, Payload, view_bytes_as

__all__ = ["DensePayload", "NoneCompressor"]


@dataclass
class DensePayload(Payload):
    """Every element, in the dtype of ``values``."""

    values: Tensor


class NoneCompressor(Compressor):
    """Sends the tensor unchanged, in its own dtype: the dense baseline, byte for byte plain DDP.

    fp32 gradients cost 4 bytes per element, fp16/bf16 gradients (a model in half precision) 2.

    Example::

        >>> NoneCompressor().compress(torch.ones(3), key="w").nbytes
        12
    """

    combine = CombineMode.SUM
    stateless = True

    def compress(self, tensor: Tensor, key: str) -> DensePayload:
        return DensePayload(numel=tensor.numel(), values=tensor)

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DensePayload)
        return payload.values

    def payload_from_sum(self, summed: Tensor, own: Payload) -> DensePayload:
        return DensePayload(numel=own.numel, values=summed)

    def payload_from_wire(
        self, wire: Tensor, numel: int, dtype: torch.dtype = torch.float32, *, key: str | None = None
    ) -> DensePayload:
        """The wire carries the gradient's dtype, which every worker knows from its model (``dtype``)."""
        return DensePayload(numel=numel, values=view_bytes_as(wire, dtype))
