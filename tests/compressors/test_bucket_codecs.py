"""Codecs over whole buckets: a bucket's tensors encoded and decoded in a fixed number of passes, bit for bit the
per-tensor path's payloads, state and sums (EF-signSGD's scaled sign)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lgc.compressors import ErrorFeedback, SignSGDCompressor
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
        received = [[p, p] for p in got]
        outs = [torch.empty(n, device="cuda") for n in numels]
        sign.aggregate_many(received, outs)
        for payloads, out in zip(received, outs, strict=True):
            want = torch.empty_like(out)
            sign.aggregate_into(payloads, want)
            assert torch.equal(out, want)
    assert tuple(keys) in batched._flats
