"""``lgc-bench network``'s results: one row per method from its measurement, the tables and the plot.

:func:`summarize` turns a method's raw steps (every rank's) into its row: per-step medians, time to
the target accuracy, accuracy at equal wire bytes and the interface counters' cross-check;
the tables and the plot print the rows of one setting (:mod:`lgc.bench.network` measures them).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lgc.bench.methods import method_color
from lgc.report.seeds import Interval

__all__ = [
    "accuracy_at_bytes",
    "combine_seeds",
    "over_seeds",
    "seeds_table",
    "equal_bytes_table",
    "eval_line",
    "plot_results",
    "step_table",
    "summarize",
    "validation_table",
]


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(measurement: dict[str, Any], target: float, skip: int) -> dict[str, Any]:
    """One method's row: per-step medians over ranks and steps, time to ``target``, the cross-check."""
    ranks = measurement["ranks"]
    # Per-step figures describe the steady state: past --skip and past the method's own stages
    # (LGC's warm-up and autoencoder training, PowerSGD's dense steps, DGC's density warm-up).
    first = max(skip, *(rank.get("steady_from", 0) for rank in ranks))
    if first >= len(ranks[0]["steps"]):
        raise ValueError(
            f"{ranks[0]['spec']['method']}: its steady state starts at step {first}, after the run's "
            f"{len(ranks[0]['steps'])} steps; raise --steps"
        )
    steps = [step for rank in ranks for step in rank["steps"][first:]]
    wall = statistics.median(s["wall_s"] for s in steps)
    compute = statistics.median(rank["compute_s"] for rank in ranks)
    encode = _median([s["encode_s"] for s in steps])
    decode = _median([s["decode_s"] for s in steps])
    evaluations = ranks[0]["evaluations"]
    reached = next((e for e in evaluations if e["accuracy"] is not None and e["accuracy"] >= target), None)
    wire_sent = sum(rank["stats"]["wire_bytes_sent"] for rank in ranks)
    if all(rank.get("interface_tx_bytes") is not None for rank in ranks):
        # Counted by the workers around their training loops: no rendezvous, no initial broadcast.
        interface_sent = sum(rank["interface_tx_bytes"] for rank in ranks)
    else:
        interface_sent = sum(counts["tx_bytes"] for counts in measurement["interfaces"].values())
    total_steps = len(ranks[0]["steps"])
    return {
        "method": ranks[0]["spec"].get("label") or ranks[0]["spec"]["method"],
        "step_s": wall,
        "mean_step_s": evaluations[-1]["training_s"] / total_steps,
        "compute_s": compute,
        "encode_s": encode,
        "decode_s": decode,
        "comm_s": wall - compute - (encode or 0.0) - (decode or 0.0),
        "cpu_s": statistics.median(s["cpu_s"] for s in steps),
        "wire_bytes_per_step": statistics.mean(s["wire_bytes_sent"] for s in steps),
        "wire_bytes_per_worker": wire_sent / len(ranks),
        "interface_bytes_per_worker": interface_sent / len(ranks),
        "interface_over_wire": interface_sent / wire_sent if wire_sent else None,
        "time_to_target_s": None if reached is None else reached["training_s"],
        "steps_to_target": None if reached is None else reached["step"],
        "final_accuracy": evaluations[-1]["accuracy"],
        # Which model rank 0 evaluated (global: the synchronized one; absent from older records).
        "eval_model": ranks[0].get("eval_model"),
        "training_s": evaluations[-1]["training_s"],
        "steps": total_steps,
        "steady_from": first,
        "curve": [(e["training_s"], e["accuracy"]) for e in evaluations],
        # (wire bytes a worker sent by then, accuracy) at every evaluation: accuracy against bytes.
        "byte_curve": [(_bytes_by_step(ranks, e["step"]), e["accuracy"]) for e in evaluations],
    }


def combine_seeds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's rows of several seeds (each :func:`summarize`'d on its own steady steps) as one.

    Per-step times: the median over the seeds' medians; bytes and the mean step: the mean; time and
    steps to the target: the mean over the seeds that reached it (None if none did); the final
    accuracy: the mean. The curves are the first seed's (the table over seeds has the intervals).
    """
    combined = dict(rows[0])
    if len(rows) == 1:
        return combined
    for key in ("step_s", "compute_s", "encode_s", "decode_s", "comm_s", "cpu_s"):
        combined[key] = _median([row[key] for row in rows])
    for key in ("mean_step_s", "wire_bytes_per_step", "wire_bytes_per_worker", "interface_bytes_per_worker"):
        combined[key] = statistics.fmean(row[key] for row in rows)
    wire = combined["wire_bytes_per_worker"]
    combined["interface_over_wire"] = combined["interface_bytes_per_worker"] / wire if wire else None
    reached = [row for row in rows if row["time_to_target_s"] is not None]
    combined["time_to_target_s"] = statistics.fmean(r["time_to_target_s"] for r in reached) if reached else None
    combined["steps_to_target"] = round(statistics.fmean(r["steps_to_target"] for r in reached)) if reached else None
    accuracies = [row["final_accuracy"] for row in rows if row["final_accuracy"] is not None]
    combined["final_accuracy"] = statistics.fmean(accuracies) if accuracies else None
    combined["steady_from"] = max(row["steady_from"] for row in rows)
    combined["seeds"] = len(rows)
    return combined


def _bytes_by_step(ranks: list[dict[str, Any]], step: int) -> float:
    """Wire bytes a worker sent (mean over ranks) in the first ``step`` training steps."""
    return statistics.mean(sum(s["wire_bytes_sent"] for s in rank["steps"][:step]) for rank in ranks)


def accuracy_at_bytes(row: dict[str, Any], budget: float) -> float | None:
    """The last evaluated accuracy of ``row`` with at most ``budget`` wire bytes sent per worker."""
    within = [accuracy for sent, accuracy in row["byte_curve"] if sent <= budget and accuracy is not None]
    return within[-1] if within else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def step_table(rows: list[dict[str, Any]], target: float) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{1000 * value:.1f}"

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    dense = next((r for r in rows if r["method"] == "none"), None)
    fp16 = next((r for r in rows if r["method"] == "torch_fp16"), None)
    header = (
        f"| method | step (ms) | x dense | x fp16 | compute | encode | decode | own work alone | comm | CPU (ms) "
        f"| wire KB/step "
        f"| interface/wire | time to {target:g} (s) | x dense | steps | final acc | mean step (ms) | wire MB/worker |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        to_target = r["time_to_target_s"]
        lines.append(
            f"| {r['method']} | {ms(r['step_s'])} | {times(_ratio(r['step_s'], dense and dense['step_s']))} "
            f"| {times(_ratio(r['step_s'], fp16 and fp16['step_s']))} | {ms(r['compute_s'])} | {ms(r['encode_s'])} "
            f"| {ms(r['decode_s'])} | {ms(r.get('profile_overhead_s'))} | {ms(r['comm_s'])} | {ms(r['cpu_s'])} "
            f"| {r['wire_bytes_per_step'] / 1e3:.1f} "
            f"| {times(r['interface_over_wire'])} | {'-' if to_target is None else f'{to_target:.1f}'} "
            f"| {times(_ratio(to_target, dense and dense['time_to_target_s']))} "
            f"| {r['steps_to_target'] or '-'} | {r['final_accuracy']:.4f} | {ms(r.get('mean_step_s'))} "
            f"| {r['wire_bytes_per_worker'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


def eval_line(rows: list[dict[str, Any]]) -> str:
    """Which model the accuracies are of, per method (the worker's ``eval_model``)."""
    models: dict[str, list[str]] = {}
    for row in rows:
        models.setdefault(row.get("eval_model") or "not recorded", []).append(row["method"])
    described = {
        "global": "the synchronized (global) model: with local steps every fragment's last synchronized weights "
        "and buffers, otherwise the weights every worker shares",
        "not recorded": "a model the record does not name (rank 0's own weights)",
    }
    return (
        "Accuracy evaluated on "
        + "; ".join(f"{described.get(model, model)} ({', '.join(methods)})" for model, methods in models.items())
        + "."
    )


def equal_bytes_table(rows: list[dict[str, Any]]) -> str:
    """Every method's accuracy once it has sent as many bytes as the thriftiest method sent in its whole run."""
    if "byte_curve" not in rows[0]:
        return ""
    budget = min(r["wire_bytes_per_worker"] for r in rows)
    lines = [
        f"At equal wire bytes: accuracy at the last evaluation with at most {budget / 1e6:.3f} MB sent per worker "
        "(the least any method sent in the whole run; `-`: no evaluation within it).\n",
        "| method | accuracy |",
        "|---|---|",
    ]
    for r in rows:
        accuracy = accuracy_at_bytes(r, budget)
        lines.append(f"| {r['method']} | {'-' if accuracy is None else f'{accuracy:.4f}'} |")
    return "\n".join(lines)


def plot_results(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 9), squeeze=False)
    for column, (bandwidth, rows) in enumerate(results.items()):
        for index, row in enumerate(rows):
            seconds, accuracy = zip(*row["curve"], strict=True)
            axes[0][column].plot(seconds, accuracy, marker=".", color=method_color(index), label=row["method"])
            if "byte_curve" in row:
                # Evaluations before anything was sent (a delay's first local steps) have no place on a log axis.
                points = [(sent / 1e6, accuracy) for sent, accuracy in row["byte_curve"] if sent > 0]
                if points:
                    megabytes, accuracy = zip(*points, strict=True)
                    axes[1][column].plot(
                        megabytes, accuracy, marker=".", color=method_color(index), label=row["method"]
                    )
        for axis, xlabel in zip(axes[:, column], ("training wall time (s)", "wire MB sent per worker"), strict=True):
            axis.axhline(target, color="grey", linestyle=":", linewidth=1)
            axis.set_title(f"{bandwidth} per link")
            axis.set_xlabel(xlabel)
            axis.set_ylabel("validation accuracy")
            axis.legend(fontsize=7)
        axes[1][column].set_xscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def validation_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | measured step (ms) | predicted (ms) | error | compute | overhead | comm (model) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = r["predicted_step_s"] / r["step_s"] - 1
        lines.append(
            f"| {r['method']} | {1000 * r['step_s']:.1f} | {1000 * r['predicted_step_s']:.1f} | {100 * error:+.0f} % "
            f"| {1000 * r['profile_compute_s']:.1f} | {1000 * r['profile_overhead_s']:.1f} "
            f"| {1000 * r['predicted_comm_s']:.1f} |"
        )
    return "\n".join(lines)


def over_seeds(per: dict[str, list[dict[str, Any]]], target: float, skip: int) -> dict[str, Any]:
    """Each method's time to ``target`` per seed, their 95 % intervals, and the no-communication bound.

    ``per``: a setting's measurements, one per seed, by method label. The **no-communication
    bound** of a seed is dense's (``none``'s) steps to the target times its compute-only step
    (forward and backward without communication, ``compute_s``): what any method needs on that
    seed's batches if communication were free and it converged as dense does. Each method's
    time to target is divided by the bound seed by seed (``x_bound``), so it reads as a multiple
    of what the network allows at best. Seeds where a method never reached the target count in
    ``reached`` and are left out of its intervals.
    """
    summaries = {
        label: list(zip(_seeds(runs), [summarize(run, target, skip) for run in runs], strict=True))
        for label, runs in per.items()
    }
    bounds: dict[Any, float] = {}
    for seed, row in summaries.get("none", []):
        if row["steps_to_target"] is not None:
            bounds[seed] = row["steps_to_target"] * row["compute_s"]
    methods = []
    for label, rows in summaries.items():
        times = {seed: row["time_to_target_s"] for seed, row in rows if row["time_to_target_s"] is not None}
        ratios = [times[seed] / bounds[seed] for seed in times if seed in bounds]
        methods.append(
            {
                "method": label,
                "seeds": [seed for seed, _ in rows],
                "reached": len(times),
                "time_to_target_s": _interval(list(times.values())),
                "x_bound": _interval(ratios),
                "final_accuracy": _interval(
                    [row["final_accuracy"] for _, row in rows if row["final_accuracy"] is not None]
                ),
                "wire_mb_per_worker": _interval([row["wire_bytes_per_worker"] / 1e6 for _, row in rows]),
            }
        )
    dense = summaries.get("none", [])
    return {
        "target": target,
        "bound_s": _interval(list(bounds.values())),
        "bound_by_seed": [
            {"seed": seed, "steps": row["steps_to_target"], "compute_s": row["compute_s"], "bound_s": bounds.get(seed)}
            for seed, row in dense
        ],
        "methods": methods,
    }


def _seeds(runs: list[dict[str, Any]]) -> list[Any]:
    """The seeds the measurements ran with; their positions where the records do not tell them apart
    (records of repeats of one seed)."""
    seeds = [run["ranks"][0]["spec"].get("seed") for run in runs]
    return seeds if None not in seeds and len(set(seeds)) == len(seeds) else list(range(len(runs)))


def _interval(values: list[float]) -> dict[str, Any] | None:
    interval = Interval.of(values)
    if interval is None:
        return None
    return {**interval.as_dict(), "values": values}


def _text(interval: dict[str, Any] | None, fmt: str) -> str:
    if interval is None:
        return "-"
    half = interval["half_width"]
    return format(interval["mean"], fmt) + ("" if half is None else f" ± {half:{fmt}}")


def seeds_table(result: dict[str, Any]) -> str:
    """The time-to-target table over seeds, with the no-communication bound it is read against."""
    target, bound = result["target"], result["bound_s"]
    lines = [
        f"| method | seeds at {target:g} | time to {target:g} (s) ± 95% CI | x no-communication bound ± 95% CI "
        "| final accuracy ± 95% CI | wire MB/worker |",
        "|---|---|---|---|---|---|",
    ]
    for m in result["methods"]:
        lines.append(
            f"| {m['method']} | {m['reached']}/{len(m['seeds'])} | {_text(m['time_to_target_s'], '.1f')} "
            f"| {_text(m['x_bound'], '.2f')} | {_text(m['final_accuracy'], '.4f')} "
            f"| {_text(m['wire_mb_per_worker'], '.3g')} |"
        )
    if bound is None:
        note = "No no-communication bound: dense (`none`) did not run or never reached the target."
    else:
        per_seed = ", ".join(
            f"seed {b['seed']}: {b['steps']} steps x {1000 * b['compute_s']:.1f} ms"
            for b in result["bound_by_seed"]
            if b["bound_s"] is not None
        )
        note = (
            f"No-communication bound: dense's steps to {target:g} times its compute-only step (forward and "
            f"backward, no communication), {_text(bound, '.1f')} s over seeds ({per_seed}). `x no-communication "
            "bound` is each method's time to the target over that bound, seed by seed. Rows are in the order "
            "given, not ranked: methods whose intervals overlap are not shown to differ."
        )
    return "\n".join(lines) + "\n\n" + note
