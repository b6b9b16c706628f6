"""Lightning glue: the compression strategy, callbacks, task modules and data modules."""

from lgc.lit.callbacks import CompressionCallback, RunSummary, ValidateAtMaxSteps
from lgc.lit.checkpoint import CheckpointRecord, ResumableCheckpoint, check_checkpoint
from lgc.lit.classification import ImageClassifier
from lgc.lit.data import (
    CamVidDataModule,
    CIFAR10DataModule,
    DigitsDataModule,
    FashionMNISTDataModule,
    FashionScenesDataModule,
    ImageNetDataModule,
)
from lgc.lit.fsdp_strategy import CompressedFSDPStrategy
from lgc.lit.segmentation import SemanticSegmenter
from lgc.lit.strategy import CompressedDDPStrategy

__all__ = [
    "CIFAR10DataModule",
    "CamVidDataModule",
    "CheckpointRecord",
    "CompressedDDPStrategy",
    "CompressedFSDPStrategy",
    "CompressionCallback",
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "FashionScenesDataModule",
    "ImageNetDataModule",
    "ImageClassifier",
    "ResumableCheckpoint",
    "RunSummary",
    "SemanticSegmenter",
    "ValidateAtMaxSteps",
    "check_checkpoint",
]
