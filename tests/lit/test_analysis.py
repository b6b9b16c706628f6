"""Gradient recording (per worker, before DDP averages) and the cross-worker statistics."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lgc.analysis import (
    GradientRecorder,
    GradientRecording,
    compare_recordings,
    cross_worker_cosine,
    leader_position_statistics,
    load_recording,
    pairwise_cosine,
    pairwise_topk_jaccard,
    plot_cosine_over_time,
    plot_topk_jaccard_over_time,
    random_topk_jaccard,
    select_parameters,
    summarize_recording,
    topk_jaccard,
)
from lgc.lit import DigitsDataModule, ImageClassifier
from lgc.models import resnet8

# ----------------------------------------------------------------------------------------------
# Statistics on tensors made to order.


def test_pairwise_cosine_of_known_directions():
    e1, e2 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    # Workers x steps x numel: step 0 same direction (other length), step 1 opposite, step 2 orthogonal.
    grads = torch.stack([torch.stack([e1, e1, e1]), torch.stack([3 * e1, -e1, e2])])
    torch.testing.assert_close(cross_worker_cosine(grads), torch.tensor([1.0, -1.0, 0.0]))
    matrices = pairwise_cosine(grads)
    assert matrices.shape == (3, 2, 2)
    torch.testing.assert_close(torch.diagonal(matrices, dim1=1, dim2=2), torch.ones(3, 2))


def test_cross_worker_cosine_averages_the_pairs_and_survives_a_zero_gradient():
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])
    grads = torch.stack([a, b, c])[:, None, :]  # 3 workers, 1 step
    expected = (0.0 + 2**-0.5 + 2**-0.5) / 3
    torch.testing.assert_close(cross_worker_cosine(grads), torch.tensor([expected]))
    with_zero = torch.stack([a, torch.zeros(2)])[:, None, :]
    assert cross_worker_cosine(with_zero).item() == 0.0
    with pytest.raises(ValueError, match="at least 2 workers"):
        cross_worker_cosine(torch.ones(1, 3, 4))


def test_topk_jaccard_of_known_supports():
    # k = 2 of 8: worker 0 largest at {0, 1}, worker 1 at {1, 2} -> |A & B| = 1, |A | B| = 3.
    w0 = torch.tensor([9.0, -8.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])
    w1 = torch.tensor([0.0, 5.0, -7.0, 0.1, 0.0, 0.0, 0.0, 0.0])
    grads = torch.stack([torch.stack([w0, w0]), torch.stack([w1, w0])])
    torch.testing.assert_close(topk_jaccard(grads, density=0.25), torch.tensor([1 / 3, 1.0]))
    assert pairwise_topk_jaccard(grads, density=0.25).shape == (2, 2, 2)
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got 0"):
        topk_jaccard(grads, density=0)


def test_independent_gradients_overlap_as_the_random_baseline_says():
    torch.manual_seed(0)
    grads = torch.randn(2, 400, 1000)
    measured = topk_jaccard(grads, density=0.05).mean().item()
    assert measured == pytest.approx(random_topk_jaccard(1000, 0.05), rel=0.1)
    assert random_topk_jaccard(100, 1.0) == pytest.approx(1.0)


def _synthetic_recording(shared: float, seed: int = 0) -> GradientRecording:
    """Two workers whose gradients are ``shared * common + noise``: more shared, more alike."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(1, 10, 4, 3, 3, 3, generator=generator)
    noise = torch.randn(2, 10, 4, 3, 3, 3, generator=generator)
    fc = torch.randn(2, 10, 10, 4, generator=generator)
    return GradientRecording(
        steps=torch.arange(0, 20, 2),
        gradients={"model.conv.weight": shared * common + noise, "model.fc.weight": fc},
        world_size=2,
        metadata={"shared": shared},
    )


def test_values_at_the_leaders_positions_agree_for_equal_gradients_and_not_for_independent_ones():
    torch.manual_seed(0)
    common = torch.randn(1, 6, 2000)
    same = leader_position_statistics(common.expand(3, -1, -1).clone(), density=0.05)
    assert torch.allclose(same["correlation"], torch.ones(6))
    # Every worker's energy at the leader's positions is the leader's own top-k share.
    own = common[0].pow(2).topk(100, dim=-1).values.sum(-1) / common[0].pow(2).sum(-1)
    assert torch.allclose(same["energy_share"], own)
    independent = leader_position_statistics(torch.randn(4, 6, 20000), density=0.05)
    assert independent["correlation"].abs().max() < 0.05
    assert torch.allclose(independent["energy_share"], torch.full((6,), 0.05), atol=0.01)


def test_the_leader_is_worker_0_or_rotates_with_the_step():
    # Worker w's gradient is large at position w and small elsewhere (its own top-1), a ramp shared by all.
    grads = torch.linspace(0.0, 0.01, 8).repeat(3, 4, 1)
    for w in range(3):
        grads[w, :, w] = 10.0
    fixed = leader_position_statistics(grads, density=1 / 8)
    rotating = leader_position_statistics(grads, density=1 / 8, rotating=True)
    # At the leader's one position the others hold only the ramp: a tiny share of their energy.
    assert fixed["energy_share"].max() < 1e-5 and rotating["energy_share"].max() < 1e-5
    # With k = 1 value each there is nothing to correlate: r is NaN, not a made-up 0.
    assert fixed["correlation"].isnan().all()
    # Worker 0 now holds 5 at position 1 in step 1, where that step's rotating leader (worker 1) has its
    # spike: a fifth of worker 0's energy (25 / 125), nothing of worker 2's; the mean over the two is 0.1.
    grads[0, 1, 1] = 5.0
    shared = leader_position_statistics(grads, density=1 / 8, rotating=True)["energy_share"]
    assert shared[1] == pytest.approx(0.1, abs=1e-4) and shared[0] < 1e-5
    # The fixed leader (worker 0) picks its own larger spike at position 0 in every step.
    assert leader_position_statistics(grads, density=1 / 8)["energy_share"].max() < 1e-5
    with pytest.raises(ValueError, match="density must be in"):
        leader_position_statistics(grads, density=0.0)


def test_summaries_rank_more_alike_workers_higher():
    alike, unrelated = _synthetic_recording(3.0), _synthetic_recording(0.0)
    rows = compare_recordings({"alike": alike, "unrelated": unrelated}, density=0.1)
    conv = "model.conv.weight"
    assert rows["alike"][conv]["cosine_mean"] > 0.8 > 0.2 > abs(rows["unrelated"][conv]["cosine_mean"])
    assert rows["alike"][conv]["jaccard_mean"] > 2 * rows["alike"][conv]["jaccard_random"]
    assert summarize_recording(alike, 0.1)[conv]["numel"] == 108
    other_layers = GradientRecording(alike.steps, {"x": alike.gradients["model.fc.weight"]}, 2)
    with pytest.raises(ValueError, match="different layers"):
        compare_recordings({"a": alike, "b": other_layers})


def test_plots_draw_one_panel_per_layer_and_one_line_per_run():
    recordings = {"alike": _synthetic_recording(3.0), "unrelated": _synthetic_recording(0.0)}
    figure = plot_cosine_over_time(recordings)
    visible = [axis for axis in figure.axes if axis.get_visible()]
    assert [axis.get_title() for axis in visible] == ["model.conv.weight", "model.fc.weight"]
    assert all(len(axis.get_lines()) == 3 for axis in visible)  # 2 runs + the zero line
    figure = plot_topk_jaccard_over_time(recordings, density=0.1)
    assert figure.axes[0].get_legend_handles_labels()[1] == ["alike", "unrelated", "random supports"]
    assert all(len(axis.get_lines()) == 3 for axis in visible)  # 2 runs + the random baseline


# ----------------------------------------------------------------------------------------------
# The recorder in training.


def test_select_parameters_by_pattern_or_a_few_conv_weights():
    module = ImageClassifier(resnet8(num_classes=10, in_channels=1), 10, optimizer=torch.optim.SGD)
    assert list(select_parameters(module.named_parameters())) == [
        "model.conv1.weight",
        "model.layers.1.conv1.weight",
        "model.layers.2.conv2.weight",
    ]
    picked = select_parameters(module.named_parameters(), ["model.layers.*.conv1.weight", "model.fc.*"])
    assert list(picked) == [f"model.layers.{i}.conv1.weight" for i in range(3)] + ["model.fc.weight", "model.fc.bias"]
    with pytest.raises(ValueError, match=r"no parameter name matches \['\*nothing\*'\].*model.conv1.weight"):
        select_parameters(module.named_parameters(), ["*nothing*"])


class _GradsAtStep(pl.Callback):
    """The gradients the optimizer is about to apply (DDP's average on several ranks), per step."""

    def __init__(self, names: list[str], out_dir: str | None = None) -> None:
        self.names, self.out_dir = names, out_dir
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = dict(pl_module.named_parameters())
        self.grads.append({name: params[name].grad.detach().clone() for name in self.names})

    def on_train_end(self, trainer, pl_module) -> None:
        if self.out_dir is not None:
            torch.save(self.grads, Path(self.out_dir) / f"applied{trainer.global_rank}.pt")


_NAMES = ["model.conv1.weight", "model.layers.2.conv2.weight"]


def _fit(tmp_path: Path, callbacks: list[pl.Callback], devices: int = 1, **trainer_kwargs) -> ImageClassifier:
    pl.seed_everything(0, verbose=False)
    module = ImageClassifier(
        resnet8(num_classes=10, in_channels=1), 10, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=5,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=16))
    return module


def test_recorder_records_the_gradients_and_does_not_change_training(tmp_path):
    applied = _GradsAtStep(_NAMES)
    recorder = GradientRecorder(str(tmp_path / "grads"), _NAMES, every_n_steps=2, metadata={"partition": "iid"})
    recorded_run = _fit(tmp_path, [recorder, applied])
    plain_run = _fit(tmp_path, [])
    for name, tensor in plain_run.state_dict().items():
        assert torch.equal(tensor, recorded_run.state_dict()[name]), name

    recording = load_recording(tmp_path / "grads")
    assert recording.steps.tolist() == [0, 2, 4] and recording.world_size == 1
    assert recording.metadata == {"partition": "iid"} and recording.names == _NAMES
    for name in _NAMES:
        assert recording.gradients[name].shape == (1, 3, *applied.grads[0][name].shape)
        for index, step in enumerate([0, 2, 4]):
            torch.testing.assert_close(recording.gradients[name][0, index], applied.grads[step][name])
    assert not recorder._handles  # hooks removed at the end of training


def test_recorder_sums_accumulated_micro_batches_and_stores_half_precision(tmp_path):
    applied = _GradsAtStep(_NAMES[:1])
    recorder = GradientRecorder(str(tmp_path / "grads"), _NAMES[:1], dtype="float16")
    _fit(tmp_path, [recorder, applied], accumulate_grad_batches=2)
    recording = load_recording(tmp_path / "grads")
    grads = recording.gradients[_NAMES[0]]
    assert grads.dtype == torch.float16 and recording.steps.tolist() == list(range(5))
    for step in range(5):
        torch.testing.assert_close(grads[0, step].float(), applied.grads[step][_NAMES[0]], rtol=2e-3, atol=1e-5)


def test_recorder_and_loader_reject_bad_input(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer, got 0"):
        GradientRecorder(str(tmp_path), every_n_steps=0)
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, bfloat16; got 'int8'"):
        GradientRecorder(str(tmp_path), dtype="int8")
    with pytest.raises(FileNotFoundError, match="no rank\\*.pt gradient recording"):
        load_recording(tmp_path)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recorded_gradients_are_each_workers_own_and_average_to_what_ddp_applies(tmp_path):
    recorder = GradientRecorder(str(tmp_path / "grads"), _NAMES)
    applied = _GradsAtStep(_NAMES, out_dir=str(tmp_path))
    _fit(tmp_path, [recorder, applied], devices=2, strategy="ddp_spawn")
    recording = load_recording(tmp_path / "grads")
    assert recording.world_size == 2 and recording.steps.tolist() == list(range(5))
    averaged = [torch.load(tmp_path / f"applied{rank}.pt") for rank in range(2)]
    for name in _NAMES:
        local = recording.gradients[name]
        assert not torch.allclose(local[0], local[1])  # different batches, different gradients
        for step in range(5):
            torch.testing.assert_close(averaged[0][step][name], averaged[1][step][name])
            torch.testing.assert_close(local[:, step].mean(dim=0), averaged[0][step][name], rtol=1e-4, atol=1e-6)


def test_the_recording_config_sets_the_partition_only_where_the_task_has_one(tmp_path):
    from omegaconf import OmegaConf

    from lgc.analysis import compose_recording_config

    cfg = compose_recording_config(tmp_path, partition="dirichlet", alpha=0.3, overrides=["data=fashion_mnist"])
    assert (cfg.data.partition, cfg.data.alpha) == ("dirichlet", 0.3)
    assert OmegaConf.to_container(cfg.callbacks.gradient_recorder.metadata, resolve=True)["partition"] == "dirichlet"
    # Segmentation (dense labels) has IID shards only: asking for another partition is refused, naming it.
    scenes = compose_recording_config(tmp_path, overrides=["data=fashion_scenes", "model=pspnet_small"])
    assert "partition" not in scenes.data
    metadata = OmegaConf.to_container(scenes.callbacks.gradient_recorder.metadata, resolve=True)
    assert (metadata["partition"], metadata["alpha"]) == ("iid", None)
    with pytest.raises(ValueError, match="partition='dirichlet': this task has no partition option"):
        compose_recording_config(tmp_path, partition="dirichlet", overrides=["data=fashion_scenes"])
