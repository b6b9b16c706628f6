"""The learning-rate schedules: a per-step linear warm-up in front of a per-epoch decay (DGC's)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, MultiStepLR

from lgc.lit.classification import LinearWarmup, optimizer_with_epoch_scheduler

LR = 0.1


def _optimizer() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=LR, momentum=0.9)


def _rates(configs: list[dict], optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int) -> list[float]:
    """The rate of every optimizer step, stepping the schedulers as Lightning does.

    After every optimizer step the ``"step"`` schedulers, after every epoch the ``"epoch"`` ones.
    """
    rates = []
    for _ in range(epochs):
        for _ in range(steps_per_epoch):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            for config in configs:
                if config["interval"] == "step":
                    config["scheduler"].step()
        for config in configs:
            if config["interval"] == "epoch":
                config["scheduler"].step()
    return rates


def _warmup(step: int, steps: int, start: float) -> float:
    return start + (1 - start) * min(step, steps) / steps


def test_warmup_then_multistep_is_the_product_of_both_at_every_step():
    optimizer = _optimizer()
    warmup = LinearWarmup(10, start_factor=0.25, decay=partial(MultiStepLR, milestones=[2, 4], gamma=0.1))
    configs = warmup(optimizer)
    assert [(type(c["scheduler"]), c["interval"]) for c in configs] == [(LinearLR, "step"), (MultiStepLR, "epoch")]
    steps_per_epoch = 4  # the warm-up (10 steps) runs into the first milestone's epoch
    rates = _rates(configs, optimizer, 6, steps_per_epoch)
    expected = [
        LR * _warmup(s, 10, 0.25) * 0.1 ** sum(s // steps_per_epoch >= m for m in (2, 4)) for s in range(len(rates))
    ]
    assert rates == pytest.approx(expected, rel=1e-12)
    # Steps 0..10: 0.025 rising by 0.0075 per step to the full rate at step 10 (decayed x0.1 from epoch 2).
    assert rates[0] == pytest.approx(0.025) and rates[1] == pytest.approx(0.0325)
    assert rates[7] == pytest.approx(LR * (0.25 + 0.75 * 0.7))
    assert rates[8] == pytest.approx(0.1 * LR * (0.25 + 0.75 * 0.8))
    assert rates[10] == pytest.approx(0.1 * LR) and rates[16] == pytest.approx(0.01 * LR)


def test_warmup_then_cosine_is_the_product_of_both_at_every_step():
    optimizer = _optimizer()
    epochs, steps_per_epoch = 8, 3
    configs = LinearWarmup(5, start_factor=0.1, decay=partial(CosineAnnealingLR, T_max=epochs))(optimizer)
    rates = _rates(configs, optimizer, epochs, steps_per_epoch)
    cosine = [(1 + math.cos(math.pi * (s // steps_per_epoch) / epochs)) / 2 for s in range(len(rates))]
    expected = [LR * _warmup(s, 5, 0.1) * c for s, c in enumerate(cosine)]
    assert rates == pytest.approx(expected, rel=1e-12)


def test_no_warmup_steps_leaves_the_decay_alone_and_no_decay_keeps_the_full_rate():
    optimizer = _optimizer()
    configs = LinearWarmup(0, decay=partial(MultiStepLR, milestones=[1]))(optimizer)
    assert [c["interval"] for c in configs] == ["epoch"]
    assert _rates(configs, optimizer, 2, 2) == pytest.approx([LR, LR, 0.1 * LR, 0.1 * LR])
    optimizer = _optimizer()
    configs = LinearWarmup(4, start_factor=0.5)(optimizer)
    assert _rates(configs, optimizer, 2, 3) == pytest.approx([0.05, 0.0625, 0.075, 0.0875, 0.1, 0.1])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"warmup_steps": -1}, "scheduler.warmup_steps must be a non-negative integer, got -1"),
        ({"warmup_steps": 2.5}, "scheduler.warmup_steps must be a non-negative integer, got 2.5"),
        ({"warmup_steps": True}, "scheduler.warmup_steps must be a non-negative integer, got True"),
        ({"warmup_steps": "10"}, "scheduler.warmup_steps must be a non-negative integer, got '10'"),
        ({"warmup_steps": 10, "start_factor": 0.0}, r"scheduler.start_factor must be a number in \(0, 1\], got 0.0"),
        ({"warmup_steps": 10, "start_factor": 1.5}, r"scheduler.start_factor must be a number in \(0, 1\], got 1.5"),
        ({"warmup_steps": 10, "decay": "MultiStepLR"}, "decay must build a scheduler from an optimizer"),
    ],
)
def test_bad_warmup_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinearWarmup(**kwargs)


@pytest.mark.parametrize(
    "decay",
    [partial(LambdaLR, lr_lambda=lambda epoch: 1.0), partial(CosineAnnealingLR, T_max=10, eta_min=1e-3)],
    ids=["lambda", "cosine_eta_min"],
)
def test_a_decay_that_would_erase_the_warmup_is_refused(decay):
    with pytest.raises(ValueError, match="does not compose with the warm-up"):
        LinearWarmup(10, decay=decay)  # a partial names its class: refused before any optimizer exists
    with pytest.raises(ValueError, match="does not compose with the warm-up"):
        LinearWarmup(10, decay=lambda optimizer: decay(optimizer))(_optimizer())  # or once it is built


def test_configure_optimizers_answer_keeps_one_epoch_scheduler_and_hands_warmup_configs_over():
    params = [torch.nn.Parameter(torch.zeros(2))]
    sgd = partial(torch.optim.SGD, lr=LR)
    assert isinstance(optimizer_with_epoch_scheduler(params, sgd, None), torch.optim.SGD)
    single = optimizer_with_epoch_scheduler(params, sgd, partial(MultiStepLR, milestones=[3]))
    assert single["lr_scheduler"]["interval"] == "epoch" and isinstance(
        single["lr_scheduler"]["scheduler"], MultiStepLR
    )
    optimizers, configs = optimizer_with_epoch_scheduler(
        params, sgd, LinearWarmup(5, decay=partial(MultiStepLR, milestones=[3]))
    )
    assert len(optimizers) == 1 and [c["interval"] for c in configs] == ["step", "epoch"]
    assert all(c["scheduler"].optimizer is optimizers[0] for c in configs)


@pytest.mark.parametrize("name", ["warmup_multistep", "warmup_cosine"])
def test_scheduler_configs_build_a_warmup_and_require_its_length(name):
    import hydra
    from hydra import compose, initialize_config_module
    from omegaconf.errors import MissingMandatoryValue

    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"scheduler={name}", "scheduler.warmup_steps=7"])
        unset = compose("train", overrides=[f"scheduler={name}"])
    warmup = hydra.utils.instantiate(cfg.scheduler)
    assert isinstance(warmup, LinearWarmup) and warmup.warmup_steps == 7
    configs = warmup(_optimizer())
    assert [c["interval"] for c in configs] == ["step", "epoch"]
    with pytest.raises(Exception, match="warmup_steps") as err:
        hydra.utils.instantiate(unset.scheduler)
    assert isinstance(err.value, MissingMandatoryValue) or isinstance(err.value.__cause__, MissingMandatoryValue)


def test_lightning_steps_the_warmup_per_step_and_the_decay_per_epoch():
    """A tiny ImageClassifier fit: the rate seen by every training batch is the product rule."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lgc.lit.classification import ImageClassifier

    class RecordRate(pl.Callback):
        def __init__(self) -> None:
            self.rates: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 4), torch.randint(0, 3, (12,)))
    module = ImageClassifier(
        torch.nn.Linear(4, 3),
        num_classes=3,
        optimizer=partial(torch.optim.SGD, lr=LR),
        scheduler=LinearWarmup(5, start_factor=0.2, decay=partial(MultiStepLR, milestones=[1], gamma=0.5)),
    )
    record = RecordRate()
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, DataLoader(data, batch_size=4))  # 3 steps per epoch
    expected = [LR * _warmup(s, 5, 0.2) * 0.5 ** (s // 3 >= 1) for s in range(9)]
    assert record.rates == pytest.approx(expected, rel=1e-12)


def test_step_cosine_reaches_zero_at_the_last_step_and_stays_there():
    from lgc.lit.classification import StepCosine

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    (config,) = StepCosine(8)(optimizer)
    assert config["interval"] == "step"
    rates = []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        config["scheduler"].step()
    expected = [0.4 * 0.5 * (1 + math.cos(math.pi * min(s, 8) / 8)) for s in range(10)]
    assert rates == pytest.approx(expected) and rates[8] == rates[9] == pytest.approx(0, abs=1e-12)


def test_cosine_steps_without_a_step_budget_is_refused_by_name(tmp_path):
    from hydra import compose, initialize_config_module

    from lgc.train import _prepare

    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=["scheduler=cosine_steps", "logger=none", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"scheduler.total_steps must be the run's positive number .* got -1"):
        _prepare(cfg)
