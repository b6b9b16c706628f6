"""Fixed-length chunks of a value vector, each normalized by a scale.

LGC's autoencoder sees chunks of ``chunk`` values, so its size does not depend on the model's. A
vector of ``K`` values becomes ``ceil(K / chunk)`` rows, the last one zero-padded. Gradient
magnitudes change by orders of magnitude over training and between layers, so every chunk is
divided by a scale before encoding and multiplied by it after decoding: the autoencoder learns the
*shape* of the values, which is what stays similar across steps. In LGC every worker must use the
same scales (latents of different workers are combined), so the scales are the leader's (one fp32
per chunk, sent with its indices).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["chunk_scales", "divide_by_scales", "from_chunks", "num_chunks", "to_chunks"]


def num_chunks(numel: int, chunk: int) -> int:
    return math.ceil(numel / chunk)


def to_chunks(values: Tensor, chunk: int) -> Tensor:
    """``[K]`` -> ``[ceil(K / chunk), chunk]``, zero-padded at the end."""
    rows = num_chunks(values.numel(), chunk)
    padded = values.new_zeros(rows * chunk)
    padded[: values.numel()] = values
    return padded.view(rows, chunk)


def divide_by_scales(chunks: Tensor, scales: Tensor) -> Tensor:
    """``[B, chunk]`` rows divided by ``[B]`` scales; a finite value whose quotient leaves the
    dtype's range saturates at its largest value instead of becoming inf.

    The scales are the leader's and the values every worker's: a worker's value far above the
    leader's chunk (a leader whose chunk holds tiny values) would otherwise turn into an inf that no
    wire saturation tells from a genuine one, and the delivered sum would hold it. An inf or NaN
    already in ``chunks`` stays as it is.
    """
    quotient = chunks / scales[:, None]
    largest = torch.finfo(quotient.dtype).max
    return torch.where(quotient.isinf() & chunks.isfinite(), quotient.clamp(-largest, largest), quotient)


def from_chunks(chunks: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`to_chunks`: the first ``numel`` values."""
    return chunks.reshape(-1)[:numel]


def chunk_scales(chunks: Tensor) -> Tensor:
    """Root mean square of every chunk's non-padded values, ``1.0`` for an all-zero chunk.

    ``[B, chunk] -> [B]`` (float32). The mean is over the whole row, so a padded last chunk has a
    slightly smaller scale than its values alone; every worker computes it the same way.
    """
    rms = chunks.float().square().mean(dim=1).sqrt()
    return torch.where(rms > 0, rms, torch.ones_like(rms))
