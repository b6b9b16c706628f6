"""Stage 2, codec training: every worker's values at the leader's positions, gathered at rank 0.

During codec training the workers communicate top-k as ``compressor=topk`` does. Each step, every
worker also keeps, per compressed parameter, its error-corrected gradient at the leader's top-k
positions (the very vector the codec will encode in the compressed stage). At the step's last
bucket the whole model's samples are joined in cat space, put in wire order
(:class:`~lgc.learned.leader_code.LeaderIndexCodec`), gathered at rank 0 (counted with the stage's
bytes), cut into chunks and divided by the leader's chunk scales: ``[rows, workers, chunk]``,
what the codec's trainer takes (:class:`~lgc.learned.training.CodecTraining` runs the stage).
With ``training.samples="leader"`` the step runs the compressed stage's own exchange exactly instead
(every worker's float32 values at the leader's positions, summed), and its values, in wire order
already, are gathered by :func:`gather_leader_samples`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.coding import pack_bits
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.learned.leader_code import LeaderIndexCodec

__all__ = ["GatheredSamples", "Sample", "gather_leader_samples", "gather_samples", "mean_pairwise_correlation"]


def mean_pairwise_correlation(values: Tensor) -> Tensor:
    """Pearson's r between every two workers' values, averaged over the pairs: ``[W, ..., k]`` -> ``[...]``.

    The workers' values at the same (the leader's) positions: LGC's premise is that they agree.
    A worker whose values are all equal correlates 0 with every other (not NaN).
    """
    if values.shape[0] < 2:
        raise ValueError(f"a correlation between workers needs at least 2, got {values.shape[0]}")
    centered = values.double() - values.double().mean(dim=-1, keepdim=True)
    unit = centered / centered.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    workers = values.shape[0]
    first, second = torch.triu_indices(workers, workers, offset=1)
    return (unit[first] * unit[second]).sum(dim=-1).mean(dim=0).float()


class Sample(NamedTuple):
    """One compressed parameter's stage-2 sample of this worker."""

    #: The parameter's position in the model (samples are joined in this order).
    order: int
    numel: int
    #: The leader's top-k positions in the parameter and its values there.
    positions: Tensor
    leader_values: Tensor
    #: This worker's error-corrected gradient at those positions.
    values: Tensor
    #: LGC-PS: which of those positions are in this worker's innovation.
    innovation: Tensor | None
    #: The squared norm of this worker's whole error-corrected gradient of the parameter.
    energy: float = 0.0


class GatheredSamples(NamedTuple):
    """A step's samples at rank 0."""

    #: ``[rows, workers, chunk]``: every worker's values in wire order, chunked and scaled.
    chunks: Tensor
    #: LGC-PS: every worker's innovation mask over the ``count`` values, bit-packed.
    innovation_masks: list[Tensor] | None
    #: Values per worker (the step's ``K``).
    count: int


def gather_samples(
    samples: list[Sample], codec: LeaderIndexCodec, stats: CommStats, group: dist.ProcessGroup | None
) -> GatheredSamples | None:
    """Join this worker's samples and gather everyone's at rank 0 (a collective: every rank calls it).

    Returns the gathered samples at rank 0, None elsewhere (and everywhere when there are none).
    """
    samples = sorted(samples, key=lambda sample: sample.order)
    if not samples:
        return None
    offsets = torch.tensor([0] + [sample.numel for sample in samples[:-1]]).cumsum(0).tolist()
    positions = torch.cat([sample.positions + offset for sample, offset in zip(samples, offsets, strict=True)])
    leader_values = torch.cat([sample.leader_values for sample in samples])
    order = codec.order(positions, leader_values)
    values = torch.cat([sample.values for sample in samples])[order]
    gathered = counted.gather(stats, values, 0, group)
    masks = None
    if samples[0].innovation is not None:
        mask = torch.cat([sample.innovation for sample in samples])[order]  # type: ignore[misc]
        masks = counted.gather(stats, pack_bits(mask).to(values.device), 0, group)
    if gathered is None:
        return None
    return GatheredSamples(_scaled(gathered, leader_values[order], codec), masks, values.numel())


def gather_leader_samples(
    values: Tensor, leader: int, codec: LeaderIndexCodec, stats: CommStats, group: dist.ProcessGroup | None
) -> GatheredSamples | None:
    """Gather every worker's ``values`` at the leader's positions, already in wire order, at rank 0.

    What :func:`gather_samples` returns, for a step that ran the leader's exchange itself (codec
    training with ``training.samples="leader"``): the leader's own values give the chunk scales. A
    collective: every rank calls it; the gathered samples at rank 0, None elsewhere.
    """
    gathered = counted.gather(stats, values, 0, group)
    if gathered is None:
        return None
    return GatheredSamples(_scaled(gathered, gathered[leader], codec), None, values.numel())


def _scaled(gathered: list[Tensor], leader_values: Tensor, codec: LeaderIndexCodec) -> Tensor:
    """``[rows, workers, chunk]``: every worker's values chunked and divided by the leader's chunk scales."""
    scales = codec.chunk_scales(leader_values)
    return torch.stack([codec.scaled_chunks(x, scales) for x in gathered], dim=1)
