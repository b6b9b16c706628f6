"""LGC's ablations: shared-index top-k, leader-scaled, and the linear codec."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from test_lgc import MIN_NUMEL, _batch, _net, observe_step, per_parameter
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc.autoencoder import LossWeights, num_chunks
from lgc.autoencoder.linear import LinearChunkCodec, LinearCodecTrainer
from lgc.autoencoder.pca_autoencoder import PCAAutoencoder, PCAAutoencoderConfig, PCAAutoencoderTrainer
from lgc.compressors.topk import num_selected
from lgc.learned.knobs import CodecTrainingKnobs
from lgc.learned.ps import LGCParameterServerState
from lgc.learned.rar import LGCRingAllreduceState
from lgc.learned.shared_index import SharedIndexState, quantization_levels
from lgc.learned.state import LGCStage
from lgc.learned.training import CodecTraining

DENSITY = 0.05
CHUNK = 32


def _state(**kwargs) -> SharedIndexState:
    # DGC-style warm-up: step 0 dense, step 1 top-k with error feedback (fills the residuals), then compressed.
    stages = dict(warmup_steps=2, warmup="dgc", warmup_densities=[0.2])
    return SharedIndexState(**{**dict(density=DENSITY, stages=stages, min_numel=MIN_NUMEL, chunk=CHUNK), **kwargs})


def _step(model: DDP, step: int, optimizer: torch.optim.Optimizer | None = None) -> None:
    x, y = _batch(step, dist.get_rank())
    model.zero_grad()
    (model(x) - y).square().mean().backward()
    if optimizer is not None:
        optimizer.step()


def _warmed_up(kwargs: dict) -> tuple[DDP, SharedIndexState, torch.optim.Optimizer]:
    """A model with the shared-index hook, past its two warm-up steps (the next step is compressed)."""
    kwargs = dict(kwargs)
    model = DDP(_net(), bucket_cap_mb=kwargs.pop("bucket_cap_mb", 0.01))
    state = _state(measure_error=True, **kwargs)
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        _step(model, step, optimizer)
    return model, state, optimizer


def _one_compressed_step(rank: int, world: int, kwargs: dict) -> dict:
    model, state, _ = _warmed_up(kwargs)
    payload_before = state.stats.payload_bytes
    observed = observe_step(model, state, 2, rank, world)
    return {
        **observed,
        "true_error": state.metrics()["lgc/true_error"],
        "premise": (state.metrics()["lgc/premise_r"], state.metrics()["lgc/premise_share"]),
        "run_premise": state.summary_extras()["lgc"]["premise"],
        "payload": state.stats.payload_bytes - payload_before,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("index_coding", ["raw", pytest.param("golomb", marks=pytest.mark.slow)])
def test_shared_index_fp32_delivers_the_exact_sum_at_the_leaders_positions(index_coding):
    results = run_workers(_one_compressed_step, 2, dict(leaders=dict(index_coding=index_coding)))
    compressed_k = 0
    for rank, result in enumerate(results):
        assert result["stage"] == LGCStage.COMPRESSED
        assert result["true_error"] == pytest.approx(0.0, abs=1e-12)
        for name, v, leader, own in per_parameter(result, rank, DENSITY):
            expected = torch.zeros_like(own)
            expected[leader] = sum(vj[leader] for vj in v)
            torch.testing.assert_close(result["grads"][name], expected, rtol=1e-6, atol=1e-7)
            cleared = own.clone()
            cleared[leader] = 0.0
            torch.testing.assert_close(result["residuals_after"][name], cleared, rtol=0, atol=0)
            compressed_k += leader.numel() if rank == 0 else 0
    if index_coding == "raw":
        # Payload: the leader broadcasts 4 bytes per position; everyone sends 4 bytes per value.
        assert [r["payload"] for r in results] == [8 * compressed_k, 4 * compressed_k]


@pytest.mark.multiprocess
@pytest.mark.parametrize("values", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_quantized_shared_index_is_within_one_step_per_worker_and_keeps_its_rounding(values):
    """One bucket: also the payload, exactly: every worker's codes in ``bits``-wide lanes (whole chunks,
    zero-padded) and each chunk's scale once (4 bytes, the allreduce-max); the leader's raw positions."""
    results = run_workers(_one_compressed_step, 2, dict(values=values, bucket_cap_mb=100))
    bits = int(values[3:])
    levels = quantization_levels(bits, 2)
    for rank, result in enumerate(results):
        params = list(per_parameter(result, rank, DENSITY))
        k = sum(leader.numel() for _, _, leader, _ in params)
        rows = num_chunks(k, CHUNK)
        assert result["payload"] == rows * CHUNK * bits // 8 + 4 * rows + (4 * k if rank == 0 else 0)
        # Chunks run across parameters in cat space; each chunk's shared scale is at most the largest
        # magnitude over both workers and all selected values, so one step is at most that / levels.
        step = max(float(torch.stack([vj[leader] for vj in v]).abs().max()) for _, v, leader, _ in params) / levels
        for name, v, leader, own in params:
            exact = sum(vj[leader] for vj in v)
            delivered = result["grads"][name][leader]
            assert torch.all((delivered - exact).abs() <= 2 * step * (1 + 1e-5))
            assert not torch.equal(delivered, exact)  # it is quantized
            # Error feedback keeps this worker's own rounding error: less than one step.
            assert torch.all(result["residuals_after"][name][leader].abs() < step * (1 + 1e-5))
            outside = torch.ones_like(own, dtype=torch.bool)
            outside[leader] = False
            assert torch.equal(result["grads"][name][outside], torch.zeros_like(own[outside]))
            torch.testing.assert_close(result["residuals_after"][name][outside], own[outside], rtol=0, atol=0)


def _rotating_steps(rank: int, world: int, kwargs: dict) -> list[dict]:
    model, state, optimizer = _warmed_up(kwargs)  # the default: a rotating leader
    observed = []
    for step in range(2, 2 + world):
        observed.append(observe_step(model, state, step, rank, world))
        optimizer.step()
    return observed


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "leader_only", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["shared_topk", "leader_scaled"]
)
def test_a_rotating_leader_gives_every_worker_its_turn(leader_only):
    """By default (``rotate_leader``) step ``t`` uses worker ``t % P``'s top-k positions (three workers, steps 2, 3, 4).

    shared-index fp32 delivers the exact sum there; leader-scaled delivers ``P`` times that step's
    leader's values, and every worker keeps ``v - v_leader`` there, the leader itself nothing.
    """
    results = run_workers(_rotating_steps, 3, dict(leader_only=leader_only))
    for rank, observed in enumerate(results):
        for step, result in enumerate(observed, start=2):
            leader_rank = step % 3
            for name, v, leader, own in per_parameter(result, rank, DENSITY, leader=leader_rank):
                expected = torch.zeros_like(own)
                kept = own.clone()
                if leader_only:
                    expected[leader] = 3 * v[leader_rank][leader]
                    kept[leader] = own[leader] - v[leader_rank][leader]
                else:
                    expected[leader] = sum(vj[leader] for vj in v)
                    kept[leader] = 0.0
                torch.testing.assert_close(result["grads"][name], expected, rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(result["residuals_after"][name], kept, rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
def test_leader_scaled_applies_world_size_times_the_leaders_values_and_feeds_back_the_difference():
    results = run_workers(_one_compressed_step, 2, dict(leader_only=True))
    for rank, result in enumerate(results):
        assert result["payload"] == (8 if rank == 0 else 0) * sum(
            leader.numel() for _, _, leader, _ in per_parameter(result, rank, DENSITY)
        )
        for name, v, leader, own in per_parameter(result, rank, DENSITY):
            expected = torch.zeros_like(own)
            expected[leader] = 2 * v[0][leader]
            torch.testing.assert_close(result["grads"][name], expected, rtol=1e-6, atol=1e-7)
            kept = own.clone()
            kept[leader] = own[leader] - v[0][leader]
            torch.testing.assert_close(result["residuals_after"][name], kept, rtol=1e-6, atol=1e-7)


def test_bad_values_are_refused_before_workers_start():
    with pytest.raises(ValueError, match=r"values must be one of .*got 'int2'"):
        SharedIndexState(values="int2")
    with pytest.raises(ValueError, match="learns nothing has no training stage: stages.ae_steps must be 0"):
        SharedIndexState(stages={"ae_steps": 5})
    with pytest.raises(ValueError, match="chunk must be an even integer >= 2, got 33"):
        SharedIndexState(chunk=33)
    with pytest.raises(ValueError, match="leader_only .* float format, got 'int8'"):
        SharedIndexState(leader_only=True, values="int8")
    assert quantization_levels(8, 8) == 15 and quantization_levels(4, 2) == 3 and quantization_levels(4, 8) == 0
    with pytest.raises(ValueError, match=r"values='int4' cannot hold the sum of 8 workers' codes .*at most 7 workers"):
        SharedIndexState(values="int4", world_size=8)
    SharedIndexState(values="int4", world_size=7)  # 1 level each way: allowed
    with pytest.raises(ValueError, match="training.codec must be one of"):
        LGCRingAllreduceState(training={"codec": "pca"})
    with pytest.raises(ValueError, match="training.linear_latent=4 sizes the linear and PCA-initialised codecs"):
        LGCRingAllreduceState(training={"linear_latent": 4})
    with pytest.raises(ValueError, match="training.pca_hidden must be a non-negative integer"):
        LGCRingAllreduceState(training={"codec": "pca_autoencoder", "pca_hidden": -1})


# -- the linear codec ------------------------------------------------------------------------------------


def test_linear_codec_is_exact_on_data_in_its_span_and_sums_linearly():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(64, 6, generator=g)).Q
    samples = torch.randn(500, 6, generator=g) @ basis.T  # rank 6
    codec = LinearChunkCodec(chunk=64, latent_size=6)
    codec.fit(samples)
    torch.testing.assert_close(codec.decode(codec.encode(samples)), samples, rtol=1e-5, atol=1e-5)
    # Codes add: decoding the sum of two workers' codes gives the sum of their chunks.
    a, b = samples[:10], samples[10:20]
    torch.testing.assert_close(codec.decode(codec.encode(a) + codec.encode(b)), a + b, rtol=1e-5, atol=1e-5)
    # Outside its span it is the orthogonal projection: the error is orthogonal to the span.
    x = torch.randn(5, 64, generator=g)
    error = x - codec.decode(codec.encode(x))
    torch.testing.assert_close(error @ codec.basis, torch.zeros(5, 6), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"latent_size must be in \[1, chunk=64\], got 65"):
        LinearChunkCodec(chunk=64, latent_size=65)


def test_linear_codec_trainer_fits_the_top_directions_of_its_buffer_and_round_trips_its_state():
    g = torch.Generator().manual_seed(1)
    direction = torch.nn.functional.normalize(torch.randn(32, generator=g), dim=0)
    chunks = torch.randn(200, 2, 1, generator=g) * 10 * direction + 0.01 * torch.randn(200, 2, 32, generator=g)
    trainer = LinearCodecTrainer(LinearChunkCodec(32, 1), buffer_size=150)
    trainer.add(chunks)
    assert trainer.num_samples == 150
    losses = trainer.train(1)
    assert losses["relative_error"] < 1e-3
    assert abs(float(trainer.autoencoder.basis[:, 0] @ direction)) == pytest.approx(1.0, abs=1e-4)
    twin = LinearCodecTrainer(LinearChunkCodec(32, 1))
    twin.load_state_dict(trainer.state_dict())
    assert torch.equal(twin.autoencoder.basis, trainer.autoencoder.basis) and torch.equal(twin.chunks, trainer.chunks)
    with pytest.raises(ValueError, match="no innovations"):
        trainer.add(chunks, chunks)


@pytest.mark.multiprocess
def test_the_measured_premise_is_the_workers_correlation_and_energy_share_at_the_leaders_positions():
    world = 3
    results = run_workers(_one_compressed_step, world, dict(leaders=dict(index_coding="golomb")))
    at, energy = [[] for _ in range(world)], [0.0] * world
    lead = 2 % world  # the leader rotates: worker t % W leads step t
    for _name, v, leader, _ in per_parameter(results[0], 0, DENSITY, leader=lead):
        for worker in range(world):
            at[worker].append(v[worker][leader])
            energy[worker] += float(v[worker].double().square().sum())
    values = torch.stack([torch.cat(parts) for parts in at])  # [W, K]
    r = [torch.corrcoef(values[[i, j]].double())[0, 1] for i in range(world) for j in range(i + 1, world)]
    shares = [float(values[w].double().square().sum()) / energy[w] for w in range(world) if w != lead]
    for result in results:  # gathered: the same on every rank
        assert result["premise"] == pytest.approx((float(sum(r) / len(r)), sum(shares) / len(shares)), rel=1e-5)
        # One measured step so far: the run's means are this step's.
        assert result["run_premise"] == pytest.approx(
            {"correlation": result["premise"][0], "energy_share": result["premise"][1], "steps": 1.0}
        )


def _linear_rar(rank: int, world: int) -> dict:
    model = DDP(_net(), bucket_cap_mb=0.01)
    state = LGCRingAllreduceState(
        density=DENSITY,
        stages=dict(warmup_steps=1, ae_steps=3),
        training=dict(
            codec="linear",
            autoencoder=dict(chunk=CHUNK, encoder_channels=[8, 8], decoder_channels=[8, 8], latent_channels=2),
        ),
        min_numel=MIN_NUMEL,
        measure_error=True,
    )
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        _step(model, step, optimizer)
    return {
        "stage": state.metrics()["lgc/stage"],
        "basis": state.autoencoder.basis.clone(),
        "true_error": state.summary_extras()["lgc"]["true_error"],
        "weights": state.summary_extras()["lgc"]["stages"]["autoencoder_weights"]["bytes_sent"],
    }


@pytest.mark.multiprocess
def test_lgc_rar_with_the_linear_codec_trains_ships_and_uses_one_basis():
    results = run_workers(_linear_rar, 2)
    assert all(r["stage"] == LGCStage.COMPRESSED for r in results)
    assert torch.equal(results[0]["basis"], results[1]["basis"])
    assert not torch.equal(results[0]["basis"], torch.eye(CHUNK)[:, : results[0]["basis"].shape[1]])
    # The basis (chunk x latent floats: 32 x the autoencoder's 2 channels x 32 / 2**2) is broadcast once from rank 0.
    assert results[0]["weights"] == 4 * CHUNK * 16
    assert 0.0 < results[0]["true_error"] < 1.0


def _stage_two_at_the_leader(rank: int, world: int) -> dict:
    """LGC-RAR's stage 2 with codec_samples="leader" beside shared-index float32, 2 warm-up + 4 steps each."""
    runs = {}
    for name in ("lgc", "shared"):
        model = DDP(_net(), bucket_cap_mb=0.01)
        common = dict(density=DENSITY, min_numel=MIN_NUMEL, leaders=dict(value_order="value"))
        if name == "lgc":
            ae = dict(chunk=CHUNK, encoder_channels=[8, 8], decoder_channels=[8, 8], latent_channels=2)
            training = dict(codec="linear", samples="leader", autoencoder=ae)
            state = LGCRingAllreduceState(stages=dict(warmup_steps=2, ae_steps=4), training=training, **common)
        else:
            state = SharedIndexState(stages=dict(warmup_steps=2), chunk=CHUNK, measure_error=True, **common)
        state.register(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(6):
            _step(model, step, optimizer)
        runs[name] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "residuals": {key: r.clone() for key, r in state.ef.residuals.items()},
            "stages": state.summary_extras()["lgc"]["stages"],
            "stage": state.stage,
            "metrics": state.metrics(),
        }
        if name == "lgc":
            runs[name]["samples"] = state.trainer.chunks
            runs[name]["k"] = sum(
                num_selected(p.numel(), DENSITY) for p in model.parameters() if p.numel() >= MIN_NUMEL
            )
    return runs


@pytest.mark.multiprocess
def test_codec_training_at_the_leader_runs_the_exact_exchange_and_learns_from_its_values():
    for rank, runs in enumerate(run_workers(_stage_two_at_the_leader, 2)):
        lgc, shared = runs["lgc"], runs["shared"]
        assert lgc["stage"] is LGCStage.AUTOENCODER_TRAINING and shared["stage"] is LGCStage.COMPRESSED
        # Stage 2 moves the model exactly as shared-index float32 at the same (rotating) leaders does.
        for a, b in zip(lgc["params"], shared["params"], strict=True):
            assert torch.equal(a, b)
        assert lgc["residuals"].keys() == shared["residuals"].keys()
        for key, residual in shared["residuals"].items():
            assert torch.equal(lgc["residuals"][key], residual), key
        # The same bytes, plus every worker's K values gathered at rank 0 once per step.
        k = lgc["k"]
        gathered = 0 if rank == 0 else 4 * 4 * k
        assert (
            lgc["stages"]["autoencoder_training"]["bytes_sent"]
            == shared["stages"]["compressed"]["bytes_sent"] + gathered
        )
        # The exact exchange is not the codec: no delivered error is measured in stage 2.
        assert "lgc/true_error" in shared["metrics"] and "lgc/true_error" not in lgc["metrics"]
        # Rank 0 logs the share of its corrected gradient's energy at the leader's positions.
        assert (0.0 < lgc["metrics"].get("lgc/leader_energy_share", -1) <= 1.0) == (rank == 0)
        if rank == 0:
            # Rank 0 holds 4 steps of [rows, workers, chunk] samples; each step's leader (worker
            # step % 2) divided its own chunks by their RMS: its slice has unit RMS in every row.
            rows = -(-k // CHUNK)
            samples = lgc["samples"]
            assert samples.shape == (4 * rows, 2, CHUNK)
            for i, step in enumerate(range(2, 6)):
                leader_rows = samples[i * rows : (i + 1) * rows, step % 2]
                torch.testing.assert_close(leader_rows.square().mean(dim=1), torch.ones(rows))
        else:
            assert "samples" not in lgc or lgc["samples"] is None


def test_codec_samples_are_named_and_lgc_ps_keeps_the_papers():
    with pytest.raises(ValueError, match="training.samples must be one of 'topk', 'leader'"):
        LGCRingAllreduceState(training={"samples": "exact"})
    with pytest.raises(ValueError, match="LGC-PS's codec trains on the paper's top-k samples only"):
        LGCParameterServerState(training={"samples": "leader"})
    with pytest.raises(ValueError, match="LGC-PS's codec trains on the paper's top-k samples only"):
        CodecTraining(CodecTrainingKnobs(samples="leader"), innovation_density=0.001)
    with pytest.raises(ValueError, match="training.codec='linear': LGC-PS decodes every worker with its own decoder"):
        LGCParameterServerState(training={"codec": "linear"})


# -- the PCA-initialised autoencoder -------------------------------------------------------------------


def _curved_chunks(samples: int, seed: int) -> torch.Tensor:
    """``[samples, 2 workers, 32]`` on a curve, (t, t^2) in 2 directions, that one principal direction cannot follow."""
    g = torch.Generator().manual_seed(seed)
    axes = torch.linalg.qr(torch.randn(32, 2, generator=torch.Generator().manual_seed(0))).Q.T
    t = 4 * torch.rand(samples, 1, 1, generator=g) - 2  # the workers agree (LGC's premise), up to noise
    curve = torch.cat([t, t.square() - 4 / 3], dim=-1) @ axes
    return curve.expand(samples, 2, 32) + 0.01 * torch.randn(samples, 2, 32, generator=g)


@pytest.mark.slow
def test_pca_autoencoder_is_the_linear_codec_until_its_correction_learns_and_then_beats_it():
    chunks = _curved_chunks(400, 0)
    options = dict(lr=3e-3, batch_size=64, seed=0, weights=LossWeights(similarity=0.0))
    trainer = PCAAutoencoderTrainer(PCAAutoencoder(PCAAutoencoderConfig(32, 1, hidden=32)), **options)
    linear = LinearCodecTrainer(LinearChunkCodec(32, 1))
    for t in (trainer, linear):
        t.add(chunks)
    linear.train(1)
    # Every call refits U to the buffer in closed form; with the corrections at zero it is the linear codec.
    codec = trainer.autoencoder
    trainer.autoencoder.linear.fit(trainer.chunks)
    x = chunks[:50, 0]
    torch.testing.assert_close(codec.encode(x), linear.autoencoder.encode(x), rtol=0, atol=0)
    torch.testing.assert_close(codec.decode(codec.encode(x)), linear.autoencoder.decode(linear.autoencoder.encode(x)))
    held_out = _curved_chunks(200, 1)
    pca_error = linear.evaluate(held_out)["relative_error"]
    assert trainer.evaluate(held_out)["relative_error"] == pytest.approx(pca_error, rel=1e-4)
    trainer.train(300)
    # U is fitted, never trained, on the buffer but its newest fifth, on which the corrections proved
    # themselves: they stay on.
    fitted_part = LinearChunkCodec(32, 1)
    fitted_part.fit(chunks[:-80])
    assert torch.equal(codec.linear.basis, fitted_part.basis) and codec.gate == 1
    assert trainer.evaluate(held_out)["relative_error"] < 0.5 * pca_error  # 0.54 -> below 0.27
    # Its state round-trips (the basis, the corrections, the optimizer and the draws).
    twin = PCAAutoencoderTrainer(PCAAutoencoder(PCAAutoencoderConfig(32, 1, hidden=32)), **options)
    twin.load_state_dict(trainer.state_dict())
    for a, b in zip(twin.autoencoder.parameters(), codec.parameters(), strict=True):
        assert torch.equal(a, b)
    # hidden=0: no correction, the linear codec exactly.
    plain = PCAAutoencoderTrainer(PCAAutoencoder(PCAAutoencoderConfig(32, 1, hidden=0)), **options)
    plain.add(chunks)
    assert plain.train(5)["relative_error"] == pytest.approx(linear.evaluate(chunks)["relative_error"], rel=1e-5)
    assert torch.equal(plain.autoencoder.linear.basis, linear.autoencoder.basis)
    with pytest.raises(ValueError, match="no innovation channel"):
        codec.decode(codec.encode(x), innovation=x)


def test_pca_autoencoder_drops_corrections_that_do_not_help_on_held_out_samples():
    """Workers' chunks on a line plus noise: nothing nonlinear to learn, so the corrections only fit noise."""
    g = torch.Generator().manual_seed(3)
    direction = torch.nn.functional.normalize(torch.randn(32, generator=g), dim=0)
    chunks = torch.randn(100, 1, 1, generator=g).expand(100, 2, 1) * direction + torch.randn(100, 2, 32, generator=g)
    options = dict(lr=1e-2, batch_size=16, seed=0, weights=LossWeights(similarity=0.0))
    trainer = PCAAutoencoderTrainer(PCAAutoencoder(PCAAutoencoderConfig(32, 1, hidden=64)), **options)
    trainer.add(chunks)
    trainer.train(100)
    linear = LinearChunkCodec(32, 1)
    linear.fit(chunks)
    codec = trainer.autoencoder
    # Gated off: the linear codec on every sample, exactly.
    assert codec.gate == 0 and torch.equal(codec.linear.basis, linear.basis)
    x = torch.randn(7, 32, generator=g)
    assert torch.equal(codec.decode(codec.encode(x)), linear.decode(linear.encode(x)))
    with pytest.raises(ValueError, match=r"validation must be in \(0, 1\), got 1"):
        PCAAutoencoderTrainer(PCAAutoencoder(PCAAutoencoderConfig(32, 1)), validation=1)
