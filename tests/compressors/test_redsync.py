"""RedSync's trimmed top-k and threshold binary search: exactness, bounds, reuse, quantization, DDP."""

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import register_compression_hook
from lgc.compressors import CombineMode, ErrorFeedback, SparsePayload
from lgc.compressors.redsync import RedSyncCompressor, SignMeanPayload
from lgc.compressors.topk import num_selected

SEARCH = "threshold_binary_search"


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _heavy(n: int, seed: int = 0) -> torch.Tensor:
    """Student-t with 2 degrees of freedom: max |v| is hundreds of times the mean, like real gradients."""
    normal = _randn(n, seed)
    chi2 = _randn(2 * n, seed + 1).view(2, n).square().sum(0)
    return normal / (chi2 / 2).sqrt()


def _naive_binary_search(v: torch.Tensor, k: int, epsilon: float) -> tuple[set[int], int] | None:
    """RedSync's binary search written plainly: every count over the whole tensor."""
    a = v.abs()
    mean, top = float(a.mean()), float(a.max())
    low, high, passes = 0.0, 1.0, 0
    while True:
        ratio = 0.5 * (low + high)
        above = a > mean + ratio * (top - mean)
        count, passes = int(above.sum()), passes + 1
        if k <= count < 2 * k:
            return set(above.nonzero().squeeze(1).tolist()), passes
        low, high = (low, ratio) if count < k else (ratio, high)
        if high - low < epsilon:
            return None


def _separates(v: torch.Tensor, indices: torch.Tensor) -> bool:
    """Every selected magnitude exceeds every unselected one (the selection is a threshold cut)."""
    selected = torch.zeros(v.numel(), dtype=torch.bool)
    selected[indices.long()] = True
    return bool(v.abs()[selected].min() > v.abs()[~selected].max())


# ------------------------------------------------------------------------------------------------
# trimmed top-k


@pytest.mark.parametrize("data", [_randn, _heavy], ids=["normal", "heavy"])
@pytest.mark.parametrize("numel,density", [(1000, 0.01), (200_000, 0.001), (100_000, 0.02), (5000, 0.5), (37, 0.1)])
def test_trimmed_topk_is_exactly_torch_topk(data, numel, density):
    v = data(numel, seed=numel)
    compressor = RedSyncCompressor(density)
    payload = compressor.compress(v, "w")
    k = num_selected(numel, density)
    assert type(payload) is SparsePayload
    assert payload.indices.dtype == torch.int32 and payload.values.dtype == torch.float32
    assert payload.values.numel() == payload.indices.numel() == k
    assert payload.nbytes == 8 * k
    assert set(payload.indices.tolist()) == set(torch.topk(v.abs(), k).indices.tolist())
    assert torch.equal(payload.values, v[payload.indices.long()])


def test_trimmed_topk_counts_on_few_survivors_not_on_a_sort():
    v = _randn(1_000_000)
    compressor = RedSyncCompressor(0.001)
    compressor.compress(v, "w")
    # A normal sample passes k = 1000 at ratio 0.4; the strided sample skips the hopeless 0.8 and 0.6.
    assert compressor.counting_passes == 1
    assert compressor.counted_elements == v.numel()


def test_trimmed_topk_without_sampling_lowers_the_ratio_by_steps():
    v = _randn(50_000)  # too small for the sample: every ratio from 0.8 down is counted
    compressor = RedSyncCompressor(0.001)
    compressor.compress(v, "w")
    a = v.abs()
    mean, top = float(a.mean()), float(a.max())
    passing = [r for r in (0.8, 0.6, 0.4, 0.2, 0.0) if int((a > mean + r * (top - mean)).sum()) >= 50]
    assert compressor.counting_passes == 1 + [0.8, 0.6, 0.4, 0.2, 0.0].index(passing[0])


def test_trimmed_topk_with_ties_still_sends_exactly_k():
    v = torch.tensor([1.0, -1.0] * 500)  # every magnitude equal: nothing is above the mean
    payload = RedSyncCompressor(0.01).compress(v, "w")
    assert payload.indices.numel() == 10 and payload.indices.unique().numel() == 10


# ------------------------------------------------------------------------------------------------
# threshold binary search


@pytest.mark.parametrize("data", [_randn, _heavy], ids=["normal", "heavy"])
@pytest.mark.parametrize("numel,density", [(1000, 0.01), (300_000, 0.001), (100_000, 0.05)])
def test_binary_search_sends_k_to_2k_entries_cut_at_a_threshold(data, numel, density):
    v = data(numel, seed=numel + 1)
    compressor = RedSyncCompressor(density, method=SEARCH)
    payload = compressor.compress(v, "w")
    k = num_selected(numel, density)
    count = payload.indices.numel()
    assert k <= count < 2 * k
    assert payload.indices.unique().numel() == count
    assert _separates(v, payload.indices)  # all entries above the threshold, none below
    assert torch.equal(payload.values, v[payload.indices.long()])
    assert payload.nbytes == 8 * count


def test_binary_search_equals_the_plain_algorithm_and_counts_fewer_elements():
    full_passes = counted = 0
    for seed in range(1, 5):
        v = _heavy(400_000, seed)  # needs several halvings, so candidates get compacted
        k = num_selected(v.numel(), 0.001)
        expected = _naive_binary_search(v, k, 1e-5)
        assert expected is not None
        compressor = RedSyncCompressor(0.001, method=SEARCH, epsilon=1e-5)
        payload = compressor.compress(v, "w")
        assert set(payload.indices.tolist()) == expected[0]
        assert compressor.counting_passes == expected[1]
        full_passes += expected[1] * v.numel()
        counted += compressor.counted_elements
    assert counted < full_passes - 2 * 400_000  # at least two whole passes saved by compaction


def test_binary_search_with_ties_falls_back_to_exactly_k():
    # 50 entries share the largest magnitude: with k = 20 no threshold passes 20 to 39 entries.
    v = torch.cat([torch.full((50,), -5.0), _randn(950, seed=3).clamp(-2, 2)])
    compressor = RedSyncCompressor(0.02, method=SEARCH, epsilon=1e-4)
    payload = compressor.compress(v, "w")
    assert payload.indices.numel() == 20
    assert bool((v[payload.indices.long()] == -5.0).all())
    # Every magnitude equal: not even the mean is exceeded; exact top-k over everything.
    flat = RedSyncCompressor(0.01, method=SEARCH, epsilon=1e-3).compress(torch.ones(1000), "w")
    assert flat.indices.numel() == 10


# ------------------------------------------------------------------------------------------------
# threshold reuse


def test_binary_search_reuse_gives_the_fresh_result_in_one_pass():
    v = _heavy(200_000, seed=7)
    fresh = RedSyncCompressor(0.001, method=SEARCH)
    reusing = RedSyncCompressor(0.001, method=SEARCH, reuse_threshold=True)
    first = reusing.compress(v, "w")
    passes_first = reusing.counting_passes
    expected = fresh.compress(v, "w")
    assert torch.equal(first.indices, expected.indices)
    assert passes_first == fresh.counting_passes > 3
    again = reusing.compress(v, "w")  # the stored threshold still passes k..2k - 1 entries
    assert torch.equal(again.indices, expected.indices)
    assert reusing.counting_passes - passes_first == 1


def test_trimmed_topk_reuse_is_exact_across_drifting_steps_and_saves_passes():
    k = num_selected(50_000, 0.002)
    fresh = RedSyncCompressor(0.002)
    reusing = RedSyncCompressor(0.002, reuse_threshold=True)
    fresh_passes = reused_passes = 0
    for step in range(6):
        v = _randn(50_000, seed=0) + 0.05 * _randn(50_000, seed=100 + step)  # a slowly drifting gradient
        before = (fresh.counting_passes, reusing.counting_passes)
        expected = fresh.compress(v, "w")
        got = reusing.compress(v, "w")
        assert set(got.indices.tolist()) == set(expected.indices.tolist()) == set(torch.topk(v.abs(), k)[1].tolist())
        fresh_passes += fresh.counting_passes - before[0]
        reused_passes += reusing.counting_passes - before[1]
        if step > 0:
            assert reusing.counting_passes - before[1] == 1, "the reused threshold should stay in [k, 2k)"
    assert reused_passes < fresh_passes


def test_reuse_searches_again_when_the_count_leaves_the_range():
    v = _heavy(100_000, seed=2)
    compressor = RedSyncCompressor(0.001, method=SEARCH, reuse_threshold=True)
    compressor.compress(v, "w")
    payload = compressor.compress(10 * v, "w")  # every magnitude grows: far more than 2k pass the old threshold
    assert 100 <= payload.indices.numel() < 200
    assert _separates(10 * v, payload.indices)


def test_thresholds_survive_a_state_dict_round_trip():
    v = _heavy(100_000, seed=4)
    compressor = RedSyncCompressor(0.001, method=SEARCH, reuse_threshold=True)
    compressor.compress(v, "a")
    compressor.compress(_heavy(20_000, seed=5), "b")
    restored = RedSyncCompressor(0.001, method=SEARCH, reuse_threshold=True)
    restored.load_state_dict(compressor.state_dict())
    assert restored.thresholds == compressor.thresholds and set(restored.thresholds) == {"a", "b"}
    assert torch.equal(restored.compress(v, "a").indices, compressor.compress(v, "a").indices)
    assert restored.counting_passes == 1
    with pytest.raises(ValueError, match="unknown state"):
        restored.load_state_dict({"residuals": {}})


# ------------------------------------------------------------------------------------------------
# quantization, wire format, error feedback


@pytest.mark.parametrize("method", ["trimmed_topk", SEARCH])
def test_quantized_payload_is_two_means_a_count_and_positions(method):
    v = _randn(100_000, seed=9)
    compressor = RedSyncCompressor(0.001, method=method, quantize=True)
    payload = compressor.compress(v, "w")
    assert isinstance(payload, SignMeanPayload)
    count = payload.indices.numel()
    assert payload.nbytes == 12 + 4 * count  # [mu+, mu-] fp32, int32 count, int32 positions
    assert [t.dtype for t in payload.tensors()] == [torch.float32, torch.int32, torch.int32]
    wire = payload.to_wire()
    assert wire.numel() == payload.nbytes
    num_positive = int(payload.num_positive)
    selected = v[payload.indices.long()]
    assert bool((selected[:num_positive] > 0).all()) and bool((selected[num_positive:] <= 0).all())
    torch.testing.assert_close(
        payload.means, torch.stack([selected[:num_positive].mean(), selected[num_positive:].mean()])
    )
    decoded = compressor.decompress(payload)
    torch.testing.assert_close(decoded.sum(), selected.sum(), rtol=1e-5, atol=1e-4)  # each side's sum is kept
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), wire])[1:]  # unaligned, as inside a gathered buffer
    rebuilt = compressor.payload_from_wire(shifted, v.numel())
    assert type(rebuilt) is SignMeanPayload
    for a, b in zip(payload.tensors(), rebuilt.tensors(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(compressor.decompress(rebuilt), decoded)


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("method", ["trimmed_topk", SEARCH])
def test_error_feedback_invariant(method, quantize):
    ef = ErrorFeedback(RedSyncCompressor(0.01, method=method, quantize=quantize))
    assert ef.combine is CombineMode.GATHER and ef.variable_size
    ef.residuals["w"] = _randn(30_000, seed=11)
    g = _randn(30_000, seed=12)
    corrected = g + ef.residuals["w"]
    payload = ef.compress(g, "w")
    sent = torch.zeros(30_000, dtype=torch.bool)
    sent[payload.indices.long()] = True
    restored = ef.decompress(payload) + ef.residuals["w"]
    assert torch.equal(restored[~sent], corrected[~sent]) and torch.equal(ef.residuals["w"][~sent], corrected[~sent])
    if quantize:  # residual = v - mu is rounded once
        torch.testing.assert_close(restored, corrected, rtol=0, atol=1e-6)
    else:
        assert torch.equal(restored, corrected)
        assert bool((ef.residuals["w"][sent] == 0).all())


@pytest.mark.parametrize("quantize", [False, True])
def test_aggregate_is_the_sum_of_decoded_payloads(quantize):
    compressor = RedSyncCompressor(0.01, method=SEARCH, quantize=quantize)
    payloads = [compressor.compress(_randn(5000, seed=s), f"w{s}") for s in range(3)]
    wires = [compressor.payload_from_wire(p.to_wire(), 5000) for p in payloads]
    torch.testing.assert_close(compressor.aggregate(wires), sum(compressor.decompress(p) for p in payloads))


def test_density_one_sends_everything_and_bad_knobs_are_refused():
    v = _randn(100)
    assert torch.equal(RedSyncCompressor(1.0, method=SEARCH).decompress(RedSyncCompressor(1.0).compress(v, "w")), v)
    with pytest.raises(ValueError, match="density"):
        RedSyncCompressor(0.0)
    with pytest.raises(ValueError, match="method"):
        RedSyncCompressor(0.01, method="topk")
    with pytest.raises(ValueError, match="epsilon"):
        RedSyncCompressor(0.01, epsilon=0.0)


# ------------------------------------------------------------------------------------------------
# two processes, through the DDP hook


def _train_least_squares(rank: int, world: int, configs: list, steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(512, 64, generator=gen)
    target = features @ torch.randn(64, 16, generator=gen)
    shard = slice(rank * 256, (rank + 1) * 256)  # each worker has its own half of the data
    results = []
    for compressor in configs:
        torch.manual_seed(0)
        model = DDP(nn.Linear(64, 16, bias=False))
        state = None
        if compressor is not None:
            state = register_compression_hook(model, compressor, min_numel=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, payload_bytes = [], []
        for _ in range(steps):
            optimizer.zero_grad()
            (model(features[shard]) - target[shard]).square().sum(1).mean().backward()
            optimizer.step()
            with torch.no_grad():
                losses.append(float((model(features) - target).square().sum(1).mean()))
            payload_bytes.append(state.stats.payload_bytes if state else 0)
        results.append({"losses": losses, "payload_bytes": payload_bytes})
    return results


@pytest.mark.multiprocess
def test_two_workers_send_different_lengths_and_converge():
    configs = [
        None,
        ErrorFeedback(RedSyncCompressor(0.05, method=SEARCH, reuse_threshold=True)),
        ErrorFeedback(RedSyncCompressor(0.05)),
        ErrorFeedback(RedSyncCompressor(0.05, method=SEARCH, quantize=True)),
        RedSyncCompressor(0.05),  # no error feedback
    ]
    steps = 200
    ranks = run_workers(_train_least_squares, 2, configs, steps)
    dense, search, trimmed, quantized, without_feedback = ranks[0]
    assert dense["losses"][-1] < 1e-9 * dense["losses"][0]
    k = num_selected(64 * 16, 0.05)
    # Binary search: every rank picks its own count in [k, 2k), so payload lengths differ
    # (the hook exchanges sizes first); step 0 is the hook's plain-allreduce warm-up.
    per_step = [torch.tensor(r[1]["payload_bytes"]).diff() for r in ranks]
    assert all(bool(((8 * k <= b) & (b < 16 * k)).all()) for b in per_step)
    assert bool((per_step[0] != per_step[1]).any())
    assert torch.equal(torch.tensor(ranks[0][2]["payload_bytes"]).diff(), torch.full((steps - 1,), 8 * k))
    # Both ranks end every step with the same model, so they report the same loss.
    assert all(a["losses"] == b["losses"] for a, b in zip(ranks[0], ranks[1], strict=True))
    for name, run in (("binary search", search), ("trimmed top-k", trimmed), ("quantized", quantized)):
        first, last = run["losses"][0], run["losses"][-1]
        assert last < 1e-6 * first, f"{name} + error feedback did not converge: {first:.3g} -> {last:.3g}"
    # Measured at step 200 (from 606): dense 6e-11, binary search 1e-11, trimmed 2e-5, quantized 9e-12,
    # no feedback 1.4.
    assert without_feedback["losses"][-1] > 1e-4 * without_feedback["losses"][0]


@pytest.mark.parametrize("method", ["trimmed_topk", SEARCH])
@pytest.mark.parametrize("data", ["normal", "heavy", "ties", "nonfinite"])
def test_counting_only_the_blocks_above_a_threshold_changes_nothing(method, data):
    """The CPU's block maxima prune each count: the same positions, in the same order, thresholds and counters."""
    from unittest import mock

    from lgc.compressors import redsync

    pruned = RedSyncCompressor(0.001, method=method, reuse_threshold=True)
    plain = RedSyncCompressor(0.001, method=method, reuse_threshold=True)
    searched = 0
    real = RedSyncCompressor._above_in_blocks

    def counting(self, *args, **kwargs):
        nonlocal searched
        searched += 1
        return real(self, *args, **kwargs)

    for step in range(4):
        n = 200_003
        v = {"normal": _randn, "heavy": _heavy}.get(data, _randn)(n, seed=step)
        if data == "ties":
            v = torch.randint(-3, 4, (n,), generator=torch.Generator().manual_seed(step)).float()
        if data == "nonfinite":
            v[[5, 70_000]] = float("nan")
            v[199_999] = -float("inf")
        with mock.patch.object(RedSyncCompressor, "_above_in_blocks", counting):
            mine = pruned.compress(v, "w")
        with mock.patch.object(redsync, "_BLOCKED_MIN_NUMEL", 1 << 40):  # every count over the whole tensor
            theirs = plain.compress(v, "w")
        assert torch.equal(mine.indices, theirs.indices)
        assert torch.equal(mine.values.nan_to_num(), theirs.values.nan_to_num())
        assert pruned.thresholds == plain.thresholds
        assert (pruned.counting_passes, pruned.counted_elements) == (plain.counting_passes, plain.counted_elements)
    if data == "normal":
        assert searched, "the pruned count ran"
