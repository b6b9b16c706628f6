"""``lgc-bench network``: bad input refused before anything is built, the per-method summary, a real run (slow)."""

import json
import re
import shutil
import subprocess

import pytest
import torch
from distributed import run_workers
from scipy import stats

from lgc.bench import netns, network, network_results
from lgc.bench.cli import main
from lgc.bench.network_worker import build_model, lr_factor


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if a shaped network is built or a network check runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("the network was touched before the bad value was reported")

    monkeypatch.setattr(netns.ShapedNetwork, "__enter__", refuse)
    monkeypatch.setattr(netns, "check_available", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "none,nosuch"], r"unknown method 'nosuch'"),
        (["--methods", "demo:lr=-1"], r"demo:lr=-1: lr must be a non-negative number, got -1"),
        (["--bandwidth", "fast"], "fast"),
        (["--task", "vgg"], "--task must be one of"),
        (["--steps", "5", "--skip", "5"], r"--skip must be in \[0, --steps=5\)"),
        (["--workers", "0"], r"--workers must be >= 2"),
        (["--workers", "4,x"], "--workers must be comma-separated integers, got '4,x'"),
        (["--seeds", "0,x"], "--seeds must be comma-separated integers, got '0,x'"),
        (["--seeds", "1,1"], "--seeds must be distinct non-negative integers, got '1,1'"),
    ],
)
def test_bad_values_are_named_before_any_namespace_exists(nothing_built, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["network", *argv])
    assert re.search(message, str(exit_info.value.code))


def test_fashion_mnist_missing_is_refused_before_any_namespace_exists(nothing_built, tmp_path, monkeypatch):
    monkeypatch.setenv("FASHION_MNIST_ROOT", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["network", "--task", "fashion_mnist"])
    assert "Fashion-MNIST file" in str(exit_info.value.code) and "apt-get install dataset-fashion-mnist" in str(
        exit_info.value.code
    )


def test_without_root_it_says_what_is_missing_and_exits_with_status_2(monkeypatch, capsys):
    def unavailable(**kwargs):
        raise netns.NetworkUnavailable(
            "a shaped network needs root (network namespaces, veth, tc); running as uid 1000"
        )

    monkeypatch.setattr(netns, "check_available", unavailable)
    monkeypatch.setattr(netns.ShapedNetwork, "__enter__", lambda self: pytest.fail("built a network without root"))
    with pytest.raises(SystemExit) as exit_info:
        main(["network", "--methods", "none"])
    assert exit_info.value.code == 2
    assert "needs root" in capsys.readouterr().err


def _rank(method, steps, compute, accuracies, wire_per_step, encode=None, seed=0):
    return {
        "spec": {"method": method, "seed": seed},
        "compute_s": compute,
        "steps": [
            {
                "wall_s": wall,
                "cpu_s": wall / 2,
                "wire_bytes_sent": wire_per_step,
                "encode_s": encode,
                "decode_s": encode,
            }
            for wall in steps
        ],
        "evaluations": [
            {"step": 10 * (i + 1), "training_s": 1.0 * (i + 1), "accuracy": accuracy}
            for i, accuracy in enumerate(accuracies)
        ],
        "stats": {"wire_bytes_sent": wire_per_step * len(steps)},
    }


def test_summary_takes_medians_after_the_skipped_steps_and_the_first_evaluation_at_the_target():
    ranks = [
        _rank("topk", [9.0, 0.10, 0.30, 0.20], 0.05, [0.5, 0.91, 0.95], 1000, encode=0.01),
        _rank("topk", [9.0, 0.20, 0.40, 0.30], 0.07, [None, None, None], 1000, encode=0.01),
    ]
    measurement = {"ranks": ranks, "interfaces": {0: {"tx_bytes": 4400}, 1: {"tx_bytes": 4200}}}
    row = network_results.summarize(measurement, target=0.9, skip=1)
    assert row["step_s"] == pytest.approx(0.25)  # median of 0.1, 0.3, 0.2, 0.2, 0.4, 0.3
    assert row["compute_s"] == pytest.approx(0.06)
    assert row["encode_s"] == row["decode_s"] == pytest.approx(0.01)
    assert row["comm_s"] == pytest.approx(0.25 - 0.06 - 0.02)
    assert row["time_to_target_s"] == 2.0 and row["steps_to_target"] == 20
    assert row["final_accuracy"] == 0.95
    assert row["interface_over_wire"] == pytest.approx(8600 / 8000)
    table = network_results.step_table([row], 0.9)
    assert table.splitlines()[0].count("|") == table.splitlines()[2].count("|")
    assert "| topk | 250.0 |" in table


def test_accuracy_at_equal_wire_bytes_reads_every_curve_at_the_thriftiest_methods_total():
    def row(method, wire_per_step, accuracies):
        ranks = [_rank(method, [0.1] * 30, 0.05, accuracies, wire_per_step) for _ in range(2)]
        return network_results.summarize({"ranks": ranks, "interfaces": {}}, target=0.9, skip=0)

    cheap, dear = row("cheap", 10, [0.5, 0.6, 0.7]), row("dear", 100, [0.8, 0.9, 0.95])
    assert cheap["byte_curve"] == [(100, 0.5), (200, 0.6), (300, 0.7)]
    assert dear["byte_curve"] == [(1000, 0.8), (2000, 0.9), (3000, 0.95)]
    assert network_results.accuracy_at_bytes(dear, 2500) == 0.9 and network_results.accuracy_at_bytes(dear, 999) is None
    assert cheap["mean_step_s"] == pytest.approx(3.0 / 30)  # the last evaluation's training seconds over the steps
    table = network_results.equal_bytes_table([cheap, dear])
    assert "at most 0.000 MB" in table and "| cheap | 0.7000 |" in table and "| dear | - |" in table


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2")
def test_two_workers_over_a_shaped_link_report_every_method_and_leave_nothing_behind(tmp_path):
    try:
        netns.check_available()
    except netns.NetworkUnavailable as error:
        pytest.skip(str(error))
    main(
        [
            "network", "--workers", "2", "--bandwidth", "1gbit", "--methods", "none,topk",
            "--steps", "12", "--eval-every", "6", "--skip", "2", "--target", "0.3", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    saved = network.read_record(tmp_path / network.RECORD)
    rows = {row["method"]: row for row in saved["results"]["2 workers, 1gbit"]}
    assert set(rows) == {"none", "topk"}
    # Dense fp32 with 2 workers: the ring sends the whole model once per step.
    assert rows["none"]["wire_bytes_per_step"] == pytest.approx(
        4 * saved["raw"]["2 workers, 1gbit"]["none"][0]["ranks"][0]["parameters"], rel=0.01
    )
    assert rows["topk"]["wire_bytes_per_step"] < rows["none"]["wire_bytes_per_step"] / 10
    # The learning rate fell along the cosine, step by step, from --lr (0.05) towards 0.
    lrs = [step["lr"] for step in saved["raw"]["2 workers, 1gbit"]["none"][0]["ranks"][0]["steps"]]
    assert lrs == pytest.approx([0.05 * lr_factor("cosine", step, 12) for step in range(12)], rel=1e-5)
    assert lrs[0] == 0.05 and lrs[-1] < 0.001
    # The interfaces carried what lgc counted, plus framing, rendezvous and barriers.
    for row in rows.values():
        assert 1.0 < row["interface_over_wire"] < 2.0
    # The cost model: a link fitted on plain collectives, a prediction for every method's step.
    fitted = saved["calibrations"]["2 workers, 1gbit"]
    assert 0 < fitted["bytes_per_s"] * 8 < 1.2e9 and fitted["latency_s"] >= 0
    for row in rows.values():
        assert row["predicted_step_s"] > row["predicted_comm_s"] > 0 and row["profile_compute_s"] > 0
    # Dense's one bucket, a ring allreduce among 2: two rounds of half the model each, on the fitted link;
    # then rank 0's BatchNorm statistics, one broadcast (a round of its bytes among 2) per dtype.
    half = 4 * saved["raw"]["2 workers, 1gbit"]["none"][0]["ranks"][0]["parameters"] // 2
    ring = 2 * (fitted["latency_s"] + half / fitted["bytes_per_s"])
    per_dtype = {}
    for buffer in build_model("digits").buffers():
        per_dtype[buffer.dtype] = per_dtype.get(buffer.dtype, 0) + buffer.numel() * buffer.element_size()
    buffers = sum(fitted["latency_s"] + nbytes / fitted["bytes_per_s"] for nbytes in per_dtype.values())
    # (the record keeps 6 significant digits of each figure)
    assert rows["none"]["predicted_comm_s"] == pytest.approx(ring + buffers, rel=2e-5)
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0
    assert "| none |" in (tmp_path / "network.md").read_text()
    assert "lgc-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_the_report_names_the_model_every_accuracy_was_measured_on():
    def row(method, eval_model):
        ranks = [_rank(method, [0.1] * 4, 0.05, [0.5], 10) for _ in range(2)]
        if eval_model is not None:
            for rank in ranks:
                rank["eval_model"] = eval_model
        return network_results.summarize({"ranks": ranks, "interfaces": {}}, target=0.9, skip=0)

    rows = [row("none", "global"), row("sparseloco:delay=10", "global"), row("old", None)]
    assert [r["eval_model"] for r in rows] == ["global", "global", None]
    line = network_results.eval_line(rows)
    assert "synchronized (global) model" in line and "(none, sparseloco:delay=10)" in line
    assert "does not name (rank 0's own weights) (old)" in line


def test_time_to_target_over_seeds_is_read_against_the_no_communication_bound():
    def run(method, seed, compute, accuracies, wall=0.1):
        # Evaluations every 10 steps, 1 s of training each (the _rank helper); ranks alike.
        ranks = [_rank(method, [wall] * 30, compute, accuracies, 100, seed=seed) for _ in range(2)]
        return {"ranks": ranks, "interfaces": {}}

    per = {
        # Dense reaches 0.9 at step 20 on seed 0 and step 30 on seed 1; compute-only steps of 10 and 20 ms.
        "none": [run("none", 0, 0.010, [0.5, 0.9, 0.95]), run("none", 1, 0.020, [0.5, 0.8, 0.9])],
        # topk reaches it at 3 s on seed 0 and never on seed 1.
        "topk": [run("topk", 0, 0.010, [0.5, 0.8, 0.9]), run("topk", 1, 0.020, [0.5, 0.8, 0.85])],
    }
    result = network_results.over_seeds(per, target=0.9, skip=0)
    # The bound: steps to target x compute-only step, seed by seed: 20 x 10 ms and 30 x 20 ms.
    assert [b["bound_s"] for b in result["bound_by_seed"]] == [pytest.approx(0.2), pytest.approx(0.6)]
    assert result["bound_s"]["mean"] == pytest.approx(0.4) and result["bound_s"]["n"] == 2
    dense, topk = result["methods"]
    assert dense["reached"] == 2 and dense["time_to_target_s"]["values"] == [2.0, 3.0]
    # Each time over its own seed's bound, then the interval: 2 / 0.2 and 3 / 0.6.
    assert dense["x_bound"]["values"] == [pytest.approx(10.0), pytest.approx(5.0)]
    assert dense["x_bound"]["half_width"] == pytest.approx(stats.t.ppf(0.975, 1) * stats.sem([10.0, 5.0]))
    # A seed that never reached the target counts in `reached` and stays out of the intervals.
    assert topk["reached"] == 1 and topk["time_to_target_s"]["values"] == [3.0]
    assert topk["x_bound"]["values"] == [pytest.approx(15.0)] and topk["x_bound"]["half_width"] is None
    assert topk["final_accuracy"]["values"] == [0.9, 0.85]
    table = network_results.seeds_table(result)
    assert "| topk | 1/2 | 3.0 | 15.00 | 0.8750 ± " in table
    assert "No-communication bound: dense's steps to 0.9" in table and "seed 1: 30 steps x 20.0 ms" in table
    # Without dense there is no bound, and the table says so.
    alone = network_results.over_seeds({"topk": per["topk"]}, target=0.9, skip=0)
    assert alone["bound_s"] is None and alone["methods"][0]["x_bound"] is None
    assert "No no-communication bound" in network_results.seeds_table(alone)


def _evaluate_on_each_rank(rank, world, folder, perturb):
    from lgc.bench.network_worker import WorkerSpec, _evaluate, load_task_data

    torch.manual_seed(0)
    model = build_model("fashion_mnist")
    if perturb and rank == 1:
        with torch.no_grad():
            model.fc.bias.add_(1e-3)
    _, _, images, labels = load_task_data(WorkerSpec("none", task="fashion_mnist", data_root=folder))
    try:
        return _evaluate(model, images, labels)
    except RuntimeError as error:
        return str(error)


@pytest.mark.slow
def test_fashion_mnist_is_evaluated_on_every_image_shared_between_ranks_holding_the_same_model(tmp_path):
    from test_fashion_mnist import write_fashion_mnist

    from lgc.bench.network_worker import WorkerSpec, load_task_data
    from lgc.data.fashion_mnist import prepare_fashion_mnist

    write_fashion_mnist(tmp_path / "raw")
    folder = str(prepare_fashion_mnist(tmp_path / "raw", tmp_path / "cache"))
    images, labels, val_images, val_labels = load_task_data(WorkerSpec("none", task="fashion_mnist", data_root=folder))
    assert images.shape == (64, 1, 28, 28) and val_images.shape == (16, 1, 28, 28) and images.dtype == torch.float32
    # One process evaluating all 16 images, against two ranks evaluating 8 each.
    torch.manual_seed(0)
    model = build_model("fashion_mnist").eval()
    with torch.no_grad():
        expected = int((model(val_images).argmax(dim=1) == val_labels).sum()) / 16
    assert run_workers(_evaluate_on_each_rank, 2, folder, False) == [expected, expected]
    # Different models on the ranks: an error on every rank, not an average over two models.
    assert all("different models" in r for r in run_workers(_evaluate_on_each_rank, 2, folder, True))


def test_seeds_are_summarized_each_on_its_own_steady_steps_then_combined():
    def run(seed, walls, accuracies, steady_from):
        ranks = [_rank("lgc_rar", walls, 0.05, accuracies, 100, seed=seed) for _ in range(2)]
        for rank in ranks:
            rank["steady_from"] = steady_from
        return network_results.summarize({"ranks": ranks, "interfaces": {}}, target=0.9, skip=0)

    # Seed 1's first two steps are its codec-training stage (slow): left out of its own medians.
    rows = [run(0, [0.1] * 30, [0.5, 0.9, 0.95], 0), run(1, [5.0, 5.0] + [0.3] * 28, [0.5, 0.8, 0.85], 2)]
    combined = network_results.combine_seeds(rows)
    assert combined["step_s"] == pytest.approx((0.1 + 0.3) / 2)  # the median of the seeds' medians
    assert combined["mean_step_s"] == pytest.approx((rows[0]["mean_step_s"] + rows[1]["mean_step_s"]) / 2)
    # Only seed 0 reached 0.9 (at 2 s, step 20); the final accuracy is the mean of 0.95 and 0.85.
    assert (combined["time_to_target_s"], combined["steps_to_target"]) == (2.0, 20)
    assert combined["final_accuracy"] == pytest.approx(0.9) and combined["seeds"] == 2
    assert network_results.combine_seeds(rows[:1]) == rows[0]


class _NoNetwork:
    """A ShapedNetwork that builds nothing (the measurement itself is replaced too)."""

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _measure_offline(monkeypatch, measure, calibrate=lambda net, args, folder: {"samples": []}) -> None:
    """lgc-bench network with ``measure`` and ``calibrate`` in place of the workers and the network."""
    monkeypatch.setattr(netns, "check_available", lambda **kwargs: None)
    monkeypatch.setattr(netns, "ShapedNetwork", _NoNetwork)
    monkeypatch.setattr(network, "_calibrate", calibrate)
    monkeypatch.setattr(
        network, "_fitted_link", lambda calibration, workers: type("L", (), {"latency_s": 0.0, "bytes_per_s": 1.0})
    )
    monkeypatch.setattr(network, "_measure", measure)


def test_measurements_are_kept_when_the_report_cannot_be_made(tmp_path, monkeypatch):
    def measure(net, spec, timeout, folder):
        ranks = [_rank(spec["method"], [0.1] * 4, 0.05, [0.5], 10, seed=spec["seed"]) for _ in range(2)]
        for rank in ranks:
            rank["steady_from"] = 10  # its stages outlast the 4 steps measured
        return {"ranks": ranks, "interfaces": {}}

    _measure_offline(monkeypatch, measure)
    with pytest.raises(SystemExit) as exit_info:
        main(["network", "--workers", "2", "--bandwidth", "1gbit", "--methods", "lgc_rar", "--steps", "4",
              "--skip", "1", "--out", str(tmp_path)])  # fmt: skip
    assert "raise --steps" in str(exit_info.value.code) and "measurements are kept in" in str(exit_info.value.code)
    saved = network.read_record(tmp_path / network.RECORD)
    assert len(saved["raw"]["2 workers, 1gbit"]["lgc_rar"]) == 1


def test_a_rerun_with_the_same_out_measures_only_what_is_missing(tmp_path, monkeypatch):
    measured, calibrated = [], []

    def measure(net, spec, timeout, folder):
        measured.append((spec["method"], spec["seed"]))
        ranks = [_rank(spec["method"], [0.1] * 4, 0.05, [0.5], 10, seed=spec["seed"]) for _ in range(2)]
        for rank in ranks:
            rank["steady_from"] = 10  # no report: only what is kept matters here
        return {"ranks": ranks, "interfaces": {}}

    def calibrate(net, args, folder):
        calibrated.append(folder.name)
        return {"samples": []}

    _measure_offline(monkeypatch, measure, calibrate)
    common = ["network", "--workers", "2", "--bandwidth", "1gbit", "--methods", "none,topk", "--steps", "4",
              "--skip", "1", "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit):
        main([*common, "--seeds", "0"])
    assert sorted(measured) == [("none", 0), ("topk", 0)] and len(calibrated) == 1
    measured.clear()
    with pytest.raises(SystemExit):
        main([*common, "--seeds", "0,1"])
    assert sorted(measured) == [("none", 1), ("topk", 1)] and len(calibrated) == 1  # the kept calibration
    saved = network.read_record(tmp_path / network.RECORD)["raw"]["2 workers, 1gbit"]
    assert [run["ranks"][0]["spec"]["seed"] for run in saved["topk"]] == [0, 1]
    assert all("commit" in run["provenance"] for run in saved["topk"]), "every measurement records its commit"
    measured.clear()
    with pytest.raises(SystemExit, match=r"other training settings \(--schedule cosine there, constant here\)"):
        main([*common, "--seeds", "0,1,2", "--schedule", "constant"])
    with pytest.raises(SystemExit, match=r"other training settings \(--steps 4 there, 6 here\)"):
        main([*common[:-4], "--steps", "6", "--skip", "1", "--out", str(tmp_path), "--seeds", "0,1,2"])
    assert measured == []


def test_a_plain_json_record_is_resumed_and_replaced_by_the_compact_one(tmp_path, monkeypatch):
    # A record kept as plain JSON (every float at full precision) is read, resumed and rewritten
    # gzipped with floats at 6 significant digits; the same record gives the same bytes.
    measured = []

    def measure(net, spec, timeout, folder):
        measured.append((spec["method"], spec["seed"]))
        ranks = [_rank(spec["method"], [0.1234567891] * 4, 0.05, [0.5], 10, seed=spec["seed"]) for _ in range(2)]
        for rank in ranks:
            rank["steady_from"] = 10
        return {"ranks": ranks, "interfaces": {}}

    _measure_offline(monkeypatch, measure, lambda net, args, folder: {"samples": []})
    common = ["network", "--workers", "2", "--bandwidth", "1gbit", "--methods", "none", "--steps", "4",
              "--skip", "1", "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit):
        main([*common, "--seeds", "0"])
    record = network.read_record(tmp_path / network.RECORD)
    (tmp_path / network.RECORD).unlink()
    (tmp_path / "network.json").write_text(json.dumps(record))
    measured.clear()
    with pytest.raises(SystemExit):
        main([*common, "--seeds", "0,1"])
    assert measured == [("none", 1)] and not (tmp_path / "network.json").exists()
    runs = network.read_record(tmp_path / network.RECORD)["raw"]["2 workers, 1gbit"]["none"]
    assert [run["ranks"][0]["spec"]["seed"] for run in runs] == [0, 1]
    assert runs[1]["ranks"][0]["steps"][0]["wall_s"] == 0.123457
    again = tmp_path / "again.json.gz"
    network.write_record(again, network.read_record(tmp_path / network.RECORD))
    network.write_record(tmp_path / "twice.json.gz", network.read_record(tmp_path / network.RECORD))
    assert again.read_bytes() == (tmp_path / "twice.json.gz").read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_the_learning_rate_follows_a_cosine_to_zero_or_stays_constant():
    assert [lr_factor("cosine", step, 4) for step in range(5)] == pytest.approx(
        [1.0, (1 + 2**-0.5) / 2, 0.5, (1 - 2**-0.5) / 2, 0.0]
    )
    assert {lr_factor("constant", step, 4) for step in range(5)} == {1.0}
    with pytest.raises(ValueError, match="schedule must be one of"):
        lr_factor("linear", 0, 4)
    with pytest.raises(SystemExit):
        main(["network", "--schedule", "linear"])
