"""Where a method's whole-run bytes go: module buffers, parameters sent dense, LGC's warm-up.

A codec acts only on the parameters it compresses. On a small network much of a per-step method's
traffic goes where no codec reaches: parameters with fewer elements than the method's ``min_numel``
(1,024 by default: BatchNorm's weights and biases, a first convolution, a classifier's bias) are
allreduced dense every step, rank 0's module buffers (BatchNorm's running statistics) are
broadcast every step (:mod:`lgc.ddp.buffers`), and LGC's warm-up steps are dense. Methods with
local steps pay the last two only at their exchanges. This table shows, per method (the mean over
its seeds):

* the whole run's wire MB per worker (as the seed table);
* the module buffers' wire MB per worker (``wire_buffer_bytes_sent`` over the workers);
* how many parameter elements travelled dense, and their share of the bytes booked per parameter
  (``summary.json``'s ``layers``: rank 0's per-parameter bytes, logical);
* LGC's warm-up stage in wire MB per worker (``lgc_stages.warmup``);
* the fixed overhead: the module buffers and the parameters sent dense, these at a ring
  allreduce's wire cost (``2 (P - 1) / P`` per byte booked), in wire MB per worker; the codec's
  share is the rest of the wire (what the method sends for the parameters it compresses: values,
  positions, codes, sizes and agreement flags);
* the ceiling: dense's wire bytes over that overhead, the ratio no codec can pass on that model
  whatever it does with the parameters it compresses.

``-``: the runs do not book it (PyTorch's own hooks keep no per-parameter table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lgc.report.records import WIRE_MB_PER_WORKER, RunRecord
from lgc.report.seeds import group_by_seed
from lgc.report.values import markdown_table

__all__ = ["byte_rows", "bytes_table", "run_bytes"]


def run_bytes(record: RunRecord) -> dict[str, float | None]:
    """One run's byte breakdown (None where its summary does not book that part)."""
    summary = record.summary
    world = summary.get("world_size") or len(summary.get("workers") or []) or None
    buffers = summary.get("wire_buffer_bytes_sent")
    warmup = record.value("lgc_stages.warmup.wire_bytes_sent")
    layers = summary.get("layers") or []
    dense = sum(layer["bytes_sent"] for layer in layers if not layer["compressed"])
    total = dense + sum(layer["bytes_sent"] for layer in layers if layer["compressed"])
    # Only a run that books its parameters (lgc's hook) says which went dense: PyTorch's own hooks
    # (PowerSGD allreduces some tensors uncompressed) book none, and get no overhead or ceiling.
    overhead = None
    if world and layers:
        overhead = (buffers or 0) / world + dense * 2 * (world - 1) / world
    wire = summary.get("wire_bytes_sent")
    dense_wire = summary.get("wire_dense_equivalent_bytes")
    return {
        WIRE_MB_PER_WORKER: record.value(WIRE_MB_PER_WORKER),
        "buffers_wire_mb_per_worker": None if buffers is None or not world else buffers / world / 1e6,
        "dense_parameter_elements": float(sum(layer["numel"] for layer in layers if not layer["compressed"]))
        if layers
        else None,
        "dense_parameter_share": dense / total if total else None,
        "warmup_wire_mb_per_worker": None if warmup is None or not world else warmup / world / 1e6,
        "overhead_wire_mb_per_worker": None if overhead is None else overhead / 1e6,
        "codec_wire_mb_per_worker": None
        if overhead is None or wire is None or not layers
        else (wire / world - overhead) / 1e6,
        "ceiling": None if not overhead or dense_wire is None else dense_wire / world / overhead,
    }


def _mean(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None


def byte_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per seed group: the label and the mean of every part over its runs."""
    rows = []
    for group in group_by_seed(records):
        parts = [run_bytes(record) for record in group.records]
        rows.append({"label": group.label, **{key: _mean([p[key] for p in parts]) for key in parts[0]}})
    return rows


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def bytes_table(records: Sequence[RunRecord]) -> str:
    """:func:`byte_rows` as a markdown table."""
    header = [
        "method",
        "wire MB/worker",
        "module buffers (wire MB/worker)",
        "parameter elements sent dense",
        "their share of parameter bytes",
        "LGC warm-up (wire MB/worker)",
        "codec (wire MB/worker)",
        "fixed overhead (wire MB/worker)",
        "ceiling (x fewer bytes than dense at most)",
    ]
    rows = []
    for row in byte_rows(records):
        share = row["dense_parameter_share"]
        cells = [
            row["label"],
            _cell(row[WIRE_MB_PER_WORKER], ".3g"),
            _cell(row["buffers_wire_mb_per_worker"], ".3g"),
            _cell(row["dense_parameter_elements"], ",.0f"),
            "-" if share is None else f"{100 * share:.0f} %",
            _cell(row["warmup_wire_mb_per_worker"], ".3g"),
            _cell(row["codec_wire_mb_per_worker"], ".3g"),
            _cell(row["overhead_wire_mb_per_worker"], ".3g"),
            _cell(row["ceiling"], ".0f"),
        ]
        rows.append(cells)
    return markdown_table(header, rows)
