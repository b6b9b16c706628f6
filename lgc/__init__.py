"""lgc: communication-efficient data-parallel training (Learned Gradient Compression and baselines).

The way in for a plain DDP script is :func:`compress`::

    state = lgc.compress(model, "topk", optimizer=opt, density=0.01)

``sorted(lgc.METHODS)`` lists the methods by name; the classes below are what they build.
"""

from lgc.api import METHODS, HookState, compress
from lgc.compressors import (
    ChunkedTopKCompressor,
    Compressor,
    DeMoCompressor,
    DGCCompressor,
    ErrorFeedback,
    FP4Compressor,
    FP16Compressor,
    NoneCompressor,
    QSGDCompressor,
    QuantizedValues,
    RandomBlockCompressor,
    RedSyncCompressor,
    SBCCompressor,
    SignSGDCompressor,
    TernGradCompressor,
    TopKCompressor,
)
from lgc.ddp import CompressionHookState, register_compression_hook
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.powersgd import PowerSGDHookState
from lgc.ddp.torch_hooks import TorchHookState
from lgc.learned import LGCParameterServerState, LGCRingAllreduceState, SharedIndexState

__version__ = "0.1.0"

__all__ = [
    # the entry point and its registry of methods
    "METHODS",
    "HookState",
    "compress",
    # compressors (a flat tensor -> a payload on the wire -> a flat tensor)
    "ChunkedTopKCompressor",
    "Compressor",
    "DGCCompressor",
    "DeMoCompressor",
    "ErrorFeedback",
    "FP16Compressor",
    "FP4Compressor",
    "NoneCompressor",
    "QSGDCompressor",
    "QuantizedValues",
    "RandomBlockCompressor",
    "RedSyncCompressor",
    "SBCCompressor",
    "SignSGDCompressor",
    "TernGradCompressor",
    "TopKCompressor",
    # hook states (what compress returns, or takes ready-made)
    "CommunicationDelayState",
    "CompressionHookState",
    "LGCParameterServerState",
    "LGCRingAllreduceState",
    "PowerSGDHookState",
    "SharedIndexState",
    "TorchHookState",
    # the lower-level registration compress() builds on
    "register_compression_hook",
]
