"""Fashion scenes: garments of real-format Fashion-MNIST files composed into labelled canvases; the
segmentation run end to end (PSPNet, val/mIoU); bad settings refused before any worker starts."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from torchvision.datasets import FashionMNIST

from lgc.data.fashion_mnist import DEBIAN_FOLDER, FASHION_MNIST_FILES, FASHION_MNIST_MEAN, FASHION_MNIST_STD
from lgc.data.fashion_scenes import FASHION_SCENE_CLASSES, GARMENT_SIZE
from lgc.lit import FashionScenesDataModule
from lgc.train import _prepare, train

#: Training garments are all 200 inside a square, test garments all 100: a pixel tells its split.
TRAIN_VALUE, TEST_VALUE = 200, 100


def _idx(array: np.ndarray, magic: int) -> bytes:
    return struct.pack(f">i{array.ndim}i", magic, *array.shape) + array.astype(np.uint8).tobytes()


def write_garments(folder: Path, train: int = 40, test: int = 20) -> dict[str, np.ndarray]:
    """Real-format IDX files whose garments are bright squares (rows 4-23, columns 6-21) on black;
    training labels 0-4, test labels 5-9."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, count, value, classes in (("train", train, TRAIN_VALUE, (0, 5)), ("t10k", test, TEST_VALUE, (5, 10))):
        images = np.zeros((count, GARMENT_SIZE, GARMENT_SIZE), np.uint8)
        images[:, 4:24, 6:22] = value
        arrays[f"{split}-images-idx3-ubyte"] = images
        arrays[f"{split}-labels-idx1-ubyte"] = np.arange(count) % (classes[1] - classes[0]) + classes[0]
    for name, array in arrays.items():
        (folder / f"{name}.gz").write_bytes(gzip.compress(_idx(array, FASHION_MNIST_FILES[name][0])))
    return arrays


def scenes_module(tmp_path: Path, **kwargs) -> FashionScenesDataModule:
    write_garments(tmp_path / "src")
    settings = {"train_scenes": 30, "val_scenes": 10, "scale": (1.0, 1.0), **kwargs}
    module = FashionScenesDataModule(str(tmp_path / "src"), cache=str(tmp_path / "cache"), **settings)
    module.setup("fit")
    return module


def test_every_pixel_is_labelled_with_the_garment_on_top_or_background(tmp_path):
    module = scenes_module(tmp_path, scale=(0.75, 1.5), garments=(2, 4))
    scenes = module.train_set
    for index in range(len(scenes)):
        canvas, mask = scenes.compose(index)
        # The rule, written out: paint each garment's shape in turn, the later ones on top.
        expected = torch.zeros_like(mask)
        layout = scenes.layout(index)
        assert 2 <= len(layout) <= 4
        for garment, side, top, left in layout:
            assert 21 <= side <= 42 and 0 <= top <= 64 - side and 0 <= left <= 64 - side
            pixels = torch.nn.functional.interpolate(
                scenes.images[garment].float()[None, None] / 255, size=(side, side), mode="bilinear", antialias=True
            )[0, 0]
            region = expected[top : top + side, left : left + side]
            region[pixels > scenes.threshold] = int(scenes.labels[garment]) + 1
        assert torch.equal(mask, expected)
        # Labelled pixels are bright, background is black.
        assert (canvas[mask == 0] == 0).all() and (canvas[mask > 0] > scenes.threshold).all()


def test_splits_never_share_a_garment_and_labels_follow_fashion_mnist(tmp_path):
    module = scenes_module(tmp_path)
    for split, value, labels in (("train", TRAIN_VALUE, range(1, 6)), ("val", TEST_VALUE, range(6, 11))):
        dataset = module.train_set if split == "train" else module.val_set
        values, seen = set(), set()
        for index in range(len(dataset)):
            canvas, mask = dataset.compose(index)
            values |= set((canvas * 255).round().int().unique().tolist())
            seen |= set(mask.unique().tolist())
        assert values == {0, value}  # scale 1: the squares' own pixels, nothing from the other split
        assert seen - {0} <= set(labels) and len(seen - {0}) >= 3
    assert module.num_classes == len(FASHION_SCENE_CLASSES) == 11 and module.in_channels == 1


def test_scenes_are_fixed_by_their_seed_whatever_the_order_they_are_read_in(tmp_path):
    module = scenes_module(tmp_path)
    scenes = module.train_set
    forward = [scenes[i] for i in range(len(scenes))]
    backward = [scenes[i] for i in reversed(range(len(scenes)))][::-1]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(forward, backward, strict=True))
    again = scenes_module(tmp_path / "again")
    assert all(torch.equal(again.train_set[i][1], forward[i][1]) for i in range(len(scenes)))
    other = scenes_module(tmp_path / "other", seed=1)
    assert not all(torch.equal(other.train_set[i][1], forward[i][1]) for i in range(len(scenes)))
    # Train and validation scenes of one seed are drawn apart (not the same layouts).
    assert [scenes.layout(i)[0][1:] for i in range(10)] != [module.val_set.layout(i)[0][1:] for i in range(10)]
    image, mask = forward[0]
    assert image.shape == (1, 64, 64) and mask.shape == (64, 64) and mask.dtype == torch.int64
    canvas, _ = scenes.compose(0)
    torch.testing.assert_close(image[0], (canvas - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0])


def test_workers_get_disjoint_shards_of_the_training_scenes(tmp_path):
    module = scenes_module(tmp_path)
    from lgc.data import PartitionSampler

    shards = [set(PartitionSampler(module.train_set, num_replicas=2, rank=rank)) for rank in range(2)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 30


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.scale=[0.5,2.5]", r"scale's largest factor 2.5 makes a garment 70 pixels wide, more than the canvas"),
        ("data.scale=[1.5,1.0]", r"scale must satisfy 0 < smallest <= largest, got \[1.5, 1.0\]"),
        ("data.garments=[0,3]", r"garments must satisfy 1 <= fewest <= most, got \[0, 3\]"),
        ("data.garments=[2]", r"garments must be two integers"),
        ("data.threshold=1.5", r"threshold must be a number in \[0, 1\), got 1.5"),
        ("data.val_scenes=0", r"data.val_scenes=0 must be a positive integer"),
        ("data.size=16", r"makes a garment 42 pixels wide, more than the canvas \(size=16\)"),
    ],
)
def test_bad_settings_are_refused_before_any_worker_starts(tmp_path, monkeypatch, override, message):
    write_garments(tmp_path / "src")
    monkeypatch.setenv("FASHION_MNIST_ROOT", str(tmp_path / "src"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["data=fashion_scenes", "model=pspnet_small", "logger=none", f"output_dir={tmp_path}", override],
        )
    with pytest.raises(ValueError, match=message):
        _prepare(cfg)


def test_a_missing_dataset_names_the_debian_package(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"apt-get install dataset-fashion-mnist"):
        FashionScenesDataModule(str(tmp_path / "nothing"))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        pytest.param("fsdp", marks=pytest.mark.slow),
        # 2 replicas of 2 workers: FSDP2 inside a replica, top-k across the replicas.
        pytest.param("hsdp", marks=pytest.mark.slow),
    ],
)
def test_pspnet_trains_on_the_scenes_and_a_run_stopped_mid_epoch_is_validated(tmp_path, monkeypatch, strategy):
    write_garments(tmp_path / "src", train=64, test=16)
    monkeypatch.setenv("FASHION_MNIST_ROOT", str(tmp_path / "src"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    steps = 5  # of epochs of 8 batches per worker (4 under hsdp's 4 workers): stopped mid-epoch by max_steps
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "data=fashion_scenes",
                "data.train_scenes=64",
                "data.val_scenes=16",
                "data.batch_size=4",
                "model=pspnet_small",
                f"trainer.devices={4 if strategy == 'hsdp' else 2}",
                *(["strategy.shard_size=2", "ddp.oversubscribe=true"] if strategy == "hsdp" else []),
                f"trainer.max_steps={steps}",
                "trainer.max_epochs=-1",
                "scheduler=cosine_steps",
                "compressor=topk",
                "logger=csv",
                "trainer.enable_progress_bar=false",
                "ddp.start_method=fork",
                f"strategy={strategy}",
                f"output_dir={tmp_path / 'run'}",
            ],
        )
    summary = train(cfg)
    assert summary["steps"] == steps
    assert 0 <= summary["val/mIoU"] <= 1 and 0 <= summary["val/pixel_acc"] <= 1
    assert summary["compression_ratio"] > 2, "top-k compressed what crossed the wire"
    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    metrics = (tmp_path / "run" / "csv" / "version_0" / "metrics.csv").read_text()
    assert "val/mIoU" in metrics.splitlines()[0]


@pytest.mark.skipif(not DEBIAN_FOLDER.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_the_real_scenes_use_every_class_and_keep_the_splits_apart(tmp_path):
    module = FashionScenesDataModule(cache=str(tmp_path / "cache"))
    module.setup("fit")
    assert (len(module.train_set), len(module.val_set)) == (20_000, 5_000)
    test_images = FashionMNIST(module.root, train=False).data
    assert torch.equal(module.val_set.images, test_images)
    counts = torch.zeros(11)
    for index in range(500):
        _, mask = module.val_set[index]
        counts += torch.bincount(mask.flatten(), minlength=11)
    share = counts / counts.sum()
    # Background is most of the canvas; every garment class covers a share of it.
    assert 0.6 < share[0] < 0.85 and (share[1:] > 0.005).all()
