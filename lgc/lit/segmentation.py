"""Semantic segmentation as a LightningModule (pixel cross-entropy, auxiliary loss, mIoU, pixel accuracy)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

from lgc.lit.classification import WeightedMean, optimizer_with_epoch_scheduler, start_validation
from lgc.lit.fsdp_strategy import shard_for_strategy

__all__ = ["SemanticSegmenter", "pixel_cross_entropy", "split_logits"]


def split_logits(output: Any) -> tuple[Tensor, Tensor | None]:
    """``(main, aux)`` logits from a segmentation model's output; ``aux`` is None when there is none.

    Accepts a tensor (main logits only), a ``(main, aux)`` tuple such as
    :class:`lgc.models.PSPNetOutput`, or torchvision's segmentation dict (``"out"``, ``"aux"``).
    """
    if isinstance(output, Tensor):
        return output, None
    if isinstance(output, Mapping):
        return output["out"], output.get("aux")
    main, aux = output
    return main, aux


def pixel_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = 255) -> Tensor:
    """Cross-entropy averaged over the pixels whose label is not ``ignore_index``.

    ``F.cross_entropy``'s mean divides by the number of labelled pixels, which is 0 for a crop made
    only of void pixels: the loss is then nan and, averaged by DDP, poisons every worker's gradients.
    Here such a crop has loss 0 and zero gradients.

    Args:
        logits: ``(N, C, H, W)`` scores.
        target: ``(N, H, W)`` class indices in ``[0, C)`` or ``ignore_index``.
        ignore_index: label of pixels left out of the loss.
    """
    total = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    return total / (target != ignore_index).sum().clamp(min=1)


class SemanticSegmenter(pl.LightningModule):
    """Pixel-wise cross-entropy training; logs ``train/loss``, ``val/loss``, ``val/mIoU``, ``val/pixel_acc``.

    Batches are ``(images, masks)``: ``(N, C_in, H, W)`` floats and ``(N, H, W)`` integer labels, where
    ``ignore_index`` marks unlabelled (void) pixels. The model returns ``(N, num_classes, H, W)``
    logits, or in training mode main and auxiliary logits (see :func:`split_logits`); the training
    loss is ``CE(main) + aux_weight * CE(aux)`` (PSPNet's deep supervision, Zhao et al., CVPR 2017,
    Sec. 4), and ``train/aux_loss`` logs the auxiliary term's cross-entropy.

    Validation metrics accumulate a confusion matrix over the whole validation set (every worker's
    share, summed across workers when computed), as segmentation benchmarks score:

    * ``val/mIoU``: the mean over classes of ``TP / (TP + FP + FN)``. Pixels labelled
      ``ignore_index`` count nowhere; a class absent from both labels and predictions of the whole
      set is left out of the mean (torchmetrics' rule, tested), a class predicted but never labelled
      counts with IoU 0. An ``ignore_index`` inside ``[0, num_classes)`` also drops that class.
    * ``val/pixel_acc``: correctly labelled pixels / labelled pixels.
    * ``val/loss``: the main head's cross-entropy, averaged over every labelled pixel of the set.

    Every image of the set counts once: the images that pad the workers' shards to as many batches
    come with every pixel ``ignore_index`` (:mod:`lgc.data.eval_shard`).

    Args:
        model: ``nn.Module`` mapping images to per-pixel logits at the label size.
        num_classes: number of classes (for the metrics).
        optimizer: ``params -> Optimizer`` (a Hydra ``_partial_`` of e.g. ``torch.optim.SGD``).
        scheduler: ``optimizer -> LRScheduler`` stepped once per epoch, or None.
        ignore_index: label of void pixels, left out of losses and metrics (255 in VOC and Cityscapes
            as usually prepared; 11 in the CamVid data module). Pass the data module's ``ignore_index``.
        aux_weight: weight of the auxiliary loss (0.4 in the paper; 0 trains the main head only,
            the auxiliary head then gets zero gradients, which keeps DDP's reducer in step).
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        ignore_index: int = 255,
        aux_weight: float = 0.4,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes!r}")
        if aux_weight < 0:
            raise ValueError(f"aux_weight must be >= 0, got {aux_weight!r}")
        self.model = model
        self.num_classes = num_classes
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.ignore_index = ignore_index
        self.aux_weight = aux_weight
        self.val_miou = MulticlassJaccardIndex(num_classes, average="macro", ignore_index=ignore_index)
        self.val_pixel_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=ignore_index)
        self.val_loss = WeightedMean()

    def configure_model(self) -> None:
        """Under lgc's FSDP2 strategy, shard the network and install the compressed reduction; else nothing."""
        shard_for_strategy(self.trainer.strategy, self.model)

    def forward(self, images: Tensor) -> Any:
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, masks = batch
        main, aux = split_logits(self(images))
        loss = pixel_cross_entropy(main, masks, self.ignore_index)
        if aux is not None:
            # Added even with weight 0: an auxiliary head without gradients would stall DDP.
            aux_loss = pixel_cross_entropy(aux, masks, self.ignore_index)
            loss = loss + self.aux_weight * aux_loss
            self.log("train/aux_loss", aux_loss)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_start(self) -> None:
        start_validation(self.val_loss, self.val_miou, self.val_pixel_acc)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, masks = batch
        logits, _ = split_logits(self(images))
        # One argmax for both metrics (given logits, each would take its own).
        preds = logits.argmax(dim=1)
        self.val_miou.update(preds, masks)
        self.val_pixel_acc.update(preds, masks)
        labelled = (masks != self.ignore_index).sum()
        self.val_loss.update(pixel_cross_entropy(logits.float(), masks, self.ignore_index), weight=labelled)
        # Metric objects: Lightning calls compute() at the epoch's end, which sums the confusion
        # matrices (and the loss's sums) of all workers first (sync_dist does not apply to them).
        self.log("val/loss", self.val_loss)
        self.log("val/mIoU", self.val_miou, prog_bar=True)
        self.log("val/pixel_acc", self.val_pixel_acc)

    def configure_optimizers(self) -> Any:
        return optimizer_with_epoch_scheduler(self.parameters(), self.optimizer_factory, self.scheduler_factory)
