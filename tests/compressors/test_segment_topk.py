"""segment_topk: every segment's exact top-k of a flat tensor at once, against torch.topk per segment."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgc.compressors import segment_topk as segment_topk_module
from lgc.compressors.segment_topk import _thresholds_by_class, _thresholds_padded, segment_block_size, segment_topk


def _reference(values: torch.Tensor, numels: list[int], ks: list[int]) -> list[torch.Tensor]:
    out, offset = [], 0
    for numel, k in zip(numels, ks, strict=True):
        out.append(torch.topk(values[offset : offset + numel].abs(), k).values)
        offset += numel
    return out


def _check(values: torch.Tensor, numels: list[int], ks: list[int], positions: torch.Tensor) -> None:
    assert positions.dtype == torch.int64 and positions.numel() == sum(ks)
    start, offset = 0, 0
    for numel, k, expected in zip(numels, ks, _reference(values, numels, ks), strict=True):
        mine = positions[start : start + k]
        assert bool(((mine >= offset) & (mine < offset + numel)).all()), "a position outside its segment"
        assert mine.unique().numel() == k
        chosen = values[mine].abs()
        assert torch.equal(chosen, chosen.sort(descending=True).values), "each segment's largest first"
        assert torch.equal(chosen, expected), "the magnitudes torch.topk keeps"
        start, offset = start + k, offset + numel


#: Segments of a flat (some empty), the fraction of each kept, the block, the values' seed, ties or not.
_SEGMENTS = {
    "numels": st.lists(st.integers(0, 2500), min_size=1, max_size=7),
    "fractions": st.lists(st.floats(0, 1), min_size=7, max_size=7),
    "block": st.sampled_from([None, 4, 8, 128]),
    "seed": st.integers(0, 2**16),
    "ties": st.booleans(),
}


@settings(max_examples=120, deadline=None)
@given(**_SEGMENTS)
def test_every_segment_keeps_what_torch_topk_keeps(numels, fractions, block, seed, ties):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(numels), generator=g)
    if ties:  # few distinct magnitudes: ties at the k-th are the rule
        values = torch.randint(-3, 4, (sum(numels),), generator=g).float()
    ks = [round(f * n) for f, n in zip(fractions, numels, strict=False)]
    _check(values, numels, ks, segment_topk(values, numels, ks, block=block))


@pytest.mark.parametrize("density", [0.001, 0.01, 0.3])
def test_resnet_like_segments_on_every_device(reference_device, density):
    # Large and small segments together: many interior blocks, padded rows of several widths.
    numels = [4_096, 147_456, 64, 64, 589_824, 1_000, 16_384, 3, 262_147]
    ks = [max(1, round(n * density)) for n in numels]
    values = (torch.randn(sum(numels), generator=torch.Generator().manual_seed(1)) * 3).to(reference_device)
    positions = segment_topk(values, numels, ks)
    assert positions.device == values.device
    _check(values.cpu(), numels, ks, positions.cpu())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_entry_is_ranked_as_torch_topk_ranks_it(bad):
    numels, ks = [5_000, 3_001, 700], [10, 4, 2]
    values = torch.randn(sum(numels), generator=torch.Generator().manual_seed(2))
    values[[17, 5_000 + 3_000, 8_001 + 699]] = bad  # an interior block, a segment's last entry, the tail
    positions = segment_topk(values, numels, ks)
    assert {17, 8_000, 8_700} <= set(positions.tolist())
    _check(values.nan_to_num(posinf=1e30, neginf=-1e30, nan=1e30), numels, ks, positions)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="must sum to values.numel"):
        segment_topk(torch.zeros(10), [4, 5], [1, 1])
    with pytest.raises(ValueError, match="segment 1 has k=6, numel=5"):
        segment_topk(torch.zeros(10), [5, 5], [1, 6])
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        segment_topk(torch.zeros(10), [5, 5], [1, 1], block=0)
    assert segment_topk(torch.zeros(10), [5, 5], [0, 0]).numel() == 0


def test_block_size_is_a_power_of_two_near_an_eighth_of_the_kept_density():
    assert segment_block_size(25_557_032, 25_557) == 64  # 0.1 %: 25.5 M / (8 x 25.5 k) = 125
    assert segment_block_size(25_557_032, 255_570) == 8  # 1 %
    assert (
        segment_block_size(1000, 999) == 4 and segment_block_size(10**9, 1) == 128 and segment_block_size(5, 0) == 128
    )


@settings(max_examples=80, deadline=None)
@given(
    numels=st.lists(st.integers(0, 3000), min_size=1, max_size=8),
    fractions=st.lists(st.floats(0, 1), min_size=8, max_size=8),
    block=st.sampled_from([4, 8, 32, 128]),
    seed=st.integers(0, 2**16),
)
def test_the_gpu_thresholds_from_one_padded_matrix_are_the_class_loops(numels, fractions, block, seed):
    """Step 2 on a GPU (one matrix, geometry from the host) and on the CPU (a matrix per size class) agree."""
    values = torch.randn(sum(numels), generator=torch.Generator().manual_seed(seed))
    ks = [round(f * n) for f, n in zip(fractions, numels, strict=False)]
    blocks = values.numel() // block
    rows = values[: blocks * block].view(blocks, block)
    maxima = torch.maximum(rows.amax(1), rows.amin(1).neg())
    sizes, k = torch.tensor(numels), torch.tensor(ks)
    ends = sizes.cumsum(0)
    starts = ends - sizes
    first = torch.div(starts + block - 1, block, rounding_mode="floor")
    interior = (torch.div(ends, block, rounding_mode="floor") - first).clamp(min=0)
    block_start = torch.arange(blocks) * block
    owner = torch.searchsorted(ends, block_start, right=True).clamp(max=len(numels) - 1)
    inside = (block_start >= starts[owner]) & (block_start + block <= ends[owner])
    padded = _thresholds_padded(maxima, numels, ks, block)
    assert torch.equal(padded, _thresholds_by_class(maxima, k, first, interior, owner, inside))
    with mock.patch.object(segment_topk_module, "_PADDED_FREE_ENTRIES", 0):  # a matrix per width, nearly
        assert torch.equal(_thresholds_padded(maxima, numels, ks, block), padded)


def test_one_large_segment_among_many_small_ones_gets_a_matrix_of_its_own():
    """The padded matrices stay within twice their rows' blocks (beyond a free size): no matrix of mostly padding."""
    numels = [100_000] + [64] * 40
    ks = [1] * len(numels)
    values = torch.randn(sum(numels), generator=torch.Generator().manual_seed(5))
    rows = values[: values.numel() // 4 * 4].view(-1, 4)
    maxima = torch.maximum(rows.amax(1), rows.amin(1).neg())
    built = []
    real_where = torch.where

    def where(*args, **kwargs):
        out = real_where(*args, **kwargs)
        built.append(tuple(out.shape))
        return out

    with mock.patch.object(segment_topk_module, "_PADDED_FREE_ENTRIES", 0), mock.patch.object(torch, "where", where):
        thresholds = _thresholds_padded(maxima, numels, ks, 4)
    # 41 rows x 25,000 would be 40x their blocks; split, every matrix holds at most twice its rows' blocks.
    assert len(built) == 2 and built[0][1] == 25_000 and built[0][0] <= 2 and built[1][1] == 16, built
    assert sum(r * c for r, c in built) <= 2 * (25_000 + 40 * 16)
    small = maxima[25_000:].view(40, 16).amax(1)
    assert thresholds.tolist() == [float(maxima[:25_000].max()), *small.tolist()]
    starts = [0, *torch.tensor(numels).cumsum(0)[:-1].tolist()]
    expected = [int(values[s : s + n].abs().argmax()) + s for s, n in zip(starts, numels, strict=True)]
    assert segment_topk(values, numels, ks).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(**_SEGMENTS)
def test_signed_segments_keep_their_largest_values_and_the_first_of_tied_ones(numels, fractions, block, seed, ties):
    """signed=True (SBC's two sides, of values and of their negation): every segment's k largest values,
    largest first, an entry tied with the k-th kept before a later one (SBC's rule: the first in memory)."""
    values = torch.randn(sum(numels), generator=torch.Generator().manual_seed(seed))
    if ties:
        values = values.round()  # few distinct values, each many times, negative ones included
    ks = [round(f * n) for f, n in zip(fractions, numels, strict=False)]
    for signed_values in (values, -values):
        positions = segment_topk(signed_values, numels, ks, block=block, signed=True)
        start, offset = 0, 0
        for numel, k in zip(numels, ks, strict=True):
            mine, piece = positions[start : start + k], signed_values[offset : offset + numel]
            chosen = signed_values[mine]
            assert torch.equal(chosen, torch.topk(piece, k).values), "the k largest values, largest first"
            if k:
                kth = chosen.min()
                tied = torch.nonzero(piece == kth).squeeze(1) + offset
                kept = mine[chosen == kth].sort().values
                assert torch.equal(kept, tied[: kept.numel()]), "the first tied entries in memory order"
            start, offset = start + k, offset + numel
