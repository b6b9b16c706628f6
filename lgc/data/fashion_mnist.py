"""Fashion-MNIST (Xiao et al. 2017) found offline and made readable to torchvision's own ``FashionMNIST``.

Fashion-MNIST has 60,000 training and 10,000 test images, 28x28 grey, 10 classes of clothing,
in the original IDX files (``train-images-idx3-ubyte`` ...). torchvision's ``FashionMNIST`` reads
them decompressed from ``<root>/FashionMNIST/raw/``. Where they come from, in order:

1. ``root`` (``data.root``, or the ``FASHION_MNIST_ROOT`` variable) holding that layout already,
   or the four files themselves (gzipped or not), directly or under ``FashionMNIST/raw/``;
2. with no ``root``: the folder of Debian/Ubuntu's package ``dataset-fashion-mnist``
   (``apt-get install dataset-fashion-mnist``; :data:`DEBIAN_FOLDER`).

Files that are not already in torchvision's layout are decompressed (never copied otherwise) into
a cache folder, ``$XDG_CACHE_HOME/lgc/fashion_mnist`` (``~/.cache/...``) unless one is named, each
written under a temporary name and renamed, so processes preparing it at once cannot see a half
file; a file decompressed before from the same source (path, size, modification time) is reused.
Each file's IDX header (magic number, count, image size) is checked before it is used.
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
from pathlib import Path

import torch
from torchvision.transforms import v2

__all__ = [
    "DEBIAN_FOLDER",
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "fashion_mnist_cache",
    "fashion_mnist_transform",
    "prepare_fashion_mnist",
]

#: Where Debian/Ubuntu's package ``dataset-fashion-mnist`` installs the gzipped IDX files.
DEBIAN_FOLDER = Path("/usr/share/datasets/fashion-mnist")
#: The four IDX files (decompressed names), with the magic number and the shape each must have.
FASHION_MNIST_FILES: dict[str, tuple[int, tuple[int, ...]]] = {
    "train-images-idx3-ubyte": (2051, (60000, 28, 28)),
    "train-labels-idx1-ubyte": (2049, (60000,)),
    "t10k-images-idx3-ubyte": (2051, (10000, 28, 28)),
    "t10k-labels-idx1-ubyte": (2049, (10000,)),
}
#: Mean and standard deviation of the 60,000 training images' pixels (scaled to [0, 1]).
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)

_HOW_TO_GET = (
    "install it with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu), point data.root (or "
    "FASHION_MNIST_ROOT) at a folder holding the four IDX files, or set data.download=true (needs internet)"
)


def fashion_mnist_cache() -> Path:
    """Where files are decompressed unless a cache is named: ``$XDG_CACHE_HOME/lgc/fashion_mnist``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "lgc" / "fashion_mnist"


def _find(folder: Path, name: str) -> Path | None:
    """``name`` or ``name.gz`` in ``folder`` or in its ``FashionMNIST/raw``."""
    for place in (folder, folder / "FashionMNIST" / "raw"):
        for candidate in (place / name, place / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _header(path: Path) -> tuple[int, tuple[int, ...]]:
    """An IDX file's magic number and shape, read from its first bytes (gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as file:
        head = file.read(16)
    if len(head) < 8:
        raise ValueError(f"{str(path)!r} is not an IDX file: {len(head)} bytes")
    magic = struct.unpack(">i", head[:4])[0]
    dims = magic & 0xFF
    shape = struct.unpack(f">{dims}i", head[4 : 4 + 4 * dims]) if len(head) >= 4 + 4 * dims else ()
    return magic, tuple(shape)


def _check_header(path: Path, name: str, expected_count: int | None) -> int:
    """The file's number of entries, after checking its header is ``name``'s (and its count ``expected_count``)."""
    magic, shape = _header(path)
    want_magic, want_shape = FASHION_MNIST_FILES[name]
    if magic != want_magic or len(shape) != len(want_shape) or tuple(shape[1:]) != want_shape[1:]:
        raise ValueError(
            f"{str(path)!r} is not Fashion-MNIST's {name}: IDX magic {magic} and shape {shape}, expected "
            f"magic {want_magic} and shape (N, {', '.join(map(str, want_shape[1:]))})".replace(", )", ")")
        )
    if expected_count is not None and shape[0] != expected_count:
        raise ValueError(f"{str(path)!r} holds {shape[0]} entries, expected {expected_count} (its images' or labels')")
    return shape[0]


def prepare_fashion_mnist(root: str | Path | None = None, cache: str | Path | None = None) -> Path:
    """The folder to pass to torchvision's ``FashionMNIST`` as ``root``, its files checked (and
    decompressed into ``cache`` where needed); a FileNotFoundError says how to get the dataset.

    ``root``: a folder holding the files (see the module's docstring); None looks in
    :data:`DEBIAN_FOLDER`. ``cache``: where decompressed files go (None: ``$XDG_CACHE_HOME/lgc/fashion_mnist``).
    Images and labels must agree in number; the full dataset's 60,000 and 10,000 are not required
    (tests use small files in the same format).
    """
    source = DEBIAN_FOLDER if root is None else Path(root).expanduser()
    if not source.is_dir():
        where = f"data.root={str(root)!r} is not a folder" if root is not None else f"{DEBIAN_FOLDER} does not exist"
        raise FileNotFoundError(f"Fashion-MNIST not found ({where}): {_HOW_TO_GET}")
    found = {name: _find(source, name) for name in FASHION_MNIST_FILES}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST file {missing[0]}(.gz) is not in {str(source)!r} nor in its FashionMNIST/raw: {_HOW_TO_GET}"
        )
    counts: dict[str, int] = {}
    for name, path in found.items():
        assert path is not None
        split = name.split("-")[0]
        counts[split] = _check_header(path, name, counts.get(split))
    raw = source / "FashionMNIST" / "raw"
    if all(path == raw / name for name, path in found.items()):
        return source  # torchvision's layout already
    target = Path(cache).expanduser() if cache is not None else fashion_mnist_cache()
    raw = target / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, path in found.items():
        assert path is not None
        destination, stamp = raw / name, raw / f".{name}.source"
        origin = f"{path.resolve()} {path.stat().st_size} {path.stat().st_mtime_ns}"
        if destination.is_file() and stamp.is_file() and stamp.read_text() == origin:
            continue  # decompressed from this very file before
        partial = raw / f".{name}.{os.getpid()}.part"
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, destination)
        stamp.write_text(origin)
    return target


def fashion_mnist_transform(augment: bool) -> v2.Compose:
    """PIL image -> normalized float tensor (1 x 28 x 28); ``augment`` adds a random crop of the
    image padded by 2 pixels and a horizontal flip (the CIFAR recipe scaled to 28 pixels)."""
    augmentation = [v2.RandomCrop(28, padding=2), v2.RandomHorizontalFlip()] if augment else []
    to_tensor = [
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(FASHION_MNIST_MEAN, FASHION_MNIST_STD),
    ]
    return v2.Compose([*augmentation, *to_tensor])
