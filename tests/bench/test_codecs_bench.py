"""``lgc-bench codecs``: each leader-position codec's delivered sum and wire bits, on gradients made to order."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lgc.autoencoder import divide_by_scales
from lgc.bench import codecs, leader_codecs
from lgc.bench.autoencoder import aligned_samples
from lgc.bench.cli import main
from lgc.learned.leader_code import LeaderIndexCodec
from lgc.learned.shared_index import quantization_levels


def _gradients(workers=4, steps=6, sizes=(640, 1280), seed=0):
    """Per parameter ``[W, T, n]``: a common gradient plus each worker's own noise."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1, steps, n, generator=generator) + 0.5 * torch.randn(workers, steps, n, generator=generator)
        for n in sizes
    ]


def _coder(name, chunk=16, world=4):
    (spec,) = leader_codecs.parse_codecs(name, chunk)
    return leader_codecs._Coder(spec, chunk, world, seed=0, ae_updates=20)


def test_the_leaders_positions_are_its_own_top_k_per_parameter_fixed_or_rotating():
    gradients = _gradients()
    for rotating in (False, True):
        for t, step in enumerate(leader_codecs.leader_steps(gradients, 0.05, rotating)):
            leader = t % 4 if rotating else 0
            assert step.leader == leader and step.numel == 640 + 1280
            first = gradients[0][leader, t].abs().topk(32).indices.sort().values
            second = gradients[1][leader, t].abs().topk(64).indices.sort().values + 640
            assert torch.equal(step.positions, torch.cat([first, second]))
            flat = torch.cat([g[:, t] for g in gradients], dim=1)
            assert torch.equal(step.values, flat[:, step.positions])


def test_fp32_delivers_the_exact_sum_and_counts_32_bits_a_value_and_the_golomb_positions():
    step = leader_codecs.leader_steps(_gradients(), 0.05, rotating=True)[1]
    coder = _coder("fp32")
    delivered, bits = coder.run(step)
    assert torch.allclose(delivered, step.values.sum(dim=0), atol=1e-6)
    k = step.values.shape[1]
    golomb = LeaderIndexCodec(16, "position", "golomb").encode_positions(step.positions, step.numel)
    assert bits == {"payload": 32.0 * k, "leader": 8.0 * golomb.numel()}
    # Value order adds the permutation back to it: ceil(log2 K) bits a position.
    (value_ordered,) = leader_codecs.parse_codecs("pca:16:fp32:value", 16)
    permuted = leader_codecs._Coder(value_ordered, 16, 4, seed=0)._wire_positions(step)
    ordered = LeaderIndexCodec(16, "value", "golomb").encode_positions(permuted, step.numel)
    assert ordered.numel() * 8 >= golomb.numel() * 8 + k * 7  # K = 96: 7 bits a position


def test_a_16_bit_wire_saturates_a_value_beyond_its_range_as_lgcs_wire_does():
    # A non-leader's value far above the leader's chunk scale: a plain cast sent inf (the benchmark's fp16 row
    # read "inf" on ResNet-50's gradients); lgc's wire saturates it, and so does the benchmark's.
    gradients = _gradients()
    gradients[0][1] *= 1e6  # worker 1 of the first parameter, every step
    step = leader_codecs.leader_steps(gradients, 0.05, rotating=False)[1]  # worker 0 leads
    for name in ("fp16", "pca:16:fp16"):
        coder = _coder(name)
        if coder.spec.kind == "pca":
            coder.fit(leader_codecs.leader_steps(gradients, 0.05, rotating=False)[:1])
        delivered, _ = coder.run(step)
        assert torch.isfinite(delivered).all(), name


def test_a_quotient_beyond_float32_saturates_where_the_leaders_chunk_is_tiny():
    # The leader's values ~1e-21 and another worker's ~1e18 at the same positions: divided by the leader's
    # chunk scale the quotient leaves float32's range; it saturates (no inf from finite values), the
    # 16-bit wire saturates it again, and the delivered sum stays finite.
    gradients = _gradients()
    gradients[0][0] *= 1e-21  # worker 0 (the fixed leader) of the first parameter: scales ~1e-21
    gradients[0][1] *= 1e18
    step = leader_codecs.leader_steps(gradients, 0.05, rotating=False)[1]
    chunks, _ = _coder("fp16")._scaled_chunks(step)
    assert torch.isfinite(chunks).all() and chunks.abs().max() == torch.finfo(torch.float32).max
    delivered, _ = _coder("fp16").run(step)
    assert torch.isfinite(delivered).all()
    # The autoencoder benchmark's samples (LGC's stage-2 samples) are scaled the same way.
    samples = aligned_samples([g[:, 0] for g in gradients], 0.05, 8, "value", leader=0)
    assert torch.isfinite(samples).all() and samples.abs().max() == torch.finfo(torch.float32).max
    # A value that is inf already stays inf (lgc's step guard reads it).
    inf = torch.tensor([[float("inf"), 1.0]])
    assert divide_by_scales(inf, torch.tensor([1e-30])).isinf()[0, 0]


def test_the_momentum_order_needs_no_permutation_and_reads_only_what_was_delivered():
    gradients = _gradients()
    steps = leader_codecs.leader_steps(gradients, 0.05, rotating=False)
    assert steps[0].momentum is None
    # What every worker's momentum buffer holds before step 2: step 0's and step 1's delivered sums
    # (at their own leader's positions only), decayed.
    flat = [torch.cat([g[:, t] for g in gradients], dim=1) for t in range(2)]
    delivered = [
        torch.zeros(flat[t].shape[1]).index_put_((steps[t].positions,), flat[t][:, steps[t].positions].sum(0))
        for t in range(2)
    ]
    expected = leader_codecs.MOMENTUM * delivered[0] + delivered[1]
    torch.testing.assert_close(steps[2].momentum, expected[steps[2].positions])
    momentum, position = _coder("pca:4:fp32:momentum"), _coder("pca:4:fp32")
    for coder in (momentum, position):
        coder.fit(steps[:3])
    # The same Golomb-coded ascending positions and scales: no permutation travels.
    assert momentum.run(steps[4])[1] == position.run(steps[4])[1]
    order = torch.argsort(steps[4].momentum, descending=True, stable=True)
    assert torch.equal(momentum._ordered(steps[4]), steps[4].values[:, order])
    assert torch.equal(momentum._ordered(steps[0]), steps[0].values)  # nothing delivered yet: positions


def test_fewer_levels_cost_fewer_bits_and_deliver_a_worse_sum_within_the_rounding_step():
    steps = leader_codecs.leader_steps(_gradients(), 0.05, rotating=False)
    results = {name: leader_codecs._evaluate(_coder(name), steps) for name in ("int8", "levels=3", "levels=1", "int4")}
    assert results["int8"]["error"] < results["levels=3"]["error"] < results["levels=1"]["error"]
    # int8 with 4 workers: 8-bit lanes and a 32-bit scale per chunk of 16; 3 levels a side: 2 m P + 1 = 25
    # codes -> 5-bit lanes; one level: 9 codes -> 4 bits, which is int4 at 4 workers (m = 15 // 8 = 1).
    assert results["int8"]["payload_bits_per_value"] == pytest.approx((8 * 16 + 32) / 16, rel=0.05)
    assert results["levels=3"]["payload_bits_per_value"] == pytest.approx((5 * 16 + 32) / 16, rel=0.05)
    same = ("error", "payload_bits_per_value", "bits_per_value")
    assert [results["levels=1"][key] for key in same] == [results["int4"][key] for key in same]
    # Every delivered value is within P rounding steps (a step: the shared chunk scale / m) of the exact sum.
    step, coder = steps[0], _coder("int8")
    delivered, _ = coder.run(step)
    chunks = torch.stack([leader_codecs.to_chunks(v, 16) for v in step.values])
    step_size = chunks.abs().amax(dim=(0, 2)) / quantization_levels(8, 4)
    bound = leader_codecs.from_chunks(4 * step_size[:, None].expand(-1, 16), step.values.shape[1])
    assert ((delivered - step.values.sum(dim=0)).abs() <= bound + 1e-6).all()


def test_pca_is_exact_on_its_span_and_decodes_the_projection_of_the_sum():
    # Every worker's scaled chunks lie in a 3-dimensional subspace of the 16 values of a chunk.
    generator = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(16, 3, generator=generator)).Q
    workers, steps, rows = 4, 5, 12
    values = (torch.randn(workers, steps, rows, 3, generator=generator) @ basis.T).reshape(workers, steps, -1)
    layouts = [leader_codecs.LeaderStep(0, torch.arange(rows * 16) * 2, values[:, t], rows * 32) for t in range(steps)]
    exact = _coder("pca:3:fp32")
    exact.fit(layouts[:3])
    assert leader_codecs._evaluate(exact, layouts[3:])["error"] < 1e-10
    # Fewer components: the delivered sum is the sum projected on them (in the leader's chunk scales).
    narrow = _coder("pca:2:fp32")
    narrow.fit(layouts[:3])
    delivered, bits = narrow.run(layouts[4])
    chunks, scales = narrow._scaled_chunks(layouts[4])
    projection = chunks.sum(dim=0) @ narrow.basis @ narrow.basis.T
    assert torch.allclose(delivered, leader_codecs.from_chunks(projection * scales[:, None], rows * 16), atol=1e-5)
    assert bits["payload"] == 32.0 * 2 * rows
    # int8 latents: 8 bits a code and a 32-bit scale per chunk, the sum within the rounding of the codes.
    coarse = _coder("pca:3:int8")
    coarse.fit(layouts[:3])
    assert leader_codecs._evaluate(coarse, layouts[3:])["payload_bits_per_value"] == pytest.approx((8 * 3 + 32) / 16)
    assert 0 < leader_codecs._evaluate(coarse, layouts[3:])["error"] < 1e-3


@pytest.mark.slow
def test_the_autoencoder_and_leader_scaled_deliver_p_times_a_mean_estimate():
    steps = leader_codecs.leader_steps(_gradients(), 0.05, rotating=False)
    ae = _coder("ae:2:fp16:value", chunk=64)
    ae.fit(steps[:3])
    delivered, bits = ae.run(steps[4])
    rows = leader_codecs.num_chunks(steps[4].values.shape[1], 64)
    assert bits["payload"] == 16.0 * ae.autoencoder.config.latent_numel * rows and torch.isfinite(delivered).all()
    # nosim: the same codec trained without the similarity term.
    plain, nosim, narrow = leader_codecs.parse_codecs("ae:2:fp32,ae:2:fp32:position:nosim,ae:2:fp32:nosim:w0.25", 64)
    assert plain.similarity and not nosim.similarity and nosim.order == "position"
    # :wX multiplies the reference widths (fewer parameters, the same latent).
    assert (narrow.width, narrow.similarity, narrow.order, plain.width) == (0.25, False, "position", 1.0)
    # pcaae: PCA's directions and a correction that starts at zero, applied as the autoencoder is.
    pcaae = _coder("pcaae:8:fp32:nosim:h16", chunk=64)
    assert (pcaae.spec.kind, pcaae.spec.hidden, pcaae.spec.similarity) == ("pcaae", 16, False)
    pcaae.fit(steps[:3])
    delivered, bits = pcaae.run(steps[4])
    assert bits["payload"] == 32.0 * 8 * rows and torch.isfinite(delivered).all()
    small = _coder("ae:2:fp16:value:w0.25", chunk=64)
    small.fit(steps[:3])
    config = small.autoencoder.config
    assert config.encoder_channels == (16, 32, 64, 16) and config.latent_numel == ae.autoencoder.config.latent_numel
    leader = _coder("leader_scaled")
    delivered, bits = leader.run(steps[4])
    assert torch.equal(delivered, 4 * steps[4].values[0]) and bits["payload"] == 0.0


@pytest.mark.parametrize("name", ["pcaae:8:int8:h16", pytest.param("ae:2:int8:value:w0.25", marks=pytest.mark.slow)])
def test_int8_latents_round_each_chunks_codes_to_a_shared_scale_as_lgc_rar_does(name):
    steps = leader_codecs.leader_steps(_gradients(), 0.05, rotating=False)
    coder = _coder(name, chunk=64)
    coder.fit(steps[:3])
    full = _coder(name.replace("int8", "fp32"), chunk=64)
    full.autoencoder = coder.autoencoder  # the same weights: only the latents' wire differs
    rows = leader_codecs.num_chunks(steps[4].values.shape[1], 64)
    latent_numel = coder.autoencoder.config.latent_numel
    delivered, bits = coder.run(steps[4])
    exact, exact_bits = full.run(steps[4])
    # 8 bits a code and the chunk's 32-bit scale, against 32 bits a code.
    assert (
        bits["payload"] == 8.0 * latent_numel * rows + 32.0 * rows
        and exact_bits["payload"] == 32.0 * latent_numel * rows
    )
    assert bits["leader"] == exact_bits["leader"]
    # The summed codes lie within one rounding step (the shared scale over m levels) per worker of the exact sum.
    chunks, _ = coder._scaled_chunks(steps[4])
    with torch.no_grad():
        codes = torch.stack([coder.autoencoder.encode(c) for c in chunks]).reshape(4, rows, -1)
    shared = codes.abs().amax(dim=(0, 2))
    levels = quantization_levels(8, 4)
    step_size = 4 * shared / levels
    assert ((coder._int8_sum(codes) - codes.sum(dim=0)).abs() <= step_size[:, None] * (1 + 1e-5)).all()
    assert torch.isfinite(delivered).all() and not torch.equal(delivered, exact)
    # Unbiased rounding: over the scored steps the int8 codec errs about as the fp32 one does.
    errors = [leader_codecs._evaluate(c, steps[3:])["error"] for c in (coder, full)]
    assert errors[0] == pytest.approx(errors[1], rel=0.2, abs=0.02)
    (latent,) = leader_codecs.parse_codecs(name, 64)
    assert leader_codecs.cannot_sum(latent, 127) is None and "at most 127" in leader_codecs.cannot_sum(latent, 128)


def test_plain_top_k_sums_every_workers_own_top_k_and_pays_its_own_positions():
    gradients = _gradients()
    step = leader_codecs.leader_steps(gradients, 0.05, False, leader_codecs.plain_topk_steps(gradients, 0.05))[2]
    flat = torch.cat([g[:, 2] for g in gradients], dim=1)
    delivered, bits = 0, 0.0
    for w in range(4):
        own = torch.cat([gradients[0][w, 2].abs().topk(32).indices, gradients[1][w, 2].abs().topk(64).indices + 640])
        delivered = delivered + torch.zeros(1920).index_put_((own,), flat[w, own])
        bits += 32 * 96 + 8 * leader_codecs.golomb_encode(own.sort().values, 1920).to_wire().numel()
    coder = _coder("topk")
    at_leader, wire = coder.run(step)
    torch.testing.assert_close(at_leader, delivered[step.positions])
    assert wire == {"payload": bits / 4, "leader": 0.0}
    whole = (delivered - flat.sum(0)).double().square()
    torch.testing.assert_close(step.own.whole_error, torch.stack([whole[:640].sum(), whole[640:].sum()]))


def test_the_errors_per_parameter_add_up_and_the_whole_sum_counts_what_the_leader_left_out():
    gradients = _gradients()
    steps = leader_codecs.leader_steps(gradients, 0.05, True, leader_codecs.plain_topk_steps(gradients, 0.05))
    names = ["first", "second"]
    for name in ("fp32", "int8", "pca:4:fp32:value", "topk"):
        coder = _coder(name)
        coder.fit(steps[:3])
        deliveries, run = [], coder.run
        coder.run = lambda step, run=run, deliveries=deliveries: deliveries.append(run(step)) or deliveries[-1]
        result = leader_codecs._evaluate(coder, steps[3:], names)  # (int8 draws its rounding: keep what it sent)
        at, whole = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        at_norm, whole_norm = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        for t, step in enumerate(steps[3:], start=3):
            full = torch.cat([g[:, t] for g in gradients], dim=1).sum(0).double()
            delivered, _ = deliveries[t - 3]
            order = coder._order(step)
            positions = step.positions if order is None else step.positions[order]
            estimate = torch.zeros(1920, dtype=torch.float64).index_put_((positions,), delivered.double())
            exact = torch.zeros(1920, dtype=torch.float64).index_put_((positions,), full[positions])
            for layer, part in enumerate((slice(0, 640), slice(640, 1920))):
                at[layer] += (estimate - exact)[part].square().sum()
                at_norm[layer] += exact[part].square().sum()
                whole[layer] += (estimate - full)[part].square().sum()
                whole_norm[layer] += full[part].square().sum()
        for layer, key in enumerate(names):
            assert result["layers"][key]["error"] == pytest.approx(float(at[layer] / at_norm[layer]), rel=1e-4)
            if name != "topk":  # (its whole sum is its own sparse vectors: checked above)
                assert result["layers"][key]["whole_error"] == pytest.approx(
                    float(whole[layer] / whole_norm[layer]), rel=1e-4
                )
        assert result["error"] == pytest.approx(float(at.sum() / at_norm.sum()), rel=1e-4)
        if name == "fp32":  # exact at the positions: the whole error is the energy the leader left out
            assert result["error"] < 1e-10 and 0.5 < result["whole_error"] < 1


def test_the_premise_per_parameter_is_the_analysis_statistics_on_the_scored_steps():
    from lgc.analysis.correlation import leader_position_statistics

    gradients = _gradients(steps=6)
    rows = leader_codecs.layer_premise(gradients, ["a", "b"], 0.05, slice(2, None))
    for row, grad in zip(rows, gradients, strict=True):
        assert row["numel"] == grad.shape[2]
        for rotating in (False, True):
            stats = leader_position_statistics(grad, 0.05, rotating)
            leader = "rotating" if rotating else "fixed"
            assert row[leader]["correlation"] == pytest.approx(float(stats["correlation"][2:].mean()), rel=1e-5)
            assert row[leader]["energy_share"] == pytest.approx(float(stats["energy_share"][2:].mean()), rel=1e-5)
    # Correlated workers (a common gradient plus noise half its size) are far above chance.
    assert rows[0]["fixed"]["correlation"] > 0.5 and rows[0]["fixed"]["energy_share"] > 0.05


def test_the_table_gives_the_premise_and_the_errors_per_parameter():
    gradients = _gradients()
    steps = leader_codecs.leader_steps(gradients, 0.05, rotating=False)
    coder = _coder("int8")
    row = {"codec": "int8", "leader": "fixed", **leader_codecs._evaluate(coder, steps, ["a", "b"])}
    premise = leader_codecs.layer_premise(gradients, ["a", "b"], 0.05, slice(3, None))
    result = {"label": "x", "steps": 6, "train_steps": 3, "ae_updates": 1, "density": 0.05, "chunk": 16,
              "rows": [row], "layers": premise}  # fmt: skip
    table = codecs.format_table(result)
    assert "| parameter | values | r (fixed) |" in table and "| a | 640 |" in table
    assert f"| int8 | {row['layers']['a']['error']:.4g} ({row['layers']['a']['whole_error']:.4g}) |" in table
    assert "(fixed leader;" in table and "(rotating leader;" not in table  # only the leaders measured


def _write_recording(folder, gradients):
    """``gradients`` (per parameter ``[W, T, n]``) as GradientRecorder's per-rank files."""
    from lgc.analysis.recording import RECORDING_FORMAT, rank_file

    folder.mkdir(parents=True)
    workers, steps = gradients[0].shape[:2]
    for rank in range(workers):
        torch.save(
            {"format": RECORDING_FORMAT, "rank": rank, "world_size": workers, "steps": torch.arange(steps),
             "gradients": {f"p{i}": g[rank] for i, g in enumerate(gradients)}, "metadata": {}},
            rank_file(folder, rank),
        )  # fmt: skip
    return folder


def test_a_run_of_some_recordings_keeps_the_others_results_in_their_places(tmp_path, monkeypatch):
    monkeypatch.setattr(codecs, "format_table", lambda result: f"table of {result['label']}")
    earlier = [{"label": "4 x 32", "rows": [1]}, {"label": "8 x 32", "rows": [2]}, {"label": "8 x 128", "rows": []}]
    codecs._write(tmp_path, earlier)
    # A run of 8 x 128 alone (its partial result first measured again) and a new recording.
    run = [{"label": "8 x 128", "rows": [3]}, {"label": "16 x 32", "rows": [4]}]
    codecs._write(tmp_path, run, codecs._others(tmp_path))
    written = json.loads((tmp_path / "codecs.json").read_text())
    assert written == [earlier[0], earlier[1], run[0], run[1]]
    assert (tmp_path / "codecs.md").read_text() == "table of 4 x 32\n\ntable of 8 x 32\n\ntable of 8 x 128\n\n" + (
        "table of 16 x 32\n"
    )
    assert codecs._others(tmp_path / "nothing") == []


def test_a_stopped_benchmark_keeps_its_rows_and_measures_only_the_rest(tmp_path, monkeypatch):
    recording = _write_recording(tmp_path / "rec", _gradients())
    specs = leader_codecs.parse_codecs("fp32,int8,topk", 16)
    seen = []
    first = leader_codecs.benchmark_codecs(
        recording, specs, 0.05, 16, leaders=("rotating",), on_row=lambda r: seen.append((len(r["rows"]), r["complete"]))
    )
    assert seen == [(1, False), (2, False), (3, False)] and first["complete"]
    assert [row["codec"] for row in first["rows"]] == ["fp32", "int8", "topk"]
    assert [layer["name"] for layer in first["layers"]] == ["p0", "p1"] and None not in first["load_average"]
    # Stopped after two rows: a rerun keeps them and fits only the third codec.
    fitted = []
    fit = leader_codecs._Coder.fit

    def counted_fit(coder, steps):
        fitted.append(coder.spec.name)
        fit(coder, steps)

    monkeypatch.setattr(leader_codecs._Coder, "fit", counted_fit)
    kept = first["rows"][:2]
    again = leader_codecs.benchmark_codecs(recording, specs, 0.05, 16, leaders=("rotating",), done_rows=kept)
    assert fitted == ["topk"] and again["rows"][:2] == first["rows"][:2]
    with pytest.raises(ValueError, match="leaders must be some of"):
        leader_codecs.benchmark_codecs(recording, specs, 0.05, 16, leaders=("best",))


def test_lanes_too_narrow_for_the_workers_sum_are_named_not_run():
    int4, int8 = leader_codecs.parse_codecs("int4,int8", 64)
    assert leader_codecs.cannot_sum(int4, 7) is None and leader_codecs.cannot_sum(int8, 127) is None
    assert leader_codecs.cannot_sum(int4, 8) == "4-bit lanes cannot hold the sum of 8 workers' codes (at most 7)"
    (latent,) = leader_codecs.parse_codecs("pca:4:int8", 64)
    assert leader_codecs.cannot_sum(latent, 127) is None and "at most 127" in leader_codecs.cannot_sum(latent, 128)
    result = {"label": "x", "steps": 2, "train_steps": 1, "ae_updates": 1, "density": 0.01, "chunk": 64}
    result["rows"] = [{"codec": "int4", "leader": "fixed", "error": None, "note": leader_codecs.cannot_sum(int4, 8)}]
    assert "| fixed | int4 | - | - | - | 4-bit lanes cannot hold" in codecs.format_table(result)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--codecs", "fp64"], "unknown codec 'fp64'"),
        (["--codecs", "pca:x:fp32"], r"write pca:LATENT:DTYPE\[:ORDER\]"),
        (["--codecs", "pca:99:fp32"], r"the latent size must be in \[1, --chunk=64\]"),
        (["--codecs", "pca:4:int4"], "the dtype must be one of"),
        (["--codecs", "ae:4:int4"], "the dtype must be one of"),
        (["--codecs", "ae:4:fp32:value:sim"], r"write ae:CHANNELS:DTYPE\[:ORDER\]\[:nosim\]\[:wWIDTH\]"),
        (["--codecs", "ae:4:fp32:w0"], r"autoencoder width must be a number in \(0, 16\], got 0.0"),
        (["--codecs", "pcaae:4:fp32:w2"], r"write pcaae:LATENT:DTYPE\[:ORDER\]\[:nosim\]\[:hHIDDEN\]"),
        (["--codecs", "pcaae:99:fp32"], r"the latent size must be in \[1, --chunk=64\]"),
        (["--codecs", "ae:4:fp32", "--chunk", "16"], "shorter than the encoder's receptive field"),
        (["--codecs", "levels=0"], "levels must be a positive integer"),
        (["--ae-updates", "0"], "--ae-updates must be >= 1"),
        (["--workers", "2,x"], "--workers must be comma-separated integers"),
        (["--density", "0"], r"--density must be in \(0, 1\]"),
        (["--density", "0.01,x"], "--density must be comma-separated numbers"),
        (["--train-fraction", "1"], r"--train-fraction must be in \(0, 1\)"),
        (["--alpha", "0"], r"--alpha must be > 0"),
        (["--leaders", "fixed,best"], "--leaders must be some of fixed, rotating"),
        (["--model", "resnet999", "--workers", "2", "--batch-sizes", "8"], "resnet999"),
        (["--patterns", "model.nothing*", "--workers", "2", "--batch-sizes", "8"], r"no parameter name matches"),
        (["--override", "data.batch_size=0", "--workers", "2", "--batch-sizes", "8"], "batch_size"),
    ],
)
def test_bad_values_are_named_before_anything_is_recorded(monkeypatch, argv, message):
    import lgc.analysis

    monkeypatch.setattr(lgc.analysis, "record_gradients", lambda *a, **k: pytest.fail("recorded before checking"))
    with pytest.raises(SystemExit) as exit_info:
        main(["codecs", *argv])
    assert re.search(message, str(exit_info.value.code))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_recorded_run_gives_every_codec_a_row_per_leader_and_the_files_and_a_rerun_reuses_them(
    tmp_path, monkeypatch, capsys
):
    argv = ["codecs", "--workers", "2", "--batch-sizes", "16", "--steps", "6", "--codecs", "fp32,int8,pca:4:fp32,topk",
            "--partition", "dirichlet", "--alpha", "0.5", "--patterns", "model.layers.*.conv*.weight,model.fc.weight",
            "--keep-recordings", str(tmp_path / "recordings"), "--out", str(tmp_path)]  # fmt: skip
    main(argv)
    (result,) = json.loads((tmp_path / "codecs.json").read_text())
    # The same settings again: nothing is recorded, the saved result is reported.
    import lgc.analysis

    monkeypatch.setattr(lgc.analysis, "record_gradients", lambda *a, **k: pytest.fail("recorded again"))
    capsys.readouterr()
    main(argv)
    assert "measured before" in capsys.readouterr().out
    assert json.loads((tmp_path / "codecs.json").read_text()) == [result]
    assert result["workers"] == 2 and result["steps"] == 6 and result["train_steps"] == 3
    assert result["label"].startswith("digits, 2 workers x 16 images (Dirichlet 0.5), 6 steps")
    assert result["label"].endswith("density 0.01") and len(result["load_average"]) == 2
    assert set(result["provenance"]) >= {"commit", "dirty"}
    # Every recorded parameter has its premise, and every codec its error there.
    names = [layer["name"] for layer in result["layers"]]
    assert names == result["parameters"] and "model.fc.weight" in names
    assert all(0 <= layer["rotating"]["energy_share"] <= 1 for layer in result["layers"])
    rows = {(row["leader"], row["codec"]): row for row in result["rows"]}
    codec_names = ("fp32", "int8", "pca:4:fp32", "topk")
    assert set(rows) == {(leader, c) for leader in ("fixed", "rotating") for c in codec_names}
    assert all(set(row["layers"]) == set(names) for row in rows.values())
    assert rows["fixed", "topk"]["whole_error"] < rows["fixed", "fp32"]["whole_error"] < 1
    assert rows["fixed", "fp32"]["error"] < 1e-10 and rows["rotating", "int8"]["error"] < 0.01
    assert rows["fixed", "pca:4:fp32"]["bits_per_value"] < rows["fixed", "int8"]["bits_per_value"]
    assert "| fixed | int8 |" in (tmp_path / "codecs.md").read_text()
    # Other settings (one leader): measured anew, on the recording kept before.
    capsys.readouterr()
    main([*argv, "--leaders", "rotating"])
    assert "is reused" in capsys.readouterr().out
    rerun = json.loads((tmp_path / "codecs.json").read_text())
    assert [r["settings"]["leaders"] for r in rerun] == [["rotating"]]
    assert {row["leader"] for row in rerun[0]["rows"]} == {"rotating"}
    assert (tmp_path / "codecs.png").stat().st_size > 10_000
