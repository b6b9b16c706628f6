"""The scale comparison's tables, generated from the committed run records and the protocol.

    python experiments/scale_tables.py [RESULTS] [--write]
    # default RESULTS: experiments/results/scale; --write saves RESULTS/tables.md and tables.json

For every cell of ``scale_protocol.yaml``, every method in the protocol's order: the seeds run, the
metric's mean and 95 % interval, the gap to the reference paired by seed (in points) and its mark
(:mod:`lgc.report.marks`: within, worse or inconclusive against the margin), given only once every
seed the protocol fixes has run (a method still running shows how many have), and the whole-run
wire bytes per worker split into what the method's codec carries and the fixed overhead (module
buffers, parameters sent dense) with the ceiling no codec can pass (:func:`lgc.report.bytes.run_bytes`).

Under each table: the cell's median spread of paired gaps, the smallest loss the cell marks
``worse`` with the protocol's power, and how often a method as good as the reference is marked
``within``. The commits the runs came from are listed (each ``summary.json`` records its own).
Last, LGC's verdict on both byte accountings with each cell's byte floor (:mod:`scale_verdict`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from one_message_tables import replace_in
from scale_comparison import HERE, PROTOCOL, load_protocol
from scale_verdict import (
    ACCOUNTINGS,
    GOAL_VS_DGC,
    _fmt,
    _interval,
    _learned,
    _short,
    cell_verdict,
    floor,
    lgc_block,
    verdict_section,
)

from lgc.report.bytes import run_bytes
from lgc.report.marks import detectable_loss, mark, within_probability
from lgc.report.records import WIRE_MB_PER_WORKER, RunRecord, load_runs
from lgc.report.seeds import Interval
from lgc.report.values import MISSING, lookup


def _records(folder: Path, seeds: list[int], earlier: Path | None = None) -> dict[int, RunRecord]:
    """Seed -> run record of one method's folder (``seedN/summary.json``), each checked; with
    ``earlier``, the superseded records found there take the place of the runs that replaced them.

    A table averages exactly the runs the protocol fixes, so a record that does not fit is refused,
    naming its file, rather than counted or dropped: one outside a ``seedN`` folder, one whose folder's
    N is not the seed it ran, a seed the protocol does not list (``seeds``), or a run without a finite
    metric.
    """
    if not folder.is_dir() or not any(folder.rglob("summary.json")):
        return {}
    records: dict[int, RunRecord] = {}
    for record in load_runs([folder], label_by="folder"):
        file = record.path / "summary.json"
        seed = record.config.get("seed")
        if record.path.parent != folder or record.path.name != f"seed{seed}":
            raise SystemExit(f"{file}: a run of seed {seed} belongs in {folder}/seed{seed}/summary.json")
        if seed not in seeds:
            raise SystemExit(f"{file}: seed {seed} is not among the protocol's seeds {seeds}")
        if not record.metric_is_final:
            steps, validated = record.summary.get("steps"), record.summary.get("validated_step")
            raise SystemExit(f"{file}: its metrics are of step {validated}, not of its last step {steps}")
        metric = record.metric
        if metric is None or not math.isfinite(metric):
            raise SystemExit(f"{file}: no finite {record.metric_key} ({metric}); a table cannot mark this run")
        records[seed] = record
    if earlier is not None:
        records.update(_records(earlier, seeds))
    return records


def _every_run(values: list[Any], what: str, verb: str) -> list[float]:
    """A column's values over a row's runs: all of them, or none where no run has it. A column some runs
    have and others not is refused (its figure would be over other seeds than the row's other columns)."""
    present = [float(v) for v in values if v is not None]
    if present and len(present) < len(values):
        raise SystemExit(f"{what}: {verb} by {len(present)} of the {len(values)} runs")
    return present


def _mean(values: list[float | None], what: str) -> float | None:
    """The mean over every seed's run, or None where no run books it."""
    present = _every_run(values, what, "booked")
    return sum(present) / len(present) if present else None


def _refreshes(summary: dict[str, Any]) -> Any:
    """A run's codec refreshes; 0 for an LGC run without a refresh threshold (a record from before the
    count was kept included), None where it is not known."""
    if "lgc_refreshes" in summary:
        return summary["lgc_refreshes"]
    threshold = lookup(summary.get("config") or {}, "compressor.stages.refresh_threshold")
    return 0 if "lgc_stages" in summary and threshold in (MISSING, None) else None


#: LGC's measurements in the loop (``measure_error``), per run: tables.json key -> (reader, column, format).
LGC_MEASURES: dict[str, tuple[Any, str, str]] = {
    "lgc_error": (lambda summary: summary.get("lgc_true_error"), "delivered-sum error", ".4f"),
    "premise_r": (lambda summary: (summary.get("lgc_premise") or {}).get("correlation"), "premise r", ".3f"),
    "premise_share": (lambda summary: (summary.get("lgc_premise") or {}).get("energy_share"), "energy share", ".4f"),
    "refreshes": (_refreshes, "refreshes", ".1f"),
}


def _measured(runs: dict[int, RunRecord], read: Any, what: str) -> dict[str, Any] | None:
    """The interval over the seeds of one of LGC's measurements, None where no run has it."""
    interval = Interval.of(_every_run([read(record.summary) for record in runs.values()], what, "measured"))
    return interval.as_dict() if interval else None


#: The sparsifier LGC's codec carries the values of: LGC's rows at its density are paired with it too.
SPARSIFIER = "topk"


def _density(runs: dict[int, RunRecord]) -> float | None:
    """The ``compressor.density`` every run of a row ran at (None where they differ or do not set one)."""
    found = {lookup(record.config, "compressor.density") for record in runs.values()}
    value = found.pop() if len(found) == 1 else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _gap_to_sparsifier(
    method: str, runs: dict[int, RunRecord], sparsifier: dict[int, RunRecord], seeds: list[int]
) -> dict[str, Any] | None:
    """An LGC row's gap to top-k with error feedback at the same density, paired by seed, in points, once both
    rows have every seed: what the codec costs over the sparsification it rides on. None otherwise."""
    if not _learned(method) or not all(s in runs and s in sparsifier for s in seeds):
        return None
    density = _density(runs)
    if density is None or density != _density(sparsifier):
        return None
    gap = Interval.of([100 * (runs[s].metric - sparsifier[s].metric) for s in seeds])
    return gap.as_dict() if gap else None


def cell_rows(
    protocol: dict[str, Any], results: Path, cell: str, superseded: Path | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of one cell and what the cell can detect (read as it was before the runs that replaced
    the records in ``superseded``, when given)."""
    seeds = list(protocol["seeds"])
    margin, power = float(protocol["margin_points"]), float(protocol["power"])

    def records(method: str) -> dict[int, RunRecord]:
        return _records(results / cell / method, seeds, superseded and superseded / cell / method)

    reference = records(protocol["reference"])
    sparsifier = records(SPARSIFIER)
    rows, spreads, commits = [], [], set()
    for method in protocol["order"]["methods"]:
        runs = records(method)
        for record in runs.values():
            provenance = record.summary.get("provenance") or {}
            commits.add((provenance.get("commit") or "unknown")[:7] + ("+changes" if provenance.get("dirty") else ""))
        metric = Interval.of([r.metric for r in runs.values()])
        paired = [100 * (runs[s].metric - reference[s].metric) for s in seeds if s in runs and s in reference]
        gap = Interval.of(paired) if method != protocol["reference"] else None
        complete = all(s in runs for s in seeds) and all(s in reference for s in seeds)
        if gap is not None and gap.sd and complete:
            spreads.append(gap.sd)
        parts = [run_bytes(r) for r in runs.values()]
        rows.append(
            {
                "method": method,
                "label": protocol["methods"][method]["label"],
                "seeds": sorted(runs),
                "metric": metric.as_dict() if metric else None,
                "gap_points": gap.as_dict() if gap else None,
                "mark": mark(gap, margin) if complete and gap is not None else None,
                "gap_to_sparsifier_points": _gap_to_sparsifier(method, runs, sparsifier, seeds),
                **{
                    name: _measured(runs, read, f"{cell}/{method} {name}")
                    for name, (read, _, _) in LGC_MEASURES.items()
                },
                **{
                    name: _mean([p[key] for p in parts], f"{cell}/{method} {key}")
                    for name, key in (
                        ("wire_mb", WIRE_MB_PER_WORKER),
                        ("overhead_mb", "overhead_wire_mb_per_worker"),
                        ("codec_mb", "codec_wire_mb_per_worker"),
                        ("ceiling", "ceiling"),
                        ("warmup_mb", "warmup_wire_mb_per_worker"),
                    )
                },
            }
        )
    spread = statistics.median(spreads) if spreads else None
    n = len(seeds)
    power_line = {
        "median_sd_points": spread,
        "sd_range_points": [min(spreads), max(spreads)] if spreads else None,
        "detectable_loss_points": detectable_loss(spread, n, margin, power) if spread else None,
        "within_probability_at_no_loss": within_probability(0.0, spread, n, margin) if spread else None,
        "commits": sorted(commits),
    }
    return rows, power_line


def cell_table(protocol: dict[str, Any], cell: str, rows: list[dict[str, Any]], power: dict[str, Any]) -> str:
    spec = protocol["cells"][cell]
    n, margin = len(protocol["seeds"]), protocol["margin_points"]
    lines = [
        f"## {cell}: {spec['title']}",
        "",
        f"`{spec['metric']}` after {spec['steps']} steps; gap to {protocol['reference']} paired by seed, points, "
        f"95 % interval; mark against a {margin:g}-point margin at n = {n}.",
        "",
        "| method | seeds | " + spec["metric"] + " | gap to dense (points) | mark | wire MB/worker | "
        "codec MB/worker | overhead MB/worker | ceiling (x) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row["seeds"]:
            lines.append(f"| {row['label']} | 0 of {n} | not run yet | - | - | - | - | - | - |")
            continue
        gap = row["gap_points"]
        gap_text = "-" if gap is None else _gap_text(gap)
        seeds = f"{len(row['seeds'])}" if len(row["seeds"]) == n else f"{len(row['seeds'])} of {n}"
        lines.append(
            f"| {row['label']} | {seeds} | {_interval(row['metric'], '.4f')} | {gap_text} | {row['mark'] or '-'} | "
            f"{_fmt(row['wire_mb'], '.4g')} | {_fmt(row['codec_mb'], '.4g')} | {_fmt(row['overhead_mb'], '.4g')} | "
            f"{_fmt(row['ceiling'], '.0f')} |"
        )
    lines.append("")
    if power["median_sd_points"] is not None:
        lines.append(
            f"Median spread of paired gaps {power['median_sd_points']:.2f} points "
            f"({power['sd_range_points'][0]:.2f}-{power['sd_range_points'][1]:.2f} over its complete methods; "
            "a noisier method detects less): at the median this cell marks a loss of "
            f"{power['detectable_loss_points']:.2f} points or more `worse` with probability at least "
            f"{protocol['power']:g}, "
            f"and a method as good as dense `within` with probability {power['within_probability_at_no_loss']:.2f}."
        )
    else:
        lines.append("No method has all its seeds paired with dense yet: the cell's power is not known.")
    lines += _measures_table(rows, n)
    lines += ["", f"Runs from commits: {', '.join(power['commits']) or '-'}.", ""]
    return "\n".join(lines)


def _measures_table(rows: list[dict[str, Any]], n: int) -> list[str]:
    """LGC's measurements in the loop beside its rows' marks (the rows whose runs measured the error)."""
    measured = [row for row in rows if row["lgc_error"] is not None]
    if not measured:
        return []
    lines = [
        "",
        "LGC in the loop (runs with `measure_error`), mean ± 95 % interval over the seeds: the delivered sum's "
        "relative error at the leader's positions over the compressed steps (1: what sending nothing scores), the "
        "premise there (r: the workers' values' mean pairwise correlation; energy share: a non-leader's squared "
        "gradient lying at the leader's positions, chance = the density), and the codec refreshes per run.",
        "",
        "| method | seeds | mark | " + " | ".join(what for _, what, _ in LGC_MEASURES.values()) + " |",
        "|---|---|---|" + "---|" * len(LGC_MEASURES),
    ]
    for row in measured:
        seeds = f"{len(row['seeds'])}" if len(row["seeds"]) == n else f"{len(row['seeds'])} of {n}"
        cells = [_interval(row[name], fmt) if row[name] else "-" for name, (_, _, fmt) in LGC_MEASURES.items()]
        lines.append(f"| {row['label']} | {seeds} | {row['mark'] or '-'} | " + " | ".join(cells) + " |")
    return lines


def page(protocol: dict[str, Any], results: Path, superseded: Path | None = None) -> tuple[str, dict[str, Any]]:
    """``tables.md``'s text and ``tables.json``'s data: every cell of the protocol, in its order."""
    pages, data = ["# The comparison at scale", ""], {}
    for cell in protocol["order"]["cells"]:
        rows, power = cell_rows(protocol, results, cell, superseded)
        data[cell] = {"rows": rows, "power": power}
        pages.append(cell_table(protocol, cell, rows, power))
    pages.append(verdict_section(protocol, data))
    return "\n".join(pages), data


#: The evidence page's block that holds :func:`readme_table` (``--write`` replaces what is between the markers).
EVIDENCE = HERE.parent / "docs" / "evidence.md"
BEGIN, END = "<!-- which-method-scale:begin -->", "<!-- which-method-scale:end -->"
#: LGC's page, whose block per protocol (named by its tables) holds :func:`scale_verdict.lgc_block`.
LGC_PAGE = HERE.parent / "docs" / "lgc.md"


def lgc_markers(protocol: dict[str, Any]) -> tuple[str, str]:
    """The markers of ``protocol``'s block on LGC's page."""
    name = protocol.get("tables", "tables")
    return f"<!-- lgc-verdict-{name}:begin -->", f"<!-- lgc-verdict-{name}:end -->"


def _readme_cell(row: dict[str, Any], seeds: int) -> str:
    if not row["seeds"]:
        return "not run yet"
    gap = row["gap_points"]
    if row["mark"] is None:  # still running, or the reference
        done = f"{len(row['seeds'])} of {seeds} seeds"
        return done if gap is None or len(row["seeds"]) < seeds else f"{done}, {_gap_text(gap)}"
    return f"{_gap_text(gap)} {row['mark']}; {_fmt(row['wire_mb'], '.4g')} MB"


def _gap_text(gap: dict[str, Any]) -> str:
    return _interval(gap, "+.2f")


def readme_table(protocol: dict[str, Any], data: dict[str, Any]) -> str:
    """ "Which method" at scale: per method and cell, the gap to dense (points, 95 % interval) with its
    mark and whole-run wire MB per worker, once all its seeds have run."""
    cells, seeds = protocol["order"]["cells"], len(protocol["seeds"])
    reference = {cell: next(r for r in data[cell]["rows"] if r["method"] == protocol["reference"]) for cell in cells}
    lines = [
        "| method | " + " | ".join(cells) + " |",
        "|---|" + "---|" * len(cells),
        f"| {protocol['methods'][protocol['reference']]['label']} | "
        + " | ".join(
            "not run yet"
            if not reference[cell]["metric"]
            else f"{protocol['cells'][cell]['metric']} {_interval(reference[cell]['metric'], '.4f')}; "
            f"{_fmt(reference[cell]['wire_mb'], '.4g')} MB"
            for cell in cells
        )
        + " |",
    ]
    for method in protocol["order"]["methods"]:
        if method == protocol["reference"]:
            continue
        rows = [next(r for r in data[cell]["rows"] if r["method"] == method) for cell in cells]
        lines.append(
            f"| {protocol['methods'][method]['label']} | " + " | ".join(_readme_cell(r, seeds) for r in rows) + " |"
        )
    return "\n".join(lines)


#: The README's block that holds :func:`readme_summary`.
SUMMARY_PAGE = HERE.parent / "README.md"
SUMMARY_BEGIN, SUMMARY_END = "<!-- scale-summary:begin -->", "<!-- scale-summary:end -->"


def _by_mark(marked: list[dict[str, Any]]) -> list[str]:
    """The marked rows named under each mark that has any (`` `within`: fp16; ... ``)."""
    sentences = []
    for word in ("within", "inconclusive", "worse"):
        names = [_short(row["label"]) for row in marked if row["mark"] == word]
        if names:
            sentences.append(f"`{word}`: {'; '.join(names)}.")
    return sentences


def readme_summary(protocol: dict[str, Any], data: dict[str, Any]) -> str:
    """One line per cell for the README: the methods under each mark, what the cell detects, the byte floor and
    LGC's goal on both accountings."""
    n, reference = len(protocol["seeds"]), protocol["reference"]
    lines = []
    for cell in protocol["order"]["cells"]:
        rows, power = data[cell]["rows"], data[cell]["power"]
        head = f"- **{cell}**, {protocol['cells'][cell]['title']}:"
        others = [row for row in rows if row["method"] != reference]
        if not any(row["seeds"] for row in rows):
            lines.append(f"{head} not run yet.")
            continue
        marked = [row for row in others if row["mark"] is not None]
        text = [head] if len(marked) == len(others) else [f"{head} {len(marked)} of {len(others)} methods marked;"]
        text += _by_mark(marked)
        if power["detectable_loss_points"] is not None:
            text.append(
                f"A loss of {power['detectable_loss_points']:.2f} points or more is marked `worse` with probability "
                f"at least {protocol['power']:g} (at the median spread)."
            )
        bound = floor(rows, reference, n)
        if bound["overhead_mb"] is not None and bound["ceiling"] is not None:
            text.append(
                f"Fixed overhead under LGC's settings (its tensors sent dense and module buffers, every step) "
                f"{bound['overhead_mb']:.4g} MB per worker: no codec that sends every step with those settings "
                "can send more than "
                f"{bound['ceiling']:.0f}x fewer bytes than dense there."
            )
        goal = "; ".join(
            f"{cell_verdict(rows, reference, key)['status']} on {words}" for key, words in ACCOUNTINGS.items()
        )
        text.append(
            f"LGC's goal ({GOAL_VS_DGC:g}x fewer bytes than DGC within the margin, [verdict](docs/lgc.md)): {goal}."
        )
        lines.append(" ".join(text))
    return "\n".join(lines)


def study_markers(protocol: dict[str, Any]) -> tuple[str, str]:
    """The markers of a study protocol's line in the README (named by its tables)."""
    name = protocol.get("tables", "tables")
    return f"<!-- {name}-summary:begin -->", f"<!-- {name}-summary:end -->"


def readme_study_summary(protocol: dict[str, Any], data: dict[str, Any]) -> str:
    """One line per cell of an LGC study for the README: LGC's settings under each mark, each one's gap to top-k at
    its density where it has one, and LGC's goal on both accountings."""
    n, reference = len(protocol["seeds"]), protocol["reference"]
    lines = []
    for cell in protocol["order"]["cells"]:
        rows = data[cell]["rows"]
        learned = [row for row in rows if _learned(row["method"])]
        marked = [row for row in learned if row["mark"] is not None]
        text = [f"- **{cell}**, {len(marked)} of {len(learned)} of LGC's settings marked ({n} seeds each):"]
        text += _by_mark(marked)
        paired = [row for row in marked if row.get("gap_to_sparsifier_points")]
        if paired:
            text.append(
                f"Against {_short(protocol['methods'][SPARSIFIER]['label'])} at the same density, paired by seed: "
                + "; ".join(f"{_short(row['label'])} {_gap_text(row['gap_to_sparsifier_points'])}" for row in paired)
                + " points."
            )
        goal = "; ".join(
            f"{cell_verdict(rows, reference, key)['status']} on {words}" for key, words in ACCOUNTINGS.items()
        )
        text.append(f"LGC's goal: {goal}.")
        lines.append(" ".join(text))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=HERE / "results" / "scale")
    parser.add_argument("--protocol", type=Path, default=PROTOCOL)
    parser.add_argument("--write", action="store_true")
    parser.add_argument(
        "--superseded",
        action="store_true",
        help="print the tables as they read before the runs that replaced the records kept in RESULTS/superseded",
    )
    args = parser.parse_args(argv)
    if args.superseded and args.write:
        parser.error("--superseded prints an earlier reading; the written tables are the current one")
    protocol = load_protocol(args.protocol)
    text, data = page(protocol, args.results, args.results / "superseded" if args.superseded else None)
    print(text)
    if args.write:
        name = protocol.get("tables", "tables")  # a study's tables beside the comparison's
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / f"{name}.md").write_text(text)
        (args.results / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
        if args.results == HERE / "results" / "scale":  # the committed records
            if args.protocol.resolve() == PROTOCOL.resolve():
                EVIDENCE.write_text(replace_in(EVIDENCE.read_text(), readme_table(protocol, data), BEGIN, END))
                summary = replace_in(
                    SUMMARY_PAGE.read_text(), readme_summary(protocol, data), SUMMARY_BEGIN, SUMMARY_END
                )
                SUMMARY_PAGE.write_text(summary)
            else:
                study = readme_study_summary(protocol, data)
                SUMMARY_PAGE.write_text(replace_in(SUMMARY_PAGE.read_text(), study, *study_markers(protocol)))
            LGC_PAGE.write_text(replace_in(LGC_PAGE.read_text(), lgc_block(protocol, data), *lgc_markers(protocol)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
