"""Run labels from what each run was asked for: its compressor, then the overrides that tell it apart.

``lgc-train`` records in every ``summary.json`` the option taken in each config group and the
overrides the run was given (``hydra``, :func:`lgc.train.hydra_record`). A run's label is

1. its compressor option (``topk``, ``lgc_rar``);
2. ``key=value`` of every compressor value it overrides, and of those another run of the same
   option overrides where the two differ (``topk density=0.001`` beside ``topk density=0.01``);
3. ``key=value`` of every other setting some run overrides whose value differs between the runs
   (``seed=1``, ``data=camvid``): a group by its option, a value as resolved in the run's config.

What a config sets by itself (DGC's ``optimizer.momentum``, the schedule's ``T_max`` following
``trainer.max_epochs``) is never an override, so it never labels a run; neither do settings that
do not change what is trained (paths, loggers, how workers start). Runs alike in all of this get
their folder appended. A summary without ``hydra`` (from :func:`lgc.train.train` on a config
composed without ``return_hydra_config``) is labelled by its compressor's class and every config
value that differs between the runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lgc.report.values import MISSING, flatten, format_value, lookup, varies

__all__ = ["BOOKKEEPING", "labels"]

#: Config keys that do not change what is trained (paths, logging, how workers start): never in a label.
BOOKKEEPING = (
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


def _is_bookkeeping(key: str) -> bool:
    return key.startswith("hydra") or any(key == skip or key.startswith(f"{skip}.") for skip in BOOKKEEPING)


def _override_key(override: str) -> str:
    """The setting an override names: ``++a.b=1`` and ``~a.b`` name ``a.b``, ``group@pkg=x`` names ``group``."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


@dataclass
class _Run:
    """What the labels need of one run."""

    #: The compressor option (or, without a record, its class name).
    compressor: str
    #: Config group -> option taken.
    choices: dict[str, Any]
    #: Config values by dotted key, bookkeeping left out, in the config's order.
    flat: dict[str, Any]
    #: The settings the run overrides (groups and dotted keys); None without a record: every key counts.
    overridden: set[str] | None
    #: Values inside a node the run sets whole (``compressor.training.autoencoder={chunk:32}``): they label
    #: the run where they differ from another run's, as a value only some runs override does.
    inside: set[str]

    def value(self, key: str) -> Any:
        """A group's option, or a config value; MISSING where the run has none."""
        if key in self.choices:
            return self.choices[key]
        return self.flat.get(key, MISSING)

    def overrides(self, key: str) -> bool:
        return self.overridden is None or key in self.overridden

    def position(self, key: str) -> int:
        """Where ``key`` (or the node of a group) first appears in the config, for a stable order."""
        for index, flat_key in enumerate(self.flat):
            if flat_key == key or flat_key.startswith(f"{key}."):
                return index
        return len(self.flat)


def _class_name(target: Any) -> str:
    return str(target).rsplit(".", 1)[-1]


def _describe(summary: dict[str, Any]) -> _Run:
    config = summary.get("config") or {}
    flat = {key: value for key, value in flatten(config).items() if not _is_bookkeeping(key)}
    record = summary.get("hydra")
    target = lookup(config, "compressor._target_")
    if record:
        choices = {str(group): option for group, option in (record.get("choices") or {}).items()}
        keys = {_override_key(str(override)) for override in record.get("overrides") or ()}
        overridden = {key for key in keys if not _is_bookkeeping(key)}
        # A group's option (compressor=topk) is one setting; a node set whole holds several values.
        inside = {f for key in overridden if key not in choices for f in flat if f.startswith(f"{key}.")}
        compressor = str(choices.get("compressor") or _class_name(target))
        return _Run(compressor, choices, flat, overridden, inside)
    if target is not MISSING:
        compressor = _class_name(target)
    else:
        # A summary without a config: the hook's own description, arguments left out.
        compressor = str(summary.get("compressor") or "unknown")
        while (shorter := re.sub(r"\([^()]*\)", "", compressor)) != compressor:
            compressor = shorter
    return _Run(compressor, {}, flat, None, set())


def _token(key: str, value: Any) -> str:
    return f"{key}={format_value(value)}"


def _compressor_parts(run: _Run, peers: list[_Run]) -> list[str]:
    """The compressor values ``run`` overrides, or that differ between it and peers of its option."""
    keys = {
        key
        for peer in peers
        for key in (peer.flat if peer.overridden is None else peer.overridden | peer.inside)
        if key.startswith("compressor.") and key != "compressor._target_"
    }
    parts = []
    for key in sorted(keys, key=run.position):
        value = run.value(key)
        if value is MISSING:
            continue
        shown = (run.overridden is not None and key in run.overridden) or varies(peer.value(key) for peer in peers)
        if shown:
            parts.append(_token(key.removeprefix("compressor."), value))
    return parts


def _other_parts(runs: list[_Run]) -> list[list[str]]:
    """Each run's ``key=value`` of the other overridden settings whose values differ between the runs."""
    keys: dict[str, None] = {}
    for run in runs:
        for key in run.flat if run.overridden is None else sorted(run.overridden | run.inside, key=run.position):
            if key != "compressor" and not key.startswith("compressor."):
                keys.setdefault(key)
    parts: list[list[str]] = [[] for _ in runs]
    if not runs:
        return parts
    for key in sorted(keys, key=runs[0].position):
        if not varies(run.value(key) for run in runs):
            continue
        for run, own in zip(runs, parts, strict=True):
            value = run.value(key)
            # A top-level setting left null (no experiment chosen, beside `experiment=X` runs) says nothing.
            if value is not MISSING and not (value is None and "." not in key):
                own.append(_token(key, value))
    return parts


def labels(summaries: list[dict[str, Any]], folders: list[Path]) -> tuple[list[str], list[str], list[str]]:
    """Each run's compressor option, its label (see the module docstring) and its compressor as run: the
    option with the compressor values of the label's second part (``lgc_rar_linear codec=autoencoder``),
    which a label by folder leaves out."""
    runs = [_describe(summary) for summary in summaries]
    others = _other_parts(runs)
    names = [run.compressor for run in runs]
    settings = [
        " ".join([run.compressor, *_compressor_parts(run, [p for p in runs if p.compressor == run.compressor])])
        for run in runs
    ]
    result = [" ".join([setting, *own]) for setting, own in zip(settings, others, strict=True)]
    # Runs alike in every setting (repeats): add the folder, relative to the folders' common parent.
    repeated = {label for label in result if result.count(label) > 1}
    if repeated:
        common = Path(os.path.commonpath([folder.resolve() for folder in folders]))
        for i, folder in enumerate(folders):
            if result[i] in repeated:
                result[i] = f"{result[i]} ({folder.resolve().relative_to(common).as_posix()})"
    return names, result, settings
