"""The rows of ``lgc-bench step``'s table, from every rank's timed steps (:mod:`lgc.bench.step` runs them).

Each method's step against the no-communication step (``no_sync``): medians and means of the wall
and CPU time, the CPU step over DDP's own (``ddp``) in the same round with a 95 % Student-t interval
over the rounds, and the counted arithmetic per step.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from scipy.stats import t as t_dist

from lgc.bench.methods import NO_COMM

__all__ = ["PLAIN_DDP", "flop_rows", "step_rows"]

#: DDP's own allreduce, no communication hook: what lgc's dense hook (``none``) costs beside it, and
#: the step every method's CPU step is divided by.
PLAIN_DDP = "ddp"


def step_rows(
    per_rank: list[dict[str, list[list[float]]]], rounds: int | None = None, delays: dict[str, int] | None = None
) -> dict[str, dict[str, Any]]:
    """Each method's step from every rank's ``(wall, cpu)`` seconds per timed step, against ``no_sync``'s.

    ``wall_s``: the slowest rank's median step; ``cpu_s``: the median over steps of the CPU summed
    over the ranks; ``mean_wall_s`` and ``mean_cpu_s``: the same with means, which count every
    step (a delay's exchanges among its local steps); ``*_x``: each as a multiple of ``no_sync``'s.
    With ``rounds`` (the timed steps cut into that many interleaved rounds, in order) and DDP's own
    step among the methods: ``cpu_vs_ddp``, the mean CPU step over DDP's in the same round, its mean
    over the rounds, the half-width of its 95 % Student-t interval and the per-round ratios; for a
    method with a delay (``delays``: label -> steps between its exchanges) only when each round holds
    whole delays, since the rounds' ratios are otherwise not draws of one quantity.
    """
    rows: dict[str, dict[str, float]] = {}
    for label in per_rank[0]:
        steps = range(len(per_rank[0][label]))
        cpus = [sum(rank[label][i][1] for rank in per_rank) for i in steps]
        rows[label] = {
            "wall_s": max(statistics.median(w for w, _ in rank[label]) for rank in per_rank),
            "cpu_s": statistics.median(cpus),
            "mean_wall_s": max(statistics.fmean(w for w, _ in rank[label]) for rank in per_rank),
            "mean_cpu_s": statistics.fmean(cpus),
        }
    reference = rows[NO_COMM]
    for row in rows.values():
        row.update({f"{name[:-2]}_x": row[name] / reference[name] for name in list(row)})
    if rounds and rounds > 1 and PLAIN_DDP in per_rank[0]:
        for label, row in rows.items():
            if (len(per_rank[0][label]) // rounds) % (delays or {}).get(label, 1):
                continue
            ratios = [_round_cpu(per_rank, label, r, rounds) / _round_cpu(per_rank, PLAIN_DDP, r, rounds)
                      for r in range(rounds)]  # fmt: skip
            mean = statistics.fmean(ratios)
            half = float(t_dist.ppf(0.975, rounds - 1)) * statistics.stdev(ratios) / math.sqrt(rounds)
            row["cpu_vs_ddp"] = {"mean": mean, "half_width": half, "rounds": ratios}
    return rows


def flop_rows(rows: dict[str, dict[str, Any]], per_rank: list[dict[str, float]]) -> None:
    """Add each method's counted step (``gflop``: the most of any rank, in GFLOP) and its multiple of ``no_sync``'s."""
    for label, row in rows.items():
        row["gflop"] = max(rank[label] for rank in per_rank) / 1e9
    reference = rows[NO_COMM]["gflop"]
    for row in rows.values():
        row["gflop_x"] = row["gflop"] / reference if reference else float("nan")


def _round_cpu(per_rank: list[dict[str, list[list[float]]]], label: str, index: int, rounds: int) -> float:
    """The mean CPU step (summed over ranks) of round ``index`` of ``rounds`` equal rounds."""
    steps = len(per_rank[0][label]) // rounds
    window = range(index * steps, (index + 1) * steps)
    return statistics.fmean(sum(rank[label][i][1] for rank in per_rank) for i in window)
