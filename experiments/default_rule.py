"""The rule that chooses ``lgc-train``'s default compressor, applied to the committed results.

    python experiments/default_rule.py [COMPARISON [STEP_COST]]
    # defaults: this folder's results/fashion_mnist and results/step_cost

The rule (``docs/evidence.md``, "How lgc-train's default is chosen"): among the methods *at dense's accuracy* in
both cells of the Fashion-MNIST comparison (4 workers IID, 8 workers Dirichlet(0.5)): the gap to
dense, paired by seed over at least 3 seeds, has a 95 % interval whose lower end lies at most
``MARGIN`` below 0 (``lgc_verdict.standing``), the one that sends the fewest whole-run bytes, if its
DDP step costs at most 1.25x DDP's own allreduce step at densities 0.1 % and 1 % (``lgc-bench step``,
mean CPU time, ``step_cost/step_DENSITY[_GROUP].json``, each over DDP's row of its own run). An
undecided method that could send fewer bytes than the pick gets more seeds (up to ``MAX_SEEDS``)
before anything is picked; if no method qualifies in both cells, the rule falls to ``SECOND_TIER``.
Bytes are compared as each cell's fraction of dense's bytes, averaged over the two cells (the
cells differ in workers, so their MB do not add up). Prints the table; until every method whose step
is admitted has run over 3 seeds paired with dense in both cells (one that a cell puts below dense
by more than the margin excepted), it is provisional, picks nothing and writes nothing; then it
writes ``COMPARISON/default_rule.md``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lgc_verdict import CELLS, MARGIN, MARKS, MAX_SEEDS, MIN_PAIRED, load_cell, paired, standing, unfinished

HERE = Path(__file__).parent
#: LGC-RAR's lean codec (experiment=embedded/lgc_rar_lean) as lgc-bench step names it.
LEAN = "lgc_rar:training.codec=linear;latent_dtype=int8;leaders.index_coding=golomb;leaders.value_order=position"
#: The comparison's method -> the row of experiments/step_cost.sh's tables that times the same setup
#: (None: not timed there, so not admitted).
STEP_ROWS = {
    "dense": "ddp",
    "fp16": "fp16",
    "powersgd": "powersgd",
    "topk": "topk",
    "dgc": "dgc",
    "sbc": "sbc",
    "redsync": "redsync",
    "shared_topk_int8_lean": "shared_topk_int8",
    "shared_topk_int8": "shared_topk:values=int8;measure_error=true",
    "shared_topk_fp16": "shared_topk:values=float16;measure_error=false",
    "lgc_rar": "lgc_rar",
    "lgc_rar_linear": "lgc_rar:training.codec=linear",
    "demo": "demo",
    "signsgd": "signsgd",
    "sbc_delay": "sbc:delay=4",
    "sbc_delay_all": "sbc:delay=4;min_numel=0",
    "sparseloco": "sparseloco:delay=10",
    "diloco_h10": "none:delay=10;outer=sgd",
    "shared_topk_int8_lean_delay": "shared_topk_int8:delay=4",
    "lgc_rar_lean": LEAN,
    "lgc_rar_lean_delay": f"{LEAN};delay=4",
    "lgc_rar_lean_delay_all": f"{LEAN};delay=4;min_numel=0",
    "qsgd": "qsgd",
    "terngrad": "terngrad",
    "random_block": "random_block:shared=true",
    "lgc_ps": "lgc_ps",
    # H = 50 exchanges 5x less often than H = 10: that row bounds its cost from above.
    "diloco_h50": "none:delay=10;outer=sgd",
}
DENSITIES = ("0.001", "0.01")
MAX_STEP_VS_DDP = 1.25
#: The cell the rule falls to when no method is at dense's accuracy in every cell.
SECOND_TIER = "iid4"


#: LGC's knobs in a table's row names as lgc-bench step spelled them before they were grouped
#: (the committed tables of experiments/results/step_cost/), and as it spells them now.
_GROUPED = {
    "codec=": "training.codec=",
    "index_coding=": "leaders.index_coding=",
    "value_order=": "leaders.value_order=",
    "warmup_steps=": "stages.warmup_steps=",
    "ae_steps=": "stages.ae_steps=",
}


def _row_name(name: str) -> str:
    """A table's row name with LGC's knobs spelled in their groups (``lgc_rar:codec=linear`` -> ``training.codec``)."""
    method, sep, knobs = name.partition(":")
    if not method.startswith("lgc_") or not sep:
        return name
    grouped = []
    for knob in knobs.split(";"):
        prefix = next((flat for flat in _GROUPED if knob.startswith(flat)), None)
        grouped.append(_GROUPED[prefix] + knob[len(prefix) :] if prefix else knob)
    return f"{method}:{';'.join(grouped)}"


def _steps(step_cost: Path) -> dict[str, dict[str, float]]:
    """Method row -> density -> its mean CPU step over DDP's (lgc-bench step's ``mean_cpu_x`` ratio)."""
    out: dict[str, dict[str, float]] = {}
    for density in DENSITIES:
        path = step_cost / f"step_{density}.json"
        if not path.exists():
            raise SystemExit(f"{path} is missing: run experiments/step_cost.sh first (the rule needs both densities)")
        # step_DENSITY.json and its groups' step_DENSITY_GROUP.json, each row over its own run's DDP row
        for table in sorted(step_cost.glob(f"step_{density}*.json")):
            rows = json.loads(table.read_text())["rows"]
            ddp = rows["ddp"]["mean_cpu_x"]
            for name, row in rows.items():
                if name != "ddp":
                    out.setdefault(_row_name(name), {})[density] = row["mean_cpu_x"] / ddp
        out.setdefault("ddp", {})[density] = 1.0
    return out


def _gap(entry: dict | None) -> str:
    """``mean ± half-width`` of the paired gap in points with its seeds, or ``not run``."""
    if entry is None:
        return "not run"
    gap = entry.get("gap_to_dense")
    if not gap:
        return f"{entry.get('vs_dense', '-')} (n=0)"
    return f"{100 * gap['mean']:+.2f} ± {100 * (gap.get('half_width') or 0):.2f} (n={paired(entry)})"


def admitted(label: str, steps: dict[str, dict[str, float]]) -> bool:
    """Whether the method's DDP step is timed at every density and costs at most ``MAX_STEP_VS_DDP`` there."""
    step = steps.get(STEP_ROWS.get(label, ""))
    return step is not None and all(d in step and step[d] <= MAX_STEP_VS_DDP for d in DENSITIES)


def pick(
    cells: dict[str, dict[str, dict]], steps: dict[str, dict[str, float]]
) -> tuple[list[str], str | None, str, list[str]]:
    """The table's rows, the rule's pick (None: none yet), the sentence that says how, and the seeds it waits for.

    Tier 1: step admitted, ``yes`` in every cell, the fewest bytes (mean fraction of dense's over the
    cells). Tier 2, only when tier 1 can have no pick: the same in ``SECOND_TIER`` alone. In a tier,
    a step-admitted method that is ``undecided`` where the tier needs ``yes`` (and ``no`` nowhere)
    and would send fewer bytes than the tier's pick keeps the rule waiting for its seeds.
    """
    labels = sorted({label for entries in cells.values() for label in entries} - {"dense"})
    rows = []
    fractions: dict[str, dict[str, float]] = {}
    stand: dict[str, dict[str, str]] = {}
    cheap: dict[str, bool] = {}
    for label in labels:
        fractions[label] = {}
        for cell in CELLS:
            entry, dense = cells[cell].get(label), cells[cell].get("dense")
            if entry is not None and dense is not None:
                fractions[label][cell] = entry["wire_mb_per_worker"]["mean"] / dense["wire_mb_per_worker"]["mean"]
        step = steps.get(STEP_ROWS.get(label, ""))
        cheap[label] = admitted(label, steps)
        stand[label] = {cell: standing(cells[cell].get(label)) for cell in CELLS}
        gaps = " | ".join(f"{_gap(cells[cell].get(label))} {MARKS[stand[label][cell]]}".rstrip() for cell in CELLS)
        bytes_text = " / ".join(f"{fractions[label][c]:.4f}" if c in fractions[label] else "-" for c in CELLS)
        step_text = " / ".join(f"{step[d]:.2f}" if d in step else "-" for d in DENSITIES) if step else "not measured"
        rows.append(f"| {label} | {gaps} | {bytes_text} | {step_text} | {'yes' if cheap[label] else ''} |")

    def tier(cells_needed: tuple[str, ...]) -> tuple[tuple[float, str] | None, list[str]]:
        done, open_ = [], []
        for label in labels:
            if not cheap[label] or any(c not in fractions[label] for c in cells_needed):
                continue
            marks = [stand[label][c] for c in cells_needed]
            fraction = sum(fractions[label][c] for c in cells_needed) / len(cells_needed)
            if all(m == "yes" for m in marks):
                done.append((fraction, label))
            elif "no" not in marks and "undecided" in marks:
                open_.append(
                    (fraction, label, [c for c, m in zip(cells_needed, marks, strict=True) if m == "undecided"])
                )
        best = min(done) if done else None
        waits = [
            f"{c}: {label}"
            for fraction, label, where in sorted(open_)
            if best is None or fraction < best[0]
            for c in where
        ]
        return best, waits

    best, waits = tier(tuple(CELLS))
    if waits:
        return rows, None, "Waiting for seeds (undecided methods that could send fewer bytes than the pick).", waits
    if best is not None:
        fraction, label = best
        return (
            rows,
            label,
            (
                f"The rule picks **{label}**: at dense's accuracy in every cell at an admitted step cost, with the "
                f"fewest bytes ({fraction:.4f} of dense's on average over the cells)."
            ),
            [],
        )
    best, waits = tier((SECOND_TIER,))
    if waits:
        return rows, None, f"No method qualifies in every cell; waiting for seeds in {SECOND_TIER}.", waits
    if best is not None:
        fraction, label = best
        other = [c for c in CELLS if c != SECOND_TIER][0]
        return (
            rows,
            label,
            (
                "No method is at dense's accuracy in every cell at an admitted step cost, so the rule falls to "
                f"{SECOND_TIER} alone and picks **{label}** ({fraction:.4f} of dense's bytes there); "
                f"on {other} its gap to dense is {_gap(cells[other].get(label))} points."
            ),
            [],
        )
    return (
        rows,
        None,
        "No method meets the rule: none is at dense's accuracy at an admitted step cost, in any tier.",
        [],
    )


def main(argv: list[str]) -> str:
    comparison = Path(argv[0] if argv else HERE / "results" / "fashion_mnist")
    step_cost = Path(argv[1] if len(argv) > 1 else HERE / "results" / "step_cost")
    cells = {cell: load_cell(comparison, cell) for cell in CELLS}
    steps = _steps(step_cost)
    rows, _, sentence, waits = pick(cells, steps)
    names = " | ".join(f"{cell}: gap to dense, points" for cell in CELLS)
    lines = [
        "# The default by the rule",
        "",
        "Generated by `python experiments/default_rule.py` from both Fashion-MNIST cells' `report/seeds.json`",
        "and `step_cost/step_{0.001,0.01}[_GROUP].json`. A cell's gap to dense is paired by seed (mean ± half-width",
        "of the 95 %",
        f"interval, n seeds); ✓: at dense's accuracy there (the interval's lower end at most {100 * MARGIN:g} point",
        f"below 0, over at least {MIN_PAIRED} seeds); ✗: not (the whole interval further down, or still reaching there",
        f"after {MAX_SEEDS} seeds); ?: undecided (it straddles that line). Bytes: the cell's whole-run wire MB per",
        "worker over dense's. Step: mean CPU",
        f"time over DDP's own allreduce step at 0.1 % / 1 %, admitted at most {MAX_STEP_VS_DDP:g}x at both (a method",
        "without a step row is not admitted: time it first).",
        "",
        f"| method | {names} | bytes: {' / '.join(CELLS)} (x dense) | step x DDP, 0.1 % / 1 % | step admitted |",
        "|---|" + "---|" * (len(CELLS) + 3),
        *rows,
        "",
    ]
    # Only a method the step bound admits can be picked, so only those hold the pick back until they have run.
    labels = {label for entries in cells.values() for label in entries if admitted(label, steps)} - {"dense"}
    missing = unfinished(cells, labels)
    if missing:
        lines.append(
            f"Provisional, no pick: not yet run over {MIN_PAIRED} seeds paired with dense (of the methods whose "
            f"step is admitted): {', '.join(missing)}."
        )
    elif waits:
        lines.append(f"Provisional, no pick. {sentence} Run more seeds (with dense's) for: {', '.join(waits)}.")
    else:
        lines.append(sentence)
    text = "\n".join(lines) + "\n"
    if not missing and not waits:
        (comparison / "default_rule.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main(sys.argv[1:]))
