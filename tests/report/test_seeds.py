"""lgc-report over seeds: groups, Student-t intervals, the gap to dense paired by seed, no ranking."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats
from test_report import STEP, _worker, _write_run

from lgc.report import load_runs, main
from lgc.report.bytes import byte_rows, bytes_table
from lgc.report.seeds import Interval, group_by_seed, plot_seed_groups, seed_rows, seed_table

# Final accuracies by method and seed: topk sits 0.01 below dense every seed; int8 is within noise.
ACCURACY = {
    "none": [0.90, 0.92, 0.91],
    "topk": [0.89, 0.91, 0.90],
    "shared_topk_int8": [0.905, 0.915, 0.912],
}


def _runs(tmp_path, methods=ACCURACY):
    for method, accuracies in methods.items():
        sent = STEP if method == "none" else STEP // 10
        for seed, accuracy in enumerate(accuracies):
            _write_run(
                tmp_path / method / str(seed),
                (f"compressor={method}", f"seed={seed}"),
                "?",
                [_worker(sent * 4, sent)] * 2,
                {"val/acc": accuracy},
                wall_time_s=20.0 + seed,
                step_cpu_time_ms=(30.0 if method == "none" else 40.0) + seed,
            )
    return load_runs([tmp_path])


def test_the_interval_is_students_t_and_a_single_value_has_none():
    values = [0.90, 0.92, 0.91, 0.95]
    interval = Interval.of(values)
    sd = math.sqrt(sum((v - 0.92) ** 2 for v in values) / 3)
    assert interval.n == 4 and interval.mean == pytest.approx(0.92) and interval.sd == pytest.approx(sd)
    assert interval.half_width == pytest.approx(stats.t.ppf(0.975, 3) * sd / 2)
    low, high = stats.t.interval(0.95, 3, loc=0.92, scale=sd / 2)
    assert (interval.low, interval.high) == (pytest.approx(low), pytest.approx(high))
    single = Interval.of([0.9])
    assert (single.sd, single.half_width, single.holds(0.9)) == (None, None, None)
    assert Interval.of([]) is None
    # Equal values (the same bytes every seed) have no spread at all, not a rounding residue.
    assert Interval.of([845.186048] * 3).half_width == 0.0


def test_runs_differing_only_in_seed_form_one_group_in_the_order_met(tmp_path):
    groups = group_by_seed(_runs(tmp_path))
    assert [group.label for group in groups] == ["none", "shared_topk_int8", "topk"]
    assert all(group.seeds == [0, 1, 2] for group in groups)
    assert groups[2].interval("metric").mean == pytest.approx(0.90)


def test_the_gap_to_dense_is_paired_by_seed(tmp_path):
    rows = {row["label"]: row for row in seed_rows(_runs(tmp_path))}
    # topk is exactly 0.01 below dense on every seed: the paired gap has no spread, so it is "below",
    # although the unpaired intervals (0.90 ± 0.025 and 0.91 ± 0.025) overlap.
    topk = rows["topk"]
    assert topk["gap_to_dense"]["mean"] == pytest.approx(-0.01) and topk["gap_to_dense"]["sd"] == pytest.approx(0)
    assert topk["vs_dense"] == "below"
    gaps = [a - b for a, b in zip(ACCURACY["shared_topk_int8"], ACCURACY["none"], strict=True)]
    int8 = rows["shared_topk_int8"]
    low, high = stats.t.interval(0.95, 2, loc=sum(gaps) / 3, scale=stats.sem(gaps))
    assert int8["gap_to_dense"]["ci95"] == [pytest.approx(low), pytest.approx(high)] and low < 0 < high
    assert int8["vs_dense"] == "≈ dense"
    assert rows["none"]["vs_dense"] == "dense" and rows["none"]["gap_to_dense"] is None
    assert topk["wire_ratio_to_dense"] == pytest.approx(10.0)
    assert rows["none"]["val/acc"]["ci95"][0] < 0.91 < rows["none"]["val/acc"]["ci95"][1]


def test_the_table_keeps_the_given_order_and_shows_mean_and_half_width(tmp_path):
    table = seed_table(_runs(tmp_path)).splitlines()
    assert table[0].startswith("| method | n (seeds) | val/acc mean ± 95% CI | sd | gap to dense, paired")
    assert [line.split(" | ")[0].strip("| ") for line in table[2:]] == ["none", "shared_topk_int8", "topk"]
    half = stats.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)
    assert f"| 0.9000 ± {half:.4f} |" in table[4] and "| -0.0100 ± 0.0000 | below |" in table[4]
    assert "| 10.0 |" in table[4] and "| 3 (0, 1, 2) |" in table[4]
    # A training step's CPU time per worker: 40, 41 and 42 ms over the seeds.
    assert f"| 41.0 ± {stats.t.ppf(0.975, 2) * 1.0 / math.sqrt(3):.1f} |" in table[4]


def test_the_plot_draws_each_method_once_with_its_interval_as_an_error_bar(tmp_path):
    figure = plot_seed_groups(_runs(tmp_path))
    axis = figure.axes[0]
    bars = [c for c in axis.containers if type(c).__name__ == "ErrorbarContainer"]
    assert [bar.get_label() for bar in bars] == ["none (n=3)", "shared_topk_int8 (n=3)", "topk (n=3)"]
    # Every method its own colour and marker, and the key beside the axes, not over the points.
    looks = {(bar.lines[0].get_color(), bar.lines[0].get_marker()) for bar in bars}
    assert len(looks) == 3 and len({color for color, _ in looks}) == 3
    assert axis.get_legend().get_bbox_to_anchor().x0 > axis.get_window_extent().x1
    topk = bars[2].lines[0].get_ydata()
    assert topk[0] == pytest.approx(0.90)
    segment = bars[2].lines[2][-1].get_segments()[0]  # the vertical error bar (drawn last): mean ± half-width
    half = stats.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)
    assert (segment[0][1], segment[1][1]) == (pytest.approx(0.90 - half), pytest.approx(0.90 + half))


def test_no_dense_run_on_the_same_task_leaves_the_gap_empty(tmp_path):
    rows = seed_rows(_runs(tmp_path, {"topk": [0.9, 0.91]}))
    assert rows[0]["gap_to_dense"] is None and rows[0]["vs_dense"] == "-" and rows[0]["wire_ratio_to_dense"] is None


def test_the_command_adds_the_table_over_seeds_and_its_json(tmp_path, capsys):
    _runs(tmp_path / "runs")
    main([str(tmp_path / "runs"), "--out", str(tmp_path / "report")])
    out = capsys.readouterr().out
    assert "| method | n (seeds) |" in out
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Over seeds" in report and "Rows are in the order given, not ranked" in report
    assert (tmp_path / "report" / "accuracy_over_seeds.png").stat().st_size > 10_000
    assert "![accuracy over seeds against bytes](accuracy_over_seeds.png)" in report
    rows = json.loads((tmp_path / "report" / "seeds.json").read_text())
    assert [row["label"] for row in rows] == ["none", "shared_topk_int8", "topk"]
    # One seed per method: no table over seeds.
    main([str(tmp_path / "runs" / "none" / "0"), str(tmp_path / "runs" / "topk" / "0")])
    assert "n (seeds)" not in capsys.readouterr().out


def test_diloco_is_compressor_none_with_local_steps_and_not_the_dense_baseline(tmp_path):
    _runs(tmp_path / "runs")
    for seed, accuracy in enumerate([0.89, 0.90, 0.91]):
        _write_run(
            tmp_path / "runs" / "diloco" / str(seed),
            ("compressor=none", "comm=diloco", "comm.delay=4", f"seed={seed}"),
            "?",
            [_worker(STEP, STEP)] * 2,
            {"val/acc": accuracy},
        )
    rows = {row["label"].split()[0] + (" diloco" if "comm=diloco" in row["label"] else ""): row
            for row in seed_rows(load_runs([tmp_path / "runs"]))}  # fmt: skip
    # Still one dense baseline, so every method gets its paired gap, DiLoCo too.
    assert rows["none"]["vs_dense"] == "dense" and rows["none diloco"]["vs_dense"] != "dense"
    assert rows["none diloco"]["gap_to_dense"]["mean"] == pytest.approx(-0.01)
    assert rows["topk"]["vs_dense"] == "below"


def test_where_the_bytes_go_splits_buffers_dense_parameters_and_lgcs_warm_up(tmp_path):
    _runs(tmp_path / "runs")
    for seed in range(3):
        path = tmp_path / "runs" / "topk" / str(seed) / "summary.json"
        summary = json.loads(path.read_text())
        summary["wire_buffer_bytes_sent"] = 2 * 1_000_000  # both workers: 1 MB each
        summary["layers"] = [
            {"layer": "bn.weight", "numel": 16, "compressed": False, "steps": 4, "bytes_sent": 300},
            {"layer": "conv.weight", "numel": 2304, "compressed": True, "steps": 4, "bytes_sent": 100 + seed * 100},
        ]
        summary["lgc_stages"] = {"warmup": {"wire_bytes_sent": 4_000_000}}
        path.write_text(json.dumps(summary))
    records = load_runs([tmp_path / "runs"])
    rows = {row["label"]: row for row in byte_rows(records)}
    topk = rows["topk"]
    assert topk["buffers_wire_mb_per_worker"] == pytest.approx(1.0)
    assert topk["warmup_wire_mb_per_worker"] == pytest.approx(2.0)
    assert topk["dense_parameter_elements"] == 16
    # Shares 300/400, 300/500, 300/600, averaged over the seeds.
    assert topk["dense_parameter_share"] == pytest.approx((0.75 + 0.6 + 0.5) / 3)
    # The fixed overhead: 1 MB of buffers and 300 bytes of dense parameters (a 2-worker ring sends
    # what it is given); the codec carries the rest of the wire; the ceiling is dense's bytes over it.
    summary = json.loads((tmp_path / "runs" / "topk" / "0" / "summary.json").read_text())
    assert topk["overhead_wire_mb_per_worker"] == pytest.approx(1.0003)
    assert topk["codec_wire_mb_per_worker"] == pytest.approx(summary["wire_bytes_sent"] / 2 / 1e6 - 1.0003)
    assert topk["ceiling"] == pytest.approx(summary["wire_dense_equivalent_bytes"] / 2 / 1_000_300)
    # Runs that book none of it show dashes.
    assert rows["none"]["buffers_wire_mb_per_worker"] is None and rows["none"]["dense_parameter_share"] is None
    assert rows["none"]["overhead_wire_mb_per_worker"] is None and rows["none"]["ceiling"] is None
    # Buffers alone (a run of PyTorch's own hooks books no parameters) give no overhead: what it
    # sent dense is unknown.
    summary = json.loads((tmp_path / "runs" / "none" / "0" / "summary.json").read_text())
    summary["wire_buffer_bytes_sent"] = 2_000_000
    (tmp_path / "runs" / "none" / "0" / "summary.json").write_text(json.dumps(summary))
    (none,) = [row for row in byte_rows(load_runs([tmp_path / "runs" / "none" / "0"])) if row["label"]]
    assert none["buffers_wire_mb_per_worker"] == pytest.approx(1.0) and none["overhead_wire_mb_per_worker"] is None
    table = bytes_table(records)
    assert "| topk | " in table and "| 1 | 16 | 62 % | 2 |" in table
    assert "| none | " in table and "| - | - | - | - |" in table
    main([str(tmp_path / "runs"), "--out", str(tmp_path / "report")])
    assert "## Where the bytes go" in (tmp_path / "report" / "report.md").read_text()
