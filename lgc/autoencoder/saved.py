"""A trained codec on disk: written at the end of an LGC run, read by ``training.autoencoder.init`` to start another.

A codec trained on one run may serve another (another number of workers, data split, model or
task), which spares the new run its codec-training stage and the samples it gathers; whether it
serves well is measured, not assumed. The file holds the codec's class, the shape that must match (an
:class:`~lgc.autoencoder.AutoencoderConfig`'s fields but its seed, or the linear codec's chunk and
latent size) and its weights::

    {"format": "lgc-codec", "version": 1, "codec": "GradientAutoencoder", "shape": {...}, "state_dict": {...}}
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["FORMAT", "codec_shape", "load_codec_into", "read_codec", "save_codec"]

FORMAT = "lgc-codec"
_VERSION = 1


def codec_shape(codec: nn.Module) -> dict[str, Any]:
    """What a saved codec must share with the one it initializes (the seed aside)."""
    config = getattr(codec, "config", None)
    if dataclasses.is_dataclass(config):
        shape = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
        shape.pop("seed", None)
        return {key: list(value) if isinstance(value, tuple) else value for key, value in shape.items()}
    if hasattr(codec, "latent_size"):
        return {"chunk": codec.chunk, "latent_size": codec.latent_size}
    raise TypeError(f"no shape known for a codec of type {type(codec).__name__}")


def save_codec(codec: nn.Module, path: str | Path) -> Path:
    """Write ``codec`` (its class, shape and weights, on the CPU) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.detach().cpu().clone() for name, tensor in codec.state_dict().items()}
    record = {
        "format": FORMAT,
        "version": _VERSION,
        "codec": type(codec).__name__,
        "shape": codec_shape(codec),
        "state_dict": weights,
    }
    torch.save(record, path)
    return path


def read_codec(path: str | Path) -> dict[str, Any]:
    """Read and check a file written by :func:`save_codec` (a clear error for anything else)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"training.autoencoder.init={str(path)!r}: no such file (a codec.pt written by an LGC run)"
        )
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a pickle error, a truncated file: say which file
        raise ValueError(f"training.autoencoder.init={str(path)!r} is not a saved lgc codec: {error}") from error
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"training.autoencoder.init={str(path)!r} is not a saved lgc codec (no format {FORMAT!r})")
    if record.get("version") != _VERSION:
        raise ValueError(
            f"training.autoencoder.init={str(path)!r} has codec format version {record.get('version')!r}, "
            f"expected {_VERSION}"
        )
    return record


def load_codec_into(codec: nn.Module, path: str | Path) -> None:
    """Copy the weights saved at ``path`` into ``codec``; refuse a codec of another class or shape."""
    record = read_codec(path)
    want = {"codec": type(codec).__name__, **codec_shape(codec)}
    have = {"codec": record["codec"], **record["shape"]}
    differ = [key for key in sorted(set(want) | set(have)) if want.get(key) != have.get(key)]
    if differ:
        details = ", ".join(f"{key}: saved {have.get(key)!r}, this run {want.get(key)!r}" for key in differ)
        raise ValueError(f"training.autoencoder.init={str(path)!r} does not fit this run's codec ({details})")
    with torch.no_grad():
        codec.load_state_dict(record["state_dict"])
