"""The pure parts of LGC's hook state, one at a time: schedule, leaders, leader's code, plan, bytes, training.

Each part is checked without workers: its invariants (a round trip, a boundary, a count) and its
refusals. The whole state runs on workers in ``test_lgc.py`` and ``test_shared_index.py``.
"""

import math

import pytest
import torch

from lgc.autoencoder import AutoencoderTrainer, GradientAutoencoder
from lgc.autoencoder.linear import LinearChunkCodec, LinearCodecTrainer
from lgc.coding import golomb_encode, packed_nbytes
from lgc.compressors.segment_topk import segment_topk
from lgc.ddp.collectives import CommStats
from lgc.ddp.exchange import Segment
from lgc.ddp.step_guard import PendingBucket
from lgc.learned.byte_book import StageByteBook
from lgc.learned.knobs import CodecTrainingKnobs, Stages
from lgc.learned.leader_code import LeaderIndexCodec, order_bits
from lgc.learned.plan import plan_step
from lgc.learned.samples import mean_pairwise_correlation
from lgc.learned.schedule import LGCStage, StageSchedule
from lgc.learned.step import Leaders
from lgc.learned.training import ChunkCodec, CodecTrainer, CodecTraining

W, T, C = LGCStage.WARMUP, LGCStage.AUTOENCODER_TRAINING, LGCStage.COMPRESSED


def _schedule(*, density: float = 0.001, min_ae_steps: int = 1, **stages) -> StageSchedule:
    """A schedule of the given stage knobs (the rest at :class:`Stages`' defaults)."""
    return StageSchedule(Stages(**stages), density=density, min_ae_steps=min_ae_steps)


# -- the schedule -------------------------------------------------------------------------------------


def _run(schedule: StageSchedule, steps: range, errors: dict[int, float]) -> list[LGCStage]:
    """The stages of ``steps``, each compressed step recording ``errors.get(step)`` (if any) for the next."""
    stages, stage = [], W
    for step in steps:
        stage = schedule.begin(step, stage)
        stages.append(stage)
        if stage is C and step in errors:
            schedule.record_error(errors[step], 10)
    return stages


def test_the_workers_correlation_is_pearsons_r_averaged_over_pairs():
    x = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert float(mean_pairwise_correlation(torch.stack([x, 2 * x + 1]))) == pytest.approx(1.0)
    assert float(mean_pairwise_correlation(torch.stack([x, -x]))) == pytest.approx(-1.0)
    # Three workers: pairs (x, x) 1, (x, -x) -1, (x, -x) -1.
    assert float(mean_pairwise_correlation(torch.stack([x, x, -x]))) == pytest.approx(-1 / 3)
    assert float(mean_pairwise_correlation(torch.stack([x, torch.ones(4)]))) == 0.0  # constant: 0, not NaN
    batched = mean_pairwise_correlation(torch.stack([torch.stack([x, x]), torch.stack([x, -x])]))
    assert batched.tolist() == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError, match="at least 2"):
        mean_pairwise_correlation(x[None])


def test_the_stages_follow_their_lengths():
    schedule = _schedule(warmup_steps=2, ae_steps=3)
    assert [schedule.stage_at(step) for step in range(7)] == [W, W, T, T, T, C, C]
    assert _run(schedule, range(7), {}) == [W, W, T, T, T, C, C]


def test_a_refresh_follows_patience_strikes_lasts_refresh_steps_and_counts_once():
    schedule = _schedule(warmup_steps=1, ae_steps=2, refresh_threshold=0.5, refresh_patience=2, refresh_steps=3)
    # Compressed from step 3; steps 3 and 4 exceed the threshold (two strikes), so step 5 starts a refresh.
    stages = _run(schedule, range(12), {3: 0.9, 4: 0.8, 8: 0.9, 9: 0.1, 10: 0.9})
    assert stages == [W, T, T, C, C, T, T, T, C, C, C, C]
    # A good step (9) clears the strikes: 8 and 10 do not add up to a second refresh.
    assert schedule.refreshes == 1 and schedule.refresh_strikes == 1


def test_the_step_error_is_weighted_by_values_and_cleared_at_every_step():
    schedule = _schedule(warmup_steps=1, ae_steps=1, refresh_threshold=0.5, refresh_patience=1)
    schedule.begin(2, C)
    schedule.record_error(1.0, 1)  # 1 value far off ...
    schedule.record_error(0.0, 9)  # ... and 9 exact: 0.1 < 0.5, no strike
    assert schedule.begin(3, C) is C and schedule.step_error == [0.0, 0.0]
    schedule.record_error(0.6, 5)
    assert schedule.begin(4, C) is T


def test_a_restored_schedule_decides_as_the_original_would():
    errors = {step: 0.9 for step in range(3, 30)}
    straight = _schedule(warmup_steps=1, ae_steps=2, refresh_threshold=0.5, refresh_patience=3)
    expected = _run(straight, range(20), errors)
    first = _schedule(warmup_steps=1, ae_steps=2, refresh_threshold=0.5, refresh_patience=3)
    head = _run(first, range(7), errors)  # stopped with two strikes recorded and one step's error pending
    resumed = _schedule(warmup_steps=1, ae_steps=2, refresh_threshold=0.5, refresh_patience=3)
    resumed.load_state_dict(first.state_dict())
    stage, tail = head[-1], []
    for step in range(7, 20):
        stage = resumed.begin(step, stage)
        tail.append(stage)
        if stage is C:
            resumed.record_error(errors[step], 10)
    assert head + tail == expected and T in expected[5:]


def test_the_dgc_warmup_spreads_its_densities_evenly_and_never_below_the_density():
    schedule = _schedule(warmup_steps=8, ae_steps=1, warmup="dgc", warmup_densities=[0.5, 0.1, 0.001], density=0.01)
    # 3 phases over 8 steps: steps 0-2, 3-5, 6-7; the last phase's 0.001 is floored at 0.01.
    assert [schedule.warmup_density(step) for step in range(8)] == [0.5] * 3 + [0.1] * 3 + [0.01] * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(warmup_steps=0, ae_steps=1), "stages.warmup_steps must be a positive integer, got 0"),
        (dict(warmup_steps=1, ae_steps=0), "stages.ae_steps must be at least 1 for a codec that trains, got 0"),
        (dict(warmup_steps=1, ae_steps=1, warmup="cosine"), "stages.warmup must be one of 'dense', 'dgc'"),
        (
            dict(warmup_steps=1, ae_steps=1, warmup_densities=[0.5, 0.0]),
            r"stages.warmup_densities must be a list of number in \(0, 1\], got \(0.5, 0.0\)",
        ),
        (
            dict(warmup_steps=1, ae_steps=1, refresh_threshold=0.0),
            "stages.refresh_threshold must be a positive finite number or None, got 0.0",
        ),
        (dict(warmup_steps=1, ae_steps=0, min_ae_steps=0, refresh_threshold=0.5), "needs a codec that trains"),
        (dict(warmup_steps=1, ae_steps=1, refresh_steps=0), "stages.refresh_steps must be a positive integer"),
    ],
)
def test_the_schedule_refuses_bad_stages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _schedule(**kwargs)


def test_stages_that_leave_no_compressed_stage_are_refused():
    schedule = _schedule(warmup_steps=3, ae_steps=2)
    schedule.check_total_steps(6)
    with pytest.raises(ValueError, match=r"stages.warmup_steps=3 \+ stages.ae_steps=2 >= the run's 5 optimizer steps"):
        schedule.check_total_steps(5)


# -- the leaders -------------------------------------------------------------------------------------


def test_a_rotating_leader_cycles_through_the_workers_and_a_fixed_one_stays():
    assert [Leaders(rotate=True).at(step, 3) for step in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert {Leaders(rank=2).at(step, 3) for step in range(7)} == {2}
    with pytest.raises(ValueError, match="leaders.rank=2 fixes the leader, but leaders.rotate=true"):
        Leaders(rank=2, rotate=True)
    with pytest.raises(ValueError, match="leaders.rank=3 is outside the world of 2 worker"):
        Leaders(rank=3).check_world(2)
    with pytest.raises(ValueError, match="leaders.rank must be a non-negative integer, got True"):
        Leaders(rank=True)


# -- the leader's code -------------------------------------------------------------------------------


def _positions_and_values(count: int = 40, numel: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    v = torch.randn(numel, generator=generator)
    positions = torch.randperm(numel, generator=generator)[:count]
    return positions, v


@pytest.mark.parametrize("order", ["position", "magnitude", "value"])
def test_wire_order_sorts_by_what_it_names(order):
    positions, v = _positions_and_values()
    ordered = LeaderIndexCodec(8, order).in_wire_order(positions, v)
    assert sorted(ordered.tolist()) == sorted(positions.tolist())
    key = {"position": ordered, "magnitude": -v[ordered].abs(), "value": -v[ordered]}[order]
    assert bool((key[1:] >= key[:-1]).all())


@pytest.mark.parametrize("coding", ["raw", "golomb"])
@pytest.mark.parametrize("order", ["position", "magnitude", "value"])
@pytest.mark.parametrize("ordered", [True, False])
def test_positions_survive_their_code_in_their_order(coding, order, ordered):
    positions, v = _positions_and_values()
    code = LeaderIndexCodec(8, order, coding)
    wire_order = code.in_wire_order(positions, v)
    sent = wire_order if ordered else torch.sort(positions).values
    wire = code.encode_positions(sent, v.numel(), ordered=ordered)
    assert wire.dtype == torch.uint8
    assert torch.equal(code.decode_positions(wire, sent.numel(), ordered=ordered), sent)
    golomb = golomb_encode(torch.sort(sent).values, v.numel()).nbytes
    permutation = packed_nbytes(sent.numel() * order_bits(sent.numel()))
    expected = {
        "raw": 4 * sent.numel(),
        "golomb": golomb + (permutation if ordered and order != "position" else 0),
    }[coding]
    assert wire.numel() == expected
    assert code.raw_position_bytes(sent.numel()) == (4 * sent.numel() if coding == "raw" else None)


def test_order_bits_is_the_width_of_one_permutation_entry():
    assert [order_bits(n) for n in (1, 2, 3, 4, 5, 1024, 1025)] == [1, 1, 2, 2, 3, 10, 11]


def test_scaled_chunks_are_undone_by_unscaled_and_have_unit_rms():
    code = LeaderIndexCodec(8)
    values = torch.randn(21) * torch.logspace(-6, 2, 21)
    scales = code.chunk_scales(values)
    assert scales.shape == (math.ceil(21 / 8),)
    chunks = code.scaled_chunks(values, scales)
    assert chunks.shape == (3, 8)
    # Every chunk but the zero-padded last one has a root mean square of 1.
    torch.testing.assert_close(chunks[:2].square().mean(dim=1).sqrt(), torch.ones(2))
    torch.testing.assert_close(code.unscaled(chunks, scales, 21), values)
    # Another worker's values far above the leader's scales: saturated at float32's largest, never inf.
    huge = code.scaled_chunks(torch.full((21,), 1e18), torch.full((3,), 1e-21))
    assert torch.isfinite(huge).all() and huge.max() == torch.finfo(torch.float32).max


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(chunk=8, value_order="random"), "value_order must be one of"),
        (dict(chunk=8, index_coding="huffman"), "index_coding must be one of"),
        (dict(chunk=0), "chunk must be a positive integer, got 0"),
    ],
)
def test_the_leaders_code_refuses_unknown_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LeaderIndexCodec(**kwargs)


# -- the step plan -----------------------------------------------------------------------------------


def _pending() -> tuple[list[PendingBucket], dict[str, int]]:
    """Two buckets in DDP's (reversed) order: b.weight (30) and a small b.bias; a.weight (50) and a.bias."""
    first = torch.arange(36, dtype=torch.float32)
    second = torch.arange(100, 155, dtype=torch.float32)
    buckets = [
        PendingBucket(
            first, (Segment("b.weight", 0, 30, True), Segment("b.bias", 30, 6, False)), torch.futures.Future()
        ),
        PendingBucket(
            second, (Segment("a.weight", 0, 50, True), Segment("a.bias", 50, 5, False)), torch.futures.Future()
        ),
    ]
    order = {"a.weight": 0, "a.bias": 1, "b.weight": 2, "b.bias": 3}
    return buckets, order


def test_the_plan_lays_compressed_parameters_out_in_model_order_whatever_the_bucket_order():
    pending, order = _pending()
    plan = plan_step(pending, frozenset(order), order, density=0.1)
    assert [part.name for part in plan.compressed] == ["a.weight", "b.weight"]
    assert sorted(part.name for part in plan.dense) == ["a.bias", "b.bias"]
    assert plan.cat_offsets == (0, 50) and plan.numel == 80
    assert plan.ks == (5, 3) and plan.k == 8  # ceil(0.1 * n) per parameter
    # The parts are views of the buckets: scattering writes the gradients in place.
    plan.scatter(torch.full((80,), -1.0))
    assert bool((pending[1].buffer[:50] == -1).all()) and bool((pending[0].buffer[:30] == -1).all())
    assert torch.equal(pending[0].buffer[30:], torch.arange(30, 36, dtype=torch.float32))


def test_unused_parameters_take_no_part_in_the_plan():
    pending, order = _pending()
    plan = plan_step(pending, frozenset({"b.weight", "a.bias"}), order, density=0.1)
    assert [part.name for part in plan.compressed] == ["b.weight"] and [p.name for p in plan.dense] == ["a.bias"]
    assert plan.numel == 30 and plan.k == 3


def test_corrected_adds_residuals_and_keep_stores_views_of_the_cat_space_vector():
    pending, order = _pending()
    plan = plan_step(pending, frozenset(order), order, density=0.1)
    residuals = {"b.weight": torch.ones(30)}
    v = plan.corrected(residuals)
    assert v.dtype == torch.float32
    assert torch.equal(v[:50], torch.arange(100, 150, dtype=torch.float32))  # no residual yet: the gradient
    assert torch.equal(v[50:], torch.arange(30, dtype=torch.float32) + 1)
    plan.keep_residuals(residuals, v)
    v[0] = 7.0
    assert residuals["a.weight"][0] == 7.0 and residuals["b.weight"].numel() == 30


def test_residuals_kept_as_one_vector_are_updated_in_place_and_put_writes_only_the_positions():
    pending, order = _pending()
    plan = plan_step(pending, frozenset(order), order, density=0.1)
    residuals: dict[str, torch.Tensor] = {}
    plan.keep_residuals(residuals, torch.full((80,), 0.5))
    v = plan.corrected(residuals)
    # The residuals were one vector: v is that vector, no copy, and equals what a copy would hold.
    assert v.untyped_storage().data_ptr() == residuals["a.weight"].untyped_storage().data_ptr()
    expected = torch.cat([torch.arange(100, 150, dtype=torch.float32), torch.arange(30, dtype=torch.float32)]) + 0.5
    assert torch.equal(v, expected)
    # Residuals from anywhere else (a fresh one for b.weight) are copied into a new vector, as before.
    residuals["b.weight"] = torch.zeros(30)
    assert plan.corrected(residuals).untyped_storage().data_ptr() != residuals["a.weight"].untyped_storage().data_ptr()
    # put: every compressed gradient zero but at the positions (cat space, any order); dense ones untouched.
    plan.put(torch.tensor([79, 3, 50]), torch.tensor([-3.0, -1.0, -2.0]))
    a, b = pending[1].buffer[:50], pending[0].buffer[:30]
    assert a[3] == -1.0 and b[0] == -2.0 and b[29] == -3.0 and int((a != 0).sum() + (b != 0).sum()) == 3
    assert torch.equal(pending[0].buffer[30:], torch.arange(30, 36, dtype=torch.float32))
    assert torch.equal(pending[1].buffer[50:], torch.arange(150, 155, dtype=torch.float32))
    # put_flat (a GPU's put, through one cat-space vector) writes the same bits, half-precision values too.
    for values in (torch.tensor([-3.0, -1.0, -2.0]), torch.tensor([-3.1, 1e-3, 7.7], dtype=torch.float16)):
        plan.put(torch.tensor([79, 3, 50]), values)
        expected = [b.buffer.clone() for b in pending]
        pending[0].buffer[:30].fill_(5.0)  # the compressed gradients: whatever was there before
        pending[1].buffer[:50].fill_(5.0)
        plan.put_flat(torch.tensor([79, 3, 50]), values)
        assert all(torch.equal(b.buffer, e) for b, e in zip(pending, expected, strict=True))


def test_top_positions_are_each_parameters_top_k_in_cat_space(reference_device):
    """Parameter by parameter on the CPU, all at once (segment_topk) on a GPU: the same positions."""
    pending, order = _pending()
    plan = plan_step(pending, frozenset(order), order, density=0.1)
    v = plan.corrected({}).to(reference_device)
    # a.weight holds 100..149, b.weight 0..29: the largest of each, offset into cat space.
    assert sorted(plan.top_positions(v).tolist()) == [45, 46, 47, 48, 49, 77, 78, 79]
    assert sorted(plan.top_positions(v, density=0.02).tolist()) == [49, 79]
    random = torch.randn(plan.numel, generator=torch.Generator().manual_seed(0)).to(reference_device)
    flat = segment_topk(random, [p.grad.numel() for p in plan.compressed], list(plan.ks))
    assert sorted(plan.top_positions(random).tolist()) == sorted(flat.tolist()), "the GPU's selection"


# -- the byte book -----------------------------------------------------------------------------------


def test_the_byte_book_adds_what_was_sent_since_its_last_booking_to_the_named_stage():
    book, stats = StageByteBook(), CommStats()
    stats.bytes_sent, stats.hook_calls = 100, 2
    book.book("warmup", stats)
    stats.bytes_sent, stats.hook_calls = 130, 3
    book.book("compressed", stats)
    stats.bytes_sent = 150
    book.book("compressed", stats)
    assert book.summary()["warmup"]["bytes_sent"] == 100 and book.summary()["compressed"]["bytes_sent"] == 50
    assert book.summary()["compressed"]["hook_calls"] == 1
    restored = StageByteBook()
    restored.load_state_dict(book.state_dict())
    stats.bytes_sent = 160
    restored.book("compressed", stats)
    assert restored.summary()["compressed"]["bytes_sent"] == 60


# -- codec training ----------------------------------------------------------------------------------

_SMALL = dict(chunk=16, encoder_channels=[4, 4], decoder_channels=[4, 4], latent_channels=2)


def test_both_trainers_are_codec_trainers_of_chunk_codecs():
    autoencoder = AutoencoderTrainer(GradientAutoencoder(CodecTraining(CodecTrainingKnobs(autoencoder=_SMALL)).config))
    linear = LinearCodecTrainer(LinearChunkCodec(16, 2))
    for trainer in (autoencoder, linear):
        assert isinstance(trainer, CodecTrainer) and isinstance(trainer.autoencoder, ChunkCodec)


def test_the_codec_is_built_for_its_topology_and_world():
    rar = CodecTraining(CodecTrainingKnobs(autoencoder=_SMALL))
    rar.build(4)
    assert rar.config.num_decoders == 1 and not rar.config.innovation
    ps = CodecTraining(CodecTrainingKnobs(autoencoder=_SMALL), innovation_density=0.001)
    ps.build(4)
    assert ps.config.num_decoders == 4 and ps.config.innovation
    linear = CodecTraining(CodecTrainingKnobs(autoencoder=_SMALL, codec="linear"))
    linear.build(4)
    # The linear codec sends as many floats per chunk as the autoencoder would: the same bytes.
    assert isinstance(linear.model, LinearChunkCodec) and linear.model.latent_size == rar.config.latent_numel


def test_codec_training_refuses_knobs_that_do_not_apply():
    with pytest.raises(ValueError, match="training.codec must be one of 'autoencoder', 'linear', 'pca_autoencoder'"):
        CodecTrainingKnobs(codec="pca")
    with pytest.raises(ValueError, match="training.linear_latent=8 sizes the linear and PCA-initialised codecs"):
        CodecTraining(CodecTrainingKnobs(linear_latent=8))
    with pytest.raises(ValueError, match="training.updates_per_step must be a non-negative integer, got -1"):
        CodecTrainingKnobs(updates_per_step=-1)
    with pytest.raises(TypeError, match="training has no knob 'ae_updates_per_step'; its knobs: codec, samples"):
        CodecTrainingKnobs().changed({"ae_updates_per_step": 1})
    with pytest.raises(FileNotFoundError):
        CodecTraining(CodecTrainingKnobs(autoencoder={**_SMALL, "init": "/no/such/codec.pt"}))


def test_a_codec_is_saved_only_once_the_workers_hold_it(tmp_path):
    training = CodecTraining(CodecTrainingKnobs(autoencoder=_SMALL))
    training.build(2)
    assert training.save(tmp_path / "codec.pt") is None
    training.weights_sent = True
    saved = training.save(tmp_path / "codec.pt")
    assert saved is not None and saved.is_file()
    warm = CodecTraining(CodecTrainingKnobs(autoencoder={**_SMALL, "init": str(saved)}))
    warm.warm_start(ae_steps=0)
    warm.build(2)
    # Warm-started and not retrained: every worker holds the weights, so none are broadcast.
    assert warm.weights_sent and not warm.model.training
    for a, b in zip(warm.model.parameters(), training.model.parameters(), strict=True):
        assert torch.equal(a, b)
