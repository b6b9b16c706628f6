"""What the large-model codec measurements answer: does a learned codec beat scalar rounding?

    python experiments/codecs_summary.py [--write]

Reads the ``codecs.json`` of every model ``codecs_large_models.sh`` measures (``results/codecs_large/MODEL/``)
and, per recording, density and leader, sets every learned codec of the leader's positions (LGC's
linear codec ``pca:*``, the autoencoders ``ae:*`` and ``pcaae:*``) against the scalar rounding codecs
(``fp32``, ``fp16``, ``int8``, ``int4``, ``levels=M``), all on the same wire: total bits per value,
the leader's positions included, against the delivered-sum error at those positions.

* A learned codec is **dominated** where a scalar codec sending as many bits per value or fewer has a
  lower delivered-sum error, and **on the front** where no codec of either kind does.
* Where no scalar codec sends as few bits, the cheapest one is named with its error: a learned codec
  there is on the front only if it errs less than every codec sending fewer bits than it.

Rows the benchmark could not measure or withheld (``error`` null, with a note) and recordings still
being measured (``complete`` false) are left out and counted. Prints the summary; ``--write`` writes
``results/codecs_large/summary.md``, the block between ``<!-- codecs-large:begin -->`` and
``<!-- codecs-large:end -->`` on LGC's page (``docs/lgc.md``) and the README's line (between
``<!-- codecs-large-summary:begin -->`` and ``<!-- codecs-large-summary:end -->``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lgc.bench.leader_codecs import parse_codecs

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "codecs_large"
LGC_PAGE = HERE.parent / "docs" / "lgc.md"
BEGIN, END = "<!-- codecs-large:begin -->", "<!-- codecs-large:end -->"
#: The README's block: one line (:func:`readme_line`).
README = HERE.parent / "README.md"
README_BEGIN, README_END = "<!-- codecs-large-summary:begin -->", "<!-- codecs-large-summary:end -->"
#: The models ``codecs_large_models.sh`` measures (its ``MODELS``), their names in the text, and what each
#: measures by default: workers x images per worker, and densities (its ``WORKERS``, ``BATCH_SIZES``).
MODELS = {"resnet50": "ResNet-50", "pspnet": "ResNet-50 PSPNet"}
PLANNED_RECORDINGS = ((4, 32), (4, 128), (8, 32), (8, 128))
PLANNED_DENSITIES = (0.01, 0.001)
LEARNED = ("pca", "ae", "pcaae")
SCALAR = ("float", "levels")


def kind(codec: str, chunk: int) -> str:
    """The benchmark's kind of ``codec`` (``lgc.bench.leader_codecs.CodecSpec.kind``)."""
    return parse_codecs(codec, chunk)[0].kind


def recording_of(result: dict[str, Any]) -> tuple[int, int]:
    """(workers, images per worker) of one benchmark result, read from its label."""
    words = result["label"].split(" workers x ")
    return int(words[0].split()[-1]), int(words[1].split()[0])


def judge(result: dict[str, Any], leader: str) -> dict[str, Any]:
    """Every learned codec's standing on one recording, density and leader (see the module's docstring)."""
    rows = [row for row in result["rows"] if row["leader"] == leader and row["error"] is not None]
    kinds = {row["codec"]: kind(row["codec"], result["chunk"]) for row in rows}
    scalars = [row for row in rows if kinds[row["codec"]] in SCALAR]
    cheapest = min(scalars, key=lambda row: (row["bits_per_value"], row["error"]), default=None)
    learned = []
    for row in (row for row in rows if kinds[row["codec"]] in LEARNED):
        cheaper = [other for other in rows if other["bits_per_value"] <= row["bits_per_value"] and other is not row]
        beaten_by = min(
            (other for other in cheaper if kinds[other["codec"]] in SCALAR and other["error"] < row["error"]),
            key=lambda other: other["error"],
            default=None,
        )
        on_front = all(other["error"] >= row["error"] for other in cheaper)
        # On the front below every scalar codec's rate, and with a lower error than the cheapest of them.
        below_cheapest = cheapest is not None and row["bits_per_value"] < cheapest["bits_per_value"]
        undercuts = on_front and below_cheapest and row["error"] < cheapest["error"]
        learned.append({"row": row, "beaten_by": beaten_by, "on_front": on_front, "undercuts": undercuts})
    left_out = [row["codec"] for row in result["rows"] if row["leader"] == leader and row["error"] is None]
    return {"cheapest_scalar": cheapest, "learned": learned, "left_out": left_out}


def _point(row: dict[str, Any]) -> str:
    return f"{row['codec']} {row['bits_per_value']:.1f} bits, {row['error']:.3g}"


def _range(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{low:{fmt}} to {high:{fmt}}"


def _leaders(result: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(row["leader"] for row in result["rows"]))


def load(model: str, results: Path = RESULTS) -> list[dict[str, Any]]:
    """The model's benchmark results, in the order measured (none: an empty list)."""
    path = results / model / "codecs.json"
    return json.loads(path.read_text()) if path.is_file() else []


def table(model: str, measured: list[dict[str, Any]]) -> str:
    """The summary of one model: a row per recording, density and leader."""
    lines = [
        f"### {MODELS[model]}",
        "",
        "| workers x images | density | leader | premise r (layers) | energy share (layers) | cheapest scalar codec "
        "| learned codecs on the front | learned codecs a scalar codec beats at as many bits or fewer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in measured:
        workers, images = recording_of(result)
        if not result.get("complete", True):
            lines.append(f"| {workers} x {images} | {result['density']:g} | - | being measured | | | | |")
            continue
        for leader in _leaders(result):
            verdict = judge(result, leader)
            premise = [layer[leader] for layer in result["layers"]]
            front = [_point(item["row"]) for item in verdict["learned"] if item["on_front"]]
            beaten = [
                f"{item['row']['codec']} ({item['row']['error']:.3g}) by {_point(item['beaten_by'])}"
                for item in verdict["learned"]
                if item["beaten_by"] is not None
            ]
            cheapest = verdict["cheapest_scalar"]
            lines.append(
                f"| {workers} x {images} | {result['density']:g} | {leader} "
                f"| {_range([p['correlation'] for p in premise], '.2f')} "
                f"| {_range([p['energy_share'] for p in premise], '.2f')} "
                f"| {'-' if cheapest is None else _point(cheapest)} | {'; '.join(front) or 'none'} "
                f"| {'; '.join(beaten) or 'none'} |"
            )
    if not measured:
        lines.append("| not measured yet | | | | | | | |")
    return "\n".join(lines)


def _counts(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured (recording, density) pairs of the plan, and every learned row's standing."""
    complete = [result for result in measured if result.get("complete", True)]
    done = {(*recording_of(result), result["density"]) for result in complete}
    planned = [(w, i, d) for w, i in PLANNED_RECORDINGS for d in PLANNED_DENSITIES]
    judged = [(result, judge(result, leader)) for result in complete for leader in _leaders(result)]
    return {
        "planned": planned,
        "done": done,
        "judged": judged,
        "items": [item for _, verdict in judged for item in verdict["learned"]],
    }


def readme_line(measured: dict[str, list[dict[str, Any]]]) -> str:
    """The README's one line: per model, how much is measured and how the learned rows stand."""
    parts = []
    for model, name in MODELS.items():
        counts = _counts(measured[model])
        part = f"{name}, {len(counts['done'] & set(counts['planned']))} of {len(counts['planned'])} measured"
        items = counts["items"]
        if items:
            front = sorted({item["row"]["codec"] for item in items if item["on_front"]})
            part += (
                f": a scalar rounding codec at as many bits per value or fewer errs less than "
                f"{sum(item['beaten_by'] is not None for item in items)} of {len(items)} learned-codec rows; "
                f"on the rate-distortion front: {', '.join(front) or 'none'} "
                f"(in {sum(item['undercuts'] for item in items)} rows with fewer bits than any scalar codec and "
                "less error than the cheapest)"
            )
        parts.append(part)
    return (
        "- **LGC's codecs on recorded gradients** (recordings x densities, delivered-sum error against wire bits "
        "per value): " + "; ".join(parts) + "."
    )


def reading(model: str, measured: list[dict[str, Any]]) -> str:
    """One paragraph: what the model's measured rows answer, with what is still to measure."""
    counts = _counts(measured)
    done, planned, judged, items = counts["done"], counts["planned"], counts["judged"], counts["items"]
    missing = [f"{w} x {i} at {d:g}" for w, i, d in planned if (w, i, d) not in done]
    head = f"**{MODELS[model]}**, {len(done & set(planned))} of {len(planned)} recordings x densities measured"
    head += f" (still to measure: {', '.join(missing)})" if missing else ""
    if not judged:
        return head + "."
    beaten = [item for item in items if item["beaten_by"] is not None]
    front = [item for item in items if item["on_front"]]
    cheapest = [verdict["cheapest_scalar"] for _, verdict in judged if verdict["cheapest_scalar"] is not None]
    text = (
        f"{head}: of {len(items)} learned-codec rows, a scalar rounding codec sending as many bits per value or "
        f"fewer errs less in {len(beaten)}"
    )
    if beaten:
        errors = [item["row"]["error"] for item in beaten]
        scalar_errors = [item["beaten_by"]["error"] for item in beaten]
        text += (
            f" (the learned codec's delivered-sum error {_range(errors, '.3g')}, the scalar codec's "
            f"{_range(scalar_errors, '.2g')})"
        )
    text += ". "
    if front:
        by_codec: dict[str, list[dict[str, Any]]] = {}
        for item in front:
            by_codec.setdefault(item["row"]["codec"], []).append(item["row"])
        text += "On the front: " + "; ".join(
            f"{codec} in {len(rows)} ({_range([r['bits_per_value'] for r in rows], '.1f')} bits per value, "
            f"error {_range([r['error'] for r in rows], '.3g')})"
            for codec, rows in by_codec.items()
        )
        text += (
            f", where the cheapest scalar codec sends {_range([r['bits_per_value'] for r in cheapest], '.1f')} bits "
            f"per value with error {_range([r['error'] for r in cheapest], '.3g')}; in "
            f"{sum(item['undercuts'] for item in front)} of these {len(front)} rows the learned codec sends fewer "
            "bits than every scalar codec and errs less than the cheapest one."
        )
    else:
        text += "No learned codec is on the front."
    left_out = [codec for _, verdict in judged for codec in verdict["left_out"]]
    if left_out:
        counts = ", ".join(f"{codec} ({left_out.count(codec)})" for codec in sorted(set(left_out)))
        text += f" Rows the benchmark could not measure or withheld, left out: {counts}."
    return text


def summary(results: Path = RESULTS) -> tuple[str, str, str]:
    """(``summary.md``'s text, LGC's page's block, the README's line)."""
    measured = {model: load(model, results) for model in MODELS}
    page = "\n\n".join(
        [
            "# Learned codecs against scalar rounding on large models' recorded gradients",
            "Written by `python experiments/codecs_summary.py --write` from `resnet50/codecs.json` and "
            "`pspnet/codecs.json` (`codecs_large_models.sh`). Bits per value: the wire's total, the leader's "
            "positions included; error: the delivered sum's at the leader's positions (relative, squared). "
            "Premise: the workers' values' correlation at the leader's positions and a non-leader's energy share "
            "there, their range over the recorded layers.",
            *(table(model, measured[model]) for model in MODELS),
        ]
    )
    block = "\n\n".join(reading(model, measured[model]) for model in MODELS)
    return page + "\n", block, readme_line(measured)


def replace_in(page: str, text: str, begin: str = BEGIN, end: str = END) -> str:
    """``page`` with the text between ``begin`` and ``end`` replaced by ``text``."""
    start, stop = page.find(begin), page.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"the page has no {begin} ... {end} block")
    return page[: start + len(begin)] + "\n" + text + "\n" + page[stop:]


def main(argv: list[str]) -> str:
    page, block, line = summary()
    if "--write" in argv:
        (RESULTS / "summary.md").write_text(page)
        LGC_PAGE.write_text(replace_in(LGC_PAGE.read_text(), block))
        README.write_text(replace_in(README.read_text(), line, README_BEGIN, README_END))
    return "\n\n".join([page, block, line])


if __name__ == "__main__":
    print(main(sys.argv[1:]))
