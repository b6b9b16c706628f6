"""``lgc-bench codecs``: rate against distortion of every codec of the leader's top-k positions.

Records every worker's gradients of short dense runs (:func:`lgc.analysis.record_gradients`: any
task and model of lgc-train, IID or Dirichlet shards, the chosen parameters) or reads recordings,
measures every codec on them (:mod:`lgc.bench.leader_codecs`, where the codecs, the errors and the
bits are defined) and writes ``codecs.md``, ``codecs.json`` and ``codecs.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lgc.bench.leader_codecs import DEFAULT_CODECS, LEADERS, benchmark_codecs, parse_codecs
from lgc.bench.methods import parse_list
from lgc.provenance import run_provenance

__all__ = ["DATA", "DEFAULT_PATTERNS", "add_arguments", "format_table", "plot_codecs", "run"]

#: Tasks ``lgc-bench codecs`` records (names of lgc-train's data group).
DATA = ("digits", "fashion_mnist", "fashion_scenes")
#: The recorded parameters when ``--patterns`` is not given: every weight of the task's model.
DEFAULT_PATTERNS = "model.*.weight"


def _number(value: float | None, fmt: str = ".4g") -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: dict[str, Any]) -> str:
    """The codecs' table of one recording and, where it has them, the per-parameter premise and errors."""
    lines = [
        f"{result['label']}: {result['steps']} recorded steps (PCA fitted and autoencoders trained, "
        f"{result['ae_updates']} updates, on the first {result['train_steps']}), "
        f"density {result['density']}, chunk {result['chunk']}"
        + (
            f"; load average {result['load_average'][0]:.2f} before, {_number(result['load_average'][1], '.2f')} after "
            "(CPU times compare only on a quiet machine)"
            if "load_average" in result
            else ""
        ),
        "",
        "| leader | codec | payload bits/value | leader's message bits/value | total bits/value | delivered-sum error "
        "| whole-sum error | CPU ms/step/worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["error"] is None:
            lines.append(f"| {row['leader']} | {row['codec']} | - | - | - | {row['note']} | - | - |")
            continue
        lines.append(
            f"| {row['leader']} | {row['codec']} | {row['payload_bits_per_value']:.2f} | "
            f"{row['leader_bits_per_value']:.2f} | {row['bits_per_value']:.2f} | {row['error']:.4g} | "
            f"{_number(row.get('whole_error'))} | {row['cpu_ms_per_step_and_worker']:.2f} |"
        )
    layers = result.get("layers")
    if layers:
        lines += [
            "",
            "Per parameter, on the scored steps: LGC's premise (r: the workers' values at the leader's positions, "
            f"mean over pairs; share: a non-leader's squared gradient lying there, chance {result['density']})",
            "",
            "| parameter | values | r (fixed) | share (fixed) | r (rotating) | share (rotating) |",
            "|---|---|---|---|---|---|",
        ]
        for layer in layers:
            fixed, rotating = layer["fixed"], layer["rotating"]
            lines.append(
                f"| {layer['name']} | {layer['numel']:,} | {fixed['correlation']:.3f} | {fixed['energy_share']:.3f} "
                f"| {rotating['correlation']:.3f} | {rotating['energy_share']:.3f} |"
            )
        for leader in dict.fromkeys(row["leader"] for row in result["rows"]):
            lines += [
                "",
                f"Delivered-sum error at the leader's positions per parameter ({leader} leader; whole-sum error in "
                "brackets)",
                "",
                "| codec | " + " | ".join(layer["name"] for layer in layers) + " |",
                "|---|" + "---|" * len(layers),
            ]
            for row in result["rows"]:
                if row["leader"] != leader or "layers" not in row:
                    continue
                cells = [row["layers"][layer["name"]] for layer in layers]
                lines.append(
                    f"| {row['codec']} | "
                    + " | ".join(f"{_number(c['error'])} ({_number(c['whole_error'])})" for c in cells)
                    + " |"
                )
    return "\n".join(lines)


def plot_codecs(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Delivered-sum error against total bits per value, one panel per recording, fixed and rotating leader."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    columns = min(3, len(results))
    figure, axes = plt.subplots(
        -(-len(results) // columns), columns, figsize=(5.5 * columns, 4.2 * -(-len(results) // columns) + 2.5),
        squeeze=False, layout="constrained",
    )  # fmt: skip
    # One colour per codec across every panel (its marker says the leader), one key for the figure.
    codecs = list(dict.fromkeys(row["codec"] for result in results for row in result["rows"]))
    palette = matplotlib.colormaps["tab20"]
    handles: dict[str, Any] = {}
    for axis, result in zip(axes.flat, results, strict=False):
        for row in result["rows"]:
            if row["error"] is None:
                continue  # cannot carry this many workers' sum
            label = f"{row['codec']} ({row['leader']})"
            handles[label] = axis.scatter(
                row["bits_per_value"],
                max(row["error"], 1e-9),
                marker="o" if row["leader"] == "fixed" else "^",
                color=palette(codecs.index(row["codec"]) % 20),
                label=label,
            )
        axis.set_yscale("log")
        axis.set_xlabel("wire bits per value (payload + the leader's message)")
        axis.set_ylabel("delivered-sum error (relative, squared)")
        # A recording's name lists the parameters it chose: wrapped to the panel's width.
        axis.set_title(textwrap.fill(result["label"].replace(",", ", "), 72), fontsize=7)
        axis.grid(alpha=0.3, which="both")
    for axis in axes.flat[len(results) :]:
        axis.set_visible(False)
    figure.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=5, fontsize=7)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recording", type=Path, action="append", help="a GradientRecorder folder (repeatable; default: record now)"
    )
    parser.add_argument("--data", default="digits", choices=DATA, help="task to record (default digits)")
    parser.add_argument(
        "--model", help="the recorded model: a name of lgc-train's model group (resnet50, pspnet, ...; default: the "
        "data's own)"
    )  # fmt: skip
    parser.add_argument("--partition", default="iid", choices=("iid", "dirichlet"), help="the workers' shards")
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration (default 0.1)")
    parser.add_argument(
        "--patterns", default=DEFAULT_PATTERNS,
        help="comma-separated globs of the recorded parameters (default %(default)s: every weight; a large model "
        "needs a few layers, since every worker's gradients of every step are held in memory)",
    )  # fmt: skip
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="a Hydra override of the recorded run, e.g. model.stem=imagenet or data.size=32 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--workers", default="2,4,8", help="comma-separated worker counts to record (default 2,4,8)")
    parser.add_argument("--batch-sizes", default="8,32", help="comma-separated images per worker (default 8,32)")
    parser.add_argument("--steps", type=int, default=40, help="steps per recording (default 40)")
    parser.add_argument(
        "--density",
        default="0.01",
        help="the top-k density, comma-separated for several on each recording (default 0.01)",
    )
    parser.add_argument("--chunk", type=int, default=64, help="values per chunk (default 64)")
    parser.add_argument("--train-fraction", type=float, default=0.5, help="steps PCA is fitted on (default 0.5)")
    parser.add_argument("--ae-updates", type=int, default=1500, help="autoencoder training updates (default 1500)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help="comma-separated codecs (default %(default)s)")
    parser.add_argument(
        "--leaders", default=",".join(LEADERS), help="comma-separated leader rules: fixed, rotating (default both)"
    )
    parser.add_argument(
        "--keep-recordings", type=Path, metavar="DIR",
        help="record into DIR and reuse a complete recording found there (by default recordings are temporary)",
    )  # fmt: skip
    parser.add_argument(
        "--out",
        type=Path,
        help="write codecs.md, codecs.json and codecs.png here (after every recording; a rerun with the same "
        "settings skips the recordings measured there, and the results of recordings a run does not measure are "
        "kept)",
    )


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(item) for item in parse_list(text, what)]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} must be positive integers, got {text!r}")
    return values


def _densities(text: str) -> list[float]:
    try:
        values = [float(item) for item in parse_list(text, "density")]
    except ValueError:
        raise ValueError(f"--density must be comma-separated numbers, got {text!r}") from None
    for value in values:
        if not 0 < value <= 1:
            raise ValueError(f"--density must be in (0, 1], got {value:g}")
    return values


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        densities = _densities(args.density)
        if not 0 < args.train_fraction < 1:
            raise ValueError(f"--train-fraction must be in (0, 1), got {args.train_fraction}")
        if args.ae_updates < 1:
            raise ValueError(f"--ae-updates must be >= 1, got {args.ae_updates}")
        if args.chunk < 2 or args.steps < 2:
            raise ValueError(f"--chunk and --steps must be >= 2, got {args.chunk} and {args.steps}")
        if args.alpha <= 0:
            raise ValueError(f"--alpha must be > 0, got {args.alpha}")
        codecs = parse_codecs(args.codecs, args.chunk)
        leaders = parse_list(args.leaders, "leaders")
        if any(leader not in LEADERS for leader in leaders):
            raise ValueError(f"--leaders must be some of {', '.join(LEADERS)}, got {args.leaders!r}")
        workers, batch_sizes = _ints(args.workers, "workers"), _ints(args.batch_sizes, "batch-sizes")
        if not args.recording:
            _check_recordings(args, workers, batch_sizes)
    except ValueError as error:
        raise SystemExit(f"lgc-bench codecs: {error}") from None
    settings = {
        "chunk": args.chunk,
        "train_fraction": args.train_fraction,
        "ae_updates": args.ae_updates,
        "codecs": [spec.name for spec in codecs],
        "leaders": leaders,
    }
    others = _others(args.out)
    earlier = _finished(others, settings)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) if args.keep_recordings is None else args.keep_recordings
        for label, record in _recordings(args, workers, batch_sizes, folder):
            recording = None  # recorded once, for the first density not measured before
            for density in densities:
                name = f"{label}, density {density:g}"
                before = earlier.get(name)
                if before is not None and before.get("complete", True):
                    print(f"{name}: measured before, in {args.out / 'codecs.json'}", flush=True)
                    results.append(before)
                    continue
                recording = recording or record()
                results.append({"label": name, "rows": []})  # replaced row by row as they are measured
                # The commit it ran, and whether the tree had changes.
                provenance = run_provenance()

                def save(partial: dict[str, Any], index: int = len(results) - 1, provenance: Any = provenance) -> None:
                    results[index] = {**partial, "settings": settings, "provenance": provenance}
                    if args.out is not None:  # after every row: a stopped run resumes from here
                        _write(args.out, results, others)

                result = benchmark_codecs(
                    recording, codecs, density, args.chunk, args.train_fraction, label=name,
                    ae_updates=args.ae_updates, leaders=leaders, done_rows=(before or {}).get("rows", ()), on_row=save,
                )  # fmt: skip
                save(result)
                if args.out is not None:  # the plot of every recording so far: a stopped run keeps it
                    plot_codecs(_merged(results, others), args.out / "codecs.png")
                print(format_table(results[-1]) + "\n", flush=True)
    if args.out is not None:
        _write(args.out, results, others)
        plot_codecs(_merged(results, others), args.out / "codecs.png")
        print(f"wrote {args.out / 'codecs.md'}, codecs.json and codecs.png")
    return results


def _finished(others: Sequence[dict[str, Any]], settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The results already written (:func:`_others`) measured with the same settings, by label (``complete``
    False: stopped after some rows, which a rerun keeps)."""
    return {result["label"]: result for result in others if result.get("settings") == settings}


def _others(out: Path | None) -> list[dict[str, Any]]:
    """Every result already in ``out/codecs.json``, whatever its settings: a run of some recordings keeps the rest."""
    path = None if out is None else out / "codecs.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else []


def _merged(results: list[dict[str, Any]], others: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """This run's ``results``, each in the place of an earlier result of the same label (or after them), beside
    the earlier results (``others``) of recordings this run did not measure."""
    fresh = {result["label"]: result for result in results}
    merged = [fresh.pop(other["label"], other) for other in others]
    return [*merged, *(result for result in results if result["label"] in fresh)]


def _write(out: Path, results: list[dict[str, Any]], others: Sequence[dict[str, Any]] = ()) -> None:
    """``codecs.md`` and ``codecs.json``: :func:`_merged`."""
    merged = _merged(results, others)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codecs.md").write_text("\n\n".join(format_table(r) for r in merged) + "\n")
    (out / "codecs.json").write_text(json.dumps(merged, indent=2))


def _recordings(
    args: argparse.Namespace, workers: list[int], batch_sizes: list[int], tmp: Path
) -> Iterator[tuple[str, Callable[[], Path]]]:
    """``(label, record)`` of every recording, ``record()`` making it: the ones given, or one per worker
    count and batch size (recorded only when asked for, so a resumed run skips what it measured)."""
    if args.recording:
        for folder in args.recording:
            yield str(folder), lambda folder=folder: folder
        return

    for world in workers:
        for batch in batch_sizes:

            def record(world: int = world, batch: int = batch) -> Path:
                from lgc.analysis import record_gradients  # Lightning: only once the arguments are good
                from lgc.analysis.recording import rank_file

                run = tmp / _folder(_label(args, world, batch), world, batch)
                ranks = [rank_file(run / "gradients", r) for r in range(world)]
                if (run / "summary.json").is_file() and all(path.is_file() for path in ranks):
                    print(f"{_label(args, world, batch)}: the recording in {run} is reused", flush=True)
                    return run / "gradients"
                return record_gradients(
                    run,
                    partition=args.partition,
                    alpha=args.alpha,
                    max_epochs=-1,  # as many epochs as --steps takes
                    patterns=parse_list(args.patterns, "patterns"),
                    overrides=_run_overrides(args, world, batch),
                )

            yield _label(args, world, batch), record


def _folder(label: str, world: int, batch: int) -> str:
    """A recording's folder name: readable, and unique to its label (what was recorded, and how)."""
    return f"w{world}_b{batch}_{hashlib.sha1(label.encode()).hexdigest()[:10]}"


def _run_overrides(args: argparse.Namespace, world: int, batch: int) -> list[str]:
    model = [f"model={args.model}"] if args.model else []
    return [
        f"data={args.data}",
        *model,
        f"data.batch_size={batch}",
        f"trainer.devices={world}",
        "ddp.oversubscribe=true",
        f"trainer.max_steps={args.steps}",
        "trainer.limit_val_batches=0",
        *args.override,
    ]


def _label(args: argparse.Namespace, world: int, batch: int) -> str:
    """One recording's name: what was recorded, and how (the results of a rerun are matched by it)."""
    partition = "IID" if args.partition == "iid" else f"Dirichlet {args.alpha:g}"
    model = f" {args.model}" if args.model else ""
    extra = "".join(f", {override}" for override in args.override)
    patterns = "" if args.patterns == DEFAULT_PATTERNS else f", {args.patterns}"
    return f"{args.data}{model}, {world} workers x {batch} images ({partition}), {args.steps} steps{extra}{patterns}"


def _check_recordings(args: argparse.Namespace, workers: list[int], batch_sizes: list[int]) -> None:
    """Every recording's run as lgc-train checks it, and the patterns against its parameters, before the
    first one starts (ValueError naming the refusal)."""
    from lgc.analysis import compose_recording_config, select_parameters
    from lgc.train import _prepare

    patterns = parse_list(args.patterns, "patterns")
    for world in workers:
        for batch in batch_sizes:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    cfg = compose_recording_config(
                        tmp, args.partition, args.alpha, -1, 1, patterns, overrides=_run_overrides(args, world, batch)
                    )
                    prepared = _prepare(cfg)
                    select_parameters(prepared.module.named_parameters(), patterns)
                except Exception as error:  # noqa: BLE001 (Hydra's, the config's and the patterns' refusals alike)
                    raise ValueError(f"{_label(args, world, batch)}: {type(error).__name__}: {error}") from None
