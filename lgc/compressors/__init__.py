"""Compressors: flat tensor -> typed payload (exact wire size) -> flat tensor. Pure PyTorch.

One algorithm per module; each yaml in ``conf/compressor/`` instantiates one of these.
"""

from lgc.compressors.base import CombineMode, Compressor, HoldsSteps, Payload, view_bytes_as
from lgc.compressors.chunked_topk import ChunkedTopKCompressor
from lgc.compressors.demo import DeMoCompressor
from lgc.compressors.dgc import DGCCompressor
from lgc.compressors.error_feedback import ErrorFeedback
from lgc.compressors.fp4 import FP4Compressor
from lgc.compressors.fp16 import FP16Compressor
from lgc.compressors.none import DensePayload, NoneCompressor
from lgc.compressors.qsgd import QSGDCompressor
from lgc.compressors.quantized_values import QuantizedValues
from lgc.compressors.random_block import RandomBlockCompressor
from lgc.compressors.redsync import RedSyncCompressor
from lgc.compressors.sbc import SBCCompressor
from lgc.compressors.signsgd import SignSGDCompressor
from lgc.compressors.terngrad import TernGradCompressor
from lgc.compressors.topk import SparsePayload, TopKCompressor

__all__ = [
    "ChunkedTopKCompressor",
    "CombineMode",
    "Compressor",
    "DGCCompressor",
    "DeMoCompressor",
    "DensePayload",
    "ErrorFeedback",
    "FP16Compressor",
    "FP4Compressor",
    "HoldsSteps",
    "NoneCompressor",
    "Payload",
    "QSGDCompressor",
    "QuantizedValues",
    "RandomBlockCompressor",
    "RedSyncCompressor",
    "SBCCompressor",
    "SignSGDCompressor",
    "SparsePayload",
    "TernGradCompressor",
    "TopKCompressor",
    "view_bytes_as",
]
