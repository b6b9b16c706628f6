"""Deep Gradient Compression: momentum correction, masking, warm-up, sampled threshold, DDP training."""

import io
import math
import random

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import ErrorFeedback, TopKCompressor, register_compression_hook
from lgc.compressors import SparsePayload
from lgc.compressors.dgc import (
    PAPER_WARMUP_DENSITIES,
    DGCCompressor,
    _ColumnScan,
    check_optimizer_momentum,
    sampled_topk,
)
from lgc.compressors.topk import num_selected
from lgc.ddp.hook import CompressionHookState


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _dyadic(n: int, seed: int) -> torch.Tensor:
    """Multiples of 1/4 in [-8, 8]: with momentum 0.5 every sum below is exact in fp32, so the
    compressor must match the formulas bit for bit whatever order or FMA it computes them with."""
    return torch.randint(-32, 33, (n,), generator=torch.Generator().manual_seed(seed)).float() / 4


def _dense(payload: SparsePayload) -> torch.Tensor:
    return payload.to_dense()


def _assert_threshold_selection(x: torch.Tensor, positions: torch.Tensor) -> None:
    """Distinct positions, and every selected |x| >= every unselected |x|."""
    assert positions.unique().numel() == positions.numel()
    selected = torch.zeros(x.numel(), dtype=torch.bool)
    selected[positions] = True
    if (~selected).any():
        assert x.abs()[selected].min() >= x.abs()[~selected].max()


# -- (1) density 1: DGC sends exactly what heavy-ball SGD steps along --------------------------------
# With density 1 every entry is sent every step and v is emptied, so the sent vector is u_t:
#   masking off: u_t = m u_{t-1} + g_t, heavy-ball SGD's momentum buffer (torch.optim.SGD's
#     update direction), so DGC + SGD(momentum=0) == SGD(momentum=m);
#   Nesterov, masking off: u_t = m (u_{t-1} + g_t) = m b_t with b_t SGD's buffer, and the sent
#     u_t + g_t = g_t + m b_t is exactly SGD(nesterov=True)'s update direction;
#   masking on: u is zeroed everywhere after every step, so u_t = g_t: momentum never builds up
#     and DGC at density 1 is plain SGD without momentum.


def _sgd_directions(grads: list[torch.Tensor], momentum: float, nesterov: bool) -> list[torch.Tensor]:
    """The step directions torch.optim.SGD(lr=1) takes for these gradients."""
    param = torch.zeros_like(grads[0], requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=1.0, momentum=momentum, nesterov=nesterov)
    directions = []
    for g in grads:
        with torch.no_grad():
            param.zero_()  # from 0 with lr 1 the step is exactly -direction
        param.grad = g.clone()
        optimizer.step()
        directions.append(-param.detach().clone())
    return directions


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_without_masking_sends_heavy_ball_sgd_updates_exactly(nesterov):
    grads = [_dyadic(3000, seed) for seed in range(8)]
    dgc = DGCCompressor(1.0, momentum=0.5, nesterov=nesterov, momentum_masking=False, warmup_densities=[])
    sent = [dgc.decompress(dgc.compress(g, "w")) for g in grads]
    for got, expected in zip(sent, _sgd_directions(grads, 0.5, nesterov), strict=True):
        assert torch.equal(got, expected)
    assert torch.count_nonzero(dgc.velocities["w"]) == 0


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_matches_momentum_sgd_to_rounding_with_momentum_0_9(nesterov):
    grads = [_randn(5000, seed) for seed in range(20)]
    dgc = DGCCompressor(1.0, momentum=0.9, nesterov=nesterov, momentum_masking=False, warmup_densities=[])
    for g, expected in zip(grads, _sgd_directions(grads, 0.9, nesterov), strict=True):
        # The compressor computes g + m*u in one FMA pass, SGD as mul_ then add_: 1 ulp apart per step.
        torch.testing.assert_close(dgc.decompress(dgc.compress(g, "w")), expected, rtol=1e-5, atol=1e-6)


def test_density_one_with_masking_is_plain_sgd_without_momentum():
    dgc = DGCCompressor(1.0, momentum=0.9, warmup_densities=[])
    for seed in range(5):
        g = _randn(2000, seed)
        assert torch.equal(dgc.decompress(dgc.compress(g, "w")), g)
        assert torch.count_nonzero(dgc.momenta["w"]) == 0


# -- (1b) weight decay inside momentum correction ----------------------------------------------------
# torch.optim.SGD(momentum=m, weight_decay=wd) steps along the momentum of g + wd * w. DGC adds
# wd * w to the gradient before its momentum correction, so in the dense limit (density 1, masking
# off) DGC + SGD(momentum=0, weight_decay=0) is that optimizer, for compressed and dense tensors.
# Decay left in the optimizer instead acts outside the momentum: at equilibrium u = g / (1 - m),
# so it is (1 - m) * wd, 10x weaker at m = 0.9 (the defect this section guards against).
_WD = 0.5
_LR = 0.05


def _regression() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(256, 20, generator=gen)
    target = features @ torch.randn(20, 5, generator=gen) + 0.5 * torch.randn(256, 5, generator=gen)
    return features, target


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(20, 5)  # a 100-entry weight (compressed below) and a 5-entry bias (sent dense)


def _train_regression(
    optimizer_kwargs: dict, dgc: DGCCompressor | None, steps: int, make_optimizer=None
) -> list[list[torch.Tensor]]:
    """Parameters after every step; with ``dgc``, gradients go through it as the hook would send them.

    One process stands in for the hook with world size 1: the gradient is divided by 1, tensors of
    at least 64 entries are compressed and decoded, smaller ones pass through ``transform_dense``.
    """
    features, target = _regression()
    model = _linear()
    if dgc is not None:
        dgc.attach_parameters(dict(model.named_parameters()))
    if make_optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=_LR, **optimizer_kwargs)
    else:
        optimizer = make_optimizer(model.parameters())
    trajectory = []
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * (model(features) - target).square().sum(1).mean()).backward()
        if dgc is not None:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    share = param.grad.reshape(-1) / 1  # the hook divides by the world size
                    if param.numel() >= 64:
                        sent = dgc.decompress(dgc.compress(share, name))
                    else:
                        sent = dgc.transform_dense(share, name)
                    param.grad.copy_(sent.view_as(param))
        optimizer.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


def _dense_limit_dgc(nesterov: bool, weight_decay: float, world_size: int = 1) -> DGCCompressor:
    return DGCCompressor(
        1.0,
        momentum=0.9,
        nesterov=nesterov,
        momentum_masking=False,
        warmup_densities=[],
        weight_decay=weight_decay,
        world_size=world_size,
    )


def _norm(params: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([p.reshape(-1) for p in params])))


@pytest.mark.parametrize("nesterov", [False, True])
def test_dense_limit_with_weight_decay_is_momentum_sgd_with_weight_decay_step_for_step(nesterov):
    steps = 60
    expected = _train_regression(dict(momentum=0.9, weight_decay=_WD, nesterov=nesterov), None, steps)
    dgc = _dense_limit_dgc(nesterov, _WD)
    got = _train_regression(dict(momentum=0.0, weight_decay=0.0), dgc, steps)
    for step, (mine, reference) in enumerate(zip(got, expected, strict=True)):
        for param, ref in zip(mine, reference, strict=True):
            torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")
    assert sorted(dgc.velocities) == ["weight"] and sorted(dgc.dense_momenta) == ["bias"]


@pytest.mark.parametrize("nesterov", [False, True])
def test_weight_decay_outside_dgc_is_one_minus_m_weaker_and_inside_it_is_not(nesterov):
    """Equilibrium norms (measured: dense SGD 7.676, DGC with the decay 7.676, decay in the optimizer 11.118).

    Before the decay moved into DGC, the dgc config left it in the optimizer: the weights settled
    where dense momentum SGD with a decay of (1 - m) * wd settles, not with wd.
    """
    steps = 400  # converged by then (the norms agree to 1e-7 with 800 steps)
    dense = _norm(_train_regression(dict(momentum=0.9, weight_decay=_WD, nesterov=nesterov), None, steps)[-1])
    weaker = _norm(_train_regression(dict(momentum=0.9, weight_decay=0.1 * _WD, nesterov=nesterov), None, steps)[-1])
    inside = _norm(_train_regression(dict(momentum=0.0), _dense_limit_dgc(nesterov, _WD), steps)[-1])
    outside = _norm(_train_regression(dict(momentum=0.0, weight_decay=_WD), _dense_limit_dgc(nesterov, 0.0), steps)[-1])
    assert inside == pytest.approx(dense, rel=1e-5)
    assert outside == pytest.approx(weaker, rel=1e-4)
    assert outside > 1.4 * dense


def test_dgc_config_in_the_dense_limit_trains_like_the_dense_config():
    """compressor=dgc (density 1, masking off) against compressor=none with heavy-ball momentum.

    Optimizer and compressor are built from the composed configs, as lgc-train builds them: the
    dgc config must move the weight decay into the compressor, otherwise its weights decay
    (1 - m) times more slowly and drift from the dense run's (5e-4, lr 0.1: ~1e-4 after 60 steps).
    """
    import hydra
    from hydra import compose, initialize_config_module

    from lgc.train import build_compressor

    dense_limit = ["compressor.density=1.0", "compressor.momentum_masking=false", "compressor.warmup_densities=[]"]
    with initialize_config_module("lgc.conf", version_base="1.3"):
        dgc_cfg = compose("train", overrides=["compressor=dgc", "compressor.world_size=1", *dense_limit])
        dense_cfg = compose("train", overrides=["compressor=none", "optimizer.nesterov=false"])
    dgc = build_compressor(dgc_cfg.compressor)
    steps = 60
    got = _train_regression({}, dgc, steps, hydra.utils.instantiate(dgc_cfg.optimizer))
    expected = _train_regression({}, None, steps, hydra.utils.instantiate(dense_cfg.optimizer))
    for step, (mine, reference) in enumerate(zip(got, expected, strict=True)):
        for param, ref in zip(mine, reference, strict=True):
            torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")


def test_each_worker_adds_its_share_of_the_weight_decay():
    """The hook divides gradients by the world size before compressing: N workers' shares sum to g + wd * w."""
    world, n = 4, 3000
    weight = _randn(n, 7)
    grads = [_randn(n, seed) for seed in range(world)]
    mean = torch.stack(grads).mean(0)
    sent = []
    for rank in range(world):
        dgc = DGCCompressor(1.0, momentum=0.0, warmup_densities=[], weight_decay=0.01, world_size=world)
        dgc.attach_parameters({"w": weight, "b": weight[:10]})
        sent.append(
            (dgc.decompress(dgc.compress(grads[rank] / world, "w")), dgc.apply_momentum(grads[rank][:10] / world, "b"))
        )
    torch.testing.assert_close(sum(s[0] for s in sent), mean + 0.01 * weight)
    torch.testing.assert_close(sum(s[1] for s in sent), mean[:10] + 0.01 * weight[:10])
    # The hook can tell the world size instead of the constructor.
    told = DGCCompressor(1.0, momentum=0.0, warmup_densities=[], weight_decay=0.01)
    told.set_world_size(world)
    told.attach_parameters({"w": weight})
    torch.testing.assert_close(told.decompress(told.compress(grads[0] / world, "w")), sent[0][0])
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        told.set_world_size(0)


def test_weight_decay_refuses_to_run_without_the_weights():
    dgc = DGCCompressor(0.01, weight_decay=1e-4)
    with pytest.raises(ValueError, match=r"weight_decay=0.0001 needs the model's weights.*attach_parameters"):
        dgc.compress(_randn(1000), "w")
    with pytest.raises(ValueError, match="attach_parameters"):
        dgc.transform_dense(_randn(10), "b")
    dgc.attach_parameters({"w": torch.zeros(1000)})
    with pytest.raises(ValueError, match="gradient for 'v' but no parameter of that name"):
        dgc.compress(_randn(1000), "v")
    with pytest.raises(ValueError, match="parameter 'w' has 1000 elements but its gradient 999"):
        dgc.compress(_randn(999), "w")
    # Without weight decay nothing needs attaching.
    DGCCompressor(0.01).compress(_randn(1000), "w")


def test_attached_weights_are_neither_pickled_nor_checkpointed():
    import pickle

    model = _linear()
    dgc = DGCCompressor(1.0, weight_decay=1e-4, warmup_densities=[])
    state = CompressionHookState(dgc, min_numel=0)
    dgc.attach_parameters(dict(model.named_parameters()))
    dgc.compress(_randn(100), "weight")
    copy = pickle.loads(pickle.dumps(state))  # what a spawned worker receives
    assert copy.compressor._parameters is None and dgc._parameters is not None
    assert copy.compressor.weight_decay == 1e-4 and torch.equal(
        copy.compressor.velocities["weight"], dgc.velocities["weight"]
    )
    assert set(dgc.state_dict()) == {"momenta", "velocities", "dense_momenta", "rng", "epoch"}
    assert sorted(dgc.state_dict()["velocities"]) == ["weight"]  # DGC's own buffers, not the model's weights


# -- (2) momentum factor masking and (3) the error-feedback invariant -------------------------------
SAMPLED = {"exact_below_numel": 0}  # force the sampled-threshold path on small tensors
EXACT = {}  # tensors below exact_below_numel use torch.topk


@pytest.mark.parametrize("masking", [True, False])
@pytest.mark.parametrize("path", [EXACT, SAMPLED], ids=["exact", "sampled"])
def test_masking_zeroes_u_and_v_at_sent_positions_and_v_keeps_exactly_the_unsent(masking, path):
    m, n = 0.5, 40_000
    dgc = DGCCompressor(0.01, momentum=m, momentum_masking=masking, warmup_densities=[], **path)
    u_prev, v_prev = torch.zeros(n), torch.zeros(n)
    for step in range(6):
        g = _dyadic(n, step)
        u_new = m * u_prev + g  # exact for dyadic inputs
        v_before = v_prev + u_new
        payload = dgc.compress(g, "w")
        sent = payload.indices.long()
        unsent = torch.ones(n, dtype=torch.bool)
        unsent[sent] = False
        u, v = dgc.momenta["w"], dgc.velocities["w"]
        # (3) v_before == decoded + v_after, exactly.
        assert torch.equal(_dense(payload) + v, v_before)
        assert torch.equal(payload.values, v_before[sent])
        # (2) v is zeroed where sent; u too with masking, untouched without.
        assert torch.count_nonzero(v[sent]) == 0
        assert torch.equal(v[unsent], v_before[unsent])
        assert torch.equal(u[unsent], u_new[unsent])
        if masking:
            assert torch.count_nonzero(u[sent]) == 0
        else:
            assert torch.equal(u[sent], u_new[sent])
        u_prev, v_prev = u.clone(), v.clone()


def test_nesterov_accumulates_u_plus_g():
    m, n = 0.5, 20_000
    dgc = DGCCompressor(0.01, momentum=m, nesterov=True, warmup_densities=[])
    u_prev, v_prev = torch.zeros(n), torch.zeros(n)
    for step in range(4):
        g = _dyadic(n, step)
        u_new = m * (u_prev + g)
        v_before = v_prev + u_new + g
        payload = dgc.compress(g, "w")
        assert torch.equal(_dense(payload) + dgc.velocities["w"], v_before)
        u_prev, v_prev = dgc.momenta["w"].clone(), dgc.velocities["w"].clone()


def test_momentum_zero_is_top_k_with_error_feedback():
    dgc = DGCCompressor(0.01, momentum=0.0, warmup_densities=[])
    reference = ErrorFeedback(TopKCompressor(0.01))
    for step in range(5):
        g = _randn(30_000, step)
        assert torch.equal(_dense(dgc.compress(g, "w")), _dense(reference.compress(g, "w")))
    assert not dgc.momenta
    assert torch.equal(dgc.velocities["w"], reference.residuals["w"])
    assert dgc.residual_norm() == pytest.approx(reference.residual_norm())


def test_local_clipping_scales_by_inverse_sqrt_world_size():
    g = _randn(10_000) * 10
    dgc = DGCCompressor(1.0, momentum=0.0, clip_norm=2.0, world_size=4, warmup_densities=[])
    sent = dgc.decompress(dgc.compress(g, "w"))
    assert float(sent.norm()) == pytest.approx(2.0 / math.sqrt(4), rel=1e-5)
    torch.testing.assert_close(sent / sent.norm(), g / g.norm())
    small = g / g.norm() * 0.5  # below the limit: untouched
    assert torch.equal(DGCCompressor(1.0, momentum=0.0, clip_norm=2.0, world_size=4).compress(small, "w").values, small)


# -- (4) the sampled threshold -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_sampled_threshold_sends_at_least_0_8_k_and_exactly_k_after_the_survivor_top_k(seed):
    x = _randn(300_000, seed) * torch.rand(300_000, generator=torch.Generator().manual_seed(100 + seed))
    k = num_selected(x.numel(), 0.001)
    positions, info = sampled_topk(x, k, rng=random.Random(seed))
    assert info.path in ("threshold", "threshold+topk")
    assert 0.8 * k <= positions.numel()
    if info.survivors > 1.3 * k:
        assert info.path == "threshold+topk" and positions.numel() == k
    else:
        assert positions.numel() == info.survivors <= 1.3 * k
    _assert_threshold_selection(x, positions)


def test_too_low_a_threshold_takes_an_exact_top_k_of_the_survivors():
    x = _randn(200_000)
    k = 2000
    positions, info = sampled_topk(x, k, threshold=0.5)
    assert info.path == "threshold+topk" and info.rounds == 0 and info.survivors > 1.3 * k
    assert positions.numel() == k
    _assert_threshold_selection(x, positions)
    assert set(positions.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_ties_at_the_threshold_still_give_exactly_k():
    x = torch.ones(200_000)
    x[::2] = -1.0
    positions, info = sampled_topk(x, 500, rng=random.Random(0))
    assert info.path == "threshold+topk" and positions.numel() == 500


def test_too_high_a_threshold_is_lowered_by_0_8_per_round():
    x = _randn(200_000, 1)
    k = 2000
    kth = float(torch.topk(x.abs(), k).values[-1])
    positions, info = sampled_topk(x, k, threshold=kth * 1.25**3 * 1.01)
    assert info.rounds == 3 and info.path == "threshold"
    assert 0.8 * k <= positions.numel() <= 1.3 * k
    assert torch.equal(positions.sort().values, torch.nonzero(x.abs() >= info.threshold).view(-1))


def test_after_ten_rounds_what_passes_is_sent():
    x = _randn(200_000, 2)
    k = 2000
    half = float(torch.topk(x.abs(), k // 2).values[-1])
    positions, info = sampled_topk(x, k, threshold=half / 0.8**10 * 1.0001)
    assert info.rounds == 10 and info.path == "threshold"
    assert 0 < positions.numel() < 0.8 * k
    assert torch.equal(positions.sort().values, torch.nonzero(x.abs() >= info.threshold).view(-1))
    # Nothing passes even after 10 rounds: an exact top-k, never an empty payload.
    positions, info = sampled_topk(x, k, threshold=1e30)
    assert info.path == "exact" and positions.numel() == k
    _assert_threshold_selection(x, positions)


@pytest.mark.parametrize("chunk", [None, 4096, 1 << 20])
@pytest.mark.parametrize("numel", [15, 16, 1000, 65_543, 2 * (1 << 20) + 12_345])
def test_column_scan_finds_exactly_the_entries_above_each_threshold(numel, chunk):
    x = _randn(numel, numel)
    scan = _ColumnScan(x, chunk).scan_all()
    for q in (0.5, 0.9, 0.999, 0.99999):
        t = float(torch.quantile(x.abs(), q))
        assert torch.equal(scan(t).sort().values, torch.nonzero(x.abs() >= t).view(-1))


def test_span_by_span_accumulation_equals_one_pass(monkeypatch):
    import lgc.compressors.dgc as dgc_module

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spans are used on single-threaded CPUs
    try:
        results = []
        for chunk in (4096 + 16 * 7, 1 << 30):
            monkeypatch.setattr(dgc_module, "_CPU_CHUNK", chunk)
            dgc = DGCCompressor(0.003, warmup_densities=[], exact_below_numel=0)
            # Distinct magnitudes (no ties for top-k to break differently); spans are multiples of
            # 16 elements, so the vectorized arithmetic is the same, bit for bit.
            payloads = [dgc.compress(_randn(100_003, step), "w") for step in range(4)]
            results.append((payloads, dgc.momenta["w"], dgc.velocities["w"]))
    finally:
        torch.set_num_threads(threads)
    (chunked, u1, v1), (whole, u2, v2) = results
    for p, q in zip(chunked, whole, strict=True):
        assert torch.equal(p.to_dense(), q.to_dense())
    assert torch.equal(u1, u2) and torch.equal(v1, v2)


def test_small_tensors_use_an_exact_top_k():
    dgc = DGCCompressor(0.01, warmup_densities=[], exact_below_numel=10_000)
    g = _randn(5000)
    payload = dgc.compress(g, "w")
    assert dgc.last_selection.path == "exact" and payload.values.numel() == 50
    _assert_threshold_selection(g, payload.indices.long())


def test_payload_is_fp32_values_and_int32_indices_and_round_trips_the_wire():
    dgc = DGCCompressor(0.001, warmup_densities=[], exact_below_numel=0)
    payload = dgc.compress(_randn(500_000), "w")
    count = payload.values.numel()
    assert payload.values.dtype == torch.float32 and payload.indices.dtype == torch.int32
    assert payload.nbytes == 8 * count and payload.to_wire().numel() == 8 * count
    rebuilt = dgc.payload_from_wire(payload.to_wire(), 500_000)
    assert torch.equal(rebuilt.values, payload.values) and torch.equal(rebuilt.indices, payload.indices)
    assert torch.equal(dgc.decompress(rebuilt), payload.to_dense())
    assert torch.equal(dgc.aggregate([rebuilt, payload]), 2 * payload.to_dense())


# -- (5) warm-up -------------------------------------------------------------------------------------
def test_warmup_follows_the_paper_then_the_final_density():
    dgc = DGCCompressor(0.001)
    densities = []
    for epoch in range(6):
        dgc.set_epoch(epoch)
        densities.append(dgc.current_density)
    assert densities == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert list(PAPER_WARMUP_DENSITIES) == densities[:4]
    g = _randn(400_000)
    dgc.set_epoch(0)
    assert 0.8 * 100_000 <= dgc.compress(g, "w").values.numel() <= 1.3 * 100_000
    dgc.set_epoch(4)
    assert 0.8 * 400 <= dgc.compress(g, "w").values.numel() <= 1.3 * 400
    no_warmup = DGCCompressor(0.001, warmup_densities=[])
    assert no_warmup.current_density == 0.001
    custom = DGCCompressor(0.01, warmup_densities=[0.5])
    custom.set_epoch(1)
    assert custom.current_density == 0.01


# -- (6) checkpoints ---------------------------------------------------------------------------------
def test_state_dict_round_trip_continues_identically():
    grads = [_randn(300_000, seed) for seed in range(6)]
    original = DGCCompressor(0.001, warmup_densities=[0.01], exact_below_numel=0)
    for g in grads[:3]:
        original.compress(g, "a")
        original.compress(g[:1000], "b")
    original.set_epoch(1)
    state = original.state_dict()
    assert all(t.device.type == "cpu" for t in state["velocities"].values())
    saved_v = state["velocities"]["a"].clone()
    restored = DGCCompressor(0.001, warmup_densities=[0.01], exact_below_numel=0)
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as it goes into a checkpoint
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    for g in grads[3:]:
        for key, x in (("a", g), ("b", g[:1000])):
            p, q = original.compress(x, key), restored.compress(x, key)
            assert torch.equal(p.values, q.values) and torch.equal(p.indices, q.indices)
    assert torch.equal(state["velocities"]["a"], saved_v)  # the state holds clones
    assert restored.current_density == 0.001
    assert restored.residual_norm() == original.residual_norm() > 0


def test_apply_momentum_is_sgd_momentum_for_dense_tensors():
    grads = [_randn(64, seed) for seed in range(6)]
    for nesterov in (False, True):
        dgc = DGCCompressor(momentum=0.9, nesterov=nesterov)
        expected = _sgd_directions(grads, 0.9, nesterov)
        for g, direction in zip(grads, expected, strict=True):
            assert torch.equal(dgc.apply_momentum(g, "bias"), direction)


# -- (7) configuration checks ------------------------------------------------------------------------
def test_check_optimizer_momentum_refuses_weight_decay_in_both_places():
    dgc = DGCCompressor(weight_decay=5e-4)
    with pytest.raises(
        ValueError, match=r"optimizer weight_decay is 0.0005 but DGC applies weight decay itself"
    ) as err:
        check_optimizer_momentum(dgc, 0.0, weight_decay=5e-4)
    assert "optimizer.weight_decay=0" in str(err.value) and "compressor.weight_decay" in str(err.value)
    with pytest.raises(ValueError, match="applied twice"):
        check_optimizer_momentum(CompressionHookState(dgc), 0, weight_decay=1e-4)
    check_optimizer_momentum(dgc, 0.0, weight_decay=0.0)
    check_optimizer_momentum(dgc, 0.0, weight_decay=None)  # not told: not checked
    check_optimizer_momentum(dgc, 0.0)  # the positional signature of before
    check_optimizer_momentum(DGCCompressor(), 0.0, weight_decay=5e-4)  # decay only in the optimizer
    check_optimizer_momentum(ErrorFeedback(TopKCompressor(0.01)), 0.9, weight_decay=5e-4)


def test_check_optimizer_momentum_refuses_double_momentum_and_double_error_feedback():
    dgc = DGCCompressor()
    with pytest.raises(ValueError, match="DGC applies momentum correction itself; set optimizer.momentum=0"):
        check_optimizer_momentum(dgc, 0.9)
    with pytest.raises(ValueError, match="optimizer.momentum=0"):
        check_optimizer_momentum(CompressionHookState(dgc), 0.5)
    with pytest.raises(ValueError, match="error_feedback=false"):
        check_optimizer_momentum(ErrorFeedback(dgc), 0.0)
    check_optimizer_momentum(dgc, 0.0)
    check_optimizer_momentum(CompressionHookState(dgc), 0)
    check_optimizer_momentum(ErrorFeedback(TopKCompressor(0.01)), 0.9)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"density": 0.0}, r"density must be in \(0, 1\], got 0.0"),
        ({"density": 1.5}, r"density must be in \(0, 1\], got 1.5"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
        ({"clip_norm": -1.0}, r"clip_norm must be positive or None, got -1.0"),
        ({"world_size": 0}, r"world_size must be a positive integer, got 0"),
        ({"weight_decay": -1e-4}, r"weight_decay must be a finite number >= 0, got -0.0001"),
        ({"weight_decay": math.inf}, r"weight_decay must be a finite number >= 0, got inf"),
        ({"warmup_densities": [0.25, 2.0]}, r"warmup_densities must lie in \(0, 1\], got 2.0"),
        ({"sample_fraction": 0.0}, r"sample_fraction must be in \(0, 1\], got 0.0"),
        ({"exact_below_numel": -1}, r"exact_below_numel must be a non-negative integer, got -1"),
    ],
)
def test_bad_knobs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DGCCompressor(**kwargs)


def test_yaml_holds_the_paper_defaults_without_error_feedback():
    from hydra import compose, initialize_config_module

    from lgc.train import build_hook_state

    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=["compressor=dgc", "optimizer.momentum=0", "optimizer.nesterov=false"])
    assert cfg.compressor.error_feedback is False
    state = build_hook_state(cfg.compressor, cfg.comm)
    dgc = state.compressor
    assert isinstance(dgc, DGCCompressor)  # not wrapped in ErrorFeedback
    assert (dgc.density, dgc.momentum, dgc.nesterov, dgc.momentum_masking, dgc.clip_norm) == (
        0.001,
        0.9,
        False,
        True,
        None,
    )
    assert dgc.warmup_densities == PAPER_WARMUP_DENSITIES and dgc.sample_fraction == 0.01
    assert dgc.world_size == cfg.trainer.devices
    # The weight decay moves from the optimizer (train.yaml's 5e-4) into the compressor.
    assert dgc.weight_decay == 5e-4 and cfg.optimizer.weight_decay == 0.0
    check_optimizer_momentum(state, cfg.optimizer.momentum, weight_decay=cfg.optimizer.weight_decay)


def test_yaml_weight_decay_follows_the_runs_weight_decay_and_refuses_it_twice():
    from hydra import compose, initialize_config_module

    from lgc.train import build_hook_state

    with initialize_config_module("lgc.conf", version_base="1.3"):
        paper = compose("train", overrides=["experiment=paper/dgc_cifar10_resnet110"])
        twice = compose("train", overrides=["compressor=dgc", "optimizer.weight_decay=5e-4"])
    dgc = build_hook_state(paper.compressor, paper.comm).compressor
    assert dgc.weight_decay == paper.regularization.weight_decay == 1e-4 and paper.optimizer.weight_decay == 0.0
    state = build_hook_state(twice.compressor, twice.comm)
    with pytest.raises(ValueError, match="applied twice"):
        check_optimizer_momentum(state, twice.optimizer.momentum, weight_decay=twice.optimizer.weight_decay)


# -- (8) two-process DDP training ---------------------------------------------------------------------
class _CountingDGC(DGCCompressor):
    """Records how many entries every compress() sends (module level, so spawn can pickle it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts: list[int] = []

    def compress(self, tensor, key):
        payload = super().compress(tensor, key)
        self.counts.append(payload.values.numel())
        return payload


def _least_squares_losses(rank: int, compressor, momentum: float, steps: int, lr: float) -> tuple[list[float], dict]:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(512, 64, generator=gen)
    target = features @ torch.randn(64, 64, generator=gen)
    shard = slice(rank * 256, (rank + 1) * 256)  # each worker has its own half of the data
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 64, bias=False))
    stats = {}
    if compressor is not None:
        state = register_compression_hook(model, compressor, min_numel=0, start_iter=0)
        stats = state.stats
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        (model(features[shard]) - target[shard]).square().sum(1).mean().backward()
        optimizer.step()
        with torch.no_grad():
            losses.append(float((model(features) - target).square().sum(1).mean()))
    return losses, stats


def _train_three_ways(rank: int, world: int, steps: int, lr: float, density: float) -> dict:
    dense, _ = _least_squares_losses(rank, None, 0.9, steps, lr)
    dgc = _CountingDGC(density, momentum=0.9, warmup_densities=[], exact_below_numel=0)
    dgc_losses, stats = _least_squares_losses(rank, dgc, 0.0, steps, lr)
    topk_ef = DGCCompressor(density, momentum=0.0, warmup_densities=[], exact_below_numel=0)
    topk_losses, _ = _least_squares_losses(rank, topk_ef, 0.0, steps, lr)
    return {"dense": dense, "dgc": dgc_losses, "topk_ef": topk_losses, "counts": dgc.counts, "stats": stats}


@pytest.mark.multiprocess
def test_ddp_dgc_with_plain_sgd_trains_like_dense_momentum_sgd():
    """Least squares (512 x 64 features, a 64 x 64 weight), two gloo workers with half the data each.

    Dense DDP with SGD(momentum=0.9) against DGC (density 5 %, no warm-up, momentum 0.9 in the
    compressor) with SGD(momentum=0), same learning rate, 200 steps. Both go from ~4e3 to ~1e-5 or
    below: DGC's final loss must be within 100x of the dense one (measured ~6x). Top-k with error
    feedback alone (DGC with momentum 0) lacks the momentum and must stay >= 1e4x higher.
    """
    steps, lr, density = 200, 0.01, 0.05
    results = run_workers(_train_three_ways, 2, steps, lr, density)
    r0, r1 = results
    assert r0["dgc"] == r1["dgc"]  # every rank applies the same aggregated update
    dense, dgc, topk_ef = r0["dense"], r0["dgc"], r0["topk_ef"]
    assert dense[-1] < 1e-8 * dense[0]
    assert dgc[-1] < 100 * dense[-1], f"DGC {dgc[0]:.3g} -> {dgc[-1]:.3g}, dense momentum SGD -> {dense[-1]:.3g}"
    assert topk_ef[-1] > 1e4 * dgc[-1]
    # The sampled threshold sends different numbers of entries on the two ranks; the hook's
    # size exchange makes the allgather work anyway, and its byte count is 8 bytes per entry.
    k = num_selected(64 * 64, density)
    assert len(r0["counts"]) == len(r1["counts"]) == steps
    assert any(a != b for a, b in zip(r0["counts"], r1["counts"], strict=True))
    for result in results:
        assert all(0.8 * k <= c <= 1.3 * k for c in result["counts"])
        assert result["stats"].payload_bytes == 8 * sum(result["counts"])


def _momentum_sgd_two_ways(
    rank: int, world: int, steps: int, weight_decay: float = 0.0, nesterov: bool = False
) -> dict:
    """Plain DDP + SGD(momentum, weight_decay) against DGC (density 1, no masking) + plain SGD, several buckets."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 5))

    reference = DDP(net(), bucket_cap_mb=0.005)
    hooked = DDP(net(), bucket_cap_mb=0.005)
    dgc = _dense_limit_dgc(nesterov, weight_decay, world)
    # min_numel 1000: the 32x64 and 64x48 weights are compressed, the 48x5 weight and the biases go dense.
    register_compression_hook(hooked, dgc, min_numel=1000, start_iter=0)
    optimizers = [
        torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay),
        torch.optim.SGD(hooked.parameters(), lr=0.05, momentum=0.0),
    ]
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        for model, optimizer in zip((reference, hooked), optimizers, strict=True):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    return {
        "reference": [p.detach().clone() for p in reference.parameters()],
        "hooked": [p.detach().clone() for p in hooked.parameters()],
        "dense_keys": sorted(dgc.dense_momenta),
        "compressed_keys": sorted(dgc.velocities),
    }


@pytest.mark.multiprocess
def test_dgc_momentum_reaches_the_tensors_the_hook_sends_dense():
    """Without sparsity or masking, DGC's momentum correction *is* heavy-ball SGD, for every tensor.

    The hook sends small tensors dense; it must pass them through DGC's momentum too, otherwise the
    biases and the small weight would train without momentum and the parameters would differ.
    """
    for result in run_workers(_momentum_sgd_two_ways, 2, 8):
        assert result["compressed_keys"] == ["0.weight", "2.weight"]
        assert result["dense_keys"] == ["0.bias", "2.bias", "4.bias", "4.weight"]
        for reference, hooked in zip(result["reference"], result["hooked"], strict=True):
            torch.testing.assert_close(hooked, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_dgc_weight_decay_through_the_hook_is_momentum_sgd_weight_decay():
    """The hook attaches the weights and divides by the world size: two workers each add half the decay.

    Nesterov, weight decay 0.05, density 1 without masking: every parameter, compressed or sent
    dense, follows SGD(momentum=0.9, nesterov=True, weight_decay=0.05) on the averaged gradient.
    """
    for result in run_workers(_momentum_sgd_two_ways, 2, 8, 0.05, True):
        assert result["compressed_keys"] == ["0.weight", "2.weight"]
        assert result["dense_keys"] == ["0.bias", "2.bias", "4.bias", "4.weight"]
        for reference, hooked in zip(result["reference"], result["hooked"], strict=True):
            torch.testing.assert_close(hooked, reference, rtol=1e-5, atol=1e-6)
