"""Accuracy at equal whole-run bytes: for each bytes budget, the methods that fit it and which of them are best.

A method's accuracy means little without what it sent. For a budget B (whole-run wire MB per
worker, everything a worker put on the network: warm-ups, codec training and weight broadcasts
included), a method *fits* when every one of its seeds' runs sent at most B. Among the fitting
methods of one task (the same :data:`~lgc.report.seeds.TASK_KEYS`), the one with the highest
mean final metric over at least two seeds leads (one run is no evidence to lead by; only where no
method has two does the highest single run lead), and every
other fitting method is compared with it *paired by seed* (:func:`~lgc.report.seeds.paired_gap`):
where the 95 % interval of the gap holds 0 it is *tied* with the leader, else *below* it; with
fewer than two seeds in common it is *untested*. So a row names the set of methods the evidence
cannot separate at that budget (the leader and its ties, unranked), never an order among them.

Default budgets: every power of ten from the cheapest method's bytes up, and the most expensive
method's bytes (usually dense), so the top row compares every method; ``lgc-report --budgets
10,50,100`` names them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lgc.report.records import WIRE_MB_PER_WORKER, RunRecord
from lgc.report.seeds import TASK_KEYS, SeedGroup, group_by_seed, paired_gap
from lgc.report.values import markdown_table

__all__ = ["BudgetVerdict", "budget_rows", "budget_table", "budget_verdicts", "default_budgets"]


@dataclass(frozen=True)
class BudgetVerdict:
    """The methods of one task within one bytes budget, split by how they compare with the best of them."""

    budget_mb: float
    fitting: tuple[SeedGroup, ...]
    # The fitting method with the highest mean metric over two seeds or more (None when none fits).
    best: SeedGroup | None
    # Fitting methods whose paired gap to the best has a 95 % interval holding 0, below 0, or none.
    tied: tuple[SeedGroup, ...]
    below: tuple[SeedGroup, ...]
    untested: tuple[SeedGroup, ...]


def _peak_mb(group: SeedGroup) -> float | None:
    """The most wire MB per worker any of the group's runs sent (None without wire bytes)."""
    values = group.values(WIRE_MB_PER_WORKER)
    return max(values) if values and len(values) == len(group.records) else None


def default_budgets(groups: Sequence[SeedGroup]) -> list[float]:
    """Powers of ten from the cheapest group's peak bytes up, and the costliest group's peak."""
    peaks = [peak for peak in map(_peak_mb, groups) if peak is not None and peak > 0]
    if not peaks:
        return []
    low, high = min(peaks), max(peaks)
    decades = [10.0**k for k in range(math.ceil(math.log10(low)), math.floor(math.log10(high)) + 1)]
    return sorted({*decades, high})


def budget_verdicts(records: Sequence[RunRecord], budgets: Sequence[float] | None = None) -> list[BudgetVerdict]:
    """One verdict per task and budget, tasks in the order first met, budgets ascending."""
    groups = [group for group in group_by_seed(records) if group.interval("metric") is not None]
    tasks: dict[tuple[Any, ...], list[SeedGroup]] = {}
    for group in groups:
        tasks.setdefault(group.task, []).append(group)
    verdicts = []
    for members in tasks.values():
        for budget in sorted(budgets if budgets is not None else default_budgets(members)):
            fitting = tuple(g for g in members if (peak := _peak_mb(g)) is not None and peak <= budget)
            verdicts.append(_verdict(budget, fitting))
    return verdicts


def _verdict(budget: float, fitting: tuple[SeedGroup, ...]) -> BudgetVerdict:
    if not fitting:
        return BudgetVerdict(budget, (), None, (), (), ())
    repeated = [g for g in fitting if len(g.values("metric")) > 1] or list(fitting)
    best = max(repeated, key=lambda g: g.interval("metric").mean)  # type: ignore[union-attr]
    tied, below, untested = [], [], []
    for group in fitting:
        if group is best:
            continue
        gap = paired_gap(group, best)
        if gap is None or gap.half_width is None:
            untested.append(group)
        elif gap.holds(0.0):
            tied.append(group)
        else:
            below.append(group)
    return BudgetVerdict(budget, fitting, best, tuple(tied), tuple(below), tuple(untested))


def _named(groups: Sequence[SeedGroup]) -> list[str]:
    return [group.label for group in groups]


def budget_rows(records: Sequence[RunRecord], budgets: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """The verdicts as plain rows (labels, the best one's metric interval and peak bytes)."""
    rows = []
    for verdict in budget_verdicts(records, budgets):
        best = verdict.best
        accuracy = None if best is None else best.interval("metric")
        rows.append(
            {
                "budget_mb_per_worker": verdict.budget_mb,
                "task": None if best is None else dict(zip(TASK_KEYS, best.task, strict=True)),
                "fitting": _named(verdict.fitting),
                "best": None if best is None else best.label,
                "best_metric": None if accuracy is None else accuracy.as_dict(),
                "best_peak_mb_per_worker": None if best is None else _peak_mb(best),
                "tied_with_best": _named(verdict.tied),
                "below_best": _named(verdict.below),
                "untested": _named(verdict.untested),
            }
        )
    return rows


def _task_text(task: tuple[Any, ...]) -> str:
    """``4 workers, dirichlet`` from a group's task values."""
    values = dict(zip(TASK_KEYS, task, strict=True))
    return f"{values['world_size']} workers, {values['data.partition'] or 'iid'}"


def budget_table(records: Sequence[RunRecord], budgets: Sequence[float] | None = None) -> str:
    """The verdicts as a markdown table, one row per task and budget."""
    verdicts = budget_verdicts(records, budgets)
    several_tasks = len({v.best.task for v in verdicts if v.best is not None}) > 1
    header = [
        "budget (wire MB/worker)",
        "methods within",
        "highest mean (± 95% CI, MB/worker)",
        "tied with it (paired CI holds 0)",
        "below it",
        "fewer than 2 seeds in common",
    ]
    if several_tasks:
        header.insert(0, "task")
    rows = []
    for verdict in verdicts:
        best = verdict.best
        cells = [
            f"{verdict.budget_mb:.4g}",
            str(len(verdict.fitting)),
            "-" if best is None else f"{best.label}: {best.interval('metric').text('.4f')} ({_peak_mb(best):.3g} MB)",  # type: ignore[union-attr]
            ", ".join(_named(verdict.tied)) or "-",
            ", ".join(_named(verdict.below)) or "-",
            ", ".join(_named(verdict.untested)) or "-",
        ]
        if several_tasks:
            cells.insert(0, "-" if best is None else _task_text(best.task))
        rows.append(cells)
    return markdown_table(header, rows)
