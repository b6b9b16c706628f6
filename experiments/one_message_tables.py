"""Tables of the step's speed from committed benchmark records (run by the scripts that name it).

    python experiments/one_message_tables.py time BEFORE.json.gz AFTER.json.gz --setting "4 workers, 100mbit"
    python experiments/one_message_tables.py latency NETWORK.json.gz --setting "4 workers, 100mbit"
    python experiments/one_message_tables.py check MODEL.json NETWORK.json.gz [--write]

``time``: each method's time to the target as a multiple of the no-communication bound (95 %
intervals over seeds) and its median step, in two ``lgc-bench network`` records of the same
setting (experiments/one_message_network.sh). ``latency``: the per-message latency a record fitted
on plain collectives, in tc syntax (experiments/crossover.sh hands it to ``lgc-bench model``).
``check``: the crossover table of an ``lgc-bench model`` record (the bandwidth below which each
method's step beats the fp16 hook's) and, for its ``resnet8`` rows at 4 workers, whether the
measured steps of a shaped-network record (Fashion-MNIST's ResNet-8, 4 workers) agree; with
``--write``, saved as ``crossover.md`` beside the model record, and the evidence page's block (the
table at the comparison's scale and ResNet-50's, with the check's count) regenerated.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

from lgc.bench.model import crossover_table

HERE = Path(__file__).resolve().parent
EVIDENCE = HERE.parent / "docs" / "evidence.md"
BEGIN, END = "<!-- crossover:begin -->", "<!-- crossover:end -->"
TIME_BEGIN, TIME_END = "<!-- one-message-time:begin -->", "<!-- one-message-time:end -->"
#: The committed records the evidence page's blocks are generated from.
RECORDS = HERE / "results" / "crossover"
TIME_RECORDS = HERE / "results" / "one_message_network"


def _network(path: Path) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))


def _interval(value: dict[str, Any] | None, fmt: str = ".2f") -> str:
    if value is None:
        return "-"
    half = value.get("half_width")
    return format(value["mean"], fmt) + ("" if half is None else f" ± {half:{fmt}}")


def _rows(record: dict[str, Any], setting: str) -> dict[str, dict[str, Any]]:
    """Every method's summary row of ``setting``: the record's own, or (a record whose run stopped before
    its summary) each method's first measurement summarized here, the methods whose steady state
    starts after the run's last step left out (:func:`_unsteady` names them)."""
    if "results" in record:
        return {row["method"]: row for row in record["results"][setting]}
    from lgc.bench.network_results import summarize

    rows = {}
    skip, target = int(record["arguments"]["skip"]), float(record["arguments"]["target"])
    for label, runs in record["raw"][setting].items():
        try:
            rows[label] = {"method": label, **summarize(runs[0], target, skip)}
        except ValueError:
            continue  # not at its steady state within the run (named by _unsteady)
    return rows


def _link(record: dict[str, Any], setting: str) -> tuple[float, float]:
    """``setting``'s link as fitted on plain collectives: (latency s, bytes/s); fitted here from the samples
    where the record's run stopped before its summary."""
    calibration = record["calibrations"][setting]
    if "latency_s" in calibration:
        return calibration["latency_s"], calibration["bytes_per_s"]
    from lgc.bench.cost_model import CollectiveCall, fit_link

    workers = int(setting.split()[0])
    samples = calibration["samples"]
    link = fit_link([(CollectiveCall(x["kind"], x["nbytes"], workers), workers, x["seconds"]) for x in samples])
    return link.latency_s, link.bytes_per_s


def _unsteady(record: dict[str, Any], setting: str) -> list[str]:
    """The methods of a summary-less record whose steady state starts after the run's last step."""
    if "results" in record:
        return []
    return [label for label in record["raw"][setting] if label not in _rows(record, setting)]


def time_table(before: Path, after: Path, setting: str, commit: str) -> str:
    old, new = _network(before), _network(after)
    old_seeds = {m["method"]: m for m in old["over_seeds"][setting]["methods"]}
    new_over = new["over_seeds"][setting]
    old_rows, new_rows = _rows(old, setting), _rows(new, setting)
    target = new_over["target"]
    lines = [
        f"# Time to {target} at {setting.split(', ')[1]}, before and after (after: {commit})\n",
        f"`lgc-bench network --task fashion_mnist`, {setting}: ResNet-8 on Fashion-MNIST, seeds "
        f"{', '.join(str(s) for s in new_over['methods'][0]['seeds'])}, the before record "
        f"`{before.parent.name}` and the after record `{after.parent.name}` in the same setting. x bound: "
        "time to the target over the no-communication bound (dense's steps to the target at its "
        "compute-only step, seed by seed), mean ± 95 % interval over the seeds that reached it; "
        "step: the median step over the seeds' medians (ms).\n",
        "| method | before: reached | before: x bound | before: step | after: reached | after: x bound | after: step |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in new_over["methods"]:
        label = method["method"]
        was = old_seeds.get(label)
        cells = [
            f"{was['reached']}/{len(was['seeds'])}" if was else "-",
            _interval(was["x_bound"]) if was else "-",
            f"{1000 * old_rows[label]['step_s']:.1f}" if label in old_rows else "-",
            f"{method['reached']}/{len(method['seeds'])}",
            _interval(method["x_bound"]),
            f"{1000 * new_rows[label]['step_s']:.1f}",
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nNo-communication bound: before {_interval(old['over_seeds'][setting]['bound_s'], '.1f')} s, "
        f"after {_interval(new_over['bound_s'], '.1f')} s. Rows are not ranked: overlapping intervals do not differ."
    )
    return "\n".join(lines) + "\n"


def latency(record: Path, setting: str) -> str:
    return f"{1e6 * _link(_network(record), setting)[0]:.0f}us"


def _beats(crossing: list[Any] | None, bytes_per_s: float) -> bool | None:
    """Whether a crossing ``[side, bandwidth]`` says the method wins at ``bytes_per_s``."""
    if crossing is None:
        return None
    side, at = crossing
    if side in ("always", "never"):
        return side == "always"
    return bytes_per_s < at if side == "below" else bytes_per_s > at


def check_table(model_path: Path, network_path: Path, commit: str) -> str:
    model = json.loads(model_path.read_text())
    network = _network(network_path)
    results = model["results"]
    arguments = model["arguments"]
    workers = [int(w) for w in arguments["workers"].split(",")]
    methods = list(next(iter(results.values()))["methods"])
    lines = [
        f"# Where each method's step beats PyTorch's fp16 hook's ({commit})\n",
        f"`lgc-bench model --latency {arguments['latency']}` (the per-message latency fitted on the shaped "
        "network below), from each method's codec time and collectives measured on this machine "
        "(`profiles.json`) and the alpha-beta cost model (`lgc.bench.cost_model`): the link bandwidth per "
        "direction below which (`<`) or above which (`>`) the method's predicted step is shorter than "
        "the fp16 hook's; `always`, `never`. ResNet-50: ImageNet shapes with a GPU's 100 ms of compute "
        "per step; resnet8, resnet20, pspnet_small: the comparison's models on their data, compute "
        "measured here. Local-step methods pay their exchanges at their share of the H steps; "
        "Streaming DiLoCo's overlap is not modelled (its exchange counts as blocking). The model's "
        "steps are in `model.md`, the curves in `model.png`.\n",
        crossover_table(list(results), workers, methods, results),
    ]
    if "resnet8" in results and 4 in workers:
        lines += _check_lines(results["resnet8"]["methods"], network)[0]
    return "\n".join(lines) + "\n"


#: Knobs the shaped network's runs add for training (DGC's warm-up epochs, DeMo's learning rate),
#: which do not change a step's cost: its label without them is the model's.
TRAINING_ONLY_KNOBS = ("steps_per_epoch", "lr")


def _model_label(label: str) -> str:
    name, _, knobs = label.partition(":")
    kept = [k for k in knobs.split(";") if k and k.split("=")[0] not in TRAINING_ONLY_KNOBS]
    return name + (":" + ";".join(kept) if kept else "")


def _check_lines(predicted: dict[str, Any], network: dict[str, Any]) -> tuple[list[str], int, int]:
    """The check's table and text, with how many of the measured sides the model's crossing agrees with."""
    measured = network["results"] if "results" in network else network["raw"]
    settings = [s for s in measured if s.startswith("4 workers, ")]
    # The bandwidth each link delivered (fitted on plain collectives), not the shaper's nominal rate.
    rates = {s: _link(network, s)[1] for s in settings}
    lines = [
        "\n## The check: measured over a shaped network\n",
        "Fashion-MNIST's ResNet-8 on 4 workers, each in its own network namespace behind a link shaped "
        "by tc (`network/network.json.gz`): each method's median step over the fp16 hook's in the same run "
        "(`x fp16`), and whether the model's crossing for resnet8 at 4 workers (above) says it beats "
        "fp16 at the bandwidth the link delivered (fitted on plain collectives, below: a veth shaped to "
        "1 Gbit/s carries less on this machine). The model's compute is measured with one worker alone; on the network "
        "4 workers share this machine's 2 cores, so steps there are longer. Agree: the measured and the "
        "predicted side are the same.\n",
        "| method | " + " | ".join(f"{s.split(', ')[1]}: x fp16 | model: beats | agree" for s in settings) + " |",
        "|---|" + "---|---|---|" * len(settings),
    ]
    agreed = total = 0
    for setting in settings:
        if "torch_fp16" not in _rows(network, setting):
            raise ValueError(f"{setting}: the network record has no torch_fp16 row")
    labels = list(_rows(network, settings[0]))
    for label in labels:
        name = _model_label(label)
        if label == "torch_fp16" or name not in predicted:
            continue
        cells = []
        for setting in settings:
            rows = _rows(network, setting)
            ratio = rows[label]["step_s"] / rows["torch_fp16"]["step_s"]
            says = _beats(predicted[name]["crossover_bytes_per_s"].get("torch_fp16@4"), rates[setting])
            agree = None if says is None else (ratio < 1) == says
            agreed += bool(agree)
            total += agree is not None
            cells.append(
                f"{ratio:.2f} | {'-' if says is None else 'yes' if says else 'no'} | "
                f"{'-' if agree is None else 'yes' if agree else 'no'}"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(f"\nThe model's side agrees with the measured one in {agreed} of {total} cases.")
    if left_out := sorted({label for setting in settings for label in _unsteady(network, setting)}):
        lines.append(
            f"Left out: {', '.join(left_out)}, whose steady state (past its own warm-up stages) starts after "
            "the run's last step, so its measured step is not the one the model predicts."
        )
    links = {s: _link(network, s) for s in network["calibrations"]}
    lines.append(
        "Links fitted on plain collectives: "
        + "; ".join(f"{s}: alpha {1e6 * a:.0f} us, {8 * b / 1e6:.1f} Mbit/s" for s, (a, b) in links.items())
        + "."
    )
    return lines, agreed, total


def evidence_block(model_path: Path, network_path: Path) -> str:
    """The evidence page's crossover block: ResNet-50's columns and the comparison's models at 4 workers."""
    model = json.loads(model_path.read_text())
    results, arguments = model["results"], model["arguments"]
    methods = list(next(iter(results.values()))["methods"])
    workers = [int(w) for w in arguments["workers"].split(",")]
    _, agreed, total = _check_lines(results["resnet8"]["methods"], _network(network_path))
    resnet50 = crossover_table(["resnet50"], workers, methods, {"resnet50": results["resnet50"]})
    comparison = [name for name in results if name != "resnet50"]
    small = crossover_table(comparison, [4], methods, results)
    return "\n".join(
        [
            f"At a per-message latency of {arguments['latency']} (fitted on the shaped network), from each "
            "method's codec time and collectives measured on this 2-core machine and the alpha-beta cost model: "
            "the link bandwidth per direction below which (`<`) or above which (`>`) a method's step is shorter "
            "than PyTorch's fp16 hook's. ResNet-50 with a GPU's 100 ms of compute per step:\n",
            resnet50 + "\n",
            "The comparison's models on their data, 4 workers, compute measured here:\n",
            small + "\n",
            f"Over a shaped network (ResNet-8 on Fashion-MNIST, 4 workers, 100 Mbit/s and 1 Gbit/s), the "
            f"model's side (faster or slower than fp16) agrees with the measured one in {agreed} of {total} "
            "cases (`experiments/results/crossover/crossover.md`).",
        ]
    )


def replace_in(page: str, text: str, begin: str = BEGIN, end: str = END) -> str:
    """``page`` with the text between ``begin`` and ``end`` (the crossover block's markers) replaced by ``text``."""
    start, stop = page.find(begin), page.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"the page has no {begin} ... {end} block")
    return page[: start + len(begin)] + "\n" + text + "\n" + page[stop:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    time_parser = sub.add_parser("time")
    time_parser.add_argument("before", type=Path)
    time_parser.add_argument("after", type=Path)
    time_parser.add_argument("--setting", required=True)
    time_parser.add_argument("--commit", default="-")
    time_parser.add_argument("--write", action="store_true", help="save README.md beside AFTER and the evidence block")
    latency_parser = sub.add_parser("latency")
    latency_parser.add_argument("record", type=Path)
    latency_parser.add_argument("--setting", required=True)
    check_parser = sub.add_parser("check")
    check_parser.add_argument("model", type=Path)
    check_parser.add_argument("network", type=Path)
    check_parser.add_argument("--commit", default="-")
    check_parser.add_argument("--write", action="store_true", help="save crossover.md and the evidence block")
    args = parser.parse_args()
    if args.command == "time":
        text = time_table(args.before, args.after, args.setting, args.commit)
        print(text, end="")
        if args.write:
            (args.after.parent / "README.md").write_text(text)
            if args.after.resolve().parent == TIME_RECORDS:  # the committed records: the evidence page follows
                block = text.split("\n", 2)[2].strip()  # the table and its notes, without the title
                EVIDENCE.write_text(replace_in(EVIDENCE.read_text(), block, TIME_BEGIN, TIME_END))
    elif args.command == "latency":
        print(latency(args.record, args.setting))
    else:
        text = check_table(args.model, args.network, args.commit)
        print(text, end="")
        if args.write:
            (args.model.parent / "crossover.md").write_text(text)
            if args.model.resolve().parent == RECORDS:  # the committed records: the evidence page follows them
                EVIDENCE.write_text(replace_in(EVIDENCE.read_text(), evidence_block(args.model, args.network)))


if __name__ == "__main__":
    main()
