"""The only code that calls torch.distributed: the compression DDP hook and its state."""

from lgc.ddp.collectives import CommStats
from lgc.ddp.hook import CompressionHookState, compression_hook, register_compression_hook

__all__ = ["CommStats", "CompressionHookState", "compression_hook", "register_compression_hook"]
