"""The console commands ``lgc-train``, ``lgc-bench`` and ``lgc-report``.

They need the training stack (``pip install "lgc[train]"``); the core package (``lgc.compress`` and
every method) does not. Each command checks for it first and says how to install it, instead of
failing on the first import it lacks.
"""

from __future__ import annotations

import importlib.util

__all__ = ["bench", "report", "train"]

#: Import names of the training stack (the ``train`` extra).
TRAINING_STACK = ("pytorch_lightning", "hydra", "wandb", "torchmetrics", "torchdata", "torchvision", "sklearn")


def _require_training_stack(command: str, modules: tuple[str, ...] = TRAINING_STACK) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"{command} needs lgc's training stack, which this environment lacks ({', '.join(missing)}): "
            'pip install "lgc[train]" (in a clone: pip install -e ".[train]")'
        )


def train() -> None:
    """``lgc-train``: Hydra's command line around :func:`lgc.train.train`."""
    _require_training_stack("lgc-train")
    from lgc.train import main

    main()


def bench() -> None:
    """``lgc-bench``: the benchmarks (:mod:`lgc.bench.cli`)."""
    _require_training_stack("lgc-bench", ("torchvision", "matplotlib", "yaml"))
    from lgc.bench.cli import main

    main()


def report() -> None:
    """``lgc-report``: tables and plots of finished runs (:mod:`lgc.report`)."""
    _require_training_stack("lgc-report", ("matplotlib", "omegaconf"))
    from lgc.report import main

    main()
