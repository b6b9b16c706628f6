"""Runs that differ only in ``seed``, as one method: mean, spread and 95 % intervals, and the paired gap to dense.

A comparison is evidence only when it says how much its numbers move between seeds. The runs
of one label once its ``seed=N`` token is left out form a group (``lgc-train -m seed=0,1,2
compressor=topk`` makes one). For each group and each quantity (the final ``val/acc`` or
``val/mIoU``, whole-run wire MB per worker, a training step's CPU time per worker, wall time)
this module gives n, the mean, the sample standard deviation and the half-width of the 95 %
confidence interval of the mean from Student's t distribution (``t(0.975, n - 1) * sd /
sqrt(n)``; none for n = 1).

The dense baseline (``compressor=none``) of a group is the dense group run on the same task:
the same data, model, number of workers, batch size, length and schedule (:data:`TASK_KEYS`; not
the optimizer, which some methods define, as DGC and DeMo do). Where several dense groups match
(a learning-rate sweep of dense, say), none is paired. Its accuracy is compared *paired by seed*: the differences
``method(seed) - dense(seed)`` over the seeds both have, their mean and 95 % interval. Where that
interval holds 0 the method is marked indistinguishable from dense (``≈ dense``); else ``above`` or
``below``. The rows keep the order the runs were given in: the table never ranks methods by their
means, since two methods whose intervals overlap are not shown to differ.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lgc.report.records import WIRE_MB_PER_WORKER, RunRecord
from lgc.report.values import MISSING, lookup, markdown_table

__all__ = [
    "STEP_CPU_MS",
    "TASK_KEYS",
    "Interval",
    "SeedGroup",
    "group_by_seed",
    "paired_gap",
    "plot_seed_groups",
    "seed_rows",
    "seed_table",
]

#: What makes two runs the same task (a method's dense baseline shares every one of these).
TASK_KEYS = (
    "data._target_",
    "data.partition",
    "data.alpha",
    "data.batch_size",
    "model._target_",
    "world_size",
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.limit_train_batches",
    "scheduler._target_",
)
#: A training step's CPU time per worker, in ms (``summary.json``'s mean over workers; lgc.lit.RunSummary).
STEP_CPU_MS = "step_cpu_time_ms"
_SEED_TOKEN = re.compile(r"(^| )seed=\S+")


@dataclass(frozen=True)
class Interval:
    """n values' mean, sample standard deviation and 95 % Student-t half-width (None below two values)."""

    n: int
    mean: float
    sd: float | None
    half_width: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Interval | None:
        """The interval of ``values`` (None when there are none)."""
        if not values:
            return None
        n, mean = len(values), math.fsum(values) / len(values)
        if n < 2:
            return cls(n, mean, None, None)
        from scipy.stats import t

        # Equal values have no spread (not the rounding residue of their mean).
        sd = 0.0 if min(values) == max(values) else math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
        return cls(n, mean, sd, float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n))

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def holds(self, value: float) -> bool | None:
        """Whether ``value`` lies inside the interval (None: no interval)."""
        return None if self.half_width is None else self.low <= value <= self.high  # type: ignore[operator]

    def as_dict(self) -> dict[str, Any]:
        """For JSON: n, mean, sd, the half-width and the bounds (``ci95``; None below two values)."""
        ci95 = None if self.half_width is None else [self.low, self.high]
        return {"n": self.n, "mean": self.mean, "sd": self.sd, "half_width": self.half_width, "ci95": ci95}

    def text(self, fmt: str) -> str:
        """``mean ± half-width`` in ``fmt`` (a ``+`` in it signs the mean only)."""
        spread = fmt.replace("+", "")
        return format(self.mean, fmt) + ("" if self.half_width is None else f" ± {self.half_width:{spread}}")


@dataclass(frozen=True)
class SeedGroup:
    """One method's runs over seeds (the same label once ``seed`` is left out)."""

    label: str
    records: tuple[RunRecord, ...] = field(repr=False)

    @property
    def seeds(self) -> list[Any]:
        return [record.config.get("seed") for record in self.records]

    @property
    def is_dense(self) -> bool:
        return all(record.is_dense for record in self.records)

    @property
    def task(self) -> tuple[Any, ...]:
        """The :data:`TASK_KEYS` values of its first run (``world_size`` from the summary)."""
        record = self.records[0]
        return tuple(
            record.summary.get("world_size") if key == "world_size" else lookup(record.config, key) for key in TASK_KEYS
        )

    def values(self, key: str) -> list[float]:
        """The runs' values of a quantity (``metric``, ``wire_mb_per_worker`` or a summary key) that they have."""
        found = [record.metric if key == "metric" else record.value(key) for record in self.records]
        return [float(value) for value in found if value is not None and value is not MISSING]

    def interval(self, key: str) -> Interval | None:
        return Interval.of(self.values(key))


def group_by_seed(records: Sequence[RunRecord]) -> list[SeedGroup]:
    """The runs grouped by their label without its ``seed=N`` token, in the order first met."""
    groups: dict[str, list[RunRecord]] = {}
    for record in records:
        label = _SEED_TOKEN.sub("", record.label).strip()
        groups.setdefault(label, []).append(record)
    return [SeedGroup(label, tuple(members)) for label, members in groups.items()]


def _dense_for(group: SeedGroup, groups: Sequence[SeedGroup]) -> SeedGroup | None:
    """The one dense group on the same task (None if there is none, or several)."""
    matches = [other for other in groups if other.is_dense and other.task == group.task]
    return matches[0] if len(matches) == 1 else None


def paired_gap(group: SeedGroup, other: SeedGroup) -> Interval | None:
    """The group's final metric minus the other's (dense's, say), seed by seed, over the seeds both ran."""
    mine = {record.config.get("seed"): record.metric for record in group.records}
    theirs = {record.config.get("seed"): record.metric for record in other.records}
    gaps = [mine[s] - theirs[s] for s in mine if s in theirs and mine[s] is not None and theirs[s] is not None]
    return Interval.of(gaps)  # type: ignore[arg-type]


def _verdict(gap: Interval | None) -> str:
    if gap is None or gap.half_width is None:
        return "-"
    if gap.holds(0.0):
        return "≈ dense"
    return "above" if gap.mean > 0 else "below"


@dataclass(frozen=True)
class _Comparison:
    """One group's intervals and its comparison with dense: what the table and the JSON rows show."""

    group: SeedGroup
    accuracy: Interval | None
    wire: Interval | None
    step_cpu: Interval | None
    wall: Interval | None
    gap: Interval | None
    vs_dense: str
    wire_ratio: float | None


def _comparisons(records: Sequence[RunRecord]) -> list[_Comparison]:
    groups = group_by_seed(records)
    compared = []
    for group in groups:
        dense = _dense_for(group, groups)
        gap = None if dense is None or group is dense else paired_gap(group, dense)
        compared.append(
            _Comparison(
                group,
                group.interval("metric"),
                group.interval(WIRE_MB_PER_WORKER),
                group.interval(STEP_CPU_MS),
                group.interval("wall_time_s"),
                gap,
                "dense" if group is dense else _verdict(gap),
                _wire_ratio(group, dense),
            )
        )
    return compared


def seed_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One plain row per seed group (means, standard deviations, interval bounds, paired gap to dense)."""
    return [
        {
            "label": c.group.label,
            "n": len(c.group.records),
            "seeds": c.group.seeds,
            c.group.records[0].metric_key: _interval_dict(c.accuracy),
            WIRE_MB_PER_WORKER: _interval_dict(c.wire),
            STEP_CPU_MS: _interval_dict(c.step_cpu),
            "wall_time_s": _interval_dict(c.wall),
            "gap_to_dense": _interval_dict(c.gap),
            "vs_dense": c.vs_dense,
            "wire_ratio_to_dense": c.wire_ratio,
        }
        for c in _comparisons(records)
    ]


def _wire_ratio(group: SeedGroup, dense: SeedGroup | None) -> float | None:
    """Dense's mean whole-run wire bytes over the group's (None without both)."""
    wire = group.interval(WIRE_MB_PER_WORKER)
    dense_wire = None if dense is None else dense.interval(WIRE_MB_PER_WORKER)
    return dense_wire.mean / wire.mean if dense_wire is not None and wire is not None and wire.mean else None


def _interval_dict(interval: Interval | None) -> dict[str, Any] | None:
    return None if interval is None else interval.as_dict()


def seed_table(records: Sequence[RunRecord]) -> str:
    """The groups as a markdown table: mean ± 95 % half-width, n, and the paired gap to dense."""
    metric = records[0].metric_key if records else "val/acc"
    header = [
        "method",
        "n (seeds)",
        f"{metric} mean ± 95% CI",
        "sd",
        "gap to dense, paired ± 95% CI",
        "vs dense",
        "wire MB/worker",
        "x fewer bytes than dense",
        "step CPU ms/worker",
        "wall time (s)",
    ]
    rows = []
    for c in _comparisons(records):
        cells = [
            c.group.label,
            f"{len(c.group.records)} ({', '.join(str(seed) for seed in c.group.seeds)})",
            "-" if c.accuracy is None else c.accuracy.text(".4f"),
            "-" if c.accuracy is None or c.accuracy.sd is None else f"{c.accuracy.sd:.4f}",
            "-" if c.gap is None else c.gap.text("+.4f"),
            c.vs_dense,
            "-" if c.wire is None else c.wire.text(".3g"),
            "-" if c.wire_ratio is None else f"{c.wire_ratio:.1f}",
            "-" if c.step_cpu is None else c.step_cpu.text(".1f"),
            "-" if c.wall is None else c.wall.text(".1f"),
        ]
        rows.append(cells)
    return markdown_table(header, rows)


#: Ten colours and eight markers: the n-th method gets colour n % 10 and marker n % 8, a pair no other
#: method of the first 40 shares, so a plot of a whole sweep tells every method apart.
_COLORS = tuple(f"C{i}" for i in range(10))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_seed_groups(records: Sequence[RunRecord]) -> Any:
    """Each method's mean accuracy against its whole-run wire MB per worker, with 95 % intervals as error bars.

    The bytes axis is logarithmic; the dense group's interval is drawn as a grey band, so a
    method whose bar reaches into it cannot be told apart from dense by its unpaired interval (the
    table's paired gap is the sharper test). Groups without the metric or without wire bytes are
    left out and named in the title.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    groups = group_by_seed(records)
    figure, axis = plt.subplots(figsize=(9, 4.5), layout="constrained")
    metric = records[0].metric_key if records else "val/acc"
    skipped = []
    for index, group in enumerate(groups):
        accuracy, wire = group.interval("metric"), group.interval(WIRE_MB_PER_WORKER)
        if accuracy is None or wire is None or wire.mean <= 0:
            skipped.append(group.label)
            continue
        if group.is_dense and accuracy.half_width is not None:
            axis.axhspan(accuracy.low, accuracy.high, color="gray", alpha=0.2, label=f"{group.label} (95% CI)")
        axis.errorbar(
            [wire.mean],
            [accuracy.mean],
            yerr=None if accuracy.half_width is None else [[accuracy.half_width], [accuracy.half_width]],
            xerr=None if wire.half_width is None else [[min(wire.half_width, wire.mean * 0.999)], [wire.half_width]],
            fmt=_MARKERS[index % len(_MARKERS)],
            color=_COLORS[index % len(_COLORS)],
            capsize=3,
            label=f"{group.label} (n={accuracy.n})",
        )
    axis.set_xscale("log")
    axis.set_xlabel("whole-run wire MB per worker (log scale)")
    axis.set_ylabel(f"{metric}, mean ± 95% CI over seeds")
    title = f"{metric} against bytes sent, over seeds"
    axis.set_title(title + (f"\nnot plotted: {', '.join(skipped)}" if skipped else ""), fontsize=10)
    axis.grid(alpha=0.3, which="both")
    # Beside the axes, not over the points (a sweep has two dozen methods).
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncols=1 + len(groups) // 24)
    return figure
