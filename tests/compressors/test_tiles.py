"""rows_topk: every tile's exact top-k (DeMo's and SparseLoCo's selection), against torch.topk per row."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgc.compressors.tiles import _ROW_GROUP_HEIGHT, rows_topk


def _check(rows: torch.Tensor, keep: int, positions: torch.Tensor) -> None:
    """The positions of every row: ``keep`` distinct ones, holding the magnitudes torch.topk keeps."""
    assert positions.shape == (rows.shape[0], keep) and positions.dtype == torch.int64
    assert bool(((positions >= 0) & (positions < rows.shape[1])).all())
    assert all(row.unique().numel() == keep for row in positions)
    chosen = rows.gather(1, positions).abs().sort(dim=1, descending=True).values
    expected = torch.topk(rows.abs(), keep, dim=1).values  # sorted, largest (NaN) first
    torch.testing.assert_close(chosen, expected, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=150, deadline=None)
@given(
    tiles=st.integers(1, 12),
    size=st.sampled_from([8, 64, 256, 1920, 4096, 100, 1000]),
    keep_fraction=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_every_row_keeps_what_torch_topk_keeps(tiles, size, keep_fraction, seed, ties):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(tiles, size, generator=g)
    if ties:  # few distinct magnitudes: ties at the k-th are the rule
        rows = torch.randint(-3, 4, (tiles, size), generator=g).float()
    keep = max(1, round(keep_fraction**3 * size))  # mostly small keeps, where the bound is taken
    _check(rows, keep, rows_topk(rows, keep))


@pytest.mark.parametrize(("size", "keep"), [(4096, 32), (4096, 64), (1920, 32), (512, 16)])
def test_the_bound_is_taken_at_demo_and_sparseloco_sizes_and_keeps_nan_and_inf_first(size, keep):
    assert size % _ROW_GROUP_HEIGHT == 0 and 4 * _ROW_GROUP_HEIGHT * keep <= size  # the bound's path
    rows = torch.randn(6, size, generator=torch.Generator().manual_seed(size + keep))
    rows[1, 5] = float("nan")
    rows[2, size - 1] = float("-inf")
    rows[3, :3] = float("inf")
    rows[4, 7] = rows[4, 7 + size // 8] = float("nan")  # two NaNs in one column group
    positions = rows_topk(rows, keep)
    _check(rows, keep, positions)
    assert 5 in positions[1].tolist() and size - 1 in positions[2].tolist()
    assert {0, 1, 2} <= set(positions[3].tolist()) and {7, 7 + size // 8} <= set(positions[4].tolist())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_select_as_torch_topk(dtype):
    rows = torch.randn(5, 4096, generator=torch.Generator().manual_seed(3)).to(dtype)
    _check(rows, 32, rows_topk(rows, 32))
