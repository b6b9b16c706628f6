"""The report's plot: accuracy against compression ratio, one labelled marker per run."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lgc.report.records import RunRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["KEY_LABEL_CHARS", "MAX_LABELLED_RUNS", "NEAR_DECADES", "plot_tradeoff"]


#: Above this many runs in a panel, markers are numbered and a key names them.
MAX_LABELLED_RUNS = 8
#: Numbered markers closer than this (in decades of the ratio) at the same accuracy share a label.
NEAR_DECADES = 0.06
#: Characters per line of the key (longer labels wrap).
KEY_LABEL_CHARS = 76


def _key_lines(number: int, label: str) -> list[str]:
    """A run's entry in the plot's key: its number and its whole label, wrapped."""
    return textwrap.wrap(f"{number:>2}  {label}", KEY_LABEL_CHARS, subsequent_indent="    ", break_on_hyphens=False)


def _numbered_groups(logs: list[float], ys: list[float]) -> list[tuple[float, float, list[str], bool]]:
    """Markers ``1..n`` at ``(log10 x, y)`` grouped for one annotation each: ``(log x, y, numbers, below)``.

    Runs on (nearly) the same spot share one annotation (``"3,7"``): the same ``y``, each within
    :data:`NEAR_DECADES` of the previous one. Neighbouring groups at the same ``y`` alternate
    above and below their markers, so their numbers do not run into each other.
    """
    groups: list[tuple[float, float, list[str], bool]] = []
    last_x = math.nan
    for number, log_x, y in sorted(zip(range(1, len(logs) + 1), logs, ys, strict=True), key=lambda p: (p[2], p[1])):
        if groups and groups[-1][1] == y and log_x - last_x < NEAR_DECADES:
            groups[-1][2].append(str(number))
        else:
            below = bool(groups) and groups[-1][1] == y and not groups[-1][3]
            groups.append((log_x, y, [str(number)], below))
        last_x = log_x
    return groups


def plot_tradeoff(records: Sequence[RunRecord], ratio: str = "compression_ratio") -> Figure:
    """Accuracy (``val/mIoU`` for segmentation runs) against compression ratio, one labelled marker per run.

    The ratio axis is logarithmic; markers are coloured by compressor group; each dense run
    (``compressor=none``) is also drawn as a dashed horizontal line, the baseline to compare
    with. Runs without the metric or with a null ratio are listed in the legend as not plotted.
    Classification and segmentation runs get a panel each. With more than
    :data:`MAX_LABELLED_RUNS` runs in a panel the markers carry numbers (runs on the same spot
    share one, ``"3,7"``) and a key beside the axes names them; fewer carry their labels.

    Args:
        records: runs from :func:`load_runs`.
        ratio: the summary field on the x axis (dotted for nested ones), e.g.
            ``"payload_compression_ratio"`` or ``"lgc_stages.compressed.compression_ratio"``.

    Returns:
        A ``matplotlib.figure.Figure`` made without pyplot (it displays itself in a notebook;
        ``fig.savefig(path)`` writes it).
    """
    from matplotlib import ticker
    from matplotlib.figure import Figure

    if not records:
        raise ValueError("no runs to plot")
    metric_keys = list(dict.fromkeys(record.metric_key for record in records))
    colors = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(record.compressor for record in records))}
    panels = [[record for record in records if record.metric_key == key] for key in metric_keys]
    # Many runs: their labels would overlap (accuracies of a small validation set take few values),
    # so each marker gets a number and a key beside the axes names the runs.
    numbered = max(len(panel) for panel in panels) > MAX_LABELLED_RUNS
    key_lines = max(sum(len(_key_lines(1, record.label)) for record in panel) for panel in panels)
    height = max(5.0, 0.13 * key_lines + 1.2) if numbered else 5.0
    figure = Figure(figsize=((13.0 if numbered else 8.0) * len(metric_keys), height), layout="constrained")
    if numbered:
        ratios = {"width_ratios": [8, 5] * len(metric_keys)}
        both = figure.subplots(1, 2 * len(metric_keys), squeeze=False, gridspec_kw=ratios)[0]
        axes, keys = both[0::2], both[1::2]
    else:
        axes, keys = figure.subplots(1, len(metric_keys), squeeze=False)[0], [None] * len(metric_keys)
    for axis, key_axis, metric_key, panel in zip(axes, keys, metric_keys, panels, strict=True):
        points, skipped = [], []
        for record in panel:
            x, y = record.value(ratio), record.metric
            if isinstance(x, (int, float)) and y is not None and x > 0 and math.isfinite(x) and math.isfinite(y):
                points.append((record, float(x), y))
            else:
                skipped.append(record.label)
        logs = [math.log10(x) for _, x, _ in points]
        middle = (min(logs) + max(logs)) / 2 if logs else 0.0
        shown: set[str] = set()
        for (record, x, y), log_x in zip(points, logs, strict=True):
            legend = record.compressor if record.compressor not in shown else None
            shown.add(record.compressor)
            axis.scatter([x], [y], color=colors[record.compressor], label=legend, zorder=3, s=36)
            if numbered:
                continue
            # Labels point inwards, so that long ones stay on the figure; they do not resize the axes.
            right_half = log_x > middle
            text = axis.annotate(
                record.label,
                (x, y),
                xytext=(-6 if right_half else 6, 4),
                textcoords="offset points",
                ha="right" if right_half else "left",
                fontsize=8,
            )
            text.set_in_layout(False)
        for log_x, y, names, below in _numbered_groups(logs, [y for _, _, y in points]) if numbered else []:
            text = axis.annotate(
                ",".join(names), (10**log_x, y), xytext=(3, -9 if below else 4), textcoords="offset points", fontsize=7
            )
            text.set_in_layout(False)
        if key_axis is not None:
            key_axis.axis("off")
            lines = [
                line
                for number, (record, _, _) in enumerate(points, start=1)
                for line in _key_lines(number, record.label)
            ]
            key_axis.text(0, 1, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=7,
                          transform=key_axis.transAxes)  # fmt: skip
        dense = [record for record in panel if record.is_dense and record.metric is not None]
        for record in dense:
            name = "dense baseline" if len(dense) == 1 else f"dense baseline: {record.label}"
            axis.axhline(record.metric, color="gray", ls="--", lw=1, label=name, zorder=1)
        if skipped:
            note = f"not plotted (no {metric_key} or {ratio}): {', '.join(skipped)}"
            axis.plot([], [], " ", label=textwrap.fill(note, 60))
        axis.set_xscale("log")
        # Plain numbers (2, 5, 50) rather than powers of ten: ratios of a sweep often span less than a decade.
        axis.xaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))
        axis.xaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(1.5, 0.6)))
        axis.set_xlabel(f"{ratio} (log scale)")
        axis.set_ylabel(metric_key)
        axis.set_title(f"{metric_key} against {ratio}", fontsize=10)
        axis.grid(alpha=0.3, which="both")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    return figure
