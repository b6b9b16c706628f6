"""lgc-bench runs end to end on a small gradient (a smoke test; timings are not asserted)."""

import json
import subprocess
import sys

import pytest
import torch
from distributed import run_workers

from lgc.bench.cli import main
from lgc.bench.compressors import resnet50_numels


def test_resnet50_has_the_documented_number_of_elements():
    assert sum(resnet50_numels()) == 25_557_032


def test_compressor_benchmark_reports_every_configured_compressor(tmp_path, capsys):
    from lgc.bench.compressors import BUCKET_CODECS, _configured_compressors

    out = tmp_path / "bench.json"
    main(["compressors", "--numel", "5000", "70000", "--repeats", "1", "--density", "0.01", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {row["compressor"]: row for row in result["rows"]}
    # Every codec with a bucket-level path, both ways it encodes (error feedback's says which in its repr).
    variants = {f"{name}_{way}" for name in BUCKET_CODECS for way in ("per_tensor", "bucketed")}
    # Every configured codec with a bucket-level path (the GPU's default) is timed both ways.
    configured = _configured_compressors(0.01)
    assert set(BUCKET_CODECS) == {name for name, c in configured.items() if c.batches_on(torch.device("cuda"))}
    assert set(rows) == set(_configured_compressors(0.01)) | variants
    assert set(rows) >= {"none", "fp16", "topk", "dgc"}
    for name in ("topk", "dgc", "sbc", "redsync", "signsgd"):
        assert "bucketed=True" in rows[f"{name}_bucketed"]["description"]
        assert "bucketed=False" in rows[f"{name}_per_tensor"]["description"]
    for name in BUCKET_CODECS:
        for way in ("per_tensor", "bucketed"):
            assert rows[f"{name}_{way}"]["bits_per_element"] == rows[name]["bits_per_element"]
    assert result["numel"] == 75_000
    assert rows["none"]["bits_per_element"] == 32
    assert rows["fp16"]["bits_per_element"] == 16
    # top-k sends ceil(0.01 n) (fp32 value, int32 index) pairs per tensor: 50 + 700 pairs of 64 bits.
    assert rows["topk"]["bits_per_element"] == 64 * (50 + 700) / 75_000
    # DGC is timed after its warm-up, at the density asked for: its sampled threshold keeps between
    # 0.8 k and k entries per tensor (the authors' rule), top-k exactly k.
    assert 0.8 * rows["topk"]["bits_per_element"] <= rows["dgc"]["bits_per_element"] <= rows["topk"]["bits_per_element"]

    # The x fp16 reference is the per-tensor fp16 round trip into reused buffers: 1.0 by construction.
    references = {row["name"]: row for row in result["references"]}
    assert result["reference"] == "fp16_per_layer"
    assert set(references) == {"fp16_per_layer", "torch_topk_flat", "segment_topk_flat", "fp16_flat_alloc"}
    assert "reused buffers" in references["fp16_per_layer"]["description"]
    fp16 = references["fp16_per_layer"]
    assert fp16["x_fp16_wall"] == 1.0
    assert fp16["x_fp16_cpu"] == (1.0 if fp16["cpu_ms"] > 0 else None)
    assert references["torch_topk_flat"]["x_torch_topk_wall"] == 1.0
    assert references["fp16_per_layer"]["bits_per_element"] == 16
    assert references["torch_topk_flat"]["bits_per_element"] is None

    # Wall and CPU time for every candidate, one run per round, ratios over the reference's medians.
    for row in result["references"] + result["rows"]:
        assert len(row["wall_ms_runs"]) == len(row["cpu_ms_runs"]) == result["repeats"] == 1
        assert row["wall_ms"] > 0 and row["cpu_ms"] >= 0  # CPU time ticks coarsely on some kernels
        assert row["x_fp16_wall"] == pytest.approx(row["wall_ms"] / fp16["wall_ms"])
        if fp16["cpu_ms"] > 0:  # None when the reference took less than the CPU clock's tick
            assert row["x_fp16_cpu"] == pytest.approx(row["cpu_ms"] / fp16["cpu_ms"])
    assert result["schedule"] == [row["name"] for row in result["references"] + result["rows"]]
    assert result["schedule"][0] == "fp16_per_layer"

    # Noise indicators: load average before and after, torch's threads.
    assert len(result["load_average_start"]) == len(result["load_average_end"]) == 3
    assert result["threads"] >= 1 and result["cpu_time"] == "process"
    printed = capsys.readouterr().out
    assert "| topk |" in printed and "| ref: fp16_per_layer |" in printed and "load average" in printed
    assert "x fp16 wall" in printed and "x fp16 CPU" in printed


def test_min_numel_leaves_small_tensors_out_of_compressors_and_references(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["compressors", "--numel", "100", "5000", "--min-numel", "1024", "--repeats", "1", "--only", "topk"]
    main([*argv, "--json", str(out)])
    result = json.loads(out.read_text())
    assert (result["numel"], result["tensors"], result["min_numel"]) == (5000, 1, 1024)
    assert [row["compressor"] for row in result["rows"]] == ["topk", "topk_per_tensor", "topk_bucketed"]
    assert result["rows"][0]["bits_per_element"] == 64 * 5 / 5000  # density 0.001 by default: k = 5


def test_schedule_interleaves_every_candidate_once_per_round():
    from lgc.bench.compressors import interleaved_schedule

    names = ["fp16_per_layer", "torch_topk_flat", "topk", "dgc"]
    rounds = interleaved_schedule(names, repeats=3)
    assert rounds == [names, names, names]  # reference first, then A, B, ... ; again, not A A A B B B
    with pytest.raises(ValueError, match="repeats"):
        interleaved_schedule(names, repeats=0)
    with pytest.raises(ValueError, match="unique"):
        interleaved_schedule(["topk", "topk"], repeats=1)


def test_golomb_section_measures_the_code_against_its_formula_and_the_entropy_bound():
    from lgc.bench.compressors import golomb_bits

    rows = golomb_bits(2_000_000, ps=(0.01, 0.001))
    for row in rows:
        assert row["positions"] == pytest.approx(row["p"] * 2_000_000, rel=0.1)
        assert row["bits_per_position"] == pytest.approx(row["expected_bits"], rel=0.01)
        assert row["bits_per_position"] == pytest.approx(row["entropy_bits"], rel=0.02)
    assert [row["b"] for row in rows] == [6, 9]


def test_help_is_plain_text_and_loads_no_training_stack():
    # In a fresh interpreter: this test process has Lightning loaded already.
    code = """
import sys
from lgc.bench.cli import main
commands = ([], ["compressors"], ["autoencoder"], ["network"], ["model"], ["step"])
for argv in ([*command, "--help"] for command in commands):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = ("pytorch_lightning", "lightning_fabric", "torchvision", "torchmetrics", "wandb", "hydra", "lgc.analysis")
print("loaded:", sorted(name for name in heavy if name in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "loaded: []"
    assert "encode + decode time and bits per element" in out and "``" not in out and ":func:" not in out


def test_step_methods_take_nested_knobs_and_bad_ones_are_named():
    from lgc.bench.methods import parse_methods, parse_overrides

    specs = parse_methods("none,lgc_rar:density=0.001;training.autoencoder.encoder_channels=[16,32,64,16],dgc")
    assert [spec.name for spec in specs] == ["none", "lgc_rar", "dgc"]
    assert specs[1].knobs == {"density": 0.001, "training": {"autoencoder": {"encoder_channels": [16, 32, 64, 16]}}}
    assert specs[1].label == "lgc_rar:density=0.001;training.autoencoder.encoder_channels=[16,32,64,16]"
    with pytest.raises(ValueError, match="unknown method 'lgc_rarr'"):
        parse_methods("lgc_rarr")
    with pytest.raises(ValueError, match="names a method twice"):
        parse_methods("dgc,dgc")
    assert parse_methods("ddp,dgc", plain=("ddp",))[0] == ("ddp", "ddp", {})
    with pytest.raises(ValueError, match="'ddp' takes no knobs"):
        parse_methods("ddp:x=1", plain=("ddp",))
    with pytest.raises(ValueError, match="key=value, got 'density'"):
        parse_overrides("density")
    with pytest.raises(ValueError, match="sets a field of 'a'"):
        parse_overrides("a=1;a.b=2")


def test_autoencoder_benchmark_names_a_bad_architecture_before_recording():
    with pytest.raises(SystemExit, match="decoder must be one of .* got 'bilinear'"):
        main(["autoencoder", "--architecture", "odd:decoder=bilinear"])
    with pytest.raises(SystemExit, match="--orders must name some of"):
        main(["autoencoder", "--orders", "sideways"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_step_benchmark_times_lgc_past_its_stages_against_no_communication(tmp_path):
    """``lgc-bench step`` on a small ResNet-18 step: every row timed, no-comm the reference (1.0)."""
    out = tmp_path / "step.json"
    narrow = "lgc_rar:training.autoencoder.encoder_channels=[8,8,8,8];training.autoencoder.decoder_channels=[8,8,8,8]"
    main(
        ["step", "--model", "resnet18", "--image-size", "32", "--batch-size", "2", "--density", "0.01",
         "--steps", "2", "--rounds", "1", "--methods", f"topk,{narrow},sbc:delay=2", "--json", str(out)]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["no_sync", "topk", narrow, "sbc:delay=2"]
    assert rows["no_sync"]["cpu_x"] == rows["no_sync"]["mean_cpu_x"] == 1.0
    assert all(row["cpu_s"] > 0 and row["wall_s"] > 0 and row["mean_cpu_s"] > 0 for row in rows.values())
    # The arithmetic: top-k and SBC add none to the model's; LGC-RAR's codec adds its convolutions.
    assert rows["topk"]["gflop"] == rows["sbc:delay=2"]["gflop"] == rows["no_sync"]["gflop"] > 0
    assert rows[narrow]["gflop_x"] > 1.0


def test_step_on_cuda_wants_one_gpu_per_worker_before_any_worker_starts(no_workers, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device is available"):
        main(["step", "--device", "cuda"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="one NCCL worker per GPU: --workers 2, but 1 GPU"):
        main(["step", "--device", "cuda", "--workers", "2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_step_benchmark_on_a_gpu_over_nccl(tmp_path):
    out = tmp_path / "step.json"
    main(
        ["step", "--device", "cuda", "--workers", "1", "--model", "resnet18", "--image-size", "32",
         "--steps", "2", "--rounds", "1", "--methods", "topk,dgc", "--json", str(out)]
    )  # fmt: skip
    table = json.loads(out.read_text())
    assert table["device"] == "cuda" and list(table["rows"]) == ["no_sync", "topk", "dgc"]
    assert all(row["wall_s"] > 0 for row in table["rows"].values())


def test_step_rows_read_a_delayed_method_by_its_mean_and_every_step_method_by_its_median():
    from lgc.bench.step_rows import step_rows

    # Two ranks, four timed steps each: no_sync steps 1.0 s; a delay of 4 exchanges once (5.0 s).
    per_rank = [
        {"no_sync": [[1.0, 0.5]] * 4, "sbc:delay=4": [[1.0, 0.5], [1.0, 0.5], [1.0, 0.5], [5.0, 2.5]]},
        {"no_sync": [[1.0, 0.5]] * 4, "sbc:delay=4": [[1.0, 0.5], [1.0, 0.5], [1.0, 0.5], [6.0, 2.5]]},
    ]
    rows = step_rows(per_rank)
    assert rows["no_sync"] == {
        "wall_s": 1.0, "cpu_s": 1.0, "mean_wall_s": 1.0, "mean_cpu_s": 1.0,
        "wall_x": 1.0, "cpu_x": 1.0, "mean_wall_x": 1.0, "mean_cpu_x": 1.0,
    }  # fmt: skip
    delayed = rows["sbc:delay=4"]
    assert delayed["wall_s"] == delayed["wall_x"] == 1.0 and delayed["cpu_s"] == 1.0  # the median: a local step
    assert delayed["mean_wall_s"] == 9.0 / 4  # the slower rank's mean, its exchange included
    assert delayed["mean_cpu_s"] == delayed["mean_cpu_x"] == (1.0 + 1.0 + 1.0 + 5.0) / 4


def test_step_rows_give_each_methods_cpu_over_ddps_round_by_round_with_an_interval():
    from scipy.stats import t

    from lgc.bench.step_rows import step_rows

    # Two ranks, 3 rounds of 2 steps; DDP's CPU per step 1.0, 2.0, 1.0 by round; topk 1.2x, 2.6x, 1.1x it.
    def timeline(per_round: list[float]) -> list[list[float]]:
        return [[0.1, cpu / 2] for cpu in per_round for _ in range(2)]

    per_rank = [
        {"no_sync": timeline([0.8] * 3), "ddp": timeline([1.0, 2.0, 1.0]), "topk": timeline([1.2, 2.6, 1.1])}
        for _ in range(2)
    ]
    rows = step_rows(per_rank, rounds=3)
    ratios = rows["topk"]["cpu_vs_ddp"]["rounds"]
    assert ratios == pytest.approx([1.2, 1.3, 1.1])
    assert rows["topk"]["cpu_vs_ddp"]["mean"] == pytest.approx(1.2)
    assert rows["topk"]["cpu_vs_ddp"]["half_width"] == pytest.approx(t.ppf(0.975, 2) * 0.1 / 3**0.5)
    assert rows["ddp"]["cpu_vs_ddp"]["mean"] == 1.0 and rows["ddp"]["cpu_vs_ddp"]["half_width"] == 0.0
    # Without DDP's row, or with one round, there is nothing to pair.
    assert "cpu_vs_ddp" not in step_rows(per_rank, rounds=1)["topk"]
    assert "cpu_vs_ddp" not in step_rows([{k: v for k, v in r.items() if k != "ddp"} for r in per_rank], 3)["topk"]


def test_a_delayed_method_gets_an_interval_only_from_rounds_that_hold_whole_delays():
    from lgc.bench.step_rows import step_rows

    # 2 rounds of 4 steps; DDP 1.0 CPU per step. Every 2nd step exchanges (delay 2: 3.0), so every round
    # holds two exchanges; a delay of 8 exchanges once, in the second round only.
    def timeline(steps: list[float]) -> list[list[float]]:
        return [[0.1, cpu / 2] for cpu in steps]

    local, every_2, every_8 = [1.0] * 8, [1.0, 3.0] * 4, [1.0] * 7 + [9.0]
    per_rank = [
        {"no_sync": timeline(local), "ddp": timeline(local), "a:delay=2": timeline(every_2),
         "b:delay=8": timeline(every_8)}
        for _ in range(2)
    ]  # fmt: skip
    rows = step_rows(per_rank, rounds=2, delays={"a:delay=2": 2, "b:delay=8": 8})
    assert rows["a:delay=2"]["cpu_vs_ddp"]["rounds"] == pytest.approx([2.0, 2.0])
    # Its rounds would read 1.0 and 3.0: where its one exchange fell, not noise. Its mean still counts it.
    assert "cpu_vs_ddp" not in rows["b:delay=8"] and rows["b:delay=8"]["mean_cpu_x"] == pytest.approx(2.0)
    assert "cpu_vs_ddp" in step_rows(per_rank, rounds=2)["b:delay=8"]  # without the delays, every row is paired


@pytest.mark.slow
@pytest.mark.multiprocess
def test_step_benchmark_times_the_model_sharded_with_fsdp2_beside_ddp(tmp_path):
    """``--fsdp``: the same ResNet-18 sharded with FSDP2, its own reduce-scatter (``fsdp``) and lgc's; ``--hsdp``:
    hybrid-sharded (two replicas of one worker here), FSDP2's own HSDP (``hsdp``) and lgc's all-reduce across the
    replicas; all timed in the same rounds as DDP's step, each with its CPU ratio to DDP's."""
    out = tmp_path / "step.json"
    main(
        ["step", "--model", "resnet18", "--image-size", "32", "--batch-size", "2", "--steps", "1", "--rounds", "2",
         "--methods", "ddp", "--fsdp", "fsdp,fp16,topk", "--hsdp", "hsdp,topk", "--json", str(out)]
    )  # fmt: skip
    table = json.loads(out.read_text())
    rows = table["rows"]
    assert table["provenance"]["commit"] and table["provenance"]["dirty"] in (True, False), "the commit it timed"
    sharded = ["fsdp", "fsdp/fp16", "fsdp/topk", "hsdp", "hsdp/topk"]
    assert list(rows) == ["no_sync", "ddp", *sharded]
    assert all(row["cpu_s"] > 0 for row in rows.values())
    assert all("cpu_vs_ddp" in rows[label] for label in sharded)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_step_benchmark_times_hsdp_on_a_2x2_mesh(tmp_path):
    """``--hsdp`` on 4 workers as 2 replicas of 2 (the sharded comparison's mesh): FSDP2's own HSDP and lgc's top-k
    across the replicas, each with its CPU ratio to DDP's step, and the same arithmetic per worker (top-k adds
    no matrix products)."""
    out = tmp_path / "step.json"
    main(
        ["step", "--model", "resnet18", "--image-size", "32", "--batch-size", "2", "--steps", "1", "--rounds", "2",
         "--workers", "4", "--shard-size", "2", "--methods", "ddp", "--hsdp", "hsdp,topk", "--json", str(out)]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["no_sync", "ddp", "hsdp", "hsdp/topk"]
    assert all("cpu_vs_ddp" in rows[label] for label in ("hsdp", "hsdp/topk"))
    assert rows["hsdp/topk"]["gflop"] == rows["hsdp"]["gflop"] == rows["ddp"]["gflop"] > 0


def test_step_fsdp_rows_are_refused_on_one_worker_before_any_worker_starts(no_workers):
    with pytest.raises(SystemExit, match="--fsdp shards the model over the workers"):
        main(["step", "--workers", "1", "--fsdp", "topk"])
    with pytest.raises(SystemExit, match="--fsdp: unknown method 'topkk'"):
        main(["step", "--fsdp", "topkk"])
    with pytest.raises(SystemExit, match="--hsdp: unknown method 'topkk'"):
        main(["step", "--hsdp", "topkk"])
    for workers, shard_size in (("1", None), ("5", None), ("4", "3"), ("4", "4"), ("4", "0")):
        argv = ["step", "--workers", workers, "--hsdp", "topk", *(["--shard-size", shard_size] if shard_size else [])]
        with pytest.raises(SystemExit, match="must form two or more replicas"):
            main(argv)
    with pytest.raises(SystemExit, match="--shard-size 2 sizes the replicas of --hsdp, which is not given"):
        main(["step", "--workers", "4", "--shard-size", "2", "--fsdp", "topk"])
    # What lgc.compress would refuse in every worker, refused before any starts, naming the row.
    refused = {
        ("--fsdp", "lgc_rar"): "codes the all-reduce across replicas",
        ("--fsdp", "sbc:delay=4"): "communication delay under FSDP2 needs hybrid sharding",
        ("--hsdp", "torch_fp16"): "runs an lgc compressor every step",
        ("--hsdp", "topk:overlap=true"): "overlap",
        ("--hsdp", "lgc_rar:delay=4"): "codes whole parameters",
        ("--fsdp", "topk:densty=0.1"): "has no knob 'densty'",
    }
    for (flag, method), message in refused.items():
        with pytest.raises(SystemExit, match=rf"{flag} .*{message}"):
            main(["step", "--workers", "4", flag, method])


def _counted_steps(rank: int, world_size: int) -> dict[str, float]:
    """One counted step of a small model without communication and through LGC-RAR's compressed stage."""
    import copy
    import math

    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.flop_counter import FlopCounterMode

    import lgc
    from lgc.bench.step import _counted_flops

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x, y = torch.randn(8, 256), torch.randint(10, (8,))
    plain = DistributedDataParallel(copy.deepcopy(base))
    model = DistributedDataParallel(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = lgc.compress(
        model, "lgc_rar", optimizer=opt, density=0.01, stages={"warmup_steps": 1, "ae_steps": 1},
        training={"updates_per_step": 1, "autoencoder": {"width": 0.25}},
    )  # fmt: skip
    runs = {"plain": (plain, torch.optim.SGD(plain.parameters(), lr=0.01)), "lgc_rar": (model, opt)}

    def step(label: str) -> None:
        net, optimizer = runs[label]
        optimizer.zero_grad()
        if label == "plain":
            with net.no_sync():
                torch.nn.functional.cross_entropy(net(x), y).backward()
        else:
            torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    for _ in range(state.steady_from() + 1):
        step("lgc_rar")
    assert state.metrics()["lgc/stage"] == 3.0  # the compressed stage
    counted = {label: _counted_flops(step, label) for label in runs}
    # The codec's arithmetic on its own: every worker encodes its chunks and decodes its own and the mean latent.
    ae, chunk = state.autoencoder, state.leader_code.chunk
    k = sum(math.ceil(0.01 * p.numel()) for p in base.parameters() if p.numel() >= state.min_numel)
    rows = math.ceil(k / chunk)
    with torch.no_grad(), FlopCounterMode(display=False) as codec:
        ae.decode(torch.cat([ae.encode(torch.zeros(rows, chunk))] * 2))
    return {**counted, "codec": float(codec.get_total_flops())}


@pytest.mark.multiprocess
def test_a_counted_step_holds_the_models_arithmetic_and_the_codecs_through_the_hook():
    """``lgc-bench step``'s GFLOP column: the hook's codec work is counted, to the operation."""
    for counted in run_workers(_counted_steps, 2):
        assert counted["codec"] > counted["plain"] > 0
        assert counted["lgc_rar"] == counted["plain"] + counted["codec"]


def test_flop_rows_give_the_most_of_any_rank_over_no_communications():
    from lgc.bench.step_rows import flop_rows

    rows = {"no_sync": {}, "topk": {}, "lgc_rar": {}}
    flop_rows(rows, [{"no_sync": 2e9, "topk": 2e9, "lgc_rar": 5e9}, {"no_sync": 2e9, "topk": 2e9, "lgc_rar": 6e9}])
    assert rows == {
        "no_sync": {"gflop": 2.0, "gflop_x": 1.0},
        "topk": {"gflop": 2.0, "gflop_x": 1.0},
        "lgc_rar": {"gflop": 6.0, "gflop_x": 3.0},
    }


def test_a_delay_is_counted_over_a_delays_worth_of_steps():
    """A method that exchanges every fourth step: its exchange's arithmetic counts at a quarter per step."""
    from lgc.bench.step import _counted_flops

    calls = []

    def step(label: str) -> None:
        calls.append(label)
        if len(calls) % 4 == 0:  # the exchange: one 8x8 by 8x8 product, 2 * 8**3 operations
            torch.ones(8, 8) @ torch.ones(8, 8)

    assert _counted_flops(step, "sbc:delay=4", 4) == 2 * 8**3 / 4
    assert calls == ["sbc:delay=4"] * 4
