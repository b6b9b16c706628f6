"""Datasets (plain PyTorch): the embedded digits task, loaders for real datasets, worker partitions."""

from lgc.data.camvid import CAMVID_CLASSES, CAMVID_IGNORE_INDEX, CamVidDataset, camvid_pairs
from lgc.data.cifar10 import check_cifar10_folder
from lgc.data.digits import load_digits_split
from lgc.data.eval_shard import CLASS_IGNORE_INDEX, EvalShardSampler, PaddedEvalDataset
from lgc.data.fashion_scenes import FASHION_SCENE_CLASSES, FashionScenes
from lgc.data.folders import require_files, require_folder
from lgc.data.imagenet import imagenet_classes
from lgc.data.partition import (
    PARTITIONS,
    check_partition,
    dataset_labels,
    dirichlet_partition,
    iid_partition,
    label_histogram,
    resample_to_length,
)
from lgc.data.sampler import PartitionSampler
from lgc.data.seeded import EpochSeededDataset

__all__ = [
    "CAMVID_CLASSES",
    "CAMVID_IGNORE_INDEX",
    "CLASS_IGNORE_INDEX",
    "PARTITIONS",
    "CamVidDataset",
    "FASHION_SCENE_CLASSES",
    "FashionScenes",
    "EpochSeededDataset",
    "EvalShardSampler",
    "PaddedEvalDataset",
    "PartitionSampler",
    "camvid_pairs",
    "check_cifar10_folder",
    "check_partition",
    "dataset_labels",
    "dirichlet_partition",
    "iid_partition",
    "imagenet_classes",
    "label_histogram",
    "load_digits_split",
    "require_files",
    "require_folder",
    "resample_to_length",
]
