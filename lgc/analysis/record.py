"""Record the workers' gradients of a short ``lgc.train.train`` run on the embedded digits task."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict

__all__ = ["compose_recording_config", "record_gradients"]


def _is_interactive() -> bool:
    # Lightning's own test (lightning_fabric.utilities.imports._IS_INTERACTIVE); Jupyter sets sys.ps1.
    return hasattr(sys, "ps1") or bool(sys.flags.interactive)


def compose_recording_config(
    output_dir: str | Path,
    partition: str = "iid",
    alpha: float = 0.1,
    max_epochs: int = 2,
    every_n_steps: int = 1,
    patterns: Sequence[str] | None = None,
    dtype: str = "float32",
    overrides: Sequence[str] = (),
) -> Any:
    """The Hydra config of :func:`record_gradients` (``lgc/conf/train.yaml`` plus the recorder).

    Starts from the default run (digits, ResNet-8, 2 CPU workers) with ``compressor=none``, so the
    gradients are those of plain data-parallel SGD, and ``logger=none``. ``overrides`` are Hydra
    overrides applied last (``"compressor=topk"``, ``"trainer.devices=4"``, ...). A recording by steps
    (``max_epochs`` below 0) trains at a constant rate unless ``overrides`` pick a scheduler (the default
    cosine follows ``max_epochs``).
    """
    from hydra import compose, initialize_config_module

    output_dir = Path(output_dir)
    base = ["compressor=none", "logger=none", f"output_dir={output_dir}"]
    run = [f"trainer.max_epochs={max_epochs}", "trainer.enable_progress_bar=false", *overrides]
    if max_epochs < 0 and not any(o.lstrip("+~").startswith("scheduler") for o in overrides):
        # A recording by steps: the default cosine follows max_epochs, so a constant rate instead.
        run.append("~scheduler")
    with initialize_config_module("lgc.conf", version_base="1.3"):
        # Tasks with dense labels (segmentation) have no partition option: their shards are IID.
        if "partition" in compose("train", overrides=[*base, *run]).data:
            base += [f"data.partition={partition}", f"data.alpha={alpha}"]
        elif partition != "iid":
            raise ValueError(f"partition={partition!r}: this task has no partition option (its shards are IID)")
        cfg = compose("train", overrides=[*base, *run])
    recorder = {
        "_target_": "lgc.analysis.GradientRecorder",
        "output_dir": str(output_dir / "gradients"),
        "patterns": None if patterns is None else list(patterns),
        "every_n_steps": every_n_steps,
        "dtype": dtype,
        "metadata": {
            "partition": "${oc.select:data.partition,iid}",
            "alpha": "${oc.select:data.alpha,null}",
            "partition_seed": "${oc.select:data.partition_seed,null}",
            "data": "${data._target_}",
            "model": "${model._target_}",
            "compressor": "${compressor._target_}",
            "seed": "${seed}",
        },
    }
    with open_dict(cfg):
        cfg.callbacks = {**(cfg.get("callbacks") or {}), "gradient_recorder": recorder}
    return cfg


def record_gradients(
    output_dir: str | Path,
    partition: str = "iid",
    alpha: float = 0.1,
    max_epochs: int = 2,
    every_n_steps: int = 1,
    patterns: Sequence[str] | None = None,
    dtype: str = "float32",
    overrides: Sequence[str] = (),
    start_method: str | None = None,
) -> Path:
    """Train briefly with :func:`lgc.train.train` and record every worker's gradients.

    The run is the default embedded task (scikit-learn digits, ResNet-8, 2 CPU worker processes
    over gloo), dense (``compressor=none``), with its training set split by ``partition``
    (``"iid"`` or ``"dirichlet"`` with concentration ``alpha``). Two epochs are 44 steps (about
    20 s on 2 cores, most of it starting the workers).

    Args:
        output_dir: the run's folder (``summary.json``, ``checkpoints/``, ``gradients/``).
        partition: ``"iid"`` or ``"dirichlet"``.
        alpha: Dirichlet concentration (read only by ``"dirichlet"``).
        max_epochs: training length.
        every_n_steps: record every n-th optimizer step.
        patterns: parameter name globs (e.g. ``["model.layers.*.conv*.weight"]``); None records the
            first, middle and last conv weight.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` on disk.
        overrides: further Hydra overrides.
        start_method: how the worker processes start; None: ``"fork"`` in an interactive session
            (Jupyter, the REPL: Lightning refuses ``"spawn"`` there, because spawned workers
            cannot import code defined in ``__main__``), else the config's ``ddp.start_method``
            (``"spawn"``, which from a script needs an ``if __name__ == "__main__":`` guard).

    Returns:
        The folder of the recording (``output_dir/gradients``): read it with
        :func:`lgc.analysis.load_recording`.
    """
    from lgc.train import train

    if start_method is None and _is_interactive():
        start_method = "fork"
    if start_method is not None:
        overrides = [f"ddp.start_method={start_method}", *overrides]
    cfg = compose_recording_config(output_dir, partition, alpha, max_epochs, every_n_steps, patterns, dtype, overrides)
    train(cfg)
    return Path(OmegaConf.select(cfg, "callbacks.gradient_recorder.output_dir"))
