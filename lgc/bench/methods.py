"""What every benchmark shares about methods: the default lists, short-run knobs, parsing, optimizer, colours.

The bottom of :mod:`lgc.bench`: it imports no other benchmark module, and each of them
(:mod:`~lgc.bench.step`, :mod:`~lgc.bench.network`, :mod:`~lgc.bench.network_worker`,
:mod:`~lgc.bench.model`, :mod:`~lgc.bench.profile`) takes its method handling from here.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
import yaml
from torch import nn

__all__ = [
    "DEFAULT_METHODS",
    "NO_COMM",
    "OPTIMIZER_KNOBS",
    "SHORT_RUN_KNOBS",
    "MethodSpec",
    "method_color",
    "parse_list",
    "parse_methods",
    "parse_overrides",
    "profile_knobs",
    "sgd_for",
    "short_run_knobs",
]

#: The methods ``lgc-bench network`` and ``step`` run by default: dense, the 16-bit baseline,
#: PowerSGD, lgc's baselines, LGC.
DEFAULT_METHODS = (
    "none",
    "torch_fp16",
    "powersgd",
    "topk",
    "dgc",
    "sbc",
    "redsync",
    "random_block",
    "qsgd",
    "lgc_rar",
    "lgc_ps",
)


def short_run_knobs(density: float, warmup_steps: int, ae_steps: int) -> dict[str, dict[str, Any]]:
    """Knobs that fit each sparsifier and LGC to a short run (the yamls' are for full trainings).

    Top-k, DGC, RedSync, random-block and LGC at ``density`` (LGC-PS's innovation 10x sparser),
    LGC's stages shortened to ``warmup_steps`` and ``ae_steps``.
    """
    sparse = {"density": density}
    stages = {"warmup_steps": warmup_steps, "ae_steps": ae_steps}
    return {
        **{method: dict(sparse) for method in ("topk", "dgc", "redsync", "random_block")},
        "lgc_rar": {**sparse, "stages": dict(stages)},
        "lgc_ps": {**sparse, "innovation_density": density / 10, "stages": dict(stages)},
    }


#: Knobs that make each method fit a run of a few hundred steps.
SHORT_RUN_KNOBS = short_run_knobs(0.01, warmup_steps=20, ae_steps=40)


def profile_knobs(density: float = 0.001) -> dict[str, dict[str, Any]]:
    """Knobs that reach each method's steady state within a profile's few steps, sparsifiers at ``density``."""
    knobs = short_run_knobs(density, warmup_steps=1, ae_steps=2)
    return {**knobs, "sbc": {"density": density}, "powersgd": {"start_powerSGD_iter": 2}}


def parse_list(text: str, what: str) -> list[str]:
    """The comma-separated items of the option ``--what``; refuses a list that names nothing."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--{what} names nothing: {text!r}")
    return items


#: Knobs of a ``--methods`` entry that configure the worker's optimizer rather than ``lgc.compress``.
OPTIMIZER_KNOBS = ("lr", "momentum")


#: The no-communication step's name in ``lgc-bench step`` (a method may not take it).
NO_COMM = "no_sync"


def parse_overrides(text: str) -> dict[str, Any]:
    """``"a.b=1;c=[1,2]"`` -> ``{"a": {"b": 1}, "c": [1, 2]}`` (values parsed as YAML)."""
    knobs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"a knob must read key=value, got {item!r}")
        *parents, leaf = key.strip().split(".")
        target = knobs
        for name in parents:
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                raise ValueError(f"knob {key!r} sets a field of {name!r}, which already has a value")
        target[leaf] = yaml.safe_load(value)
    return knobs


class MethodSpec(NamedTuple):
    """One ``--methods`` entry."""

    #: The entry as written (the table's row name).
    label: str
    #: The ``lgc.compress`` method.
    name: str
    #: Knobs over the benchmark's own (:func:`profile_knobs`).
    knobs: dict[str, Any]

    @property
    def delay(self) -> int:
        """Steps between the method's exchanges (its ``delay`` knob; 1: it sends every step)."""
        return int(self.knobs.get("delay") or 1)


def parse_methods(text: str, plain: tuple[str, ...] = ()) -> list[MethodSpec]:
    """Comma-separated ``name[:knobs]`` entries (commas inside ``[...]`` belong to a value).

    ``plain``: names a benchmark takes besides the ``lgc.compress`` methods (no knobs).
    """
    from lgc.api import METHODS as KNOWN

    specs = []
    for entry in filter(None, (part.strip() for part in re.split(r",(?![^\[]*\])", text))):
        name, _, knobs = entry.partition(":")
        if name in plain:
            if knobs:
                raise ValueError(f"{name!r} takes no knobs, got {entry!r}")
            specs.append(MethodSpec(entry, name, {}))
            continue
        if name not in KNOWN:
            raise ValueError(f"unknown method {name!r} in {entry!r}; known: {', '.join(sorted(KNOWN))}")
        specs.append(MethodSpec(entry, name, parse_overrides(knobs)))
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels) or NO_COMM in labels:
        raise ValueError(f"--methods names a method twice or names {NO_COMM!r}: {labels}")
    return specs


def sgd_for(method: str, model: nn.Module, lr: float, momentum: float = 0.9) -> torch.optim.Optimizer:
    """SGD for ``model`` trained with ``method``: without momentum for DGC and DeMo, which apply it
    themselves (:func:`lgc.compress` refuses an optimizer that would apply it again)."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0 if method in ("dgc", "demo") else momentum)


def method_color(index: int) -> tuple[float, float, float]:
    """The ``index``-th method's line colour: tab20's dark shades first, then its light ones (20 distinct)."""
    import matplotlib

    colors = matplotlib.colormaps["tab20"].colors
    return colors[(2 * index) % 20 + (2 * index) // 20 % 2]
