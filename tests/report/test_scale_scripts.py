"""The scale comparison's sweep plan and tables (``experiments/scale_comparison.py``,
``experiments/scale_tables.py``) on the committed protocol and hand-made run records."""

import importlib
import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

EXPERIMENTS = Path(__file__).parents[2] / "experiments"


@pytest.fixture
def scripts(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    for name in ("scale_comparison", "scale_tables"):
        sys.modules.pop(name, None)
    return importlib.import_module("scale_comparison"), importlib.import_module("scale_tables")


def test_the_protocol_plans_every_method_over_the_same_seeds_in_every_cell(scripts):
    sweep, _ = scripts
    protocol = sweep.load_protocol()
    runs = sweep.planned_runs(protocol)
    cells, methods, seeds = protocol["order"]["cells"], protocol["order"]["methods"], protocol["seeds"]
    assert len(seeds) == 5 and len(runs) == len(cells) * len(methods) * len(seeds) == len(set(runs))
    assert protocol["margin_points"] == 1.0 and protocol["reference"] == "dense" and methods[0] == "dense"


def test_every_planned_run_composes_and_its_partition_follows_the_seed(scripts, tmp_path):
    sweep, _ = scripts
    protocol = sweep.load_protocol()
    with initialize_config_module("lgc.conf", version_base="1.3"):
        for cell in protocol["cells"]:
            for method in protocol["methods"]:
                overrides = sweep.run_overrides(protocol, cell, method, 3)
                cfg = compose("train", overrides=[*overrides, f"output_dir={tmp_path}"])
                assert cfg.seed == 3 and cfg.trainer.max_steps == protocol["cells"][cell]["steps"]
                assert cfg.scheduler._target_ == "lgc.lit.classification.StepCosine"
                if cell == "r20_dir4":
                    assert cfg.data.partition == "dirichlet" and cfg.data.partition_seed == 3
                    # per-step methods average the workers' buffers every step, local-step ones at exchanges
                    local = protocol["methods"][method].get("local_steps", False)
                    assert (cfg.comm.get("buffers") == "average") != local
    dgc = sweep.run_overrides(protocol, "seg4", "dgc", 0)
    assert "compressor.steps_per_epoch=3" in dgc  # 4 warm-up densities over 2.5 % of 600 steps


def _summary(seed: int, metric_key: str, metric: float, compressed_bytes: int) -> dict:
    world = 4
    return {
        "config": {"seed": seed, "compressor": {"_target_": "lgc.compressors.TopKCompressor"}},
        "world_size": world,
        metric_key: metric,
        "metrics": {metric_key: metric},
        "wire_bytes_sent": world * (compressed_bytes + 3_000_000 + 1_500_000),
        "wire_bytes_sent_per_worker": [compressed_bytes + 3_000_000 + 1_500_000] * world,
        "wire_buffer_bytes_sent": world * 1_500_000,
        "wire_dense_equivalent_bytes": world * 900_000_000,
        "layers": [
            {"layer": "a", "numel": 10, "compressed": False, "bytes_sent": 2_000_000},  # 3 MB on a 4-ring
            {"layer": "b", "numel": 9000, "compressed": True, "bytes_sent": 123},
        ],
        "provenance": {"commit": "abcdef0123456789", "dirty": False},
    }


def test_tables_mark_only_complete_methods_and_split_the_bytes(scripts, tmp_path):
    _, tables = scripts
    protocol = importlib.import_module("scale_comparison").load_protocol()
    cell = "r20_iid4"
    dense = [0.90, 0.91, 0.905, 0.895, 0.90]
    close = [d - 0.001 * k for k, d in enumerate(dense)]  # within a point
    far = [d - 0.03 + 0.002 * k for k, d in enumerate(dense)]  # about 2.6 points below
    for method, values in (("dense", dense), ("fp16", close), ("topk", far), ("dgc", close[:3])):
        for seed, value in enumerate(values):
            folder = tmp_path / cell / method / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(_summary(seed, "val/acc", value, 10_000_000)))
    rows, power = tables.cell_rows(protocol, tmp_path, cell)
    by = {row["method"]: row for row in rows}
    assert by["fp16"]["mark"] == "within" and by["topk"]["mark"] == "worse"
    assert by["dgc"]["mark"] is None and by["dgc"]["seeds"] == [0, 1, 2]  # 3 of 5 seeds: no mark yet
    assert by["lgc_rar"]["seeds"] == [] and by["dense"]["mark"] is None
    assert by["topk"]["gap_points"]["mean"] == pytest.approx(-2.6)
    assert by["fp16"]["overhead_mb"] == pytest.approx(4.5) and by["fp16"]["codec_mb"] == pytest.approx(10.0)
    assert by["fp16"]["ceiling"] == pytest.approx(900 / 4.5)
    assert power["median_sd_points"] > 0 and power["detectable_loss_points"] > 1.0
    assert power["commits"] == ["abcdef0"]
    page = tables.cell_table(protocol, cell, rows, power)
    assert "| 3 of 5 |" in page and "not run yet" in page and "within" in page and "worse" in page
    # The README's line per cell: the marked methods by mark, how many are still open, what it detects.
    empty = {"rows": [{**row, "seeds": [], "mark": None} for row in rows], "power": power}
    data = {name: empty for name in protocol["order"]["cells"]}
    data[cell] = {"rows": rows, "power": power}
    summary = dict(zip(protocol["order"]["cells"], tables.readme_summary(protocol, data).splitlines(), strict=True))
    others = len(protocol["order"]["methods"]) - 1
    assert f"2 of {others} methods marked; `within`: fp16. `worse`: top-k 1 % with error feedback." in summary[cell]
    assert f"A loss of {power['detectable_loss_points']:.2f} points or more is marked `worse`" in summary[cell]
    assert "inconclusive" not in summary[cell] and "Fixed overhead" not in summary[cell]  # no LGC row ran
    # LGC's goal on both accountings: pending while a method that could change it is unmarked.
    assert summary[cell].endswith(
        "within the margin, [verdict](docs/lgc.md)): pending on whole-wire bytes; pending on bytes the codec carries."
    )
    assert all(line.endswith(": not run yet.") for name, line in summary.items() if name != cell)


def test_a_superseded_record_gives_the_earlier_reading_in_place_of_the_run_that_replaced_it(scripts, tmp_path):
    _, tables = scripts
    protocol = importlib.import_module("scale_comparison").load_protocol()
    cell = "r20_iid4"
    dense = [0.90, 0.91, 0.905, 0.895, 0.90]
    for method, values in (("dense", dense), ("topk", [d - 0.005 for d in dense])):
        for seed, value in enumerate(values):
            folder = tmp_path / cell / method / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(_summary(seed, "val/acc", value, 10_000_000)))
    earlier = tmp_path / "superseded" / cell / "topk" / "seed2"
    earlier.mkdir(parents=True)
    (earlier / "summary.json").write_text(json.dumps(_summary(2, "val/acc", 0.805, 10_000_000)))
    now = {row["method"]: row for row in tables.cell_rows(protocol, tmp_path, cell)[0]}
    before = {row["method"]: row for row in tables.cell_rows(protocol, tmp_path, cell, tmp_path / "superseded")[0]}
    assert now["topk"]["gap_points"]["mean"] == pytest.approx(-0.5) and now["topk"]["mark"] == "within"
    assert before["topk"]["gap_points"]["mean"] == pytest.approx((4 * -0.5 - 10) / 5)  # seed 2 ten points lower
    assert before["topk"]["mark"] != "within" and before["topk"]["seeds"] == [0, 1, 2, 3, 4]
    assert before["dense"]["metric"] == now["dense"]["metric"]
    with pytest.raises(SystemExit):  # the earlier reading is printed, never written over the tables
        tables.main([str(tmp_path), "--superseded", "--write"])


def test_lgc_rows_at_top_ks_density_are_paired_with_it_once_both_ran_every_seed(scripts, tmp_path):
    _, tables = scripts
    protocol = importlib.import_module("scale_comparison").load_protocol()
    cell = "r20_iid4"
    topk = [0.88, 0.89, 0.885, 0.875, 0.88]
    runs = {
        "dense": (topk, None),
        "topk": (topk, 0.01),
        "lgc_rar": ([t + 0.001 * (k + 1) for k, t in enumerate(topk)], 0.01),  # 0.1 ... 0.5 points above
        "lgc_ps": (topk[:4], 0.01),  # 4 of 5 seeds: not yet
        "lgc_rar_linear": (topk, 0.001),  # another density: no top-k row to pair with
    }
    for method, (values, density) in runs.items():
        for seed, value in enumerate(values):
            summary = _summary(seed, "val/acc", value, 10_000_000)
            if density is not None:
                summary["config"]["compressor"]["density"] = density
            folder = tmp_path / cell / method / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(summary))
    by = {row["method"]: row for row in tables.cell_rows(protocol, tmp_path, cell)[0]}
    assert by["lgc_rar"]["gap_to_sparsifier_points"]["mean"] == pytest.approx(0.3)
    assert by["lgc_ps"]["gap_to_sparsifier_points"] is None and by["lgc_rar_linear"]["gap_to_sparsifier_points"] is None
    assert by["topk"]["gap_to_sparsifier_points"] is None  # only LGC's rows
    # The README's line of the LGC study: LGC's settings by mark, and each one paired with top-k.
    study = importlib.import_module("scale_comparison").load_protocol(EXPERIMENTS / "lgc_loop_protocol.yaml")
    rows, power = tables.cell_rows(study, tmp_path, cell)
    line = tables.readme_study_summary(study, {cell: {"rows": rows, "power": power}})
    assert line.startswith(f"- **{cell}**, 2 of 8 of LGC's settings marked (5 seeds each): `within`: LGC-RAR; ")
    assert "paired by seed: LGC-RAR +0.30 ± " in line and "LGC-PS" not in line.split("paired by seed")[1]
    assert line.endswith("LGC's goal: pending on whole-wire bytes; pending on bytes the codec carries.")


@pytest.mark.parametrize(
    ("folder", "seed", "metric", "refusal"),
    [
        ("seed1", 2, 0.9, "belongs in"),  # filed under another seed's folder
        ("seed1/retry", 1, 0.9, "belongs in"),  # a copy below a seed's folder
        ("seed7", 7, 0.9, "not among the protocol's seeds"),
        ("seed1", 1, float("nan"), "no finite val/acc"),
        ("seed1", 1, None, "no finite val/acc"),
        ("seed1", 1, "validated at step 3", "metrics are of step 3, not of its last step 10"),
    ],
)
def test_a_record_that_does_not_fit_the_protocol_is_refused_naming_its_file(
    scripts, tmp_path, folder, seed, metric, refusal
):
    _, tables = scripts
    protocol = importlib.import_module("scale_comparison").load_protocol()
    for name, value in (("seed0", 0), (folder, seed)):
        summary = _summary(value, "val/acc", 0.9, 10_000_000)
        if name == folder:
            if isinstance(metric, str):  # an earlier model's metrics
                summary.update(steps=10, validated_step=3)
            else:
                summary["val/acc"] = summary["metrics"]["val/acc"] = metric
            if metric is None:
                del summary["val/acc"], summary["metrics"]["val/acc"]
        (tmp_path / "r20_iid4" / "fp16" / name).mkdir(parents=True)
        (tmp_path / "r20_iid4" / "fp16" / name / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match=refusal) as refused:
        tables.cell_rows(protocol, tmp_path, "r20_iid4")
    assert f"fp16/{folder}/summary.json" in str(refused.value)


def test_a_byte_column_booked_by_some_seeds_runs_only_is_refused(scripts, tmp_path):
    _, tables = scripts
    protocol = importlib.import_module("scale_comparison").load_protocol()
    for seed in (0, 1):
        summary = _summary(seed, "val/acc", 0.9, 10_000_000)
        if seed:
            del summary["layers"]  # no per-layer table: no codec bytes for this run
        (tmp_path / "r20_iid4" / "fp16" / f"seed{seed}").mkdir(parents=True)
        (tmp_path / "r20_iid4" / "fp16" / f"seed{seed}" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="r20_iid4/fp16 .*: booked by 1 of the 2 runs"):
        tables.cell_rows(protocol, tmp_path, "r20_iid4")


def test_lgcs_measurements_in_the_loop_stand_beside_its_mark(scripts, tmp_path):
    _, tables = scripts
    protocol = importlib.import_module("scale_comparison").load_protocol()
    cell = "r20_iid4"
    for seed in range(5):
        for method, value in (("dense", 0.90), ("lgc_rar", 0.899 - 0.001 * seed), ("lgc_ps", 0.88)):
            summary = _summary(seed, "val/acc", value, 10_000_000)
            if method != "dense":
                summary["lgc_stages"] = {"compressed": {"wire_bytes_sent": 1}}
                summary["config"]["compressor"]["stages"] = {"refresh_threshold": None}
            if method == "lgc_rar":  # measured, with a refresh on seed 4; LGC-PS measured nothing
                summary["lgc_true_error"] = 0.2 + 0.01 * seed
                summary["lgc_premise"] = {"correlation": 0.5, "energy_share": 0.02, "steps": 100.0}
                summary["lgc_refreshes"] = int(seed == 4)
            folder = tmp_path / cell / method / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(summary))
    rows, power = tables.cell_rows(protocol, tmp_path, cell)
    by = {row["method"]: row for row in rows}
    assert by["lgc_rar"]["lgc_error"]["mean"] == pytest.approx(0.22)
    assert by["lgc_rar"]["gap_to_sparsifier_points"] is None  # no top-k row ran
    assert by["lgc_rar"]["premise_r"]["mean"] == 0.5 and by["lgc_rar"]["refreshes"]["mean"] == pytest.approx(0.2)
    # An LGC run from before the count, without a refresh threshold, refreshed nothing; no LGC: no count.
    assert by["lgc_ps"]["lgc_error"] is None and by["lgc_ps"]["refreshes"]["mean"] == 0.0
    assert by["fp16"]["refreshes"] is None
    page = tables.cell_table(protocol, cell, rows, power)
    assert "| method | seeds | mark | delivered-sum error | premise r | energy share | refreshes |" in page
    measured = [line for line in page.splitlines() if line.startswith("| LGC-")]
    assert any("| 0.2200 ± " in line and "| within |" in line for line in measured)
    assert not any("LGC-PS" in line and "0.2200" in line for line in measured)
    # Measured by some seeds' runs only: refused, naming the row.
    (tmp_path / cell / "lgc_ps" / "seed0" / "summary.json").write_text(
        json.dumps({**json.loads((tmp_path / cell / "lgc_rar" / "seed0" / "summary.json").read_text())})
    )
    with pytest.raises(SystemExit, match="r20_iid4/lgc_ps lgc_error: measured by 1 of the 5 runs"):
        tables.cell_rows(protocol, tmp_path, cell)


def test_extra_overrides_replace_the_protocols_for_the_same_key(scripts):
    sweep, _ = scripts
    protocol = sweep.load_protocol()
    overrides = sweep.with_extra(sweep.run_overrides(protocol, "seg4", "dense", 0), ["trainer=gpu", "model=pspnet"])
    assert overrides.count("model=pspnet") == 1 and "model=pspnet_small" not in overrides
    assert overrides[-2:] == ["trainer=gpu", "model=pspnet"] and "data=fashion_scenes" in overrides


def test_the_committed_tables_are_the_generated_ones(scripts):
    _, tables = scripts
    results = EXPERIMENTS / "results" / "scale"
    written = (results / "tables.md").read_text()
    protocol = importlib.import_module("scale_comparison").load_protocol()
    text, data = tables.page(protocol, results)
    assert written == text, "tables.md drifted from the records: python experiments/scale_tables.py --write"
    assert json.loads((results / "tables.json").read_text()) == json.loads(json.dumps(data))
    readme = (EXPERIMENTS.parent / "docs" / "evidence.md").read_text()
    block = readme[readme.index(tables.BEGIN) + len(tables.BEGIN) : readme.index(tables.END)].strip()
    assert block == tables.readme_table(protocol, data), "docs/evidence.md drifted: scale_tables.py --write"
    summary = tables.SUMMARY_PAGE.read_text()
    block = summary[summary.index(tables.SUMMARY_BEGIN) + len(tables.SUMMARY_BEGIN) : summary.index(tables.SUMMARY_END)]
    assert block.strip() == tables.readme_summary(protocol, data), "README.md drifted: scale_tables.py --write"
    # The LGC study's tables, from the same records (the runs it shares with the comparison included).
    study = importlib.import_module("scale_comparison").load_protocol(EXPERIMENTS / "lgc_loop_protocol.yaml")
    text, data = tables.page(study, results)
    assert (results / "lgc_loop.md").read_text() == text, "scale_tables.py --protocol lgc_loop_protocol.yaml --write"
    assert json.loads((results / "lgc_loop.json").read_text()) == json.loads(json.dumps(data))
    # LGC's page holds each protocol's LGC rows and verdict, as generated.
    page = tables.LGC_PAGE.read_text()
    for plan in (protocol, study):
        begin, end = tables.lgc_markers(plan)
        block = page[page.index(begin) + len(begin) : page.index(end)].strip()
        assert block == tables.lgc_block(plan, tables.page(plan, results)[1]), "docs/lgc.md drifted: --write"


def _data(protocol: dict, marks: dict[str, list[str]], mb: dict[str, float]) -> dict:
    """tables.json with every method's mark per cell (in the rule's cell order) and its MB everywhere."""
    cells = protocol["default_rule"]["cells"]
    rows = {cell: [] for cell in cells}
    for method in protocol["order"]["methods"]:
        for index, cell in enumerate(cells):
            mark = None if method == "dense" else marks.get(method, ["worse"] * len(cells))[index]
            rows[cell].append({"method": method, "mark": mark, "wire_mb": mb.get(method, 100.0)})
    return {cell: {"rows": rows[cell]} for cell in cells}


def test_the_scale_rule_picks_the_fewest_bytes_within_the_margin_everywhere_at_an_admitted_step(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    for name in ("scale_rule", "default_rule", "lgc_verdict"):
        sys.modules.pop(name, None)
    rule = importlib.import_module("scale_rule")
    protocol = importlib.import_module("scale_comparison").load_protocol()
    cheap = {label: {0.001: 1.1, 0.01: 1.2} for label in ("fp16", "topk", "sbc:delay=4", "dgc")}
    everywhere = ["within"] * 3
    data = _data(protocol, {"fp16": everywhere, "topk": everywhere, "sbc_delay": everywhere},
                 {"dense": 1000.0, "fp16": 500.0, "topk": 50.0, "sbc_delay": 5.0})  # fmt: skip
    # SBC every 4 steps sends the fewest bytes; once its step's upper end at 1 % is 1.3, top-k is next.
    assert rule.pick(protocol, data, cheap)[0] == "sbc_delay"
    slow = {**cheap, "sbc:delay=4": {0.001: 1.1, 0.01: 1.3}}
    assert rule.pick(protocol, data, slow)[0] == "topk"
    # Within in two cells only: the most cells first, then bytes; none anywhere: dense.
    data = _data(protocol, {"fp16": ["within", "within", "inconclusive"], "dgc": ["within", "worse", "worse"]},
                 {"dense": 1000.0, "fp16": 500.0, "dgc": 10.0})  # fmt: skip
    chosen, why = rule.pick(protocol, data, cheap)
    assert chosen == "fp16" and "2 of 3 cells" in why
    assert rule.pick(protocol, _data(protocol, {}, {}), cheap)[0] == "dense"
    # A method not yet marked somewhere keeps the rule undecided.
    data = _data(protocol, {"fp16": everywhere}, {})
    data["seg4"]["rows"][2]["mark"] = None
    assert rule.pick(protocol, data, cheap)[0] is None


def _verdict_rows(marks: dict[str, str], wire: dict[str, float], overhead: dict[str, float | None]) -> list[dict]:
    """One cell's rows: dense and the methods given, each with its mark, whole-wire MB and fixed overhead."""
    rows = []
    for method, mb in wire.items():
        fixed = overhead.get(method, 10.0)
        rows.append({"method": method, "mark": marks.get(method), "wire_mb": mb, "overhead_mb": fixed,
                     "codec_mb": None if fixed is None else mb - fixed, "seeds": [0, 1, 2, 3, 4]})  # fmt: skip
    return rows


def test_lgcs_verdict_weighs_both_accountings_and_states_the_floor(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    for name in ("scale_verdict", "lgc_verdict"):
        sys.modules.pop(name, None)
    verdict = importlib.import_module("scale_verdict")
    wire = {"dense": 1000.0, "fp16": 500.0, "dgc": 40.0, "lgc_rar": 20.0, "lgc_ps": 12.0, "powersgd": 30.0}
    marks = {"fp16": "within", "dgc": "within", "lgc_rar": "within", "lgc_ps": "inconclusive", "powersgd": "within"}
    rows = _verdict_rows(marks, wire, {"powersgd": None})
    # Whole wire: LGC-RAR's 20 MB is 2x under DGC's 40 (goal 3x): not met; its codec bytes, 10 against
    # DGC's 30, are 3x and fewer than any booked method within; PowerSGD, within, books no codec bytes,
    # so LGC cannot be said to send fewer than it: undecided.
    whole = verdict.cell_verdict(rows, "dense", "wire_mb")
    assert (whole["status"], whole["best"], whole["rival"]) == ("not met", "lgc_rar", "powersgd")
    assert not whole["vs_dgc"] and whole["vs_rest"]
    assert whole["inconclusive"] == ["lgc_ps"]
    codec = verdict.cell_verdict(rows, "dense", "codec_mb")
    assert (codec["status"], codec["best_mb"], codec["dgc_mb"], codec["rival"]) == ("undecided", 10.0, 30.0, "dgc")
    assert codec["unbooked"] == codec["unbooked_within"] == ["powersgd"]
    # PowerSGD worse: nothing unbooked is within, and the goal is met on the codec's bytes.
    booked = verdict.cell_verdict(
        _verdict_rows({**marks, "powersgd": "worse"}, wire, {"powersgd": None}), "dense", "codec_mb"
    )
    assert (booked["status"], booked["unbooked"], booked["unbooked_within"]) == ("met", ["powersgd"], [])
    # The floor: 10 MB fixed under LGC; dense's 1000 over it is the ceiling, DGC's 40 allows at most 4x.
    assert verdict.floor(rows, "dense") == {"overhead_mb": 10.0, "ceiling": 100.0, "most_below_dgc": 4.0}
    # Counted by the protocol's n, a row with seeds still to run is left out: DGC's 3 of 5 bound nothing yet.
    counted = [{**row, "seeds": [0, 1, 2] if row["method"] == "dgc" else [0, 1, 2, 3, 4]} for row in rows]
    assert verdict.floor(counted, "dense", 5) == {"overhead_mb": 10.0, "ceiling": 100.0, "most_below_dgc": None}
    # Any method unmarked keeps the cell pending; no LGC setting within: not met.
    assert verdict.cell_verdict(_verdict_rows({**marks, "dgc": None}, wire, {}), "dense", "wire_mb")["status"] == (
        "pending"
    )
    none_within = verdict.cell_verdict(_verdict_rows({**marks, "lgc_rar": "worse"}, wire, {}), "dense", "codec_mb")
    assert (none_within["status"], none_within["best"]) == ("not met", None)
    protocol = importlib.import_module("scale_comparison").load_protocol()
    tables = {cell: {"rows": rows} for cell in protocol["order"]["cells"]}
    labels = {m: {"label": m} for m in wire} | {"powersgd": {"label": "powersgd (the hook, rank 2)"}}
    protocol = {**protocol, "methods": {**protocol["methods"], **labels}}
    text = verdict.verdict_section(protocol, tables)
    # The bullets name methods by their labels' short forms.
    assert "(the hook" not in text
    assert "ceiling 100x over dense; at most 4.0x below DGC on whole-wire bytes." in text
    assert "On bytes the codec carries: undecided. LGC's fewest within the margin: lgc_rar, 10 MB" in text
    assert (
        "No codec bytes booked, left out: powersgd. Undecided, as powersgd is `within` and books no bytes here." in text
    )
    # LGC's page: LGC's rows and DGC's with their gaps and marks, the other methods left to the tables;
    # a row with seeds still to run shows how far it is, and nothing else.
    gap = {"n": 5, "mean": -0.25, "sd": 0.3, "half_width": 0.37}
    shown = [{**row, "gap_points": gap, "warmup_mb": 8.0 if row["method"] == "lgc_rar" else None} for row in rows]
    shown[-2] = {**shown[-2], "seeds": [0, 1, 2]}  # lgc_ps
    block = verdict.lgc_block(protocol, {cell: {"rows": shown} for cell in protocol["order"]["cells"]})
    assert "| lgc_rar | -0.25 ± 0.37 | within | - | 20 | 10 | 8 |" in block  # 8 of its 20 MB in the dense warm-up
    assert "| dgc | -0.25 ± 0.37 | within | - | 40 | 30 | - |" in block  # no stages of LGC's
    assert "| lgc_ps | 3 of 5 seeds | - | - | - | - | - |" in block
    paired = [{**row, "gap_to_sparsifier_points": gap if row["method"] == "lgc_rar" else None} for row in shown]
    block = verdict.lgc_block(protocol, {cell: {"rows": paired} for cell in protocol["order"]["cells"]})
    assert "| lgc_rar | -0.25 ± 0.37 | within | -0.25 ± 0.37 | 20 | 10 | 8 |" in block
    # What the complete rows say: -0.25 ± 0.37 holds 0; LGC-RAR's 8 MB warm-up is 40 % of its 20; DGC's 40 is 5x it.
    assert (
        "- Against top-k at the same density, paired by seed: Not told apart from it (the interval holds 0): lgc_rar."
        in block
    )
    assert (
        "- The dense warm-up is 40 % of every complete LGC row's whole wire; DGC's whole run sends 5.00x that warm-up."
        in block
    )
    below = [{**row, "gap_to_sparsifier_points": {**gap, "mean": -1.0}} for row in paired if row["method"] == "lgc_rar"]
    assert verdict.reading_lines(protocol, below)[0].endswith("Below it: lgc_rar.")
    assert "| fp16 |" not in block and "| powersgd |" not in block
    assert block.count("- On bytes the codec carries:") == len(protocol["order"]["cells"])
    low = _verdict_rows(marks, {**wire, "dgc": 25.0}, {})
    assert "the 3x goal is out of reach there by construction" in verdict.verdict_section(
        protocol, {cell: {"rows": low} for cell in protocol["order"]["cells"]}
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist missing")
def test_every_planned_run_passes_lgc_trains_checks(scripts):
    sweep, _ = scripts
    protocol = sweep.load_protocol()
    assert sweep.check_runs(protocol, sweep.planned_runs(protocol), []) == []


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="dataset-fashion-mnist missing")
def test_a_refused_run_is_named_before_the_sweep_starts(scripts):
    sweep, _ = scripts
    protocol = sweep.load_protocol()
    runs = sweep.planned_runs(protocol, ["seg4"], ["dense"])
    (refusal,) = sweep.check_runs(protocol, runs, ["data.garments=[0,3]"])
    assert refusal.startswith("seg4/dense: ValueError") and "garments must satisfy 1 <= fewest <= most" in refusal


def test_a_checkpoint_saved_at_the_last_step_without_a_summary_is_run_again(scripts, tmp_path, capsys):
    import torch

    sweep, _ = scripts
    for seed, step in ((0, 250), (1, 600)):
        folder = tmp_path / "out" / "seg4" / "dense" / f"seed{seed}" / "checkpoints"
        folder.mkdir(parents=True)
        torch.save({"global_step": step}, folder / "last.ckpt")
    argv = ["--out", str(tmp_path / "out"), "--results", str(tmp_path / "res"), "--cells", "seg4"]
    assert sweep.main([*argv, "--methods", "dense", "--dry-run"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert "ckpt_path=" in commands[0] and "seed=0" in commands[0]  # mid-run: resumed
    assert "ckpt_path=" not in commands[1] and "seed=1" in commands[1]  # at step 600 of 600: from the start


def test_a_run_whose_rendezvous_port_was_taken_runs_again_and_no_other_failure_does(scripts, tmp_path, monkeypatch):
    import subprocess

    sweep, _ = scripts
    outcomes = {"port": ["EADDRINUSE: address already in use", "EADDRINUSE", ""], "crash": ["ValueError: bad", ""]}
    calls = []

    def fake_run(command, stdout, stderr):
        kind = command[0]
        calls.append(kind)
        text = outcomes[kind].pop(0)
        stdout.write(text + "\n")
        return subprocess.CompletedProcess(command, 0 if not text else 1)

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    assert sweep._run_logged(["port"], tmp_path / "port.log").returncode == 0
    assert calls == ["port"] * 3  # twice the port, then the run
    assert sweep._run_logged(["crash"], tmp_path / "crash.log").returncode == 1
    assert calls[3:] == ["crash"]  # a failure of the run itself is not retried
    assert "EADDRINUSE" in (tmp_path / "port.log").read_text()


def test_the_scale_rule_refuses_missing_or_ambiguous_step_costs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    sys.modules.pop("scale_rule", None)
    rule = importlib.import_module("scale_rule")
    with pytest.raises(SystemExit, match="step_0.001.json is missing"):
        rule.step_uppers(tmp_path, [0.001])
    row = {"mean_cpu_x": 1.0, "cpu_vs_ddp": {"mean": 1.1, "half_width": 0.05, "rounds": [1.1]}}
    (tmp_path / "step_0.001.json").write_text(json.dumps({"rows": {"no_sync": {}, "topk": row}}))
    assert rule.step_uppers(tmp_path, [0.001]) == {"topk": {0.001: pytest.approx(1.15)}}
    (tmp_path / "step_0.001_more.json").write_text(json.dumps({"rows": {"topk": row}}))
    with pytest.raises(SystemExit, match="timed in another table too"):
        rule.step_uppers(tmp_path, [0.001])
    (tmp_path / "step_0.001_more.json").write_text(json.dumps({"rows": {"dgc": {"mean_cpu_x": 1.2}}}))
    with pytest.raises(SystemExit, match="row dgc has no cpu_vs_ddp interval"):
        rule.step_uppers(tmp_path, [0.001])
    # Every protocol method but dense is mapped to the step row that times its setup.
    protocol = importlib.import_module("scale_comparison").load_protocol()
    assert set(rule.STEP_ROWS) == set(protocol["methods"]) - {"dense"}


def test_a_summary_run_with_other_overrides_is_never_counted(scripts, tmp_path, capsys):
    sweep, _ = scripts
    protocol = sweep.load_protocol()
    planned = sweep.run_overrides(protocol, "seg4", "dense", 0)
    for seed, overrides in ((0, planned), (1, [*planned[:-1], "optimizer.lr=0.2"])):
        folder = tmp_path / "res" / "seg4" / "dense" / f"seed{seed}"
        folder.mkdir(parents=True)
        recorded = [o.replace("seed=0", f"seed={seed}") for o in overrides] + [f"output_dir=out/seed{seed}"]
        (folder / "summary.json").write_text(json.dumps({"hydra": {"overrides": recorded}}))
    argv = ["--out", str(tmp_path / "out"), "--results", str(tmp_path / "res"), "--cells", "seg4"]
    assert sweep.main([*argv, "--methods", "dense", "--dry-run"]) == 1
    out = capsys.readouterr()
    assert "seed=0 " not in out.out  # recorded with the planned overrides: done
    assert "seg4/dense/seed1" in out.out and "other overrides" in out.out and "stale" in out.err


def test_the_step_timings_cover_every_row_the_rule_reads_in_files_it_reads(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    for name in ("scale_step_cost", "scale_rule"):
        sys.modules.pop(name, None)
    timing, rule = importlib.import_module("scale_step_cost"), importlib.import_module("scale_rule")
    groups = timing.groups()
    assert all(group[0] == "ddp" and len(group) <= timing.GROUP_SIZE + 1 for group in groups)
    assert sorted(row for group in groups for row in group[1:]) == sorted(set(rule.STEP_ROWS.values()))
    # lgc-bench step's tables as it writes them: the rule reads every group's file of a density.
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        methods = command[command.index("--methods") + 1].split(",")
        interval = {"mean": 1.1, "half_width": 0.05}
        rows = {label: {"cpu_vs_ddp": interval} for label in methods}
        Path(command[command.index("--json") + 1]).write_text(json.dumps({"rows": rows}))
        return subprocess.CompletedProcess(command, 0, "table\n", "")

    import subprocess

    monkeypatch.setattr(timing.subprocess, "run", fake_run)
    assert timing.main([str(tmp_path), "--densities", "0.001", "0.01"]) == 0
    assert len(commands) == 2 * len(groups) and all(
        "--rounds" in c and c[c.index("--rounds") + 1] == "5" for c in commands
    )
    # Each round holds whole delays of every row in it (4 steps at least): the group with SBC's 4 runs
    # rounds of 4, the one with DiLoCo's and SparseLoCo's 10 rounds of 10.
    for command in commands:
        rows, steps = command[command.index("--methods") + 1].split(","), int(command[command.index("--steps") + 1])
        assert steps >= 4 and all(steps % timing.delay(row) == 0 for row in rows)
        assert steps == (10 if "sparseloco:delay=10" in rows else 4)
    assert timing.delay("none:delay=10;outer=sgd") == 10 and timing.delay("topk") == 1
    # Each table opens with its command, naming its output without a path of this machine.
    for table in tmp_path.glob("step_*.md"):
        assert table.read_text().splitlines()[0].endswith(f"--json {table.stem}.json")
    uppers = rule.step_uppers(tmp_path, [0.001, 0.01])
    assert set(uppers) == set(rule.STEP_ROWS.values()) and uppers["topk"] == pytest.approx({0.001: 1.15, 0.01: 1.15})
    # Written tables are not timed again; one round gives no interval and is refused.
    assert timing.main([str(tmp_path), "--densities", "0.001"]) == 0 and len(commands) == 2 * len(groups)
    with pytest.raises(SystemExit):
        timing.main([str(tmp_path), "--rounds", "1"])


def test_the_lgc_study_extends_the_comparison_and_every_run_composes(scripts, tmp_path):
    sweep, _ = scripts
    study = sweep.load_protocol(EXPERIMENTS / "lgc_loop_protocol.yaml")
    base = sweep.load_protocol()
    assert study["cells"]["r20_iid4"] == base["cells"]["r20_iid4"] and study["seeds"] == base["seeds"]
    assert "default_rule" not in study and study["tables"] == "lgc_loop" and study["changes"] == []
    assert study["order"]["methods"][: len(base["order"]["methods"])] == base["order"]["methods"]
    # The comparison's methods run with the same overrides in both: their runs are shared.
    assert sweep.run_overrides(study, "r20_iid4", "dgc", 2) == sweep.run_overrides(base, "r20_iid4", "dgc", 2)
    with initialize_config_module("lgc.conf", version_base="1.3"):
        for method, how in study["methods"].items():
            if method in base["methods"]:
                continue
            cell = study["cells"]["r20_iid4"]
            plain = [*study["common"], *cell["overrides"], *how["overrides"], *cell["per_step"]]
            for codec in study["codec_rule"]["candidates"].values() if "codec_at" in how else [[]]:
                overrides = [o.format(seed=1, steps=351, dgc_epoch=2) for o in [*plain, *codec]]
                cfg = compose("train", overrides=[*overrides, f"output_dir={tmp_path}"])
                assert cfg.compressor.measure_error and cfg.data.partition == "iid"
                if "codec_at" in how:
                    assert cfg.compressor.density == how["codec_at"] and cfg.compressor.stages.refresh_threshold == 0.5


def test_the_codec_rule_picks_the_lowest_error_then_the_fewest_bits_and_waits_for_its_rows(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    sys.modules.pop("lgc_codec_rule", None)
    rule_module = importlib.import_module("lgc_codec_rule")
    results = tmp_path / "codecs.json"
    candidates = {"ae": ["compressor=lgc_rar"], "pca": ["compressor=lgc_rar_linear"], "small": ["x=1"]}
    rule = {"results": str(results), "recording": "rec A", "leader": "rotating", "tie": 0.01, "candidates": candidates}

    def measured(rows, complete=True, label="rec A, 4 workers, density 0.01"):
        rows = [{"codec": c, "leader": leader, "error": e, "bits_per_value": b} for c, leader, e, b in rows]
        return {"label": label, "complete": complete, "rows": rows}

    with pytest.raises(ValueError, match="does not exist yet"):
        rule_module.codec_choice(rule, 0.01)
    rows = [("ae", "rotating", 0.30, 10.0), ("pca", "rotating", 0.20, 12.0), ("small", "rotating", 0.202, 11.0),
            ("pca", "fixed", 0.01, 1.0)]  # fmt: skip
    results.write_text(json.dumps([measured(rows), measured(rows, label="rec B, density 0.01")]))
    # pca has the lowest error; small is within 1 % of it with fewer bits, so small is chosen.
    assert rule_module.codec_choice(rule, 0.01) == ("small", ["x=1"])
    results.write_text(json.dumps([measured([*rows[:2], ("small", "rotating", 0.21, 11.0)])]))
    assert rule_module.codec_choice(rule, 0.01) == ("pca", ["compressor=lgc_rar_linear"])
    results.write_text(json.dumps([measured(rows, complete=False)]))
    with pytest.raises(ValueError, match="still being measured"):
        rule_module.codec_choice(rule, 0.01)
    results.write_text(json.dumps([measured(rows[:2])]))
    with pytest.raises(ValueError, match=r"no rotating-leader row for \['small'\]"):
        rule_module.codec_choice(rule, 0.01)
    with pytest.raises(ValueError, match="at density 0.001 is not measured"):
        rule_module.codec_choice(rule, 0.001)


@pytest.fixture
def sharded(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    for name in ("scale_comparison", "scale_tables", "sharded_tables"):
        sys.modules.pop(name, None)
    return importlib.import_module("sharded_tables")


def test_the_sharded_protocol_runs_every_method_under_each_strategy_over_the_same_seeds(sharded, tmp_path):
    protocol = importlib.import_module("scale_comparison").load_protocol(sharded.PROTOCOL)
    methods = protocol["methods"]
    bases = {spec["base"] for spec in methods.values()}
    assert {(spec["base"], spec["strategy"]) for spec in methods.values()} == {
        (base, strategy) for base in bases for strategy in ("ddp", "fsdp", "hsdp")
    }
    assert len(protocol["seeds"]) == 5 and protocol["margin_points"] == 1.0
    with initialize_config_module("lgc.conf", version_base="1.3"):
        for name, spec in methods.items():
            overrides = importlib.import_module("scale_comparison").run_overrides(protocol, "r8_iid4", name, 2)
            cfg = compose("train", overrides=[*overrides, f"output_dir={tmp_path}"])
            assert cfg.strategy.name == spec["strategy"] and cfg.trainer.devices == 4 and cfg.seed == 2
            assert cfg.strategy.get("shard_size") == (2 if spec["strategy"] == "hsdp" else None)


def test_sharded_runs_are_marked_against_the_same_methods_ddp_run_once_every_seed_ran(sharded, tmp_path):
    protocol = importlib.import_module("scale_comparison").load_protocol(sharded.PROTOCOL)
    ddp = [0.88, 0.885, 0.879, 0.882, 0.884]
    runs = {
        "topk_ddp": ddp,
        "topk_fsdp": ddp,  # bit for bit the DDP run
        "topk_hsdp": [d - 0.03 + 0.002 * k for k, d in enumerate(ddp)],  # about 2.6 points below
        "dense_ddp": ddp,
        "dense_fsdp": ddp[:3],  # still running
    }
    for method, values in runs.items():
        for seed, value in enumerate(values):
            folder = tmp_path / "r8_iid4" / method / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(_summary(seed, "val/acc", value, 1_000_000)))
    table, commits = sharded.rows(protocol, tmp_path)
    row = {r["method"]: r for r in table}
    assert row["topk_fsdp"]["mark"] == "within" and row["topk_fsdp"]["holds_zero"]
    assert row["topk_fsdp"]["gap_points"]["mean"] == 0.0
    assert row["topk_hsdp"]["mark"] == "worse" and row["topk_hsdp"]["holds_zero"] is False
    assert row["dense_fsdp"]["mark"] is None and row["dense_fsdp"]["seeds"] == [0, 1, 2]
    assert row["topk_ddp"]["gap_points"] is None and row["qsgd_hsdp"]["seeds"] == []
    assert commits == ["abcdef0"]
    text = sharded.table_text(protocol, table, commits)
    assert "| topk | hsdp | 5 |" in text and "| dense | fsdp | 3 of 5 |" in text


def test_the_evidence_page_holds_the_sharded_table_the_committed_records_give(sharded):
    protocol = importlib.import_module("scale_comparison").load_protocol(sharded.PROTOCOL)
    page = sharded.EVIDENCE.read_text()
    block = page[page.index(sharded.BEGIN) + len(sharded.BEGIN) : page.index(sharded.END)].strip()
    assert block == sharded.table_text(protocol, *sharded.rows(protocol, sharded.RESULTS)), (
        "python experiments/sharded_tables.py --write"
    )
