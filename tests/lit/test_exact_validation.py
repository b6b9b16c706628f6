"""Validation scores every sample of the set exactly once, whatever the number of workers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

from lgc.data import CLASS_IGNORE_INDEX, EvalShardSampler, PaddedEvalDataset, load_digits_split
from lgc.lit import ImageClassifier
from lgc.lit.segmentation import SemanticSegmenter
from lgc.models import resnet8
from lgc.train import train


@pytest.mark.parametrize("size", [1, 7, 10, 361])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_sample_is_read_once_and_every_rank_as_often_as_lightnings_sampler(size, world):
    dataset = range(size)
    shards = [list(EvalShardSampler(dataset, num_replicas=world, rank=rank)) for rank in range(world)]
    lightning = [list(DistributedSampler(dataset, world, rank, shuffle=False)) for rank in range(world)]
    # As many per rank as Lightning's own (so every rank runs as many batches), the same samples in
    # the same places, the repeated ones marked by an offset of the set's length.
    assert [len(s) for s in shards] == [len(s) for s in lightning] == [math.ceil(size / world)] * world
    assert [[i % size for i in s] for s in shards] == lightning
    real = sorted(i for s in shards for i in s if i < size)
    assert real == list(range(size))
    assert all(size <= i < 2 * size for s in shards for i in s if i >= size)


def test_a_padded_position_is_its_sample_with_every_target_ignored():
    images = torch.arange(12.0).reshape(3, 2, 2)
    labels = PaddedEvalDataset(TensorDataset(images, torch.tensor([4, 5, 6])), CLASS_IGNORE_INDEX)
    masks = PaddedEvalDataset(TensorDataset(images, torch.ones(3, 2, 2, dtype=torch.long)), 255)
    assert labels[1][1] == 5 and labels[4][1] == CLASS_IGNORE_INDEX and torch.equal(labels[4][0], images[1])
    assert isinstance(labels[4][1], torch.Tensor) and labels[4][1].dtype == torch.long  # batches with real ones
    assert PaddedEvalDataset([(images[0], 3)], CLASS_IGNORE_INDEX)[1][1] == CLASS_IGNORE_INDEX  # an int label
    assert torch.equal(masks[0][1], torch.ones(2, 2, dtype=torch.long))
    assert torch.equal(masks[5][1], torch.full((2, 2), 255)) and torch.equal(masks[5][0], images[2])
    with pytest.raises(IndexError, match="index 6 is outside the set of 3 samples"):
        labels[6]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_the_modules_score_padded_samples_nowhere():
    """Calling validation_step outside a trainer (self.log only warns): the metrics' states."""
    torch.manual_seed(0)
    classifier = ImageClassifier(resnet8(num_classes=10, in_channels=1), 10, _sgd).eval()
    images, labels = torch.randn(6, 1, 8, 8), torch.tensor([1, 2, 3, 4, CLASS_IGNORE_INDEX, CLASS_IGNORE_INDEX])
    with torch.no_grad(), pytest.warns(UserWarning, match="trainer"):
        classifier.validation_step((images[:3], labels[:3]), 0)
        classifier.validation_step((images[3:], labels[3:]), 1)
        logits = classifier(images[:4])
    assert classifier.val_loss.compute() == pytest.approx(F.cross_entropy(logits, labels[:4]).item(), rel=1e-6)
    expected = MulticlassAccuracy(10, average="micro")(logits, labels[:4])
    assert classifier.val_acc.compute() == pytest.approx(expected.item())

    model = torch.nn.Conv2d(1, 3, 1)
    segmenter = SemanticSegmenter(model, 3, _sgd, ignore_index=255)
    masks = torch.randint(0, 3, (3, 4, 4))
    masks[0, 0, :2] = 255  # void pixels of a real image
    padded = torch.full((1, 4, 4), 255)
    x = torch.randn(4, 1, 4, 4)
    with torch.no_grad(), pytest.warns(UserWarning, match="trainer"):
        segmenter.validation_step((x[:2], masks[:2]), 0)
        segmenter.validation_step((x[2:], torch.cat([masks[2:], padded])), 1)
        logits = model(x[:3])
    expected_loss = F.cross_entropy(logits, masks, ignore_index=255)  # the mean over labelled pixels
    assert segmenter.val_loss.compute() == pytest.approx(expected_loss.item(), rel=1e-6)
    miou = MulticlassJaccardIndex(3, average="macro", ignore_index=255)(logits.argmax(1), masks)
    assert segmenter.val_miou.compute() == pytest.approx(miou.item())


@pytest.mark.multiprocess
def test_three_workers_score_the_whole_set_once(tmp_path):
    """361 validation images on 3 workers: Lightning's sharding would score two of them twice.

    The run's val/acc and val/loss are those of its final model on the whole set in one process."""
    from test_train import compose_cfg

    val_fraction = 0.2005  # 361 of the 1,797 digits
    cfg = compose_cfg(
        tmp_path,
        "trainer.devices=3",
        "ddp.oversubscribe=true",
        "trainer.limit_val_batches=null",
        f"data.val_fraction={val_fraction}",
    )
    summary = train(cfg)
    _, val_set = load_digits_split(val_fraction, cfg.data.split_seed)
    assert len(val_set) == 361 and summary["world_size"] == 3
    state = torch.load(Path(tmp_path) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    net = resnet8(num_classes=10, in_channels=1)
    net.load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
    images, labels = val_set.tensors
    with torch.no_grad():
        logits = net.eval()(images)
    assert summary["val/acc"] == pytest.approx((logits.argmax(1) == labels).float().mean().item(), abs=1e-6)
    assert summary["val/loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_loss_mean_stays_float64_under_a_16_bit_true_precision_and_keeps_a_nan(dtype):
    """Lightning's 16-true and bf16-true convert the whole module, the metrics' sums too."""
    segmenter = SemanticSegmenter(torch.nn.Conv2d(1, 3, 1), 3, _sgd, ignore_index=255).to(dtype=dtype)
    assert segmenter.val_loss.total.dtype == dtype
    segmenter.on_validation_start()
    for _ in range(300):  # bf16 sums stop growing at 256; fp16 weights overflow at 65,504 pixels
        segmenter.val_loss.update(torch.tensor(0.37, dtype=dtype), weight=torch.tensor(70_000))
    assert segmenter.val_loss.compute().item() == pytest.approx(torch.tensor(0.37, dtype=dtype).item(), rel=1e-6)
    classifier = ImageClassifier(resnet8(num_classes=10, in_channels=1), 10, _sgd).to(dtype=dtype)
    classifier.on_validation_start()
    classifier.val_loss.update(torch.tensor([1.0, float("nan")]))
    assert classifier.val_loss.total.dtype == torch.float64 and classifier.val_loss.compute().isnan()
