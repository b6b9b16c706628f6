"""Lightning glue: the compression strategy, callbacks, task modules and data modules."""

from lgc.lit.callbacks import CompressionCallback, RunSummary
from lgc.lit.classification import ImageClassifier
from lgc.lit.data import CIFAR10DataModule, DigitsDataModule
from lgc.lit.strategy import CompressedDDPStrategy

__all__ = [
    "CIFAR10DataModule",
    "CompressedDDPStrategy",
    "CompressionCallback",
    "DigitsDataModule",
    "ImageClassifier",
    "RunSummary",
]
