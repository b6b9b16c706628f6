"""``lgc-train``'s default decided from the scale comparison, as ``scale_protocol.yaml``'s ``default_rule`` says.

    python experiments/scale_rule.py [RESULTS [STEP_COST]]
    # defaults: results/scale (its tables.json, from scale_tables.py --write) and results/step_cost_scale

Among the compressing methods marked ``within`` in every cell of the rule, the one sending the
fewest whole-run wire bytes (each cell's fraction of dense's, averaged over the cells) whose DDP step
is admitted: at every density of the rule, the upper end of the 95 % interval of its CPU step over
DDP's (``lgc-bench step``'s ``cpu_vs_ddp``, ``STEP_COST/step_DENSITY*.json``) at most the bound. If
none is ``within`` in every cell: the admitted method ``within`` in the most cells, fewest bytes among
those; if none is ``within`` anywhere: dense. Until every method has its mark in every cell of the
rule, nothing is picked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from scale_comparison import HERE, load_protocol

#: The protocol's method -> the ``lgc-bench step`` row that times the same setup (None: not timed, not admitted).
STEP_ROWS = {
    "fp16": "fp16",
    "topk": "topk",
    "lgc_rar": "lgc_rar",
    "lgc_rar_linear": "lgc_rar:training.codec=linear",
    # compressor=shared_topk_int8 as its config sets it: int8 values, Golomb positions, one warm-up step
    "shared_topk_int8": "shared_topk_int8",
    "dgc": "dgc",
    "lgc_ps": "lgc_ps",
    "powersgd": "powersgd",
    "sbc_delay": "sbc:delay=4",
    "signsgd": "signsgd",
    "diloco_h10": "none:delay=10;outer=sgd",
    "sparseloco": "sparseloco:delay=10",
}


def step_uppers(step_cost: Path, densities: list[float]) -> dict[str, dict[float, float]]:
    """Step-cost row -> density -> the upper end of its CPU-over-DDP interval.

    Raises SystemExit when a density has no ``step_DENSITY.json``, when a row carries no interval
    (a table from before ``cpu_vs_ddp``, or a delayed row timed in rounds of part of its delay) or
    when two tables time the same row: the rule never decides on missing or ambiguous step costs.
    """
    out: dict[str, dict[float, float]] = {}
    for density in densities:
        if not (step_cost / f"step_{density}.json").is_file():
            raise SystemExit(f"{step_cost}/step_{density}.json is missing: time the steps first (lgc-bench step)")
        for table in sorted(step_cost.glob(f"step_{density}*.json")):
            for label, row in json.loads(table.read_text())["rows"].items():
                if label in ("no_sync", "ddp"):  # the references: every group's table times DDP's own step again
                    continue
                if "cpu_vs_ddp" not in row:
                    raise SystemExit(
                        f"{table}: row {label} has no cpu_vs_ddp interval (time it with --rounds > 1, and with "
                        "--steps a multiple of its delay: scale_step_cost.py does both)"
                    )
                if density in out.get(label, {}):
                    raise SystemExit(f"{table}: row {label} at density {density} is timed in another table too")
                ratio = row["cpu_vs_ddp"]
                out.setdefault(label, {})[density] = ratio["mean"] + ratio["half_width"]
    return out


def pick(
    protocol: dict[str, Any], data: dict[str, Any], uppers: dict[str, dict[float, float]]
) -> tuple[str | None, str]:
    """The rule's pick (None while undecided) and the sentence that says why."""
    rule, reference = protocol["default_rule"], protocol["reference"]
    cells, bound, densities = rule["cells"], rule["max_step_vs_ddp"], rule["densities"]
    rows = {cell: {row["method"]: row for row in data[cell]["rows"]} for cell in cells}
    methods = [m for m in protocol["order"]["methods"] if m != reference]
    unmarked = [f"{cell}/{m}" for cell in cells for m in methods if rows[cell][m]["mark"] is None]
    if unmarked:
        return None, f"undecided: {len(unmarked)} method-cells have no mark yet (first: {unmarked[0]})"

    def admitted(method: str) -> bool:
        upper = uppers.get(STEP_ROWS.get(method, ""), {})
        return all(d in upper and upper[d] <= bound for d in densities)

    def fraction(method: str) -> float:
        return sum(rows[c][method]["wire_mb"] / rows[c][reference]["wire_mb"] for c in cells) / len(cells)

    within = {m: sum(rows[c][m]["mark"] == "within" for c in cells) for m in methods if admitted(m)}
    best = max(within.values(), default=0)
    if best == 0:
        return reference, "no admitted compressing method is within the margin in any cell: dense"
    chosen = min((m for m, count in within.items() if count == best), key=fraction)
    where = "every cell" if best == len(cells) else f"{best} of {len(cells)} cells (none in every cell)"
    return chosen, f"{chosen}: within the margin in {where}, {fraction(chosen):.4f} of dense's bytes, step admitted"


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    results = Path(args[0]) if args else HERE / "results" / "scale"
    step_cost = Path(args[1]) if len(args) > 1 else HERE / "results" / "step_cost_scale"
    protocol = load_protocol()
    data = json.loads((results / "tables.json").read_text())
    chosen, why = pick(protocol, data, step_uppers(step_cost, protocol["default_rule"]["densities"]))
    print(why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
