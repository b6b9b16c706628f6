"""DeMo's compressor: the DCT, per-tile top-k, wire format, error feedback and the sender-mean aggregate."""

import math
import pickle

import pytest
import torch
from references import get_smaller_split

from lgc.compressors import CombineMode, ErrorFeedback
from lgc.compressors.chunked_topk import chunked_topk_count, chunked_topk_nbytes
from lgc.compressors.dct import dct_matrix, dct_tiles, idct_tiles
from lgc.compressors.demo import DCTPayload, DeMoCompressor
from lgc.compressors.tiles import tile_layout


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact))


def _coefficients(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The compressor's DCT coefficients of a flat tensor in flat tiles (checked against scipy below)."""
    return DeMoCompressor(chunk=chunk, k=1, tiling="flat").transform(x)


def _from_coefficients(coefficients: torch.Tensor, chunk: int) -> torch.Tensor:
    """The tensor whose flat-tile coefficients are ``coefficients``, computed in float64."""
    return DeMoCompressor(chunk=chunk, k=1, tiling="flat").inverse_transform(coefficients.double())


def _shaped(shape: tuple[int, ...], **knobs) -> DeMoCompressor:
    """A DeMo compressor that knows the parameter ``"w"`` of ``shape`` (as the hook attaches it)."""
    compressor = DeMoCompressor(**knobs)
    compressor.attach_parameters({"w": torch.empty(shape)})
    return compressor


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
# shape tiles: a matrix needing the divisor rule, a grid of tiles, a conv weight, vectors, a prime side
SHAPES = [(96, 40), (128, 192), (16, 16, 3, 3), (64,), (10,), (200,), (67, 3), (1,)]


@pytest.mark.parametrize("chunk,numel", SIZES)
def test_keeping_every_coefficient_round_trips(chunk, numel):
    compressor = DeMoCompressor(chunk=chunk, k=chunk * chunk, tiling="flat")
    x = _randn(numel, seed=numel)
    payload = compressor.compress(x, "w")
    decoded = compressor.decompress(payload)
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32
    assert _relative_error(decoded, x) < 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_keeping_every_coefficient_of_shape_tiles_round_trips(shape):
    compressor = _shaped(shape, chunk=64, k=4096)
    x = _randn(math.prod(shape), seed=len(shape))
    payload = compressor.compress(x, "w")
    assert payload.values.numel() == x.numel()
    assert _relative_error(compressor.decompress(payload), x) < 1e-5
    exact = compressor.inverse_transform(compressor.transform(x.double(), payload.layout), payload.layout)
    assert _relative_error(exact, x.double()) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_round_trips(dtype):
    compressor = DeMoCompressor(chunk=8, k=64)  # a vector: chunks of 2 (the 202 entries' divisor), all kept
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
    decoded = compressor.decompress(compressor.payload_from_wire(payload.to_wire(), x.numel(), key="w"))
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
    compressor = DeMoCompressor(chunk=chunk, k=per_tile, tiling="flat")
    payload = compressor.compress(x, "w")
    assert sorted(payload.indices.tolist()) == sorted(torch.cat(chosen).tolist())
    torch.testing.assert_close(payload.values, coefficients.view(-1)[payload.indices].float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(compressor.decompress(payload), x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk,numel,k", [(8, 5 * 64 + 40, 6), (4, 3 * 16 + 1, 3), (8, 20, 64)])
def test_each_tile_keeps_its_largest_coefficients(chunk, numel, k):
    tile = chunk * chunk
    x = _randn(numel, seed=numel)
    payload = DeMoCompressor(chunk=chunk, k=k, tiling="flat").compress(x, "w")
    magnitudes = _coefficients(x, chunk).abs()
    full, rest = divmod(numel, tile)
    partial_k = max(1, math.ceil(k * rest / tile)) if rest else 0
    assert payload.values.numel() == full * k + partial_k == chunked_topk_count(numel, chunk, k, "flat")
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


@pytest.mark.parametrize("shape", [(96, 40), (128, 192), (16, 16, 3, 3), (10, 64), (64,), (10,), (67, 3)], ids=str)
def test_shape_tiles_are_the_references_tiles_and_keep_their_largest_coefficients(shape):
    """Each dimension cut by its largest divisor <= chunk, a 2-D DCT per tile (conv weights as matrices), k per tile."""
    fft = pytest.importorskip("scipy.fft")
    chunk, k = 64, 32
    x = _randn(math.prod(shape), seed=7, dtype=torch.float64)
    rows = shape[0] if len(shape) > 1 else 1
    cols = x.numel() // rows
    h = max(d for d in range(1, min(rows, chunk) + 1) if rows % d == 0)
    w = max(d for d in range(1, min(cols, chunk) + 1) if cols % d == 0)
    tiles = x.view(rows // h, h, cols // w, w).permute(0, 2, 1, 3).numpy()  # "(y h) (x w) -> y x h w"
    expected = torch.from_numpy(fft.dctn(tiles, norm="ortho", axes=(2, 3))).reshape(-1, h * w)
    compressor = _shaped(shape, chunk=chunk, k=k)
    layout = compressor.layout("w", x.numel())
    assert layout.tile_shape == (h, w) and layout.bits == (h * w - 1).bit_length()
    torch.testing.assert_close(compressor.transform(x, layout), expected.reshape(-1), rtol=0, atol=1e-12)
    payload = compressor.compress(x.float(), "w")
    keep = min(k, h * w)
    assert payload.values.numel() == expected.shape[0] * keep == chunked_topk_count(shape, chunk, k)
    kept = torch.zeros(expected.shape, dtype=torch.bool)
    kept.view(-1)[payload.indices] = True
    assert bool((kept.sum(dim=1) == keep).all())
    magnitudes = expected.abs()
    if keep < h * w:
        low = torch.where(kept, magnitudes, torch.inf).amin(dim=1)
        high = torch.where(kept, -torch.inf, magnitudes).amax(dim=1)
        assert bool((low >= high).all())
    torch.testing.assert_close(payload.values, expected.reshape(-1)[payload.indices].float(), rtol=0, atol=1e-5)


def _resnet8_shapes() -> list[tuple[int, ...]]:
    """lgc's CIFAR ResNet-8 for the digits task (1 input channel, 10 classes): 23 parameters, 75,002 entries."""
    from lgc.models import CifarResNet

    return [tuple(p.shape) for p in CifarResNet(depth=8, num_classes=10, in_channels=1).parameters()]


def _reference_count(shape: tuple[int, ...], chunk: int, topk: int) -> int:
    """Coefficients bloc97/DeMo ``demo.py`` keeps of one tensor: ``_get_smaller_split`` per dimension, ``_clamp_topk``.

    Conv weights as ``(out, in*kh*kw)`` matrices.
    """
    if len(shape) > 1:
        rows, cols = shape[0], math.prod(shape[1:])
        h, w = get_smaller_split(rows, chunk), get_smaller_split(cols, chunk)
        return (rows // h) * (cols // w) * max(1, min(topk, h * w))
    w = get_smaller_split(shape[0], chunk)
    return shape[0] // w * max(1, min(topk, w))


def test_resnet8_keeps_the_references_1386_coefficients_per_step():
    shapes = _resnet8_shapes()
    assert (len(shapes), sum(math.prod(s) for s in shapes)) == (23, 75002)
    compressor = DeMoCompressor()  # chunk 64, k 32
    compressor.attach_parameters({str(i): torch.empty(shape) for i, shape in enumerate(shapes)})
    kept = [compressor.compress(_randn(math.prod(s), seed=i), str(i)).values.numel() for i, s in enumerate(shapes)]
    assert kept == [_reference_count(shape, 64, 32) for shape in shapes]
    assert sum(kept) == 1386
    # The 64-entry BatchNorm vectors keep half their coefficients, the 10 x 64 classifier 32 of 640.
    assert {kept[i] for i, s in enumerate(shapes) if s == (64,)} == {32} and kept[shapes.index((10, 64))] == 32
    # Flat tiles (chunk**2 consecutive entries, the partial one keeping its share) keep 598.
    assert sum(chunked_topk_count(math.prod(s), 64, 32, "flat") for s in shapes) == 598


@pytest.mark.parametrize(
    "shape,chunk,k,tiling,value_dtype",
    [
        ((100,), 64, 32, "flat", "float32"),  # below one tile: ceil(32 * 100 / 4096) = 1 coefficient
        ((4096,), 64, 32, "flat", "float32"),  # exactly one tile
        ((3 * 4096 + 1234,), 64, 32, "flat", "float16"),  # many tiles + remainder
        ((10_000,), 64, 32, "flat", "bfloat16"),
        ((5 * 64 + 7,), 8, 10, "flat", "float32"),
        ((1,), 2, 4, "flat", "float32"),  # 2-bit positions
        ((7 * 25 + 3,), 5, 25, "flat", "float16"),  # 5 bits per position, k = chunk**2
        ((96, 40), 64, 32, "shape", "float32"),  # 11-bit positions in 48 x 40 tiles
        ((128, 192), 64, 32, "shape", "bfloat16"),  # a 2 x 3 grid of 64 x 64 tiles
        ((16, 16, 3, 3), 64, 32, "shape", "float32"),  # conv weight as 16 x 144: tiles of 16 x 48
        ((64,), 64, 32, "shape", "float16"),  # 6-bit positions
        ((10,), 64, 32, "shape", "float32"),  # all 10, 4-bit positions
        ((1,), 64, 32, "shape", "float32"),  # a 1-entry tile: no position bits
    ],
)
def test_payload_size_is_the_formula_and_the_wire_round_trips(shape, chunk, k, tiling, value_dtype):
    compressor = _shaped(shape, chunk=chunk, k=k, tiling=tiling, value_dtype=value_dtype)
    numel = math.prod(shape)
    payload = compressor.compress(_randn(numel, seed=numel), "w")
    layout = tile_layout(shape, chunk, k, tiling)
    count = layout.count
    value_size = 4 if value_dtype == "float32" else 2
    tile = chunk * chunk if tiling == "flat" else math.prod(layout.tile_shape)
    bits = math.ceil(math.log2(tile))
    assert payload.values.numel() == count
    assert payload.nbytes == chunked_topk_nbytes(shape, chunk, k, tiling, value_dtype)
    assert payload.nbytes == count * value_size + math.ceil(count * bits / 8)
    wire = payload.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    parsed = compressor.payload_from_wire(wire, numel, key="w")
    assert isinstance(parsed, DCTPayload)
    # what the DDP hook checks: the same wire tensors, dtypes and lengths
    assert [(t.dtype, t.numel()) for t in parsed.tensors()] == [(t.dtype, t.numel()) for t in payload.tensors()]
    assert torch.equal(parsed.values, payload.values)
    assert torch.equal(parsed.positions, payload.positions)
    assert torch.equal(parsed.indices, payload.indices)
    assert torch.equal(compressor.decompress(parsed), compressor.decompress(payload))


def test_reference_defaults_cost_their_tiles_bits_per_position():
    assert chunked_topk_nbytes((4096,), 64, 32, "flat") == 32 * 4 + 48
    assert chunked_topk_nbytes((10_000,), 64, 32, "flat") == 79 * 4 + 119  # 2 * 32 + ceil(32 * 1808 / 4096) = 79
    assert DeMoCompressor(tiling="flat").compress(_randn(10_000), "w").nbytes == 435
    assert chunked_topk_nbytes((4096, 4096), 64, 32) == 4096 * 32 * 4 + 4096 * 32 * 12 // 8  # 64 x 64 tiles: 12 bits
    assert _shaped((96, 40)).compress(_randn(3840), "w").nbytes == 64 * 4 + 88  # 48 x 40 tiles: 11 bits
    assert DeMoCompressor().compress(_randn(64), "w").nbytes == 32 * 4 + 24  # a vector keeps half, 6 bits


def test_a_shaped_tensor_needs_its_shape_attached():
    with pytest.raises(ValueError, match=r"'w' came as a \(96, 40\) tensor without attach_parameters"):
        DeMoCompressor().compress(_randn(96, 40), "w")
    with pytest.raises(ValueError, match=r"attached with shape \(96, 40\), but a tensor of 100 entries came"):
        _shaped((96, 40)).compress(_randn(100), "w")
    assert _shaped((96, 40)).compress(_randn(96, 40), "w").values.numel() == 64


def test_a_wire_of_the_wrong_length_is_refused():
    compressor = DeMoCompressor(chunk=8, k=4)
    wire = compressor.compress(_randn(100), "w").to_wire()
    with pytest.raises(ValueError, match=r"the DeMo payload of 'w' \(100 entries\) has \d+ bytes, got"):
        compressor.payload_from_wire(wire[:-1], 100, key="w")


# ------------------------------------------------------------------------------------------------
# error feedback: DeMo's momentum


@pytest.mark.parametrize("tiling", ["shape", "flat"])
def test_error_feedback_keeps_the_decayed_momentum_of_what_was_not_sent(tiling):
    numel, decay = 3 * 64 + 21, 0.9
    compressor = DeMoCompressor(chunk=8, k=4, tiling=tiling)
    ef = ErrorFeedback(compressor, decay=decay)
    ef.attach_parameters({"w": torch.empty(3, 71)})  # shape tiles of 3 x 1
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
    lgc = [ErrorFeedback(DeMoCompressor(chunk=chunk, k=k, tiling="flat"), decay=decay) for _ in range(workers)]
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
# the whole step against a transcription of bloc97/DeMo's demo.py


def _reference_dct(x: torch.Tensor) -> torch.Tensor:
    """``demo.py`` ``_dct(x, norm="ortho")``: the DCT-II of the last dimension, through an FFT."""
    shape, n = x.shape, x.shape[-1]
    x = x.contiguous().view(-1, n)
    v = torch.cat([x[:, ::2], x[:, 1::2].flip([1])], dim=1)
    vc = torch.view_as_real(torch.fft.fft(v, dim=1))
    k = -torch.arange(n, dtype=x.dtype, device=x.device)[None, :] * math.pi / (2 * n)
    out = vc[:, :, 0] * torch.cos(k) - vc[:, :, 1] * torch.sin(k)
    out[:, 0] /= math.sqrt(n) * 2
    out[:, 1:] /= math.sqrt(n / 2) * 2
    return 2 * out.view(*shape)


def _reference_idct(x: torch.Tensor) -> torch.Tensor:
    """``demo.py`` ``_idct(X, norm="ortho")``: the inverse of :func:`_reference_dct`, through an inverse FFT."""
    shape, n = x.shape, x.shape[-1]
    xv = x.contiguous().view(-1, n) / 2
    xv[:, 0] *= math.sqrt(n) * 2
    xv[:, 1:] *= math.sqrt(n / 2) * 2
    k = torch.arange(n, dtype=x.dtype, device=x.device)[None, :] * math.pi / (2 * n)
    cos, sin = torch.cos(k), torch.sin(k)
    imaginary = torch.cat([xv[:, :1] * 0, -xv.flip([1])[:, :-1]], dim=1)
    spectrum = torch.stack([xv * cos - imaginary * sin, xv * sin + imaginary * cos], dim=2)
    v = torch.fft.irfft(torch.view_as_complex(spectrum), n=n, dim=1)
    out = v.new_zeros(v.shape)
    out[:, ::2] += v[:, : n - n // 2]
    out[:, 1::2] += v.flip([1])[:, : n // 2]
    return out.view(*shape)


class _ReferenceDeMo:
    """bloc97/DeMo ``demo.py``: ``DeMo.step`` for several workers in one process.

    A transcription of ``DeMo.step``, ``TransformDCT`` and ``CompressDCT`` (einops patterns written
    as reshape/permute): every worker accumulates ``delta = decay * delta + lr * grad``, encodes it
    (each dimension cut by ``_get_smaller_split``, an FFT-built DCT basis applied by einsum), keeps
    the ``topk`` largest coefficients of every tile and subtracts their decoding; the gathered
    (index, value) pairs are decoded with ``scatter_reduce(reduce="mean", include_self=False)``,
    and the parameter takes ``torch.optim.SGD``'s step with the sign, after its decoupled weight decay
    (``p *= 1 - lr * weight_decay``, which the reference applies first and keeps out of the momentum).
    """

    def __init__(
        self,
        params,
        workers: int,
        lr: float,
        decay: float = 0.999,
        chunk: int = 64,
        topk: int = 32,
        weight_decay: float = 0.0,
    ):
        self.weight_decay = weight_decay
        self.params = {name: p.clone() for name, p in params.items()}
        self.deltas = [{name: torch.zeros_like(p) for name, p in params.items()} for _ in range(workers)]
        self.lr, self.decay, self.chunk, self.topk = lr, decay, chunk, topk
        sizes = {get_smaller_split(n, chunk) for p in params.values() for n in p.shape}
        some = next(iter(params.values()))
        eye = {n: torch.eye(n, dtype=some.dtype, device=some.device) for n in sizes}
        self.f = {n: _reference_dct(i) for n, i in eye.items()}
        self.b = {n: _reference_idct(i) for n, i in eye.items()}

    def encode(self, x):
        if x.dim() > 1:
            n1, n2 = get_smaller_split(x.shape[0], self.chunk), get_smaller_split(x.shape[1], self.chunk)
            x = x.reshape(x.shape[0] // n1, n1, x.shape[1] // n2, n2)  # "(y h) (x w) -> y h x w"
            return torch.einsum("...ijkl, jb, ld -> ...ikbd", x, self.f[n1], self.f[n2])
        n1 = get_smaller_split(x.shape[0], self.chunk)
        return torch.einsum("...ij, jb -> ...ib", x.reshape(-1, n1), self.f[n1])

    def decode(self, x):
        if x.dim() > 2:
            x = torch.einsum("...ijkl, kb, ld -> ...ibjd", x, self.b[x.shape[2]], self.b[x.shape[3]])
            return x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3])  # "y h x w -> (y h) (x w)"
        return torch.einsum("...ij, jb -> ...ib", x, self.b[x.shape[1]]).reshape(-1)

    def compress(self, x):
        shape = x.shape
        if x.dim() > 2:
            x = x.reshape(*shape[:2], -1)  # "y x h w -> y x (h w)"
        topk = max(1, min(self.topk, x.shape[-1]))
        idx = torch.topk(x.abs(), k=topk, dim=-1, largest=True, sorted=False).indices
        return idx, torch.gather(x, -1, idx), shape

    def decompress(self, idx, val, shape):
        x = torch.zeros(shape, dtype=val.dtype, device=val.device)
        rows = x.reshape(*shape[:2], -1) if len(shape) > 2 else x
        rows.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
        return rows.reshape(shape)

    def step(self, grads: list[dict[str, torch.Tensor]]) -> None:
        for name, p in self.params.items():
            if self.weight_decay:
                p.mul_(1.0 - self.lr * self.weight_decay)
            indices, values = [], []
            for delta in (deltas[name] for deltas in self.deltas):
                delta.mul_(self.decay).add_(grads[len(indices)][name], alpha=self.lr)
                idx, val, shape = self.compress(self.encode(delta))
                delta.sub_(self.decode(self.decompress(idx, val, shape)))
                indices.append(idx)
                values.append(val)
            update = self.decode(self.decompress(torch.cat(indices, -1), torch.cat(values, -1), shape))
            p.add_(update.sign_(), alpha=-self.lr)


@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
@pytest.mark.parametrize("workers", [2, 4])
def test_demo_step_matches_a_transcription_of_the_reference(workers, weight_decay, reference_device):
    """lgc's DeMo step, as the DDP hook runs it, against bloc97/DeMo ``demo.py``'s ``DeMo.step``, transcribed.

    Per worker and parameter: ``ErrorFeedback(DeMoCompressor(), decay=0.999)`` compresses the
    gradient divided by the world size (the hook's bucket division) under the parameter's name,
    every rank parses every wire payload and aggregates, and ``torch.optim.SGD`` steps with the
    result. A ``96 x 40`` matrix (tiles of 48 x 40), a 64-entry vector (32 of 64 kept) and a
    ``10 x 64`` classifier (one tile, 32 of 640), four steps of random gradients.

    The updates are signs, so the reference's ``lr`` inside the momentum and lgc's ``1 / P`` do
    not change them: the parameters agree bit for bit. The momenta agree to float rounding (the
    reference's FFT-built basis and einsums against lgc's closed-form basis and matmuls, and its
    ``lr * P`` scale). With weight decay, lgc's config leaves it to ``torch.optim.SGD`` (``p -= lr * (sign +
    wd * p)``) where the reference decays first (``p *= 1 - lr * wd``, then ``p -= lr * sign``): the same
    step, equal to float rounding; neither puts the decay into the momentum.
    """
    device, lr, decay = reference_device, 0.01, 0.999
    generator = torch.Generator().manual_seed(workers)
    shapes = {"hidden.weight": (96, 40), "norm.weight": (64,), "fc.weight": (10, 64)}
    params = {name: torch.randn(shape, generator=generator).to(device) for name, shape in shapes.items()}
    reference = _ReferenceDeMo(params, workers, lr=lr, decay=decay, weight_decay=weight_decay)
    model = {name: torch.nn.Parameter(p.clone()) for name, p in params.items()}
    optimizer = torch.optim.SGD(model.values(), lr=lr, weight_decay=weight_decay)  # DeMo's base: no momentum
    ranks = [ErrorFeedback(DeMoCompressor(), decay=decay) for _ in range(workers)]
    for rank in ranks:
        rank.attach_parameters(model)
        rank.set_world_size(workers)
    for _ in range(4):
        grads = [{n: torch.randn(s, generator=generator).to(device) for n, s in shapes.items()} for _ in range(workers)]
        reference.step(grads)
        for name, p in model.items():
            wires = [
                rank.compress(grads[w][name].reshape(-1) / workers, name).to_wire() for w, rank in enumerate(ranks)
            ]
            decoded = [
                rank.aggregate([rank.payload_from_wire(wire, p.numel(), key=name) for wire in wires]) for rank in ranks
            ]
            assert all(torch.equal(d, decoded[0]) for d in decoded), "every rank decodes the same bits"
            p.grad = decoded[0].view_as(p)
        optimizer.step()
        for name, p in model.items():
            if weight_decay:
                torch.testing.assert_close(p.detach(), reference.params[name], rtol=1e-6, atol=1e-7, msg=name)
            else:
                assert torch.equal(p.detach(), reference.params[name]), name
            for rank, deltas in zip(ranks, reference.deltas, strict=True):
                momentum = rank.residuals[name].view_as(p) * (lr * workers)
                torch.testing.assert_close(momentum, deltas[name], rtol=1e-4, atol=1e-6)


def _demo_net() -> torch.nn.Module:
    torch.manual_seed(0)  # weights (96, 40) (tiles of 48 x 40) and (10, 96); 96- and 10-entry biases
    return torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.Tanh(), torch.nn.Linear(96, 10))


def _demo_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 40, generator=gen), torch.randn(16, 10, generator=gen)


_DEMO_LR = 0.01


def _demo_worker(rank: int, world: int, steps: int) -> list[dict[str, torch.Tensor]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lgc

    model = DDP(_demo_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=_DEMO_LR)  # DeMo's base: no momentum
    lgc.compress(model, "demo", optimizer=optimizer)  # the method's own first step
    params = []
    for step in range(steps):
        x, y = _demo_batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        params.append({name: p.detach().clone() for name, p in model.module.named_parameters()})
    return params


@pytest.mark.multiprocess
def test_demo_through_the_hook_follows_a_transcription_of_the_reference_from_its_first_step():
    """``lgc.compress(model, "demo")`` on 2 DDP workers against bloc97/DeMo ``demo.py``'s ``DeMo.step``.

    Five steps through the DDP hook, the momenta (lgc's error-feedback residuals) carried from step
    to step, every parameter (the biases too) through DeMo, from the first step as the reference
    does: the parameters agree bit for bit at every step.
    """
    from distributed import run_workers

    steps, workers = 5, 2
    results = run_workers(_demo_worker, workers, steps)
    nets = [_demo_net() for _ in range(workers)]
    reference = _ReferenceDeMo(
        {name: p.detach().clone() for name, p in nets[0].named_parameters()}, workers, lr=_DEMO_LR
    )
    for step in range(steps):
        grads = []
        for rank, net in enumerate(nets):
            with torch.no_grad():
                for name, p in net.named_parameters():
                    p.copy_(reference.params[name])
            x, y = _demo_batch(rank, step)
            net.zero_grad()
            (net(x) - y).square().mean().backward()
            grads.append({name: p.grad.clone() for name, p in net.named_parameters()})
        reference.step(grads)
        for rank in range(workers):
            for name, p in results[rank][step].items():
                assert torch.equal(p, reference.params[name]), f"step {step}, rank {rank}, {name}"


# ------------------------------------------------------------------------------------------------
# aggregation: the mean over the workers that sent a coefficient


def _payload_of(coefficients: dict[int, float], chunk: int, numel: int, k: int) -> DCTPayload:
    """Compress a tensor whose only DCT coefficients (in one tile) are ``coefficients``."""
    dense = torch.zeros(numel, dtype=torch.float64)
    for index, value in coefficients.items():
        dense[index] = value
    x = _from_coefficients(dense, chunk).float()
    payload = DeMoCompressor(chunk=chunk, k=k, tiling="flat").compress(x, "w")
    assert sorted(payload.indices.tolist()) == sorted(coefficients)
    return payload


def test_a_coefficient_is_averaged_over_its_senders_only():
    chunk, numel = 4, 16
    a = _payload_of({0: 5.0, 3: 2.0}, chunk, numel, k=2)
    b = _payload_of({0: 1.0, 7: -4.0}, chunk, numel, k=2)
    expected = torch.zeros(16, dtype=torch.float64)
    expected[0], expected[3], expected[7] = 3.0, 2.0, -4.0  # (5 + 1) / 2; only a sent 3; only b sent 7
    expected = _from_coefficients(expected, chunk).float()
    mean = DeMoCompressor(chunk=chunk, k=2, sign=False, tiling="flat").aggregate([a, b])
    torch.testing.assert_close(mean, expected, rtol=0, atol=1e-5)
    signed = DeMoCompressor(chunk=chunk, k=2, tiling="flat").aggregate([a, b])
    assert torch.equal(signed, expected.sign())
    # aggregate="mean": the zero-filled mean, (5 + 1) / 2, 2 / 2 and -4 / 2 (the hook divided each by P = 2)
    zero_filled = DeMoCompressor(chunk=chunk, k=2, sign=False, tiling="flat", aggregate="mean")
    expected = torch.zeros(16, dtype=torch.float64)
    expected[0], expected[3], expected[7] = 6.0, 2.0, -4.0
    torch.testing.assert_close(
        zero_filled.aggregate([a, b]), _from_coefficients(expected, chunk).float(), atol=1e-5, rtol=0
    )


def test_sign_false_undoes_the_hooks_division_by_the_world_size():
    chunk, numel = 4, 16
    a = _payload_of({0: 5.0, 3: 2.0}, chunk, numel, k=2)
    compressor = DeMoCompressor(chunk=chunk, k=2, sign=False, tiling="flat")
    alone = compressor.aggregate([a])
    torch.testing.assert_close(alone, compressor.decompress(a))
    compressor.set_world_size(4)
    torch.testing.assert_close(compressor.aggregate([a]), 4 * alone)


@pytest.mark.parametrize("sign", [True, False])
def test_aggregate_matches_a_dense_sender_mean(sign):
    chunk, k, numel, workers = 8, 6, 4 * 64 + 30, 3
    compressor = DeMoCompressor(chunk=chunk, k=k, sign=sign, tiling="flat")
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
    layout = tile_layout(numel, chunk, 1, "flat")
    a = DCTPayload(
        numel, values=torch.tensor([3.0]), positions=torch.empty(0), indices=torch.tensor([1]), layout=layout
    )
    b = DCTPayload(
        numel, values=torch.tensor([-1.0]), positions=torch.empty(0), indices=torch.tensor([1]), layout=layout
    )
    out = DeMoCompressor(chunk=chunk, k=1, sign=False, tiling="flat").aggregate([a, b])
    assert torch.equal(out[16:], torch.zeros(16))
    expected = torch.zeros(16, dtype=torch.float64)
    expected[1] = 1.0  # (3 - 1) / 2
    torch.testing.assert_close(out[:16], _from_coefficients(expected, chunk).float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_aggregate_into_a_half_precision_bucket_slice(dtype):
    chunk, k, numel = 8, 6, 2 * 64 + 9
    for sign in (True, False):
        compressor = DeMoCompressor(chunk=chunk, k=k, sign=sign, tiling="flat")
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
        ({"tiling": "rows"}, "tiling must be one of shape, flat, got 'rows'"),
        ({"aggregate": "sum"}, "aggregate must be one of sender_mean, mean, got 'sum'"),
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
    assert repr(DeMoCompressor(tiling="flat", aggregate="mean")) == (
        "DeMoCompressor(chunk=64, k=32, sign=True, tiling='flat', aggregate='mean')"
    )
    assert (compressor.tiling, compressor.aggregation, compressor.default_min_numel) == ("shape", "sender_mean", 1)
    assert (
        repr(ErrorFeedback(compressor, decay=0.999))
        == "ErrorFeedback(DeMoCompressor(chunk=64, k=32, sign=True), decay=0.999)"
    )
    assert compressor.state_dict() == {}
    compressor.compress(_randn(100), "w")  # builds the cached DCT matrix
    assert compressor._dct._bases
    restored = pickle.loads(pickle.dumps(compressor))
    assert restored._dct._bases == {}
    x = _randn(5000, seed=4)
    assert torch.equal(
        restored.decompress(restored.compress(x, "w")), compressor.decompress(compressor.compress(x, "w"))
    )


@pytest.mark.parametrize("sign", [True, False])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_entry_reaches_the_aggregate_and_only_its_tile(sign, bad):
    """Called directly (the hook skips such steps first), an inf or NaN is not hidden: its tile's
    aggregate is not finite, with or without the sign, and the other tiles are as without it."""
    x = _randn(300)
    clean = DeMoCompressor(chunk=8, k=4, sign=sign)
    want = clean.aggregate([clean.payload_from_wire(clean.compress(x, "w").to_wire(), 300, key="w")])
    x[7] = bad
    compressor = DeMoCompressor(chunk=8, k=4, sign=sign)
    payload = compressor.compress(x, "w")
    got = compressor.aggregate([compressor.payload_from_wire(payload.to_wire(), 300, key="w")])
    assert not bool(got.isfinite().all()), "the bad entry came out finite"
    # The rest is as without it: only the bad entry's tile (the layout's, at most 8 x 8 entries) differs.
    tile = compressor.layout("w", 300).groups[0].size
    assert 0 < int((got != want).sum()) <= tile


def test_momentum_in_the_optimizer_is_refused_through_every_wrapper():
    from lgc.ddp.hook import CompressionHookState
    from lgc.methods import METHODS, build_hook_state

    demo = DeMoCompressor()
    # DeMo's momentum is the error feedback's residual: a second one in the optimizer is refused,
    # asked of the compressor, of error feedback around it and of the hook state alike.
    for asked in (demo, ErrorFeedback(demo, 0.999), CompressionHookState(ErrorFeedback(demo, 0.999))):
        with pytest.raises(ValueError, match=r"optimizer momentum is 0.9 but DeMo keeps its momentum"):
            asked.check_optimizer(0.9, None)
        asked.check_optimizer(0.0, 5e-4)  # no weight decay of its own: the optimizer's passes
    state = build_hook_state(METHODS["demo"].resolve(), {"delay": 2}, name="demo")  # communication delay's
    with pytest.raises(ValueError, match="optimizer.momentum=0"):
        state.check_optimizer(0.5, None)
