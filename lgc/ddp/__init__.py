"""The compression DDP hook and its state: with :mod:`lgc.learned`, the only code that calls torch.distributed."""

from lgc.ddp.collectives import CommStats
from lgc.ddp.hook import CompressionHookState, compression_hook, register_compression_hook
from lgc.ddp.protocol import HookState

__all__ = ["CommStats", "CompressionHookState", "HookState", "compression_hook", "register_compression_hook"]
