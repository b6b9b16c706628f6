"""How alike are the workers' gradients? Cross-worker cosine similarity and top-k overlap.

The premise of learned gradient compression (Abrahamyan et al., "Learned Gradient Compression
for Distributed Deep Learning", IEEE TNNLS 2021) is that the gradients that data-parallel
workers compute at the same step are strongly correlated, so that one encoder can exploit what
they share. These functions measure that on a :class:`~lgc.analysis.GradientRecording`: the
cosine similarity of the workers' gradients of a layer at every step, and how much their top-k
supports (the entries a sparsifier would send) overlap. All take and return plain tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from lgc.analysis.recording import GradientRecording
from lgc.learned.samples import mean_pairwise_correlation

__all__ = [
    "compare_recordings",
    "cross_worker_cosine",
    "leader_position_statistics",
    "pairwise_cosine",
    "pairwise_topk_jaccard",
    "random_topk_jaccard",
    "recording_cosine",
    "recording_topk_jaccard",
    "summarize_recording",
    "topk_jaccard",
]


def _check_workers_steps_numel(grads: Tensor) -> None:
    if grads.dim() != 3:
        raise ValueError(f"expected gradients of shape [workers, steps, numel], got {tuple(grads.shape)}")
    if grads.shape[0] < 2:
        raise ValueError(f"cross-worker statistics need at least 2 workers, got {grads.shape[0]}")


def _mean_over_pairs(matrices: Tensor) -> Tensor:
    """``[T, W, W]`` -> ``[T]``: mean over the unordered pairs of distinct workers."""
    workers = matrices.shape[-1]
    upper = torch.triu_indices(workers, workers, offset=1)
    return matrices[:, upper[0], upper[1]].mean(dim=-1)


def pairwise_cosine(grads: Tensor, eps: float = 1e-12) -> Tensor:
    """Cosine similarity of every pair of workers at every step: ``[W, T, N]`` -> ``[T, W, W]``.

    A worker whose gradient is zero has similarity 0 with every other (not NaN).
    """
    _check_workers_steps_numel(grads)
    grads = grads.double()
    unit = grads / grads.norm(dim=-1, keepdim=True).clamp_min(eps)
    return torch.einsum("itn,jtn->tij", unit, unit).float()


def cross_worker_cosine(grads: Tensor) -> Tensor:
    """Mean cosine similarity over pairs of workers at every step: ``[W, T, N]`` -> ``[T]``.

    1 means every worker computed the same direction; about 0 means unrelated directions (random
    high-dimensional vectors); negative means the workers pull against each other.
    """
    return _mean_over_pairs(pairwise_cosine(grads))


def _topk_masks(grads: Tensor, density: float) -> tuple[Tensor, int]:
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    numel = grads.shape[-1]
    k = max(1, round(density * numel))
    indices = grads.abs().topk(k, dim=-1, sorted=False).indices
    masks = torch.zeros(grads.shape, dtype=torch.float32).scatter_(-1, indices, 1.0)
    return masks, k


def pairwise_topk_jaccard(grads: Tensor, density: float) -> Tensor:
    """Jaccard index ``|A ∩ B| / |A ∪ B|`` of the workers' top-k supports: ``[W, T, N]`` -> ``[T, W, W]``.

    ``k = max(1, round(density * N))`` largest magnitudes of each worker's gradient at each step.
    """
    _check_workers_steps_numel(grads)
    masks, k = _topk_masks(grads, density)
    intersection = torch.einsum("itn,jtn->tij", masks, masks)
    return intersection / (2 * k - intersection)


def topk_jaccard(grads: Tensor, density: float) -> Tensor:
    """Mean Jaccard index of the top-k supports over pairs of workers at every step: ``[T]``."""
    return _mean_over_pairs(pairwise_topk_jaccard(grads, density))


def random_topk_jaccard(numel: int, density: float) -> float:
    """The mean Jaccard index of two independent uniformly random k-subsets of ``numel`` entries.

    The baseline for :func:`topk_jaccard` (what unrelated gradients would give): the intersection
    ``X`` of the two subsets is hypergeometric (``numel`` entries, ``k`` marked, ``k`` drawn), and
    the Jaccard index is ``X / (2k - X)``; this is its exact expectation.
    """
    from scipy.stats import hypergeom

    k = max(1, round(density * numel))
    overlap = np.arange(k + 1)
    return float(np.sum(hypergeom.pmf(overlap, numel, k, k) * overlap / (2 * k - overlap)))


def leader_position_statistics(grads: Tensor, density: float, rotating: bool = False) -> dict[str, Tensor]:
    """The workers' gradients at the leader's top-k positions, per step: what LGC's codec is given.

    LGC's workers all send their values at the positions of one worker's top-k (the leader's:
    worker 0, or worker ``t mod W`` at step ``t`` with ``rotating``), so its premise is that those
    values agree across workers. For ``[W, T, N]`` gradients and ``k = max(1, round(density * N))``:

    * ``correlation`` ``[T]``: Pearson's r between two workers' k values at those positions, the
      mean over pairs of workers (the leader included: its values are its largest, the others' are
      whatever they hold there); NaN where k < 2 (one value has no correlation);
    * ``energy_share`` ``[T]``: the fraction of a non-leader worker's squared gradient that lies at
      those positions (the mean over the non-leaders; ``density`` for unrelated gradients): how much
      of what the others would send themselves the leader's positions carry.
    """
    _check_workers_steps_numel(grads)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    workers, steps, numel = grads.shape
    k = max(1, round(density * numel))
    grads = grads.double()
    leaders = torch.arange(steps) % workers if rotating else torch.zeros(steps, dtype=torch.long)
    positions = grads[leaders, torch.arange(steps)].abs().topk(k, dim=-1, sorted=False).indices  # [T, k]
    values = torch.gather(grads, -1, positions.unsqueeze(0).expand(workers, -1, -1))  # [W, T, k]
    correlation = mean_pairwise_correlation(values)
    if k < 2:
        correlation = torch.full_like(correlation, float("nan"))
    share = values.pow(2).sum(dim=-1) / grads.pow(2).sum(dim=-1).clamp_min(1e-300)  # [W, T]
    others = torch.ones(workers, steps, dtype=torch.bool)
    others[leaders, torch.arange(steps)] = False
    energy_share = (share * others).sum(dim=0) / (workers - 1)
    return {"correlation": correlation.float(), "energy_share": energy_share.float()}


def recording_cosine(recording: GradientRecording) -> dict[str, Tensor]:
    """:func:`cross_worker_cosine` of every recorded layer: ``{name: [T]}``."""
    return {name: cross_worker_cosine(recording.flat(name)) for name in recording.names}


def recording_topk_jaccard(recording: GradientRecording, density: float) -> dict[str, Tensor]:
    """:func:`topk_jaccard` of every recorded layer at ``density``: ``{name: [T]}``."""
    return {name: topk_jaccard(recording.flat(name), density) for name in recording.names}


def summarize_recording(recording: GradientRecording, density: float = 0.01) -> dict[str, dict[str, float]]:
    """Per layer: mean and standard deviation over steps of the cosine and top-k Jaccard, with the random baseline."""
    summary = {}
    cosine, jaccard = recording_cosine(recording), recording_topk_jaccard(recording, density)
    for name in recording.names:
        numel = recording.flat(name).shape[-1]
        summary[name] = {
            "cosine_mean": float(cosine[name].mean()),
            "cosine_std": float(cosine[name].std()) if len(cosine[name]) > 1 else 0.0,
            "jaccard_mean": float(jaccard[name].mean()),
            "jaccard_random": random_topk_jaccard(numel, density),
            "numel": float(numel),
        }
    return summary


def compare_recordings(
    recordings: Mapping[str, GradientRecording], density: float = 0.01
) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`summarize_recording` of several runs (e.g. ``{"iid": ..., "dirichlet 0.1": ...}``), by label.

    The runs must have recorded the same layers, so that their rows compare like with like.
    """
    names = {label: rec.names for label, rec in recordings.items()}
    if len({tuple(n) for n in names.values()}) > 1:
        raise ValueError(f"the recordings hold different layers: {names}")
    return {label: summarize_recording(rec, density) for label, rec in recordings.items()}
