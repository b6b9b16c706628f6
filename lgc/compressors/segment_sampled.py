"""DGC's sampled threshold over a whole bucket: :func:`~lgc.compressors.selection.sampled_topk` of every segment
of a flat tensor in a number of passes that does not grow with the number of segments.

DGC (Lin et al. 2018) estimates each tensor's top-k threshold from a strided sample and adapts it
to the survivors' count, as its authors' code does (synxlin/deep-gradient-compression,
``dgc/compression.py``); :func:`~lgc.compressors.selection.sampled_topk` is that rule for one
tensor, a few kernels and host synchronizations each. A DDP bucket holds many tensors (ResNet-50:
161), and on a GPU those per-tensor kernels cost more than the arithmetic: :func:`sampled_topk_segments`
runs the same rule for all of them together (:meth:`~lgc.compressors.DGCCompressor.compress_many`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lgc.compressors.segment_topk import segment_topk
from lgc.compressors.selection import _LOWER, _MAX_ROUNDS, _UPPER, StartDraw, dgc_sample_layout, sampled_topk

__all__ = ["sampled_topk_segments"]


def sampled_topk_segments(
    x: Tensor,
    numels: Sequence[int],
    ks: Sequence[int],
    *,
    density: float,
    sample_fraction: float = 0.01,
    rngs: Sequence[StartDraw],
) -> tuple[Tensor, list[int]]:
    """:func:`sampled_topk` of every segment of the flat ``x`` at once: DGC's selection over a whole bucket.

    Segment ``i`` (``numels[i]`` entries, laid end to end) gets the entries :func:`sampled_topk`
    gives it with ``k = ks[i]`` and ``rng = rngs[i]`` (drawn from as that call would, once where its
    stride is above 1), in a number of passes that does not grow with the number of segments:

    1. every segment's strided sample gathered at once, and its threshold (the ``top_k_samples``-th
       largest sampled magnitude) from one :func:`~lgc.compressors.segment_topk.segment_topk` and one
       segment-wise minimum;
    2. the survivors ``|x| >= t_i`` of every segment from one comparison over the flat (the
       thresholds repeated per entry) and one ``nonzero``; the counts reach the host once;
    3. the count adapted as :func:`sampled_topk` does, every segment still below ``0.8 k`` lowered
       together (``t *= 0.8`` in fp32) and counted again: at most 10 rounds, each one pass;
    4. above ``1.3 k`` an exact top-k among the segment's survivors (one ``segment_topk`` for all
       such segments); otherwise its first ``k`` survivors in position order.

    The entries are :func:`sampled_topk`'s, bit for bit, where its selection is unique: a segment cut
    to ``k`` among survivors tied at the ``k``-th magnitude may keep another of them. Each segment's
    positions come in :func:`sampled_topk`'s order where it is defined (ascending), largest first
    where it cuts (``torch.topk``'s order is unspecified). ``x`` holding an inf or a NaN takes
    :func:`sampled_topk` segment by segment (its ``"exact"`` guard included).

    Returns:
        int64 positions in ``x``, segment by segment in the order given, and each segment's count.
    """
    x = x.detach().reshape(-1)
    device, segments = x.device, len(numels)
    if sum(numels) != x.numel() or len(ks) != segments or len(rngs) != segments:
        raise ValueError(
            f"numels must sum to x.numel() ({x.numel()}) with one k and one rng each, "
            f"got {sum(numels)}, {len(ks)} ks and {len(rngs)} rngs"
        )
    offsets = [0]
    for numel in numels:
        offsets.append(offsets[-1] + numel)
    if not bool(torch.isfinite(x).all()):
        picked = [
            sampled_topk(x[a:b], k, density=density, sample_fraction=sample_fraction, rng=rng)[0] + a
            for a, b, k, rng in zip(offsets, offsets[1:], ks, rngs, strict=False)
        ]
        return torch.cat(picked), [p.numel() for p in picked]
    # 1. The samples and their thresholds (-inf where k >= n: every entry survives, all are sent).
    sampled, firsts, strides, lengths, tops, adaptive = [], [], [], [], [], [False] * segments
    for i, (numel, k, rng) in enumerate(zip(numels, ks, rngs, strict=True)):
        if k >= numel:
            continue
        num_samples, stride, top_k_samples = dgc_sample_layout(numel, density, sample_fraction)
        start = 0 if stride == 1 else rng.randrange(stride)
        length = len(range(start, numel, stride))
        sampled.append(i)
        firsts.append(offsets[i] + start)
        strides.append(stride)
        lengths.append(length)
        tops.append(min(top_k_samples, length))
        adaptive[i] = numel > num_samples
    thresholds = torch.full((segments,), float("-inf"), dtype=x.dtype, device=device)
    if sampled:
        total = sum(lengths)
        counts_t = torch.tensor(lengths, device=device)
        which = torch.repeat_interleave(torch.arange(len(sampled), device=device), counts_t, output_size=total)
        step_in = torch.arange(total, device=device) - (counts_t.cumsum(0) - counts_t)[which]
        where = torch.tensor(firsts, device=device)[which] + torch.tensor(strides, device=device)[which] * step_in
        magnitudes = x.index_select(0, where).abs_()
        top = magnitudes[segment_topk(magnitudes, lengths, tops)]
        owner = torch.repeat_interleave(
            torch.arange(len(sampled), device=device), torch.tensor(tops, device=device), output_size=sum(tops)
        )
        lowest = torch.full((len(sampled),), float("inf"), dtype=x.dtype, device=device)
        thresholds[torch.tensor(sampled, device=device)] = lowest.scatter_reduce_(0, owner, top, "amin")
    ends = torch.tensor(offsets[1:], device=device)
    sizes = torch.tensor(list(numels), device=device)
    magnitude = x.abs()

    def survivors() -> tuple[Tensor, Tensor, list[int]]:
        hits = torch.nonzero(magnitude >= thresholds.repeat_interleave(sizes, output_size=x.numel())).squeeze(1)
        owners = torch.searchsorted(ends, hits, right=True)
        return hits, owners, torch.bincount(owners, minlength=segments).tolist()

    # 2.-3. Count, and lower the thresholds of the segments that fall short, all at once.
    hits, owners, counts = survivors()
    rounds = [0] * segments
    while True:
        lower = [i for i in range(segments) if adaptive[i] and rounds[i] < _MAX_ROUNDS and counts[i] < _LOWER * ks[i]]
        if not lower:
            break
        chosen = torch.tensor(lower, device=device)
        # The authors' threshold is a tensor of x's dtype: lowered in that precision.
        thresholds[chosen] = thresholds[chosen] * _LOWER
        for i in lower:
            rounds[i] += 1
        hits, owners, counts = survivors()
    # 4. Cut to k among the survivors above 1.3 k; elsewhere the first k by position.
    cut = [adaptive[i] and rounds[i] < _MAX_ROUNDS and counts[i] > _UPPER * ks[i] for i in range(segments)]
    k_t = torch.tensor(list(ks), device=device)
    firsts_t = torch.tensor([0, *counts], device=device).cumsum(0)[:-1]
    rank = torch.arange(hits.numel(), device=device) - firsts_t[owners]
    cut_t = torch.tensor(cut, device=device)
    keep = (rank < k_t[owners]) & ~cut_t[owners]
    kept = [hits[keep]]
    if any(cut):
        in_cut = cut_t[owners]
        cut_hits = hits[in_cut]
        cut_ids = [i for i in range(segments) if cut[i]]
        picks = segment_topk(magnitude[cut_hits], [counts[i] for i in cut_ids], [ks[i] for i in cut_ids])
        kept.append(cut_hits[picks])
    positions = torch.cat(kept)
    final = [min(ks[i], counts[i]) for i in range(segments)]
    if any(cut):
        positions = positions[torch.argsort(torch.searchsorted(ends, positions, right=True), stable=True)]
    return positions, final
