"""The rule that picks lgc-train's default and LGC's verdict (``experiments/default_rule.py``,
``experiments/lgc_verdict.py``) on hand-made over-seeds tables: non-inferiority within the margin,
undecided intervals waiting for seeds, the two tiers, and what each script writes."""

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

EXPERIMENTS = Path(__file__).parents[2] / "experiments"


@pytest.fixture
def scripts(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    for name in ("lgc_verdict", "default_rule"):
        sys.modules.pop(name, None)
    return importlib.import_module("lgc_verdict"), importlib.import_module("default_rule")


def entry(label: str, gap: tuple[float, float] | None, mb: float, n: int = 3) -> dict:
    """An over-seeds entry as lgc-report's seeds.json writes it (gap: its 95 % interval, a fraction)."""
    out = {
        "label": label,
        "n": n,
        "seeds": list(range(n)),
        "val/acc": {"n": n, "mean": 0.9, "sd": 0.01, "half_width": 0.01, "ci95": [0.89, 0.91]},
        "wire_mb_per_worker": {"n": n, "mean": mb, "sd": 0.0, "half_width": 0.0, "ci95": [mb, mb]},
    }
    if gap is not None:
        low, high = gap
        half = (high - low) / 2
        out["gap_to_dense"] = {"n": n, "mean": low + half, "sd": 0.0, "half_width": half, "ci95": [low, high]}
        out["vs_dense"] = "≈ dense" if low <= 0 <= high else ("above" if low > 0 else "below")
    return out


def write_cell(root: Path, cell: str, entries: list[dict]) -> None:
    report = root / cell / "report"
    report.mkdir(parents=True)
    (report / "seeds.json").write_text(json.dumps(entries))


def write_steps(root: Path, rows: dict[str, float]) -> None:
    """step_cost tables with DDP's row at 2.0 and every other row at ``x`` times it at both densities."""
    root.mkdir(parents=True, exist_ok=True)
    for density in ("0.001", "0.01"):
        table = {"rows": {"ddp": {"mean_cpu_x": 2.0}, **{k: {"mean_cpu_x": 2.0 * v} for k, v in rows.items()}}}
        (root / f"step_{density}.json").write_text(json.dumps(table))


def test_standing_is_non_inferiority_within_the_margin(scripts):
    verdict, _ = scripts
    assert verdict.MARGIN == 0.01
    # Below dense for certain, but by less than the margin: at dense's accuracy.
    assert verdict.standing(entry("a", (-0.009, -0.001), 1.0)) == "yes"
    # Holds 0, but reaches further down than the margin: undecided at 3 seeds, "no" at MAX_SEEDS.
    assert verdict.standing(entry("a", (-0.03, 0.01), 1.0)) == "undecided"
    assert verdict.standing(entry("a", (-0.03, 0.01), 1.0, n=verdict.MAX_SEEDS)) == "no"
    # Wholly below the margin: no, however few the seeds.
    assert verdict.standing(entry("a", (-0.05, -0.02), 1.0)) == "no"
    # Fewer seeds than MIN_PAIRED, or no pairing at all: not weighed.
    assert verdict.standing(entry("a", (-0.001, 0.001), 1.0, n=2)) == "unweighed"
    assert verdict.standing(entry("a", None, 1.0)) == "unweighed"
    assert verdict.standing(None) == "unweighed"


def test_a_failed_ablation_is_not_waited_for_in_the_other_cell(scripts):
    verdict, _ = scripts
    cells = {
        "iid4": {"dense": entry("dense", None, 100.0), "x": entry("x", (-0.05, -0.03), 1.0)},
        "dir8": {"dense": entry("dense", None, 100.0)},
    }
    assert verdict.unfinished(cells, {"x"}) == []
    cells["iid4"]["x"] = entry("x", (-0.03, 0.01), 1.0)  # undecided: the other cell must run it
    assert verdict.unfinished(cells, {"x"}) == ["dir8: x"]


def test_the_rule_picks_the_fewest_bytes_at_dense_accuracy_in_both_cells(scripts, tmp_path):
    _, rule = scripts
    both = {"cheap_close": (-0.005, 0.004), "cheap_fewer_but_far": (-0.06, -0.03), "costly_fewest": (-0.002, 0.002)}
    mbs = {"cheap_close": 5.0, "cheap_fewer_but_far": 1.0, "costly_fewest": 0.5}
    for cell in ("iid4", "dir8"):
        write_cell(
            tmp_path / "cmp",
            cell,
            [entry("dense", None, 100.0)] + [entry(k, gap, mbs[k]) for k, gap in both.items()],
        )
    rule.STEP_ROWS.update({k: k for k in both})
    write_steps(tmp_path / "steps", {"cheap_close": 1.1, "cheap_fewer_but_far": 1.0, "costly_fewest": 1.3})
    text = rule.main([str(tmp_path / "cmp"), str(tmp_path / "steps")])
    assert "The rule picks **cheap_close**" in text
    assert "0.0500 of dense's" in text
    assert (tmp_path / "cmp" / "default_rule.md").read_text() == text


def test_an_undecided_method_with_fewer_bytes_keeps_the_rule_waiting(scripts, tmp_path):
    _, rule = scripts
    for cell in ("iid4", "dir8"):
        write_cell(
            tmp_path / "cmp",
            cell,
            [entry("dense", None, 100.0), entry("close", (-0.005, 0.004), 5.0), entry("maybe", (-0.02, 0.01), 2.0)],
        )
    rule.STEP_ROWS.update({"close": "close", "maybe": "maybe"})
    write_steps(tmp_path / "steps", {"close": 1.0, "maybe": 1.0})
    text = rule.main([str(tmp_path / "cmp"), str(tmp_path / "steps")])
    assert "Provisional, no pick" in text and "iid4: maybe, dir8: maybe" in text
    assert not (tmp_path / "cmp" / "default_rule.md").exists()


def test_only_a_method_the_step_bound_admits_holds_the_pick_until_it_has_run(scripts, tmp_path):
    _, rule = scripts
    write_cell(
        tmp_path / "cmp",
        "iid4",
        [entry("dense", None, 100.0), entry("close", (-0.005, 0.004), 5.0), entry("slow", (-0.01, 0.01), 1.0)],
    )
    write_cell(tmp_path / "cmp", "dir8", [entry("dense", None, 100.0), entry("close", (-0.005, 0.004), 5.0)])
    rule.STEP_ROWS.update({"close": "close", "slow": "slow"})
    write_steps(tmp_path / "steps", {"close": 1.0, "slow": 1.3})
    assert "The rule picks **close**" in rule.main([str(tmp_path / "cmp"), str(tmp_path / "steps")])
    # The same method admitted: the Dirichlet cell must run it first.
    write_steps(tmp_path / "steps", {"close": 1.0, "slow": 1.2})
    (tmp_path / "cmp" / "default_rule.md").unlink()
    text = rule.main([str(tmp_path / "cmp"), str(tmp_path / "steps")])
    assert "Provisional, no pick" in text and "dir8: slow" in text
    assert not (tmp_path / "cmp" / "default_rule.md").exists()


def test_step_rows_are_read_from_every_group_over_its_own_ddp_row(scripts, tmp_path):
    _, rule = scripts
    write_steps(tmp_path, {"a": 1.1})
    for density in ("0.001", "0.01"):  # another group's run, its DDP row slower: b is 1.2x its own DDP
        table = {"rows": {"ddp": {"mean_cpu_x": 3.0}, "b": {"mean_cpu_x": 3.6}}}
        (tmp_path / f"step_{density}_more.json").write_text(json.dumps(table))
    steps = rule._steps(tmp_path)
    assert steps["a"] == pytest.approx({"0.001": 1.1, "0.01": 1.1})
    assert steps["b"] == pytest.approx({"0.001": 1.2, "0.01": 1.2})
    assert steps["ddp"] == {"0.001": 1.0, "0.01": 1.0}


def test_the_rule_falls_to_the_iid_cell_when_no_method_qualifies_in_both(scripts, tmp_path):
    _, rule = scripts
    write_cell(
        tmp_path / "cmp",
        "iid4",
        [entry("dense", None, 100.0), entry("a", (-0.004, 0.002), 3.0), entry("b", (-0.003, 0.003), 6.0)],
    )
    write_cell(
        tmp_path / "cmp",
        "dir8",
        [entry("dense", None, 50.0), entry("a", (-0.05, -0.02), 1.0), entry("b", (-0.04, -0.015), 2.0)],
    )
    rule.STEP_ROWS.update({"a": "a", "b": "b"})
    write_steps(tmp_path / "steps", {"a": 1.0, "b": 1.0})
    text = rule.main([str(tmp_path / "cmp"), str(tmp_path / "steps")])
    assert "falls to iid4 alone and picks **a** (0.0300 of dense's bytes there)" in text
    assert "on dir8 its gap to dense is -3.50 ± 1.50 (n=3) points" in text


def test_lgc_verdict_weighs_lgc_at_dense_accuracy_against_dgc(scripts, tmp_path):
    verdict, _ = scripts
    for cell in ("iid4", "dir8"):
        rows = [entry("dense", None, 800.0), entry("dgc", (-0.008, 0.0), 30.0)]
        rows += [entry("lgc_rar", (-0.009, 0.002), 9.0), entry("lgc_ps", (-0.03, 0.01), 2.0)]
        rows += [entry(k, (-0.005, 0.005), 20.0) for k in verdict.SHOWN if k not in ("dense", "dgc")]
        write_cell(tmp_path / "cmp", cell, rows)
    text = verdict.main([str(tmp_path / "cmp")])
    within, holds = verdict.READINGS
    # lgc_ps (fewer bytes) counts only under the weaker reading: its interval holds 0 but reaches 3 points down.
    assert text.count(f"- {within}: LGC's fewest bytes are {verdict.LGC['lgc_rar']}, 9 MB.") == 2
    assert text.count(f"- {holds}: LGC's fewest bytes are {verdict.LGC['lgc_ps']}, 2 MB.") == 2
    assert text.count("DGC's bytes over LGC's: 3.33 (goal: at least 3; met).") == 2
    assert text.count("DGC's bytes over LGC's: 15.00 (goal: at least 3; met).") == 2
    assert text.count("Undecided at 3-4 seeds") == 2
    assert (tmp_path / "cmp" / "lgc_verdict.md").read_text() == text


def test_lgc_verdict_says_whether_the_undecided_rows_can_change_the_goal(scripts, tmp_path):
    verdict, _ = scripts
    base = [entry("dense", None, 800.0), entry("dgc", (-0.008, 0.0), 30.0), entry("lgc_rar", (-0.009, 0.002), 20.0)]
    # An undecided LGC setting at 2 MB would meet both parts if it turned out within the margin.
    write_cell(tmp_path / "a", "iid4", [*base, entry("lgc_ps", (-0.03, 0.01), 2.0)])
    cell = verdict.load_cell(tmp_path / "a", "iid4")
    assert verdict.goal_met(cell, {"dgc", "lgc_rar"}) == (False, True)  # DGC's 30 MB over 20: 1.5x, short of 3x
    assert verdict.goal_met(cell, {"dgc", "lgc_rar", "lgc_ps"}) == (True, True)
    lines = verdict.verdict_of_cell(cell)
    assert any(line.startswith("- The undecided rows can still change the goal's outcome") for line in lines)
    # The same undecided setting at 25 MB cannot change it (LGC-RAR's 20 MB stays LGC's fewest).
    write_cell(tmp_path / "b", "iid4", [*base, entry("lgc_ps", (-0.03, 0.01), 25.0)])
    lines = verdict.verdict_of_cell(verdict.load_cell(tmp_path / "b", "iid4"))
    assert any(line.startswith("- The undecided rows cannot change the goal's outcome") for line in lines)


def test_the_default_run_is_the_rules_pick_on_the_committed_results(scripts):
    """lgc-train's default compressor is the method the rule picks from the committed comparison, run as the
    comparison script runs it; default_rule.md, which the rule writes once it picks, names the same method."""
    verdict, rule = scripts
    results = EXPERIMENTS / "results"
    cells = {cell: verdict.load_cell(results / "fashion_mnist", cell) for cell in verdict.CELLS}
    _, label, _, _ = rule.pick(cells, rule._steps(results / "step_cost"))
    assert label is not None and f"**{label}**" in (results / "fashion_mnist" / "default_rule.md").read_text()
    # How the comparison runs each method: its `[name]="overrides"` lines.
    runs = dict(re.findall(r'^  \[(\w+)\]="([^"]*)"$', (EXPERIMENTS / "fashion_mnist_comparison.sh").read_text(), re.M))
    with initialize_config_module("lgc.conf", version_base="1.3"):
        default = compose("train")
        picked = compose("train", runs[label].split())
    assert (default.compressor, default.comm) == (picked.compressor, picked.comm), label
    assert default.compressor._target_ == "lgc.compressors.FP16Compressor" and default.compressor.dtype == "float16"


def test_the_readme_table_is_the_generated_one(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    sys.modules.pop("which_method", None)
    which = importlib.import_module("which_method")
    readme = which.README.read_text()
    assert which.BEGIN in readme, "docs/evidence.md lost its which-method table markers"
    block = readme[readme.index(which.BEGIN) + len(which.BEGIN) : readme.index(which.END)].strip()
    expected = which.table(EXPERIMENTS / "results" / "fashion_mnist")
    assert block == expected, "the evidence page's table drifted: python experiments/which_method.py --write"
    assert which.replace_in(readme, expected) == readme
    begin, end = which.markers("which-method-gpu")
    gpu = readme[readme.index(begin) + len(begin) : readme.index(end)].strip()
    assert gpu == which.table(*which.BLOCKS["which-method-gpu"]), "python experiments/which_method.py --write"
    assert "dir8" not in gpu, "a cell without a report gets no columns"


def test_the_table_refuses_a_folder_without_reports_and_writing_another_folder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    sys.modules.pop("which_method", None)
    which = importlib.import_module("which_method")
    with pytest.raises(SystemExit, match="no report for iid4, dir8 under"):
        which.table(tmp_path)
    write_cell(tmp_path, "iid4", [entry("dense", None, 800.0)])
    assert "dir8" not in which.table(tmp_path)
    with pytest.raises(SystemExit, match="no report for dir8 under"):
        which.table(tmp_path, every_cell=True)
    with pytest.raises(SystemExit, match="give no RESULTS"):
        which.main([str(tmp_path), "--write"])


def test_the_table_marks_each_cell(scripts, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    sys.modules.pop("which_method", None)
    which = importlib.import_module("which_method")
    write_cell(tmp_path, "iid4", [entry("dense", None, 800.0), entry("dgc", (-0.008, -0.001), 30.0)])
    write_cell(
        tmp_path,
        "dir8",
        [entry("dense", None, 400.0), entry("dgc", (-0.05, 0.01), 20.0), entry("topk", (-0.05, -0.02), 9.0)],
    )
    lines = which.table(tmp_path).splitlines()
    # The three marks against the 1-point margin: within, inconclusive (straddling it), worse.
    assert lines[4] == (
        f"| {which.ROWS['dgc']} | 3 | 0.9000 ± 0.0100 | -0.45 ± 0.35 within | 30 "
        "| 3 | 0.9000 ± 0.0100 | -2.00 ± 3.00 inconclusive | 20 |"
    )
    assert lines[3] == f"| {which.ROWS['topk']} | - | not run | - | - | 3 | 0.9000 ± 0.0100 | -3.50 ± 1.50 worse | 9 |"
    (tmp_path / "iid4" / "report" / "seeds.json").write_text(json.dumps([entry("nameless", (-0.01, 0.0), 1.0)]))
    with pytest.raises(SystemExit, match="nameless"):
        which.table(tmp_path)
