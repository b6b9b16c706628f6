"""LGC's verdict on the scale comparison, on two byte accountings, with each cell's byte floor.

Read by ``scale_tables.py``, which puts it under the cells' tables (so it is generated from the same
committed records). The goal is the one LGC's verdict has always been held to (``lgc_verdict.py``):
among the methods at dense's accuracy, LGC's fewest bytes at least ``GOAL_VS_DGC`` x fewer than DGC's,
and fewer than the fewest of every non-learned method at dense's accuracy. Here "at dense's accuracy"
is the protocol's mark ``within`` (the paired 95 % interval of the gap above minus the margin, at the
protocol's n); ``inconclusive`` is not within, and is named. The goal is checked twice:

* on **whole-wire bytes** (everything a worker puts on the wire over the run: warm-up, codec training,
  parameters sent dense, module buffers, flags);
* on **the bytes the codec carries** (whole wire minus the fixed overhead of module buffers and
  parameters sent dense: what a method does with the parameters it compresses; the LGC paper counts
  only these). PyTorch's own hooks book no per-parameter table, so they have no codec bytes and are
  left out of this accounting (named); where one of them is ``within``, LGC cannot be said to send
  fewer than it there, so a goal met against every other method is ``undecided`` on this accounting.

The **byte floor** of a cell: the fixed overhead under LGC's settings (the least of its rows), and what
it allows: dense's bytes over it (the ceiling: the best ratio any codec could reach on that model), and
DGC's whole-wire bytes over it (the most any codec could undercut DGC by, whole wire). Where the latter
is below ``GOAL_VS_DGC``, the whole-wire goal is out of reach by construction and the verdict says so.
"""

from __future__ import annotations

from typing import Any

from lgc_verdict import GOAL_VS_DGC

from lgc.report.seeds import Interval

#: The learned methods (LGC's settings): the protocol's methods whose names start with this.
LEARNED_PREFIX = "lgc_"
#: The two accountings: tables.json's key and the words for it.
ACCOUNTINGS = {"wire_mb": "whole-wire bytes", "codec_mb": "bytes the codec carries"}


def _learned(method: str) -> bool:
    return method.startswith(LEARNED_PREFIX)


def floor(rows: list[dict[str, Any]], reference: str, seeds: int | None = None) -> dict[str, float | None]:
    """The cell's fixed overhead under LGC's settings and the ratios it caps (None until they ran).

    With ``seeds`` (the protocol's n), a row counts only once all its seeds have run, so the floor
    never rests on a part of a method's runs.
    """
    rows = [row for row in rows if seeds is None or len(row.get("seeds", ())) == seeds]
    by = {row["method"]: row for row in rows}
    overheads = [row["overhead_mb"] for row in rows if _learned(row["method"]) and row["overhead_mb"]]
    overhead = min(overheads) if overheads else None
    dense, dgc = (by.get(name, {}).get("wire_mb") for name in (reference, "dgc"))
    return {
        "overhead_mb": overhead,
        "ceiling": dense / overhead if dense and overhead else None,
        "most_below_dgc": dgc / overhead if dgc and overhead else None,
    }


def cell_verdict(rows: list[dict[str, Any]], reference: str, key: str) -> dict[str, Any]:
    """The goal in one cell on one accounting (``key``: ``wire_mb`` or ``codec_mb``).

    ``status``: ``"pending"`` (LGC, DGC or a method that could change the outcome lacks its mark),
    ``"met"``, ``"not met"`` or ``"undecided"`` (met against every method whose bytes this accounting
    books, while a method that books none, PyTorch's PowerSGD hook on the codec's bytes, is ``within``:
    LGC cannot be said to send fewer than it); with the best LGC setting within the margin, DGC's bytes over its,
    the non-learned rival with the fewest bytes within the margin, and the rows left out (inconclusive
    ones, and those without bytes in this accounting).
    """
    compressing = [row for row in rows if row["method"] != reference]
    pending = [row["method"] for row in compressing if row["mark"] is None]
    booked = [row for row in compressing if row["mark"] is not None and row[key] is not None]
    within = [row for row in booked if row["mark"] == "within"]
    learned = sorted((row for row in within if _learned(row["method"])), key=lambda row: row[key])
    rivals = sorted((row for row in within if not _learned(row["method"])), key=lambda row: row[key])
    dgc = next((row for row in compressing if row["method"] == "dgc"), None)
    result: dict[str, Any] = {
        "status": "pending" if pending else None,
        "pending": pending,
        "inconclusive": [row["method"] for row in compressing if row["mark"] == "inconclusive"],
        "unbooked": [row["method"] for row in compressing if row["mark"] is not None and row[key] is None],
        "best": learned[0]["method"] if learned else None,
        "best_mb": learned[0][key] if learned else None,
        "rival": rivals[0]["method"] if rivals else None,
        "rival_mb": rivals[0][key] if rivals else None,
        "dgc_mb": None if dgc is None else dgc[key],
    }
    if pending:
        return result
    if not learned:
        result["status"], result["vs_dgc"], result["vs_rest"] = "not met", False, False
        return result
    vs_dgc = result["dgc_mb"] is not None and result["dgc_mb"] / result["best_mb"] >= GOAL_VS_DGC
    vs_rest = not rivals or result["best_mb"] < result["rival_mb"]
    unbooked_within = [row["method"] for row in compressing if row["mark"] == "within" and row[key] is None]
    status = "not met" if not (vs_dgc and vs_rest) else "undecided" if unbooked_within else "met"
    result.update(vs_dgc=vs_dgc, vs_rest=vs_rest, status=status, unbooked_within=unbooked_within)
    return result


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _interval(stats: dict[str, Any], fmt: str) -> str:
    """``mean ± half-width`` of a tables.json interval."""
    return Interval(**{k: stats[k] for k in ("n", "mean", "sd", "half_width")}).text(fmt)


def _short(label: str) -> str:
    """A method's label without its parenthesis (``fp16 (the gradients ...)`` -> ``fp16``)."""
    return label.split(" (")[0]


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g} MB"


def cell_lines(protocol: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """One cell's verdict bullets: its byte floor, then the goal on each accounting."""
    reference, labels = protocol["reference"], {name: m["label"] for name, m in protocol["methods"].items()}

    def names(methods: list[str]) -> str:
        return "; ".join(_short(labels[method]) for method in methods)

    bound = floor(rows, reference, len(protocol["seeds"]))
    lines = []
    if bound["overhead_mb"] is None:
        lines.append("- Floor: not known until an LGC setting has run all its seeds.")
    else:
        reach = bound["most_below_dgc"]
        out_of_reach = reach is not None and reach < GOAL_VS_DGC
        lines.append(
            f"- Floor: {_mb(bound['overhead_mb'])} fixed overhead per worker; ceiling "
            + ("-" if bound["ceiling"] is None else f"{bound['ceiling']:.0f}x")
            + " over dense; at most "
            + ("-" if reach is None else f"{reach:.1f}x")
            + " below DGC on whole-wire bytes"
            + (f" (the {GOAL_VS_DGC:g}x goal is out of reach there by construction)." if out_of_reach else ".")
        )
    for key, words in ACCOUNTINGS.items():
        result = cell_verdict(rows, reference, key)
        if result["status"] == "pending":
            lines.append(f"- On {words}: pending, not yet marked: {names(result['pending'])}.")
            continue
        notes = []
        if result["inconclusive"]:
            notes.append(f"Inconclusive, not counted: {names(result['inconclusive'])}.")
        if result["unbooked"]:
            notes.append(f"No codec bytes booked, left out: {names(result['unbooked'])}.")
        if result["status"] == "undecided":
            notes.append(f"Undecided, as {names(result['unbooked_within'])} is `within` and books no bytes here.")
        note = "".join(f" {sentence}" for sentence in notes)
        if result["best"] is None:
            lines.append(f"- On {words}: not met, no LGC setting is `within`.{note}")
            continue
        dgc = (
            "DGC books none"
            if result["dgc_mb"] is None
            else f"DGC's {_mb(result['dgc_mb'])} is {result['dgc_mb'] / result['best_mb']:.2f}x that"
        )
        rival = (
            "no non-learned method is `within`"
            if result["rival"] is None
            else f"the non-learned method with the fewest, {names([result['rival']])}, sends {_mb(result['rival_mb'])}"
        )
        lines.append(
            f"- On {words}: {result['status']}. LGC's fewest within the margin: {names([result['best']])}, "
            f"{_mb(result['best_mb'])}; {dgc} (goal {GOAL_VS_DGC:g}x); {rival}.{note}"
        )
    return lines


def verdict_section(protocol: dict[str, Any], tables: dict[str, Any]) -> str:
    """The verdict's text for every cell of ``tables`` (``scale_tables.page``'s data), in the protocol's order."""
    lines = [
        "## LGC's verdict",
        "",
        f"Goal: among the methods marked `within`, LGC's fewest bytes at least {GOAL_VS_DGC:g}x fewer than DGC's and "
        "fewer than every non-learned method's; checked on whole-wire bytes and on the bytes the codec carries "
        "(whole wire minus module buffers and parameters sent dense). `inconclusive` counts as not within. The floor: "
        "the fixed overhead under LGC's settings, dense's bytes over it (the best ratio any codec could reach) and "
        "DGC's over it (the most any codec could undercut DGC by, whole wire).",
        "",
    ]
    for cell in protocol["order"]["cells"]:
        lines += [f"### {cell}", "", *cell_lines(protocol, tables[cell]["rows"]), ""]
    return "\n".join(lines)


def lgc_block(protocol: dict[str, Any], tables: dict[str, Any]) -> str:
    """LGC's rows of every cell (DGC's beside them) with the cell's verdict bullets: ``docs/lgc.md``'s block."""
    seeds = len(protocol["seeds"])
    labels = {name: m["label"] for name, m in protocol["methods"].items()}
    lines = []
    for cell in protocol["order"]["cells"]:
        rows = tables[cell]["rows"]
        lines += [
            f"**{cell}**: {protocol['cells'][cell]['title']}.",
            "",
            "| setting | gap to dense (points) | mark | gap to top-k at its density (points) | whole wire (MB/worker) "
            "| codec's bytes (MB/worker) | its dense warm-up's part of the whole wire (MB/worker) |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            if not (_learned(row["method"]) or row["method"] == "dgc"):
                continue
            if len(row["seeds"]) < seeds or row["gap_points"] is None:
                lines.append(f"| {labels[row['method']]} | {len(row['seeds'])} of {seeds} seeds | - | - | - | - | - |")
                continue
            sparsifier = row.get("gap_to_sparsifier_points")
            gap, vs_topk, wire, codec, warmup = (
                _interval(row["gap_points"], "+.2f"),
                "-" if sparsifier is None else _interval(sparsifier, "+.2f"),
                _fmt(row["wire_mb"], ".4g"),
                _fmt(row["codec_mb"], ".4g"),
                _fmt(row.get("warmup_mb"), ".4g"),
            )
            lines.append(
                f"| {labels[row['method']]} | {gap} | {row['mark'] or '-'} | {vs_topk} | {wire} | {codec} | {warmup} |"
            )
        lines += ["", *cell_lines(protocol, rows), *reading_lines(protocol, rows), ""]
    return "\n".join(lines).rstrip()


def reading_lines(protocol: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """What a cell's complete LGC rows say beyond their marks: where each lies against top-k at its density
    (the paired interval above 0, holding 0, or below it), and the dense warm-up's share of LGC's whole wire
    beside DGC's whole run."""
    seeds = len(protocol["seeds"])
    complete = [row for row in rows if _learned(row["method"]) and len(row["seeds"]) == seeds]
    lines = []
    above, apart, below = "above it", "not told apart from it (the interval holds 0)", "below it"
    sides: dict[str, list[str]] = {above: [], apart: [], below: []}
    for row in complete:
        gap = row.get("gap_to_sparsifier_points")
        if gap:
            low, high = gap["mean"] - gap["half_width"], gap["mean"] + gap["half_width"]
            sides[above if low > 0 else below if high < 0 else apart].append(
                _short(protocol["methods"][row["method"]]["label"])
            )
    if any(sides.values()):
        lines.append(
            "- Against top-k at the same density, paired by seed: "
            + " ".join(f"{side[0].upper()}{side[1:]}: {'; '.join(names)}." for side, names in sides.items() if names)
        )
    shares = [row["warmup_mb"] / row["wire_mb"] for row in complete if row.get("warmup_mb") and row.get("wire_mb")]
    dgc = next((row for row in rows if row["method"] == "dgc" and len(row["seeds"]) == seeds), None)
    if shares:
        warmup = min(row["warmup_mb"] for row in complete if row.get("warmup_mb"))
        beside = (
            ""
            if dgc is None or not dgc.get("wire_mb")
            else f"; DGC's whole run sends {dgc['wire_mb'] / warmup:.2f}x that warm-up"
        )
        low, high = f"{100 * min(shares):.0f}", f"{100 * max(shares):.0f}"
        lines.append(
            f"- The dense warm-up is {low if low == high else f'{low}-{high}'} % of every complete LGC row's "
            f"whole wire{beside}."
        )
    return lines
