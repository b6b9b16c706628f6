"""The sharded comparison's table, generated from the committed run records and ``sharded_protocol.yaml``.

    python experiments/sharded_tables.py [RESULTS] [--write]
    # default RESULTS: experiments/results/sharded; --write saves RESULTS/tables.md and tables.json and
    # the evidence page's block

For every method of the protocol, under DDP, FSDP2 and HSDP: the seeds run, the metric's mean and
95 % interval, and for the sharded runs the gap to the same method's DDP run, paired by seed (in
points), with its mark against the protocol's margin (:mod:`lgc.report.marks`: within, worse,
inconclusive) and whether the interval holds 0; a mark is given only once every seed has run under
both. Whole-run wire MB per worker beside it: FSDP2's are the reduce-scatters' (gloo runs one as an
allreduce of the whole input, ``2 (P - 1) / P`` of it), HSDP's the all-reduces across the replicas only
(the reduce-scatter inside a replica is FSDP2's own, not counted). The commits the runs came from are
listed (each ``summary.json`` records its own).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from network_tables import EVIDENCE
from one_message_tables import replace_in
from scale_comparison import HERE, load_protocol
from scale_tables import _fmt, _gap_text, _interval, _records

from lgc.report.bytes import run_bytes
from lgc.report.marks import mark
from lgc.report.records import WIRE_MB_PER_WORKER
from lgc.report.seeds import Interval

PROTOCOL = HERE / "sharded_protocol.yaml"
RESULTS = HERE / "results" / "sharded"
BEGIN, END = "<!-- sharded-comparison:begin -->", "<!-- sharded-comparison:end -->"


def rows(protocol: dict[str, Any], results: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per method of the protocol's order, and the commits the runs came from."""
    (cell,) = protocol["order"]["cells"]
    seeds, margin = list(protocol["seeds"]), float(protocol["margin_points"])
    methods = protocol["methods"]
    ddp_of = {spec["base"]: name for name, spec in methods.items() if spec["strategy"] == "ddp"}
    table, commits = [], set()
    for name in protocol["order"]["methods"]:
        spec = methods[name]
        runs = _records(results / cell / name, seeds)
        for record in runs.values():
            provenance = record.summary.get("provenance") or {}
            commits.add((provenance.get("commit") or "unknown")[:7] + ("+changes" if provenance.get("dirty") else ""))
        reference = _records(results / cell / ddp_of[spec["base"]], seeds) if spec["strategy"] != "ddp" else {}
        paired = [100 * (runs[s].metric - reference[s].metric) for s in seeds if s in runs and s in reference]
        gap = Interval.of(paired) if spec["strategy"] != "ddp" else None
        complete = all(s in runs for s in seeds) and all(s in reference for s in seeds)
        wire = [run_bytes(r)[WIRE_MB_PER_WORKER] for r in runs.values()]
        wire = [w for w in wire if w is not None]
        metric = Interval.of([r.metric for r in runs.values()])
        table.append(
            {
                "method": name,
                "label": spec["label"],
                "base": spec["base"],
                "strategy": spec["strategy"],
                "seeds": sorted(runs),
                "metric": metric.as_dict() if metric else None,
                "gap_points": gap.as_dict() if gap else None,
                "mark": mark(gap, margin) if complete and gap is not None else None,
                "holds_zero": gap.holds(0.0) if complete and gap is not None else None,
                "wire_mb": sum(wire) / len(wire) if wire else None,
            }
        )
    return table, sorted(commits)


def table_text(protocol: dict[str, Any], table: list[dict[str, Any]], commits: list[str]) -> str:
    (cell,) = protocol["order"]["cells"]
    spec, n, margin = protocol["cells"][cell], len(protocol["seeds"]), protocol["margin_points"]
    lines = [
        f"{spec['title']}: `{spec['metric']}` after {spec['steps']} steps, {n} seeds, 95 % intervals; each sharded "
        f"run's gap to the same method under DDP, paired by seed, in points, marked against a {margin:g}-point "
        "margin (within: the interval lies above it).",
        "",
        f"| method | strategy | seeds | {spec['metric']} | gap to DDP (points) | mark | interval holds 0 | "
        "wire MB/worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        seeds = f"{len(row['seeds'])}" if len(row["seeds"]) == n else f"{len(row['seeds'])} of {n}"
        metric = "not run yet" if not row["metric"] else _interval(row["metric"], ".4f")
        gap = "-" if row["gap_points"] is None else _gap_text(row["gap_points"])
        zero = "-" if row["holds_zero"] is None else ("yes" if row["holds_zero"] else "no")
        lines.append(
            f"| {row['base']} | {row['strategy']} | {seeds} | {metric} | {gap} | {row['mark'] or '-'} | {zero} | "
            f"{_fmt(row['wire_mb'], '.4g')} |"
        )
    lines += [
        "",
        "Wire MB: FSDP2's are its reduce-scatters as gloo runs them (an allreduce of the whole input); HSDP's are "
        "the all-reduces across its 2 replicas only, the exact reduce-scatter inside a replica not counted.",
        "",
        f"Runs from commits: {', '.join(commits) or '-'}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    protocol = load_protocol(PROTOCOL)
    table, commits = rows(protocol, args.results)
    text = table_text(protocol, table, commits)
    print(text)
    if args.write:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "tables.md").write_text("# Sharded training against DDP\n\n" + text + "\n")
        (args.results / "tables.json").write_text(json.dumps({"rows": table, "commits": commits}, indent=1) + "\n")
        EVIDENCE.write_text(replace_in(EVIDENCE.read_text(), text, BEGIN, END))
    return 0


if __name__ == "__main__":
    sys.exit(main())
