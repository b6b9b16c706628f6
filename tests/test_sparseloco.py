"""SparseLoCo's parts: chunked top-k, quantized values on any sparsifier, error feedback that decays."""

from __future__ import annotations

import math

import pytest
import torch

import lgc
from lgc.compressors import ChunkedTopKCompressor, ErrorFeedback, QuantizedValues, TopKCompressor
from lgc.compressors.chunked_topk import chunked_topk_count, chunked_topk_nbytes
from lgc.compressors.quantized_values import quantize_values, quantized_values_nbytes

NUMELS = (1, 100, 4096, 4096 * 3, 4096 * 3 + 1000)


# -- chunked top-k ---------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", NUMELS)
def test_chunked_topk_keeps_each_chunks_largest_entries(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    compressor = ChunkedTopKCompressor(chunk=4096, k=64)
    payload = compressor.compress(x, "w")
    kept = torch.zeros(numel, dtype=torch.bool)
    kept[payload.indices] = True
    assert int(kept.sum()) == payload.values.numel() == chunked_topk_count(numel, 4096, 64)
    for start in range(0, numel, 4096):
        piece, mask = x[start : start + 4096].abs(), kept[start : start + 4096]
        expected = min(piece.numel(), 64 if piece.numel() == 4096 else max(1, math.ceil(64 * piece.numel() / 4096)))
        assert int(mask.sum()) == expected
        if not mask.all():  # every kept entry is at least as large as every dropped one
            assert piece[mask].min() >= piece[~mask].max()
    assert torch.equal(payload.values, x[payload.indices])


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
def test_chunked_topk_wire_size_is_the_formula_and_round_trips(numel, value_dtype):
    compressor = ChunkedTopKCompressor(chunk=4096, k=64, value_dtype=value_dtype)
    payload = compressor.compress(torch.randn(numel), "w")
    count = chunked_topk_count(numel, 4096, 64)
    value_size = 4 if value_dtype == "float32" else 2
    assert (
        payload.nbytes
        == chunked_topk_nbytes(numel, 4096, 64, value_dtype)
        == count * value_size + math.ceil(count * 12 / 8)
    )
    parsed = compressor.payload_from_wire(payload.to_wire(), numel)
    assert torch.equal(parsed.indices.long(), payload.indices.long())
    assert torch.equal(compressor.decompress(parsed), compressor.decompress(payload))


def test_chunked_topk_sends_positions_in_log2_chunk_bits():
    assert ChunkedTopKCompressor(chunk=4096, k=64).bits == 12
    assert ChunkedTopKCompressor(chunk=4097, k=64).bits == 13
    assert ChunkedTopKCompressor(chunk=2, k=1).bits == 1
    # density 1.56 %: 44 bits (4 + 1.5 bytes) per kept fp32 entry against 64 for top-k's int32 indices
    assert chunked_topk_nbytes(4096 * 10, 4096, 64) == 640 * 4 + 640 * 12 // 8


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        (dict(chunk=1), "chunk"),
        (dict(chunk=64, k=0), "k must"),
        (dict(chunk=64, k=65), "k must"),
        (dict(chunk=64, k=2.5), "k must"),
        (dict(value_dtype="int8"), "value_dtype"),
    ],
)
def test_chunked_topk_refuses_bad_knobs(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        ChunkedTopKCompressor(**kwargs)


# -- quantized values ------------------------------------------------------------------------------


def test_quantizer_decodes_each_code_to_its_bins_centroid():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    codes, table = quantize_values(values, bits=2, range_sigmas=6.0)
    assert codes.min() >= 0 and codes.max() <= 3
    for code in codes.unique():
        assert torch.allclose(table[code], values[codes == code].mean())
    # constant values (zero spread) decode exactly
    codes, table = quantize_values(torch.full((5,), 0.25), bits=2, range_sigmas=6.0)
    assert torch.equal(table[codes], torch.full((5,), 0.25))


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_sparseloco_payload_size_equals_its_formula(numel, bits):
    """SparseLoCo's payload: ceil(K bits / 8) code bytes + 4 * 2^bits table bytes + ceil(12 K / 8) position bytes."""
    compressor = QuantizedValues(ChunkedTopKCompressor(chunk=4096, k=64), bits=bits)
    payload = compressor.compress(torch.randn(numel), "w")
    count = chunked_topk_count(numel, 4096, 64)
    formula = math.ceil(count * bits / 8) + 4 * 2**bits + math.ceil(count * 12 / 8)
    assert payload.nbytes == quantized_values_nbytes(numel, 4096, 64, bits) == formula
    assert payload.to_wire().numel() == formula


def test_sparseloco_compresses_far_beyond_97x_on_large_tensors():
    numel = 4096 * 256
    ratio = 4 * numel / quantized_values_nbytes(numel, 4096, 64, 2)
    assert 140 < ratio < 147  # 14 bits per kept entry at 1.56 %: 32 / (0.015625 * 14) = 146x, less the table


@pytest.mark.parametrize("sparsifier", [ChunkedTopKCompressor(chunk=256, k=8), TopKCompressor(density=0.02)])
def test_quantized_values_compose_with_any_fixed_count_sparsifier(sparsifier):
    numel = 5000
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    quantized = QuantizedValues(sparsifier, bits=2)
    payload = quantized.compress(x, "w")
    plain = sparsifier.compress(x, "w")
    # same positions, values replaced by their bin centroids
    assert torch.equal(payload.inner.indices.long().sort().values, plain.indices.long().sort().values)
    codes, table = quantize_values(plain.values, 2, 6.0)
    assert torch.equal(payload.inner.values, table[codes])
    parsed = quantized.payload_from_wire(payload.to_wire(), numel)
    assert parsed.nbytes == payload.nbytes
    assert torch.equal(quantized.decompress(parsed), quantized.decompress(payload))
    # the workers' payloads aggregate as the sparsifier's would with the decoded values
    other = quantized.compress(-2 * x, "w")
    total = quantized.aggregate([payload, other])
    assert torch.allclose(total, quantized.decompress(payload) + quantized.decompress(other))
    out = torch.empty(numel, dtype=torch.float16)
    quantized.aggregate_into([payload, other], out)
    assert torch.allclose(out.float(), total, atol=1e-2, rtol=1e-3)


def test_quantized_values_refuse_sparsifiers_without_a_fixed_count_and_bad_bits():
    with pytest.raises(ValueError, match="needs a sparsifier"):
        QuantizedValues(lgc.SignSGDCompressor())
    with pytest.raises(ValueError, match="needs a sparsifier"):
        QuantizedValues(lgc.DGCCompressor(density=0.01))
    for bits in (0, 9, True, 2.0):
        with pytest.raises(ValueError, match="bits"):
            QuantizedValues(ChunkedTopKCompressor(), bits=bits)
    with pytest.raises(ValueError, match="range_sigmas"):
        QuantizedValues(ChunkedTopKCompressor(), range_sigmas=0)
    with pytest.raises(ValueError, match="_target_"):
        QuantizedValues({"_target_": "torch.nn.Linear"})


def test_quantized_values_build_the_sparsifier_from_a_mapping():
    built = QuantizedValues({"_target_": "lgc.compressors.ChunkedTopKCompressor", "chunk": 128, "k": 4}, bits=3)
    assert isinstance(built.sparsifier, ChunkedTopKCompressor) and (built.sparsifier.chunk, built.sparsifier.k) == (
        128,
        4,
    )
    assert repr(built) == "QuantizedValues(ChunkedTopKCompressor(chunk=128, k=4), bits=3)"


# -- error feedback with decay ---------------------------------------------------------------------


@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_error_feedback_with_decay_keeps_its_invariant(decay):
    """``v = decay * r + g`` is sent in part and kept in part: ``v == decode(payload) + r`` exactly."""
    ef = ErrorFeedback(QuantizedValues(ChunkedTopKCompressor(chunk=512, k=8), bits=2), decay=decay)
    generator = torch.Generator().manual_seed(2)
    residual = torch.zeros(3000)
    for _ in range(4):
        g = torch.randn(3000, generator=generator)
        v = decay * residual + g
        payload = ef.compress(g, "w")
        residual = ef.residuals["w"].clone()
        torch.testing.assert_close(ef.decompress(payload) + residual, v, rtol=0, atol=1e-6)


def test_error_feedback_refuses_a_decay_outside_0_1():
    for decay in (0.0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match="decay"):
            ErrorFeedback(TopKCompressor(0.1), decay=decay)


def test_sparseloco_by_name_has_its_papers_settings(group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(64, 64))
    state = lgc.compress(model, "sparseloco", sparsifier={"k": 32})
    ef = state.compressor
    assert isinstance(ef, ErrorFeedback) and ef.decay == 0.95
    assert isinstance(ef.compressor, QuantizedValues) and ef.compressor.bits == 2
    assert (ef.compressor.sparsifier.chunk, ef.compressor.sparsifier.k) == (4096, 32)
    state = lgc.compress(DDP(torch.nn.Linear(64, 64)), "sparseloco", error_decay=0.5)
    assert state.compressor.decay == 0.5
    with pytest.raises(ValueError, match="error_decay"):
        lgc.compress(DDP(torch.nn.Linear(64, 64)), "fp16", error_decay=0.5)
