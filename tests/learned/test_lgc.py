"""Learned Gradient Compression: the autoencoder, its training, the stages and both topologies."""

import copy
import io
import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc.autoencoder import (
    AutoencoderConfig,
    AutoencoderTrainer,
    GradientAutoencoder,
    chunk_scales,
    from_chunks,
    num_chunks,
    rar_losses,
    to_chunks,
)
from lgc.compressors.selection import topk_indices
from lgc.compressors.topk import num_selected
from lgc.learned.ps import LGCParameterServerState
from lgc.learned.rar import LGCRingAllreduceState
from lgc.learned.state import LGCStage

# -- the autoencoder -------------------------------------------------------------------------------


def test_latent_is_a_quarter_of_the_chunk_and_receptive_field_is_checked():
    config = AutoencoderConfig(chunk=64)
    assert config.receptive_field == 31 and config.latent_numel == 16
    ae = GradientAutoencoder(config)
    x = torch.randn(3, 64)
    assert ae.encode(x).shape == (3, 4, 4) and ae.decode(ae.encode(x)).shape == (3, 64)
    with pytest.raises(ValueError, match=r"chunk=16 is shorter than the encoder's receptive field \(31"):
        AutoencoderConfig(chunk=16)
    with pytest.raises(ValueError, match=r"chunk=40 must be a multiple of 2\*\*4 = 16"):
        AutoencoderConfig(chunk=40)
    # Every field checked by name; channels given as a list are the same layers as a tuple.
    listed = AutoencoderConfig(chunk=64, encoder_channels=[8, 16, 32, 8], decoder_channels=[4, 8, 16, 4])
    assert listed.encoder_channels == (8, 16, 32, 8) and listed.decoder_channels == (4, 8, 16, 4)
    for bad, named in (
        ({"encoder_channels": [0, -1]}, "autoencoder encoder_channels must be"),
        ({"latent_channels": 2.5}, "autoencoder latent_channels must be a positive integer, got 2.5"),
        ({"negative_slope": "x"}, "autoencoder negative_slope must be a finite number, got 'x'"),
        ({"seed": -1}, "autoencoder seed must be an integer in"),
    ):
        with pytest.raises(ValueError, match=named):
            AutoencoderConfig(chunk=64, **bad)
    # Same seed, same weights on every worker; the global generator is left alone.
    state = torch.random.get_rng_state()
    twin = GradientAutoencoder(config)
    assert torch.equal(torch.random.get_rng_state(), state)
    for a, b in zip(ae.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_width_sizes_the_reference_architecture_and_keeps_its_latent():
    state = LGCRingAllreduceState(training={"autoencoder": dict(chunk=64, width=0.125)}, world_size=2)
    config = state.ae_config
    assert config.encoder_channels == (8, 16, 32, 8) and config.decoder_channels == (4, 8, 16, 4)
    assert config.latent_numel == AutoencoderConfig(chunk=64).latent_numel
    reference = sum(p.numel() for p in GradientAutoencoder(AutoencoderConfig(chunk=64)).parameters())
    assert (sum(p.numel() for p in state.autoencoder.parameters()), reference) == (3569, 216677)
    for width in (0, -1, "wide", True):
        with pytest.raises(ValueError, match="autoencoder width must be a number in"):
            LGCRingAllreduceState(training={"autoencoder": dict(width=width)})


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["transposed", "upsample"])
def test_both_decoders_give_the_same_code_size_and_train(decoder):
    """The decoder's upsampling choice changes its cost (``lgc-bench step``), not the wire: the same latent."""
    config = AutoencoderConfig(
        chunk=32, encoder_channels=(8, 8), decoder_channels=(8, 8), latent_channels=2, decoder=decoder
    )
    ae = GradientAutoencoder(config)
    chunks = _correlated_chunks(256, 2, 32, noise=0.1, seed=0)
    assert ae.encode(chunks[:, 0]).shape == (256, 2, 8)
    assert ae.decode(ae.encode(chunks[:, 0])).shape == (256, 32)
    layers = [type(layer) for layer in ae.decoders[0].body]
    assert (nn.Upsample in layers) == (decoder == "upsample")
    assert (nn.ConvTranspose1d in layers) == (decoder == "transposed")
    trainer = AutoencoderTrainer(ae, seed=0, buffer_size=256)
    trainer.add(chunks)
    before = rar_losses(ae, chunks).total.item()
    trainer.train(200)
    assert rar_losses(ae, chunks).total.item() < 0.5 * before
    with pytest.raises(ValueError, match="decoder must be one of .* got 'bilinear'"):
        AutoencoderConfig(decoder="bilinear")


def test_chunks_round_trip_with_zero_padding():
    values = torch.arange(1.0, 151.0)
    chunks = to_chunks(values, 64)
    assert chunks.shape == (3, 64) and torch.all(chunks[2, 22:] == 0)
    assert torch.equal(from_chunks(chunks, 150), values)
    scales = chunk_scales(torch.cat([chunks, torch.zeros(1, 64)]))
    assert scales[-1] == 1.0 and torch.isclose(scales[0], values[:64].square().mean().sqrt())


def _correlated_chunks(samples: int, workers: int, chunk: int, noise: float, seed: int) -> torch.Tensor:
    """Aligned, value-sorted gradient chunks: a shared decreasing curve plus per-worker noise."""
    g = torch.Generator().manual_seed(seed)
    common = torch.sort(torch.randn(samples, 1, chunk, generator=g) * 2, dim=-1, descending=True).values
    chunks = common + noise * torch.randn(samples, workers, chunk, generator=g)
    return chunks / chunk_scales(common.squeeze(1))[:, None, None]


@pytest.mark.slow
def test_training_lowers_reconstruction_error_and_the_mean_latent_decodes_to_the_mean():
    """On correlated synthetic gradients (4 workers, noise 0.3 of the shared curve's scale).

    Before training the mean decode is useless (relative error ~1); after 100 Adam updates the
    decode of the mean latent is within 10 % (relative squared error) of the workers' mean on
    samples it never saw (measured 0.021; 0.017 after 400).
    """
    train = _correlated_chunks(512, 4, 64, 0.3, seed=0)
    held_out = _correlated_chunks(128, 4, 64, 0.3, seed=1)
    trainer = AutoencoderTrainer(GradientAutoencoder(AutoencoderConfig(chunk=64)), batch_size=64, seed=0)
    trainer.add(train)
    before = trainer.evaluate(held_out)
    trainer.train(100)
    after = trainer.evaluate(held_out)
    assert before["relative_error"] > 0.8
    assert after["relative_error"] < 0.1
    assert after["reconstruction"] < 0.2 * before["reconstruction"]
    # Directly: D(mean E(x_i)) against mean x_i.
    with torch.no_grad():
        ae = trainer.autoencoder
        latents = torch.stack([ae.encode(held_out[:, i]) for i in range(4)], dim=1)
        decoded = ae.decode(latents.mean(dim=1))
    target = held_out.mean(dim=1)
    assert float((decoded - target).square().sum() / target.square().sum()) < 0.1


def test_similarity_term_is_the_mean_pairwise_latent_distance():
    ae = GradientAutoencoder(AutoencoderConfig(chunk=64))
    chunks = torch.randn(5, 3, 64)
    losses = rar_losses(ae, chunks)
    with torch.no_grad():
        z = torch.stack([ae.encode(chunks[:, i]) for i in range(3)], dim=1)
    pairs = [torch.nn.functional.mse_loss(z[:, i], z[:, j]) for i in range(3) for j in range(3) if i != j]
    torch.testing.assert_close(losses.similarity, torch.stack(pairs).mean())


def test_trainer_resumes_exactly_and_pickles():
    import pickle

    data = _correlated_chunks(128, 2, 64, 0.3, seed=0)
    # Narrow layers (what is saved does not depend on the widths): the reference's take seconds a step.
    narrow = dict(chunk=64, encoder_channels=(8, 16, 32, 8), decoder_channels=(4, 8, 16, 4))
    straight = AutoencoderTrainer(GradientAutoencoder(AutoencoderConfig(**narrow)), buffer_size=100)
    straight.add(data)
    assert straight.num_samples == 100  # the oldest samples were dropped
    straight.train(2)
    resumed = AutoencoderTrainer(GradientAutoencoder(AutoencoderConfig(**narrow, seed=7)), buffer_size=100)
    resumed.load_state_dict(copy.deepcopy(straight.state_dict()))
    spawned = pickle.loads(pickle.dumps(straight))
    for trainer in (straight, resumed, spawned):
        trainer.train(2)  # Adam's moments and the step count carry over
    for other in (resumed, spawned):
        for a, b in zip(straight.autoencoder.parameters(), other.autoencoder.parameters(), strict=True):
            assert torch.equal(a, b)


# -- configuration errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(leaders=dict(rank=2, rotate=False), world_size=2), r"leaders.rank=2 is outside the world of 2 worker"),
        (dict(leaders=dict(rank=1)), r"leaders.rank=1 fixes the leader, but leaders.rotate=true"),
        (dict(training=dict(autoencoder=dict(chunk=16))), r"chunk=16 is shorter than the encoder's receptive field"),
        (dict(leaders=dict(value_order="random")), "leaders.value_order must be one of 'value', 'magnitude'"),
        (dict(stages=dict(warmup_steps=0)), "stages.warmup_steps must be a positive integer, got 0"),
        (dict(training=dict(codec="pca")), "training.codec must be one of 'autoencoder', 'linear', 'pca_autoencoder'"),
        (dict(latent_dtype="int4"), "latent_dtype must be one of"),
        (dict(latent_dtype="int8", world_size=128), r"latent_dtype='int8' cannot hold the sum of 128 workers"),
    ],
)
def test_bad_lgc_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LGCRingAllreduceState(**kwargs)


def test_a_group_given_whole_replaces_the_preset_and_a_mapping_changes_it():
    # LGC-PS's preset leader is the server; a mapping keeps that, a dataclass is taken as given.
    assert not LGCParameterServerState(leaders={"index_coding": "golomb"}).rotate_leader
    golomb = LGCParameterServerState.LEADERS.changed({"index_coding": "golomb"})
    state = LGCParameterServerState(leaders=golomb)
    assert (state.rotate_leader, state.index_coding) == (False, "golomb")
    assert LGCParameterServerState.LEADERS.index_coding == "raw"  # the preset is not changed
    # The autoencoder as its config, as a mapping or left to the preset: one shape.
    config = AutoencoderConfig(chunk=64)
    from_config = LGCRingAllreduceState(training={"autoencoder": config}).ae_config
    assert from_config.chunk == 64 and from_config == LGCRingAllreduceState().ae_config


def test_a_knob_a_group_lacks_is_named_with_the_groups_knobs():
    with pytest.raises(TypeError, match="stages has no knob 'warmup_stepz'; its knobs: warmup_steps, warmup,"):
        LGCRingAllreduceState(stages={"warmup_stepz": 1})
    with pytest.raises(TypeError, match=r"leaders must be a LeaderChoice or a mapping of its fields, got 3"):
        LGCRingAllreduceState(leaders=3)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["rar", pytest.param("ps", marks=pytest.mark.slow)])
def test_one_worker_goes_through_every_stage(variant):
    """A group of one (as lgc-bench profiles a method alone): no correlation between workers to log."""
    ((result),) = run_workers(_stages_and_bytes, 1, variant, {})
    assert [entry["lgc/stage"] for entry in result["log"]] == [1, 1, 2, 2, 2, 2] + [3] * 6
    assert not any("lgc/leader_correlation" in entry for entry in result["log"])


def test_int8_latents_are_lgc_rars_alone():
    with pytest.raises(ValueError, match="LGC-PS's server receives every worker's own latent"):
        LGCParameterServerState(latent_dtype="int8")


def test_innovation_must_be_sparser_than_the_leaders_selection():
    with pytest.raises(ValueError, match=r"innovation_density must be in \(0, density=0.001\), got 0.001"):
        LGCParameterServerState(density=0.001, innovation_density=0.001)


def test_stage_schedule_and_a_run_too_short_for_a_compressed_stage():
    state = LGCRingAllreduceState(stages={"warmup_steps": 3, "ae_steps": 4})
    assert [state.stage_at(s) for s in (0, 2, 3, 6, 7, 100)] == [
        LGCStage.WARMUP,
        LGCStage.WARMUP,
        LGCStage.AUTOENCODER_TRAINING,
        LGCStage.AUTOENCODER_TRAINING,
        LGCStage.COMPRESSED,
        LGCStage.COMPRESSED,
    ]
    state.check_total_steps(8)
    with pytest.raises(ValueError, match=r"stages.warmup_steps=3 \+ stages.ae_steps=4 >= the run's 7 optimizer steps"):
        state.check_total_steps(7)


# -- two gloo workers ------------------------------------------------------------------------------

MIN_NUMEL = 100


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 32, generator=g)
    return x, torch.sin(x[:, :8]) + 0.1 * x[:, 8:16]


_LGC_AE = dict(chunk=32, encoder_channels=[8, 8], decoder_channels=[8, 8], latent_channels=2)


def _lgc_state(variant: str, *, stages: dict | None = None, training: dict | None = None, **kwargs):
    """A small LGC state of ``variant``; ``stages`` and ``training`` change those groups' fields."""
    stages = {"warmup_steps": 2, "ae_steps": 4, **(stages or {})}
    training = {"updates_per_step": 2, "autoencoder": dict(_LGC_AE), "batch_size": 16, **(training or {})}
    common = dict(density=0.05, min_numel=MIN_NUMEL, stages=stages, training=training)
    if variant == "ps":
        return LGCParameterServerState(**{"innovation_density": 0.01, **common, **kwargs})
    if variant == "rar_int8":  # int8 latents: stochastic rounding that a resumed run must repeat
        common["latent_dtype"] = "int8"
    if variant == "rar_leader":  # stage 2 runs the exact exchange at the leader's positions
        training["samples"] = "leader"
    if variant == "rar_linear":  # the linear codec: refitted in closed form at every stage-2 step
        training["codec"] = "linear"
    if variant == "rar_pca":  # the PCA-initialised autoencoder: a refitted basis, Adam on the correction
        training.update(codec="pca_autoencoder", pca_hidden=8)
    return LGCRingAllreduceState(**{**common, **kwargs})


def _train(model: DDP, state, steps: int, first_step: int = 0, optimizer=None) -> list[dict]:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    log = []
    for step in range(first_step, first_step + steps):
        x, y = _batch(step, dist.get_rank())
        optimizer.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        log.append({"loss": loss.item(), "sent": state.stats.bytes_sent, **state.metrics()})
    return log


def _stages_and_bytes(rank: int, world: int, variant: str, kwargs: dict) -> dict:
    model = DDP(_net(), bucket_cap_mb=100)  # one bucket: byte counts are easy to predict
    state = _lgc_state(variant, **kwargs)
    state.register(model)
    log = _train(model, state, 12)
    return {
        "log": log,
        "numels": [p.numel() for p in model.parameters()],
        "extras": state.summary_extras(),
        "stats": state.stats.as_dict(),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["rar", pytest.param("ps", marks=pytest.mark.slow)])
def test_stages_switch_at_the_configured_steps_and_bytes_match_the_payloads(variant):
    results = run_workers(_stages_and_bytes, 2, variant, {})
    for rank, result in enumerate(results):
        log = result["log"]
        assert [entry["lgc/stage"] for entry in log] == [1, 1, 2, 2, 2, 2] + [3] * 6
        assert "lgc/ae_loss" in log[-1] if rank == 0 else "lgc/ae_loss" not in log[-1]
        assert all(math.isfinite(entry["loss"]) for entry in log)
        # Rank 0 watches the codec's data in stage 2: the workers' agreement at the leader's positions,
        # and (LGC-RAR's autoencoder) PCA of its latent size scored like it, from the second step on.
        if rank == 0:
            assert all(-1.0 <= entry["lgc/leader_correlation"] <= 1.0 for entry in log[2:6])
            # Rank 0's share of its gradient energy at the leader's positions; a fixed leader is rank 0
            # itself (its own top-k: a large share), LGC-RAR's rotates (rank 1's top-k on odd steps).
            shares = [entry["lgc/leader_energy_share"] for entry in log[2:6]]
            assert all(0.0 < share <= 1.0 for share in shares)
            if variant == "ps":  # the server leads: rank 0's own top-k always holds more than 5 % of the entries do
                assert min(shares) > 0.05
            assert ("lgc/pca_recon_error" in log[3]) == (variant == "rar") and "lgc/pca_recon_error" not in log[2]
        else:
            assert not any("lgc/leader_correlation" in entry or "lgc/leader_energy_share" in entry for entry in log)
        numels = result["numels"]
        dense = sum(n for n in numels if n < MIN_NUMEL)
        compressed = [n for n in numels if n >= MIN_NUMEL]
        k = sum(num_selected(n, 0.05) for n in compressed)
        rows = -(-k // 32)  # chunks of 32 values; the latent holds 2 channels x 8 positions per chunk
        stages = result["extras"]["lgc"]["stages"]
        # Every step starts with the step guard: one byte per parameter and the non-finite flag.
        guard = 1 + len(numels)
        assert "skipped" not in stages
        # Warm-up: 2 dense allreduces of the whole bucket.
        assert stages["warmup"]["bytes_sent"] == 2 * (4 * sum(numels) + guard)
        # Stage 2: top-k allgather (8 bytes per entry) + dense allreduce + the sample gather to rank 0.
        per_step = 8 * k + 4 * dense + (0 if rank == 0 else 4 * k) + guard
        if variant == "ps":
            per_step += 0 if rank == 0 else -(-k // 8)  # the innovation mask, one bit per value
        assert stages["autoencoder_training"]["bytes_sent"] == 4 * per_step
        if variant == "rar":
            # Stage 3: the latent (fp32) and the dense part in one allreduce; the step's leader
            # (rotating by default: each of the 2 workers leads 3 of the 6 steps) broadcasts its
            # scales and raw positions, which the other receives.
            latent = 4 * rows * 16
            leader = 4 * rows + 4 * k
            assert stages["compressed"]["bytes_sent"] == 6 * (latent + 4 * dense + guard) + 3 * leader
            assert stages["compressed"]["bytes_received"] == 6 * (latent + 4 * dense + guard) + 3 * leader
            small = AutoencoderConfig(chunk=32, encoder_channels=(8, 8), decoder_channels=(8, 8), latent_channels=2)
            weights = sum(p.numel() for p in GradientAutoencoder(small).parameters())
        else:
            innovation = 8 * sum(num_selected(n, 0.01) for n in compressed)
            # Upstream: every worker's innovation, and the leader's scales, latent and raw positions.
            # Rank 0 hosts the server: its own messages to it count logically but not on the wire.
            leader = 4 * rows + 4 * rows * 16 + 4 * k
            upstream = 4 * dense + guard + innovation + (leader if rank == 0 else 0)
            compressed_stats = stages["compressed"]
            assert compressed_stats["bytes_sent"] - compressed_stats["server_bytes_sent"] == 6 * upstream
            wire_upstream = compressed_stats["wire_bytes_sent"] - compressed_stats["wire_server_bytes_sent"]
            assert wire_upstream == 6 * (4 * dense + guard + (0 if rank == 0 else innovation))
            server_sent = compressed_stats["server_bytes_sent"]
            assert server_sent > 0 if rank == 0 else server_sent == 0
            weights = 0  # the leader is the server: no encoder weights travel
        sent_weights = stages.get("autoencoder_weights", {"bytes_sent": 0})["bytes_sent"]
        assert sent_weights == (4 * weights if rank == 0 else 0)


def _converges(rank: int, world: int, variant: str) -> dict:
    model = DDP(_net(), bucket_cap_mb=0.01)
    if variant == "dense":
        state = None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(120):
            x, y = _batch(step, rank)
            optimizer.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return {"losses": losses}
    state = _lgc_state(variant, stages=dict(warmup_steps=10, ae_steps=30), training=dict(updates_per_step=4))
    state.register(model)
    log = _train(model, state, 120)
    params = [p.detach().clone() for p in model.parameters()]
    return {"losses": [entry["loss"] for entry in log], "params": params, "metrics": state.metrics()}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["rar", "ps"])
def test_lgc_trains_a_small_network_close_to_dense(variant):
    """120 steps (10 warm-up, 30 autoencoder training, 80 compressed), two workers, several buckets.

    The small autoencoder of these tests reconstructs poorly (relative error ~0.8), so this checks
    that the machinery trains, not LGC's quality: the final loss (mean of the last 20 steps) must
    be within 2x of dense SGD's (measured: top-k with error feedback 1.19x, LGC-RAR 1.47x, LGC-PS
    1.71x), and every rank must hold the same parameters (the decoded update is identical everywhere).
    """
    dense = run_workers(_converges, 2, "dense")[0]["losses"]
    r0, r1 = run_workers(_converges, 2, variant)
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)
    final = sum(r0["losses"][-20:]) / 20
    dense_final = sum(dense[-20:]) / 20
    assert final < 0.5 * r0["losses"][0]
    assert final < 2.0 * dense_final, f"{variant}: {final:.4f} vs dense {dense_final:.4f}"


# -- the compressed stage's plumbing, exactly: an identity "autoencoder" ------------------------------


def _identity_autoencoder(state) -> None:
    """Make the latent the (scaled) chunk itself: decoding then gives the values back."""
    ae = state.autoencoder
    ae.encode = lambda chunks: chunks.unsqueeze(1)
    ae.decode = lambda latent, innovation=None, decoder=0: latent.squeeze(1)
    ae.latent_shape = lambda rows: (rows, 1, state.ae_config.chunk)


#: The identity code's shape (the test replaces its weights).
_IDENTITY_SHAPE = dict(chunk=32, encoder_channels=[8, 8], decoder_channels=[8, 8], latent_channels=2)


def _compressed_steps(
    rank: int, world: int, variant: str, index_coding: str, rotate_leader: bool, steps: int, extra: dict | None = None
) -> list:
    """``steps`` compressed steps of LGC with an identity code, each observed (:func:`observe_step`)."""
    cls = LGCRingAllreduceState if variant == "rar" else LGCParameterServerState
    kwargs = dict(density=0.05, stages=dict(warmup_steps=1, ae_steps=1), min_numel=MIN_NUMEL)
    extra = dict(extra or {})
    bucket_cap_mb = extra.pop("bucket_cap_mb", 0.01)
    kwargs.update(leaders=dict(index_coding=index_coding, value_order="value", rotate=rotate_leader), **extra)
    kwargs["training"] = dict(updates_per_step=0, autoencoder=_IDENTITY_SHAPE)
    if variant == "ps":
        kwargs["innovation_density"] = 0.01
    model = DDP(_net(), bucket_cap_mb=bucket_cap_mb)
    state = cls(**kwargs)
    state.register(model)
    _identity_autoencoder(state)
    _train(model, state, 2)  # warm-up, then autoencoder training (which fills the residuals)
    observed = []
    for step in range(2, 2 + steps):
        before = state.stats.as_dict()
        observed.append(observe_step(model, state, step, rank, world))
        observed[-1]["payload_bytes"] = state.stats.as_dict()["payload_bytes"] - before["payload_bytes"]
        torch.optim.SGD(model.parameters(), lr=0.05).step()
    return observed


def observe_step(model: DDP, state, step: int, rank: int, world: int) -> dict:
    """Run ``step`` (forward and backward only) and return what every worker had going in and what came out.

    ``everyone`` holds every worker's residuals before the step and its local (unsynchronized)
    gradients, so tests can compute the exact ``v = residual + g / N`` of each worker.
    """
    residuals = {name: r.clone() for name, r in state.ef.residuals.items()}
    local = copy.deepcopy(model.module)
    x, y = _batch(step, rank)
    (local(x) - y).square().mean().backward()
    local_grads = {name: p.grad.reshape(-1).clone() for name, p in local.named_parameters()}
    model.zero_grad()
    (model(x) - y).square().mean().backward()
    everyone = [None] * world
    dist.all_gather_object(everyone, (residuals, local_grads))
    return {
        "stage": state.metrics()["lgc/stage"],
        "names": [name for name, _ in model.module.named_parameters()],
        "everyone": everyone,
        "grads": {name: p.grad.reshape(-1).clone() for name, p in model.module.named_parameters()},
        "residuals_after": {name: r.clone() for name, r in state.ef.residuals.items()},
    }


def per_parameter(result: dict, rank: int, density: float, leader: int = 0):
    """Per compressed parameter of an :func:`observe_step` result: its name, every worker's ``v``,
    the leader's top-k positions and this worker's ``v``. Dense parameters are checked here to
    arrive as the workers' mean."""
    everyone, world = result["everyone"], len(result["everyone"])
    for name in result["names"]:
        grads = [g[name] for _, g in everyone]
        if grads[0].numel() < MIN_NUMEL:
            torch.testing.assert_close(result["grads"][name], sum(grads) / world)
            continue
        v = [r[name] + g[name] / world for r, g in everyone]
        yield name, v, topk_indices(v[leader], num_selected(v[leader].numel(), density)), v[rank]


def _check_compressed_step(variant: str, result: dict, rank: int, leader_rank: int) -> None:
    """One observed compressed step of :func:`_compressed_steps` against what the identity code must deliver."""
    assert result["stage"] == LGCStage.COMPRESSED
    for name, v, leader, own in per_parameter(result, rank, 0.05, leader=leader_rank):
        expected = torch.zeros_like(own)
        cleared = own.clone()
        cleared[leader] = 0.0
        if variant == "rar":
            expected[leader] = sum(vj[leader] for vj in v)
        else:
            for vj in v:
                innovation = topk_indices(vj, num_selected(vj.numel(), 0.01))
                estimate = torch.zeros_like(vj)
                estimate[leader] = v[leader_rank][leader]
                estimate[innovation] = vj[innovation]
                expected += estimate
            cleared[topk_indices(own, num_selected(own.numel(), 0.01))] = 0.0
        torch.testing.assert_close(result["grads"][name], expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(result["residuals_after"][name], cleared, rtol=1e-5, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "variant,index_coding",
    [
        ("ps", "raw"),
        ("rar", "golomb"),
        pytest.param("rar", "raw", marks=pytest.mark.slow),
        pytest.param("ps", "golomb", marks=pytest.mark.slow),
    ],
)
def test_compressed_stage_delivers_exactly_what_its_code_carries(variant, index_coding):
    """With an identity code the compressed stage must deliver, exactly:

    * LGC-RAR: at the leader's top-k positions of ``v = residual + g / N`` the sum of every
      worker's ``v``, zero elsewhere, the dense parameters' mean; residuals cleared at those positions;
    * LGC-PS: at the leader's positions, for every worker, the leader's value (the decoder's input)
      replaced by the worker's own where its innovation knows it; plus the innovations outside.
    """
    for rank, (result,) in enumerate(run_workers(_compressed_steps, 2, variant, index_coding, False, 1)):
        _check_compressed_step(variant, result, rank, leader_rank=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["rar", pytest.param("ps", marks=pytest.mark.slow)])
def test_a_rotating_leader_hands_the_positions_to_every_worker_in_turn(variant):
    """``rotate_leader``: step ``t``'s positions are worker ``t % P``'s top-k, for both topologies.

    Three workers, three compressed steps (steps 2, 3, 4: leaders 2, 0, 1), each checked exactly as
    with a fixed leader. LGC-PS: the server decodes whichever worker leads (its decoders were trained
    with a random worker's latent standing in for the leader's) and the leader's message reaches it
    from that worker, point to point (nothing travels when the server itself leads).
    """
    for rank, observed in enumerate(run_workers(_compressed_steps, 3, variant, "golomb", True, 3)):
        for step, result in enumerate(observed, start=2):
            _check_compressed_step(variant, result, rank, leader_rank=step % 3)


@pytest.mark.multiprocess
def test_int8_latents_deliver_the_sum_within_the_workers_rounding_steps_and_count_their_scales():
    """``latent_dtype="int8"`` with an identity code: each worker's latent (its scaled values) rounded to
    ``m = 255 // (2P)`` levels of a per-chunk scale shared by the workers, the codes summed in 8-bit lanes.

    The delivered sum is within ``P`` rounding steps of the exact sum (a step: the chunk's largest
    magnitude over the workers over ``m``), not exact; each worker keeps its own rounding error as its
    residual; the payload is one byte per latent value and 4 bytes per chunk's scale.
    """
    world = 3
    levels = 255 // (2 * world)
    one_bucket = {"latent_dtype": "int8", "bucket_cap_mb": 100}
    results = run_workers(_compressed_steps, world, "rar", "raw", False, 1, one_bucket)
    for rank, (result,) in enumerate(results):
        assert result["stage"] == LGCStage.COMPRESSED
        # Chunks run across the parameters (in the leader's value order): the largest value anywhere bounds a step.
        parameters = list(per_parameter(result, rank, 0.05))
        largest = max(float(vj[leader].abs().max()) for _, v, leader, _ in parameters for vj in v)
        compressed_k = 0
        for name, v, leader, _own in parameters:
            exact = sum(vj[leader] for vj in v)
            error = (result["grads"][name][leader] - exact).abs()
            assert float(error.max()) <= world * largest / levels * (1 + 1e-5)
            # Its own rounding error stays with each worker, at most one step.
            residual = result["residuals_after"][name][leader]
            assert float(residual.abs().max()) <= largest / levels * (1 + 1e-5)
            compressed_k += leader.numel()
        assert any(float(r.abs().max()) > 0 for r in result["residuals_after"].values())
        # One bucket: the identity code's latent is one int8 code per value of every chunk, plus each
        # chunk's shared scale (4 bytes, in the allreduce-max); the leader also sends its positions
        # (raw, 4 bytes each) and its chunk scales.
        rows = num_chunks(compressed_k, 32)
        leader_message = 4 * compressed_k + 4 * rows if rank == 0 else 0
        assert result["payload_bytes"] == rows * 32 + 4 * rows + leader_message


def _decode_calls(rank: int, world: int, kwargs: dict) -> list[int]:
    stages = dict(warmup_steps=1, ae_steps=1, **kwargs.pop("stages", {}))
    kwargs = dict(density=0.05, stages=stages, min_numel=MIN_NUMEL, **kwargs)
    kwargs["training"] = dict(updates_per_step=0, autoencoder=_IDENTITY_SHAPE)
    model = DDP(_net(), bucket_cap_mb=100)  # one bucket
    state = LGCRingAllreduceState(**kwargs)
    state.register(model)
    _identity_autoencoder(state)
    _train(model, state, 2)
    rows: list[int] = []
    decode = state.autoencoder.decode
    state.autoencoder.decode = lambda latent, *a, **k: rows.append(latent.shape[0]) or decode(latent, *a, **k)
    _train(model, state, 1, first_step=2)
    k = sum(num_selected(p.numel(), 0.05) for p in model.parameters() if p.numel() >= MIN_NUMEL)
    return [*rows, num_chunks(k, state.ae_config.chunk)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({}, ["2r"]),  # own reconstruction and the mean: one call of both
        pytest.param({"residual": "zero"}, ["r"], marks=pytest.mark.slow),  # the mean only
        ({"stages": {"refresh_threshold": 10.0}}, ["r", "r"]),  # the own error rides in the allreduce: decoded first
    ],
)
def test_lgc_rar_decodes_once_per_bucket_unless_the_refresh_needs_its_error_first(kwargs, expected):
    """The decoder is LGC-RAR's largest cost, so it runs once per bucket where it can."""
    for result in run_workers(_decode_calls, 2, kwargs):
        *calls, rows = result
        assert calls == [{"r": rows, "2r": 2 * rows}[name] for name in expected]


def _trained_codec(rank: int, world: int, path: str) -> dict:
    model = DDP(_net(), bucket_cap_mb=100)
    state = _lgc_state("rar")
    state.register(model)
    _train(model, state, 8)  # warm-up 2, codec training 4, then compressed
    saved = state.save_codec(path) if rank == 0 else None
    return {"saved": str(saved), "weights": {k: v.clone() for k, v in state.autoencoder.state_dict().items()}}


def _warm_started(rank: int, world: int, path: str) -> dict:
    model = DDP(_net(), bucket_cap_mb=100)
    state = _lgc_state("rar", stages={"ae_steps": 0}, training={"autoencoder": dict(_LGC_AE, init=path)})
    state.register(model)
    log = _train(model, state, 5)
    return {
        "stages": [entry["lgc/stage"] for entry in log],
        "weights": {k: v.clone() for k, v in state.autoencoder.state_dict().items()},
        "booked": sorted(state.stage_stats),
        "describe": state.describe(),
    }


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_saved_codec_warm_starts_another_run_without_its_training_stage(tmp_path):
    """``training.autoencoder.init``: the saved weights on every worker, stage 2 skipped, nothing broadcast."""
    path = str(tmp_path / "codec.pt")
    trained = run_workers(_trained_codec, 2, path)
    assert trained[0]["saved"] == path
    for result in run_workers(_warm_started, 2, path):
        assert result["stages"] == [LGCStage.WARMUP] * 2 + [LGCStage.COMPRESSED] * 3
        for name, tensor in trained[0]["weights"].items():
            assert torch.equal(result["weights"][name], tensor), name
        assert "autoencoder_weights" not in result["booked"] and "autoencoder_training" not in result["booked"]
        assert f"init={path}" in result["describe"]


def test_a_missing_or_misfitting_codec_is_refused_before_training(tmp_path):
    from lgc.autoencoder.saved import save_codec

    with pytest.raises(FileNotFoundError, match="autoencoder.init='.*nowhere.pt': no such file"):
        _lgc_state("rar", training={"autoencoder": dict(_LGC_AE, init=str(tmp_path / "nowhere.pt"))})
    (tmp_path / "junk.pt").write_bytes(b"not a codec")
    with pytest.raises(ValueError, match="is not a saved lgc codec"):
        _lgc_state("rar", training={"autoencoder": dict(_LGC_AE, init=str(tmp_path / "junk.pt"))})
    other = GradientAutoencoder(
        AutoencoderConfig(chunk=64, encoder_channels=(8, 8), decoder_channels=(8, 8), latent_channels=2)
    )
    save_codec(other, tmp_path / "chunk64.pt")
    with pytest.raises(ValueError, match="does not fit this run's codec .*chunk: saved 64, this run 32"):
        _lgc_state("rar", world_size=2, training={"autoencoder": dict(_LGC_AE, init=str(tmp_path / "chunk64.pt"))})
    with pytest.raises(ValueError, match="stages.ae_steps must be at least 1 for a codec that trains, got 0"):
        _lgc_state("rar", stages={"ae_steps": 0})  # only a warm-started codec may skip its training


# -- resume -------------------------------------------------------------------------------------------


def _resume(rank: int, world: int, variant: str, stop: int) -> dict:
    """12 steps straight, and the same with a stop after ``stop`` steps and a restore into new objects."""
    total = 12  # warm-up steps 0-1, autoencoder training 2-5, compressed 6-11

    def fresh():
        model = DDP(_net(), bucket_cap_mb=0.01)
        state = _lgc_state(variant, leaders={"rotate": True})
        state.register(model)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, state, optimizer = fresh()
    _train(model, state, total, optimizer=optimizer)
    straight = (model, state)

    model, state, optimizer = fresh()
    _train(model, state, stop, optimizer=optimizer)
    # Through bytes, as a checkpoint file would be.
    blob = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "opt": optimizer.state_dict(), "lgc": state.state_dict()}, blob)
    saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=False)
    stopped = {"stage": state.stage, "buffer": state.trainer.num_samples}
    model, state, optimizer = fresh()
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["opt"])
    state.load_state_dict(saved["lgc"])
    _train(model, state, total - stop, first_step=stop, optimizer=optimizer)

    def snapshot(model, state) -> dict:
        return {
            "params": [p.detach().clone() for p in model.parameters()],
            "autoencoder": [p.detach().clone() for p in state.autoencoder.parameters()],
            "residuals": {k: v.clone() for k, v in state.ef.residuals.items()},
            "stats": state.stats.as_dict(),
            "stage": state.stage,
            "iteration": state.iteration,
        }

    return {"straight": snapshot(*straight), "resumed": snapshot(model, state), "stopped": stopped}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("variant", "stop"),
    [
        ("rar", 4),
        pytest.param("rar", 8, marks=pytest.mark.slow),
        ("ps", 8),
        # The rest with -m slow: LGC-RAR's stage 3 and LGC-PS's stage 2 (each the other's), the codec
        # variants (they differ from LGC-RAR mostly in the compressed stage), the rotating leader.
        pytest.param("ps", 4, marks=pytest.mark.slow),
        *[pytest.param(variant, 8, marks=pytest.mark.slow) for variant in ("rar_int8", "rar_linear", "rar_pca")],
        *[pytest.param(variant, 4, marks=pytest.mark.slow) for variant in ("rar_int8", "rar_linear", "rar_pca")],
        pytest.param("rar_leader", 4, marks=pytest.mark.slow),
    ],
    ids=lambda value: {4: "in stage 2", 8: "in stage 3"}.get(value, value),
)
def test_resume_in_the_middle_of_a_stage_continues_exactly(variant, stop):
    for rank, result in enumerate(run_workers(_resume, 2, variant, stop)):
        straight, resumed = result["straight"], result["resumed"]
        expected_stage = LGCStage.AUTOENCODER_TRAINING if stop == 4 else LGCStage.COMPRESSED
        assert result["stopped"]["stage"] == expected_stage
        # Rank 0 trains the autoencoder: its sample buffer is in the checkpoint (2 steps of samples
        # in stage 2, everything in stage 3); the other ranks never hold one.
        assert (result["stopped"]["buffer"] > 0) == (rank == 0)
        assert resumed["stage"] == straight["stage"] == LGCStage.COMPRESSED
        assert resumed["iteration"] == straight["iteration"] == 12
        for name in ("params", "autoencoder"):
            for a, b in zip(straight[name], resumed[name], strict=True):
                assert torch.equal(a, b), name
        # Bytes continue exactly; hook calls need not: a new DDP model's first step runs on DDP's
        # initial buckets, which can be fewer than its rebuilt ones (the bytes are the same).
        hook_calls = (straight["stats"].pop("hook_calls"), resumed["stats"].pop("hook_calls"))
        assert abs(hook_calls[0] - hook_calls[1]) <= 2
        assert resumed["stats"] == straight["stats"]
        assert straight["residuals"].keys() == resumed["residuals"].keys()
        for key, residual in straight["residuals"].items():
            assert torch.equal(residual, resumed["residuals"][key]), key
