"""Exact resume: a run stopped at any step and resumed takes the steps of one never stopped.

Every comparison is bit for bit: parameters, optimizer and LR-scheduler state, and every rank's
compressor state (residuals, momenta, LGC's autoencoder and buffers, step counters, byte counts,
random generators). Stop points: mid-epoch through ``trainer.max_steps`` (the stop users hit) and
through step checkpoints kept by a second ``ModelCheckpoint``, at epoch ends, and in each of LGC's
stages. The whole matrix is ``-m slow``; the default suite runs one mid-epoch ``max_steps`` stop of
shared-index int8 in its compressed stage end to end, and ``tests/ddp/test_devices.py`` resumes every
method's hook state mid-run.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_module

from lgc.train import train

pytestmark = pytest.mark.multiprocess

#: 2 workers, 8 batches per epoch, 3 epochs: 24 steps.
STEPS_PER_EPOCH, EPOCHS = 8, 3
COMMON = (
    "experiment=smoke",
    "logger=csv",
    "ddp.start_method=fork",  # workers start at once (spawned ones import torch and Lightning again)
    f"trainer.limit_train_batches={STEPS_PER_EPOCH}",
    "trainer.limit_val_batches=1",
    f"trainer.max_epochs={EPOCHS}",
    f"scheduler.T_max={EPOCHS}",
)
#: LGC's stages over the 24 steps: dense warm-up 0-1, autoencoder training 2-5, compressed 6-23.
LGC_STAGES = ("compressor.stages.warmup_steps=2", "compressor.stages.ae_steps=4", "compressor.training.batch_size=16")

METHODS: dict[str, tuple[str, ...]] = {
    "topk": ("compressor=topk", "compressor.density=0.05"),
    "dgc": ("compressor=dgc", "compressor.density=0.05"),
    "sbc_delay": ("compressor=sbc", "compressor.density=0.05", "comm=local_sgd", "comm.delay=3"),
    "lgc_rar": ("compressor=lgc_rar", *LGC_STAGES),
    "lgc_ps": ("compressor=lgc_ps", *LGC_STAGES),
    "lgc_rar_linear": ("compressor=lgc_rar_linear", *LGC_STAGES),
    # Stochastic rounding (seeded by step and rank) and the shared-index stages (no codec training).
    "shared_topk_int8": ("compressor=shared_topk", "compressor.values=int8", "compressor.stages.warmup_steps=2"),
    # Decaying error feedback on the pseudo-gradient, DiLoCo's outer momentum, three
    # fragments exchanged on staggered steps (one per local step); and DeMo's momentum.
    "sparseloco_streaming": ("compressor=sparseloco", "comm=streaming_diloco", "comm.delay=3", "comm.fragments=3"),
    "demo": ("compressor=demo",),
}
#: Where each method is stopped: (how, step). "max_steps" stops a run there (mid-epoch),
#: "max_epochs" at an epoch's end (step 8 or 16), "kept" resumes from a mid-epoch step checkpoint
#: kept by the uninterrupted run (LGC refuses a max_steps run that ends before its compressed stage).
STOPS: dict[str, tuple[tuple[str, int], ...]] = {
    "topk": (("max_steps", 12), ("max_epochs", 8), ("kept", 19)),
    "dgc": (("max_steps", 12), ("kept", 3), ("max_epochs", 16)),
    "sbc_delay": (("max_steps", 10), ("max_epochs", 8), ("kept", 13)),
    "lgc_rar": (("kept", 1), ("kept", 4), ("max_epochs", 8), ("max_steps", 13), ("max_epochs", 16)),
    "lgc_ps": (("kept", 1), ("kept", 4), ("max_epochs", 8), ("max_steps", 13), ("max_epochs", 16)),
    "lgc_rar_linear": (("kept", 4), ("max_steps", 13)),
    "shared_topk_int8": (("kept", 1), ("max_steps", 10), ("max_epochs", 16)),
    "sparseloco_streaming": (("max_steps", 10), ("max_epochs", 8), ("kept", 13)),
    "demo": (("max_steps", 12), ("max_epochs", 8)),
}


def compose_cfg(output_dir: Path, *overrides: str):
    with initialize_config_module("lgc.conf", version_base="1.3"):
        return compose("train", overrides=[*COMMON, f"output_dir={output_dir}", *overrides])


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_identical(expected: Any, actual: Any, where: str) -> None:
    """Bit-for-bit equality of nested checkpoint state; the message names the first differing entry."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) == set(actual), f"{where}: keys {set(expected) ^ set(actual)}"
        for key in expected:
            assert_identical(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(expected) == len(actual), f"{where}: lengths differ"
        for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_identical(e, a, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype, f"{where}: {actual!r}"
        difference = (expected.double() - actual.double()).abs().max() if expected.numel() else 0
        assert torch.equal(expected, actual), f"{where}: max difference {difference}"
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def assert_same_training(straight: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert straight["global_step"] == resumed["global_step"] == STEPS_PER_EPOCH * EPOCHS
    assert_identical(straight["state_dict"], resumed["state_dict"], "parameters")
    assert_identical(straight["optimizer_states"], resumed["optimizer_states"], "optimizer")
    assert_identical(straight["lr_schedulers"], resumed["lr_schedulers"], "lr_scheduler")
    # Every rank's compressor state (and its random generators).
    straight_ranks = straight["callbacks"]["CompressionCallback"]["per_rank"]
    resumed_ranks = resumed["callbacks"]["CompressionCallback"]["per_rank"]
    assert len(straight_ranks) == len(resumed_ranks) == 2
    for rank, (expected, actual) in enumerate(zip(straight_ranks, resumed_ranks, strict=True)):
        assert_identical(expected, actual, f"rank{rank}")


def keep_every_step(folder: Path) -> tuple[str, ...]:
    """Overrides adding a second ModelCheckpoint that keeps a checkpoint of every step."""
    return (
        "+callbacks.every_step._target_=pytorch_lightning.callbacks.ModelCheckpoint",
        f"+callbacks.every_step.dirpath={folder}",
        "+callbacks.every_step.every_n_train_steps=1",
        "+callbacks.every_step.save_top_k=-1",
        "+callbacks.every_step.filename='s{step}'",
        "+callbacks.every_step.auto_insert_metric_name=false",
    )


def check_resume_matrix(tmp_path: Path, method: str, stops: tuple[tuple[str, int], ...]) -> dict[tuple[str, int], bool]:
    overrides = METHODS[method]
    kept = tmp_path / "kept"
    train(compose_cfg(tmp_path / "straight", *overrides, *keep_every_step(kept)))
    straight = load(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    results = {}
    for how, step in stops:
        run = tmp_path / f"{how}{step}"
        if how in ("max_steps", "max_epochs"):
            stop = (
                f"trainer.max_steps={step}" if how == "max_steps" else f"trainer.max_epochs={step // STEPS_PER_EPOCH}"
            )
            train(compose_cfg(run / "first", *overrides, stop))
            stopped = run / "first" / "checkpoints" / "last.ckpt"
        else:
            stopped = kept / f"s{step}.ckpt"
        assert load(stopped)["global_step"] == step
        train(compose_cfg(run / "resumed", *overrides, f"ckpt_path={stopped}"))
        assert_same_training(straight, load(run / "resumed" / "checkpoints" / "last.ckpt"))
        # The epochs' train/acc, the one it stopped in too (over the whole epoch, not since the stop).
        resumed_rows = logged_rows(run / "resumed", "train/acc")
        assert len(resumed_rows) == EPOCHS - step // STEPS_PER_EPOCH
        assert resumed_rows == logged_rows(tmp_path / "straight", "train/acc")[-len(resumed_rows) :]
        results[(how, step)] = True
    return results


@pytest.mark.slow
def test_lgc_rar_stopped_by_max_steps_in_its_compressed_stage_resumes_bit_identically(tmp_path):
    """LGC-RAR stopped mid-epoch in its compressed stage: the checkpoint's loop and loader position, and the
    resumed run's summary naming the segment before it (every method and stage: the slow matrix below)."""
    check_resume_matrix(tmp_path, "lgc_rar", (("max_steps", 13),))
    # The stop was saved at step 13 itself, with the epoch unfinished and the loader's position.
    checkpoint = load(tmp_path / "max_steps13" / "first" / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 13
    epoch_progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert epoch_progress["started"] == 2 and epoch_progress["processed"] == 1  # epoch 1 is under way
    (loader_state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    # Five batches of 32 into epoch 1 (the stateful sampler's own record).
    assert loader_state["_sampler_iter_state"]["sampler_state"] == {"epoch": 1, "yielded": 5 * 32, "replicas": 2}
    assert checkpoint["lgc"]["world_size"] == 2
    assert checkpoint["lgc"]["compressor"]["_target_"].endswith("LGCRingAllreduceState")
    # The resumed run's summary names the segment before it: its commit, fit time and last step.
    first = json.loads((tmp_path / "max_steps13" / "first" / "summary.json").read_text())
    resumed = json.loads((tmp_path / "max_steps13" / "resumed" / "summary.json").read_text())
    (earlier,) = resumed["earlier_segments"]
    assert earlier["provenance"] == first["provenance"] and earlier["step"] == 13
    assert 0 < earlier["fit_time_s"] <= first["fit_time_s"]
    assert "earlier_segments" not in first


def logged_rows(run: Path, metric: str) -> list[dict[str, str]]:
    """The CSV logger's rows holding ``metric``: epoch, logged step and every metric of its kind
    (``val/...`` or ``train/...``)."""
    with (run / "csv" / "version_0" / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    kind = metric.split("/")[0] + "/"
    return [
        {key: value for key, value in row.items() if key in ("epoch", "step") or (key.startswith(kind) and value)}
        for row in rows
        if row.get(metric)
    ]


def validation_rows(run: Path) -> list[dict[str, str]]:
    """The CSV logger's validation rows: epoch, logged step and every validation metric."""
    return logged_rows(run, "val/loss")


def test_max_steps_run_resumed_from_an_epoch_end_checkpoint_takes_the_same_epochs(tmp_path):
    """A run with ``trainer.max_steps`` resumed from a checkpoint saved at an epoch's end (where
    Lightning counts the epoch unfinished): the next epoch is the same epoch, with the same shuffle,
    steps, learning rates, logged steps and validation as in the run never stopped."""
    overrides = (*METHODS["topk"], f"trainer.max_steps={STEPS_PER_EPOCH * EPOCHS}")
    kept = tmp_path / "kept"
    every_epoch = (
        "+callbacks.every_epoch._target_=pytorch_lightning.callbacks.ModelCheckpoint",
        f"+callbacks.every_epoch.dirpath={kept}",
        "+callbacks.every_epoch.every_n_epochs=1",
        "+callbacks.every_epoch.save_on_train_epoch_end=true",
        "+callbacks.every_epoch.save_top_k=-1",
        "+callbacks.every_epoch.filename='e{step}'",
        "+callbacks.every_epoch.auto_insert_metric_name=false",
    )
    train(compose_cfg(tmp_path / "straight", *overrides, *every_epoch))
    straight = load(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    # Kept by Lightning's ModelCheckpoint after epoch 0, and lgc-train's own last.ckpt of a run whose
    # max_steps ends epoch 1.
    train(compose_cfg(tmp_path / "first", *overrides, f"trainer.max_steps={2 * STEPS_PER_EPOCH}"))
    stops = {1: kept / f"e{STEPS_PER_EPOCH}.ckpt", 2: tmp_path / "first" / "checkpoints" / "last.ckpt"}
    for epochs_done, stopped in stops.items():
        saved = load(stopped)["loops"]["fit_loop"]["epoch_progress"]["total"]
        assert saved["processed"] == epochs_done == saved["completed"] + 1  # as Lightning saves an epoch's end
        run = tmp_path / f"resumed{epochs_done}"
        train(compose_cfg(run, *overrides, f"ckpt_path={stopped}"))
        resumed = load(run / "checkpoints" / "last.ckpt")
        assert_same_training(straight, resumed)
        assert resumed["epoch"] == straight["epoch"] == EPOCHS - 1
        epochs = [checkpoint["loops"]["fit_loop"]["epoch_progress"] for checkpoint in (straight, resumed)]
        assert_identical(*epochs, "epoch_progress")
        assert validation_rows(run) == validation_rows(tmp_path / "straight")[epochs_done:]
        # The next epoch's train/acc counts that epoch alone (the saved epoch's counts are not carried).
        assert logged_rows(run, "train/acc") == logged_rows(tmp_path / "straight", "train/acc")[epochs_done:]


def test_a_checkpoint_saved_at_a_mid_epoch_validation_resumes_with_the_same_validations(tmp_path):
    """A checkpoint written at a validation's end in the middle of an epoch (``val_check_interval``,
    Lightning's ``ModelCheckpoint``) holds that validation's metric counts, as Lightning resets them only
    afterwards: the resumed run's next validation scores the set once, as the run never stopped does."""
    kept = tmp_path / "kept"
    overrides = (
        *METHODS["topk"],
        "trainer.max_epochs=1",
        "scheduler.T_max=1",
        f"+trainer.val_check_interval={STEPS_PER_EPOCH // 2}",
        "+callbacks.every_validation._target_=pytorch_lightning.callbacks.ModelCheckpoint",
        f"+callbacks.every_validation.dirpath={kept}",
        "+callbacks.every_validation.save_top_k=-1",
        "+callbacks.every_validation.filename='v{step}'",
        "+callbacks.every_validation.auto_insert_metric_name=false",
    )
    train(compose_cfg(tmp_path / "straight", *overrides))
    stopped = kept / f"v{STEPS_PER_EPOCH // 2}.ckpt"
    assert not load(stopped)["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"]
    train(compose_cfg(tmp_path / "resumed", *overrides, f"ckpt_path={stopped}"))
    straight_rows = validation_rows(tmp_path / "straight")
    assert len(straight_rows) == 2
    assert validation_rows(tmp_path / "resumed") == straight_rows[1:]
    assert logged_rows(tmp_path / "resumed", "train/acc") == logged_rows(tmp_path / "straight", "train/acc")


def test_shared_index_int8_stopped_in_its_compressed_stage_resumes_bit_identically(tmp_path):
    check_resume_matrix(tmp_path, "shared_topk_int8", (("max_steps", 10),))


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_resume_matrix_every_method_and_stage(tmp_path, method):
    check_resume_matrix(tmp_path, method, STOPS[method])
