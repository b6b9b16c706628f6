"""Sparse Binary Compression: side selection, exact byte counts, Golomb lengths, error feedback, DDP."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run_workers
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import register_compression_hook
from lgc.coding.golomb import (
    HEADER_BYTES,
    GolombCode,
    expected_bits_per_position,
    golomb_decode,
    golomb_encode,
    optimal_golomb_parameter,
)
from lgc.compressors import CombineMode, ErrorFeedback
from lgc.compressors.sbc import SBCCompressor, SBCPayload, sbc_select
from lgc.compressors.selection import _kth_numpy, extreme_sides, sbc_block_size, side_numpy, side_torch
from lgc.compressors.topk import num_selected
from lgc.methods import build_compressor


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _reference(v: torch.Tensor, k: int) -> tuple[bool, torch.Tensor, float, float]:
    """SBC as the paper writes it: two full top-k calls, then the side with the larger mean magnitude."""
    largest, smallest = torch.topk(v, k), torch.topk(-v, k)
    mean_positive, mean_negative = largest.values.double().mean().item(), smallest.values.double().mean().item()
    positive = mean_positive >= mean_negative
    chosen = largest.indices if positive else smallest.indices
    return positive, chosen.sort().values, mean_positive, mean_negative


# ---------------------------------------------------------------------------------------------
# which side is sent


@pytest.mark.parametrize("positive", [True, False])
def test_the_side_with_the_larger_mean_magnitude_is_sent(positive):
    v = _randn(1000) * 0.01
    strong, weak = torch.arange(0, 100, 10), torch.arange(500, 600, 10)  # k = 10 each
    v[strong], v[weak] = 5.0, -3.0
    if not positive:
        v = -v
    payload = SBCCompressor(0.01).compress(v, "w")
    assert payload.indices.tolist() == strong.tolist()
    assert payload.mean.tolist() == [5.0 if positive else -5.0]
    decoded = SBCCompressor(0.01).decompress(payload)
    assert torch.equal(decoded[strong], torch.full((10,), 5.0 if positive else -5.0))
    assert torch.count_nonzero(decoded) == 10


def test_one_topk_of_magnitudes_split_by_sign_would_be_wrong():
    # The ten largest magnitudes are +100 and nine -5, yet SBC's positive side wins
    # (mu+ = (100 + 9 * 0.1) / 10 = 10.09 > mu- = 5) and must send the nine +0.1 entries as well.
    v = torch.zeros(100)
    v[7], v[20:29], v[50:60] = 100.0, 0.1, -5.0
    selection = sbc_select(v, 10)
    assert selection.positive
    assert selection.mean_positive == pytest.approx(10.09) and selection.mean_negative == pytest.approx(5.0)
    assert selection.positions.tolist() == [7, *range(20, 29)]
    assert selection.mean.dtype == torch.float32 and selection.mean.item() == pytest.approx(10.09)


@pytest.mark.parametrize(
    "numel,density",
    [(10, 0.1), (1000, 0.01), (40_000, 0.001), (100_003, 0.001), (1_000_001, 0.001), (400_000, 0.01), (300_001, 1e-4)],
)
@pytest.mark.parametrize("shift", [0.0, 0.02, -0.02])
def test_selection_equals_two_full_topk_calls(numel, density, shift):
    v = _randn(numel, seed=numel) * torch.linspace(0.2, 2.0, numel) + shift  # structure along the tensor
    k = num_selected(numel, density)
    selection = sbc_select(v, k)
    positive, positions, mean_positive, mean_negative = _reference(v, k)
    assert selection.positive == positive
    assert torch.equal(selection.positions, positions)
    assert selection.mean_positive == pytest.approx(mean_positive, rel=1e-12)
    assert selection.mean_negative == pytest.approx(mean_negative, rel=1e-12)


def test_ties_and_a_ragged_tail_give_exactly_k_positions_of_the_right_values():
    v = torch.randint(-3, 4, (100_037,), generator=torch.Generator().manual_seed(0)).float()
    v[-5:] = -9.0  # the strongest negatives sit in the tail that does not fill a block
    k = 1000
    selection = sbc_select(v, k)
    positive, _, mean_positive, mean_negative = _reference(v, k)
    assert not selection.positive and not positive
    assert selection.positions.numel() == k and torch.equal(selection.positions, selection.positions.unique())
    assert torch.equal(v[selection.positions].sort().values, torch.topk(-v, k).values.neg().sort().values)
    assert set(range(100_032, 100_037)) <= set(selection.positions.tolist())
    assert selection.mean.item() == pytest.approx(-mean_negative)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("numel,k", [(200_007, 300), (5000, 50), (100_013, 1000)])  # 64, direct, 16 per group
def test_numpy_and_torch_paths_agree_bit_for_bit(largest, ties, columns, numel, k):
    # CPU float tensors finish the selection in numpy; other devices (and bfloat16) in torch.
    v = _randn(numel, seed=7)
    if ties:
        v = v.round()  # many equal group maxima and entries around the bound
    block = sbc_block_size(numel, k)
    assert block == {200_007: 64, 5000: 1, 100_013: 16}[numel]
    from_numpy, from_torch = side_numpy(v, k, block, largest, columns), side_torch(v, k, block, largest, columns)
    assert from_numpy.total == pytest.approx(from_torch.total, rel=1e-14)  # float64 sums, any order
    positions = from_numpy.positions()
    assert torch.equal(positions, from_torch.positions()) and bool((positions.diff() > 0).all())  # ascending
    reference = torch.topk(v, k, largest=largest).values
    assert from_numpy.total == pytest.approx(reference.double().sum().item(), rel=1e-12)
    assert torch.equal(v[from_numpy.positions()].sort().values, reference.sort().values)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("numel,k", [(5000, 50), (2048, 3), (10, 6), (7, 7), (1, 1)])  # 2k > n: the sides overlap
def test_both_direct_sides_from_one_partition_equal_each_side_on_its_own(ties, numel, k):
    v = _randn(numel, seed=numel + k)
    if ties:
        v = v.mul(2).round()
    assert sbc_block_size(numel, k) == 1
    positive, negative = extreme_sides(v, k)
    for side, largest in ((positive, True), (negative, False)):
        alone = side_numpy(v, k, 1, largest)
        assert side.total == pytest.approx(alone.total, rel=1e-14)
        assert torch.equal(side.positions(), alone.positions())
        assert torch.equal(side.positions(), side_torch(v, k, 1, largest).positions())


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("kind", ["normal", "mostly_zero", "all_zero", "one_sign", "rounded"])
def test_the_kth_entry_is_partitions_whatever_the_mass_of_zeros(kind, largest):
    # _kth_numpy selects around the zeros (introselect slows 10-30x on a repeated value); the answer
    # is np.partition's for every k.
    gen = np.random.default_rng(0)
    values = gen.standard_normal(999).astype(np.float32)
    if kind == "mostly_zero":
        values[gen.random(999) < 0.97] = 0.0
    elif kind == "all_zero":
        values[:] = 0.0
    elif kind == "one_sign":
        values = np.abs(values) * (1 if largest else -1)
        values[::3] = 0.0
    elif kind == "rounded":
        values = values.round()
    for k in (1, 2, 17, 30, 500, 998, 999):
        rank = values.size - k if largest else k - 1
        assert _kth_numpy(values, k, largest) == np.partition(values, rank)[rank], k


def test_fewer_entries_of_one_sign_than_k_take_zeros_as_the_paper_does():
    v = torch.zeros(50_000)
    v[123] = 2.0
    selection = sbc_select(v, 100)  # topk(v, 100) holds the 2.0 and 99 zeros; topk(-v, 100) only zeros
    assert selection.positive and selection.mean.item() == pytest.approx(0.02)
    assert 123 in selection.positions.tolist() and selection.positions.numel() == 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy and torch paths
@pytest.mark.parametrize("numel,k", [(200_007, 200), (100_013, 1000), (5000, 50)])  # rows, columns, direct
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "nan_and_inf", "k_nans"])
def test_an_inf_or_a_nan_is_ranked_as_the_references_two_topk_calls_rank_it(dtype, numel, k, bad):
    # The block bound cannot order them (and the zero-robust k-th entry would fail with fewer than k
    # finite entries): such a tensor takes the reference's topk(v, k) and topk(-v, k).
    v = _randn(numel, seed=3).to(dtype)
    where = {"nan": [17], "inf": [numel // 2], "-inf": [numel - 1], "nan_and_inf": [5, numel // 3]}
    spots = where.get(bad, list(range(0, numel, max(1, numel // (k + 5))))[: k + 3])
    v[spots] = {"inf": math.inf, "-inf": -math.inf}.get(bad, math.nan)
    if bad == "nan_and_inf":
        v[spots[1]] = math.inf
    selection = sbc_select(v, k)
    positive, positions, mean_positive, mean_negative = _reference(v, k)
    assert selection.positive == positive
    assert math.isnan(selection.mean_positive) == math.isnan(mean_positive)
    assert math.isnan(selection.mean_negative) == math.isnan(mean_negative)
    if bad in ("inf", "-inf"):  # one infinite side wins, with an infinite mean, as in the reference
        assert selection.positive == (bad == "inf") and math.isinf(selection.mean.item())
        assert spots[0] in selection.positions.tolist()
    else:  # a NaN leads both sides: both means NaN, and the comparison falls to the negative side
        assert not selection.positive and math.isnan(selection.mean.item())
        assert bad == "k_nans" or spots[0] in selection.positions.tolist()  # (a +inf ranks last on this side)
    assert selection.positions.numel() == k and bool((selection.positions.diff() > 0).all())
    assert torch.equal(selection.positions, positions)  # the same topk calls: the same picks among NaNs


# ---------------------------------------------------------------------------------------------
# payload content and size


@pytest.mark.parametrize("numel,density", [(1000, 0.01), (250_000, 0.001), (65_536, 0.05)])
def test_decoded_tensor_has_k_nonzeros_equal_to_the_mean_of_the_chosen_entries(numel, density):
    v = _randn(numel, seed=1)
    compressor = SBCCompressor(density)
    payload = compressor.compress(v, "w")
    k = num_selected(numel, density)
    decoded = compressor.decompress(payload)
    support = torch.nonzero(decoded).squeeze(1)
    assert support.numel() == k and torch.equal(support, payload.indices)
    assert torch.all(decoded[support] == payload.mean)
    assert payload.mean.item() == pytest.approx(v[support].double().mean().item(), rel=1e-6)
    assert (payload.mean.item() > 0) == sbc_select(v, k).positive


def test_exact_byte_count_and_golomb_length_near_the_formula_for_random_positions():
    numel, density = 2_000_000, 0.001
    v = _randn(numel, seed=2)  # i.i.d. entries: the kept positions are uniformly random
    payload = SBCCompressor(density).compress(v, "w")
    k = num_selected(numel, density)
    code = golomb_encode(payload.indices, numel)
    b = optimal_golomb_parameter(k / numel)
    assert code.b == payload.golomb.b == b == 9
    assert payload.nbytes == 4 + code.nbytes == 4 + HEADER_BYTES + math.ceil(code.num_bits / 8)
    assert payload.to_wire().numel() == payload.nbytes
    assert torch.equal(payload.code, code.to_wire())
    expected = expected_bits_per_position(k / numel, b)  # 11.49 bits
    assert code.bits_per_position == pytest.approx(expected, rel=0.02)
    assert 4 * numel / payload.nbytes > 2700  # compression ratio ~2780 (top-k: 500)


def test_forced_golomb_parameter_still_decodes_exactly_but_costs_more():
    v = _randn(200_000, seed=3)
    optimal = SBCCompressor(0.001).compress(v, "w")
    forced = SBCCompressor(0.001, golomb_parameter=3).compress(v, "w")
    assert forced.golomb.b == 3 and optimal.golomb.b == 9
    assert torch.equal(golomb_decode(forced.golomb), optimal.indices)
    assert forced.nbytes > optimal.nbytes


def test_wire_round_trip_is_exact_also_from_an_unaligned_offset():
    compressor = SBCCompressor(0.003)
    v = _randn(77_777, seed=4)
    payload = compressor.compress(v, "w")
    wire = torch.cat([torch.zeros(3, dtype=torch.uint8), payload.to_wire()])[3:]
    assert wire.storage_offset() == 3 and wire.numel() == payload.nbytes
    rebuilt = compressor.payload_from_wire(wire, v.numel())
    assert isinstance(rebuilt, SBCPayload)
    for a, b in zip(payload.tensors(), rebuilt.tensors(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(rebuilt.indices, payload.indices) and torch.equal(rebuilt.values, payload.values)
    assert torch.equal(compressor.decompress(rebuilt), compressor.decompress(payload))


def test_corrupt_or_mismatched_buffers_are_rejected():
    compressor = SBCCompressor(0.01)
    wire = compressor.compress(_randn(5000), "w").to_wire()
    with pytest.raises(ValueError, match="Golomb"):
        compressor.payload_from_wire(wire[:-1], 5000)
    with pytest.raises(ValueError, match="uint8"):
        compressor.payload_from_wire(wire[:3], 5000)
    with pytest.raises(ValueError, match="position"):
        compressor.payload_from_wire(wire, 100)


def test_aggregate_equals_the_sum_of_decoded_payloads():
    compressor = SBCCompressor(0.05)
    payloads = [compressor.compress(_randn(3000, seed=s), "w") for s in range(4)]
    received = [compressor.payload_from_wire(p.to_wire(), 3000) for p in payloads]
    expected = sum(compressor.decompress(p) for p in payloads)
    torch.testing.assert_close(compressor.aggregate(received), expected)
    assert torch.equal(compressor.aggregate(received[:1]), compressor.decompress(payloads[0]))


# ---------------------------------------------------------------------------------------------
# error feedback (SBC's residual accumulation)


@pytest.mark.parametrize("density", [0.001, 0.02])
def test_error_feedback_invariant_input_equals_decoded_plus_residual(density):
    numel = 100_000
    ef = ErrorFeedback(SBCCompressor(density))
    for step in range(3):
        g = _randn(numel, seed=10 + step)
        previous = ef.residuals.get("w", torch.zeros(numel)).clone()
        v = g + previous  # what the compressor sees
        payload = ef.compress(g, "w")
        decoded, residual = ef.decompress(payload), ef.residuals["w"]
        sent = payload.indices
        unsent = torch.ones(numel, dtype=torch.bool)
        unsent[sent] = False
        # Unsent entries keep the input bit for bit.
        assert torch.equal(residual[unsent], v[unsent]) and torch.count_nonzero(decoded[unsent]) == 0
        # Sent entries keep r = fl(v - mu): one rounding, so decoded + r equals v up to half an ulp
        # of |v - mu| (exact where Sterbenz' lemma applies, mu / 2 <= v <= 2 mu).
        mu = payload.mean.double()
        error = (decoded[sent].double() + residual[sent].double() - v[sent].double()).abs()
        assert torch.all(error <= 2.0**-24 * (v[sent].double() - mu).abs())
        sterbenz = (v[sent].double() / mu >= 0.5) & (v[sent].double() / mu <= 2.0)
        assert sterbenz.any() and torch.all(error[sterbenz] == 0)


def test_error_feedback_delays_but_never_drops():
    ef = ErrorFeedback(SBCCompressor(0.01))
    total_in, total_sent = torch.zeros(5000, dtype=torch.float64), torch.zeros(5000, dtype=torch.float64)
    for step in range(40):
        g = _randn(5000, seed=step)
        total_in += g.double()
        total_sent += ef.decompress(ef.compress(g, "w")).double()
    torch.testing.assert_close(total_sent + ef.residuals["w"].double(), total_in, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# density 1, configuration, validation


@pytest.mark.parametrize("shift", [0.3, -0.3])
def test_density_one_sends_the_tensor_mean_everywhere(shift):
    numel = 10_001
    v = _randn(numel, seed=5) + shift
    ef = ErrorFeedback(SBCCompressor(1.0))
    payload = ef.compress(v, "w")
    # Both sides are the whole tensor: mu+ = mean(v), mu- = -mean(v); either way mean(v) is sent.
    assert payload.mean.item() == pytest.approx(v.double().mean().item(), rel=1e-6)
    assert payload.indices.tolist() == list(range(numel))
    assert payload.golomb.b == 0 and payload.golomb.num_bits == numel  # every gap is 1: one bit each
    assert payload.nbytes == 4 + HEADER_BYTES + math.ceil(numel / 8)
    assert torch.equal(ef.decompress(payload), payload.mean.expand(numel))
    torch.testing.assert_close(ef.residuals["w"], v - payload.mean)


def test_yaml_builds_sbc_with_error_feedback():
    import lgc

    node = OmegaConf.load(Path(lgc.__file__).parent / "conf" / "compressor" / "sbc.yaml")
    built = build_compressor(node)
    assert isinstance(built, ErrorFeedback) and isinstance(built.compressor, SBCCompressor)
    assert built.compressor.density == 0.01 and built.compressor.golomb_parameter is None
    assert built.combine is CombineMode.GATHER and built.variable_size


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan"), "0.1", True])
def test_bad_density_is_rejected_by_name(density):
    with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\], got"):
        SBCCompressor(density)


@pytest.mark.parametrize("golomb_parameter", [-1, 49, 2.5, True])
def test_bad_golomb_parameter_is_rejected_by_name(golomb_parameter):
    with pytest.raises(ValueError, match=rf"golomb_parameter must be .* got {golomb_parameter!r}"):
        SBCCompressor(0.01, golomb_parameter=golomb_parameter)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])  # numpy path and torch path
def test_half_precision_input_is_selected_in_its_own_dtype_and_sent_as_fp32(dtype):
    v = _randn(50_000, seed=6).to(dtype)
    payload = SBCCompressor(0.01).compress(v, "w")
    positive, positions, mean_positive, mean_negative = _reference(v.float(), 500)
    assert payload.mean.dtype == torch.float32
    assert payload.mean.item() == pytest.approx(mean_positive if positive else -mean_negative, rel=1e-6)
    assert torch.equal(v.float()[payload.indices].sort().values, v.float()[positions].sort().values)


def test_empty_tensor_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        SBCCompressor(0.01).compress(torch.empty(0), "w")


# ---------------------------------------------------------------------------------------------
# two gloo workers through the DDP hook


class _RecordingSBC(SBCCompressor):
    """Records the wire size of every payload this worker sends."""

    def __init__(self, density: float) -> None:
        super().__init__(density)
        self.sizes: list[int] = []

    def compress(self, tensor: torch.Tensor, key: str) -> SBCPayload:
        payload = super().compress(tensor, key)
        self.sizes.append(payload.nbytes)
        assert GolombCode.from_wire(payload.code).count == payload.indices.numel()
        return payload


def _train_least_squares(rank: int, world: int, compressor, steps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(512, 64, generator=gen)
    target = features @ torch.randn(64, 8, generator=gen)
    shard = slice(rank * 256, (rank + 1) * 256)  # each worker has its own half of the data
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 8, bias=False))
    state = register_compression_hook(model, compressor, min_numel=0) if compressor is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (model(features[shard]) - target[shard]).square().sum(1).mean()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            losses.append(float((model(features) - target).square().sum(1).mean()))
    recorder = getattr(compressor, "compressor", compressor)
    sizes = getattr(recorder, "sizes", [])
    return {"losses": losses, "sizes": sizes, "stats": state.stats.as_dict() if state else None}


def _steps_to_reach(losses: list[float], fraction: float) -> float:
    return next((step + 1 for step, loss in enumerate(losses) if loss < fraction * losses[0]), math.inf)


@pytest.mark.multiprocess
def test_two_workers_with_different_payload_sizes_converge_within_a_factor_of_dense():
    steps, density = 300, 0.05  # k = 26 of 512 weights, one shared magnitude per step
    dense = run_workers(_train_least_squares, 2, None, steps)[0]["losses"]
    results = run_workers(_train_least_squares, 2, ErrorFeedback(_RecordingSBC(density)), steps)
    sbc = results[0]["losses"]
    assert results[1]["losses"] == sbc  # every worker applies the same aggregate
    # Positions differ between workers, so their Golomb streams (and payloads) differ in length.
    sizes = [r["sizes"] for r in results]
    assert len(sizes[0]) == len(sizes[1]) == steps - 1  # step 1 is a plain allreduce
    assert any(a != b for a, b in zip(*sizes, strict=True))
    assert results[0]["stats"]["payload_bytes"] == sum(sizes[0])
    # Dense reaches 1e-1 ... 1e-6 of the initial loss in 7, 15, 24, 34 and 56 steps; SBC with error
    # feedback needs about 3x as many (20, 46, 76, 107, 181): one sign side at one magnitude per step.
    assert dense[-1] < 1e-9 * dense[0]
    for fraction in (1e-1, 1e-2, 1e-3, 1e-4, 1e-6):
        assert _steps_to_reach(sbc, fraction) <= 4 * _steps_to_reach(dense, fraction), fraction
