"""Image classification as a LightningModule (loss, torchmetrics accuracy, optimizer from config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["ImageClassifier"]


def optimizer_with_epoch_scheduler(
    parameters: Any,
    optimizer_factory: Callable[..., torch.optim.Optimizer],
    scheduler_factory: Callable[..., Any] | None,
) -> Any:
    """``configure_optimizers``' answer for the task modules: the optimizer, stepping its scheduler once per epoch."""
    optimizer = optimizer_factory(parameters)
    if scheduler_factory is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler_factory(optimizer), "interval": "epoch"}}


class ImageClassifier(pl.LightningModule):
    """Cross-entropy training of ``model``; logs ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``.

    Args:
        model: any ``nn.Module`` mapping images to logits.
        num_classes: number of classes (for the accuracy metric).
        optimizer: ``params -> Optimizer`` (a Hydra ``_partial_`` of e.g. ``torch.optim.SGD``).
        scheduler: ``optimizer -> LRScheduler`` stepped once per epoch, or None.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val/loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return optimizer_with_epoch_scheduler(self.parameters(), self.optimizer_factory, self.scheduler_factory)
