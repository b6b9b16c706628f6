"""DeMo's compressor: the DCT, per-tile top-k, wire format, error feedback and the sender-mean aggregate."""

import math
import pickle

import pytest
import torch

from lgc.compressors import CombineMode, ErrorFeedback
from lgc.compressors.demo import (
    DCTPayload,
    DeMoCompressor,
    dct_matrix,
    dct_tiles,
    demo_coefficient_count,
    demo_payload_nbytes,
    idct_tiles,
)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact))


def _coefficients(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The compressor's DCT coefficients of a flat tensor (checked against scipy below)."""
    return DeMoCompressor(chunk=chunk, k=1).transform(x)


def _from_coefficients(coefficients: torch.Tensor, chunk: int) -> torch.Tensor:
    """The tensor whose coefficients are ``coefficients``, computed in float64."""
    return DeMoCompressor(chunk=chunk, k=1).inverse_transform(coefficients.double())


# ------------------------------------------------------------------------------------------------
# the transform


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_dct_matrix_is_orthonormal(n):
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        basis = dct_matrix(n, dtype)
        assert basis.dtype == dtype
        torch.testing.assert_close(basis @ basis.T, torch.eye(n, dtype=dtype), rtol=0, atol=tolerance)
        torch.testing.assert_close(basis.T @ basis, torch.eye(n, dtype=dtype), rtol=0, atol=tolerance)


@pytest.mark.parametrize("n", [2, 7, 64])
def test_dct_matrix_matches_scipy_in_one_and_two_dimensions(n):
    fft = pytest.importorskip("scipy.fft")
    basis = dct_matrix(n)
    x = _randn(n, seed=n, dtype=torch.float64)
    expected = torch.from_numpy(fft.dct(x.numpy(), type=2, norm="ortho"))
    torch.testing.assert_close(basis @ x, expected, rtol=0, atol=1e-12)
    tile = _randn(3, n, n, seed=n + 1, dtype=torch.float64)  # a batch of tiles
    expected = torch.from_numpy(fft.dctn(tile.numpy(), type=2, norm="ortho", axes=(1, 2)))
    torch.testing.assert_close(dct_tiles(tile, basis), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(idct_tiles(expected, basis), tile, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk,numel", [(4, 2 * 16), (4, 16 + 11), (4, 3), (8, 64 + 3 * 8), (5, 2 * 25 + 24)])
def test_transform_is_the_2d_dct_of_each_tile_and_of_the_partial_tiles_rows(chunk, numel):
    fft = pytest.importorskip("scipy.fft")
    x = _randn(numel, seed=numel, dtype=torch.float64)
    coefficients = _coefficients(x, chunk)
    assert coefficients.dtype == torch.float64 and coefficients.shape == (numel,)
    tile = chunk * chunk
    full, rest = divmod(numel, tile)
    rows, tail = divmod(rest, chunk)
    parts = [fft.dctn(x[: full * tile].view(full, chunk, chunk).numpy(), norm="ortho", axes=(1, 2)).reshape(-1)]
    if rows:
        parts.append(fft.dctn(x[full * tile : full * tile + rows * chunk].view(rows, chunk).numpy(), norm="ortho"))
    if tail:
        parts.append(fft.dct(x[numel - tail :].numpy(), norm="ortho"))
    expected = torch.cat([torch.from_numpy(p).reshape(-1) for p in parts])
    torch.testing.assert_close(coefficients, expected, rtol=0, atol=1e-12)
    # orthonormal: the energy is preserved, and the inverse gives the tensor back
    torch.testing.assert_close(coefficients.norm(), x.norm(), rtol=1e-12, atol=0)
    assert _relative_error(_from_coefficients(coefficients, chunk), x) < 1e-12


def test_dct_tiles_round_trip_in_float64():
    basis = dct_matrix(64)
    tiles = _randn(5, 64, 64, dtype=torch.float64)
    assert _relative_error(idct_tiles(dct_tiles(tiles, basis), basis), tiles) < 1e-12


# below one tile, exactly one tile, several tiles plus a remainder (chunk 64), and small tiles
SIZES = [(64, 100), (64, 4096), (64, 3 * 4096 + 1234), (4, 1), (4, 16), (4, 5 * 16 + 3), (5, 7 * 25 + 24)]


@pytest.mark.parametrize("chunk,numel", SIZES)
def test_keeping_every_coefficient_round_trips(chunk, numel):
    compressor = DeMoCompressor(chunk=chunk, k=chunk * chunk)
    x = _randn(numel, seed=numel)
    payload = compressor.compress(x, "w")
    decoded = compressor.decompress(payload)
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32
    assert _relative_error(decoded, x) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_round_trips(dtype):
    compressor = DeMoCompressor(chunk=8, k=64)
    x = _randn(3 * 64 + 10, seed=1).to(dtype)
    decoded = compressor.decompress(compressor.compress(x, "w"))
    assert decoded.dtype == torch.float32
    # the input is exact in fp32, so only the fp32 transform's rounding remains
    torch.testing.assert_close(decoded, x.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
def test_half_precision_values_round_trip_within_their_precision(value_dtype):
    compressor = DeMoCompressor(chunk=8, k=64, value_dtype=value_dtype)
    x = _randn(2 * 64 + 5, seed=2)
    payload = compressor.compress(x, "w")
    assert payload.values.dtype == getattr(torch, value_dtype)
    decoded = compressor.decompress(compressor.payload_from_wire(payload.to_wire(), x.numel()))
    assert _relative_error(decoded, x) < (1e-3 if value_dtype == "float16" else 8e-3)


# ------------------------------------------------------------------------------------------------
# selection in the transformed domain


def test_a_few_basis_functions_per_tile_are_found_and_reconstructed_exactly():
    chunk, tiles, per_tile = 8, 4, 5
    generator = torch.Generator().manual_seed(3)
    coefficients = torch.zeros(tiles, chunk * chunk, dtype=torch.float64)
    chosen = []
    for t in range(tiles):
        positions = torch.randperm(chunk * chunk, generator=generator)[:per_tile]
        signs = torch.where(torch.rand(per_tile, generator=generator) < 0.5, -1.0, 1.0).double()
        coefficients[t, positions] = signs * (1.0 + torch.rand(per_tile, generator=generator, dtype=torch.float64))
        chosen.append(positions + t * chunk * chunk)
    x = _from_coefficients(coefficients.view(-1), chunk).float()
    compressor = DeMoCompressor(chunk=chunk, k=per_tile)
    payload = compressor.compress(x, "w")
    assert sorted(payload.indices.tolist()) == sorted(torch.cat(chosen).tolist())
    torch.testing.assert_close(payload.values, coefficients.view(-1)[payload.indices].float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(compressor.decompress(payload), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk,numel,k", [(8, 5 * 64 + 40, 6), (4, 3 * 16 + 1, 3), (8, 20, 64)])
def test_each_tile_keeps_its_largest_coefficients(chunk, numel, k):
    tile = chunk * chunk
    x = _randn(numel, seed=numel)
    payload = DeMoCompressor(chunk=chunk, k=k).compress(x, "w")
    magnitudes = _coefficients(x, chunk).abs()
    full, rest = divmod(numel, tile)
    partial_k = max(1, math.ceil(k * rest / tile)) if rest else 0
    assert payload.values.numel() == full * k + partial_k == demo_coefficient_count(numel, chunk, k)
    tile_of = payload.indices // tile
    for t in range(-(-numel // tile)):
        in_tile = magnitudes[t * tile : (t + 1) * tile]  # the partial tile has as many coefficients as entries
        kept = torch.zeros(in_tile.numel(), dtype=torch.bool)
        kept[payload.indices[tile_of == t] % tile] = True
        assert int(kept.sum()) == (k if t < full else partial_k)
        if not kept.all():
            assert in_tile[kept].min() >= in_tile[~kept].max()
    torch.testing.assert_close(payload.values, _coefficients(x, chunk)[payload.indices], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# wire format


@pytest.mark.parametrize(
    "numel,chunk,k,value_dtype",
    [
        (100, 64, 32, "float32"),  # below one tile: ceil(32 * 100 / 4096) = 1 coefficient
        (4096, 64, 32, "float32"),  # exactly one tile
        (3 * 4096 + 1234, 64, 32, "float16"),  # many tiles + remainder
        (10_000, 64, 32, "bfloat16"),
        (5 * 64 + 7, 8, 10, "float32"),
        (1, 2, 4, "float32"),  # 2-bit positions
        (7 * 25 + 3, 5, 25, "float16"),  # 5 bits per position, k = chunk**2
    ],
)
def test_payload_size_is_the_formula_and_the_wire_round_trips(numel, chunk, k, value_dtype):
    compressor = DeMoCompressor(chunk=chunk, k=k, value_dtype=value_dtype)
    payload = compressor.compress(_randn(numel, seed=numel), "w")
    count = demo_coefficient_count(numel, chunk, k)
    value_size = 4 if value_dtype == "float32" else 2
    bits = math.ceil(math.log2(chunk * chunk))
    assert payload.nbytes == demo_payload_nbytes(numel, chunk, k, value_dtype)
    assert payload.nbytes == count * value_size + math.ceil(count * bits / 8)
    wire = payload.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    parsed = compressor.payload_from_wire(wire, numel)
    assert isinstance(parsed, DCTPayload)
    # what the DDP hook checks: the same wire tensors, dtypes and lengths
    assert [(t.dtype, t.numel()) for t in parsed.tensors()] == [(t.dtype, t.numel()) for t in payload.tensors()]
    assert torch.equal(parsed.values, payload.values)
    assert torch.equal(parsed.positions, payload.positions)
    assert torch.equal(parsed.indices, payload.indices)
    assert torch.equal(compressor.decompress(parsed), compressor.decompress(payload))


def test_reference_defaults_cost_twelve_bits_per_position():
    assert demo_payload_nbytes(4096, 64, 32) == 32 * 4 + 48
    assert demo_payload_nbytes(10_000, 64, 32) == 79 * 4 + 119  # 2 * 32 + ceil(32 * 1808 / 4096) = 79
    assert DeMoCompressor().compress(_randn(10_000), "w").nbytes == 435


def test_a_wire_of_the_wrong_length_is_refused():
    compressor = DeMoCompressor(chunk=8, k=4)
    wire = compressor.compress(_randn(100), "w").to_wire()
    with pytest.raises(ValueError, match="bytes"):
        compressor.payload_from_wire(wire[:-1], 100)


# ------------------------------------------------------------------------------------------------
# error feedback: DeMo's momentum


def test_error_feedback_keeps_the_decayed_momentum_of_what_was_not_sent():
    numel, decay = 3 * 64 + 21, 0.9
    compressor = DeMoCompressor(chunk=8, k=4)
    ef = ErrorFeedback(compressor, decay=decay)
    residual = torch.zeros(numel)
    for step in range(3):
        g = _randn(numel, seed=10 + step)
        v = decay * residual + g
        payload = ef.compress(g, "w")
        sent = compressor.decompress(payload)
        torch.testing.assert_close(sent + ef.residuals["w"], v, rtol=0, atol=1e-6)
        assert torch.linalg.vector_norm(sent) > 0 and torch.linalg.vector_norm(ef.residuals["w"]) > 0
        residual = v - sent


def test_flat_tiles_of_a_matrix_with_chunk_columns_match_the_reference_algorithm():
    """Two workers, three steps: lgc (error feedback + hook's 1/P scaling) against DeMo's optimizer step, written out.

    A row-major ``(rows, chunk)`` matrix's flat tiles are exactly the reference's ``chunk x chunk``
    tiles, so the signed updates agree (lr and the world size scale the momentum, not its sign).
    """
    chunk, rows, k, decay, lr, workers = 8, 24, 5, 0.999, 0.01, 2
    basis = dct_matrix(chunk, torch.float32)
    lgc = [ErrorFeedback(DeMoCompressor(chunk=chunk, k=k), decay=decay) for _ in range(workers)]
    deltas = [torch.zeros(rows, chunk) for _ in range(workers)]
    for step in range(3):
        grads = [_randn(rows, chunk, seed=100 * step + w) for w in range(workers)]
        # the reference, per worker: momentum with lr, 2-D DCT of each tile, top-k, subtract what was sent
        indices, values = [], []
        for w in range(workers):
            deltas[w].mul_(decay).add_(grads[w], alpha=lr)
            coefficients = dct_tiles(deltas[w].view(-1, chunk, chunk), basis).reshape(-1, chunk * chunk)
            idx = torch.topk(coefficients.abs(), k, dim=-1).indices
            val = torch.gather(coefficients, -1, idx)
            sent = torch.zeros_like(coefficients).scatter_(-1, idx, val)
            deltas[w] -= idct_tiles(sent.view(-1, chunk, chunk), basis).reshape(rows, chunk)
            indices.append(idx)
            values.append(val)
        mean = torch.zeros(rows // chunk, chunk * chunk).scatter_reduce_(
            -1, torch.cat(indices, -1), torch.cat(values, -1), reduce="mean", include_self=False
        )
        reference = idct_tiles(mean.view(-1, chunk, chunk), basis).reshape(-1)
        # lgc: what the DDP hook does with each worker's gradient
        payloads = [lgc[w].compress(grads[w].reshape(-1) / workers, "w") for w in range(workers)]
        update = lgc[0].aggregate(payloads)
        clear = reference.abs() > 1e-6
        assert clear.float().mean() > 0.9
        assert torch.equal(update[clear], reference.sign()[clear])


# ------------------------------------------------------------------------------------------------
# aggregation: the mean over the workers that sent a coefficient


def _payload_of(coefficients: dict[int, float], chunk: int, numel: int, k: int) -> DCTPayload:
    """Compress a tensor whose only DCT coefficients (in one tile) are ``coefficients``."""
    dense = torch.zeros(numel, dtype=torch.float64)
    for index, value in coefficients.items():
        dense[index] = value
    x = _from_coefficients(dense, chunk).float()
    payload = DeMoCompressor(chunk=chunk, k=k).compress(x, "w")
    assert sorted(payload.indices.tolist()) == sorted(coefficients)
    return payload


def test_a_coefficient_is_averaged_over_its_senders_only():
    chunk, numel = 4, 16
    a = _payload_of({0: 5.0, 3: 2.0}, chunk, numel, k=2)
    b = _payload_of({0: 1.0, 7: -4.0}, chunk, numel, k=2)
    expected = torch.zeros(16, dtype=torch.float64)
    expected[0], expected[3], expected[7] = 3.0, 2.0, -4.0  # (5 + 1) / 2; only a sent 3; only b sent 7
    expected = _from_coefficients(expected, chunk).float()
    mean = DeMoCompressor(chunk=chunk, k=2, sign=False).aggregate([a, b])
    torch.testing.assert_close(mean, expected, rtol=0, atol=1e-5)
    signed = DeMoCompressor(chunk=chunk, k=2).aggregate([a, b])
    assert torch.equal(signed, expected.sign())


def test_sign_false_undoes_the_hooks_division_by_the_world_size():
    chunk, numel = 4, 16
    a = _payload_of({0: 5.0, 3: 2.0}, chunk, numel, k=2)
    compressor = DeMoCompressor(chunk=chunk, k=2, sign=False)
    alone = compressor.aggregate([a])
    torch.testing.assert_close(alone, compressor.decompress(a))
    compressor.set_world_size(4)
    torch.testing.assert_close(compressor.aggregate([a]), 4 * alone)


@pytest.mark.parametrize("sign", [True, False])
def test_aggregate_matches_a_dense_sender_mean(sign):
    chunk, k, numel, workers = 8, 6, 4 * 64 + 30, 3
    compressor = DeMoCompressor(chunk=chunk, k=k, sign=sign)
    payloads = [compressor.compress(_randn(numel, seed=20 + w), "w") for w in range(workers)]
    sums = torch.zeros(numel, dtype=torch.float64)
    counts = torch.zeros(numel, dtype=torch.float64)
    for payload in payloads:
        for index, value in zip(payload.indices.tolist(), payload.values.tolist(), strict=True):
            sums[index] += value
            counts[index] += 1
    assert (counts > 1).any() and (counts == 1).any()  # some coefficients shared, some not
    mean = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    reference = _from_coefficients(mean, chunk)
    out = compressor.aggregate(payloads)
    assert out.shape == (numel,) and out.dtype == torch.float32
    if sign:
        assert set(out.unique().tolist()) <= {-1.0, 0.0, 1.0}
        clear = reference.abs() > 1e-6
        assert torch.equal(out[clear], reference.sign().float()[clear])
    else:
        torch.testing.assert_close(out, reference.float(), rtol=0, atol=1e-5)


def test_coefficients_nobody_sent_are_zero():
    # Hand-built payloads of a two-tile tensor that only touch the first tile: the second decodes to exactly 0.
    chunk, numel = 4, 2 * 16
    a = DCTPayload(numel=numel, values=torch.tensor([3.0]), positions=torch.empty(0), indices=torch.tensor([1]))
    b = DCTPayload(numel=numel, values=torch.tensor([-1.0]), positions=torch.empty(0), indices=torch.tensor([1]))
    out = DeMoCompressor(chunk=chunk, k=1, sign=False).aggregate([a, b])
    assert torch.equal(out[16:], torch.zeros(16))
    expected = torch.zeros(16, dtype=torch.float64)
    expected[1] = 1.0  # (3 - 1) / 2
    torch.testing.assert_close(out[:16], _from_coefficients(expected, chunk).float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_aggregate_into_a_half_precision_bucket_slice(dtype):
    chunk, k, numel = 8, 6, 2 * 64 + 9
    for sign in (True, False):
        compressor = DeMoCompressor(chunk=chunk, k=k, sign=sign)
        payloads = [compressor.compress(_randn(numel, seed=30 + w), "w") for w in range(2)]
        bucket = torch.full((numel + 20,), 7.0, dtype=dtype)
        compressor.aggregate_into(payloads, bucket[10 : 10 + numel])
        assert torch.equal(bucket[10 : 10 + numel], compressor.aggregate(payloads).to(dtype))
        assert torch.equal(bucket[:10], torch.full((10,), 7.0, dtype=dtype))
        assert torch.equal(bucket[10 + numel :], torch.full((10,), 7.0, dtype=dtype))


# ------------------------------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"k": 0}, "got 0"),
        ({"chunk": 8, "k": 65}, "got 65"),
        ({"chunk": 1, "k": 1}, "got 1"),
        ({"chunk": 8.0}, "got 8.0"),
        ({"k": True}, "got True"),
        ({"value_dtype": "int8"}, "'int8'"),
    ],
)
def test_bad_knobs_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeMoCompressor(**kwargs)


def test_knobs_repr_and_state():
    compressor = DeMoCompressor()
    assert (compressor.chunk, compressor.k, compressor.sign, compressor.value_dtype) == (64, 32, True, torch.float32)
    assert compressor.combine is CombineMode.GATHER
    assert compressor.density == 32 / 4096
    assert repr(compressor) == "DeMoCompressor(chunk=64, k=32, sign=True)"
    assert repr(DeMoCompressor(8, 3, sign=False, value_dtype="bf16")) == (
        "DeMoCompressor(chunk=8, k=3, sign=False, value_dtype=bfloat16)"
    )
    assert (
        repr(ErrorFeedback(compressor, decay=0.999))
        == "ErrorFeedback(DeMoCompressor(chunk=64, k=32, sign=True), decay=0.999)"
    )
    assert compressor.state_dict() == {}
    compressor.compress(_randn(100), "w")  # builds the cached DCT matrix
    restored = pickle.loads(pickle.dumps(compressor))
    assert restored._bases == {}
    x = _randn(5000, seed=4)
    assert torch.equal(
        restored.decompress(restored.compress(x, "w")), compressor.decompress(compressor.compress(x, "w"))
    )


def test_an_infinite_entry_does_not_crash():
    x = _randn(300)
    x[7] = float("inf")
    compressor = DeMoCompressor(chunk=8, k=4)
    payload = compressor.compress(x, "w")
    compressor.aggregate([compressor.payload_from_wire(payload.to_wire(), 300)])
