"""``lgc-report``: compare finished runs from their ``summary.json`` files, as a table and a plot.

Every run of ``lgc-train`` (and of :func:`lgc.train.train`) leaves a ``summary.json``
(:class:`lgc.lit.RunSummary`) with its final metrics, bytes, compression ratios and fully
resolved config. This module reads those of one or more run folders (a Hydra multirun folder
holds one run per subfolder ``0/``, ``1/``, ...), names every run by what sets it apart from the
others (``topk density=0.001``, ``dgc``, ``none seed=1``) and reports accuracy against
compression ratio::

    lgc-report multirun/2026-11-23/13-52-41 --out reports/sweep --json reports/sweep/rows.json

prints a markdown table and writes ``report.md`` and ``accuracy_vs_ratio.png`` to ``--out``.
In a notebook use :func:`load_runs`, :func:`report_table` and :func:`plot_tradeoff`.

In the table, ``n/a`` is a ratio that ``summary.json`` holds as null (nothing was sent that way:
the payload ratio of PyTorch's own hooks, a run resumed after its last step) and ``-`` a value the
run does not have (the LGC column of a run without LGC, a summary written before a field existed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DENSE_TARGETS",
    "FEWER_BYTES_THAN_DGC",
    "LGC_COMPRESSED_RATIO",
    "SUMMARY_NAME",
    "WIRE_MB_PER_WORKER",
    "RunRecord",
    "load_runs",
    "main",
    "plot_tradeoff",
    "report_table",
    "table_rows",
]

SUMMARY_NAME = "summary.json"
DENSE_TARGETS = ("lgc.compressors.NoneCompressor", "lgc.compressors.none.NoneCompressor")
# The compressed-stage ratio of an LGC run (lgc.lit.callbacks._stage_totals).
LGC_COMPRESSED_RATIO = "lgc_stages.compressed.compression_ratio"
# Wire bytes sent per worker over the whole run, in MB (RunRecord.wire_mb_per_worker).
WIRE_MB_PER_WORKER = "wire_mb_per_worker"
# Whole-run wire bytes of the DGC run with the same world size and density over the run's.
FEWER_BYTES_THAN_DGC = "fewer_bytes_than_dgc"

_CONF = Path(__file__).resolve().parent / "conf"
# Config keys that do not change what is trained (paths, logging, how workers start): never in a label.
_BOOKKEEPING = (
    "output_dir",
    "ckpt_path",
    "logger",
    "callbacks",
    "ddp.start_method",
    "ddp.oversubscribe",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
)


class _Missing:
    """A value the summary does not have (shown as ``-``), unlike a null one (``n/a``)."""

    def __repr__(self) -> str:
        return "MISSING"


_MISSING: Any = _Missing()


def _lookup(mapping: Any, dotted: str) -> Any:
    """``mapping["a"]["b"]`` for ``"a.b"`` (an exact key such as ``val/acc`` first); _MISSING if absent."""
    if isinstance(mapping, dict) and dotted in mapping:
        return mapping[dotted]
    for part in dotted.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return _MISSING
        mapping = mapping[part]
    return mapping


@dataclass(frozen=True)
class RunRecord:
    """One finished run: its ``summary.json`` and a label that tells it apart from the runs loaded with it."""

    # The run folder (the one holding summary.json).
    path: Path
    # The compressor's config group and what differs from the other runs, e.g. "topk density=0.001".
    label: str
    # The compressor's config group in lgc/conf/compressor (topk, dgc, lgc_ps, ...), or its class
    # name when no group builds it.
    compressor: str
    # summary.json as lgc.lit.RunSummary and lgc.train.train wrote it.
    summary: dict[str, Any] = field(repr=False, hash=False)

    @property
    def config(self) -> dict[str, Any]:
        """The run's fully resolved Hydra config (empty if the summary has none)."""
        return self.summary.get("config") or {}

    @property
    def is_dense(self) -> bool:
        """Whether the run is the uncompressed baseline (``compressor=none``)."""
        return _lookup(self.config, "compressor._target_") in DENSE_TARGETS

    @property
    def metric_key(self) -> str:
        """``val/mIoU`` for a segmentation run, else ``val/acc``."""
        return "val/mIoU" if "val/mIoU" in self.summary or "val/mIoU" in self.metrics else "val/acc"

    @property
    def metrics(self) -> dict[str, float]:
        """Every metric Lightning held at the end of training (``train/loss``, ``val/acc``, ...)."""
        return self.summary.get("metrics") or {}

    @property
    def metric(self) -> float | None:
        """The final ``val/acc`` (or ``val/mIoU``); None if the run has none."""
        value = self.summary.get(self.metric_key, self.metrics.get(self.metric_key))
        return None if value is None else float(value)

    @property
    def counts_wire_bytes(self) -> bool:
        """Whether the summary has wire bytes (``wire_*``); older ones hold logical ratios only."""
        return "wire_bytes_sent" in self.summary

    @property
    def wire_mb_per_worker(self) -> float | None:
        """Wire bytes sent per worker over the whole run, in MB (None for an older summary)."""
        if not self.counts_wire_bytes:
            return None
        per_worker = self.summary.get("wire_bytes_sent_per_worker") or [self.summary["wire_bytes_sent"]]
        return sum(per_worker) / len(per_worker) / 1e6

    def value(self, key: str) -> Any:
        """A summary field by dotted key (``"compression_ratio"``, ``"lgc_stages.compressed.bytes_sent"``).

        Returns None both for a null field and for one the summary does not have. A summary written
        before wire bytes were counted has no wire ratios: its ``compression_ratio`` (and LGC's
        stage ratios) were logical, so they answer ``logical_compression_ratio`` and the wire keys None.
        """
        value = self._value(key)
        return None if value is _MISSING else value

    def _value(self, key: str) -> Any:
        if key == WIRE_MB_PER_WORKER:
            return _MISSING if not self.counts_wire_bytes else self.wire_mb_per_worker
        if not self.counts_wire_bytes:
            if key == "logical_compression_ratio":
                return _lookup(self.summary, "compression_ratio")
            if key.split(".")[-1] == "compression_ratio":
                return _MISSING
        return _lookup(self.summary, key)


# -- finding and reading summaries ----------------------------------------------------------------


def _natural_key(path: Path) -> list[tuple[int, int, str]]:
    # Hydra numbers multirun jobs 0, 1, ..., 10: sort 2 before 10.
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", str(path)) if part]


def _summary_files(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file():
        if path.name != SUMMARY_NAME:
            raise ValueError(f"{path} is not a {SUMMARY_NAME} (give a run folder or its {SUMMARY_NAME})")
        return [path]
    found = sorted(path.rglob(SUMMARY_NAME), key=lambda file: _natural_key(file.relative_to(path)))
    if not found:
        raise FileNotFoundError(
            f"no {SUMMARY_NAME} in {path} or its subfolders: not an lgc-train run folder, "
            "or its runs have not finished (the summary is written at the end of training)"
        )
    return found


def _read_summary(file: Path) -> dict[str, Any]:
    try:
        summary = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(summary, dict):
        raise ValueError(f"{file} holds a {type(summary).__name__}, not a run summary")
    return summary


def load_runs(paths: Iterable[str | os.PathLike[str]]) -> list[RunRecord]:
    """Every run under ``paths``, labelled by what sets it apart from the others.

    Args:
        paths: run folders, folders of runs (searched recursively, e.g. a Hydra multirun folder
            with ``0/``, ``1/``, ... subfolders) or ``summary.json`` files.

    Returns:
        One record per ``summary.json``, in the order of ``paths`` and, within a folder, in
        natural order of the subfolders (``2/`` before ``10/``); a file reached twice counts once.

    Raises:
        FileNotFoundError: a path does not exist, or a folder holds no ``summary.json`` at all.
        ValueError: a file given is not named ``summary.json``, or one is not a JSON object.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        for file in _summary_files(Path(path)):
            if file.resolve() not in seen:
                seen.add(file.resolve())
                files.append(file)
    summaries = [_read_summary(file) for file in files]
    folders = [file.parent for file in files]
    names, labels = _labels(summaries, folders)
    return [
        RunRecord(path=folder, label=label, compressor=name, summary=summary)
        for folder, label, name, summary in zip(folders, labels, names, summaries, strict=True)
    ]


# -- labels ---------------------------------------------------------------------------------------
#
# A label is the compressor's config group (found by matching compressor._target_ against
# lgc/conf/compressor/*.yaml), then the compressor values that differ from that group's yaml or
# between runs of that group, then every other config value that differs between the runs. What a
# config sets by itself is left out: what a group sets outside its own node (compressor=dgc turns
# the optimizer's momentum off), values a yaml interpolates from others (the cosine schedule's
# T_max is trainer.max_epochs) and, when the model (data, ...) class differs between runs, that
# class's own settings.


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested dict by dotted key (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _is_bookkeeping(key: str) -> bool:
    return any(key == skip or key.startswith(f"{skip}.") for skip in _BOOKKEEPING)


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _norm(value: Any) -> str:
    # Comparable and hashable; True and 1 stay apart, 1 and 1.0 do not.
    if value is _MISSING:
        return "<missing>"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(float(value))
    return json.dumps(value, sort_keys=True, default=str)


def _varies(values: Iterable[Any]) -> bool:
    return len({_norm(value) for value in values}) > 1


def _format_value(value: Any) -> str:
    # As one would type it in a Hydra override.
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, list):
        return "[" + ",".join(_format_value(item) for item in value) + "]"
    return str(value)


def _class_name(target: Any) -> str:
    return str(target).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class _Group:
    """One yaml of a config group (``conf/compressor/topk.yaml``), its values unresolved."""

    name: str
    # Its node's values by dotted key (interpolations are still strings).
    values: dict[str, Any]
    # What it sets outside its node, by dotted key from the root (a `# @package _global_` yaml).
    implied: dict[str, Any]


@cache
def _groups(node: str) -> tuple[_Group, ...]:
    """The yaml files of config group ``node`` (``compressor``, ``scheduler``, ...), by name."""
    from omegaconf import OmegaConf

    groups = []
    for file in sorted((_CONF / node).glob("*.yaml")) if node.isidentifier() else ():
        text = file.read_text()
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
        if not isinstance(data, dict):
            continue
        data.pop("defaults", None)
        if re.search(r"^#\s*@package\s+_global_\s*$", text, flags=re.MULTILINE):
            values, implied = _flatten(data.pop(node, {}), ""), _flatten(data)
        else:
            values, implied = _flatten(data), {}
        groups.append(_Group(file.stem, values, implied))
    return tuple(groups)


@cache
def _train_interpolations() -> dict[str, str]:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(_CONF / "train.yaml"), resolve=False)
    return {key: value for key, value in _flatten(data).items() if _is_interpolation(value)}


def _match_group(node: str, values: dict[str, Any]) -> _Group | None:
    """The yaml of group ``node`` that these resolved values came from: same ``_target_``, fewest differences."""
    candidates = [group for group in _groups(node) if group.values.get("_target_") == values.get("_target_")]

    def differences(group: _Group) -> int:
        return sum(
            _norm(values.get(key, _MISSING)) != _norm(value)
            for key, value in group.values.items()
            if not _is_interpolation(value)
        )

    return min(candidates, key=differences, default=None)  # ties: the first by name


def _resolver(config: dict[str, Any]) -> Any:
    """A function resolving an interpolation string (``${trainer.max_epochs}``) against ``config``."""
    from omegaconf import OmegaConf

    context = OmegaConf.create(config)

    def resolve(value: Any) -> Any:
        if not _is_interpolation(value):
            return value
        try:
            context["_lgc_report_probe"] = value
            resolved = context._lgc_report_probe
        except Exception:  # an unknown resolver (hydra:...), a missing key: nothing to compare with
            return _MISSING
        return OmegaConf.to_container(resolved) if OmegaConf.is_config(resolved) else resolved

    return resolve


@dataclass
class _Run:
    """What the labels need of one run."""

    # Config values by dotted key, bookkeeping left out.
    flat: dict[str, Any]
    # The compressor's group name, and its yaml's values resolved for this run (None: no yaml built it).
    compressor: str
    compressor_defaults: dict[str, Any] | None
    # Values this run's own config implies (interpolations, what a group sets outside its node), resolved.
    implied: dict[str, Any]

    def is_implied(self, key: str) -> bool:
        value = self.implied.get(key, _MISSING)
        return value is not _MISSING and _norm(value) == _norm(self.flat.get(key, _MISSING))


def _describe_run(summary: dict[str, Any]) -> _Run:
    config = summary.get("config") or {}
    resolve = _resolver(config)
    implied = {key: resolve(value) for key, value in _train_interpolations().items()}
    compressor, compressor_defaults = None, None
    for node, values in config.items():
        if not (isinstance(values, dict) and "_target_" in values):
            continue
        group = _match_group(node, _flatten(values))
        if node == "compressor":
            compressor = group.name if group is not None else _class_name(values["_target_"])
            if group is not None:
                compressor_defaults = {key: resolve(value) for key, value in group.values.items()}
        if group is not None:
            implied.update({f"{node}.{k}": resolve(v) for k, v in group.values.items() if _is_interpolation(v)})
            implied.update({key: resolve(value) for key, value in group.implied.items()})
    if compressor is None:
        # A summary without a config: the hook's own description, arguments left out.
        compressor = str(summary.get("compressor") or "unknown")
        while (shorter := re.sub(r"\([^()]*\)", "", compressor)) != compressor:
            compressor = shorter
    flat = {key: value for key, value in _flatten(config).items() if not _is_bookkeeping(key)}
    return _Run(flat, compressor, compressor_defaults, implied)


def _compressor_parts(run: _Run, peers: list[_Run]) -> list[str]:
    """``key=value`` of the compressor values that differ from its yaml or between runs of the same group."""
    parts = []
    for dotted, value in run.flat.items():
        # The yaml interpolates some from elsewhere (dgc's world_size is trainer.devices): shown there.
        if not dotted.startswith("compressor.") or dotted == "compressor._target_" or run.is_implied(dotted):
            continue
        key = dotted.removeprefix("compressor.")
        defaults = run.compressor_defaults
        differs = defaults is not None and (
            key not in defaults or (defaults[key] is not _MISSING and _norm(defaults[key]) != _norm(value))
        )
        if differs or _varies(peer.flat.get(dotted, _MISSING) for peer in peers):
            parts.append(f"{key}={_format_value(value)}")
    return parts


def _other_parts(runs: list[_Run]) -> list[list[str]]:
    """Each run's ``key=value`` of the other config values that differ between the runs."""
    keys = list(dict.fromkeys(key for run in runs for key in run.flat if not key.startswith("compressor.")))
    # Nodes whose class differs between runs (model=..., data=...).
    varying_classes = {
        key.split(".")[0]
        for key in keys
        if key.count(".") == 1 and key.endswith("._target_") and _varies(run.flat.get(key, _MISSING) for run in runs)
    }
    parts: list[list[str]] = [[] for _ in runs]
    for key in keys:
        node = key.split(".")[0]
        if node in varying_classes:
            target = f"{node}._target_"
            for run, own in zip(runs, parts, strict=True):
                if key == target:
                    own.append(f"{node}={_class_name(run.flat.get(key, 'none'))}")
                    continue
                # A setting of the model (data, ...) class: only where it differs between runs of that class.
                peers = [peer for peer in runs if _norm(peer.flat.get(target)) == _norm(run.flat.get(target))]
                if key in run.flat and _varies(peer.flat.get(key, _MISSING) for peer in peers):
                    own.append(f"{key}={_format_value(run.flat[key])}")
            continue
        # A run whose own config implies the value (dgc's optimizer.momentum) neither counts nor shows it.
        free = [i for i, run in enumerate(runs) if not run.is_implied(key)]
        if _varies(runs[i].flat.get(key, _MISSING) for i in free):
            for i in free:
                if key in runs[i].flat:
                    parts[i].append(f"{key}={_format_value(runs[i].flat[key])}")
    return parts


def _labels(summaries: list[dict[str, Any]], folders: list[Path]) -> tuple[list[str], list[str]]:
    """Each run's compressor group name and its label."""
    runs = [_describe_run(summary) for summary in summaries]
    others = _other_parts(runs)
    labels = [
        " ".join(
            [run.compressor, *_compressor_parts(run, [peer for peer in runs if peer.compressor == run.compressor])]
            + own
        )
        for run, own in zip(runs, others, strict=True)
    ]
    # Runs alike in every setting (repeats): add the folder, relative to the folders' common parent.
    repeated = {label for label in labels if labels.count(label) > 1}
    if repeated:
        common = Path(os.path.commonpath([folder.resolve() for folder in folders]))
        for i, folder in enumerate(folders):
            if labels[i] in repeated:
                labels[i] = f"{labels[i]} ({folder.resolve().relative_to(common).as_posix()})"
    return [run.compressor for run in runs], labels


# -- the table ------------------------------------------------------------------------------------


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
    columns.append(_Column("wall_time_s", "wall time (s)", ".1f"))
    return columns


def _density(record: RunRecord) -> Any:
    return _lookup(record.config, "compressor.density")


def _dgc_reference(record: RunRecord, records: Sequence[RunRecord]) -> RunRecord | None:
    """The DGC run with the same world size and density as ``record`` (the ablation's yardstick), if loaded."""
    for other in records:
        if (
            other.compressor == "dgc"
            and other.summary.get("world_size") == record.summary.get("world_size")
            and _density(other) is not _MISSING
            and _density(other) == _density(record)
            and other.counts_wire_bytes
        ):
            return other
    return None


def _cell_value(record: RunRecord, key: str, records: Sequence[RunRecord] = ()) -> Any:
    if key == "label":
        return record.label
    if key == "compressor":
        return record.compressor
    if key == FEWER_BYTES_THAN_DGC:
        reference = _dgc_reference(record, records)
        own, theirs = record.wire_mb_per_worker, None if reference is None else reference.wire_mb_per_worker
        return _MISSING if own is None or theirs is None or own == 0 else theirs / own
    return record._value(key)


def table_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """The rows of :func:`report_table` as plain values (null and missing values are None), plus each run's path."""
    columns = _columns(records)
    rows = []
    for record in records:
        row = {column.key: _cell_value(record, column.key, records) for column in columns}
        rows.append(
            {key: None if value is _MISSING else value for key, value in row.items()} | {"path": str(record.path)}
        )
    return rows


def _format_cell(value: Any, column: _Column) -> str:
    if value is _MISSING:
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
    the relative error of the sums delivered at the leader's positions (runs with
    ``measure_error``) and wall time.
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


# -- the plot -------------------------------------------------------------------------------------

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


# -- the command ----------------------------------------------------------------------------------


def _report_markdown(records: Sequence[RunRecord], plot_name: str) -> str:
    sources = "\n".join(f"- `{record.path}`" for record in records)
    return (
        f"# Accuracy against compression ratio\n\n{report_table(records)}\n\n"
        "`n/a`: null in summary.json (nothing was sent that way); `-`: the run does not have this value.\n\n"
        f"![accuracy against compression ratio]({plot_name})\n\nRuns:\n\n{sources}\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lgc-report",
        description="Compare lgc-train runs from their summary.json files: a markdown table on stdout and, "
        "with --out, report.md and accuracy_vs_ratio.png.",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="run folders or folders of runs (a Hydra multirun folder), searched recursively for summary.json",
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="write report.md and accuracy_vs_ratio.png here")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the table rows as JSON to this file")
    args = parser.parse_args(argv)
    try:
        records = load_runs(args.runs)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    print(report_table(records))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        plot_path = args.out / "accuracy_vs_ratio.png"
        plot_tradeoff(records).savefig(plot_path, dpi=120)
        (args.out / "report.md").write_text(_report_markdown(records, plot_path.name))
        print(f"-> {args.out / 'report.md'}, {plot_path}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(table_rows(records), indent=2) + "\n")
        print(f"-> {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
