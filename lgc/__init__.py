"""lgc: communication-efficient data-parallel training (Learned Gradient Compression and baselines)."""

from lgc.compressors import ErrorFeedback, FP16Compressor, NoneCompressor, TopKCompressor
from lgc.ddp import CompressionHookState, register_compression_hook

__version__ = "0.1.0"

__all__ = [
    "CompressionHookState",
    "ErrorFeedback",
    "FP16Compressor",
    "NoneCompressor",
    "TopKCompressor",
    "register_compression_hook",
]
