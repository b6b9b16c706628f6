"""Tests of the bit-packed quantizers: QSGD, TernGrad and EF-SGD's scaled sign.

Single-process tests check exact wire sizes and content, unbiasedness against the analytic
variance, QSGD's variance bound, the error-feedback invariant and the random state; one
two-process gloo test trains a least-squares model through the DDP hook with each of them.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc
from lgc import register_compression_hook
from lgc.coding.bitpack import unpack_bits, unpack_uint
from lgc.compressors import CombineMode, ErrorFeedback
from lgc.compressors.qsgd import Buckets, QSGDCompressor, QuantizedPayload, code_bits
from lgc.compressors.signsgd import SignPayload, SignSGDCompressor
from lgc.compressors.terngrad import TernGradCompressor
from lgc.methods import build_compressor

CONF = Path(lgc.__file__).parent / "conf" / "compressor"
#: Draws per unbiasedness test; the tolerance below scales with 1 / sqrt(DRAWS).
DRAWS = 2000
#: Allowed deviation of the empirical mean, in standard errors of the mean.
Z = 5.0


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _gradient_like(n: int, seed: int = 0) -> torch.Tensor:
    """Entries of very different magnitudes (scaled Gaussians, a few exact zeros, one outlier)."""
    g = _randn(n, seed) * torch.logspace(-2, 0, n)[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]
    g[:: max(1, n // 7)] = 0.0
    g[n // 2] = 8.0
    return g


def _per_element(buckets: Buckets, per_bucket: torch.Tensor) -> torch.Tensor:
    """One value per bucket repeated over the bucket's entries."""
    sizes = [rows.shape[1] for rows in buckets.views(torch.empty(buckets.numel)) for _ in range(rows.shape[0])]
    return torch.repeat_interleave(per_bucket, torch.tensor(sizes))


ALL = [
    QSGDCompressor(),
    QSGDCompressor(levels=1, bucket_size=None),
    QSGDCompressor(levels=3, bucket_size=100),
    QSGDCompressor(levels=127, bucket_size=64),
    QSGDCompressor(levels=200, bucket_size=1000),
    TernGradCompressor(),
    TernGradCompressor(bucket_size=64, clip_sigma=None),
    SignSGDCompressor(),
]


# --- wire format ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "compressor,numel,nbytes",
    [
        # QSGD: 4 bytes per bucket of 512 + 4 bits per element (s = 4 -> codes 0..8).
        (QSGDCompressor(), 1, 4 + 1),
        (QSGDCompressor(), 7, 4 + 4),
        (QSGDCompressor(), 512, 4 + 256),
        (QSGDCompressor(), 1000, 8 + 500),
        (QSGDCompressor(), 1025, 12 + 513),
        (QSGDCompressor(), 0, 0),
        (QSGDCompressor(levels=1, bucket_size=None), 1001, 4 + 251),  # 2-bit codes
        (QSGDCompressor(levels=2, bucket_size=100), 1001, 44 + 376),  # 3-bit codes, 11 buckets
        (QSGDCompressor(levels=127, bucket_size=None), 13, 4 + 13),  # 8-bit codes
        (QSGDCompressor(levels=128, bucket_size=64), 100, 8 + 113),  # 9-bit codes
        # TernGrad: 4 bytes per scaler + 2 bits per element.
        (TernGradCompressor(), 1, 4 + 1),
        (TernGradCompressor(), 13, 4 + 4),
        (TernGradCompressor(), 1000, 4 + 250),
        (TernGradCompressor(bucket_size=64), 1000, 64 + 250),
        # Scaled sign: one fp32 scale + 1 bit per element.
        (SignSGDCompressor(), 0, 4),
        (SignSGDCompressor(), 1, 4 + 1),
        (SignSGDCompressor(), 13, 4 + 2),
        (SignSGDCompressor(), 1000, 4 + 125),
        (SignSGDCompressor(), 1001, 4 + 126),
    ],
    ids=lambda x: repr(x) if not isinstance(x, int) else str(x),
)
def test_payload_bytes_are_exact_and_independent_of_the_values(compressor, numel, nbytes):
    assert compressor.payload_nbytes(numel) == nbytes
    for g in (_randn(numel), torch.zeros(numel), _gradient_like(numel) if numel > 1 else torch.ones(numel)):
        payload = compressor.compress(g, "w")
        assert payload.nbytes == nbytes
        assert payload.to_wire().numel() == nbytes
    assert compressor.combine is CombineMode.GATHER
    assert compressor.variable_size is False


def test_code_widths():
    assert [code_bits(s) for s in (1, 2, 3, 4, 7, 8, 127, 128)] == [2, 3, 3, 4, 4, 5, 8, 9]


@pytest.mark.parametrize("compressor", ALL, ids=repr)
@pytest.mark.parametrize("offset", [0, 3])
def test_wire_round_trip_is_exact(compressor, offset):
    g = _gradient_like(4099)
    payload = compressor.compress(g, "w")
    wire = payload.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    shifted = torch.cat([torch.zeros(offset, dtype=torch.uint8), wire])[offset:]  # misaligned fp32 scales
    rebuilt = compressor.payload_from_wire(shifted, g.numel())
    assert type(rebuilt) is type(payload) and rebuilt.numel == payload.numel
    for a, b in zip(payload.tensors(), rebuilt.tensors(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(compressor.decompress(rebuilt), compressor.decompress(payload))


@pytest.mark.parametrize("compressor", [QSGDCompressor(), TernGradCompressor(), SignSGDCompressor()], ids=repr)
def test_payload_from_wire_rejects_a_wrong_length(compressor):
    wire = compressor.compress(_randn(100), "w").to_wire()
    with pytest.raises(ValueError, match="bytes, got"):
        compressor.payload_from_wire(wire[:-1], 100)


@pytest.mark.parametrize("levels,bucket_size", [(4, 512), (1, None), (3, 100), (100, 100), (200, 64)])
def test_qsgd_wire_content_is_norms_and_offset_levels(levels, bucket_size):
    g = _gradient_like(1501, seed=levels)  # odd: the last byte is partly padding
    compressor = QSGDCompressor(levels=levels, bucket_size=bucket_size)
    payload = compressor.compress(g, "w")
    assert isinstance(payload, QuantizedPayload)
    assert payload.scales.dtype == torch.float32 and payload.codes.dtype == torch.uint8
    buckets = Buckets(g.numel(), bucket_size)
    norms = torch.cat([torch.linalg.vector_norm(rows, dim=1) for rows in buckets.views(g)])
    assert torch.equal(payload.scales, norms)
    codes = unpack_uint(payload.codes, code_bits(levels), g.numel())
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2 * levels
    signed = codes - levels
    # The level is |v| * s / norm rounded down or up, with the sign of v (or zero).
    exact = g.double().abs() * levels / _per_element(buckets, norms.double())
    assert torch.all(signed.abs() >= (exact - 1e-5).floor()) and torch.all(signed.abs() <= (exact + 1e-5).ceil())
    assert torch.all((signed == 0) | (signed.sign() == g.sign()))
    decoded = compressor.decompress(payload)
    assert torch.equal(decoded, signed.float() * _per_element(buckets, norms / levels))


def test_terngrad_sends_plus_minus_scale_or_zero_per_bucket():
    g = _gradient_like(1001)
    for bucket_size in (None, 64):
        compressor = TernGradCompressor(bucket_size=bucket_size, clip_sigma=None)
        payload = compressor.compress(g, "w")
        buckets = Buckets(1001, bucket_size)
        assert torch.equal(payload.scales, torch.cat([rows.abs().amax(1) for rows in buckets.views(g)]))
        decoded = compressor.decompress(payload)
        for rows, scale in zip(buckets.views(decoded), buckets.columns(payload.scales), strict=True):
            assert torch.all((rows == 0) | (rows == scale) | (rows == -scale))
        assert torch.all((decoded == 0) | (decoded.sign() == g.sign()))
        assert torch.all(decoded[g == 0] == 0)
        assert int(unpack_uint(payload.codes, 2, 1001).max()) <= 2


def test_terngrad_clips_at_c_sigma():
    g = _randn(1000) * 0.1
    g[7] = 50.0  # an outlier far beyond 2.5 sigma
    sigma = torch.std(g, correction=0)
    payload = TernGradCompressor(clip_sigma=2.5).compress(g, "w")
    torch.testing.assert_close(payload.scales, (2.5 * sigma).reshape(1))
    decoded = TernGradCompressor(clip_sigma=2.5).decompress(payload)
    assert decoded[7] == payload.scales[0]  # the clipped outlier is always sent at full scale
    # Without clipping the scale is the outlier itself.
    assert TernGradCompressor(clip_sigma=None).compress(g, "w").scales.item() == 50.0
    # A constant tensor (sigma = 0) is not clipped to zero.
    constant = TernGradCompressor().compress(torch.full((10,), 0.5), "w")
    assert torch.equal(TernGradCompressor().decompress(constant), torch.full((10,), 0.5))


def test_signsgd_scale_is_mean_magnitude_and_signs_match():
    g = _gradient_like(1001)
    compressor = SignSGDCompressor()
    payload = compressor.compress(g, "w")
    assert isinstance(payload, SignPayload)
    torch.testing.assert_close(payload.scale.double(), g.double().abs().mean().reshape(1), rtol=1e-6, atol=0)
    assert torch.equal(unpack_bits(payload.signs, 1001), g < 0)
    decoded = compressor.decompress(payload)
    assert torch.equal(decoded.abs(), payload.scale.expand(1001))
    assert torch.equal(decoded < 0, g < 0)
    assert torch.all(decoded[g == 0] > 0)  # sign(0) is sent as +1


@pytest.mark.parametrize("compressor", ALL, ids=repr)
def test_aggregate_equals_the_sum_of_decoded_payloads(compressor):
    payloads = [compressor.compress(_gradient_like(3001, seed=s), "w") for s in range(3)]
    expected = sum(compressor.decompress(p) for p in payloads)
    torch.testing.assert_close(compressor.aggregate(payloads), expected)
    assert torch.equal(compressor.aggregate(payloads[:1]), compressor.decompress(payloads[0]))


@pytest.mark.parametrize("compressor", ALL, ids=repr)
def test_input_and_payloads_are_left_untouched_and_other_dtypes_are_accepted(compressor):
    g = _gradient_like(777)
    before = g.clone()
    compressor.compress(g, "w")
    assert torch.equal(g, before)
    decoded = compressor.decompress(compressor.compress(g.bfloat16(), "w"))
    assert decoded.dtype == torch.float32 and decoded.shape == (777,)
    # Payloads own their memory: the compressor's reused scratch buffers do not leak into them.
    first = compressor.compress(g, "w")
    kept = [t.clone() for t in first.tensors()]
    compressor.compress(_randn(777, seed=9), "w")
    assert all(torch.equal(a, b) for a, b in zip(first.tensors(), kept, strict=True))


def test_zero_buckets_decode_to_zero_and_non_finite_buckets_to_nan():
    g = _randn(1024)
    g[:512] = 0.0
    for compressor in (QSGDCompressor(bucket_size=512), TernGradCompressor(bucket_size=512)):
        decoded = compressor.decompress(compressor.compress(g, "w"))
        assert torch.equal(decoded[:512], torch.zeros(512))
        g_inf = g.clone()
        g_inf[3] = math.inf
        decoded = compressor.decompress(compressor.compress(g_inf, "w"))
        assert decoded[:512].isnan().all()  # a gradient scaler (AMP) still sees the overflow
        assert decoded[512:].isfinite().all()


# --- statistics ----------------------------------------------------------------------------


def _draws(compressor, g: torch.Tensor, draws: int = DRAWS) -> torch.Tensor:
    return torch.stack([compressor.decompress(compressor.compress(g, "w")).double() for _ in range(draws)])


def _assert_unbiased(samples: torch.Tensor, g: torch.Tensor, variance: torch.Tensor, step: torch.Tensor) -> None:
    """Every element's mean is within Z standard errors of g (standard error from the exact variance).

    ``step`` (the grid spacing) adds a fp32 slack of 1e-5 steps for elements with zero variance.
    """
    mean = samples.mean(0)
    error = (mean - g.double()).abs()
    standard_error = (variance / samples.shape[0]).sqrt()
    assert torch.all(error <= Z * standard_error + 1e-5 * step), float((error / standard_error).nan_to_num().max())
    # The empirical variance matches the exact one (so the tolerance above is the right one).
    torch.testing.assert_close(samples.var(0).sum(), variance.sum(), rtol=0.1, atol=0)


@pytest.mark.parametrize("levels,bucket_size", [(4, 512), (7, None)])
def test_qsgd_is_unbiased(levels, bucket_size):
    g = _gradient_like(1200, seed=1)
    compressor = QSGDCompressor(levels=levels, bucket_size=bucket_size, seed=5)
    buckets = Buckets(g.numel(), bucket_size)
    norms = torch.cat([torch.linalg.vector_norm(rows.double(), dim=1) for rows in buckets.views(g)])
    step = _per_element(buckets, norms / levels)
    frac = torch.frac(g.double().abs() / step)
    variance = step.square() * frac * (1 - frac)  # a Bernoulli(frac) step of size `step`
    _assert_unbiased(_draws(compressor, g), g, variance, step)


@pytest.mark.parametrize("bucket_size", [None, 100])
def test_terngrad_without_clipping_is_unbiased(bucket_size):
    g = _gradient_like(1200, seed=2)
    compressor = TernGradCompressor(bucket_size=bucket_size, clip_sigma=None, seed=6)
    buckets = Buckets(g.numel(), bucket_size)
    scale = _per_element(buckets, torch.cat([rows.double().abs().amax(1) for rows in buckets.views(g)]))
    variance = scale * g.double().abs() - g.double().square()  # s * b with b ~ Bernoulli(|g| / s)
    _assert_unbiased(_draws(compressor, g), g, variance, scale)


@pytest.mark.parametrize(
    "levels,bucket_size,g",
    [
        (1, 512, _randn(2048, seed=3)),  # sqrt(d) / s = 22.6 binds
        (4, 512, _randn(2048, seed=4)),  # sqrt(d) / s = 5.66 binds
        (64, 512, _randn(2048, seed=5)),  # d / s^2 = 0.125 binds
        (4, None, _gradient_like(2000, seed=6)),  # one bucket, uneven magnitudes
    ],
    ids=["s1", "s4", "s64", "s4-one-bucket"],
)
def test_qsgd_variance_bound_holds_empirically(levels, bucket_size, g):
    compressor = QSGDCompressor(levels=levels, bucket_size=bucket_size, seed=7)
    samples = _draws(compressor, g, draws=500)
    mean_squared_error = (samples - g.double()).square().sum(1).mean()
    bound = compressor.variance_bound(g)
    d = bucket_size or g.numel()
    assert bound == pytest.approx(min(d / levels**2, math.sqrt(d) / levels) * float(g.double().square().sum()))
    assert mean_squared_error <= bound
    assert mean_squared_error >= 0.05 * bound  # the bound is not vacuous for these inputs


def test_shared_seed_gives_identical_draws_and_different_seeds_do_not():
    g = _randn(1000)
    a, b, c = QSGDCompressor(seed=1), QSGDCompressor(seed=1), QSGDCompressor(seed=2)
    assert torch.equal(a.compress(g, "w").codes, b.compress(g, "w").codes)
    assert not torch.equal(a.compress(g, "w").codes, c.compress(g, "w").codes)


@pytest.mark.parametrize("make", [QSGDCompressor, TernGradCompressor], ids=["qsgd", "terngrad"])
def test_state_dict_round_trip_reproduces_the_random_draws(make):
    compressor = make(seed=3)
    for step in range(3):
        compressor.compress(_randn(700, seed=step), "w")
    saved = io.BytesIO()
    torch.save(compressor.state_dict(), saved)  # as in a checkpoint
    expected = [compressor.compress(_randn(700, seed=10 + step), "w") for step in range(3)]

    resumed = make(seed=999)
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    pickled = pickle.loads(pickle.dumps(compressor))  # the DDP hook state is pickled to workers
    again = [resumed.compress(_randn(700, seed=10 + step), "w") for step in range(3)]
    for p, q in zip(expected, again, strict=True):
        assert torch.equal(p.codes, q.codes) and torch.equal(p.scales, q.scales)
    assert torch.equal(pickled.compress(_randn(700), "w").codes, compressor.compress(_randn(700), "w").codes)

    # Through the error-feedback wrapper, as train.py builds it.
    ef = ErrorFeedback(make(seed=4))
    ef.compress(_randn(700), "w")
    other = ErrorFeedback(make())
    other.load_state_dict(ef.state_dict())
    g = _randn(700, seed=1)
    assert torch.equal(ef.compress(g, "w").codes, other.compress(g, "w").codes)
    assert torch.equal(ef.residuals["w"], other.residuals["w"])


@pytest.mark.parametrize("make", [QSGDCompressor, TernGradCompressor], ids=["qsgd", "terngrad"])
def test_draws_follow_the_tensor_not_the_order_it_came_in(make):
    # DDP's first step after a restart groups the parameters into other buckets than the run it
    # resumes: a tensor's draws must not depend on which tensors came before it.
    forward, backward = make(seed=5), make(seed=5)
    grads = {key: _randn(600, seed=i) for i, key in enumerate(("a", "b", "c"))}
    for step in range(2):
        first = {key: forward.compress(g, key) for key, g in grads.items()}
        second = {key: backward.compress(g, key) for key, g in reversed(grads.items())}
        for key in grads:
            assert torch.equal(first[key].codes, second[key].codes), f"step {step}, {key}"
    assert forward.state_dict() == {"seed": 5, "draws": {"a": 2, "b": 2, "c": 2}} == backward.state_dict()
    # A key's next draws differ from its last: the count moves the seed.
    assert not torch.equal(forward.compress(grads["a"], "a").codes, first["a"].codes)
    with pytest.raises(ValueError, match="'draws'"):
        make().load_state_dict({"seed": 0, "generators": {"cpu": torch.Generator().get_state()}})


def test_signsgd_is_stateless():
    assert SignSGDCompressor().state_dict() == {}
    with pytest.raises(ValueError, match="stateless"):
        SignSGDCompressor().load_state_dict({"seed": 0})


# --- error feedback ------------------------------------------------------------------------

EF_INNER = [QSGDCompressor(), TernGradCompressor(), TernGradCompressor(clip_sigma=None), SignSGDCompressor()]


@pytest.mark.parametrize("inner", EF_INNER, ids=repr)
@pytest.mark.parametrize("seed", [0, 1])
def test_error_feedback_invariant(inner, seed):
    """``input == decoded + residual``: exact where the decoded value is 0, one rounding elsewhere.

    ``residual = input - decoded`` is computed exactly as defined (checked with torch.equal). Adding
    ``decoded`` back gives ``input`` bit for bit only when the subtraction was exact, which holds
    where ``decoded == 0`` and, by Sterbenz's lemma, where ``decoded`` lies within a factor 2 of
    ``input``. A quantizer's decoded value (+-scale, a grid point) can be far from a small input,
    so ``input - decoded`` is rounded to fp32 there and ``decoded + residual`` differs from
    ``input`` by at most two roundings: ``2**-23 * (|input| + |decoded|)``. Top-k and fp16 are exact
    everywhere because their decoded value is the input itself or its own rounding.
    """
    ef = ErrorFeedback(inner)
    ef.residuals["w"] = _gradient_like(3000, seed=100 + seed)
    g = _gradient_like(3000, seed=seed)
    corrected = g + ef.residuals["w"]
    decoded = ef.decompress(ef.compress(g, "w"))
    residual = ef.residuals["w"]
    assert torch.equal(residual, corrected - decoded)
    rebuilt = decoded + residual
    zero = decoded == 0
    assert torch.equal(rebuilt[zero], corrected[zero])
    near = ~zero & (decoded.abs() <= 2 * corrected.abs()) & (corrected.abs() <= 2 * decoded.abs())
    near &= decoded.sign() == corrected.sign()
    assert torch.equal(rebuilt[near], corrected[near])
    assert torch.all((rebuilt - corrected).abs() <= 2**-23 * (corrected.abs() + decoded.abs()))


#: Compressors whose error is a contraction, ``E ||C(v) - v||^2 < ||v||^2``: error feedback keeps
#: their residual bounded. QSGD needs about ``s >= sqrt(d)`` for that.
CONTRACTIONS = [
    SignSGDCompressor(),
    QSGDCompressor(levels=127, bucket_size=512),
    QSGDCompressor(levels=16, bucket_size=64),
    TernGradCompressor(bucket_size=64),
]


@pytest.mark.parametrize("inner", CONTRACTIONS, ids=repr)
def test_error_feedback_delays_but_never_drops(inner):
    ef = ErrorFeedback(inner)
    total_in, total_sent = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for step in range(40):
        g = _randn(1000, seed=step)
        total_in += g
        total_sent += ef.decompress(ef.compress(g, "w")).double()
    torch.testing.assert_close(total_sent + ef.residuals["w"].double(), total_in, rtol=0, atol=1e-4)
    assert ef.residual_norm() < 4 * math.sqrt(1000)  # bounded: a few gradient norms, not growing with the steps


def test_error_feedback_residual_grows_when_the_quantizer_is_not_a_contraction():
    """Why qsgd.yaml and terngrad.yaml default to ``error_feedback: false``.

    With the default ``s = 4`` and buckets of 512, QSGD's error variance is several times
    ``||v||^2`` (the bound is ``sqrt(512) / 4 = 5.7``), so ``v - Q(v)`` is larger than ``v`` and
    the residual fed back grows step after step instead of staying bounded.
    """
    ef = ErrorFeedback(QSGDCompressor())
    for step in range(40):
        ef.compress(_randn(1000, seed=step), "w")
    assert ef.residual_norm() > 100 * math.sqrt(1000)


def test_error_feedback_around_a_quantizer_that_is_not_a_contraction_is_refused():
    from lgc.methods import check_error_feedback

    for qsgd, words in (
        (QSGDCompressor(), "with levels=4 and bucket_size=512 its error can exceed the gradient"),
        (QSGDCompressor(bucket_size=None), "one bucket per tensor (bucket_size=None) its error can exceed"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            check_error_feedback(ErrorFeedback(qsgd), "qsgd", True, prefix="compressor.")
    check_error_feedback(ErrorFeedback(QSGDCompressor(levels=127, bucket_size=64)), "qsgd", True)  # a contraction
    check_error_feedback(QSGDCompressor(), "qsgd", None)  # without error feedback, as its yaml has it


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,expected",
    [
        ("qsgd", "QSGDCompressor(levels=4, bucket_size=512, seed=0)"),
        ("terngrad", "TernGradCompressor(bucket_size=None, clip_sigma=2.5, seed=0)"),
        ("signsgd", "ErrorFeedback(SignSGDCompressor())"),
    ],
)
def test_yaml_defaults_build_the_documented_compressors(name, expected):
    assert repr(build_compressor(OmegaConf.load(CONF / f"{name}.yaml"))) == expected


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: QSGDCompressor(levels=0), "levels must be an integer"),
        (lambda: QSGDCompressor(levels=2.5), "levels must be an integer"),
        (lambda: QSGDCompressor(levels=True), "levels must be an integer"),
        (lambda: QSGDCompressor(levels=2**15), "levels must be an integer"),
        (lambda: QSGDCompressor(bucket_size=0), "bucket_size must be a positive integer or None"),
        (lambda: QSGDCompressor(seed="x"), "seed must be an integer"),
        (lambda: TernGradCompressor(bucket_size=-1), "bucket_size must be a positive integer or None"),
        (lambda: TernGradCompressor(clip_sigma=0), "clip_sigma must be a positive finite number or None, got 0"),
        (
            lambda: TernGradCompressor(clip_sigma=float("nan")),
            "clip_sigma must be a positive finite number or None, got nan",
        ),
    ],
)
def test_invalid_knobs_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --- two-process training ------------------------------------------------------------------

STEPS = 250


def _train_least_squares(rank: int, world: int, compressors: dict, steps: int) -> dict[str, list[float]]:
    """Full-batch least squares on each worker's half of the data, once per compressor (None: dense)."""
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(512, 64, generator=gen)
    target = features @ torch.randn(64, 8, generator=gen)  # exactly realizable: the optimum has zero loss
    shard = slice(rank * 256, (rank + 1) * 256)
    curves = {}
    for name, compressor in compressors.items():
        torch.manual_seed(0)
        model = DDP(nn.Linear(64, 8, bias=False))
        if compressor is not None:
            register_compression_hook(model, compressor, min_numel=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            (model(features[shard]) - target[shard]).square().sum(1).mean().backward()
            optimizer.step()
            with torch.no_grad():
                losses.append(float((model(features) - target).square().sum(1).mean()))
        curves[name] = losses
    return curves


def _steps_to(losses: list[float], fraction: float) -> float:
    """First step whose loss is below ``fraction`` of the initial loss (infinity if none is)."""
    return next((i for i, loss in enumerate(losses) if loss < fraction * losses[0]), math.inf)


@pytest.fixture(scope="module")
def curves() -> dict[str, list[float]]:
    compressors = {
        "dense": None,
        # The yaml defaults, built as train.py builds them.
        "qsgd": build_compressor(OmegaConf.load(CONF / "qsgd.yaml")),
        "terngrad": build_compressor(OmegaConf.load(CONF / "terngrad.yaml")),
        "signsgd": build_compressor(OmegaConf.load(CONF / "signsgd.yaml")),
        "sign_without_feedback": SignSGDCompressor(),
    }
    rank0, rank1 = run_workers(_train_least_squares, 2, compressors, STEPS)
    for name in compressors:  # the DDP hook hands every rank the same averaged gradient
        assert rank0[name] == rank1[name], name
    return rank0


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name,fraction,max_slowdown,final",
    [("qsgd", 1e-6, 2.0, 1e-9), ("terngrad", 1e-6, 2.0, 1e-8), ("signsgd", 1e-4, 5.0, 1e-4)],
)
def test_two_process_training_converges_close_to_dense(curves, name, fraction, max_slowdown, final):
    """Reach ``fraction`` of the initial loss in at most ``max_slowdown`` times dense's steps.

    Dense SGD needs about 33 steps for 1e-4 and 55 for 1e-6 of the initial loss. QSGD's noise
    vanishes with the gradient on this realizable problem, so it follows dense closely (about 68
    steps to 1e-6); TernGrad's clipping slows the end (about 75 steps to 1e-6, 1e-9 after about
    220); the scaled sign with error feedback is markedly slower per step (about 120 steps to
    1e-4) but keeps converging. After all steps the loss is below ``final`` times the initial one.
    """
    dense = curves["dense"]
    assert _steps_to(dense, 1e-9) < 150
    losses = curves[name]
    assert _steps_to(losses, fraction) <= max_slowdown * _steps_to(dense, fraction), f"{name}: {losses[::25]}"
    assert losses[-1] < final * losses[0], f"{name}: {losses[::25]}"


@pytest.mark.multiprocess
def test_error_feedback_is_what_makes_the_scaled_sign_converge(curves):
    with_feedback, without = curves["signsgd"], curves["sign_without_feedback"]
    assert with_feedback[-1] < 0.1 * without[-1], (with_feedback[-1], without[-1])
