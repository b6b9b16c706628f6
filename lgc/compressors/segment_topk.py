"""Exact top-k of every segment of a flat tensor at once: the selection a bucket-level codec needs.

A DDP bucket is one flat tensor holding many parameters. A per-tensor compressor selects each
parameter's ``k`` largest magnitudes separately (:func:`~lgc.compressors.selection.topk_indices`,
or one ``torch.topk``, per parameter): a few small kernels each, which on a GPU cost far more than
the arithmetic (ResNet-50's 161 tensors: 18 ms for top-k's encode and decode on an H200, against
0.6 ms for one ``torch.topk`` of the whole flat; ``experiments/results/gpu_h200/``).
:func:`segment_topk` selects exactly the same entries for every segment in a fixed number of
passes over the flat, however many segments there are:

1. **Block maxima.** The magnitudes' maxima over blocks of ``b`` consecutive entries of the flat
   (one reduction over an ``(n / b, b)`` view). A block that lies inside one segment is *interior*
   to it; a block across a boundary, and the tail that fills no block, are searched entry by entry.
2. **A threshold per segment.** ``t_i``, the ``k_i``-th largest maximum among segment ``i``'s
   interior blocks (``torch.topk`` along the rows of ``(segments, blocks)`` matrices padded with -1
   (-inf for signed values), on the CPU one per power of two of the segments' block counts, so
   padding never doubles the blocks; on a GPU as few matrices as keep the padding bounded, built
   from geometry the host knows, without the class loop's host synchronizations). Those
   ``k_i`` maxima are ``k_i`` distinct entries of the segment, so its ``k_i``-th largest magnitude
   is at least ``t_i``, and every entry it keeps is at least ``t_i``. A segment with fewer than
   ``k_i`` interior blocks (a small one) gets ``t_i = -1`` (``-inf`` signed): all its entries are candidates.
3. **Candidates.** The entries of the interior blocks whose maximum reaches their segment's
   ``t_i``, and of the blocks across boundaries and the tail, that are at least ``t_i``: usually
   little over ``k_i`` per segment.
4. **Exact top-k among them.** Candidates ordered by segment, then by magnitude (largest first,
   equal magnitudes by position): the first ``k_i`` of each segment.

Ties at a segment's ``k_i``-th magnitude are broken by position (the lower first), where
``torch.topk`` breaks them as its kernel happens to: the selected magnitudes are the same. An inf
or a NaN anywhere in the flat sends every segment to one ``torch.topk`` of its magnitudes, which
ranks NaN and inf highest and breaks ties as it happens to (one host synchronization per call
detects them, in the block maxima and the tail).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lgc.compressors.selection import _TOPK_MAX_BLOCK, _topk_block_size, group_maxima

__all__ = ["segment_block_size", "segment_topk"]


def segment_block_size(numel: int, k: int) -> int:
    """:func:`~lgc.compressors.selection.topk_indices`'s block: a power of two near ``numel / (8 k)`` in ``[4, 128]``.

    Then there are about ``8 k`` blocks or more (fewer where the block stops at 4, at densities
    above about 3 %): a segment of average density has several times more interior blocks than
    entries to keep, so its threshold excludes most blocks.
    """
    return _topk_block_size(numel, k) if k > 0 else _TOPK_MAX_BLOCK


def segment_topk(
    values: Tensor, numels: Sequence[int], ks: Sequence[int], block: int | None = None, *, signed: bool = False
) -> Tensor:
    """Positions in ``values`` of every segment's ``k`` entries of largest magnitude, exactly.

    Args:
        values: a flat tensor, the segments laid end to end (a DDP bucket's parameters).
        numels: each segment's length; they sum to ``values.numel()``.
        ks: how many entries to keep of each segment (``0 <= k <= numel``).
        block: the block length of step 1 (default :func:`segment_block_size` of the totals).
        signed: the ``k`` largest entries instead of magnitudes (``-values`` for the smallest: SBC's
            two sides): the same bound over the blocks' maxima, ties again by position.

    Returns:
        int64 positions, segment by segment in the order given, ``ks[i]`` of segment ``i``, each
        segment's largest magnitude (value) first.

    Raises:
        ValueError: ``numels`` do not sum to ``values.numel()``, a ``k`` is outside ``[0, numel]``, or
            ``block`` is below 1.
    """
    values = values.detach().reshape(-1)
    n, segments = values.numel(), len(numels)
    if sum(numels) != n or len(ks) != segments:
        raise ValueError(f"numels must sum to values.numel() ({n}) with one k each, got {sum(numels)} and {len(ks)} ks")
    bad = [(i, k, m) for i, (k, m) in enumerate(zip(ks, numels, strict=True)) if not 0 <= k <= m]
    if bad:
        raise ValueError(f"every k must lie in [0, numel]; segment {bad[0][0]} has k={bad[0][1]}, numel={bad[0][2]}")
    if block is not None and block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    device = values.device
    if n == 0 or sum(ks) == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    b = block if block is not None else segment_block_size(n, sum(ks))
    sizes = torch.tensor(list(numels), dtype=torch.int64, device=device)
    k = torch.tensor(list(ks), dtype=torch.int64, device=device)
    ends = sizes.cumsum(0)
    starts = ends - sizes

    # 1. Block maxima; the interior blocks of each segment and their place in its row.
    blocks = n // b
    # max(amax, -amin) per row (signed: amax): no gradient-sized |x| is written (NaN and inf show through).
    rows_view = values[: blocks * b].view(blocks, b)
    maxima = rows_view.amax(1) if signed else group_maxima(rows_view, 1)
    # Below every entry: what a row is padded with, and the threshold of a segment that keeps all.
    floor = float("-inf") if signed else -1.0
    first = torch.div(starts + b - 1, b, rounding_mode="floor")  # a segment's first interior block
    last = torch.div(ends, b, rounding_mode="floor")  # one past its last
    interior = (last - first).clamp(min=0)
    block_start = torch.arange(blocks, device=device) * b
    owner = torch.searchsorted(ends, block_start, right=True).clamp(max=segments - 1)
    inside = (block_start >= starts[owner]) & (block_start + b <= ends[owner])

    # A non-finite magnitude anywhere: every segment through torch.topk (NaN and inf ranked highest).
    tail = values[blocks * b :]
    finite = torch.isfinite(maxima).all()
    if tail.numel():
        finite &= torch.isfinite(tail).all()
    if not bool(finite):
        return _per_segment(values if signed else values.abs(), numels, ks)

    # 2. Per segment, the k-th largest of its interior maxima (-1 where it has fewer than k).
    if device.type != "cpu":
        thresholds = _thresholds_padded(maxima, numels, ks, b, floor)
    else:
        thresholds = _thresholds_by_class(maxima, k, first, interior, owner, inside, floor)
    thresholds = torch.where(k == 0, torch.full_like(thresholds, float("inf")), thresholds)

    # 3. Candidates: interior blocks reaching their threshold, every other block and the tail.
    keep = ~inside | (maxima >= thresholds[owner])
    chosen_blocks = torch.nonzero(keep).squeeze(1)
    positions = (chosen_blocks.unsqueeze(1) * b + torch.arange(b, device=device)).reshape(-1)
    if tail.numel():
        positions = torch.cat([positions, torch.arange(blocks * b, n, device=device)])
    segment = torch.searchsorted(ends, positions, right=True)
    candidate = values[positions] if signed else values[positions].abs()
    hit = candidate >= thresholds[segment]
    positions, segment, candidate = positions[hit], segment[hit], candidate[hit]

    # 4. By segment, then magnitude (largest first; equal ones in position order): the first k of each.
    order = torch.argsort(candidate, descending=True, stable=True)
    order = order[torch.argsort(segment[order], stable=True)]
    positions, segment = positions[order], segment[order]
    rank = torch.arange(segment.numel(), device=device) - torch.searchsorted(segment, segment)
    return positions[rank < k[segment]]


def _thresholds_by_class(
    maxima: Tensor,
    k: Tensor,
    first: Tensor,
    interior: Tensor,
    owner: Tensor,
    inside: Tensor,
    floor: float = -1.0,
) -> Tensor:
    """Step 2 in padded ``(segments, blocks)`` matrices, one per power of two of the segments' interior blocks.

    The padding stays under the blocks themselves; each matrix costs a few host synchronizations.
    """
    segments, device = k.numel(), maxima.device
    thresholds = torch.full((segments,), floor, dtype=maxima.dtype, device=device)
    ranked = (interior >= k) & (k > 0)
    size_class = torch.where(ranked, torch.log2(interior.clamp(min=1).float()).ceil().long(), -1)
    ids = torch.nonzero(inside).squeeze(1)
    id_class = size_class[owner[ids]]
    for c in torch.unique(size_class[ranked]).tolist():
        members = torch.nonzero(size_class == c).squeeze(1)
        row_of = torch.full((segments,), -1, dtype=torch.int64, device=device)
        row_of[members] = torch.arange(members.numel(), device=device)
        width = int(interior[members].max())
        rows = torch.full((members.numel(), width), floor, dtype=maxima.dtype, device=device)
        mine = ids[id_class == c]
        rows[row_of[owner[mine]], mine - first[owner[mine]]] = maxima[mine]
        top = torch.topk(rows, int(k[members].max()), dim=1).values
        thresholds[members] = top.gather(1, (k[members] - 1).unsqueeze(1)).squeeze(1)
    return thresholds


#: A padded matrix of :func:`_thresholds_padded` holds at most this many times its rows' interior
#: blocks, or _PADDED_FREE_ENTRIES entries, whichever is more (ResNet-50 at density 0.1 %: one
#: matrix of 161 rows x 36,864 blocks, 5.9 M entries; at 1 %, 47 M entries, split in several).
_MAX_PADDING = 2
_PADDED_FREE_ENTRIES = 1 << 24


def _thresholds_padded(maxima: Tensor, numels: Sequence[int], ks: Sequence[int], b: int, floor: float = -1.0) -> Tensor:
    """Step 2 in padded ``(segments, blocks)`` matrices, without a host synchronization.

    Every segment's interior blocks follow from ``numels`` and ``b``, which the host knows, so a
    matrix is one gather of the maxima (int32 positions). The ranked segments, widest first, fill
    one matrix while it stays within ``_MAX_PADDING`` times their interior blocks or within
    ``_PADDED_FREE_ENTRIES`` entries, then the next: one matrix for most models (a few kernels),
    and never a matrix of mostly padding (one very large segment among many ranked small ones):
    each matrix holds at most twice its rows' blocks or 16 M entries (about 13 bytes an entry at
    the peak: gather positions, gathered maxima, mask, padded rows).
    """
    device = maxima.device
    thresholds = torch.full((len(numels),), floor, dtype=maxima.dtype, device=device)
    start, ranked = 0, []
    for i, (numel, k) in enumerate(zip(numels, ks, strict=True)):
        first, last = -(-start // b), (start + numel) // b
        if k > 0 and last - first >= k:
            ranked.append((last - first, first, k, i))
        start += numel
    ranked.sort(reverse=True)
    groups: list[list[tuple[int, int, int, int]]] = []
    blocks = 0  # the interior blocks of the rows of the last group
    for row in ranked:
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * group[0][0] <= max(_MAX_PADDING * (blocks + row[0]), _PADDED_FREE_ENTRIES):
            group.append(row)
            blocks += row[0]
        else:
            groups.append([row])
            blocks = row[0]
    last_block = maxima.numel() - 1
    for group in groups:
        width = group[0][0]
        width_t, first_t, k_t, rows_t = (
            torch.tensor(x, dtype=torch.int32 if j < 2 else torch.int64).to(device, non_blocking=True)
            for j, x in enumerate(zip(*group, strict=True))
        )
        column = torch.arange(width, dtype=torch.int32, device=device)
        gather = (first_t.unsqueeze(1) + column).clamp_(max=last_block)
        rows = torch.where(column < width_t.unsqueeze(1), maxima[gather], floor)
        top = torch.topk(rows, max(r[2] for r in group), dim=1).values
        thresholds[rows_t] = top.gather(1, (k_t - 1).unsqueeze(1)).squeeze(1)
    return thresholds


def _per_segment(magnitudes: Tensor, numels: Sequence[int], ks: Sequence[int]) -> Tensor:
    """One ``torch.topk`` per segment (NaN and inf ranked highest), largest first, as positions in the flat."""
    out, offset = [], 0
    for numel, k in zip(numels, ks, strict=True):
        if k:
            out.append(torch.topk(magnitudes[offset : offset + numel], k).indices + offset)
        offset += numel
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device=magnitudes.device)
