"""Image classification as a LightningModule (loss, torchmetrics accuracy, optimizer from config)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from lgc.data.eval_shard import CLASS_IGNORE_INDEX
from lgc.lit.fsdp_strategy import shard_for_strategy
from lgc.validation import NonNegativeInt, PositiveFraction, check

__all__ = ["ImageClassifier", "LinearWarmup", "StepCosine", "WeightedMean", "start_validation"]

#: Schedulers whose step multiplies the current learning rate by a factor of their own, so that
#: they compose with the warm-up's factor (others recompute the rate from ``base_lrs`` and would
#: erase it, or need a monitored metric).
_CHAINABLE = (
    torch.optim.lr_scheduler.MultiStepLR,
    torch.optim.lr_scheduler.StepLR,
    torch.optim.lr_scheduler.ExponentialLR,
    torch.optim.lr_scheduler.MultiplicativeLR,
    torch.optim.lr_scheduler.CosineAnnealingLR,
)


def _check_chainable(scheduler: type, eta_min: float) -> None:
    if not issubclass(scheduler, _CHAINABLE) or eta_min != 0.0:
        raise ValueError(
            f"scheduler.decay {scheduler.__name__} does not compose with the warm-up (its steps must multiply the "
            "current learning rate): use MultiStepLR, StepLR, ExponentialLR, MultiplicativeLR or CosineAnnealingLR "
            "with eta_min=0"
        )


class LinearWarmup:
    """A per-step linear learning-rate warm-up in front of a per-epoch schedule.

    DGC (Lin et al. 2018) warms the learning rate up together with the density, as Goyal et al.
    (2017) do for large batches. The learning rate is ``start_factor * lr`` at the first optimizer
    step and rises linearly to ``lr`` at step ``warmup_steps`` (torch's
    :class:`~torch.optim.lr_scheduler.LinearLR`, stepped after every optimizer step), while
    ``decay`` (e.g. ``MultiStepLR``) is stepped once per epoch as without warm-up. Both multiply
    the current rate, so at optimizer step ``s`` of epoch ``e`` the rate is
    ``lr * warmup(s) * decay(e)``: the decay's epochs count from the start of training, warm-up
    included.

    Used as the ``scheduler`` of a task module (``scheduler=warmup_multistep`` or
    ``warmup_cosine``); calling it returns Lightning's scheduler configs, which
    :func:`optimizer_with_epoch_scheduler` hands over as they are.

    Args:
        warmup_steps: optimizer steps of the warm-up (batches divided by
            ``accumulate_grad_batches``), an integer >= 0; 0 disables it. E.g. DGC's 4 warm-up
            epochs are ``4 * steps_per_epoch``.
        start_factor: fraction of the learning rate at the first step, in (0, 1]. Goyal et al. start
            from the learning rate of one worker's batch: ``1 / world_size`` when ``lr`` was scaled
            with the number of workers.
        decay: ``optimizer -> LRScheduler`` stepped per epoch (a Hydra ``_partial_``), or None for a
            constant rate after the warm-up. It must be one whose steps multiply the current rate
            (MultiStepLR, StepLR, ExponentialLR, MultiplicativeLR, CosineAnnealingLR with
            ``eta_min=0``); others are refused.

    Example::

        >>> warmup = LinearWarmup(500, start_factor=0.1, decay=partial(MultiStepLR, milestones=[82, 123]))
        >>> configs = warmup(optimizer)  # [{"scheduler": LinearLR, "interval": "step"}, {... "epoch"}]
    """

    def __init__(
        self,
        warmup_steps: NonNegativeInt,
        start_factor: PositiveFraction = 0.1,
        decay: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        check("scheduler.warmup_steps", warmup_steps, NonNegativeInt)
        check("scheduler.start_factor", start_factor, PositiveFraction)
        if decay is not None and not callable(decay):
            raise ValueError(f"scheduler.decay must build a scheduler from an optimizer (a _partial_), got {decay!r}")
        # A Hydra _partial_ names its class: refuse a decay that cannot compose before any worker starts.
        func = getattr(decay, "func", None)
        if isinstance(func, type) and issubclass(func, torch.optim.lr_scheduler.LRScheduler):
            _check_chainable(func, getattr(decay, "keywords", {}).get("eta_min", 0.0))
        self.warmup_steps = warmup_steps
        self.start_factor = float(start_factor)
        self.decay = decay

    def __call__(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """Lightning's scheduler configs for ``optimizer``: the warm-up per step, the decay per epoch."""
        configs = []
        # The decay first: it records the full rate as its base before the warm-up lowers it.
        if self.decay is not None:
            decay = self.decay(optimizer)
            _check_chainable(type(decay), getattr(decay, "eta_min", 0.0))
            configs.append({"scheduler": decay, "interval": "epoch"})
        if self.warmup_steps > 0:
            warmup = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=self.start_factor, end_factor=1.0, total_iters=self.warmup_steps
            )
            configs.insert(0, {"scheduler": warmup, "interval": "step"})
        return configs

    def __repr__(self) -> str:
        return f"LinearWarmup(warmup_steps={self.warmup_steps}, start_factor={self.start_factor}, decay={self.decay!r})"


class StepCosine:
    """Cosine decay of the learning rate to zero over ``total_steps`` optimizer steps, stepped per step.

    The schedule an endpoint comparison needs: the rate falls to 0 over the run's steps whatever
    the number of epochs (a per-epoch cosine over few epochs spends the last epoch at a rate well
    above zero); step ``s`` (from 0) trains at ``lr * (1 + cos(pi * s / total_steps)) / 2``, so the
    last step's rate is about ``lr * (pi / total_steps)^2 / 4``. ``total_steps`` is the run's
    length, ``trainer.max_steps`` in ``scheduler=cosine_steps``; past it the rate stays at 0.

    Args:
        total_steps: optimizer steps of the run (a positive integer).
    """

    def __init__(self, total_steps: int) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(
                f"scheduler.total_steps must be the run's positive number of optimizer steps (scheduler=cosine_steps "
                f"takes trainer.max_steps: set it), got {total_steps!r}"
            )
        self.total_steps = total_steps

    def __call__(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """Lightning's scheduler config: the rate ``lr * (1 + cos(pi * step / total_steps)) / 2``, per step."""
        lam = _HalfCosine(self.total_steps)
        return [{"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lam), "interval": "step"}]

    def __repr__(self) -> str:
        return f"StepCosine(total_steps={self.total_steps})"


class _HalfCosine:
    """``step -> (1 + cos(pi * min(step, total) / total)) / 2`` (picklable, unlike a lambda)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, step: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * min(step, self.total) / self.total))


def optimizer_with_epoch_scheduler(
    parameters: Any,
    optimizer_factory: Callable[..., torch.optim.Optimizer],
    scheduler_factory: Callable[..., Any] | None,
) -> Any:
    """``configure_optimizers``' answer for the task modules: the optimizer and its learning-rate schedule.

    ``scheduler_factory(optimizer)`` returns either a scheduler, stepped once per epoch, or (a
    :class:`LinearWarmup`) a list of Lightning scheduler configs that say their own ``interval``.
    """
    optimizer = optimizer_factory(parameters)
    if scheduler_factory is None:
        return optimizer
    scheduler = scheduler_factory(optimizer)
    if isinstance(scheduler, list):
        return [optimizer], scheduler
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class WeightedMean(Metric):
    """``sum(value * weight) / sum(weight)`` over every update of every worker (torchmetrics sums
    both across workers), in float64 (a set's pixel count passes float32's exact integers); a NaN
    value makes the mean NaN.

    Why not torchmetrics' ``MeanMetric``: it drops NaN values with a warning (a batch that diverged
    would vanish from the mean), and with ``nan_strategy="disable"`` it ignores the weights
    (torchmetrics 1.9; Lightning-AI/torchmetrics issue 3434).
    """

    full_state_update = False
    total: Tensor
    weight: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, value: Tensor, weight: Tensor | float = 1.0) -> None:
        """Add ``value`` (any shape; every element counts ``weight``, broadcast to it)."""
        value = value.to(self.total.dtype)
        weights = torch.as_tensor(weight, dtype=self.total.dtype, device=value.device).expand_as(value)
        self.total += (value * weights).sum()
        self.weight += weights.sum()

    def compute(self) -> Tensor:
        return self.total / self.weight


def start_validation(loss: WeightedMean, *metrics: Metric) -> None:
    """Ready a module's validation metrics at the start of every validation: every count zero, and
    ``loss``'s sums in float64.

    Zero: a checkpoint written at a validation's end (Lightning's ``ModelCheckpoint`` runs before
    Lightning resets the metrics) holds that validation's counts, and a run resumed from it would add
    them to its next validation's. float64: undo a 16-bit ``"true"`` precision's conversion of the
    sums (Lightning converts the whole module, metrics included): a float16 sum of weights overflows
    at 65,504 pixels and a bfloat16 one stops growing at 256 samples.
    """
    for metric in (loss, *metrics):
        metric.reset()
    loss.set_dtype(torch.float64)


class ImageClassifier(pl.LightningModule):
    """Cross-entropy training of ``model``; logs ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``.

    ``val/acc`` and ``val/loss`` are the accuracy and the mean cross-entropy over every sample of the
    validation set, each counted once across all workers (torchmetrics sums the workers' counts);
    samples labelled :data:`lgc.data.eval_shard.CLASS_IGNORE_INDEX` (the positions that pad the
    workers' shards to as many batches) count nowhere.

    Args:
        model: any ``nn.Module`` mapping images to logits.
        num_classes: number of classes (for the accuracy metric).
        optimizer: ``params -> Optimizer`` (a Hydra ``_partial_`` of e.g. ``torch.optim.SGD``).
        scheduler: ``optimizer -> LRScheduler`` stepped once per epoch, a :class:`LinearWarmup`
            (per-step warm-up, then a per-epoch schedule), or None.
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
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", ignore_index=CLASS_IGNORE_INDEX)
        self.val_loss = WeightedMean()

    def configure_model(self) -> None:
        """Under lgc's FSDP2 strategy, shard the network and install the compressed reduction; else nothing."""
        shard_for_strategy(self.trainer.strategy, self.model)

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

    def on_validation_start(self) -> None:
        start_validation(self.val_loss, self.val_acc)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        kept = labels != CLASS_IGNORE_INDEX
        self.val_acc.update(logits, labels)
        self.val_loss.update(F.cross_entropy(logits[kept].float(), labels[kept], reduction="none"))
        # Metric objects: Lightning calls compute() at the epoch's end, after torchmetrics has
        # summed every worker's counts, so the means are over the whole set.
        self.log("val/loss", self.val_loss)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return optimizer_with_epoch_scheduler(self.parameters(), self.optimizer_factory, self.scheduler_factory)
