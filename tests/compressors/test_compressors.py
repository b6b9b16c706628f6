"""Single-process unit tests of the compressors and error feedback."""

import math

import pytest
import torch

from lgc.compressors import (
    CombineMode,
    DensePayload,
    ErrorFeedback,
    FP16Compressor,
    NoneCompressor,
    QSGDCompressor,
    RandomBlockCompressor,
    SBCCompressor,
    SignSGDCompressor,
    SparsePayload,
    TernGradCompressor,
    TopKCompressor,
)
from lgc.compressors.topk import num_selected
from lgc.ddp.exchange import joined

ALL = [
    NoneCompressor(),
    FP16Compressor(),
    FP16Compressor("bfloat16"),
    TopKCompressor(0.01),
    TopKCompressor(0.3),
    TopKCompressor(1.0),
]


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_none_is_exact_and_four_bytes_per_element():
    g = _randn(1000)
    payload = NoneCompressor().compress(g, "w")
    assert isinstance(payload, DensePayload)
    assert payload.nbytes == 4000
    assert torch.equal(NoneCompressor().decompress(payload), g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rounds_once_and_sends_two_bytes(dtype):
    g = _randn(1001)
    compressor = FP16Compressor(dtype)
    payload = compressor.compress(g, "w")
    assert payload.nbytes == 2 * 1001
    assert torch.equal(compressor.decompress(payload), g.to(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_precision_bucket_is_one_flat_of_back_to_back_views_decoding_as_per_tensor(dtype, out_dtype):
    tensors = [_randn(n, seed=n).reshape(-1, 1) for n in (7, 1001, 64)]
    compressor = FP16Compressor(dtype)
    payloads = compressor.compress_many(tensors, ["a", "b", "c"])
    parts = [p.values.reshape(-1) for p in payloads]
    # The exchange's join is a view: no copy before the allreduce.
    assert joined(parts).data_ptr() == parts[0].data_ptr()
    assert joined(parts).numel() == sum(t.numel() for t in tensors)
    for tensor, payload in zip(tensors, payloads, strict=True):
        alone = compressor.compress(tensor, "x")
        assert payload.nbytes == alone.nbytes and payload.numel == alone.numel
        assert torch.equal(payload.values, alone.values)
        out = torch.full((tensor.numel(),), float("nan"), dtype=out_dtype)
        compressor.decompress_into(payload, out)
        assert torch.equal(out, compressor.decompress(alone).reshape(-1).to(out_dtype))
    # Gradients already in the wire's dtype are sent as they lie: each payload is its tensor, no copy.
    halves = [t.to(dtype) for t in tensors]
    for tensor, payload in zip(halves, compressor.compress_many(halves, ["a", "b", "c"]), strict=True):
        assert payload.values.data_ptr() == tensor.data_ptr()


@pytest.mark.parametrize("numel,density", [(1, 0.5), (10, 0.1), (1000, 0.01), (12345, 0.001), (777, 1.0), (100, 0.999)])
def test_topk_keeps_the_k_largest_magnitudes(numel, density):
    g = _randn(numel, seed=numel)
    payload = TopKCompressor(density).compress(g, "w")
    k = math.ceil(density * numel)
    assert isinstance(payload, SparsePayload)
    assert payload.values.numel() == payload.indices.numel() == k
    assert payload.nbytes == 8 * k  # fp32 value + int32 index
    assert payload.indices.dtype == torch.int32
    kept = g.abs()[payload.indices.long()]
    dropped = torch.ones(numel, dtype=torch.bool)
    dropped[payload.indices.long()] = False
    if dropped.any():
        assert kept.min() >= g.abs()[dropped].max()
    decoded = TopKCompressor(density).decompress(payload)
    assert torch.equal(decoded[payload.indices.long()], g[payload.indices.long()])
    assert torch.count_nonzero(decoded[dropped]) == 0


def test_topk_density_one_is_lossless():
    g = _randn(500)
    compressor = TopKCompressor(1.0)
    assert torch.equal(compressor.decompress(compressor.compress(g, "w")), g)


@pytest.mark.parametrize("compressor", ALL, ids=repr)
def test_wire_round_trip_is_exact(compressor):
    g = _randn(4099)
    payload = compressor.compress(g, "w")
    wire = payload.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    rebuilt = compressor.payload_from_wire(wire, g.numel())
    assert type(rebuilt) is type(payload)
    for a, b in zip(payload.tensors(), rebuilt.tensors(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(compressor.decompress(rebuilt), compressor.decompress(payload))


def test_wire_round_trip_from_an_unaligned_offset():
    compressor = TopKCompressor(0.1)
    payload = compressor.compress(_randn(999), "w")
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), payload.to_wire()])[3:]
    assert shifted.storage_offset() == 3
    assert torch.equal(
        compressor.decompress(compressor.payload_from_wire(shifted, 999)), compressor.decompress(payload)
    )


def test_topk_aggregate_equals_sum_of_decoded():
    compressor = TopKCompressor(0.05)
    payloads = [compressor.compress(_randn(2000, seed=s), "w") for s in range(4)]
    expected = sum(compressor.decompress(p) for p in payloads)
    torch.testing.assert_close(compressor.aggregate(payloads), expected)


@pytest.mark.parametrize("inner", ALL, ids=repr)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_error_feedback_invariant_input_equals_decoded_plus_residual(inner, seed):
    ef = ErrorFeedback(inner)
    ef.residuals["w"] = _randn(3000, seed=100 + seed)
    g = _randn(3000, seed=seed)
    corrected = g + ef.residuals["w"]
    payload = ef.compress(g, "w")
    assert torch.equal(ef.decompress(payload) + ef.residuals["w"], corrected)


def test_error_feedback_delays_but_never_drops():
    ef = ErrorFeedback(TopKCompressor(0.02))
    total_in, total_sent = torch.zeros(1000), torch.zeros(1000)
    for step in range(50):
        g = _randn(1000, seed=step)
        total_in += g
        total_sent += ef.decompress(ef.compress(g, "w"))
    torch.testing.assert_close(total_sent + ef.residuals["w"], total_in)
    assert ef.combine is CombineMode.GATHER


def test_error_feedback_state_round_trip():
    ef = ErrorFeedback(TopKCompressor(0.1))
    ef.compress(_randn(100), "a")
    ef.compress(_randn(50, seed=1), "b")
    other = ErrorFeedback(TopKCompressor(0.1))
    other.load_state_dict(ef.state_dict())
    g = _randn(100, seed=5)
    assert torch.equal(ef.decompress(ef.compress(g, "a")), other.decompress(other.compress(g, "a")))
    assert ef.residual_norm() == pytest.approx(other.residual_norm())


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_topk_rejects_density_outside_unit_interval(density):
    with pytest.raises(ValueError, match=rf"density must be a number in \(0, 1\], got {density!r}"):
        TopKCompressor(density)


def test_num_selected_rounds_up_and_keeps_at_least_one():
    assert num_selected(1000, 0.001) == 1
    assert num_selected(1001, 0.001) == 2
    assert num_selected(10, 1e-9) == 1


def test_double_error_feedback_is_refused():
    with pytest.raises(ValueError, match="already"):
        ErrorFeedback(ErrorFeedback(TopKCompressor(0.1)))


@pytest.mark.parametrize(
    "numel,k",
    # Blocks (density up to 0.4 %), columns (0.4 % to 3 %, ragged tail included), a whole top-k above.
    [
        (70_000, 1),
        (100_000, 100),
        (1_000_000, 1000),
        (1_000_000, 10_000),
        (1_000_003, 5_000),
        (262_147, 5_243),
        (300_000, 30_000),
        (200_000, 24_999),
    ],
)
def test_group_maximum_topk_selection_is_exact(numel, k):
    from lgc.compressors.selection import topk_indices

    g = _randn(numel, seed=numel + k) * torch.linspace(0.1, 3.0, numel)  # non-uniform scale along the tensor
    chosen = topk_indices(g, k)
    assert chosen.numel() == k and chosen.unique().numel() == k
    expected = torch.topk(g.abs(), k).indices
    assert set(chosen.tolist()) == set(expected.tolist())


@pytest.mark.parametrize("numel,k", [(1_000, 10), (100_003, 100), (1_000_003, 5000)])
def test_topk_selection_is_exact_on_every_device(reference_device, numel, k):
    # On a GPU it is torch.topk itself; the magnitudes it ranks must be those of the input.
    from lgc.compressors.selection import topk_indices

    g = (_randn(numel, seed=k) * torch.linspace(0.1, 3.0, numel)).to(reference_device)
    g[3] = float("nan")
    chosen = topk_indices(g, k)
    assert chosen.device == g.device and chosen.unique().numel() == k
    assert set(chosen.tolist()) == set(torch.topk(g.abs().cpu(), k).indices.tolist())


@pytest.mark.parametrize("numel,k", [(100_003, 100), (100_003, 1000), (1_000_003, 5000)])
def test_group_maximum_topk_selection_takes_nan_and_inf_first_as_torch_topk(numel, k):
    from lgc.compressors.selection import topk_indices

    g = _randn(numel, seed=1)
    g[[5, 70_000, numel - 1]] = float("nan")  # one in the ragged tail
    g[[7, 300, 90_000]] = float("inf")
    g[9] = -float("inf")
    expected = set(torch.topk(g.abs(), k).indices.tolist())
    assert {5, 7, 9} <= expected
    assert set(topk_indices(g, k).tolist()) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_group_maximum_topk_selection_orders_nan_inf_and_the_largest_float_as_torch_topk(dtype):
    from lgc.compressors.selection import topk_indices

    numel = 1 << 17
    g = (_randn(numel, seed=2) * 0.01).to(dtype)
    g[5] = torch.finfo(dtype).max  # a group maximum no finite bound tells from inf
    g[numel // 2 + 3] = float("inf")
    assert topk_indices(g, 1).tolist() == [numel // 2 + 3]
    g[numel // 2 + 2] = float("nan")  # in the same group as the inf: NaN is larger still
    assert topk_indices(g, 1).tolist() == [numel // 2 + 2]
    assert set(topk_indices(g, 3).tolist()) == {5, numel // 2 + 2, numel // 2 + 3}


def test_topk_selection_takes_a_tensor_that_requires_grad():
    from lgc.compressors.selection import topk_indices

    g = _randn(1 << 16, seed=3).requires_grad_()
    assert set(topk_indices(g, 10).tolist()) == set(torch.topk(g.detach().abs(), 10).indices.tolist())


@pytest.mark.parametrize("k", [50, 1000])  # blocks, columns
def test_group_maximum_topk_selection_with_ties_and_a_ragged_tail(k):
    from lgc.compressors.selection import topk_indices

    g = torch.zeros(100_003)
    g[:10] = 1.0
    g[-2:] = -5.0  # in the tail that does not fill a group
    chosen = topk_indices(g, k)
    assert chosen.numel() == k and chosen.unique().numel() == k
    assert {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 100_001, 100_002} <= set(chosen.tolist())


@pytest.mark.parametrize("k", [200, 2000])  # blocks (the run fills a few), columns (it spreads over many)
def test_group_maximum_topk_selection_finds_a_contiguous_run_of_large_entries(k):
    from lgc.compressors.selection import topk_indices

    g = _randn(200_000, seed=7) * 1e-3
    g[50_000 : 50_000 + k] = torch.linspace(1.0, 2.0, k)
    chosen = topk_indices(g, k)
    assert set(chosen.tolist()) == set(range(50_000, 50_000 + k))


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "inner",
    [
        TopKCompressor(0.05),
        TopKCompressor(0.05, "float16"),
        FP16Compressor(),
        RandomBlockCompressor(0.05),
        RandomBlockCompressor(0.05, shared=False),
        SBCCompressor(0.05),
        SignSGDCompressor(),
        QSGDCompressor(levels=4, bucket_size=512),
        TernGradCompressor(),
    ],
    ids=repr,
)
def test_aggregate_into_writes_what_aggregate_returns_over_whatever_the_bucket_held(inner, out_dtype, workers):
    compressor = ErrorFeedback(inner)
    payloads = [compressor.compress(_randn(3000, seed=s), f"w{s}") for s in range(workers)]
    out = torch.full((3000,), float("nan"), dtype=out_dtype)  # stale bucket content must not leak in
    compressor.aggregate_into(payloads, out)
    expected = compressor.aggregate(payloads).to(out_dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _sixteen_bit_wires():
    from lgc.compressors.chunked_topk import ChunkedTopKCompressor
    from lgc.compressors.demo import DeMoCompressor

    return {
        "topk": lambda: TopKCompressor(0.25, "float16"),
        "chunked_topk": lambda: ChunkedTopKCompressor(chunk=8, k=2, value_dtype="float16"),
        "demo": lambda: DeMoCompressor(chunk=4, k=4, value_dtype="float16"),
    }


@pytest.mark.parametrize("bucketed", [False, True], ids=["per_tensor", "bucket"])
@pytest.mark.parametrize("name", ["topk", "chunked_topk", "demo"])
def test_a_value_beyond_a_half_precision_wire_is_sent_saturated_and_the_rest_kept(name, bucketed):
    """A finite gradient entry above fp16's 65504: the wire carries at most that, the residual stays finite
    and holds the excess, and the following steps send it (a plain cast would keep -inf in the residual)."""
    ef = ErrorFeedback(_sixteen_bit_wires()[name](), bucketed=bucketed)
    big = 1e6 if name == "demo" else 1e5  # DeMo's transform spreads an entry over its tile's coefficients
    grads = [torch.zeros(64), torch.zeros(32)]
    grads[0][5] = big
    grads[1][:4] = torch.tensor([1.0, -2.0, 3.0, -4.0])
    keys = ["a", "b"]
    sent_total = [torch.zeros_like(g) for g in grads]
    for step in range(8):
        inputs = grads if step == 0 else [torch.zeros_like(g) for g in grads]
        payloads = ef.compress_many(inputs, keys)
        for key, payload, total in zip(keys, payloads, sent_total, strict=True):
            assert payload.values.dtype == torch.float16
            assert bool(torch.isfinite(payload.values).all()), f"step {step}: {key} sent a non-finite value"
            assert float(payload.values.float().abs().max()) <= torch.finfo(torch.float16).max
            assert bool(torch.isfinite(ef.residuals[key]).all()), f"step {step}: {key}'s residual is not finite"
            total += ef.compressor.decompress(payload).reshape(-1)
    # Error feedback's invariant: what was sent plus what is held is what came in.
    for grad, key, total in zip(grads, keys, sent_total, strict=True):
        torch.testing.assert_close(total + ef.residuals[key], grad, rtol=1e-5, atol=1e-6 * big)
    # The large entry went out over several steps: one step could not carry it.
    assert float(sent_total[0][5]) > torch.finfo(torch.float16).max


def test_a_plain_cast_to_a_half_precision_wire_keeps_inf_and_nan():
    from lgc.compressors.topk import to_wire_float

    values = torch.tensor([1e5, -1e5, float("inf"), float("-inf"), float("nan"), 1.5])
    wire = to_wire_float(values, torch.float16)
    assert wire[:2].tolist() == [65504.0, -65504.0]
    assert wire[2:4].tolist() == [float("inf"), float("-inf")] and bool(wire[4].isnan()) and float(wire[5]) == 1.5
    # bf16 holds fp32's range but for its last sliver; fp32 to fp32 is the values themselves.
    assert to_wire_float(torch.tensor([3.4e38]), torch.bfloat16).item() == torch.finfo(torch.bfloat16).max
    assert torch.equal(to_wire_float(values[:2], torch.float32), values[:2])
    # bf16 values clamped in fp32: fp16's largest rounds to 65536 in bf16, which is inf in fp16.
    assert to_wire_float(torch.tensor([1e5, -7e4, 65504.0], dtype=torch.bfloat16), torch.float16).tolist() == [
        65504.0,
        -65504.0,
        65504.0,
    ]
    # Values an fp16 allreduce of 4 adds are saturated at a quarter of the largest, fp16 values too.
    summed = to_wire_float(torch.tensor([6e4, -3e4], dtype=torch.float16), torch.float16, terms=4)
    assert summed.tolist() == [16376.0, -16376.0] and bool(torch.isfinite(summed * 4).all())
