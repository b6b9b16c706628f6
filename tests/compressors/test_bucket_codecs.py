"""Codecs over whole buckets: a bucket's tensors encoded and decoded in a fixed number of passes, bit for bit the
per-tensor path's payloads, state and sums (EF-signSGD's scaled sign, Streaming DiLoCo's fp4, QSGD and TernGrad)."""

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgc.compressors import (
    DeMoCompressor,
    DGCCompressor,
    ErrorFeedback,
    FP4Compressor,
    QSGDCompressor,
    RedSyncCompressor,
    SBCCompressor,
    SignSGDCompressor,
    TernGradCompressor,
    TopKCompressor,
)
from lgc.compressors.sbc import sbc_select, sbc_select_segments
from lgc.compressors.segment_sampled import sampled_topk_segments
from lgc.compressors.selection import dgc_sample_layout, sampled_topk
from lgc.compressors.signsgd import SignPayload, decode_signs_many


def _same_sign_payload(have: SignPayload, want: SignPayload) -> None:
    assert have.numel == want.numel and have.nbytes == want.nbytes
    assert torch.equal(have.to_wire(), want.to_wire())


@settings(max_examples=40, deadline=None)
@given(
    numels=st.lists(st.integers(1, 700), min_size=2, max_size=6),
    decay=st.sampled_from([1.0, 0.95]),
    seed=st.integers(0, 2**16),
)
def test_ef_signsgd_over_a_bucket_is_the_per_tensor_loop(numels, decay, seed):
    """Several steps of error feedback over the scaled sign: the same payload bytes and residuals, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f"p{i}" for i in range(len(numels))]
    loop = ErrorFeedback(SignSGDCompressor(), decay=decay, bucketed=False)
    batched = ErrorFeedback(SignSGDCompressor(), decay=decay, bucketed=True)
    for step in range(3):
        bucket = torch.randn(sum(numels), generator=gen) * torch.rand(sum(numels), generator=gen)
        if step == 1:
            bucket[::7] = 0.0  # sign(0) = +1 in both
        grads = list(bucket.split(numels))
        expected, got = loop.compress_many(grads, keys), batched.compress_many(grads, keys)
        for key, want, have in zip(keys, expected, got, strict=True):
            _same_sign_payload(have, want)
            assert torch.equal(batched.residuals[key], loop.residuals[key]), (step, key)
    assert tuple(keys) in batched._buckets.flats, "the bucket went as one flat"


def test_the_scaled_signs_segments_are_its_payloads_and_their_decoding():
    sign = SignSGDCompressor()
    numels = [13, 8, 1, 64, 301]
    flat = torch.randn(sum(numels), generator=torch.Generator().manual_seed(4))
    payloads, sent = sign.compress_segments(flat, numels)
    for segment, payload in zip(flat.split(numels), payloads, strict=True):
        _same_sign_payload(payload, sign.compress(segment, "w"))
    assert torch.equal(sent, torch.cat([sign.decompress(p) for p in payloads]))


def test_the_plain_scaled_sign_encodes_a_bucket_at_once_where_it_batches(monkeypatch):
    """Without error feedback (a GPU's path, forced here): compress_many's payloads are compress's."""
    sign = SignSGDCompressor()
    monkeypatch.setattr(sign, "batches_on", lambda device: True)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 17, 64, 1)]
    for have, tensor in zip(sign.compress_many(grads, ["a", "b", "c", "d"]), grads, strict=True):
        _same_sign_payload(have, sign.compress(tensor, "w"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_buckets_sign_payloads_sum_as_tensor_by_tensor(dtype):
    """Three ranks' payloads of five tensors decoded at once into (fp32 or fp16) bucket slices: the loop's bits."""
    sign = SignSGDCompressor()
    numels = [9, 16, 1, 100, 33]
    gen = torch.Generator().manual_seed(5)
    received = [[sign.compress(torch.randn(n, generator=gen), "w") for _ in range(3)] for n in numels]
    loop = [torch.empty(n, dtype=dtype) for n in numels]
    for payloads, out in zip(received, loop, strict=True):
        sign.aggregate_into(payloads, out)
    bucket = torch.empty(sum(numels), dtype=dtype)
    outs = list(bucket.split(numels))
    decode_signs_many(received, outs)
    for want, have in zip(loop, outs, strict=True):
        assert torch.equal(have, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_scaled_signs_bucket_is_the_per_tensor_loop():
    """The default batches on a GPU: the multi-tensor norm and the bucket decode give the loop's bits there too."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    numels = [64 * 64 * 9, 17, 256 * 128, 5000, 3]
    keys = [f"p{i}" for i in range(len(numels))]
    loop = ErrorFeedback(SignSGDCompressor(), bucketed=False)
    batched = ErrorFeedback(SignSGDCompressor())
    sign = SignSGDCompressor()
    for _ in range(3):
        grads = list(torch.randn(sum(numels), device="cuda", generator=gen).split(numels))
        expected, got = loop.compress_many(grads, keys), batched.compress_many(grads, keys)
        for key, want, have in zip(keys, expected, got, strict=True):
            _same_sign_payload(have, want)
            assert torch.equal(batched.residuals[key], loop.residuals[key])
        for want, have in zip(sign.compress_many(grads, keys), [sign.compress(g, "w") for g in grads], strict=True):
            _same_sign_payload(have, want)  # the plain scaled sign batches on a GPU too
        received = [[p, p] for p in got]
        outs = [torch.empty(n, device="cuda") for n in numels]
        sign.aggregate_many(received, outs)
        for payloads, out in zip(received, outs, strict=True):
            want = torch.empty_like(out)
            sign.aggregate_into(payloads, want)
            assert torch.equal(out, want)
    assert tuple(keys) in batched._buckets.flats


def _fp4_tensors(numels: list[int], seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """Heavy-tailed values, a zero bucket, an inf and a NaN where the sizes allow."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = [torch.randn(n, device=device, generator=gen) ** 3 for n in numels]
    if numels[0] >= 300:
        tensors[0][:256] = 0.0  # an all-zero bucket: 0/0 codes zero
    if len(numels) > 2 and numels[2] >= 2:
        tensors[2][1] = float("inf")  # its bucket's scale is inf, every code there zero
    if len(numels) > 3 and numels[3] >= 1:
        tensors[3][-1] = float("nan")
    return tensors


@settings(max_examples=30, deadline=None)
@given(
    numels=st.lists(st.integers(0, 1100), min_size=2, max_size=6),
    bucket_size=st.sampled_from([256, 32, 2, 1024]),
    seed=st.integers(0, 2**16),
)
def test_fp4_over_a_bucket_is_the_per_tensor_loop(numels, bucket_size, seed):
    """Every tensor's payload (scales and codes, byte for byte) and every rank's sum, fp32 and fp16 buckets."""
    fp4 = FP4Compressor(bucket_size=bucket_size)
    ranks = [_fp4_tensors(numels, seed + rank) for rank in range(3)]
    sent = [fp4.compress_segments(tensors) for tensors in ranks]
    for tensors, payloads in zip(ranks, sent, strict=True):
        for tensor, payload in zip(tensors, payloads, strict=True):
            want = fp4.compress(tensor, "w")
            assert payload.numel == want.numel and torch.equal(payload.to_wire(), want.to_wire())
    _assert_bucket_sums_are_the_loops(fp4, fp4, [[payloads[i] for payloads in sent] for i in range(len(numels))])


def _assert_bucket_sums_are_the_loops(loop, batched, received, device: str = "cpu") -> None:
    """``batched`` writes every rank's sum into a bucket's fp32 and fp16 slices as ``loop.aggregate_into``
    does tensor by tensor, NaN where it has NaN: through ``decode_segments`` on the CPU, through the
    hook's ``aggregate_many`` (which takes that path there by default) on a GPU."""
    numels = [payloads[0].numel for payloads in received]
    decode = batched.decode_segments if device == "cpu" else batched.aggregate_many
    for dtype in (torch.float32, torch.float16):
        want_sums = [torch.empty(n, dtype=dtype, device=device) for n in numels]
        for payloads, out in zip(received, want_sums, strict=True):
            loop.aggregate_into(payloads, out)
        outs = list(torch.empty(sum(numels), dtype=dtype, device=device).split(numels))
        decode(received, outs)
        for want, have in zip(want_sums, outs, strict=True):
            assert torch.equal(have.isnan(), want.isnan()) and torch.equal(have.isinf(), want.isinf())
            assert torch.equal(have.nan_to_num(), want.nan_to_num())


def test_fp4_batches_only_with_an_even_bucket_size_and_on_a_gpu():
    assert FP4Compressor(256).batches_on(torch.device("cuda")) and not FP4Compressor(256).batches_on(
        torch.device("cpu")
    )
    assert not FP4Compressor(255).batches_on(torch.device("cuda")) and not FP4Compressor(None).batches_on(
        torch.device("cuda")
    )
    with pytest.raises(ValueError, match="needs an even bucket_size, got 255"):
        FP4Compressor(255).compress_segments([torch.ones(3), torch.ones(4)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_fp4_over_a_bucket_is_the_per_tensor_loop():
    numels = [64 * 64 * 9, 17, 256 * 128, 5001, 3]
    fp4 = FP4Compressor()
    ranks = [_fp4_tensors(numels, rank, "cuda") for rank in range(2)]
    sent = [fp4.compress_many(tensors, [f"p{i}" for i in range(len(numels))]) for tensors in ranks]
    for tensors, payloads in zip(ranks, sent, strict=True):
        for tensor, payload in zip(tensors, payloads, strict=True):
            assert torch.equal(payload.to_wire(), fp4.compress(tensor, "w").to_wire())
    _assert_bucket_sums_are_the_loops(fp4, fp4, [[p[i] for p in sent] for i in range(len(numels))], "cuda")


# -- QSGD and TernGrad ----------------------------------------------------------------------------
def _quantizers() -> list:
    return [
        QSGDCompressor(levels=4, bucket_size=512, seed=3),
        QSGDCompressor(levels=1, bucket_size=32, seed=4),
        QSGDCompressor(levels=127, bucket_size=None, seed=5),
        TernGradCompressor(seed=6),
        TernGradCompressor(bucket_size=64, clip_sigma=None, seed=7),
    ]


@settings(max_examples=25, deadline=None)
@given(
    numels=st.lists(st.integers(1, 1300), min_size=2, max_size=6),
    which=st.integers(0, 4),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_the_stochastic_quantizers_over_a_bucket_are_the_per_tensor_loop(numels, which, steps, seed):
    """QSGD and TernGrad: every payload byte for byte over several steps (each key's draws advance as the
    loop's do), and every rank's sum into fp32 and fp16 slices, with zero, inf and NaN entries."""
    loop, batched = _quantizers()[which], _quantizers()[which]
    keys = [f"p{i}" for i in range(len(numels))]
    for step in range(steps):
        ranks = [_fp4_tensors(numels, seed + 10 * step + rank) for rank in range(3)]
        sent = []
        for tensors in ranks:  # one compressor for the 3 ranks: each call advances every key's draws
            counts = [loop.draws.get(key, 0) for key in keys]
            payloads = batched.compress_segments(tensors, keys, counts)
            want = [loop.compress(tensor, key) for tensor, key in zip(tensors, keys, strict=True)]
            for have, expected in zip(payloads, want, strict=True):
                assert have.numel == expected.numel and torch.equal(have.to_wire(), expected.to_wire())
            sent.append(payloads)
        _assert_bucket_sums_are_the_loops(
            loop, batched, [[payloads[i] for payloads in sent] for i in range(len(numels))]
        )


def test_a_quantizers_compress_many_advances_every_keys_draws_as_the_loop():
    loop, batched = QSGDCompressor(seed=1), QSGDCompressor(seed=1)
    batched.bucketed = True  # as on a GPU
    keys = ["a", "b", "c"]
    for step in range(3):
        tensors = _fp4_tensors([700, 5, 1200], step)
        have = batched.compress_many(tensors, keys)
        want = [loop.compress(t, k) for t, k in zip(tensors, keys, strict=True)]
        assert all(torch.equal(h.to_wire(), w.to_wire()) for h, w in zip(have, want, strict=True))
        assert batched.draws == loop.draws == dict.fromkeys(keys, step + 1)


def test_the_stochastic_quantizers_batch_on_a_gpu_with_whole_codes_per_byte():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert QSGDCompressor(levels=4).batches_on(cuda) and TernGradCompressor().batches_on(cuda)
    assert not QSGDCompressor(levels=4).batches_on(cpu)
    assert not QSGDCompressor(levels=3).batches_on(cuda)  # 3-bit codes straddle bytes: tensor by tensor
    everywhere, nowhere = QSGDCompressor(), TernGradCompressor()
    everywhere.bucketed, nowhere.bucketed = True, False
    assert everywhere.batches_on(cpu) and not nowhere.batches_on(cuda)
    with pytest.raises(ValueError, match="codes of 1, 2, 4 or 8 bits, got 3"):
        QSGDCompressor(levels=3).compress_segments([torch.ones(3), torch.ones(4)], ["a", "b"], [0, 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_stochastic_quantizers_over_a_bucket_are_the_per_tensor_loop():
    numels = [64 * 64 * 9, 17, 256 * 128, 5001, 3]
    keys = [f"p{i}" for i in range(len(numels))]
    for loop, batched in zip(_quantizers(), _quantizers(), strict=True):
        ranks = [_fp4_tensors(numels, rank, "cuda") for rank in range(2)]
        sent = []
        for rank, tensors in enumerate(ranks):
            batched.draws = dict(loop.draws)
            payloads = batched.compress_many(tensors, keys)
            for tensor, key, payload in zip(tensors, keys, payloads, strict=True):
                assert torch.equal(payload.to_wire(), loop.compress(tensor, key).to_wire()), (loop, rank, key)
            sent.append(payloads)
        _assert_bucket_sums_are_the_loops(loop, batched, [[p[i] for p in sent] for i in range(len(numels))], "cuda")


# -- chunked top-k (SparseLoCo's selection) under error feedback ------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(
        st.sampled_from([(128, 64), (64, 64), (96, 40), (300,), (64,), (7,), (32, 3, 3, 3), (130, 70), (4097,)]),
        min_size=2,
        max_size=6,
        unique=True,
    ),
    tiling=st.sampled_from(["shape", "flat"]),
    k=st.sampled_from([1, 5, 64]),
    value_dtype=st.sampled_from(["float32", "bfloat16"]),
    bits=st.sampled_from([None, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_over_chunked_topk_encodes_a_bucket_as_the_per_tensor_loop(
    shapes, tiling, k, value_dtype, bits, seed
):
    """Every payload's wire bytes and every residual, bit for bit, over 3 steps with SparseLoCo's decay;
    the tiles of one size across tensors go through one top-k; with ``bits``, SparseLoCo's quantized
    values (a table per tensor) over it."""
    from lgc.compressors import ChunkedTopKCompressor, QuantizedValues

    keys = [f"p{i}" for i in range(len(shapes))]
    parameters = {key: torch.empty(shape) for key, shape in zip(keys, shapes, strict=True)}

    def build(bucketed: bool) -> ErrorFeedback:
        inner = ChunkedTopKCompressor(chunk=16, k=k, tiling=tiling, value_dtype=value_dtype)
        inner.attach_parameters(parameters)
        outer = inner if bits is None else QuantizedValues(inner, bits=bits)
        return ErrorFeedback(outer, decay=0.95, bucketed=bucketed)

    loop, batched = build(False), build(True)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        tensors = [torch.randn(p.numel(), generator=gen) ** 3 for p in parameters.values()]
        have = batched.compress_many([t.clone() for t in tensors], keys)
        want = loop.compress_many([t.clone() for t in tensors], keys)
        for key, h, w in zip(keys, have, want, strict=True):
            assert torch.equal(h.to_wire(), w.to_wire()), key
            assert torch.equal(loop.decompress(h), loop.decompress(w)), key
            assert torch.equal(batched.residuals[key], loop.residuals[key]), key


def test_quantized_values_over_top_k_and_over_a_sparsifier_of_ones_own_feed_back_a_bucket_as_the_loop():
    """Top-k (whose bucket selection lists pairs in another order, so a table's sums could round
    differently) and a sparsifier without ``select_segments`` take error feedback's loop inside the
    bucket path under SparseLoCo's quantizer: the same bits."""
    from lgc.compressors import QuantizedValues, TopKCompressor

    class OwnTopK(TopKCompressor):
        select_segments = None  # selects tensor by tensor only

    keys = ["a", "b", "c"]
    for sparsifier in (TopKCompressor, OwnTopK):
        loop = ErrorFeedback(QuantizedValues(sparsifier(density=0.05), bits=2), decay=0.95, bucketed=False)
        batched = ErrorFeedback(QuantizedValues(sparsifier(density=0.05), bits=2), decay=0.95, bucketed=True)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            tensors = [torch.randn(n, generator=gen) for n in (700, 33, 2000)]
            have = batched.compress_many([t.clone() for t in tensors], keys)
            want = loop.compress_many([t.clone() for t in tensors], keys)
            for key, h, w in zip(keys, have, want, strict=True):
                assert torch.equal(h.to_wire(), w.to_wire()), (sparsifier, key)
                assert torch.equal(batched.residuals[key], loop.residuals[key]), (sparsifier, key)


def test_a_subclass_that_overrides_compress_alone_is_encoded_tensor_by_tensor():
    """Its parent's bucket path would encode by the parent's rule: error feedback does not take it."""
    from lgc.compressors import TopKCompressor
    from lgc.compressors.segments import feeds_back_segments

    class Shifted(TopKCompressor):
        def compress(self, tensor, key):
            return super().compress(tensor + 1, key)

    class ShiftedEverywhere(Shifted):
        def feed_back_segments(self, flat, numels, keys):
            return super().feed_back_segments(flat.add_(1), numels, keys)

    assert feeds_back_segments(TopKCompressor(0.1)) and feeds_back_segments(SignSGDCompressor())
    assert not feeds_back_segments(Shifted(0.1)) and feeds_back_segments(ShiftedEverywhere(0.1))
    assert not ErrorFeedback(Shifted(0.1)).batches_on(torch.device("cuda"))
    with pytest.raises(ValueError, match="bucketed=True needs a compressor with a bucket-level path"):
        ErrorFeedback(Shifted(0.1), bucketed=True)


@pytest.mark.parametrize("which", range(6))
def test_error_feedback_over_a_stochastic_quantizer_feeds_a_bucket_back_as_the_loop(which):
    """TernGrad with error feedback (its overlap config) and QSGD under it: payloads, residuals and draws
    as the per-tensor loop's over 3 steps; 3-bit codes (QSGD's levels=3) take error feedback's own loop."""

    def quantizer():
        return [*_quantizers(), QSGDCompressor(levels=3, bucket_size=64, seed=8)][which]

    loop, batched = ErrorFeedback(quantizer(), bucketed=False), ErrorFeedback(quantizer(), bucketed=True)
    keys = ["a", "b", "c", "d"]
    for step in range(3):
        tensors = _fp4_tensors([700, 5, 1200, 64], 100 + step)
        tensors = [t.nan_to_num(0.0, 0.0, 0.0) for t in tensors]  # error feedback sees finite steps (the guard)
        have = batched.compress_many([t.clone() for t in tensors], keys)
        want = loop.compress_many([t.clone() for t in tensors], keys)
        for key, h, w in zip(keys, have, want, strict=True):
            assert torch.equal(h.to_wire(), w.to_wire()), key
            assert torch.equal(batched.residuals[key], loop.residuals[key]), key
        assert batched.compressor.draws == loop.compressor.draws


# -- DGC: the sampled threshold, momentum correction and masking over a whole bucket ----------------


class _Start:
    """A fixed draw for the sample's start (what DGC's per-key draw is to sampled_topk)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def randrange(self, stop: int) -> int:
        return self.value % stop


def _sorted_pairs(payload):
    order = payload.indices.long().argsort()
    return payload.indices[order], payload.values[order]


def _same_sparse_payload(have, want) -> None:
    assert have.numel == want.numel and have.nbytes == want.nbytes
    assert have.indices.dtype == want.indices.dtype
    for a, b in zip(_sorted_pairs(have), _sorted_pairs(want), strict=True):
        assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(
    numels=st.lists(st.sampled_from([1, 3, 17, 250, 3000, 20_000, 70_000]), min_size=1, max_size=6),
    density=st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0]),
    zeros=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dgcs_sampled_threshold_over_segments_is_the_per_tensor_rule(numels, density, zeros, seed):
    """Every segment gets sampled_topk's entries (sample, threshold, rounds of x0.8, the cut at 1.3 k)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(numels), generator=gen) * torch.rand(sum(numels), generator=gen) ** 3
    if zeros:
        x[::3] = 0.0  # a mass of equal magnitudes: thresholds at zero, cuts among survivors
    ks = [math.ceil(n * density) for n in numels]
    starts = torch.randint(0, 2**31, (len(numels),), generator=gen).tolist()
    positions, counts = sampled_topk_segments(x, numels, ks, density=density, rngs=[_Start(s) for s in starts])
    offset = 0
    for numel, k, start, got in zip(numels, ks, starts, positions.split(counts), strict=True):
        want, info = sampled_topk(x[offset : offset + numel], k, density=density, rng=_Start(start))
        if info.path == "threshold+topk":  # the same magnitudes (ties at the cut may pick other entries)
            segment = x[offset : offset + numel].abs()
            assert torch.equal(segment[got - offset].sort().values, segment[want].sort().values)
        else:
            assert torch.equal(got - offset, want), info
        offset += numel


def test_dgcs_segments_cover_every_path_of_the_rule():
    """The rounds of x0.8, the cut at 1.3 k and the whole-sample (stride 1) case all occur, and agree."""
    gen = torch.Generator().manual_seed(3)
    numels = [100_000, 100_000, 1_500, 40]
    x = torch.randn(sum(numels), generator=gen) * 0.01
    # The sampled entries large, falling by 0.8 over every 100: the sample's threshold lets through a
    # handful only, one round of x0.8 about 100 (rounds, no cut).
    _, stride, _ = dgc_sample_layout(100_000, 0.001)
    sampled = x[7 % stride : 100_000 : stride]
    sampled.copy_(2.0 * 0.8 ** (torch.arange(sampled.numel()) / 100.0))
    x[100_000:200_000:2] = 1.0  # half the entries tied: everything survives, cut to k
    ks = [100, 100, 2, 1]
    positions, counts = sampled_topk_segments(x, numels, ks, density=0.001, rngs=[_Start(7)] * 4)
    paths, offset = [], 0
    for numel, k, got in zip(numels, ks, positions.split(counts), strict=True):
        want, info = sampled_topk(x[offset : offset + numel], k, density=0.001, rng=_Start(7))
        paths.append((info.path, info.rounds > 0))
        assert torch.equal(got.sort().values - offset, want.sort().values)
        offset += numel
    assert ("threshold", True) in paths and ("threshold+topk", False) in paths, paths


def _dgc_pair(**knobs):
    loop, batched = DGCCompressor(**knobs), DGCCompressor(**knobs)
    loop.bucketed, batched.bucketed = False, True
    return loop, batched


def _same_dgc_state(have, want, keys) -> None:
    for store in ("velocities", "momenta"):
        for key in keys:
            a, b = getattr(have, store).get(key), getattr(want, store).get(key)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (store, key)
    assert have.draws == want.draws


@settings(max_examples=12, deadline=None)
@given(
    numels=st.lists(st.sampled_from([2, 40, 900, 12_000, 60_000]), min_size=2, max_size=5),
    knobs=st.sampled_from(
        [
            {},
            {"nesterov": True},
            {"momentum": 0.0},
            {"momentum_masking": False},
            {"density": 0.05},
            {"warmup_densities": [0.25, 0.01], "steps_per_epoch": 2},
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_dgc_over_a_bucket_is_the_per_tensor_loop(numels, knobs, seed):
    """Several steps of DGC (warm-up, momentum correction, masking): the loop's payloads and state, bit for bit;
    a checkpoint taken from the bucket path and loaded midway resumes both alike."""
    knobs = {"density": 0.001, "warmup_densities": [], **knobs}
    loop, batched = _dgc_pair(**knobs)
    keys = [f"p{i}" for i in range(len(numels))]
    gen = torch.Generator().manual_seed(seed)
    for step in range(5):
        if step == 3:
            state = batched.state_dict()
            loop.load_state_dict(state)
            batched.load_state_dict(state)
        for dgc in (loop, batched):
            dgc.begin_step(step)
        bucket = torch.randn(sum(numels), generator=gen) * torch.rand(sum(numels), generator=gen) ** 2
        grads = list(bucket.split(numels))
        expected, got = loop.compress_many(grads, keys), batched.compress_many(grads, keys)
        for want, have in zip(expected, got, strict=True):
            _same_sparse_payload(have, want)
        _same_dgc_state(batched, loop, keys)
    assert tuple(keys) in batched._buckets.flats and not loop._buckets.flats, "the bucket went as one flat"


def test_a_selection_a_nan_threshold_leaves_empty_sends_an_exact_top_k():
    """DGC's one departure from its authors' selection: nothing survives a NaN threshold (every comparison
    is false, and lowering it by 0.8 keeps it NaN), so an exact top-k goes instead of an empty payload."""
    from lgc.compressors.selection import exact_topk

    x = torch.randn(20_000, generator=torch.Generator().manual_seed(3))
    positions, info = sampled_topk(x, 20, density=0.001, threshold=float("nan"))
    assert info.path == "exact" and positions.numel() == 20
    assert torch.equal(positions.sort().values, exact_topk(x, 20).sort().values)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_dgc_with_a_non_finite_entry_sends_at_most_k_and_its_bucket_path_is_the_loop(bad):
    """Called directly (the hook skips such steps before compressing), an inf or a NaN in a gradient: every
    tensor still sends between 1 and k entries, and the bucket path (the sampled threshold's non-finite
    branch) sends what the per-tensor loop sends, NaN for NaN, with the same state after."""
    numels = [900, 12_000, 60_000]
    keys = ["a", "b", "c"]
    loop, batched = _dgc_pair(density=0.001, warmup_densities=[])
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        bucket = torch.randn(sum(numels), generator=gen)
        if step == 1:
            bucket[900 + 4321] = bad  # one entry of the second tensor
        grads = list(bucket.split(numels))
        for dgc in (loop, batched):
            dgc.begin_step(step)
        expected, got = loop.compress_many(grads, keys), batched.compress_many(grads, keys)
        for numel, want, have in zip(numels, expected, got, strict=True):
            assert 1 <= have.indices.numel() <= math.ceil(0.001 * numel)
            (wi, wv), (hi, hv) = _sorted_pairs(want), _sorted_pairs(have)
            assert torch.equal(hi, wi)
            torch.testing.assert_close(hv, wv, rtol=0, atol=0, equal_nan=True)
        for store in ("velocities", "momenta"):
            for key in keys:
                torch.testing.assert_close(
                    getattr(batched, store)[key], getattr(loop, store)[key], rtol=0, atol=0, equal_nan=True
                )


def _run_held_schedule(loop, batched, numels: list[int], seed: int, check) -> None:
    """Steps held until the ranks agree, committed whole, in part (keys "a" and "b") or dropped, between plain
    bucket steps and another bucketing of two keys (DDP rebuilt its buckets): ``loop`` tensor by tensor,
    ``batched`` a bucket at once; ``check(step, expected, payloads)`` after each. The last key first
    appears in a held step that leaves it unused."""
    keys = ["a", "b", "c", "d"][: len(numels)]
    modes = ["held", "held", "held_some", "bucket", "dropped", "held", "other", "held", "bucket", "held"]
    gen = torch.Generator().manual_seed(seed)
    for step, mode in enumerate(modes):
        grads = list(torch.randn(sum(numels), generator=gen).split(numels))
        step_keys = keys if step else keys[:-1]
        grads = grads[: len(step_keys)]
        for compressor in (loop, batched):
            compressor.begin_step(step)
            if mode == "bucket":
                payloads = compressor.compress_many(grads, step_keys)
            elif mode == "other":
                payloads = compressor.compress_many(grads[:2], step_keys[:2])
            else:
                if compressor is loop:
                    payloads = [compressor.compress_pending(g, k) for g, k in zip(grads, step_keys, strict=True)]
                else:
                    payloads = compressor.compress_pending_many(grads, step_keys)
                if mode == "dropped":
                    compressor.drop()
                else:
                    compressor.commit({"a", "b"} if mode == "held_some" or step == 1 else set(step_keys))
            if compressor is loop:
                expected = payloads
        for want, have in zip(expected, payloads, strict=True):
            _same_sparse_payload(have, want)
        check(step)
    assert list(batched._buckets.flats) == [tuple(keys)], "the last held step's flats are the bucket's state"


def _same_residuals(batched, loop):
    """A check of :func:`_run_held_schedule`: the two error feedbacks' residuals, key for key, bit for bit."""

    def check(step):
        assert batched.residuals.keys() == loop.residuals.keys(), step
        for key in loop.residuals:
            assert torch.equal(batched.residuals[key], loop.residuals[key]), (step, key)

    return check


def test_dgcs_held_bucket_steps_are_the_per_tensor_held_steps():
    """Steps held until the ranks agree (the hook's one message per step), committed whole, in part or dropped,
    between plain bucket steps and another bucketing of the keys: compress_pending_many over a bucket leaves
    what compress_pending tensor by tensor does, bit for bit; a key met first in a held step and left
    unused stays without state."""
    loop, batched = _dgc_pair(density=0.01, warmup_densities=[0.3], steps_per_epoch=3)

    def check(step):
        _same_dgc_state(batched, loop, ["a", "b", "c", "d"])
        assert (batched.epoch, batched.current_density) == (loop.epoch, loop.current_density), step

    _run_held_schedule(loop, batched, [500, 3000, 64, 2000], 11, check)


def test_dgc_takes_a_bucket_at_once_on_a_gpu_by_default_and_refuses_where_it_has_no_bucket_rule():
    assert DGCCompressor().batches_on(torch.device("cuda")) and not DGCCompressor().batches_on(torch.device("cpu"))
    for knobs in ({"clip_norm": 1.0}, {"exact_below_numel": 100}):
        dgc = DGCCompressor(**knobs)
        dgc.bucketed = True
        assert not dgc.batches_on(torch.device("cpu")), knobs  # the per-tensor loop: clipping, exact small tensors


# -- SBC: both sides of every tensor, the kept side's mean and its residual over a whole bucket -------


@settings(max_examples=30, deadline=None)
@given(
    numels=st.lists(st.sampled_from([1, 7, 300, 5000, 40_000]), min_size=1, max_size=5),
    density=st.sampled_from([0.001, 0.01, 0.1, 1.0]),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sbcs_sides_over_segments_are_the_per_tensor_selection(numels, density, ties, seed):
    """The kept side and its mean of every segment are sbc_select's; with ties at a side's k-th value the
    kept entries may differ, their values not."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(numels), generator=gen)
    if ties:
        flat = flat.round()  # a handful of distinct values, each many times
    ks = [math.ceil(n * density) for n in numels]
    positions, means = sbc_select_segments(flat, numels, ks)
    offset = 0
    for i, (numel, k, got) in enumerate(zip(numels, ks, positions.split(ks), strict=True)):
        piece = flat[offset : offset + numel]
        want = sbc_select(piece, k)
        assert torch.equal(means[i : i + 1], want.mean)
        if ties:
            assert torch.equal(piece[got - offset].sort().values, piece[want.positions].sort().values)
        else:
            assert torch.equal(got - offset, want.positions)
        offset += numel


def _same_sparse_wire(have, want) -> None:
    assert have.numel == want.numel and have.nbytes == want.nbytes
    assert torch.equal(have.to_wire(), want.to_wire())


def _ef_bucket_steps(make, numels, decay, steps, seed, same):
    """``steps`` steps of error feedback over ``make()``, tensor by tensor and a bucket at once: each step's
    payloads compared by ``same`` and the residuals bit for bit; returns both (the loop's first)."""
    keys = [f"p{i}" for i in range(len(numels))]
    loop = ErrorFeedback(make(), decay=decay, bucketed=False)
    batched = ErrorFeedback(make(), decay=decay, bucketed=True)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        bucket = torch.randn(sum(numels), generator=gen) * torch.rand(sum(numels), generator=gen)
        grads = list(bucket.split(numels))
        for want, have in zip(loop.compress_many(grads, keys), batched.compress_many(grads, keys), strict=True):
            same(have, want)
        for key in keys:
            assert torch.equal(batched.residuals[key], loop.residuals[key]), (step, key)
    assert tuple(keys) in batched._buckets.flats, "the bucket went as one flat"
    return loop, batched


@settings(max_examples=15, deadline=None)
@given(
    numels=st.lists(st.sampled_from([1, 7, 300, 5000, 40_000]), min_size=2, max_size=5),
    density=st.sampled_from([0.001, 0.01, 0.1]),
    decay=st.sampled_from([1.0, 0.95]),
    seed=st.integers(0, 2**16),
)
def test_sbc_with_error_feedback_over_a_bucket_is_the_per_tensor_loop(numels, density, decay, seed):
    """Several steps: the same payload bytes (mean, Golomb-coded positions) and residuals, bit for bit."""
    _ef_bucket_steps(lambda: SBCCompressor(density), numels, decay, 3, seed, _same_sparse_wire)


@pytest.mark.parametrize("inner", ["sbc", "topk"])
@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_error_feedbacks_held_bucket_steps_are_the_per_tensor_held_steps(inner, decay):
    """Steps held until the ranks agree (SBC's one message per step: its sizes vary, so it encodes ahead),
    committed whole, in part or dropped, between plain bucket steps and another bucketing: the same
    payloads and residuals as compress_pending tensor by tensor; a key first met in a held step that
    leaves it unused stays without a residual."""

    def make():
        return SBCCompressor(0.01) if inner == "sbc" else TopKCompressor(0.01)

    loop = ErrorFeedback(make(), decay=decay, bucketed=False)
    batched = ErrorFeedback(make(), decay=decay, bucketed=True)

    check = _same_residuals(batched, loop)
    _run_held_schedule(loop, batched, [300, 5000, 40_000, 64], 1, check)


def test_sbcs_payloads_of_a_bucket_parse_at_once_as_one_by_one():
    """payloads_from_wire_many: the means, positions and codes payload_from_wire gives each wire, and its checks."""
    sbc = SBCCompressor(0.01)
    numels = [5000, 40_000, 7, 300]
    gen = torch.Generator().manual_seed(2)
    wires = [sbc.compress(torch.randn(n, generator=gen), "w").to_wire() for n in numels]
    for have, wire, numel in zip(sbc.payloads_from_wire_many(wires, numels, ["a"] * 4), wires, numels, strict=True):
        want = sbc.payload_from_wire(wire, numel)
        assert torch.equal(have.mean, want.mean) and torch.equal(have.indices, want.indices)
        assert torch.equal(have.values, want.values) and torch.equal(have.to_wire(), wire)
    with pytest.raises(ValueError, match="position .* in a tensor of 200 elements"):
        sbc.payloads_from_wire_many(wires[:2], [5000, 200], ["a", "b"])


# -- RedSync: trimmed top-k is every tensor's exact top-k, so a bucket's selection is segment_topk's -----


@pytest.mark.parametrize(
    "knobs",
    [{}, {"density": 0.01}, {"method": "threshold_binary_search"}, {"quantize": True}, {"reuse_threshold": True}],
    ids=["trimmed", "trimmed_1pct", "binary_search_loop", "quantize_loop", "reuse_loop"],
)
def test_redsync_with_error_feedback_over_a_bucket_is_the_per_tensor_loop(knobs):
    """Several steps: the same (value, index) pairs and residuals, bit for bit; the settings whose selection
    depends on a search path, a reused threshold or the sign means go tensor by tensor inside."""
    numels = [7, 300, 5000, 40_000, 70_000]
    loop, batched = _ef_bucket_steps(lambda: RedSyncCompressor(**knobs), numels, 1.0, 4, 5, _same_sparse_payload)
    assert batched.compressor.thresholds == loop.compressor.thresholds


def test_redsyncs_held_bucket_steps_are_the_per_tensor_held_steps():
    """RedSync sends variable sizes, so the hook encodes its steps ahead: without a reused threshold its
    error feedback holds a bucket's step in a second flat, as for SBC."""
    loop = ErrorFeedback(RedSyncCompressor(0.01), bucketed=False)
    batched = ErrorFeedback(RedSyncCompressor(0.01), bucketed=True)
    assert batched.speculates and batched._holder is None, "RedSync without reuse moves no state of its own"

    check = _same_residuals(batched, loop)
    _run_held_schedule(loop, batched, [300, 5000, 40_000, 64], 3, check)


@pytest.mark.parametrize("which", ["dgc", "sbc"])
def test_several_buckets_held_in_one_step_keep_their_flats_and_a_new_bucketing_frees_the_old(which):
    """The hook's overlap holds one bucket at a time and commits the step once: every bucket's written flats
    become its state and its old ones its next spare (the same storage every other step, nothing
    rebuilt); a new bucketing of the keys frees the old bucketings' spares. Bit for bit the loop's."""

    def make():
        if which == "dgc":
            return DGCCompressor(density=0.01, warmup_densities=[])
        return ErrorFeedback(SBCCompressor(0.01))

    loop, batched = make(), make()
    loop.bucketed, batched.bucketed = False, True
    same = (
        (lambda _: _same_dgc_state(batched, loop, list("abcd"))) if which == "dgc" else _same_residuals(batched, loop)
    )
    gen = torch.Generator().manual_seed(4)
    buckets = [(("a", "b"), [500, 3000]), (("c", "d"), [64, 2000])]
    storage: list[dict] = []
    for step in range(5):
        if step == 4:
            buckets = [(("a", "b", "c", "d"), [500, 3000, 64, 2000])]  # DDP rebuilt its buckets
        for compressor in (loop, batched):
            compressor.begin_step(step)
        for keys, numels in buckets:
            grads = list(torch.randn(sum(numels), generator=gen).split(numels))
            want = [loop.compress_pending(g, k) for g, k in zip(grads, keys, strict=True)]
            for have, expected in zip(batched.compress_pending_many(grads, list(keys)), want, strict=True):
                _same_sparse_payload(have, expected)
        loop.commit(set("abcd"))
        batched.commit(set("abcd"))
        same(step)
        assert set(batched._buckets.flats) == {keys for keys, _ in buckets} == set(batched._buckets.spares), step
        flat_of = {keys: g.flats[0].data_ptr() for keys, g in batched._buckets.flats.items()}
        storage.append(flat_of)
    assert storage[3] == storage[1] and storage[2] == storage[0], "each bucket's two flats alternate, none rebuilt"


# -- DeMo: a bucket's tiles of one shape transformed, selected and decoded together ----------------------


@contextlib.contextmanager
def _one_thread():
    """torch on one thread, as lgc's gloo workers run: the BLAS then rounds each tile's product alike whatever
    is batched beside it (on several it may split a lone tile's product between threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_DEMO_SHAPES = [(64,), (10,), (7,), (300,), (96, 40), (10, 64), (32, 3, 3, 3), (128, 64), (130, 70), (16, 16)]


def _demo_pair(shapes, **knobs):
    """Error feedback over DeMo tensor by tensor and a bucket at once, the shapes attached as the hook does."""
    keys = [f"p{i}" for i in range(len(shapes))]
    parameters = {key: torch.empty(shape) for key, shape in zip(keys, shapes, strict=True)}
    pair = []
    for bucketed in (False, True):
        inner = DeMoCompressor(**knobs)
        inner.attach_parameters(parameters)
        pair.append(ErrorFeedback(inner, decay=0.999, bucketed=bucketed))
    return keys, [math.prod(shape) for shape in shapes], *pair


@settings(max_examples=12, deadline=None)
@given(
    shapes=st.lists(st.sampled_from(_DEMO_SHAPES), min_size=2, max_size=6, unique=True),
    knobs=st.sampled_from(
        [
            {"chunk": 16, "k": 4},
            {"chunk": 16, "k": 256},  # every coefficient of a full tile kept
            {"chunk": 64, "k": 32},  # the reference's
            {"chunk": 8, "k": 1, "value_dtype": "bfloat16"},
            {"chunk": 16, "k": 4, "tiling": "flat"},  # error feedback's own loop
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_over_demo_encodes_a_bucket_as_the_per_tensor_loop(shapes, knobs, seed):
    """Every payload's wire bytes and coefficient indices and every residual (DeMo's momentum), bit for bit,
    over 3 steps; then every rank's aggregate (sign and no sign) decoded at once as tensor by tensor."""
    keys, numels, loop, batched = _demo_pair(shapes, **knobs)
    assert batched.compressor.bucketed is True, "error feedback's switch is its compressor's decode's too"
    with _one_thread():
        _demo_steps_and_sums(keys, numels, loop, batched, knobs, seed)


def _demo_steps_and_sums(keys, numels, loop, batched, knobs, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        received = [[] for _ in keys]
        for _rank in range(3):
            tensors = list((torch.randn(sum(numels), generator=gen) ** 3).split(numels))
            have = batched.compress_many(tensors, keys)
            want = loop.compress_many(tensors, keys)
            for key, h, w, payloads in zip(keys, have, want, received, strict=True):
                assert torch.equal(h.to_wire(), w.to_wire()) and torch.equal(h.indices, w.indices), key
                assert torch.equal(batched.residuals[key], loop.residuals[key]), key
                payloads.append(h)
    for sign in (True, False):
        loop.compressor.sign = batched.compressor.sign = sign
        if knobs.get("tiling") == "flat":
            assert not batched.compressor.batches_on(torch.device("cpu")), "flat tiles decode tensor by tensor"
        else:
            _assert_bucket_sums_are_the_loops(loop, batched.compressor, received)


def test_demos_bucket_decode_goes_through_the_hooks_aggregate_many_where_it_batches(monkeypatch):
    """aggregate_many takes decode_segments where batches_on says (error feedback's bucketed=True on the CPU)."""
    keys, numels, loop, batched = _demo_pair([(96, 40), (64,)], chunk=16, k=4)
    tensors = list(torch.randn(sum(numels)).split(numels))
    received = [[p] for p in batched.compress_many(tensors, keys)]
    calls = []
    monkeypatch.setattr(type(batched.compressor), "decode_segments", lambda self, p, o: calls.append(len(o)))
    batched.aggregate_many(received, list(torch.empty(sum(numels)).split(numels)))
    loop.aggregate_many(received, list(torch.empty(sum(numels)).split(numels)))
    assert calls == [2], "the bucketed side alone decodes at once"
    assert DeMoCompressor().batches_on(torch.device("cuda")) and not DeMoCompressor().batches_on(torch.device("cpu"))
    flat_tiles = DeMoCompressor(tiling="flat")
    flat_tiles.bucketed = True
    assert not flat_tiles.batches_on(torch.device("cpu")), "flat tiles have no bucket pass"


@pytest.mark.parametrize(
    ("make", "refusal"),
    [
        (lambda: DeMoCompressor(chunk=16, k=4, tiling="flat"), "tiling='flat' has no bucket pass"),
        (lambda: QSGDCompressor(levels=3, bucket_size=64), r"codes of 1, 2, 4 or 8 bits, got 3 \(levels=3\)"),
    ],
)
def test_error_feedback_keeps_its_own_loop_where_a_codec_configuration_has_no_bucket_pass(make, refusal, monkeypatch):
    """bucketed=True over a configuration without a bucket pass (segments_supported): error feedback builds no flat
    and never calls feed_back_segments, which refuses such a configuration when called directly."""
    ef = ErrorFeedback(make(), bucketed=True)
    if isinstance(ef.compressor, DeMoCompressor):
        ef.compressor.attach_parameters({"a": torch.empty(700), "b": torch.empty(40, 30)})
    assert not ef.batches_on(torch.device("cpu")) and not ef.batches_on(torch.device("cuda"))
    with pytest.raises(ValueError, match=refusal):
        ef.compressor.feed_back_segments(torch.zeros(1900), [700, 1200], ["a", "b"])
    monkeypatch.setattr(type(ef.compressor), "feed_back_segments", lambda *args: pytest.fail("no bucket pass"))
    ef.compress_many([torch.randn(700), torch.randn(1200)], ["a", "b"])
    assert not ef._buckets.flats, "no flat built"


def test_demos_tiles_transform_alike_whatever_tiles_are_batched_beside_them():
    """On one thread a tile's coefficients (and its inverse) do not depend on the tiles batched beside it nor on
    where in memory they lie: the one-row chunks of vectors too, where a folded matrix product rounds a
    single row differently, and tiles whose rows the BLAS reads differently at another alignment."""
    demo = DeMoCompressor()
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 64), (1, 10), (1, 7), (2, 64), (5, 64), (10, 64), (3, 5), (26, 35), (48, 40), (64, 64), (64, 27)]
    with _one_thread():
        for h, w in shapes:
            memory = torch.randn(40 * h * w + 3, generator=gen)
            for inverse in (False, True):
                whole = demo._dct.tiles(memory[: 40 * h * w].view(40, h, w), inverse)
                for start, count in [(0, 1), (3, 1), (5, 2), (9, 7), (20, 20)]:
                    for shift in (0, 1, 3):  # the same tiles at another address, 4 or 12 bytes off alignment
                        buffer = torch.zeros(count * h * w + shift)
                        buffer[shift:] = memory[start * h * w : (start + count) * h * w]
                        part = demo._dct.tiles(buffer[shift:].view(count, h, w), inverse)
                        assert torch.equal(part, whole[start : start + count]), (h, w, inverse, start, count, shift)


def test_demo_takes_a_bucket_with_an_empty_tensor_as_the_loop():
    """An empty parameter (the hook sends one with min_numel=0) in a bucket: encoded and decoded at once as the
    per-tensor path does, the empty tensor's payload empty."""
    keys, numels, loop, batched = _demo_pair([(96, 40), (0,), (64,)], chunk=16, k=4)
    demo = batched.compressor
    with _one_thread():
        flat = torch.randn(sum(numels))
        want = [demo.compress(t, key) for t, key in zip(flat.split(numels), keys, strict=True)]
        expected = flat - torch.cat([demo.decompress(p) for p in want])
        have = demo.feed_back_segments(flat, numels, keys)
        assert torch.equal(flat, expected)
        for h, w in zip(have, want, strict=True):
            assert torch.equal(h.to_wire(), w.to_wire())
        assert have[1].values.numel() == 0
        _assert_bucket_sums_are_the_loops(loop.compressor, demo, [[p] for p in have])


@pytest.mark.parametrize("decay", [1.0, 0.999])
def test_demos_held_bucket_steps_are_the_per_tensor_held_steps(decay):
    """DeMo keeps no state of its own (the momentum is error feedback's residual): error feedback holds a
    bucket's step in a second flat, committed whole, in part or dropped, as tensor by tensor."""
    loop = ErrorFeedback(DeMoCompressor(chunk=16, k=4), decay=decay, bucketed=False)
    batched = ErrorFeedback(DeMoCompressor(chunk=16, k=4), decay=decay, bucketed=True)
    assert batched.speculates and batched._holder is None
    with _one_thread():
        _run_held_schedule(loop, batched, [300, 5000, 64, 250], 2, _same_residuals(batched, loop))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_demo_over_a_bucket_is_the_per_tensor_loop_up_to_rounding():
    """The default on a GPU, where batched products choose their kernels by the batch: every rank gets the same
    bits from the same bucket (the path is deterministic), and the momenta and the unsigned aggregate match
    bucketed=False's loop up to float rounding."""
    shapes = [(256, 64, 3, 3), (64,), (2048, 512), (1000, 2048), (10,)]
    keys = [f"p{i}" for i in range(len(shapes))]
    parameters = {key: torch.empty(shape) for key, shape in zip(keys, shapes, strict=True)}
    numels = [math.prod(shape) for shape in shapes]

    def build(bucketed):
        demo = DeMoCompressor(sign=False)
        demo.attach_parameters(parameters)
        return ErrorFeedback(demo, 0.999, bucketed=bucketed)

    loop, batched, again = build(False), build(None), build(None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        tensors = list(torch.randn(sum(numels), device="cuda", generator=gen).split(numels))
        have, want = batched.compress_many(tensors, keys), loop.compress_many(tensors, keys)
        for key, h, a in zip(keys, have, again.compress_many(tensors, keys), strict=True):
            assert torch.equal(h.to_wire(), a.to_wire()), key
            assert torch.equal(batched.residuals[key], again.residuals[key]), key
    for key in keys:
        torch.testing.assert_close(batched.residuals[key], loop.residuals[key], rtol=1e-4, atol=1e-4)
    outs = list(torch.empty(sum(numels), device="cuda").split(numels))
    batched.aggregate_many([[p] for p in have], outs)
    for out, p in zip(outs, want, strict=True):
        torch.testing.assert_close(out, loop.aggregate([p]), rtol=1e-3, atol=1e-3)
