"""The report's table: one row per run, as markdown and as plain JSON rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lgc.report.records import FEWER_BYTES_THAN_DGC, LGC_COMPRESSED_RATIO, WIRE_MB_PER_WORKER, RunRecord
from lgc.report.values import MISSING, lookup

__all__ = ["report_table", "table_rows"]


@dataclass(frozen=True)
class _Column:
    key: str  # in table_rows and the JSON rows
    header: str
    fmt: str  # format spec of a number
    numeric: bool = True


def _columns(records: Sequence[RunRecord]) -> list[_Column]:
    columns = [
        _Column("label", "run", "", numeric=False),
        _Column("compressor", "compressor", "", numeric=False),
        _Column("world_size", "world size", "d"),
        _Column("steps", "steps", "d"),
    ]
    columns += [_Column(key, key, ".4f") for key in dict.fromkeys(record.metric_key for record in records)]
    columns.append(_Column(WIRE_MB_PER_WORKER, "wire MB/worker", ".3g"))
    columns.append(_Column("compression_ratio", "compression ratio (wire)", ".2f"))
    columns.append(_Column("logical_compression_ratio", "logical ratio", ".2f"))
    if any("upstream_compression_ratio" in record.summary for record in records):
        columns.append(_Column("upstream_compression_ratio", "upstream ratio", ".2f"))
    columns.append(_Column("payload_compression_ratio", "payload ratio", ".2f"))
    if any("lgc_stages" in record.summary for record in records):
        columns.append(_Column(LGC_COMPRESSED_RATIO, "LGC compressed-stage ratio", ".2f"))
    if any(_dgc_reference(record, records) is not None for record in records):
        columns.append(_Column(FEWER_BYTES_THAN_DGC, "x fewer bytes than DGC", ".2f"))
    if any("lgc_true_error" in record.summary for record in records):
        columns.append(_Column("lgc_true_error", "error at leader positions", ".3g"))
    if any("lgc_premise" in record.summary for record in records):
        columns.append(_Column("lgc_premise.correlation", "premise r", ".3f"))
        columns.append(_Column("lgc_premise.energy_share", "premise energy share", ".3g"))
    if any(_refreshing(record) for record in records):
        columns.append(_Column("lgc_refreshes", "codec refreshes", "d"))
    columns.append(_Column("wall_time_s", "wall time (s)", ".1f"))
    return columns


def _refreshing(record: RunRecord) -> bool:
    """Whether the run could refresh its codec (a refresh threshold set) or did."""
    threshold = lookup(record.config, "compressor.stages.refresh_threshold")
    return bool(record.summary.get("lgc_refreshes")) or threshold not in (MISSING, None)


def _density(record: RunRecord) -> Any:
    return lookup(record.config, "compressor.density")


def _dgc_reference(record: RunRecord, records: Sequence[RunRecord]) -> RunRecord | None:
    """The DGC run with the same world size and density as ``record`` (the ablation's yardstick), if loaded."""
    for other in records:
        if (
            other.compressor == "dgc"
            and other.summary.get("world_size") == record.summary.get("world_size")
            and _density(other) is not MISSING
            and _density(other) == _density(record)
            and other.counts_wire_bytes
        ):
            return other
    return None


def _cell_value(record: RunRecord, key: str, records: Sequence[RunRecord] = ()) -> Any:
    if key == "label":
        return record.label
    if key == "compressor":
        return record.compressor_settings or record.compressor
    if key == FEWER_BYTES_THAN_DGC:
        reference = _dgc_reference(record, records)
        own, theirs = record.wire_mb_per_worker, None if reference is None else reference.wire_mb_per_worker
        return MISSING if own is None or theirs is None or own == 0 else theirs / own
    return record._value(key)


def table_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """The rows of :func:`report_table` as plain values (null and missing values are None), plus each run's path."""
    columns = _columns(records)
    rows = []
    for record in records:
        row = {column.key: _cell_value(record, column.key, records) for column in columns}
        rows.append(
            {key: None if value is MISSING else value for key, value in row.items()} | {"path": str(record.path)}
        )
    return rows


def _format_cell(value: Any, column: _Column) -> str:
    if value is MISSING:
        return "-"
    if value is None:
        return "n/a"
    if column.numeric and isinstance(value, (int, float)) and not isinstance(value, bool):
        if column.fmt == "d" and float(value).is_integer():
            return str(int(value))
        return format(float(value), column.fmt.replace("d", "g"))
    return str(value).replace("|", "\\|")


def report_table(records: Sequence[RunRecord]) -> str:
    """A markdown table with one row per run (columns padded so it reads in a terminal too).

    Columns: the run's label, its compressor group, world size, steps, ``val/acc`` (``val/mIoU``
    for segmentation runs; both columns when the runs mix the two), wire MB sent per worker,
    ``compression_ratio`` (a dense ring allreduce's wire bytes over the run's; ``-`` for a summary
    written before wire bytes were counted), ``logical_compression_ratio``,
    ``upstream_compression_ratio`` (when the summaries have it: without what LGC-PS's parameter
    server sends), ``payload_compression_ratio`` (the compressor's own ratio on the tensors it
    compresses), LGC's compressed-stage ratio (when a run has ``lgc_stages``), how many times fewer
    whole-run wire bytes than the DGC run of the same world size and density (when one is loaded),
    the relative error of the sums delivered at the leader's positions and LGC's premise there (runs
    with ``measure_error``), the codec refreshes (runs with a refresh threshold) and wall time.
    A null ratio reads ``n/a``, a value the run does not have ``-``.
    """
    columns = _columns(records)
    cells = [
        [_format_cell(_cell_value(record, column.key, records), column) for column in columns] for record in records
    ]
    widths = [max([len(column.header), 3, *(len(row[c]) for row in cells)]) for c, column in enumerate(columns)]

    def line(values: list[str]) -> str:
        padded = [
            value.rjust(width) if column.numeric else value.ljust(width)
            for value, width, column in zip(values, widths, columns, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    dashes = ["-" * (w + 1) + ":" if c.numeric else "-" * (w + 2) for w, c in zip(widths, columns, strict=True)]
    rule = "|" + "|".join(dashes) + "|"
    return "\n".join([line([column.header for column in columns]), rule, *(line(row) for row in cells)])
