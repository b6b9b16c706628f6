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

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> DensePayload:
        """The wire carries the gradient as it is: 4 bytes per entry read as float32, 8 as float64.

        Two bytes per entry could be float16 or bfloat16, which the bytes do not tell: such a wire
        is refused (the hook sums dense payloads and rebuilds them with :meth:`payload_from_sum`,
        which knows the gradient's dtype).
        """
        if numel == 0:
            return DensePayload(numel=0, values=view_bytes_as(wire, torch.float32))
        if wire.numel() % numel:
            raise ValueError(f"a dense wire of {wire.numel()} bytes does not hold {numel} entries")
        dtype = {4: torch.float32, 8: torch.float64}.get(wire.numel() // numel)
        if dtype is None:
            raise ValueError(
                f"a dense wire of {wire.numel() // numel} bytes per entry does not say its dtype "
                "(float16 or bfloat16?): rebuild it with payload_from_sum"
            )
        return DensePayload(numel=numel, values=view_bytes_as(wire, dtype))
