"""Data modules on tiny fixtures in the real on-disk formats, worker partitions and their sampler."""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from fixtures import (
    CAMVID_SIZE,
    CIFAR_NAMES,
    CIFAR_PER_BATCH,
    IMAGENET_COLORS,
    PALETTE,
    cifar_checksums,
    cifar_image,
    write_camvid,
    write_cifar10,
    write_imagenet,
)
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

import lgc.lit.data
from lgc.data import (
    CAMVID_IGNORE_INDEX,
    CamVidDataset,
    PartitionSampler,
    dataset_labels,
    dirichlet_partition,
    iid_partition,
    label_histogram,
    resample_to_length,
)
from lgc.data.camvid import camvid_eval_transform, camvid_train_transform
from lgc.data.imagenet import IMAGENET_MEAN, IMAGENET_STD
from lgc.lit.data import CamVidDataModule, CIFAR10DataModule, DigitsDataModule, ImageNetDataModule

# ----------------------------------------------------------------------------------------------
# CIFAR-10


@pytest.fixture
def cifar10_root(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    root = write_cifar10(tmp_path / "cifar10")
    # torchvision verifies each file's MD5: give it the fixture's checksums (the check still runs).
    md5 = cifar_checksums(root)
    monkeypatch.setattr(CIFAR10, "train_list", [[name, md5[name]] for name in CIFAR_NAMES[:5]])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5["batches.meta"]})
    return root


def test_cifar10_fixture_has_the_real_pickle_layout(cifar10_root):
    with open(cifar10_root / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        entry = pickle.load(f, encoding="bytes")
    assert {b"data", b"labels"} <= entry.keys()
    assert entry[b"data"].dtype == np.uint8 and entry[b"data"].shape == (CIFAR_PER_BATCH, 3072)


def test_cifar10_loads_through_torchvision_with_checksums(cifar10_root):
    from lgc.data.cifar10 import CIFAR10_MEAN, CIFAR10_STD

    module = CIFAR10DataModule(str(cifar10_root), batch_size=4, augment=False, num_workers=0)
    assert (module.num_classes, module.in_channels, module.task) == (10, 3, "classification")
    module.setup("fit")
    assert len(module.train_set) == 5 * CIFAR_PER_BATCH and len(module.val_set) == CIFAR_PER_BATCH
    image, label = module.train_set[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 3
    # The R, G, B planes come back as the channels (CHW), normalized.
    mean, std = torch.tensor(CIFAR10_MEAN)[:, None, None], torch.tensor(CIFAR10_STD)[:, None, None]
    expected = torch.from_numpy(cifar_image(3).reshape(3, 32, 32).astype(np.float32) / 255)
    torch.testing.assert_close(image * std + mean, expected, atol=1e-5, rtol=0)
    assert dataset_labels(module.train_set).tolist() == [i % 10 for i in range(5 * CIFAR_PER_BATCH)]


def test_cifar10_augmentation_pads_4_pixels_and_crops_32(cifar10_root):
    module = CIFAR10DataModule(str(cifar10_root), batch_size=4, augment=True, num_workers=0)
    module.setup("fit")
    torch.manual_seed(0)
    padded_rows = []
    for _ in range(30):
        image, _ = module.train_set[5]
        assert image.shape == (3, 32, 32)
        # Padding is black: a pixel whose three channels all differ from the (constant) image.
        unnormalized = image * torch.tensor([0.2470, 0.2435, 0.2616])[:, None, None]
        unnormalized += torch.tensor([0.4914, 0.4822, 0.4465])[:, None, None]
        is_pad = (unnormalized.abs() < 1e-5).all(dim=0)
        padded_rows.append(int(is_pad.all(dim=1).sum()))
        assert int(is_pad.all(dim=0).sum()) <= 4 and int(is_pad.all(dim=1).sum()) <= 4
    assert max(padded_rows) > 0  # some crops reach into the padding


def _batches(loader, count=None):
    batches = []
    for images, labels in loader:
        batches.append((images, labels))
        if count is not None and len(batches) == count:
            break
    return batches


def test_augmented_batches_do_not_depend_on_the_loading_process_and_resume_mid_epoch(cifar10_root):
    """The training loader's augmentation is seeded by each sample's place in training."""
    module = CIFAR10DataModule(str(cifar10_root), batch_size=4, augment=True, num_workers=0)
    module.setup("fit")

    def loader(num_workers: int, epoch: int = 1):
        sampler = module.train_sampler(num_replicas=2, rank=1)
        made = lgc.lit.data._resumable_loader(module.train_set, sampler, 4, num_workers)
        sampler.set_epoch(epoch)
        return made

    torch.manual_seed(0)
    straight = _batches(loader(0))
    torch.manual_seed(1)  # another state of the training process's generator: same batches
    assert all(torch.equal(a[0], b[0]) for a, b in zip(straight, _batches(loader(0)), strict=True))
    in_workers = _batches(loader(2))  # DataLoader workers, reseeded by their own rules: same batches
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(straight, in_workers, strict=True))
    assert not torch.equal(_batches(loader(0, epoch=2))[0][0], straight[0][0])  # a new epoch, new crops

    # Stopped after 2 batches and restored in a loader built afresh: the remaining batches are identical.
    first = loader(0)
    _batches(first, count=2)
    state = first.state_dict()
    resumed = loader(0, epoch=0)
    resumed.load_state_dict(state)
    rest = _batches(resumed)
    assert len(rest) == len(straight) - 2
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(straight[2:], rest, strict=True))


def test_cifar10_missing_files_are_named(tmp_path, cifar10_root):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CIFAR10DataModule(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        CIFAR10DataModule(str(tmp_path))
    (cifar10_root / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        CIFAR10DataModule(str(cifar10_root))


def test_cifar10_corrupted_file_is_refused_by_the_checksum(cifar10_root):
    module = CIFAR10DataModule(str(cifar10_root), num_workers=0)
    with open(cifar10_root / "cifar-10-batches-py" / "data_batch_2", "ab") as f:
        f.write(b"junk")
    with pytest.raises(RuntimeError, match="corrupted"):
        module.setup("fit")


# ----------------------------------------------------------------------------------------------
# ImageNet: an ImageFolder tree of small JPEGs.


@pytest.fixture
def imagenet_root(tmp_path):
    return write_imagenet(tmp_path / "imagenet")


def test_imagenet_reads_the_image_folder_tree(imagenet_root):
    module = ImageNetDataModule(
        str(imagenet_root), batch_size=2, train_crop_size=16, val_resize_size=20, val_crop_size=16, num_workers=0
    )
    assert (module.num_classes, module.in_channels, module.task) == (3, 3, "classification")
    module.setup("fit")
    assert len(module.train_set) == 9 and len(module.val_set) == 6
    assert sorted(set(dataset_labels(module.train_set).tolist())) == [0, 1, 2]
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    for dataset in (module.train_set, module.val_set):
        for index in range(len(dataset)):
            image, label = dataset[index]
            assert image.shape == (3, 16, 16) and image.dtype == torch.float32
            # The label is the sorted folder's index: its colour is the image's colour.
            color = torch.tensor(list(IMAGENET_COLORS.values())[label], dtype=torch.float32) / 255
            torch.testing.assert_close((image * std + mean).mean(dim=(1, 2)), color, atol=0.05, rtol=0)
    images, labels = next(iter(module.val_dataloader()))
    assert images.shape == (2, 3, 16, 16) and labels.dtype == torch.int64


def test_imagenet_bad_layouts_are_named(imagenet_root, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ImageNetDataModule(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="num_classes=1000 but .* holds 3 classes"):
        ImageNetDataModule(str(imagenet_root), num_classes=1000)
    extra = imagenet_root / "val" / "n99999999"
    extra.mkdir()
    with pytest.raises(ValueError, match="only in val: \\['n99999999'\\]"):
        ImageNetDataModule(str(imagenet_root))
    extra.rmdir()
    for path in (imagenet_root / "val").rglob("*.JPEG"):
        path.unlink()
    for folder in list((imagenet_root / "val").iterdir()):
        folder.rmdir()
    with pytest.raises(FileNotFoundError, match="holds no class folders"):
        ImageNetDataModule(str(imagenet_root))
    (imagenet_root / "val").rmdir()
    with pytest.raises(FileNotFoundError, match=r"imagenet/val' does not exist"):
        ImageNetDataModule(str(imagenet_root))


# ----------------------------------------------------------------------------------------------
# CamVid: SegNet's layout of PNG frames and one-byte label maps, void pixels included.


@pytest.fixture
def camvid_root(tmp_path):
    return write_camvid(tmp_path / "camvid")


def _unnormalize(image: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    return image * std + mean


def test_camvid_module_reads_frames_and_label_maps(camvid_root):
    module = CamVidDataModule(str(camvid_root), batch_size=2, crop_size=(16, 16), base_size=24, num_workers=0)
    assert (module.num_classes, module.in_channels, module.ignore_index, module.task) == (11, 3, 11, "segmentation")
    module.setup("fit")
    assert (len(module.train_set), len(module.val_set), len(module.test_set)) == (3, 2, 2)
    image, mask = module.val_set[1]
    assert image.shape == (3, *CAMVID_SIZE) and image.dtype == torch.float32
    assert mask.shape == CAMVID_SIZE and mask.dtype == torch.int64
    stored = np.array(Image.open(sorted((camvid_root / "valannot").glob("*.png"))[1]))
    assert torch.equal(mask, torch.from_numpy(stored).long())
    assert int(mask[0, 0]) == CAMVID_IGNORE_INDEX and int(mask.max()) <= CAMVID_IGNORE_INDEX
    color = torch.from_numpy(PALETTE[stored]).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(_unnormalize(image), color, atol=1e-5, rtol=0)
    images, masks = next(iter(module.train_dataloader()))
    assert images.shape == (2, 3, 16, 16) and masks.shape == (2, 16, 16) and masks.dtype == torch.int64


def test_camvid_joint_transform_keeps_image_and_mask_aligned(camvid_root):
    dataset = CamVidDataset(camvid_root, "train", camvid_train_transform((20, 20), (0.5, 2.0), base_size=24))
    palette = torch.from_numpy(PALETTE).float() / 255
    torch.manual_seed(0)
    looks, padded, agreements = set(), 0, []
    for step in range(24):
        image, mask = dataset[step % len(dataset)]
        assert image.shape == (3, 20, 20) and mask.shape == (20, 20) and mask.dtype == torch.int64
        # Nearest-neighbour resizing never invents labels.
        assert set(mask.unique().tolist()) <= set(range(12))
        # The colour of each pixel is its label's colour (or black padding where the mask is void);
        # only pixels next to a block edge may be blended by the image's bilinear resize.
        nearest = (_unnormalize(image).permute(1, 2, 0)[:, :, None, :] - palette).norm(dim=-1).argmin(dim=-1)
        agreements.append((nearest == mask).float().mean().item())
        looks.add(float(image.std()))
        padded += int((mask == CAMVID_IGNORE_INDEX).sum())
    # Aligned: 0.79-1.0 per crop, about 0.9 on average (2,000 crops); with the mask flipped or
    # shifted against the image instead: about 0.57 on average.
    assert min(agreements) > 0.75 and sum(agreements) / len(agreements) > 0.85, agreements
    assert len(looks) > 5  # the random transform really varied
    assert padded > 0


def test_camvid_flip_moves_image_and_mask_together(camvid_root):
    from torchvision.transforms import v2

    from lgc.data.camvid import _to_normalized_tensor

    flip = v2.Compose([v2.RandomHorizontalFlip(p=1.0), *_to_normalized_tensor()])
    plain, flipped = CamVidDataset(camvid_root, "val", camvid_eval_transform()), CamVidDataset(camvid_root, "val", flip)
    (image, mask), (image_f, mask_f) = plain[0], flipped[0]
    assert torch.equal(mask_f, mask.flip(-1)) and torch.equal(image_f, image.flip(-1))


def test_camvid_padding_uses_the_ignore_index(camvid_root):
    # Scale 0.5 of a 24-pixel shorter side: a 12x16 frame in a 20x20 crop, the rest padded.
    dataset = CamVidDataset(camvid_root, "train", camvid_train_transform((20, 20), (0.5, 0.5), base_size=24))
    image, mask = dataset[0]
    outside = mask == CAMVID_IGNORE_INDEX
    assert int(outside.sum()) >= 20 * 20 - 12 * 16
    black = (_unnormalize(image).abs() < 1e-5).all(dim=0)
    assert int((black & outside).sum()) >= 20 * 20 - 12 * 16


def test_camvid_bad_layouts_are_named(camvid_root, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        CamVidDataModule(str(tmp_path / "nowhere"))
    extra = camvid_root / "val" / "0001TP_999999.png"
    Image.new("RGB", (32, 24)).save(extra)
    with pytest.raises(ValueError, match=r"no label map for \['0001TP_999999.png'\]"):
        CamVidDataModule(str(camvid_root))
    extra.unlink()
    rgb_label = camvid_root / "testannot" / "0001TP_000000.png"
    Image.new("RGB", (32, 24)).save(rgb_label)
    with pytest.raises(ValueError, match="0001TP_000000.png' has PIL mode 'RGB'"):
        CamVidDataset(camvid_root, "test")[0]
    Image.fromarray(np.full(CAMVID_SIZE, 40, dtype=np.uint8), mode="L").save(rgb_label)
    with pytest.raises(ValueError, match="holds label 40"):
        CamVidDataset(camvid_root, "test")[0]
    for path in (camvid_root / "testannot").iterdir():
        path.unlink()
    (camvid_root / "testannot").rmdir()
    with pytest.raises(FileNotFoundError, match="testannot' does not exist"):
        CamVidDataModule(str(camvid_root))


# ----------------------------------------------------------------------------------------------
# Partitions (pure functions).


def _skewed_labels(num_classes: int = 10, per_class: int = 200) -> np.ndarray:
    return np.random.default_rng(0).permutation(np.repeat(np.arange(num_classes), per_class))


def test_iid_shards_are_disjoint_and_cover_everything():
    shards = iid_partition(1001, 4, seed=3)
    assert sorted(len(s) for s in shards) == [250, 250, 250, 251]
    merged = np.concatenate(shards)
    assert len(merged) == 1001 and set(merged.tolist()) == set(range(1001))
    assert all(np.array_equal(a, b) for a, b in zip(shards, iid_partition(1001, 4, seed=3), strict=True))
    assert not np.array_equal(shards[0], iid_partition(1001, 4, seed=4)[0])


def test_iid_shards_are_what_distributed_sampler_deals_out():
    from torch.utils.data import DistributedSampler

    dataset = range(1000)
    for rank in range(4):
        sampler = DistributedSampler(dataset, num_replicas=4, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(2)
        assert list(sampler) == iid_partition(1000, 4, seed=7 + 2)[rank].tolist()


def test_dirichlet_shards_are_disjoint_cover_everything_and_are_deterministic():
    labels = _skewed_labels()
    shards = dirichlet_partition(labels, 5, alpha=0.5, seed=1)
    merged = np.concatenate(shards)
    assert len(merged) == len(labels) and set(merged.tolist()) == set(range(len(labels)))
    again = dirichlet_partition(labels.tolist(), 5, alpha=0.5, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))
    other = dirichlet_partition(labels, 5, alpha=0.5, seed=2)
    assert not all(np.array_equal(a, b) for a, b in zip(shards, other, strict=True))


def _dominant_share(labels: np.ndarray, shards: list[np.ndarray], top: int) -> float:
    """Mean over workers of the share of a worker's samples in its ``top`` largest classes."""
    histogram = label_histogram(labels, shards, 10)
    return float(np.mean(np.sort(histogram, axis=1)[:, -top:].sum(axis=1) / histogram.sum(axis=1)))


def test_dirichlet_small_alpha_skews_labels_and_large_alpha_does_not():
    labels = _skewed_labels()
    skewed = dirichlet_partition(labels, 4, alpha=0.1, seed=0)
    uniform = dirichlet_partition(labels, 4, alpha=1000.0, seed=0)
    # alpha=0.1: most of each worker's data is one or two classes (0.62-0.78 over 30 seeds); alpha=1000: 2/10.
    assert _dominant_share(labels, skewed, top=2) > 0.55
    assert _dominant_share(labels, uniform, top=2) < 0.25
    histogram = label_histogram(labels, uniform, 10)
    assert np.abs(histogram / histogram.sum(axis=1, keepdims=True) - 0.1).max() < 0.03


def test_dirichlet_redraws_until_every_worker_has_data_or_says_why():
    labels = np.repeat(np.arange(2), 5)
    shards = dirichlet_partition(labels, 4, alpha=0.05, seed=0, min_size=1)
    assert min(len(s) for s in shards) >= 1
    with pytest.raises(ValueError, match="use a larger alpha"):
        dirichlet_partition(labels, 4, alpha=0.01, seed=0, min_size=2, max_draws=3)
    with pytest.raises(ValueError, match="cannot give 4 workers 3 sample"):
        dirichlet_partition(labels, 4, alpha=1.0, seed=0, min_size=3)


@pytest.mark.parametrize(
    "partition,alpha,message",
    [
        ("noniid", 1.0, "partition must be one of iid, dirichlet; got 'noniid'"),
        ("dirichlet", 0.0, "alpha must be a positive finite number, got 0.0"),
        ("dirichlet", -1.0, "got -1.0"),
        ("dirichlet", float("inf"), "got inf"),
    ],
)
def test_bad_partition_knobs_are_named(partition, alpha, message):
    with pytest.raises(ValueError, match=message):
        DigitsDataModule(partition=partition, alpha=alpha)
    with pytest.raises(ValueError, match=message):
        PartitionSampler(range(10), labels=[0] * 10, partition=partition, alpha=alpha, num_replicas=1, rank=0)


def test_resample_to_length_subsamples_or_cycles_evenly():
    rng = np.random.default_rng(0)
    subset = resample_to_length(np.arange(100), 30, rng)
    assert len(subset) == 30 and len(set(subset.tolist())) == 30
    cycled = resample_to_length(np.arange(7), 30, rng)
    counts = np.bincount(cycled, minlength=7)
    assert len(cycled) == 30 and counts.min() == 4 and counts.max() == 5


# ----------------------------------------------------------------------------------------------
# The sampler and the data modules.


def test_sampler_gives_every_rank_the_same_number_of_steps():
    labels = _skewed_labels()
    dataset = TensorDataset(torch.zeros(len(labels), 1), torch.from_numpy(labels))
    samplers = [
        PartitionSampler(dataset, labels, partition="dirichlet", alpha=0.1, num_replicas=4, rank=r) for r in range(4)
    ]
    assert len(set(samplers[0].shard_sizes)) == 4  # the shards really differ in size
    shards = dirichlet_partition(labels, 4, alpha=0.1, seed=0)
    lengths = set()
    for rank, sampler in enumerate(samplers):
        loader = DataLoader(dataset, batch_size=32, sampler=sampler, drop_last=True)
        lengths.add(len(loader))
        indices = sampler.indices(0)
        assert len(indices) == 500 and set(indices.tolist()) <= set(shards[rank].tolist())
        assert len(list(loader)) == len(loader)
    assert lengths == {500 // 32}


def test_sampler_reshuffles_every_epoch_and_repeats_an_epoch_exactly():
    sampler = PartitionSampler(range(100), partition="iid", seed=5, num_replicas=2, rank=1)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second and len(first) == len(second) == 50
    sampler.set_epoch(0)
    assert list(sampler) == first
    labels = np.arange(100) % 10
    dirichlet = PartitionSampler(range(100), labels, partition="dirichlet", alpha=0.5, num_replicas=2, rank=0)
    epoch0 = list(dirichlet)
    dirichlet.set_epoch(1)
    assert list(dirichlet) != epoch0 and set(dirichlet) <= set(dirichlet.shard.tolist())


def test_iid_sampler_covers_the_dataset_across_ranks_each_epoch():
    for epoch in range(2):
        seen = []
        for rank in range(3):
            sampler = PartitionSampler(range(99), num_replicas=3, rank=rank, seed=1)
            sampler.set_epoch(epoch)
            seen += list(sampler)
        assert sorted(seen) == list(range(99))


def test_digits_partition_knobs_reach_the_sampler():
    module = DigitsDataModule(partition="dirichlet", alpha=0.1, partition_seed=3)
    assert module.task == "classification"
    module.setup("fit")
    loader = module.train_dataloader()
    sampler = loader.sampler
    assert isinstance(sampler, PartitionSampler) and (sampler.num_replicas, sampler.rank) == (1, 0)
    assert sampler.partition == "dirichlet" and sampler.alpha == 0.1 and sampler.partition_seed == 3
    # One worker holds everything, whatever the partition.
    assert len(sampler.shard) == len(module.train_set) and len(loader) == len(module.train_set) // 32


class _RecordBatches(pl.Callback):
    """Saves what this rank's training dataloader holds and yields (the test reads the files)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.labels: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.labels.append(batch[1].clone())

    def on_train_end(self, trainer, pl_module) -> None:
        sampler = trainer.train_dataloader.sampler
        torch.save(
            {
                "sampler": type(sampler).__name__,
                "indices": sampler.indices(0).tolist() if isinstance(sampler, PartitionSampler) else None,
                "labels": torch.cat(self.labels),
                "steps": trainer.global_step,
            },
            Path(self.out_dir) / f"rank{trainer.global_rank}.pt",
        )


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.layer(images.flatten(1)), labels)

    def configure_optimizers(self):
        return partial(torch.optim.SGD, lr=0.01)(self.parameters())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lightning_keeps_the_partition_sampler_on_every_rank(tmp_path):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_RecordBatches(str(tmp_path))],
        default_root_dir=tmp_path,
    )
    module = DigitsDataModule(batch_size=16, partition="dirichlet", alpha=0.1, partition_seed=0)
    trainer.fit(_Linear(), datamodule=module)

    module.setup("fit")
    labels = dataset_labels(module.train_set)
    shards = [
        PartitionSampler(module.train_set, labels, "dirichlet", 0.1, num_replicas=2, rank=r).shard for r in range(2)
    ]
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert record["sampler"] == "PartitionSampler" and record["steps"] == 4
        assert set(record["indices"]) <= set(shards[rank].tolist())
        # The batches are exactly this rank's sampler's first indices, in order.
        assert torch.equal(record["labels"], torch.from_numpy(labels[record["indices"][: 4 * 16]]))


# ----------------------------------------------------------------------------------------------
# The config group: every file builds its module, and bad values stop train(cfg) before workers start.


def _compose(tmp_path: Path, *overrides: str):
    from hydra import compose, initialize_config_module

    with initialize_config_module("lgc.conf", version_base="1.3"):
        return compose("train", overrides=["experiment=smoke", "logger=none", f"output_dir={tmp_path}", *overrides])


def test_every_data_config_builds_its_module(tmp_path, cifar10_root, imagenet_root, camvid_root):
    import hydra

    expected = {
        "digits": ([], DigitsDataModule, 10, 1, "classification"),
        "cifar10": ([f"data.root={cifar10_root}"], CIFAR10DataModule, 10, 3, "classification"),
        "imagenet": ([f"data.root={imagenet_root}", "data.num_classes=3"], ImageNetDataModule, 3, 3, "classification"),
        "camvid": ([f"data.root={camvid_root}"], CamVidDataModule, 11, 3, "segmentation"),
    }
    for name, (overrides, cls, num_classes, in_channels, task) in expected.items():
        module = hydra.utils.instantiate(_compose(tmp_path, f"data={name}", *overrides).data)
        assert type(module) is cls, name
        assert (module.num_classes, module.in_channels, module.task) == (num_classes, in_channels, task), name
        if task == "classification":
            assert (module.partition, module.alpha, module.partition_seed) == ("iid", 1.0, 0), name
    skewed = hydra.utils.instantiate(_compose(tmp_path, "data.partition=dirichlet", "data.alpha=0.3").data)
    assert (skewed.partition, skewed.alpha) == ("dirichlet", 0.3)


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (["data.partition=shuffled"], ValueError, "data: partition must be one of iid, dirichlet; got 'shuffled'"),
        (["data.partition=dirichlet", "data.alpha=0"], ValueError, "data.alpha=0 must be a positive finite number"),
        (["data=imagenet", "data.root=/no/such/imagenet"], FileNotFoundError, "'/no/such/imagenet' does not exist"),
        (["data=camvid", "data.root=/no/such/camvid"], FileNotFoundError, "'/no/such/camvid' does not exist"),
        (
            ["data=fashion_mnist", "data.root=/no/such/fashion"],
            FileNotFoundError,
            r"data: Fashion-MNIST not found \(data.root='/no/such/fashion' is not a folder\): install it with "
            r"`apt-get install dataset-fashion-mnist`.* or set data.download=true",
        ),
    ],
)
def test_bad_data_values_stop_train_before_workers_start(tmp_path, no_workers, overrides, error, message):
    from lgc.train import train

    with pytest.raises(error, match=message):
        train(_compose(tmp_path, *overrides))
