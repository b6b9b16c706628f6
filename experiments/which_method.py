"""The "Which method" table of ``docs/evidence.md``, generated from both Fashion-MNIST cells' over-seeds reports.

    python experiments/which_method.py            # print the evidence page's tables
    python experiments/which_method.py --write    # replace them in docs/evidence.md
    python experiments/which_method.py RESULTS    # print the table of one comparison folder

Reads ``RESULTS/CELL/report/seeds.json`` (``lgc-report``'s over-seeds table) for every cell that has
one and prints one row per method: per cell, accuracy (mean ±
half-width of the 95 % interval over seeds, Student t), the gap to dense paired by seed (points,
mean ± half-width of its 95 % interval), its mark against the 1-point margin
(:func:`lgc.report.marks.mark`: ``within``, the interval's lower end at most 1 point below 0;
``worse``, the whole interval further down; ``inconclusive``, it straddles that line, at the seeds
the method has), and whole-run wire MB per worker. The evidence page holds one table per folder of :data:`BLOCKS`
(the CPU comparison ``results/fashion_mnist`` and its GPU runs ``results/fashion_mnist_gpu``), each
between its markers ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; ``--write`` replaces what is
between them, and a test checks that the page's tables are this script's output for the committed
results, so their numbers cannot drift from them.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from lgc_verdict import CELLS, MARGIN, load_cell

from lgc.report.marks import detectable_loss, mark, within_probability
from lgc.report.seeds import Interval

HERE = Path(__file__).parent
README = HERE.parent / "docs" / "evidence.md"
#: Block name on the evidence page -> the comparison folder its table is generated from, and whether every cell
#: must have a report there (the CPU comparison's prose reads both cells; the GPU runs cover one).
BLOCKS = {
    "which-method": (HERE / "results" / "fashion_mnist", True),
    "which-method-gpu": (HERE / "results" / "fashion_mnist_gpu", False),
}

#: Row label in the comparison -> its name in the table, in the table's order (grouped, not ranked).
ROWS = {
    "dense": "dense (DDP's fp32 allreduce)",
    "fp16": "**fp16 (lgc's hook: the gradients allreduced in half precision; the default)**",
    "powersgd": "PyTorch's PowerSGD hook, rank 2",
    "topk": "top-k 1 % with error feedback",
    "dgc": "DGC 0.1 % (its warm-up over 2.5 % of the run)",
    "shared_topk_int8_lean": "shared-index int8, 1 warm-up step, Golomb positions (`compressor=shared_topk_int8`)",
    "shared_topk_int8": "shared-index int8, 30 dense warm-up steps, raw positions",
    "shared_topk_fp16": "shared-index fp16, 30 dense warm-up steps, raw positions",
    "lgc_rar": "LGC-RAR (autoencoder, 30 dense warm-up steps)",
    "lgc_rar_linear": "LGC-RAR, linear codec (PCA), 30 warm-up steps",
    "lgc_rar_lean": "LGC-RAR, linear codec, int8 latents, Golomb positions, 1 warm-up step",
    "lgc_ps": "LGC-PS (innovation 0.1 %)",
    "redsync": "RedSync 0.1 % (trimmed top-k)",
    "terngrad": "TernGrad",
    "signsgd": "EF-signSGD (scaled sign with error feedback)",
    "qsgd": "QSGD, 4 levels, buckets of 512",
    "random_block": "random-block 1 %, shared offsets, error feedback",
    "sbc": "SBC 1 %",
    "sbc_delay": "SBC 1 %, exchanging every 4 steps",
    "sbc_delay_all": "SBC 1 %, exchanging every 4 steps, every parameter through it",
    "diloco_h10": "DiLoCo, H = 10",
    "diloco_h50": "DiLoCo, H = 50",
    "sparseloco": "SparseLoCo, H = 10",
    "demo": "DeMo",
    "shared_topk_int8_lean_delay": "shared-index int8, 1 warm-up step, Golomb, exchanging every 4 steps",
    "lgc_rar_lean_delay": "LGC-RAR linear, int8, Golomb, 1 warm-up step, exchanging every 4 steps",
    "shared_topk_int8_lean_all": "shared-index int8, 1 warm-up step, Golomb, every parameter through it",
    "lgc_rar_lean_all": "LGC-RAR linear, int8, Golomb, 1 warm-up step, every parameter",
    "lgc_rar_lean_delay_all": "the same, exchanging the weight updates of 4 local steps",
    "shared_topk_int8_lean_delay_all": (
        "shared-index int8, 1 warm-up step, Golomb, every parameter, exchanging every 4 steps"
    ),
}


def _cells(entry: dict | None) -> list[str]:
    """A cell's four columns for one method: n, accuracy, paired gap with its mark, MB."""
    if entry is None:
        return ["-", "not run", "-", "-"]
    acc = entry["val/acc"]
    accuracy = f"{acc['mean']:.4f}" + (f" ± {acc['half_width']:.4f}" if acc.get("half_width") is not None else "")
    gap = entry.get("gap_to_dense")
    if not gap:
        gap_text = "-"
    else:
        half = gap.get("half_width")
        gap_text = f"{100 * gap['mean']:+.2f}" + (f" ± {100 * half:.2f}" if half is not None else "")
        judged = mark(Interval(gap["n"], gap["mean"], gap.get("sd"), half), MARGIN)
        gap_text += f" {judged}" if judged else ""
    mb = entry["wire_mb_per_worker"]["mean"]
    return [str(entry["n"]), accuracy, gap_text, f"{mb:,.0f}" if mb >= 100 else f"{mb:.3g}"]


def table(results: Path, every_cell: bool = False) -> str:
    """The markdown table (no trailing newline) from the reports of the cells that have one (``every_cell``: all
    of them must)."""
    cells = {cell: entries for cell in CELLS if (entries := load_cell(results, cell))}
    missing = [cell for cell in CELLS if cell not in cells]
    if not cells or (every_cell and missing):
        raise SystemExit(f"which_method.py: no report for {', '.join(missing)} under {results}")
    header = ["method"]
    for cell in cells:
        header += [f"{cell}: n", f"{cell}: val/acc", f"{cell}: gap to dense, points", f"{cell}: MB/worker"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    unknown = sorted({label for entries in cells.values() for label in entries} - set(ROWS))
    if unknown:
        raise SystemExit(f"which_method.py: no table name for {', '.join(unknown)}: add them to ROWS")
    for label, name in ROWS.items():
        if not any(label in entries for entries in cells.values()):
            continue
        row = [name]
        for entries in cells.values():
            row += _cells(entries.get(label))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for cell, entries in cells.items():
        lines.append(power_line(cell, entries))
    return "\n".join(lines)


def power_line(cell: str, entries: dict[str, dict]) -> str:
    """What a cell can detect at its median spread of paired gaps (:mod:`lgc.report.marks`), at 5 seeds."""
    spreads = sorted(
        100 * entry["gap_to_dense"]["sd"]
        for entry in entries.values()
        if entry.get("gap_to_dense") and entry["gap_to_dense"].get("sd")
    )
    if not spreads:
        return f"{cell}: no paired spread yet."
    spread = statistics.median(spreads)
    margin = 100 * MARGIN
    return (
        f"{cell}: median spread of the paired gaps {spread:.2f} points; at 5 seeds this cell marks a loss of "
        f"{detectable_loss(spread, 5, margin):.2f} points `worse` with probability 0.8, and a method as good as "
        f"dense `within` with probability {within_probability(0.0, spread, 5, margin):.2f} (at 3 seeds "
        f"{within_probability(0.0, spread, 3, margin):.2f})."
    )


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of block ``name`` on the evidence page."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = markers("which-method")


def replace_in(readme: str, text: str, name: str = "which-method") -> str:
    """``readme`` with the text between block ``name``'s markers replaced by ``text``."""
    begin, end = markers(name)
    start, stop = readme.find(begin), readme.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{README.name} has no {begin} ... {end} block")
    return readme[: start + len(begin)] + "\n" + text + "\n" + readme[stop:]


def main(argv: list[str]) -> str:
    args = [a for a in argv if a != "--write"]
    if args:
        if "--write" in argv:
            raise SystemExit("which_method.py: --write writes the evidence page's own folders; give no RESULTS")
        return table(Path(args[0]))
    page, texts = README.read_text(), []
    for name, (results, every_cell) in BLOCKS.items():
        text = table(results, every_cell)
        page = replace_in(page, text, name)
        texts.append(f"{name}:\n\n{text}")
    if "--write" in argv:
        README.write_text(page)
    return "\n\n".join(texts)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
