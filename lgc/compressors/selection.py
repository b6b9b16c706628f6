"""Exact selection of the largest entries without a full top-k: the kernels top-k, SBC and DGC share.

A ``torch.topk`` over a large 1-D tensor runs on one CPU thread and is many times slower than a
pass over memory. Three methods need the largest entries of every gradient, each with its own
rule, and each is made fast the same way, with one streaming reduction (block or column maxima)
followed by work proportional to ``k``:

1. **Top-k by magnitude** (:func:`topk_indices`; top-k, LGC's leader, the shared-index codecs):
   group maxima (blocks of consecutive entries, or columns when dense) bound the ``k``-th largest
   magnitude, and only the ``k`` best groups are searched.
2. **SBC's two sides** (:func:`extreme_sides`): the ``k`` largest and the ``k`` smallest entries,
   signed, through the same block bound on each side.
3. **DGC's sampled threshold** (:func:`sampled_topk`): the paper's threshold estimated from a
   strided sample, its survivors counted after one column scan (:class:`ColumnScan`) that the
   compressor runs span by span while it accumulates.

Why one module: the three share their idea, their measurements and their tests' shape.

SBC's block bound, in detail. The tempting shortcut, one top-k of ``|v|`` split by sign, is *not*
equivalent: with ``k = 10``, one entry ``+100``, nine entries ``+0.1`` and ten entries ``-5``, the
ten largest magnitudes are ``+100`` and nine ``-5`` s, yet SBC's positive side wins
(``mu+ = 10.09 > mu- = 5``) and must send the nine ``+0.1`` entries too. Instead each side is found
exactly through a bound on blocks of ``B`` consecutive entries (``B`` up to 64):

1. One reduction pass gives every block's maximum (``amax``; ``amin`` for the negative side).
2. Let ``b_k`` be the ``k``-th largest block maximum. The ``k`` blocks with the largest maxima
   hold ``k`` distinct entries ``>= b_k``, so the ``k``-th largest entry ``tau`` is ``>= b_k``; and
   an entry ``>= tau`` lies in a block whose maximum is ``>= tau``, i.e. among those ``k`` blocks
   (ties included: a block left out has maximum ``<= b_k <= tau``, and enough kept blocks then
   have maximum exactly ``tau``). So the ``k`` largest entries of ``v`` are the ``k`` largest of
   the entries ``>= b_k`` in those ``k`` blocks.
3. Gather those ``k * B`` entries, keep the ones ``>= b_k`` (for gradient-like tensors barely
   more than ``k``: 26,343 for ``k = 25,558``), and run an exact top-k over that short list.

From ``B = 16`` down (density above about 0.8 %) the groups are the columns of a ``(B, n / B)``
view instead (``B`` entries ``n / B`` apart): the same bound over another partition, with a
reduction that runs along memory (one over rows of 16 does not vectorize; 1.5x less for SBC's
round trip of ResNet-50's gradients at density 0.01).

The result equals two full ``torch.topk`` calls (up to which of several equal entries is taken),
with no sampling, no retries and no randomness; the cost is two streaming reductions plus work
proportional to ``k * B``. On CPU everything after the reductions runs in numpy (introselect
instead of ``torch.topk``, less per-call overhead); on other devices in torch, with the same result.
At 25.6 M entries and density 0.001 the selection costs less than half an fp16 round trip.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ColumnScan",
    "SelectionInfo",
    "StartDraw",
    "Side",
    "dgc_sample_layout",
    "exact_topk",
    "extreme_sides",
    "group_maxima",
    "sampled_topk",
    "sbc_block_size",
    "side_numpy",
    "side_torch",
    "topk_grouping",
    "topk_indices",
]

# -- 1. top-k by magnitude ---------------------------------------------------------------------------
#: Tensors at least this large use the block-maximum selection; smaller ones call torch.topk directly.
_BLOCK_SELECTION_MIN_NUMEL = 1 << 15
#: Largest block of the block-maximum selection (measured best for density 0.001 on ResNet-50's shapes).
_TOPK_MAX_BLOCK = 128


def _topk_block_size(numel: int, k: int) -> int:
    """Block length for :func:`topk_indices`: a power of two near ``numel / (8 k)``, in ``[4, 128]``.

    Longer blocks make the block-maximum pass cheaper and the ``k`` candidate blocks (``k * b``
    entries, filtered with one comparison) dearer; ``k * b <= numel / 8`` keeps the candidates an
    eighth of the tensor at most. Measured on a 2-core CPU for 65k to 2.4M entries, this is within
    10 % of the best power of two at densities 0.001 and 0.01, and 1.2 to 2x faster than the
    ``sqrt(numel / k)`` blocks that balance the two top-k calls.
    """
    return 1 << min(max(2, (numel // (8 * k)).bit_length() - 1), _TOPK_MAX_BLOCK.bit_length() - 1)


def topk_indices(values: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` entries of largest magnitude, exactly (in no particular order).

    ``torch.topk`` over a large 1-D tensor runs on one CPU thread and is many times slower than a
    pass over memory. For large tensors this uses group maxima instead: split the entries into
    groups of ``b`` and take every group's largest magnitude. The k largest entries all lie in the
    k groups with the largest maxima: those k maxima are k distinct entries, so the k-th largest
    entry is at least the k-th largest group maximum ``t``, and a group holding a top-k entry has a
    maximum at least that large. So only entries of those k groups (and of the tail that does not
    fill a group) with magnitude at least ``t`` can be chosen, usually little over ``k`` of them,
    and an exact top-k over those is the exact answer. Any partition into groups will do; two are
    used, whichever is cheaper at the density:

    - **Blocks** of ``b`` consecutive entries (``b`` from 32 up, density below about 0.4 %): the
      maxima are ``amax`` and ``amin`` over the rows of an ``(n / b, b)`` view (on the CPU the pair
      is several times faster than one ``aminmax(dim=1)`` or an infinity norm, which do not
      vectorize), and the k candidate blocks are gathered as whole rows.
    - **Columns** of an ``(b, n / b)`` view (``b`` of 8 or 16, denser): a reduction over short rows
      does not vectorize (at ``b = 8`` it costs three to five times one over the columns, which
      runs along memory), while gathering ``k`` columns costs ``k * b`` scattered reads; at these
      densities the reduction dominates.

    The search after the maxima stays in torch on the CPU too: finished in numpy it measured 25-40 %
    faster alone but 8 % slower in top-k's round trip at density 0.01 (its large temporaries), the
    same at 0.001. A tensor holding an inf or a NaN (rare: the DDP hook's step guard keeps them out)
    takes one ``torch.topk`` of its magnitudes, so it selects as ``torch.topk`` does (NaN largest).

    On a GPU it is one ``torch.topk`` of the magnitudes: the search's host synchronizations (the
    finite check, ``nonzero``) stall the device for more than the radix selection costs (measured on
    an H200 over ResNet-50's 161 tensors: error feedback, selection and decoding per tensor took
    51 ms through the search, 24 ms through ``torch.topk`` alone).
    """
    values = values.detach()
    grouping = topk_grouping(values, k)
    if grouping is None:
        return torch.topk(values.abs(), k, sorted=False).indices
    return _topk_in_groups(values, k, *grouping)


def topk_grouping(values: Tensor, k: int) -> tuple[Tensor, int] | None:
    """The groups :func:`topk_indices` bounds the ``k``-th magnitude of ``values`` by, or ``None``.

    A 2-D view of ``values`` (its first ``rows * cols`` entries) and the dimension along which a
    group runs (``1``: rows are blocks of consecutive entries; ``0``: columns); :func:`group_maxima`
    of that view is the one streaming pass the selection makes. ``None`` where ``torch.topk`` of
    the magnitudes is taken directly (off the CPU, small tensors, high densities).
    """
    numel = values.numel()
    block = _topk_block_size(numel, k) if k else 1
    if values.device.type != "cpu" or numel < _BLOCK_SELECTION_MIN_NUMEL or 8 * k * block > numel:
        return None
    if block <= _COLUMN_GROUPS_MAX_ROW_BLOCK:
        group = min(2 * block, _COLUMN_GROUPS_MAX)
        width = numel // group
        return values[: width * group].view(group, width), 0
    num_blocks = numel // block
    return values[: num_blocks * block].view(num_blocks, block), 1


def group_maxima(grouped: Tensor, dim: int) -> Tensor:
    """Every group's largest magnitude (NaN where a group holds one), groups along ``dim`` of ``grouped``.

    ``amax`` and ``amin`` rather than one ``abs().amax()``: on the CPU the pair is several times
    faster than ``aminmax(dim=...)`` or an infinity norm, which do not vectorize along short rows.
    """
    return torch.maximum(grouped.amax(dim=dim), grouped.amin(dim=dim).neg_())


#: Row blocks at most this long (density above about 0.4 %) select through column groups instead.
_COLUMN_GROUPS_MAX_ROW_BLOCK = 16
#: Largest column group: its ``k * b`` candidates stay a sixth of the tensor at density 1 %.
_COLUMN_GROUPS_MAX = 16


def _topk_in_groups(values: Tensor, k: int, grouped: Tensor, dim: int) -> Tensor:
    """:func:`topk_indices` with the slices of the 2-D view ``grouped`` along ``dim`` as the groups.

    ``dim=1``: the rows are the groups (blocks); ``dim=0``: the columns are. Each kept entry's
    position in ``values`` follows from the view's strides; the entries past the view (the tail that
    fills no group) are searched directly.
    """
    across = 1 - dim
    group_max = group_maxima(grouped, dim)
    top_groups = torch.topk(group_max, k, sorted=False)
    tail = values[grouped.numel() :]
    # A non-finite group maximum is among the top k (torch.topk ranks NaN and inf highest): checking
    # those k costs less than checking every group.
    if not bool(top_groups.values.isfinite().all()) or (tail.numel() and not bool(tail.isfinite().all())):
        return _topk_nonfinite(values, k)
    threshold = top_groups.values.min()
    magnitudes = grouped.index_select(across, top_groups.indices).abs_()
    kept = (magnitudes >= threshold).nonzero()
    coordinates = list(kept.unbind(1))
    magnitudes = magnitudes[coordinates[0], coordinates[1]]
    coordinates[across] = top_groups.indices[coordinates[across]]
    positions = coordinates[0] * grouped.stride(0) + coordinates[1] * grouped.stride(1)
    covered = grouped.numel()
    if covered < values.numel():
        tail = tail.abs()
        tail_kept = (tail >= threshold).nonzero().squeeze(1)
        magnitudes = torch.cat([magnitudes, tail[tail_kept]])
        positions = torch.cat([positions, tail_kept + covered])
    return positions[torch.topk(magnitudes, k, sorted=False).indices]


def _topk_nonfinite(values: Tensor, k: int) -> Tensor:
    """``torch.topk`` of the magnitudes, for a tensor holding an inf or a NaN.

    A group bound cannot order them as ``torch.topk`` does (a NaN above every number, and above
    inf, which no finite bound separates from the largest float); such a tensor is rare enough to
    take the plain top-k.
    """
    return torch.topk(values.abs(), k, sorted=False).indices


# -- 2. SBC's two sides ------------------------------------------------------------------------------
#: Largest block of the block-maximum bound. Larger blocks make the reduction's output and the
#: top-k over it smaller but gather ``k * B`` entries afterwards; 64 balances both at density 0.001.
_SBC_MAX_BLOCK = 64
#: Smallest useful block: below it the bound saves too little over a top-k of the whole tensor.
_SBC_MIN_BLOCK = 8
#: Dtypes whose selection finishes in numpy on CPU (numpy has no bfloat16; those go through torch).
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
#: Tensors smaller than this take the direct path (a top-k of each side over the whole tensor).
_MIN_BLOCKED_NUMEL = 1 << 15
#: Groups of at most this many entries are columns (:func:`_groups`; density above about 0.8 %).
_SBC_COLUMN_GROUPS_MAX = 16


def sbc_block_size(numel: int, k: int) -> int:
    """Block length for the bound of :func:`~lgc.compressors.sbc.sbc_select`; 1 means two top-k calls over the tensor.

    The gathered blocks hold ``k * B`` entries per side; capping them at a quarter of the tensor
    keeps the bound cheaper than the direct path (``B = 64`` at density 0.001, 16 at 0.01, direct
    above about 3 %).
    """
    if numel < _MIN_BLOCKED_NUMEL:
        return 1
    block = _SBC_MAX_BLOCK
    while block >= _SBC_MIN_BLOCK and 4 * k * block > numel:
        block //= 2
    return block if block >= _SBC_MIN_BLOCK else 1


def _first_k(values: Tensor, kth: Tensor, k: int, largest: bool) -> Tensor:
    """Mask of exactly ``k`` entries: all beyond the ``k``-th value ``kth``, then the first ones equal to it."""
    beyond = values > kth if largest else values < kth
    tied = values == kth
    return beyond | (tied & (torch.cumsum(tied, 0) <= k - beyond.count_nonzero()))


def _first_k_numpy(values: np.ndarray, kth: Any, k: int, largest: bool) -> np.ndarray:
    """:func:`_first_k` in numpy; the cumulative count is only needed when there are surplus ties."""
    beyond = values > kth if largest else values < kth
    tied = values == kth
    missing = k - np.count_nonzero(beyond)
    if np.count_nonzero(tied) <= missing:
        return beyond | tied
    return beyond | (tied & (np.cumsum(tied) <= missing))


def _kth_numpy(values: np.ndarray, k: int, largest: bool) -> Any:
    """The ``k``-th largest (smallest) entry, ``np.partition``'s, without its slowdown on a mass of zeros.

    Introselect slows down 10-30x when the value it looks for is repeated many times, and the value
    a gradient repeats is zero (parameters a batch did not touch, a residual not yet filled, a
    mostly-zero block bound). So the entries beyond zero on the wanted side are selected alone; when
    fewer than ``k``, the answer is zero, or lies among the entries beyond zero on the other side.
    For finite ``values`` (:func:`extreme_sides` sends a tensor holding an inf or a NaN elsewhere).
    """
    wanted = values > 0 if largest else values < 0
    count = np.count_nonzero(wanted)
    if count < k:
        zeros = np.count_nonzero(values == 0)
        if count + zeros >= k:
            return values.dtype.type(0)
        wanted, k = (values < 0 if largest else values > 0), k - count - zeros
    part = values[wanted]
    rank = part.size - k if largest else k - 1
    return np.partition(part, rank)[rank]


class Side(NamedTuple):
    """One side of SBC's comparison."""

    #: Sum of the side's ``k`` entries (in float64).
    total: float
    #: Computes the side's ``k`` positions, ascending; only called for the side that is sent.
    positions: Callable[[], Tensor]


def side_numpy(values: Tensor, k: int, block: int, largest: bool, columns: bool = False) -> Side:
    """The ``k`` largest (smallest) entries of a CPU tensor: group maxima in torch, the rest in numpy.

    Only the group reduction runs over the whole tensor (multi-threaded); everything after it
    touches ``O(k * block)`` entries, where numpy's introselect (``np.partition``) and its small
    array operations cost several times less than ``torch.topk`` and torch's per-call overhead.
    ``block`` entries per group: consecutive ones (rows), or with ``columns`` the columns of a
    ``(block, n / block)`` view (:func:`_groups`); 1 means no groups (the whole tensor).
    """
    if block == 1:
        positions, candidates = None, values.numpy()
    else:
        grouped, extremes, tail = _groups(values, block, largest, columns)
        _check_bound(extremes, tail, largest)
        positions, candidates = _gather_numpy(grouped.numpy(), extremes.numpy(), tail.numpy(), k, largest, columns)
    kth = _kth_numpy(candidates, k, largest)
    beyond = candidates[candidates > kth if largest else candidates < kth]
    # The k entries: those beyond the k-th value, and the k-th value as often as they fall short.
    total = float(beyond.sum(dtype=np.float64) + (k - beyond.size) * np.float64(kth))

    def kept() -> Tensor:
        chosen = np.flatnonzero(_first_k_numpy(candidates, kth, k, largest))
        return torch.from_numpy(chosen if positions is None else positions[chosen])

    return Side(total, kept)


def side_torch(values: Tensor, k: int, block: int, largest: bool, columns: bool = False) -> Side:
    """:func:`side_numpy` in torch, for accelerators and dtypes numpy lacks (same result)."""
    if block == 1:
        positions, candidates = None, values
    else:
        grouped, extremes, tail = _groups(values, block, largest, columns)
        _check_bound(extremes, tail, largest)
        positions, candidates = _gather_torch(grouped, extremes, tail, k, largest, columns)
    top = torch.topk(candidates, k, largest=largest, sorted=False).values
    kth = top.min() if largest else top.max()
    total = float(top.sum(dtype=torch.float64))

    def kept() -> Tensor:
        chosen = torch.nonzero(_first_k(candidates, kth, k, largest)).squeeze(1)
        return chosen if positions is None else positions[chosen]

    return Side(total, kept)


def _groups(values: Tensor, block: int, largest: bool, columns: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The groups of ``block`` entries as a 2-D view, each group's maximum (minimum), and the leftover entries.

    Rows (``columns=False``): an ``(n / block, block)`` view, every row ``block`` consecutive
    entries. Columns: a ``(block, n / block)`` view, every column ``block`` entries ``n / block``
    apart; its reduction runs along memory and vectorizes, where one over rows of 16 or fewer
    entries does not (three to five times slower at 8 or 16). Any partition into groups gives the
    bound of the module docstring; the leftover entries past the view count as groups of one.
    """
    if columns:
        width = values.numel() // block
        grouped = values[: block * width].view(block, width)
        extremes = grouped.amax(0) if largest else grouped.amin(0)
    else:
        grouped = values[: values.numel() // block * block].view(-1, block)
        extremes = grouped.amax(1) if largest else grouped.amin(1)
    return grouped, extremes, values[grouped.numel() :]


def _gather_torch(
    grouped: Tensor, extremes: Tensor, tail: Tensor, k: int, largest: bool, columns: bool = False
) -> tuple[Tensor, Tensor]:
    """Ascending positions and values of the entries beyond the bound ``b_k`` in exactly ``k`` groups.

    The bound of the module docstring over :func:`_groups`'s groups; leftover entries after the
    view count as groups of one. Rows are gathered whole; columns as a ``(block, m)`` matrix whose
    row-major order is memory order, so both give ascending positions.
    """
    num_groups = extremes.numel()
    both = torch.cat([extremes, tail]) if tail.numel() else extremes
    top = torch.topk(both, k, largest=largest, sorted=False).values
    bound = top.min() if largest else top.max()
    chosen = torch.nonzero(_first_k(both, bound, k, largest)).squeeze(1)  # exactly k groups, ascending
    num_full = int(torch.searchsorted(chosen, num_groups))
    group_ids, tail_ids = chosen[:num_full], chosen[num_full:] - num_groups
    entries = grouped.index_select(1 if columns else 0, group_ids).reshape(-1)
    flat = torch.nonzero(entries >= bound if largest else entries <= bound).squeeze(1)
    positions = _positions(flat, group_ids, grouped, columns)
    candidates = entries[flat]
    if tail_ids.numel():  # a leftover entry chosen as a group is beyond the bound by construction
        positions = torch.cat([positions, grouped.numel() + tail_ids])
        candidates = torch.cat([candidates, tail[tail_ids]])
    return positions, candidates


def _positions(flat: Any, group_ids: Any, grouped: Any, columns: bool) -> Any:
    """Positions in the tensor of entries ``flat`` of the gathered groups ``group_ids`` (torch or numpy)."""
    if columns:  # a (block, m) matrix of the chosen columns: row r, column j is r * width + group_ids[j]
        return flat // group_ids.shape[0] * grouped.shape[1] + group_ids[flat % group_ids.shape[0]]
    return group_ids[flat // grouped.shape[1]] * grouped.shape[1] + flat % grouped.shape[1]


def _gather_numpy(
    grouped: np.ndarray, extremes: np.ndarray, tail: np.ndarray, k: int, largest: bool, columns: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_gather_torch` in numpy (the same arrays, bit for bit)."""
    num_groups = extremes.size
    both = np.concatenate([extremes, tail]) if tail.size else extremes
    bound = _kth_numpy(both, k, largest)
    chosen = np.flatnonzero(_first_k_numpy(both, bound, k, largest))
    num_full = int(np.searchsorted(chosen, num_groups))
    group_ids, tail_ids = chosen[:num_full], chosen[num_full:] - num_groups
    # np.take: several times faster than fancy indexing
    entries = np.take(grouped, group_ids, axis=1 if columns else 0).reshape(-1)
    flat = np.flatnonzero(entries >= bound if largest else entries <= bound)
    positions = _positions(flat, group_ids, grouped, columns)
    candidates = entries[flat]
    if tail_ids.size:
        positions = np.concatenate([positions, grouped.size + tail_ids])
        candidates = np.concatenate([candidates, tail[tail_ids]])
    return positions.astype(np.int64, copy=False), candidates


def extreme_sides(values: Tensor, k: int) -> tuple[Side, Side]:
    """The ``k`` largest and the ``k`` smallest entries of ``values`` (flat), exactly, without a full top-k.

    SBC's two sides (:func:`~lgc.compressors.sbc.sbc_select` compares their means). Equal to
    ``torch.topk(v, k)`` and ``torch.topk(-v, k)`` up to which of several equal entries is taken
    (the first ones in memory order), through the block bound of the module docstring; on CPU
    everything after the reductions runs in numpy, elsewhere in torch, with the same result.

    A tensor holding an inf or a NaN takes the reference's two ``torch.topk`` calls
    (:func:`_sides_nonfinite`): a NaN then ranks first on both sides and makes both means NaN, as
    in the reference. The block path sees one in the group maxima (minima) it computes anyway
    (a NaN propagates through the reduction), the direct path in the sides' sums.
    """
    block = sbc_block_size(values.numel(), k)
    on_numpy = values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES
    try:
        if on_numpy and block == 1:
            sides = _both_sides_numpy(values, k)
        else:
            side = side_numpy if on_numpy else side_torch
            columns = block <= _SBC_COLUMN_GROUPS_MAX
            sides = side(values, k, block, True, columns), side(values, k, block, False, columns)
    except _NonFinite:
        return _sides_nonfinite(values, k)
    if not all(math.isfinite(side.total) for side in sides):
        return _sides_nonfinite(values, k)
    return sides


class _NonFinite(Exception):
    """A side's group bound met an inf or a NaN (:func:`extreme_sides` then takes :func:`_sides_nonfinite`)."""


def _check_bound(extremes: Tensor, tail: Tensor, largest: bool) -> None:
    """Raise :class:`_NonFinite` when the groups' maxima (minima) or the leftover entries hold an inf or a NaN.

    The largest of the maxima is NaN when any group holds a NaN and inf when one holds +inf; a
    -inf shows in the other side's minima, and :func:`extreme_sides` always computes both.
    """
    for part in (extremes, tail):
        if part.numel() and not bool(torch.isfinite(part.max() if largest else part.min())):
            raise _NonFinite


def _sides_nonfinite(values: Tensor, k: int) -> tuple[Side, Side]:
    """SBC's two sides as its reference computes them, ``torch.topk(v, k)`` and ``torch.topk(-v, k)``.

    For a tensor holding an inf or a NaN, which the block bound cannot order as ``torch.topk``
    does (a NaN above every number on both sides); rare enough to take the plain top-k calls.
    """

    def side(signed: Tensor, sign: float) -> Side:
        top = torch.topk(signed, k, sorted=False)
        positions = top.indices.sort().values
        return Side(sign * float(top.values.sum(dtype=torch.float64)), lambda: positions)

    return side(values, 1.0), side(-values, -1.0)


def _both_sides_numpy(values: Tensor, k: int) -> tuple[Side, Side]:
    """:func:`side_numpy`'s two direct sides (no blocks) from one ``np.partition`` with both ranks.

    The tensors below the block bound's size are most of a model's tensors and each costs mostly
    per-call overhead: one introselect places both the ``k``-th smallest and the ``k``-th largest.
    The sides' sums are float64 sums of the same ``k`` entries as :func:`side_numpy`'s.
    """
    candidates = values.numpy()
    high, low = candidates.size - k, k - 1
    part = np.partition(candidates, [low, high] if low < high else [high, low])

    def side(rank: int, chosen: np.ndarray, largest: bool) -> Side:
        kth = part[rank]
        return Side(
            float(chosen.sum(dtype=np.float64)),
            lambda: torch.from_numpy(np.flatnonzero(_first_k_numpy(candidates, kth, k, largest))),
        )

    return side(high, part[high:], True), side(low, part[:k], False)


# -- 3. DGC's sampled threshold ----------------------------------------------------------------------
#: Survivor-count window of the sampled threshold (the paper's and its code's bounds): above
#: ``_UPPER * k`` an exact top-k over the survivors cuts them to ``k``; below ``_LOWER * k`` the
#: threshold is multiplied by ``_LOWER`` and the count retried, at most ``_MAX_ROUNDS`` times.
_UPPER = 1.3
_LOWER = 0.8
_MAX_ROUNDS = 10
#: Rows of the grid each span is viewed as (see ``ColumnScan``): with 8-16 rows a column-wise
#: max costs about one read of the span, and a candidate column costs 16 gathered entries.
_ROWS = 16
#: Elements per span of the accumulation pass on a single-threaded CPU: the ``u``, ``g`` and ``v``
#: slices of a span (4 MB each) stay in cache from the momentum update through the accumulation to
#: the column scan, which cuts that pass by 15-40 % on a 25M-element tensor (2^18-2^20 measured
#: best). With several intra-op threads every operation on a span opens a parallel region, and on
#: a machine busier than its cores each region waits for a descheduled thread (measured 3-5x
#: slower in total), so multi-threaded CPUs and accelerators take the whole tensor as one span.
_CPU_CHUNK = 1 << 20


@dataclass(frozen=True)
class SelectionInfo:
    """How :func:`sampled_topk` chose the entries it returned (for tests and diagnostics)."""

    #: ``"all"`` (k == n), ``"exact"`` (torch.topk over the whole tensor), ``"threshold"``
    #: (everything at or above the final threshold) or ``"threshold+topk"`` (exact top-k over the
    #: survivors of the final threshold).
    path: str
    #: Target count ``k``.
    k: int
    #: Entries at or above the final threshold (``numel`` for ``"all"``/``"exact"``).
    survivors: int
    #: How many times the threshold was lowered by ``x0.8``.
    rounds: int
    #: The final threshold (``nan`` for ``"all"``/``"exact"``).
    threshold: float


class ColumnScan:
    """Finds ``{i : |x[i]| >= t}`` for several thresholds ``t`` after a single pass over ``x``.

    ``x`` is cut into spans of at most ``_CPU_CHUNK`` elements (see there), whole
    multiples of ``_ROWS``, each viewed as a ``(_ROWS, cols)`` grid; :meth:`scan` stores the
    largest magnitude of every grid column (two reductions along the outer dimension, ``amax`` and
    ``amin``). A survivor can only sit in a column whose maximum reaches ``t``: those columns are
    gathered (``_ROWS`` entries each) and compared, so every count after the scan costs O(k), not
    another pass. When many columns qualify (large densities: warm-up) one full mask is cheaper
    and is used instead. The last ``n % _ROWS`` entries belong to no grid and are compared directly.

    The compressor calls :meth:`scan` on each span right after accumulating it, while it is in cache.
    """

    def __init__(self, x: Tensor, chunk: int | None = None) -> None:
        self.x = x
        n = x.numel()
        if chunk is None:
            chunk = _CPU_CHUNK if x.device.type == "cpu" and torch.get_num_threads() == 1 else n
        chunk = max(_ROWS, chunk)
        starts, cols = [], []
        start = 0
        while n - start >= _ROWS:
            size = min(chunk, (n - start) // _ROWS * _ROWS)
            starts.append(start)
            cols.append(size // _ROWS)
            start += size
        #: Element ranges to accumulate and scan, in order; a last one without a grid holds the tail.
        self.spans = [(a, a + c * _ROWS) for a, c in zip(starts, cols, strict=True)]
        self.tail = start
        if start < n:
            self.spans.append((start, n))
        self._span_cols = cols
        self._col_starts = [0]
        for c in cols:
            self._col_starts.append(self._col_starts[-1] + c)
        self._col_max = x.new_empty(self._col_starts[-1])
        self._col_min = x.new_empty(self._col_starts[-1])
        self._col_abs_max: Tensor | None = None

    def scan(self, span: int) -> None:
        """Record the column extremes of span number ``span`` (a no-op for the tail)."""
        if span >= len(self._span_cols):
            return
        start, stop = self.spans[span]
        grid = self.x[start:stop].view(_ROWS, self._span_cols[span])
        cols = slice(self._col_starts[span], self._col_starts[span + 1])
        # Written in place: few operations per span (each may start a parallel region, which is
        # costly on a busy machine); |.| is formed once for all spans in col_abs_max.
        torch.amax(grid, dim=0, out=self._col_max[cols])
        torch.amin(grid, dim=0, out=self._col_min[cols])

    @property
    def col_abs_max(self) -> Tensor:
        """Largest magnitude of every grid column (after every span was scanned)."""
        if self._col_abs_max is None:
            # torch.linalg.vector_norm(ord=inf, dim=0) would do it in one go but is ~10x slower on CPU.
            self._col_abs_max = torch.maximum(self._col_max, self._col_min.neg_())
        return self._col_abs_max

    def scan_all(self) -> ColumnScan:
        for span in range(len(self.spans)):
            self.scan(span)
        return self

    def __call__(self, threshold: float) -> Tensor:
        """int64 positions of the entries with ``|x| >= threshold`` (in no particular order)."""
        x = self.x
        if not self._span_cols:
            return torch.nonzero(x.abs() >= threshold).view(-1)
        columns = torch.nonzero(self.col_abs_max >= threshold).view(-1)
        if columns.numel() * 4 > self.col_abs_max.numel():
            return torch.nonzero(x.abs() >= threshold).view(-1)
        device = x.device
        rows = torch.arange(_ROWS, device=device)
        # Entry r of column j of a span starting at a with c columns sits at a + r * c + j.
        if len(self._span_cols) == 1:
            # One span (the usual case; fewer small operations, each costly on a busy machine).
            candidates = (columns[:, None] + rows[None, :] * self._span_cols[0]).view(-1)
        else:
            col_starts = torch.tensor(self._col_starts[:-1], device=device)
            span = torch.searchsorted(col_starts, columns, right=True) - 1
            span_cols = torch.tensor(self._span_cols, device=device)[span]
            span_starts = torch.tensor([a for a, _ in self.spans[: len(self._span_cols)]], device=device)[span]
            first = span_starts + (columns - col_starts[span])
            candidates = (first[:, None] + rows[None, :] * span_cols[:, None]).view(-1)
        # index_select: about twice as fast as x[candidates] on CPU.
        positions = candidates[x.index_select(0, candidates).abs() >= threshold]
        if self.tail < x.numel():
            tail_hits = torch.nonzero(x[self.tail :].abs() >= threshold).view(-1) + self.tail
            positions = torch.cat([positions, tail_hits])
        return positions


def exact_topk(x: Tensor, k: int) -> Tensor:
    return torch.topk(x.abs(), k, sorted=False).indices


class StartDraw(Protocol):
    """What :func:`sampled_topk` draws its sample's start from: ``random.Random`` or DGC's per-key draw."""

    def randrange(self, stop: int, /) -> int: ...


def dgc_sample_layout(numel: int, density: float, sample_fraction: float = 0.01) -> tuple[int, int, int]:
    """``(num_samples, stride, top_k_samples)``: how DGC's authors sample a tensor of ``numel`` entries.

    Transcribed from synxlin/deep-gradient-compression, ``dgc/compression.py``,
    ``DGCCompressor.initialize`` (strided sampling): the sample must hold ``max(ceil(sample_fraction
    * n), ceil(2 / density))`` entries; a tensor no larger than ``ceil(2 / density)`` is taken whole
    (stride 1); otherwise the stride starts at ``ceil(n / wanted / 32) * 32 + 1`` and falls by 8 until
    ``n // stride`` entries are enough. The threshold is the smallest of the ``ceil(num_samples *
    density)`` largest sampled magnitudes. ``sample_fraction`` is clamped to ``[0.01, 1]`` as theirs is.
    """
    fraction = min(max(sample_fraction, 0.01), 1.0)
    if fraction < 1.0:
        pct_numel = math.ceil(numel * fraction)
        cpr_numel = math.ceil(2 / density)
        if numel <= cpr_numel:
            stride, num_samples = 1, numel
        else:
            wanted = max(pct_numel, cpr_numel)
            stride = math.ceil(numel / wanted / 32) * 32 + 1
            num_samples = numel // stride
            while num_samples < wanted:
                stride -= 8
                num_samples = numel // stride
    else:
        stride, num_samples = 1, numel
    return num_samples, stride, math.ceil(num_samples * density)


def sampled_topk(
    x: Tensor,
    k: int,
    *,
    density: float,
    sample_fraction: float = 0.01,
    rng: StartDraw | None = None,
    threshold: float | None = None,
    scan: ColumnScan | None = None,
) -> tuple[Tensor, SelectionInfo]:
    """Positions of about ``k = ceil(density * n)`` largest-magnitude entries of the flat tensor ``x``, as DGC's
    authors select them (synxlin/deep-gradient-compression, ``dgc/compression.py``, ``_sparsify``).

    The rule, exactly:

    1. ``k >= n``: every position. Otherwise the threshold ``t`` is the smallest of the
       ``top_k_samples`` largest magnitudes of the sample ``|x|[start::stride]``
       (:func:`dgc_sample_layout`; ``start`` drawn from ``rng``; stride 1: all of ``|x|``). Passing
       ``threshold`` skips the estimate (tests use it to drive the other branches).
    2. Survivors: ``|x| >= t``, ``c`` of them. Unless the sample was all of ``x``, the count is
       adapted at most 10 times: ``c > k``: above ``1.3 k`` an exact top-k over the survivors keeps
       exactly ``k`` (path ``"threshold+topk"``), otherwise the survivors stay; ``c < 0.8 k``:
       ``t *= 0.8`` (in ``x``'s dtype) and count again; otherwise they stay.
    3. At most ``k`` are sent: of more survivors, the first ``k`` in position order (the authors'
       ``indices[:num_selects]``; the rest stay in the accumulator).

    One departure: if nothing survives (only with NaN or an all-zero sample of a mostly-zero
    tensor), an exact top-k is sent instead of an empty payload (path ``"exact"``).

    Args:
        x: flat tensor to select from.
        k: ``ceil(density * n)``, the count sent at most.
        density: the density ``k`` comes from (the sample's size depends on it).
        sample_fraction: the fraction of entries sampled (at least 1 %, as the authors clamp it).
        rng: draws the sample's start (``randrange(stride)``); ``None`` uses Python's global generator.
        threshold: use this initial threshold instead of the sampled estimate.
        scan: the column maxima of ``x`` if the caller already computed them (the compressor does,
            fused with its accumulation pass).

    Returns:
        int64 positions and how they were chosen.
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device), SelectionInfo("all", n, n, 0, math.nan)
    num_samples, stride, top_k_samples = dgc_sample_layout(n, density, sample_fraction)
    if threshold is None:
        start = 0 if stride == 1 else (rng or random).randrange(stride)
        sample = x[start::stride].abs()
        threshold = float(torch.topk(sample, min(top_k_samples, sample.numel()), sorted=False).values.min())
    survivors_of = scan if scan is not None else ColumnScan(x).scan_all()
    positions = survivors_of(threshold)
    count, rounds, path = positions.numel(), 0, "threshold"
    while n > num_samples and rounds < _MAX_ROUNDS:
        if count > k:
            if count > _UPPER * k:
                keep = torch.topk(x.index_select(0, positions).abs(), k, sorted=False).indices
                positions, path = positions[keep], "threshold+topk"
            break
        if count >= _LOWER * k:
            break
        # The authors' threshold is a tensor of x's dtype: lowered in that precision.
        threshold = float(torch.tensor(threshold, dtype=x.dtype) * _LOWER)
        positions = survivors_of(threshold)
        count, rounds = positions.numel(), rounds + 1
    if positions.numel() == 0:
        return exact_topk(x, k), SelectionInfo("exact", k, 0, rounds, threshold)
    if path == "threshold":  # the authors' mask.nonzero(): ascending, of which the first k are sent
        positions = positions.sort().values[:k]
    return positions, SelectionInfo(path, k, count, rounds, threshold)
