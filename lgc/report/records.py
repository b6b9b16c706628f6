"""Finding and reading ``summary.json`` files: one :class:`RunRecord` per run, labelled."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lgc.report.labels import labels
from lgc.report.values import MISSING, lookup

__all__ = [
    "DENSE_TARGETS",
    "FEWER_BYTES_THAN_DGC",
    "LGC_COMPRESSED_RATIO",
    "SUMMARY_NAME",
    "WIRE_MB_PER_WORKER",
    "RunRecord",
    "load_runs",
]

SUMMARY_NAME = "summary.json"
DENSE_TARGETS = ("lgc.compressors.NoneCompressor", "lgc.compressors.none.NoneCompressor")
# The compressed-stage ratio of an LGC run (lgc.lit.callbacks._stage_totals).
LGC_COMPRESSED_RATIO = "lgc_stages.compressed.compression_ratio"
# Wire bytes sent per worker over the whole run, in MB (RunRecord.wire_mb_per_worker).
WIRE_MB_PER_WORKER = "wire_mb_per_worker"
# Whole-run wire bytes of the DGC run with the same world size and density over the run's.
FEWER_BYTES_THAN_DGC = "fewer_bytes_than_dgc"


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
    # The compressor as run, for the table when the label is the folder: its option and the compressor
    # values overridden or differing between runs of that option ("lgc_rar_linear
    # training.codec=autoencoder"); None: the option alone (a label by settings starts with this).
    compressor_settings: str | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The run's fully resolved Hydra config (empty if the summary has none)."""
        return self.summary.get("config") or {}

    @property
    def is_dense(self) -> bool:
        """Whether the run is the uncompressed baseline: ``compressor=none`` communicating every step
        (DiLoCo is ``compressor=none`` too, with ``comm.delay`` local steps between exchanges)."""
        delay = lookup(self.config, "comm.delay")
        every_step = delay is MISSING or delay is None or delay == 0
        return lookup(self.config, "compressor._target_") in DENSE_TARGETS and every_step

    @property
    def metric_key(self) -> str:
        """``val/mIoU`` for a segmentation run, else ``val/acc``."""
        return "val/mIoU" if "val/mIoU" in self.summary or "val/mIoU" in self.metrics else "val/acc"

    @property
    def metrics(self) -> dict[str, float]:
        """Every metric Lightning held at the end of training (``train/loss``, ``val/acc``, ...)."""
        return self.summary.get("metrics") or {}

    @property
    def metric_is_final(self) -> bool:
        """Whether the metrics are the final model's (``validated_step`` is ``steps``; a summary without
        ``validated_step``, written before it was recorded, is taken as final)."""
        return self.summary.get("validated_step", self.summary.get("steps")) == self.summary.get("steps")

    @property
    def metric(self) -> float | None:
        """The final model's ``val/acc`` (or ``val/mIoU``); None if the run has none, or only an earlier model's."""
        value = self.summary.get(self.metric_key, self.metrics.get(self.metric_key))
        return None if value is None or not self.metric_is_final else float(value)

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
        return None if value is MISSING else value

    def _value(self, key: str) -> Any:
        if key == WIRE_MB_PER_WORKER:
            return MISSING if not self.counts_wire_bytes else self.wire_mb_per_worker
        if not self.counts_wire_bytes:
            if key == "logical_compression_ratio":
                return lookup(self.summary, "compression_ratio")
            if key.split(".")[-1] == "compression_ratio":
                return MISSING
        return lookup(self.summary, key)


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


#: How :func:`load_runs` labels runs.
LABEL_BY = ("settings", "folder")
#: A folder named for a seed (``seed2``): a folder label shows it as ``seed=2``, the token seed groups drop.
_SEED_FOLDER = re.compile(r"seed(\d+)")


def _folder_label(folder: Path, root: Path) -> str:
    """``folder`` relative to ``root`` (its own name if it is the root), a last ``seedN`` as ``seed=N``.

    A seed folder with nothing above it under ``root`` is named for the folder holding it
    (``lgc-report sweep/topk --label folder`` and ``lgc-report sweep/topk/seed0 --label folder``
    both name the run ``topk seed=0``).
    """
    folder, root = folder.resolve(), root.resolve()
    parts = list(folder.relative_to(root).parts) or [folder.name]
    seed = _SEED_FOLDER.fullmatch(parts[-1])
    if seed is None:
        return "/".join(parts)
    method = "/".join(parts[:-1]) or folder.parent.name
    return f"{method} seed={seed.group(1)}"


def load_runs(paths: Iterable[str | os.PathLike[str]], label_by: str = "settings") -> list[RunRecord]:
    """Every run under ``paths``, labelled by what sets it apart from the others.

    Args:
        paths: run folders, folders of runs (searched recursively, e.g. a Hydra multirun folder
            with ``0/``, ``1/``, ... subfolders) or ``summary.json`` files.
        label_by: ``"settings"``: by the compressor and the overrides that tell the runs apart
            (:mod:`lgc.report.labels`); ``"folder"``: by each run's folder relative to the path it
            was found under, a last folder ``seedN`` read as ``seed=N`` (a sweep that files its runs
            as ``METHOD/seedN`` gets one row per method over its seeds).

    Returns:
        One record per ``summary.json``, in the order of ``paths`` and, within a folder, in
        natural order of the subfolders (``2/`` before ``10/``); a file reached twice counts once.

    Raises:
        FileNotFoundError: a path does not exist, or a folder holds no ``summary.json`` at all.
        ValueError: a file given is not named ``summary.json``, or one is not a JSON object.
    """
    if label_by not in LABEL_BY:
        raise ValueError(f"label_by={label_by!r}: expected one of {', '.join(LABEL_BY)}")
    files: list[Path] = []
    roots: list[Path] = []
    seen: set[Path] = set()
    for path in map(Path, paths):
        root = path if path.is_dir() else path.parent  # a summary.json given: its run folder
        for file in _summary_files(path):
            if file.resolve() not in seen:
                seen.add(file.resolve())
                files.append(file)
                roots.append(root)
    summaries = [_read_summary(file) for file in files]
    folders = [file.parent for file in files]
    names, run_labels, settings = labels(summaries, folders)
    if label_by == "folder":
        run_labels = [_folder_label(folder, root) for folder, root in zip(folders, roots, strict=True)]
    else:  # the label starts with the compressor as run already
        settings = [None] * len(settings)
    return [
        RunRecord(path=folder, label=label, compressor=name, summary=summary, compressor_settings=setting)
        for folder, label, name, summary, setting in zip(folders, run_labels, names, summaries, settings, strict=True)
    ]
