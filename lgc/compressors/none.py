"""The identity compressor: dense fp32, what plain DDP sends."""

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
    """Sends the tensor unchanged as fp32 (4 bytes per element): the dense baseline.

    Example::

        >>> NoneCompressor().compress(torch.ones(3), key="w").nbytes
        12
    """

    combine = CombineMode.SUM

    def compress(self, tensor: Tensor, key: str) -> DensePayload:
        return DensePayload(numel=tensor.numel(), values=tensor.float())

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DensePayload)
        return payload.values

    def payload_from_wire(self, wire: Tensor, numel: int) -> DensePayload:
        return DensePayload(numel=numel, values=view_bytes_as(wire, torch.float32))
