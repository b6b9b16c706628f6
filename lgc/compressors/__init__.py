"""Compressors: flat tensor -> typed payload (exact wire size) -> flat tensor. Pure PyTorch."""

from lgc.compressors.base import CombineMode, Compressor, Payload
from lgc.compressors.error_feedback import ErrorFeedback
from lgc.compressors.fp16 import FP16Compressor
from lgc.compressors.none import DensePayload, NoneCompressor
from lgc.compressors.topk import SparsePayload, TopKCompressor

__all__ = [
    "CombineMode",
    "Compressor",
    "DensePayload",
    "ErrorFeedback",
    "FP16Compressor",
    "NoneCompressor",
    "Payload",
    "SparsePayload",
    "TopKCompressor",
]
