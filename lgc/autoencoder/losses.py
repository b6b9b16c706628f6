"""Training losses of LGC's autoencoder (the training path; the runtime path is encode/decode).

Samples are *aligned* chunks: ``chunks[b, i]`` is worker ``i``'s values at the same positions (the
leader's top-k indices), normalized by the leader's chunk scale. Three terms, each weighted by a
config knob (:class:`LossWeights`):

* **reconstruction**: ``MSE(decode(encode(x_i)), x_i)`` averaged over workers (LGC-RAR), or, for
  LGC-PS, ``MSE(D_i(E(x_l), u_i), x_i)``: decoder ``i`` rebuilds worker ``i``'s values from the
  leader's latent and worker ``i``'s innovation ``u_i``; a random worker stands in for the leader
  in every sample, as in the paper's training.
* **similarity**: ``mean_{i != j} MSE(E(x_i), E(x_j))``, the paper's term that pulls the latents of
  different workers together so the latent carries their common information. Computed in O(N) as
  ``2N / (N - 1) * mean_i MSE(E(x_i), mean_j E(x_j))``.
* **mean** (LGC-RAR only): ``MSE(decode(mean_i E(x_i)), mean_i x_i)``. LGC-RAR sums the latents
  with an allreduce and decodes the mean, so this is the quantity it actually needs; the paper's
  loss does not have it (the RAR variant's training is not described in detail: measure it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lgc.autoencoder.model import GradientAutoencoder

__all__ = ["DEFAULT_WEIGHTS", "AutoencoderLosses", "LossWeights", "ps_losses", "rar_losses", "relative_error"]


class LossWeights(NamedTuple):
    """Weights of the loss terms (the paper: 0.5 reconstruction, 0.5 similarity)."""

    #: Per-worker reconstruction.
    reconstruction: float = 0.5
    #: Pull the latents of different workers together.
    similarity: float = 0.5
    #: Decoding the mean latent gives the mean values (LGC-RAR's actual use; ignored by LGC-PS).
    mean: float = 1.0


#: The defaults, shared (a NamedTuple is immutable).
DEFAULT_WEIGHTS = LossWeights()


class AutoencoderLosses(NamedTuple):
    total: Tensor
    reconstruction: Tensor
    similarity: Tensor
    mean: Tensor
    #: ``||x_hat - x||^2 / ||x||^2`` of what the topology decodes (RAR: the mean; PS: every worker).
    relative_error: Tensor


def relative_error(estimate: Tensor, target: Tensor) -> Tensor:
    """``||estimate - target||^2 / ||target||^2`` (0 for an all-zero target)."""
    return (estimate - target).square().sum() / target.square().sum().clamp_min(torch.finfo(target.dtype).tiny)


def _encode_all(ae: GradientAutoencoder, chunks: Tensor) -> Tensor:
    batch, workers, length = chunks.shape
    latent = ae.encode(chunks.reshape(batch * workers, length))
    return latent.view(batch, workers, *latent.shape[1:])


def _similarity(latents: Tensor) -> Tensor:
    workers = latents.shape[1]
    if workers < 2:
        return latents.new_zeros(())
    spread = F.mse_loss(latents, latents.mean(dim=1, keepdim=True).expand_as(latents))
    return spread * (2 * workers / (workers - 1))


def rar_losses(ae: GradientAutoencoder, chunks: Tensor, weights: LossWeights = DEFAULT_WEIGHTS) -> AutoencoderLosses:
    """LGC-RAR's losses on aligned chunks ``[B, workers, chunk]``."""
    batch, workers, length = chunks.shape
    latents = _encode_all(ae, chunks)
    decoded = ae.decode(latents.reshape(batch * workers, *latents.shape[2:])).view(batch, workers, length)
    reconstruction = F.mse_loss(decoded, chunks)
    similarity = _similarity(latents)
    target_mean = chunks.mean(dim=1)
    decoded_mean = ae.decode(latents.mean(dim=1))
    mean = F.mse_loss(decoded_mean, target_mean)
    total = weights.reconstruction * reconstruction + weights.similarity * similarity + weights.mean * mean
    return AutoencoderLosses(total, reconstruction, similarity, mean, relative_error(decoded_mean, target_mean))


def ps_losses(
    ae: GradientAutoencoder,
    chunks: Tensor,
    innovations: Tensor,
    leaders: Tensor,
    weights: LossWeights = DEFAULT_WEIGHTS,
) -> AutoencoderLosses:
    """LGC-PS's losses on aligned chunks and innovations ``[B, workers, chunk]``.

    ``leaders[b]`` is the worker whose latent stands in for the leader's in sample ``b``.
    """
    batch, workers, length = chunks.shape
    if ae.config.num_decoders != workers:
        raise ValueError(f"LGC-PS needs one decoder per worker: {ae.config.num_decoders} decoders, {workers} workers")
    latents = _encode_all(ae, chunks)
    leader_latent = latents[torch.arange(batch, device=chunks.device), leaders]
    decoded = torch.stack([ae.decode(leader_latent, innovations[:, i], decoder=i) for i in range(workers)], dim=1)
    reconstruction = F.mse_loss(decoded, chunks)
    similarity = _similarity(latents)
    total = weights.reconstruction * reconstruction + weights.similarity * similarity
    zero = chunks.new_zeros(())
    return AutoencoderLosses(total, reconstruction, similarity, zero, relative_error(decoded, chunks))
