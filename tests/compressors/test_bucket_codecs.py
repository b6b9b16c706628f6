"""Codecs over whole buckets: a bucket's tensors encoded and decoded in a fixed number of passes, bit for bit the
per-tensor path's payloads, state and sums (EF-signSGD's scaled sign, Streaming DiLoCo's fp4, QSGD and TernGrad)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgc.compressors import ErrorFeedback, FP4Compressor, QSGDCompressor, SignSGDCompressor, TernGradCompressor
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
    assert tuple(keys) in batched._flats, "the bucket went as one flat"


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
    assert tuple(keys) in batched._flats


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
    as the per-tensor loop's over 3 steps; 3-bit codes (QSGD's levels=3) take the loop inside."""

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
