"""Tiny datasets in the real on-disk formats, shared by the data and experiment tests.

* CIFAR-10: the python version's ``cifar-10-batches-py`` pickles, written the way the real
  (Python 2) files are;
* ImageNet: an ImageFolder tree of small JPEGs;
* CamVid: SegNet's layout, PNG frames and PNG label maps with void pixels.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

from lgc.data import CAMVID_IGNORE_INDEX

__all__ = [
    "CAMVID_SIZE",
    "CIFAR_NAMES",
    "CIFAR_PER_BATCH",
    "IMAGENET_COLORS",
    "PALETTE",
    "camvid_mask",
    "cifar_checksums",
    "cifar_image",
    "write_camvid",
    "write_cifar10",
    "write_imagenet",
]


class _Py2Str(bytes):
    """A Python 2 ``str``: pickled with the (SHORT_)BINSTRING opcode, as in the real CIFAR-10 files."""


class _Py2Pickler(pickle._Pickler):
    # The real files were pickled by Python 2: their keys load as str with encoding="latin1"
    # (torchvision) and as bytes (b"data", b"labels") with encoding="bytes" (the CIFAR web page).
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_py2str(self, obj: _Py2Str) -> None:
        size = len(obj)
        opcode = pickle.SHORT_BINSTRING + bytes([size]) if size < 256 else pickle.BINSTRING + size.to_bytes(4, "little")
        self.write(opcode + bytes(obj))
        self.memoize(obj)

    dispatch[_Py2Str] = _save_py2str


def _py2_pickle(path: Path, obj: dict) -> None:
    buffer = io.BytesIO()
    _Py2Pickler(buffer, protocol=2).dump(obj)
    path.write_bytes(buffer.getvalue())


CIFAR_PER_BATCH = 4
CIFAR_NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def cifar_image(index: int) -> np.ndarray:
    """3072 bytes, 1024 per channel (R, G, B planes, rows of 32): each plane constant."""
    return np.repeat(np.array([index * 7 % 256, 100 + index, 200 - index], dtype=np.uint8), 1024)


def write_cifar10(root: Path, per_batch: int = CIFAR_PER_BATCH) -> Path:
    """``root/cifar-10-batches-py`` with ``per_batch`` images in each of the six batches; returns ``root``."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for batch, name in enumerate(CIFAR_NAMES):
        indices = range(batch * per_batch, (batch + 1) * per_batch)
        _py2_pickle(
            folder / name,
            {
                _Py2Str(b"batch_label"): _Py2Str(f"batch {batch}".encode()),
                _Py2Str(b"labels"): [i % 10 for i in indices],
                _Py2Str(b"data"): np.stack([cifar_image(i) for i in indices]),
                _Py2Str(b"filenames"): [_Py2Str(f"img_{i}.png".encode()) for i in indices],
            },
        )
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    _py2_pickle(
        folder / "batches.meta",
        {
            _Py2Str(b"label_names"): [_Py2Str(c.encode()) for c in classes],
            _Py2Str(b"num_cases_per_batch"): per_batch,
            _Py2Str(b"num_vis"): 3072,
        },
    )
    return root


def cifar_checksums(root: Path) -> dict[str, str]:
    """MD5 of every file of the fixture (torchvision checks them: tests give it these)."""
    folder = root / "cifar-10-batches-py"
    return {name: hashlib.md5((folder / name).read_bytes()).hexdigest() for name in [*CIFAR_NAMES, "batches.meta"]}


IMAGENET_COLORS = {"n01440764": (220, 30, 30), "n01443537": (30, 220, 30), "n01484850": (30, 30, 220)}


def write_imagenet(root: Path, train: int = 3, val: int = 2) -> Path:
    for split, count in (("train", train), ("val", val)):
        for name, color in IMAGENET_COLORS.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (40 + 4 * i, 30), color).save(folder / f"{name}_{i}.JPEG", quality=95)
    return root


# One colour per CamVid class (0-10) and black for void (11).
PALETTE = np.array([[17 * c + 20, (53 * c) % 256, 255 - 19 * c] for c in range(11)] + [[0, 0, 0]], dtype=np.uint8)
CAMVID_SIZE = (24, 32)  # (height, width)


def camvid_mask(seed: int) -> np.ndarray:
    """Blocks of 8x8 pixels, each one class or void."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 12, size=(CAMVID_SIZE[0] // 8, CAMVID_SIZE[1] // 8), dtype=np.uint8)
    return np.kron(blocks, np.ones((8, 8), dtype=np.uint8))


def write_camvid(root: Path, train: int = 3, val: int = 2, test: int = 2) -> Path:
    for split, count in (("train", train), ("val", val), ("test", test)):
        (root / split).mkdir(parents=True)
        (root / f"{split}annot").mkdir()
        for i in range(count):
            mask = camvid_mask(seed=10 * ("train", "val", "test").index(split) + i)
            mask[0, 0] = CAMVID_IGNORE_INDEX  # every map has void pixels
            name = f"0001TP_{i:06d}.png"
            Image.fromarray(PALETTE[mask]).save(root / split / name)
            Image.fromarray(mask, mode="L").save(root / f"{split}annot" / name)
    return root
