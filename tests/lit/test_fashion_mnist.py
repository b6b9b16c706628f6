"""Fashion-MNIST: found offline, decompressed for torchvision's own FashionMNIST, checked; small IDX fixtures."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from torchvision.datasets import FashionMNIST

from lgc.data.fashion_mnist import DEBIAN_FOLDER, FASHION_MNIST_FILES, FASHION_MNIST_MEAN, prepare_fashion_mnist
from lgc.lit import FashionMNISTDataModule

COUNTS = {"train": 64, "t10k": 16}


def _idx(array: np.ndarray, magic: int) -> bytes:
    return struct.pack(f">i{array.ndim}i", magic, *array.shape) + array.astype(np.uint8).tobytes()


def write_fashion_mnist(folder: Path, *, gz: bool = True, counts: dict[str, int] = COUNTS) -> dict[str, np.ndarray]:
    """The four files in the real IDX format (random pixels, labels 0-9), as Debian ships them when ``gz``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, count in counts.items():
        arrays[f"{split}-images-idx3-ubyte"] = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        arrays[f"{split}-labels-idx1-ubyte"] = rng.integers(0, 10, count, dtype=np.uint8)
    for name, array in arrays.items():
        data = _idx(array, FASHION_MNIST_FILES[name][0])
        (folder / f"{name}.gz").write_bytes(gzip.compress(data)) if gz else (folder / name).write_bytes(data)
    return arrays


def test_gzipped_files_are_decompressed_into_the_cache_and_read_by_torchvision(tmp_path):
    arrays = write_fashion_mnist(tmp_path / "debian")
    root = prepare_fashion_mnist(tmp_path / "debian", tmp_path / "cache")
    assert root == tmp_path / "cache" and not (tmp_path / "debian" / "FashionMNIST").exists()
    train, test = FashionMNIST(str(root), train=True), FashionMNIST(str(root), train=False)
    assert torch.equal(train.data, torch.from_numpy(arrays["train-images-idx3-ubyte"]))
    assert torch.equal(train.targets, torch.from_numpy(arrays["train-labels-idx1-ubyte"]).long())
    assert len(test) == 16


def test_a_file_decompressed_before_from_the_same_source_is_reused_and_a_changed_one_is_not(tmp_path):
    write_fashion_mnist(tmp_path / "src")
    root = prepare_fashion_mnist(tmp_path / "src", tmp_path / "cache")
    raw = root / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte"
    first = raw.stat().st_mtime_ns
    prepare_fashion_mnist(tmp_path / "src", tmp_path / "cache")
    assert raw.stat().st_mtime_ns == first
    arrays = write_fashion_mnist(tmp_path / "src", counts={"train": 32, "t10k": 8})
    prepare_fashion_mnist(tmp_path / "src", tmp_path / "cache")
    assert np.array_equal(np.frombuffer(raw.read_bytes()[8:], np.uint8), arrays["train-labels-idx1-ubyte"])


def test_torchvisions_own_layout_is_used_where_it_is(tmp_path):
    write_fashion_mnist(tmp_path / "root" / "FashionMNIST" / "raw", gz=False)
    assert prepare_fashion_mnist(tmp_path / "root", tmp_path / "cache") == tmp_path / "root"
    assert not (tmp_path / "cache").exists()
    # Plain (not gzipped) files in the folder itself are laid out in the cache.
    write_fashion_mnist(tmp_path / "plain", gz=False)
    assert len(FashionMNIST(str(prepare_fashion_mnist(tmp_path / "plain", tmp_path / "c2")), train=False)) == 16


def test_a_missing_dataset_says_how_to_get_it(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"apt-get install dataset-fashion-mnist.*data.download=true"):
        prepare_fashion_mnist(tmp_path / "none")
    (tmp_path / "partial").mkdir()
    write_fashion_mnist(tmp_path / "partial")
    (tmp_path / "partial" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"file t10k-labels-idx1-ubyte\(.gz\) is not in .*partial"):
        prepare_fashion_mnist(tmp_path / "partial")
    monkeypatch.setattr("lgc.data.fashion_mnist.DEBIAN_FOLDER", tmp_path / "no-package")
    with pytest.raises(FileNotFoundError, match=r"no-package does not exist\): install it with `apt-get"):
        prepare_fashion_mnist(None)


def test_files_that_are_not_fashion_mnist_are_refused_by_name(tmp_path):
    write_fashion_mnist(tmp_path / "bad")
    (tmp_path / "bad" / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(np.zeros(63), 2049)))
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte.gz' holds 63 entries, expected 64"):
        prepare_fashion_mnist(tmp_path / "bad", tmp_path / "cache")
    write_fashion_mnist(tmp_path / "bad2")
    (tmp_path / "bad2" / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(np.zeros((16, 32, 32)), 2051)))
    with pytest.raises(ValueError, match=r"is not Fashion-MNIST's t10k-images-idx3-ubyte: IDX magic 2051 and shape"):
        prepare_fashion_mnist(tmp_path / "bad2", tmp_path / "cache")


def test_the_data_module_partitions_normalises_and_augments_like_the_others(tmp_path):
    arrays = write_fashion_mnist(tmp_path / "src")
    module = FashionMNISTDataModule(str(tmp_path / "src"), batch_size=8, cache=str(tmp_path / "cache"))
    module.setup("fit")
    image, label = module.train_set[3]
    assert image.shape == (1, 28, 28) and label == int(arrays["train-labels-idx1-ubyte"][3])
    expected = (arrays["train-images-idx3-ubyte"][3] / 255.0 - FASHION_MNIST_MEAN[0]) / 0.3530
    torch.testing.assert_close(image[0], torch.from_numpy(expected).float(), rtol=0, atol=1e-6)
    shards = [set(module.train_sampler(num_replicas=2, rank=rank)) for rank in range(2)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 64
    skewed = FashionMNISTDataModule(str(tmp_path / "src"), partition="dirichlet", alpha=0.5, cache=str(tmp_path / "c"))
    skewed.setup("fit")
    assert len(list(skewed.train_sampler(num_replicas=2, rank=0))) > 0
    augmenting = FashionMNISTDataModule(str(tmp_path / "src"), augment=True, cache=str(tmp_path / "cache"))
    augmenting.setup("fit")
    assert augmenting.augments and len({augmenting.train_set[0][0].sum().item() for _ in range(8)}) > 1


def test_lgc_train_composes_it_with_the_root_from_the_environment(tmp_path, monkeypatch):
    write_fashion_mnist(tmp_path / "src")
    monkeypatch.setenv("FASHION_MNIST_ROOT", str(tmp_path / "src"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=["data=fashion_mnist", "logger=none"])
    import hydra

    module = hydra.utils.instantiate(cfg.data)
    assert module.root == str(tmp_path / "xdg" / "lgc" / "fashion_mnist")
    assert (module.num_classes, module.in_channels, module.batch_size, module.augment) == (10, 1, 64, False)


@pytest.mark.skipif(not DEBIAN_FOLDER.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_the_real_files_hold_60000_and_10000_images_with_the_documented_statistics(tmp_path):
    root = prepare_fashion_mnist(None, tmp_path / "cache")
    train, test = FashionMNIST(str(root), train=True), FashionMNIST(str(root), train=False)
    assert (len(train), len(test)) == (60000, 10000)
    pixels = train.data.double() / 255
    assert (round(pixels.mean().item(), 4), round(pixels.std().item(), 3)) == (0.2860, 0.353)
    assert torch.bincount(test.targets).tolist() == [1000] * 10
