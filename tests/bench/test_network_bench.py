"""``lgc-bench network``: bad input refused before anything is built, the per-method summary, a real run (slow)."""

import json
import re
import shutil
import subprocess

import pytest

from lgc.bench import netns, network_results
from lgc.bench.cli import main
from lgc.bench.network_worker import build_model


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
    ],
)
def test_bad_values_are_named_before_any_namespace_exists(nothing_built, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["network", *argv])
    assert re.search(message, str(exit_info.value.code))


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


def _rank(method, steps, compute, accuracies, wire_per_step, encode=None):
    return {
        "spec": {"method": method},
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
    saved = json.loads((tmp_path / "network.json").read_text())
    rows = {row["method"]: row for row in saved["results"]["2 workers, 1gbit"]}
    assert set(rows) == {"none", "topk"}
    # Dense fp32 with 2 workers: the ring sends the whole model once per step.
    assert rows["none"]["wire_bytes_per_step"] == pytest.approx(
        4 * saved["raw"]["2 workers, 1gbit"]["none"][0]["ranks"][0]["parameters"], rel=0.01
    )
    assert rows["topk"]["wire_bytes_per_step"] < rows["none"]["wire_bytes_per_step"] / 10
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
    assert rows["none"]["predicted_comm_s"] == pytest.approx(ring + buffers, rel=1e-6)
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
