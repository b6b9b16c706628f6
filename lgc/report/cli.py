"""``lgc-report`` on the command line: the table on stdout, ``report.md``, the plot and JSON rows."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lgc.report.plot import plot_tradeoff
from lgc.report.records import RunRecord, load_runs
from lgc.report.seeds import group_by_seed, plot_seed_groups, seed_rows, seed_table
from lgc.report.table import report_table, table_rows

__all__ = ["main", "shown_path"]


def shown_path(path: Path, common: Path) -> str:
    """A run folder as a results page names it: relative to the working directory when inside it, else
    to ``common``'s parent (the runs' common folder, by name). Never an absolute path of this machine."""
    resolved = path.resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.relative_to(common.parent).as_posix()


def _report_markdown(records: Sequence[RunRecord], plot_name: str) -> str:
    common = Path(os.path.commonpath([record.path.resolve() for record in records]))
    sources = "\n".join(f"- `{shown_path(record.path, common)}`" for record in records)
    over_seeds = ""
    if _has_repeats(records):
        over_seeds = (
            f"## Over seeds\n\n{seed_table(records)}\n\n"
            "Mean ± half-width of the 95 % confidence interval of the mean (Student t); the gap to dense "
            "is paired by seed; `≈ dense`: that interval holds 0. Rows are in the order given, not ranked.\n\n"
            "![accuracy over seeds against bytes](accuracy_over_seeds.png)\n\n"
        )
    return (
        f"# Accuracy against compression ratio\n\n{over_seeds}## Runs\n\n{report_table(records)}\n\n"
        "`n/a`: null in summary.json (nothing was sent that way); `-`: the run does not have this value.\n\n"
        f"![accuracy against compression ratio]({plot_name})\n\nRuns:\n\n{sources}\n"
    )


def _has_repeats(records: Sequence[RunRecord]) -> bool:
    """Whether some method ran with more than one seed (then the report has its table over seeds)."""
    return any(len(group.records) > 1 for group in group_by_seed(records))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lgc-report",
        description="Compare lgc-train runs from their summary.json files: a markdown table on stdout and, "
        "with --out, report.md and accuracy_vs_ratio.png.",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="run folders or folders of runs (a Hydra multirun folder), searched recursively for summary.json",
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="write report.md and accuracy_vs_ratio.png here")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the table rows as JSON to this file")
    args = parser.parse_args(argv)
    try:
        records = load_runs(args.runs)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(report_table(records))
    if _has_repeats(records):
        print(f"\n{seed_table(records)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        plot_path = args.out / "accuracy_vs_ratio.png"
        plot_tradeoff(records).savefig(plot_path, dpi=120)
        (args.out / "report.md").write_text(_report_markdown(records, plot_path.name))
        if _has_repeats(records):
            (args.out / "seeds.json").write_text(json.dumps(seed_rows(records), indent=2) + "\n")
            plot_seed_groups(records).savefig(args.out / "accuracy_over_seeds.png", dpi=120)
        print(f"-> {args.out / 'report.md'}, {plot_path}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(table_rows(records), indent=2) + "\n")
        print(f"-> {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
