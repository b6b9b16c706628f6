"""Figures of cross-worker gradient statistics: one panel per layer, one line per run.

Every function returns a ``matplotlib.figure.Figure`` built without pyplot's global state, so
it works in scripts, tests and notebooks alike (in a notebook, the figure displays itself as the
cell's value; ``fig.savefig(path)`` writes it to a file).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from matplotlib.figure import Figure

from lgc.analysis.correlation import random_topk_jaccard, recording_cosine, recording_topk_jaccard
from lgc.analysis.recording import GradientRecording

__all__ = ["plot_cosine_over_time", "plot_topk_jaccard_over_time"]


def _layer_grid(names: list[str], title: str, ylabel: str) -> tuple[Figure, list]:
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False, sharex=True).ravel().tolist()
    for axis, name in zip(axes, names, strict=False):
        axis.set_title(name, fontsize=9)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
    for axis in axes[len(names) :]:
        axis.set_visible(False)
    for axis in axes[max(0, len(names) - columns) : len(names)]:
        axis.set_xlabel("step")
    figure.suptitle(title)
    return figure, axes


def _common_layers(recordings: Mapping[str, GradientRecording]) -> list[str]:
    if not recordings:
        raise ValueError("no recording to plot")
    names = [rec.names for rec in recordings.values()]
    if any(n != names[0] for n in names):
        raise ValueError(f"the recordings hold different layers: {dict(zip(recordings, names, strict=True))}")
    return names[0]


def plot_cosine_over_time(recordings: Mapping[str, GradientRecording]) -> Figure:
    """Mean cross-worker cosine similarity per layer against the training step, one line per run.

    Args:
        recordings: runs by label, e.g. ``{"IID": iid, "Dirichlet alpha=0.1": skewed}``.
    """
    names = _common_layers(recordings)
    figure, axes = _layer_grid(names, "cosine similarity of the workers' gradients", "cosine")
    for label, recording in recordings.items():
        cosine = recording_cosine(recording)
        for axis, name in zip(axes, names, strict=False):
            axis.plot(recording.steps.numpy(), cosine[name].numpy(), label=label, lw=1.2)
    for axis in axes[: len(names)]:
        axis.axhline(0.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    return figure


def plot_topk_jaccard_over_time(recordings: Mapping[str, GradientRecording], density: float = 0.01) -> Figure:
    """Jaccard index of the workers' top-k supports per layer, with the random-subset baseline.

    Args:
        recordings: runs by label.
        density: fraction of entries in each top-k set (``k = round(density * numel)``).
    """
    names = _common_layers(recordings)
    figure, axes = _layer_grid(names, f"top-k overlap of the workers' gradients (density {density:g})", "Jaccard")
    for label, recording in recordings.items():
        jaccard = recording_topk_jaccard(recording, density)
        for axis, name in zip(axes, names, strict=False):
            axis.plot(recording.steps.numpy(), jaccard[name].numpy(), label=label, lw=1.2)
    first = next(iter(recordings.values()))
    for axis, name in zip(axes, names, strict=False):
        axis.axhline(random_topk_jaccard(first.flat(name).shape[-1], density), color="gray", ls="--", lw=0.8)
    axes[0].plot([], [], color="gray", ls="--", lw=0.8, label="random supports")
    axes[0].legend(fontsize=8)
    return figure
