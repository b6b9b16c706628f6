"""What the large-model codec measurements answer: does a learned codec beat scalar rounding?

    python experiments/codecs_summary.py [--write]

Reads the ``codecs.json`` of every folder ``codecs_large_models.sh`` writes (``results/codecs_large/MODEL/``
and ``MODEL_int8_latents/``)
and, per recording, density and leader, sets every learned codec of the leader's positions (LGC's
linear codec ``pca:*``, the autoencoders ``ae:*`` and ``pcaae:*``) against the scalar rounding codecs
(``fp32``, ``fp16``, ``int8``, ``int4``, ``levels=M``), all on the same wire: total bits per value,
the leader's message included (its positions, and for ``:value`` codecs the leader's value order),
against the delivered-sum error at the leader's positions. One codec **dominates** another where it
sends as many bits per value or fewer and errs less (strictly). Each learned codec's standing:

* **beaten**: a scalar codec dominates it (named: the one with the lowest error among those);
* **beats**: it dominates a scalar codec and none dominates it (named: the cheapest it dominates);
* **neither**: every scalar codec that errs less sends more bits, and every one that sends as many
  bits or more errs no more (a different trade-off, not a win).

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
#: The folders ``codecs_large_models.sh`` writes (its ``MODELS``, each in its main pass and its int8-latents
#: pass), their names in the text, and what each measures by default: workers x images per worker, and
#: densities (its ``WORKERS``, ``BATCH_SIZES``).
MODELS = {
    "resnet50": "ResNet-50",
    "pspnet": "ResNet-50 PSPNet",
    "resnet50_int8_latents": "ResNet-50, int8 latents",
    "pspnet_int8_latents": "ResNet-50 PSPNet, int8 latents",
}
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


def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Row ``a`` sends as many bits per value as ``b`` or fewer and has a strictly lower error."""
    return a["bits_per_value"] <= b["bits_per_value"] and a["error"] < b["error"]


def judge(result: dict[str, Any], leader: str) -> dict[str, Any]:
    """Every learned codec's standing on one recording, density and leader (see the module's docstring)."""
    rows = [row for row in result["rows"] if row["leader"] == leader and row["error"] is not None]
    kinds = {row["codec"]: kind(row["codec"], result["chunk"]) for row in rows}
    scalars = [row for row in rows if kinds[row["codec"]] in SCALAR]
    learned = []
    for row in (row for row in rows if kinds[row["codec"]] in LEARNED):
        beaten_by = min(
            (s for s in scalars if dominates(s, row)), key=lambda s: (s["error"], s["bits_per_value"]), default=None
        )
        beats = None
        if beaten_by is None:
            beats = min(
                (s for s in scalars if dominates(row, s)), key=lambda s: (s["bits_per_value"], s["error"]), default=None
            )
        learned.append({"row": row, "beaten_by": beaten_by, "beats": beats})
    left_out = [row["codec"] for row in result["rows"] if row["leader"] == leader and row["error"] is None]
    cheapest = min(scalars, key=lambda row: (row["bits_per_value"], row["error"]), default=None)
    return {"cheapest_scalar": cheapest, "learned": learned, "left_out": left_out}


def _point(row: dict[str, Any]) -> str:
    return f"{row['codec']} {row['bits_per_value']:.1f} bits, {row['error']:.3g}"


def _number(value: float, fmt: str) -> str:
    text = format(value, fmt)
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.00"


def _range(values: list[float], fmt: str) -> str:
    low, high = _number(min(values), fmt), _number(max(values), fmt)
    return low if low == high else f"{low} to {high}"


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
        "| learned codecs beating a scalar codec | learned codecs a scalar codec beats | neither |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in measured:
        workers, images = recording_of(result)
        if not result.get("complete", True):
            lines.append(f"| {workers} x {images} | {result['density']:g} | - | being measured | | | | | |")
            continue
        for leader in _leaders(result):
            verdict = judge(result, leader)
            premise = [layer[leader] for layer in result["layers"]]
            items = verdict["learned"]
            beats = [f"{_point(item['row'])} over {_point(item['beats'])}" for item in items if item["beats"]]
            beaten = [f"{_point(item['row'])} by {_point(item['beaten_by'])}" for item in items if item["beaten_by"]]
            neither = [_point(item["row"]) for item in items if not item["beats"] and not item["beaten_by"]]
            cheapest = verdict["cheapest_scalar"]
            lines.append(
                f"| {workers} x {images} | {result['density']:g} | {leader} "
                f"| {_range([p['correlation'] for p in premise], '.2f')} "
                f"| {_range([p['energy_share'] for p in premise], '.2f')} "
                f"| {'-' if cheapest is None else _point(cheapest)} | {'; '.join(beats) or 'none'} "
                f"| {'; '.join(beaten) or 'none'} | {'; '.join(neither) or 'none'} |"
            )
    if not measured:
        lines.append("| not measured yet | | | | | | | | |")
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


def _standings(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], ...]:
    """The learned rows that beat a scalar codec, that one beats, and neither."""
    beats = [item for item in items if item["beats"] is not None]
    beaten = [item for item in items if item["beaten_by"] is not None]
    neither = [item for item in items if item["beats"] is None and item["beaten_by"] is None]
    return beats, beaten, neither


def _names(rows: list[dict[str, Any]]) -> str:
    return ", ".join(sorted({row["codec"] for row in rows}))


def readme_line(measured: dict[str, list[dict[str, Any]]]) -> str:
    """The README's one line: per model, how much is measured and how the learned rows stand."""
    parts = []
    for model, name in MODELS.items():
        counts = _counts(measured[model])
        part = f"{name}, {len(counts['done'] & set(counts['planned']))} of {len(counts['planned'])} measured"
        items = counts["items"]
        if items:
            beats, beaten, neither = _standings(items)
            part += (
                f": of {len(items)} learned-codec rows, {len(beaten)} beaten by a scalar rounding codec (as many bits "
                f"per value or fewer, less error), {len(beats)} beating one"
                + (f" ({_names([item['row'] for item in beats])})" if beats else "")
                + f", {len(neither)} neither"
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
    beats, beaten, neither = _standings(items)
    text = f"{head}: of {len(items)} learned-codec rows, {len(beaten)} are beaten by a scalar rounding codec"
    if beaten:
        text += (
            f" ({_names([item['row'] for item in beaten])}: error {_range([i['row']['error'] for i in beaten], '.3g')}"
            f" against {_names([item['beaten_by'] for item in beaten])} at as many bits per value or fewer, error "
            f"{_range([i['beaten_by']['error'] for i in beaten], '.2g')})"
        )
    text += f"; {len(beats)} beat one"
    if beats:
        text += (
            " ("
            + "; ".join(
                f"{codec} {_range([i['row']['bits_per_value'] for i in group], '.1f')} bits per value, error "
                f"{_range([i['row']['error'] for i in group], '.3g')}, against "
                f"{_names([i['beats'] for i in group])} at "
                f"{_range([i['beats']['bits_per_value'] for i in group], '.1f')} bits, error "
                f"{_range([i['beats']['error'] for i in group], '.3g')}"
                for codec, group in _by_codec(beats).items()
            )
            + ")"
        )
    text += f"; {len(neither)} neither"
    if neither:
        text += (
            f" ({_names([item['row'] for item in neither])}: every scalar codec that errs less sends more bits, "
            "every one sending more errs no more)"
        )
    text += "."
    left_out = [codec for _, verdict in judged for codec in verdict["left_out"]]
    if left_out:
        counts_text = ", ".join(f"{codec} ({left_out.count(codec)})" for codec in sorted(set(left_out)))
        text += f" Rows the benchmark could not measure or withheld, left out: {counts_text}."
    return text


def _by_codec(items: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        groups.setdefault(item["row"]["codec"], []).append(item)
    return groups


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
