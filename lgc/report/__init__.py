"""``lgc-report``: compare finished runs from their ``summary.json`` files, as a table and a plot.

Every run of ``lgc-train`` (and of :func:`lgc.train.train`) leaves a ``summary.json``
(:class:`lgc.lit.RunSummary`) with its final metrics, bytes, compression ratios and fully
resolved config. This module reads those of one or more run folders (a Hydra multirun folder
holds one run per subfolder ``0/``, ``1/``, ...), names every run by what sets it apart from the
others (``topk density=0.001``, ``dgc``, ``none seed=1``) and reports accuracy against
compression ratio::

    lgc-report multirun/2026-11-23/13-52-41 --out reports/sweep --json reports/sweep/rows.json

prints a markdown table and writes ``report.md`` and ``accuracy_vs_ratio.png`` to ``--out``.
Runs that differ only in ``seed`` (``lgc-train -m seed=0,1,2 compressor=topk``) are also reported
as one method each (:mod:`lgc.report.seeds`): mean ± 95 % Student-t interval, the gap to the dense
baseline paired by seed, and whether that gap is distinguishable from 0; never ranked by means;
and at equal bytes (:mod:`lgc.report.budgets`): for each whole-run bytes budget (``--budgets``), the
methods within it, the best of them and those its seeds cannot separate from the best.

In a notebook use :func:`load_runs`, :func:`report_table`, :func:`seed_table`, :func:`budget_table` and
:func:`plot_tradeoff`.

In the table, ``n/a`` is a ratio that ``summary.json`` holds as null (nothing was sent that way:
the payload ratio of PyTorch's own hooks, a run resumed after its last step) and ``-`` a value the
run does not have (the LGC column of a run without LGC, a summary written before a field existed).
"""

from lgc.report.budgets import budget_rows, budget_table
from lgc.report.cli import main
from lgc.report.plot import plot_tradeoff
from lgc.report.records import (
    DENSE_TARGETS,
    FEWER_BYTES_THAN_DGC,
    LGC_COMPRESSED_RATIO,
    SUMMARY_NAME,
    WIRE_MB_PER_WORKER,
    RunRecord,
    load_runs,
)
from lgc.report.seeds import group_by_seed, seed_rows, seed_table
from lgc.report.table import report_table, table_rows

__all__ = [
    "DENSE_TARGETS",
    "FEWER_BYTES_THAN_DGC",
    "LGC_COMPRESSED_RATIO",
    "SUMMARY_NAME",
    "WIRE_MB_PER_WORKER",
    "RunRecord",
    "budget_rows",
    "budget_table",
    "group_by_seed",
    "load_runs",
    "main",
    "plot_tradeoff",
    "report_table",
    "seed_rows",
    "seed_table",
    "table_rows",
]
