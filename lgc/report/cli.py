"""``lgc-report`` on the command line: the table on stdout, ``report.md``, the plot and JSON rows."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lgc.report.budgets import budget_rows, budget_table
from lgc.report.bytes import bytes_table
from lgc.report.plot import plot_tradeoff
from lgc.report.records import LABEL_BY, RunRecord, load_runs
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


def _report_markdown(records: Sequence[RunRecord], plot_name: str, budgets: Sequence[float] | None = None) -> str:
    common = Path(os.path.commonpath([record.path.resolve() for record in records]))
    sources = "\n".join(f"- `{shown_path(record.path, common)}`" for record in records)
    over_seeds = ""
    if _has_repeats(records):
        over_seeds = (
            f"## Over seeds\n\n{seed_table(records)}\n\n"
            "Mean ± half-width of the 95 % confidence interval of the mean (Student t); the gap to dense "
            "is paired by seed; `≈ dense`: that interval holds 0. Rows are in the order given, not ranked.\n\n"
            "![accuracy over seeds against bytes](accuracy_over_seeds.png)\n\n"
            f"## At equal bytes\n\n{budget_table(records, budgets)}\n\n"
            "A method is within a budget when each of its runs sent at most that many wire MB per worker "
            "(everything it put on the network over the whole run). The highest mean among them is named with "
            "the methods tied with it (their gap to it, paired by seed, has a 95 % interval holding 0): the "
            "evidence does not separate those. Rows compare methods on one task only.\n\n"
            f"## Where the bytes go\n\n{bytes_table(records)}\n\n"
            "Means over seeds. Parameters with fewer elements than a method's `min_numel` travel dense every "
            "step and no codec reaches them; their share is of the bytes booked per parameter (logical, rank "
            "0's). Rank 0 broadcasts the module buffers every step (methods with local steps average them at "
            "exchanges). `-`: the runs do not book that part.\n\n"
        )
    return (
        f"# Accuracy against compression ratio\n\n{over_seeds}## Runs\n\n{report_table(records)}\n\n"
        "`n/a`: null in summary.json (nothing was sent that way); `-`: the run does not have this value.\n\n"
        f"![accuracy against compression ratio]({plot_name})\n\nRuns:\n\n{sources}\n"
    )


def _budgets(text: str) -> list[float]:
    """``--budgets 10,50,100``: positive numbers of MB."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers of MB") from None
    if not values or any(not value > 0 or value == float("inf") for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every budget must be a positive, finite number of MB")
    return values


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
    parser.add_argument(
        "--budgets",
        type=_budgets,
        metavar="MB[,MB...]",
        help="whole-run wire MB per worker at which to compare methods over seeds (default: powers of ten "
        "from the cheapest method's bytes, and the costliest method's)",
    )
    parser.add_argument(
        "--label",
        choices=LABEL_BY,
        default="settings",
        help="name each run by the settings that tell it apart (default), or by its folder under RUN_DIR "
        "(a last folder seedN counts as seed=N, so METHOD/seedN folders give one row per method)",
    )
    args = parser.parse_args(argv)
    try:
        records = load_runs(args.runs, label_by=args.label)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(report_table(records))
    if _has_repeats(records):
        print(f"\n{seed_table(records)}\n\n{budget_table(records, args.budgets)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        plot_path = args.out / "accuracy_vs_ratio.png"
        plot_tradeoff(records).savefig(plot_path, dpi=120)
        (args.out / "report.md").write_text(_report_markdown(records, plot_path.name, args.budgets))
        if _has_repeats(records):
            (args.out / "seeds.json").write_text(json.dumps(seed_rows(records), indent=2) + "\n")
            (args.out / "budgets.json").write_text(json.dumps(budget_rows(records, args.budgets), indent=2) + "\n")
            plot_seed_groups(records).savefig(args.out / "accuracy_over_seeds.png", dpi=120)
        print(f"-> {args.out / 'report.md'}, {plot_path}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(table_rows(records), indent=2) + "\n")
        print(f"-> {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
