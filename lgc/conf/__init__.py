"""Hydra configs shipped with the package (the repository root links to them as conf/).

Importing this package (Hydra does, to read the configs) registers the resolvers they use and the
``comm`` group's options, which are dataclasses (:mod:`lgc.comm`).
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Any

from omegaconf import OmegaConf

__all__ = ["run_id", "sweep_group", "sweep_run_name"]

#: This process's share of a run folder's name, drawn once (Hydra resolves the folder more than once).
_PROCESS_TOKEN = secrets.token_hex(3)


def run_id() -> str:
    """What makes a run folder unique beside its start time (``outputs/DATE/TIME-ID``).

    Two runs started in the same second must not share a folder (one summary would be lost, and the
    checkpoints would be ``last.ckpt`` and ``last-v1.ckpt`` with no way to tell them apart). The
    processes of one run agree on it: under torchrun the rendezvous id, or the launching agent's
    process id, which every local worker shares; under SLURM the job and step id; otherwise six
    random hex digits drawn once per process (``lgc-train`` spawns its workers itself, from the one
    process that names the folder).
    """
    elastic_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic_id and elastic_id != "none":
        return re.sub(r"[^A-Za-z0-9_.-]", "_", elastic_id)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return f"p{os.getppid()}"
    if "SLURM_JOB_ID" in os.environ:
        return "-".join(filter(None, ("j" + os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_STEP_ID"))))
    return _PROCESS_TOKEN


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
OmegaConf.register_new_resolver("lgc_run_id", run_id, replace=True)


def _register_comm_options() -> None:
    """The ``comm`` group's options (:mod:`lgc.comm`'s dataclasses: their fields are the only keys, typed)."""
    from hydra.core.config_store import ConfigStore

    from lgc.comm import COMM_OPTIONS

    for name, option in COMM_OPTIONS.items():
        ConfigStore.instance().store(group="comm", name=name, node=option)


_register_comm_options()
