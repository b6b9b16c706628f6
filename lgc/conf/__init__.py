"""Hydra configs shipped with the package (the repository root links to them as conf/).

Importing this package (Hydra does, to read the configs) registers the resolvers they use.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

__all__ = ["sweep_group", "sweep_run_name"]


def _hydra_config() -> Any:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def sweep_group() -> str | None:
    """The sweep folder's name during ``lgc-train -m`` (wandb groups a sweep's runs by it), else None."""
    from hydra.types import RunMode

    config = _hydra_config()
    if config is None or config.mode != RunMode.MULTIRUN:
        return None
    return f"{config.job.name}/{config.sweep.dir}"


def sweep_run_name() -> str | None:
    """A run's overrides (``compressor=dgc,trainer.devices=4``) as its wandb name; None without any."""
    config = _hydra_config()
    return (config.job.override_dirname or None) if config is not None else None


OmegaConf.register_new_resolver("lgc_sweep_group", sweep_group, replace=True)
OmegaConf.register_new_resolver("lgc_run_name", sweep_run_name, replace=True)
