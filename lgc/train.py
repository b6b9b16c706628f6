"""``train(cfg)``: one Hydra config in, one trained model and ``summary.json`` out.

``lgc-train`` is a thin Hydra wrapper around :func:`train`. Every value is checked here, in the
launching process, before any worker process starts; a bad value raises an error that names it,
and ``lgc-train`` then removes the run folder Hydra made for it if it holds only Hydra's own files.

Why one module: ``lgc-train`` from a config to its summary, in the order a run takes it: the checks
that refuse a run before any worker starts, each naming its field (devices, types, the model
against the task, the optimizer), the launch environment, the fit, and the run folder's cleanup.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NamedTuple

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

import lgc.conf  # noqa: F401  (registers the resolvers the configs use, e.g. the run folder's lgc_run_id)
from lgc.config_types import check_node_types
from lgc.lit.checkpoint import (
    CheckpointRecord,
    ResumableCheckpoint,
    check_checkpoint,
    resolve_checkpoint_path,
    run_settings,
)
from lgc.lit.strategy import heartbeats, stalled_workers
from lgc.methods import ERROR_FEEDBACK_KEYS, build_hook_state, check_error_feedback
from lgc.provenance import run_provenance
from lgc.validation import PositiveFloat, RunSeed, check

__all__ = [
    "check_devices",
    "check_strategy",
    "expected_optimizer_steps",
    "launched_externally",
    "main",
    "shared_gpus",
    "train",
]


def _instantiate(node: Any, what: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, re-raising a constructor's own error type, prefixed with the group."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, (ValueError, TypeError, FileNotFoundError)):
            raise type(cause)(f"{what}: {cause}") from err
        raise


def launched_externally() -> bool:
    """Whether torchrun or SLURM started this process as one of the workers (multi-node runs)."""
    from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    return TorchElasticEnvironment.detect() or (SLURMEnvironment.detect() and "SLURM_NTASKS" in os.environ)


def check_devices(accelerator: str, devices: Any, oversubscribe: bool) -> int:
    """Number of worker processes per node; an error names a count this machine cannot run.

    ``devices=-1`` on GPU means every visible GPU. More workers than CPU cores, or than GPUs, needs
    ``oversubscribe`` (see :func:`shared_gpus` for workers that share a GPU).
    """
    if accelerator in ("gpu", "cuda") and devices == -1 and not isinstance(devices, bool):
        devices = torch.cuda.device_count()
        if devices == 0:
            raise ValueError("trainer.devices=-1 (every visible GPU) but this machine has no CUDA device")
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"trainer.devices must be a positive number of worker processes, got {devices!r}")
    if accelerator in ("gpu", "cuda"):
        available = torch.cuda.device_count()
        if devices > available and (available == 0 or not oversubscribe):
            hint = "; set ddp.oversubscribe=true to let the workers share them (over gloo)" if available else ""
            raise ValueError(f"trainer.devices={devices} but this machine has {available} CUDA device(s){hint}")
    elif accelerator == "cpu":
        cores = os.cpu_count() or 1
        if devices > cores and not oversubscribe:
            raise ValueError(
                f"trainer.devices={devices} worker processes but this machine has {cores} CPU cores; "
                "set ddp.oversubscribe=true to simulate more workers than cores"
            )
    else:
        raise ValueError(f"trainer.accelerator must be 'cpu' or 'gpu', got {accelerator!r}")
    return devices


def check_backend(accelerator: str, backend: str | None) -> None:
    """Refuse a ``ddp.process_group_backend`` the workers could not start: one other than gloo or NCCL,
    or NCCL without GPUs (None takes Lightning's choice: gloo on the CPU, NCCL on GPUs)."""
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"ddp.process_group_backend={backend!r} must be null, 'gloo' or 'nccl'")
    if backend == "nccl" and accelerator not in ("gpu", "cuda"):
        raise ValueError(
            f"ddp.process_group_backend='nccl' needs GPUs (trainer.accelerator={accelerator!r}): leave it null "
            "or set gloo"
        )


def shared_gpus(accelerator: str, devices: int, backend: str | None, num_nodes: int = 1) -> list[torch.device] | None:
    """Each worker's GPU where more workers than GPUs share them (``ddp.oversubscribe=true``), else None.

    Worker ``i`` runs on GPU ``i mod count``. NCCL takes one worker per GPU, so these workers talk
    over gloo, which moves CUDA tensors through host memory: a way to simulate many workers on one
    GPU for accuracy and byte counts (the hook counts the same bytes on any backend), not for timing
    the network. ``backend`` is ``ddp.process_group_backend``: null or gloo; NCCL is refused.
    """
    if accelerator not in ("gpu", "cuda"):
        return None
    available = torch.cuda.device_count()
    if devices <= available:
        return None
    if backend not in (None, "gloo"):
        raise ValueError(
            f"ddp.process_group_backend={backend!r} but trainer.devices={devices} workers share {available} "
            "GPU(s), which only gloo allows (NCCL takes one worker per GPU): leave it null or set gloo"
        )
    external = launched_externally()
    if num_nodes != 1 or external:
        raise ValueError(
            f"trainer.devices={devices} workers sharing {available} GPU(s) run on one node, started by lgc-train "
            f"(trainer.num_nodes={num_nodes}{', under torchrun/SLURM' if external else ''})"
        )
    return [torch.device("cuda", rank % available) for rank in range(devices)]


def expected_optimizer_steps(trainer_node: DictConfig, datamodule: Any, world_size: int) -> int | None:
    """Optimizer steps the run will take (for checks made before workers start), or None if unknown: the
    fewer of ``max_steps`` and ``max_epochs``' steps where both are set (Lightning stops at the first)."""
    max_steps = trainer_node.get("max_steps")
    by_steps = int(max_steps) if max_steps is not None and max_steps >= 0 else None
    max_epochs = trainer_node.get("max_epochs")
    if by_steps is not None and (max_epochs is None or max_epochs < 0):
        return by_steps
    by_epochs = _epoch_steps(trainer_node, datamodule, world_size)
    return by_epochs if by_steps is None or by_epochs is None else min(by_steps, by_epochs)


def _epoch_batches(trainer_node: DictConfig, datamodule: Any, world_size: int) -> int | None:
    """Each worker's training batches per epoch (``trainer.limit_train_batches`` applied), None if unknown."""
    sampler_of = getattr(datamodule, "train_sampler", None)
    if sampler_of is None:
        return None
    datamodule.setup("fit")
    batches = len(sampler_of(num_replicas=world_size, rank=0)) // datamodule.batch_size
    limit = trainer_node.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    return batches


def _epoch_steps(trainer_node: DictConfig, datamodule: Any, world_size: int) -> int | None:
    """The optimizer steps of ``max_epochs`` epochs, or None if unknown."""
    batches = _epoch_batches(trainer_node, datamodule, world_size)
    if batches is None or trainer_node.get("max_epochs") is None:
        return None
    # Lightning also steps on an epoch's last, partial accumulation.
    return math.ceil(batches / int(trainer_node.get("accumulate_grad_batches") or 1)) * int(trainer_node.max_epochs)


def _check_model_fits_task(model: torch.nn.Module, datamodule: Any, task: str) -> None:
    """A tiny forward pass: a classifier must give ``[N, classes]``, a segmenter ``[N, classes, H, W]``."""
    size = 32
    probe = torch.zeros(2, datamodule.in_channels, size, size)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(probe)
    finally:
        model.train(was_training)
    out = out[0] if isinstance(out, tuple) else out
    expected = (2, datamodule.num_classes) if task == "classification" else (2, datamodule.num_classes, size, size)
    if tuple(out.shape) != expected:
        raise ValueError(
            f"model {type(model).__name__} gives outputs of shape {tuple(out.shape)} on a {task} task with "
            f"{datamodule.num_classes} classes (expected {expected}): pick a model for this task"
        )


def _check_optimizer(module: Any, hook_state: Any) -> None:
    """Build the optimizer and its schedule once on the model, so bad values fail here, not in a worker; then
    the method's optimizer rules (DGC's, DeMo's) on what that optimizer applies, whatever its class (Adam's
    betas are momentum), as ``lgc.compress`` checks them."""
    from lgc.api import _check_against_optimizer

    try:
        configured = module.configure_optimizers()
    except (ValueError, TypeError) as err:
        raise type(err)(f"optimizer/scheduler: {err}") from err
    for schedule in _schedulers(configured):
        if isinstance(schedule, torch.optim.lr_scheduler.CosineAnnealingLR) and schedule.T_max <= 0:
            raise ValueError(
                f"scheduler.T_max={schedule.T_max} (scheduler=cosine follows trainer.max_epochs): a cosine over "
                "epochs needs trainer.max_epochs > 0; for a run by steps use scheduler=cosine_steps"
            )
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    # ``([optimizer], [scheduler])`` where the schedule is a list of configs (warm-ups, per-step cosine).
    while isinstance(optimizer, list | tuple) and optimizer:
        optimizer = optimizer[0]
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_against_optimizer(hook_state, optimizer, None, None)


def _schedulers(configured: Any) -> list[Any]:
    """Every learning-rate scheduler in what ``configure_optimizers`` returned (lists, tuples, Lightning's dicts)."""
    if isinstance(configured, torch.optim.lr_scheduler.LRScheduler):
        return [configured]
    if isinstance(configured, dict):
        return [found for value in configured.values() for found in _schedulers(value)]
    if isinstance(configured, list | tuple):
        return [found for value in configured for found in _schedulers(value)]
    return []


def _task_module(cfg: DictConfig, model: torch.nn.Module, datamodule: Any) -> Any:
    from lgc.lit import ImageClassifier, SemanticSegmenter

    task = getattr(datamodule, "task", "classification")
    if task not in ("classification", "segmentation"):
        raise ValueError(f"data module {type(datamodule).__name__} has an unknown task {task!r}")
    _check_model_fits_task(model, datamodule, task)
    optimizer = _instantiate(cfg.optimizer, "optimizer")
    scheduler = _instantiate(cfg.scheduler, "scheduler") if cfg.get("scheduler") else None
    if task == "segmentation":
        return SemanticSegmenter(
            model,
            num_classes=datamodule.num_classes,
            optimizer=optimizer,
            scheduler=scheduler,
            ignore_index=datamodule.ignore_index,
            aux_weight=cfg.loss.aux_weight,
        )
    return ImageClassifier(model, num_classes=datamodule.num_classes, optimizer=optimizer, scheduler=scheduler)


# Third-party messages that say nothing about the run and that the user cannot act on, printed once
# per worker; to be fixed upstream, not here:
#: * torch deprecates ``LeafSpec`` (a FutureWarning), which Lightning's ``CombinedLoader`` still builds;
#: * torchdata's ``StatefulDataLoader`` calls the deprecated ``torch.set_vital`` on construction.
_NOISE_WARNINGS = (
    {
        "message": r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "category": FutureWarning,
        "module": r"pytorch_lightning\.utilities\._pytree",
    },
    {
        "message": r"'set_vital' is deprecated",
        "category": UserWarning,
        "module": r"torchdata\.stateful_dataloader\.stateful_dataloader",
    },
)
#: The same filters for spawned workers, as ``PYTHONWARNINGS`` (literal message prefixes, no commas).
_NOISE_PYTHONWARNINGS = (
    "ignore:`isinstance(treespec:FutureWarning:pytorch_lightning.utilities._pytree,"
    "ignore:'set_vital' is deprecated:UserWarning:torchdata.stateful_dataloader.stateful_dataloader"
)


def _drop_lightning_tips(record: logging.LogRecord) -> bool:
    """Logging filter: Lightning's "💡 Tip: try installing litlogger / litmodels" advertisements."""
    return not record.getMessage().startswith("💡 Tip:")


def _without_require_service(require: Callable[..., Any]) -> Callable[..., Any]:
    """``wandb.require`` minus ``"service"``, a no-op in current wandb that warns on every call.

    Lightning's ``WandbLogger`` calls ``wandb.require("service")`` whenever it is pickled for a
    spawned worker, which printed the same warning once per worker.
    """

    def without_service(*args: Any, **kwargs: Any) -> Any:
        if args == ("service",) and not kwargs:
            return None
        return require(*args, **kwargs)

    return without_service


@contextlib.contextmanager
def _launch_environment(loggers: list[Any], spawns_workers: bool) -> Iterator[None]:
    """Environment of one ``trainer.fit``, restored afterwards.

    * ``MASTER_PORT``: Lightning picks a free port for spawned workers and leaves it in
      ``os.environ``, where every later run in the same process (a notebook, a test session) would
      reuse it although something else may hold it by then. Unless the caller set it, each run
      picks its own.
    * ``WANDB_DIR``: with spawned workers Lightning creates the wandb run in this process and the
      rank-0 worker attaches to it; the attached run would write its media (the per-layer tables)
      under the working directory's ``wandb/`` instead of the logger's ``save_dir``. The run is
      created here, before the port is chosen (wandb's service listens on a port of its own), and
      finished when training ends, which flushes the offline transaction log before ``train``
      returns.
    * Third-party noise on every run is left out, here and in the workers: torch's ``LeafSpec``
      deprecation warning raised by Lightning's code and torchdata's ``set_vital`` call (``PYTHONWARNINGS``
      for spawned workers), and
      wandb's warnings about settings Lightning passes (``anonymous=None``, ``require("service")``).
    """
    from pytorch_lightning.loggers import WandbLogger

    if spawns_workers and torch.distributed.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialized in the process that launches the workers "
            f"(it holds MASTER_PORT={os.environ.get('MASTER_PORT')}); call torch.distributed.destroy_process_group() "
            "first, or launch with torchrun"
        )
    wandb_loggers = [logger for logger in loggers if isinstance(logger, WandbLogger)]
    saved = {name: os.environ.get(name) for name in ("MASTER_PORT", "WANDB_DIR", "PYTHONWARNINGS")}
    if wandb_loggers and wandb_loggers[0].save_dir:
        os.environ["WANDB_DIR"] = str(Path(wandb_loggers[0].save_dir).resolve())
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (saved["PYTHONWARNINGS"], _NOISE_PYTHONWARNINGS)))
    for logger in wandb_loggers:
        # Lightning passes anonymous=None, which current wandb warns about as a setting with no effect.
        init_kwargs = getattr(logger, "_wandb_init", {})
        if "anonymous" in init_kwargs and init_kwargs["anonymous"] is None:
            del init_kwargs["anonymous"]
    wandb = None
    if wandb_loggers:
        import wandb

        require = wandb.require
        wandb.require = _without_require_service(require)
    try:
        with warnings.catch_warnings():
            for noise in _NOISE_WARNINGS:
                warnings.filterwarnings("ignore", **noise)
            if spawns_workers:
                for logger in wandb_loggers:
                    _ = logger.experiment
            yield
    finally:
        if wandb is not None:
            wandb.require = require
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for logger in wandb_loggers:
            if logger._experiment is not None:
                logger._experiment.finish()


class _PreparedRun(NamedTuple):
    """Everything :func:`train` builds and checks before it writes a file or starts a worker."""

    trainer: Any  # pl.Trainer
    module: Any  # the task's LightningModule
    datamodule: Any
    loggers: list[Any]
    output_dir: Path
    ckpt_path: str | None
    heartbeat_dir: Path
    timeout_s: float


#: The ``ddp`` node's settings and their types (``timeout``: :func:`_check_timeout`).
_DDP_SETTINGS: dict[str, Any] = {
    "start_method": Literal["spawn", "fork", "forkserver", "popen"],
    "process_group_backend": str | None,
    "bucket_cap_mb": PositiveFloat,
    "oversubscribe": bool,
    "timeout": Any,
}


#: The plain nodes no ``_target_`` checks (a misspelt key there would otherwise change nothing, unseen).
_PLAIN_NODES = ("checkpoint", "loss", "regularization", "strategy")


@functools.cache
def _known_settings() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """The run's top-level settings and the keys of each plain node, as ``lgc/conf`` declares them: train.yaml's
    own nodes and the config groups its defaults pick (a group defaulting to null, ``experiment``, adds none);
    a group's node (``strategy``) holds the keys of any of its options."""
    conf = Path(lgc.conf.__file__).parent
    train = OmegaConf.to_container(OmegaConf.load(conf / "train.yaml"))
    assert isinstance(train, dict)
    picked = [entry for entry in train.pop("defaults") if isinstance(entry, dict)]  # "_self_" is a string
    groups = {name for entry in picked for name, option in entry.items() if option is not None}
    nodes = {}
    for node in _PLAIN_NODES:
        if node in groups:
            options = [OmegaConf.load(path) for path in sorted((conf / node).glob("*.yaml"))]
            nodes[node] = frozenset(key for option in options for key in option)
        else:
            nodes[node] = frozenset(train[node])
    return frozenset(train) | groups, nodes


def _check_settings(cfg: DictConfig) -> None:
    """The settings no ``_target_`` checks: no unknown top-level key, nor in the plain nodes (``checkpoint``,
    ``loss``, ``regularization``, ``strategy``); the ``ddp`` node's (no unknown key, each of its type); the seed."""
    top_level, plain_nodes = _known_settings()
    for key in cfg:
        if key not in top_level:
            raise ValueError(
                f"{key} is not a setting of lgc-train; they are {', '.join(sorted(top_level - {'hydra'}))}"
            )
    for node, known in plain_nodes.items():
        for key in cfg.get(node) or {}:
            if key not in known:
                raise ValueError(f"{node}.{key} is not a {node} setting; they are {', '.join(sorted(known))}")
    ddp = cfg.get("ddp") or {}
    for key in ddp:
        if key not in _DDP_SETTINGS:
            raise ValueError(f"ddp.{key} is not a DDP setting; they are {', '.join(_DDP_SETTINGS)}")
        check(f"ddp.{key}", ddp[key], _DDP_SETTINGS[key])
    check("seed", cfg.get("seed"), RunSeed)


def _check_types(cfg: DictConfig) -> None:
    """Every instantiated node's values against its ``_target_``'s annotations (errors name the field).

    ``comm`` is a structured config (:mod:`lgc.comm`): Hydra has checked its keys and types already.
    """
    _check_settings(cfg)
    groups = {name: cfg.get(name) for name in ("compressor", "model", "data", "optimizer", "scheduler", "trainer")}
    groups |= {f"logger.{name}": node for name, node in (cfg.get("logger") or {}).items()}
    groups |= {f"callbacks.{name}": node for name, node in (cfg.get("callbacks") or {}).items()}
    for what, node in groups.items():
        if node:
            check_node_types(node, what, ignore=ERROR_FEEDBACK_KEYS if what == "compressor" else ())


def _check_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"ddp.timeout must be a positive number of seconds, got {value!r}")
    return float(value)


#: ``strategy.name``'s options (``lgc/conf/strategy/``).
STRATEGIES = ("ddp", "fsdp", "hsdp")
_FP32 = (None, 32, "32", "32-true")


def check_strategy(cfg: DictConfig, hook_state: Any, devices: int, world_size: int, shared: bool) -> int | None:
    """The shard size the ``strategy`` node asks for (None: DDP, or FSDP over every worker), or an error naming it.

    FSDP2 and HSDP take a per-step lgc compressor (:func:`lgc.fsdp.check_fsdp_state`), fp32 training,
    one worker per device, and at least two workers (HSDP: two replicas, of ``shard_size`` workers,
    default ``trainer.devices``). HSDP also takes local steps (``comm.delay``) through an lgc
    compressor and LGC's family, the replicas the workers (:mod:`lgc.fsdp.local_steps`,
    :mod:`lgc.fsdp.learned`).
    """
    from lgc.fsdp import check_fsdp_state, check_local_steps
    from lgc.learned.state import LGCHookState

    node = cfg.get("strategy") or {"name": "ddp"}
    name = node.get("name")
    if name not in STRATEGIES:
        raise ValueError(f"strategy.name must be one of {', '.join(STRATEGIES)}, got {name!r}")
    if getattr(hook_state, "takes_local_steps", False) and cfg.trainer.get("accumulate_grad_batches", 1) != 1:
        raise ValueError(
            f"trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches}: communication delay "
            f"(comm.delay={cfg.comm.get('delay')}) counts optimizer steps; train with 1 here"
        )
    if name == "ddp":
        return None
    if isinstance(hook_state, LGCHookState):
        if name == "fsdp":
            raise ValueError(
                f"{type(hook_state).__name__} codes the all-reduce across replicas, and strategy=fsdp shards one model "
                "over every worker (no replicas): strategy=hsdp strategy.shard_size=N (each replica of N workers one "
                "of LGC's workers), or strategy=ddp"
            )
    elif not getattr(hook_state, "takes_local_steps", False):
        check_fsdp_state(hook_state, cfg.compressor.get("_target_"))
    elif name == "fsdp":
        raise ValueError(
            f"comm.delay={cfg.comm.delay}: local steps need replicas that step apart, and strategy=fsdp shards one "
            "model over every worker: strategy=hsdp strategy.shard_size=N (each replica of N workers an outer "
            "worker), or strategy=ddp"
        )
    else:
        check_local_steps(hook_state)
        if hook_state.overlap_steps and cfg.trainer.get("accelerator") not in (None, "cpu"):
            raise ValueError(
                f"comm.overlap_steps={hook_state.overlap_steps}: under strategy=hsdp overlapped exchanges run on "
                f"the CPU only (trainer.accelerator={cfg.trainer.accelerator!r}); use comm.overlap_steps=0"
            )
    if cfg.trainer.get("accumulate_grad_batches", 1) != 1:
        raise ValueError(
            f"trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches}: strategy={name} reduces (and lgc "
            "compresses) every micro-batch under Lightning, not once per optimizer step; train with 1 here"
        )
    if cfg.comm.get("pack"):
        raise ValueError(f"comm.pack=true is a DDP hook setting; strategy={name} reduces each parameter group itself")
    if cfg.trainer.get("precision") not in _FP32:
        raise ValueError(
            f"trainer.precision={cfg.trainer.precision!r}: strategy={name} trains in fp32 here (FSDP2's mixed "
            "precision is its MixedPrecisionPolicy, which lgc.compress takes in a script of your own)"
        )
    if shared:
        raise ValueError(f"strategy={name} takes one worker per GPU; workers sharing GPUs run with strategy=ddp")
    if name == "fsdp":
        if world_size < 2:
            raise ValueError(f"strategy=fsdp shards over the workers: it needs two or more, this run has {world_size}")
        return None
    shard_size = devices if node.get("shard_size") is None else node.get("shard_size")
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ValueError(f"strategy.shard_size must be a positive number of workers, got {shard_size!r}")
    if world_size % shard_size or world_size // shard_size < 2:
        raise ValueError(
            f"strategy=hsdp with strategy.shard_size={shard_size} on {world_size} workers: the workers must form two "
            "or more replicas of shard_size workers each"
        )
    return shard_size


def hydra_record(choices: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """What a run was asked for, as ``summary.json`` records it (``hydra``; ``lgc-report`` labels runs by it).

    ``choices``: the option taken in every config group (``compressor: topk``, ``data: digits``;
    Hydra's own ``hydra/*`` groups left out); ``overrides``: the command line's overrides as typed
    (a multirun job's own values).
    """
    return {
        "choices": {str(group): option for group, option in choices.items() if not str(group).startswith("hydra/")},
        "overrides": [str(override) for override in overrides],
    }


def _prepare(cfg: DictConfig, hydra_run: dict[str, Any] | None = None) -> _PreparedRun:
    """Validate and build everything in this process; writes nothing, starts no worker.

    ``hydra_run``: the run's :func:`hydra_record`, for its summary.
    """
    import pytorch_lightning as pl

    from lgc.lit import (
        CompressedDDPStrategy,
        CompressedFSDPStrategy,
        CompressionCallback,
        RunSummary,
        ValidateAtMaxSteps,
    )

    _check_types(cfg)
    hook_state = build_hook_state(cfg.compressor, cfg.comm)
    check_error_feedback(hook_state, cfg.compressor, cfg.compressor.get("error_feedback"), prefix="compressor.")
    hook_state.check_optimizer(cfg.optimizer.get("momentum", 0.0), cfg.optimizer.get("weight_decay", 0.0))
    devices = check_devices(cfg.trainer.accelerator, cfg.trainer.devices, cfg.ddp.oversubscribe)
    check_backend(cfg.trainer.accelerator, cfg.ddp.process_group_backend)
    num_nodes = int(cfg.trainer.get("num_nodes") or 1)
    world_size = devices * num_nodes
    # Workers sharing GPUs: Lightning takes their devices from the strategy; the Trainer gets the GPUs' count.
    worker_gpus = shared_gpus(cfg.trainer.accelerator, devices, cfg.ddp.process_group_backend, num_nodes)
    timeout_s = _check_timeout(cfg.ddp.get("timeout", 300))
    shard_size = check_strategy(cfg, hook_state, devices, world_size, shared=bool(worker_gpus))
    output_dir = Path(cfg.output_dir)
    ckpt_path = resolve_checkpoint_path(cfg.ckpt_path, output_dir)

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = _instantiate(cfg.data, "data")
    # The run's length, for the checks that need it (LGC's stages, a checkpoint with steps left).
    for name in ("max_steps", "max_epochs"):
        if cfg.trainer.get(name) == 0:
            raise ValueError(f"trainer.{name}=0: the run would take no optimizer step and write no summary")
    max_steps, max_epochs = cfg.trainer.get("max_steps"), cfg.trainer.get("max_epochs")
    both_limits = max_steps is not None and max_steps > 0 and max_epochs is not None and max_epochs > 0
    total_steps = (
        expected_optimizer_steps(cfg.trainer, datamodule, world_size)
        if hook_state.needs_total_steps or ckpt_path is not None or both_limits
        else None
    )
    if total_steps == 0 or _epoch_batches(cfg.trainer, datamodule, world_size) == 0:
        raise ValueError(
            f"the run takes no optimizer step: each of its {world_size} workers' shard holds fewer than one batch "
            f"of data.batch_size={cfg.data.get('batch_size')} (or trainer.limit_train_batches leaves none)"
        )
    steps_schedule = str((cfg.get("scheduler") or {}).get("_target_", "")).endswith("StepCosine")
    if both_limits and steps_schedule and total_steps is not None and total_steps < max_steps:
        raise ValueError(
            f"trainer.max_epochs={max_epochs} stops the run at step {total_steps}, before trainer.max_steps="
            f"{max_steps}, where scheduler=cosine_steps reaches 0: set trainer.max_epochs=-1 (or "
            f"trainer.max_steps={total_steps})"
        )
    model = _instantiate(cfg.model, "model", num_classes=datamodule.num_classes, in_channels=datamodule.in_channels)
    module = _task_module(cfg, model, datamodule)
    _check_optimizer(module, hook_state)
    # The method's workers: under HSDP the replicas (LGC's leader and codecs, the local steps' outer workers).
    hook_state.check_run(model, world_size if shard_size is None else world_size // shard_size, total_steps)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    run = run_settings(resolved)  # what a checkpoint records and a resume must keep
    # comm.min_numel: null follows the method; the summary and the checkpoint record the number it is.
    effective_min_numel = hook_state.dense_below()
    if resolved["comm"].get("min_numel") is None and effective_min_numel is not None:
        resolved["comm"]["min_numel"] = effective_min_numel
    resolved.setdefault("strategy", {"name": "ddp"})
    if shard_size is not None:  # hsdp: the number it is, as the checkpoint records it
        resolved["strategy"]["shard_size"] = shard_size
    if ckpt_path is not None:
        check_checkpoint(
            ckpt_path,
            compressor=resolved["compressor"],
            comm=resolved["comm"],
            world_size=world_size,
            model_state=module.state_dict(),
            total_steps=total_steps,
            strategy=resolved["strategy"],
            run=run,
        )
    heartbeat_dir = output_dir / ".workers"
    start_method = "popen" if launched_externally() else cfg.ddp.start_method
    if resolved["strategy"]["name"] == "ddp":
        strategy = CompressedDDPStrategy(
            hook_state,
            heartbeat_dir=heartbeat_dir,
            start_method=start_method,
            process_group_backend="gloo" if worker_gpus else cfg.ddp.process_group_backend,
            parallel_devices=worker_gpus,
            bucket_cap_mb=cfg.ddp.bucket_cap_mb,
            timeout=timedelta(seconds=timeout_s),
        )
    else:
        strategy = CompressedFSDPStrategy(
            hook_state,
            shard_size=shard_size,
            buffers=hook_state.buffers,
            heartbeat_dir=heartbeat_dir,
            start_method=start_method,
            timeout=timedelta(seconds=timeout_s),
            process_group_backend=cfg.ddp.process_group_backend,
        )
    loggers = [hydra.utils.instantiate(node) for node in (cfg.get("logger") or {}).values() if node is not None]
    checkpoint_node = cfg.get("checkpoint") or {}
    callbacks = [
        CompressionCallback(),
        RunSummary(str(output_dir), resolved, hydra=hydra_run, provenance=run_provenance()),
        ValidateAtMaxSteps(),
        ResumableCheckpoint(output_dir / "checkpoints", every_n_train_steps=checkpoint_node.get("every_n_train_steps")),
        CheckpointRecord(resolved["compressor"], resolved["comm"], resolved["strategy"], run),
    ]
    # Extra callbacks by name (null drops one), e.g. lgc.analysis.GradientRecorder.
    callbacks += [
        _instantiate(node, f"callbacks.{name}") for name, node in (cfg.get("callbacks") or {}).items() if node
    ]
    logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(_drop_lightning_tips)
    gpu_count = {"devices": len(set(worker_gpus))} if worker_gpus else {}
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        strategy=strategy,
        logger=loggers or False,
        callbacks=callbacks,
        default_root_dir=str(output_dir),
        **gpu_count,
    )
    return _PreparedRun(
        trainer,
        module,
        datamodule,
        loggers,
        output_dir,
        None if ckpt_path is None else str(ckpt_path),
        heartbeat_dir,
        timeout_s,
    )


def _name_stalled_worker(run: _PreparedRun, error: BaseException) -> None:
    """After a failed fit: if a worker went silent long before the others, raise an error naming it."""
    stalled = stalled_workers(run.heartbeat_dir)
    if not stalled:
        return
    first = stalled[0]
    waiting = max((record["step"] or 0) for record in heartbeats(run.heartbeat_dir))
    raise RuntimeError(
        f"worker rank {first['rank']} (pid {first['pid']} on {first['host']}) stopped answering: its last "
        f"heartbeat (at step {first['step']}) came {first['silent_s']:.0f} s before the last worker gave up, the "
        f"others waited at step {waiting} for ddp.timeout={run.timeout_s:g} s. It was frozen, stuck outside Python "
        f"or killed; the run was stopped. Resume it with ckpt_path={run.output_dir}"
    ) from error


def _fit(run: _PreparedRun, start: float) -> dict[str, Any]:
    """Train a prepared run; its summary gets the wall time since ``start`` (a ``time.perf_counter()``)."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    if not launched_externally():  # under torchrun every worker runs this: leave the others' heartbeats
        shutil.rmtree(run.heartbeat_dir, ignore_errors=True)
    try:
        with _launch_environment(run.loggers, spawns_workers=not launched_externally()):
            run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path)
    except Exception as error:
        _name_stalled_worker(run, error)
        raise
    if not launched_externally():
        shutil.rmtree(run.heartbeat_dir, ignore_errors=True)
    elif run.trainer.global_rank != 0:
        # Under torchrun or SLURM every worker returns here; rank 0 writes the summary (on its own node, with
        # no shared file system on the others), and only rank 0 reads it and reports.
        return {}

    summary_path = run.output_dir / "summary.json"
    if not summary_path.is_file():
        raise RuntimeError(
            f"training ended without writing {summary_path}: no training step ran (trainer.max_steps or "
            "trainer.max_epochs had been reached already?)"
        )
    summary = json.loads(summary_path.read_text())
    summary["wall_time_s"] = time.perf_counter() - start
    summary_path.write_text(json.dumps(summary, indent=2, default=str))
    return summary


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says and return the run summary (also written to ``output_dir/summary.json``; under
    torchrun or SLURM, rank 0 returns it and the other workers an empty dict).

    Every value is checked, and the model, data and trainer built, before anything is written or a
    worker starts: a refused config leaves no trace. A config composed with
    ``compose(..., return_hydra_config=True)`` keeps its group choices and overrides in the summary
    (``hydra``, as ``lgc-train`` records them); its ``hydra`` node is not part of the run's config.
    """
    start = time.perf_counter()
    hydra_run = None
    if "hydra" in cfg:
        hydra_run = hydra_record(cfg.hydra.runtime.choices, cfg.hydra.overrides.task)
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    return _fit(_prepare(cfg, hydra_run), start)


# What Hydra writes into a run folder before the job starts.
_HYDRA_FILES = frozenset({"config.yaml", "hydra.yaml", "overrides.yaml"})


def _remove_unused_run_folder(folder: Path, log_name: str, stop_at: Path) -> bool:
    """Remove ``folder`` if it holds nothing but Hydra's own files, then its empty parents below ``stop_at``.

    Hydra's own files are ``.hydra/{config,hydra,overrides}.yaml`` and an *empty* job log
    ``log_name``; a folder holding anything else (a log with something in it included) is kept.
    Returns whether ``folder`` was removed.
    """
    folder = folder.resolve()
    try:
        entries = {entry.name: entry for entry in folder.iterdir()}
        hydra_dir, log = entries.pop(".hydra", None), entries.pop(log_name, None)
        if entries or (log is not None and (not log.is_file() or log.stat().st_size > 0)):
            return False
        if hydra_dir is not None and (
            not hydra_dir.is_dir() or any(not f.is_file() or f.name not in _HYDRA_FILES for f in hydra_dir.iterdir())
        ):
            return False
    except OSError:
        return False
    # Hydra's job log handler still has the file open (Windows would refuse to delete it).
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", [])):
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == folder:
                handler.close()
                logger.removeHandler(handler)
    shutil.rmtree(folder, ignore_errors=True)
    stop_at = stop_at.resolve()
    for parent in folder.parents:
        if parent == stop_at or stop_at not in parent.parents:
            break
        try:
            parent.rmdir()  # only while empty: outputs/DATE/ of this run alone, then outputs/
        except OSError:
            break
    return not folder.exists()


def _remove_refused_run_folder() -> None:
    """After a refused config: the folder Hydra made for the run, unless the user named it."""
    hydra_cfg = HydraConfig.get()
    pinned = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.sweep.subdir=")
    if any(override.startswith(pinned) for override in hydra_cfg.overrides.hydra):
        return
    folder = Path(hydra_cfg.runtime.output_dir)
    _remove_unused_run_folder(folder, f"{hydra_cfg.job.name}.log", stop_at=Path(hydra_cfg.runtime.cwd))


def _result_line(summary: dict[str, Any], output_dir: str) -> str:
    """The line ``lgc-train`` ends with: final metrics, the run's overall ratio (and LGC's compressed stage's)."""

    def ratio(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    metrics = " ".join(
        f"{key}={summary[key]:.4f}" for key in ("val/acc", "val/mIoU", "val/pixel_acc") if key in summary
    )
    parts = [
        metrics or "no validation metrics",
        # Not wandb's comm/compression_ratio (rank 0's running value): every worker, every step.
        f"overall_compression_ratio={ratio(summary['compression_ratio'])} "
        f"(wire bytes against a dense ring allreduce, all {summary['world_size']} workers, "
        f"all {summary['steps']} steps)",
    ]
    if "wire_bytes_sent" in summary:
        parts.append(f"wire_sent={summary['wire_bytes_sent'] / summary['world_size'] / 1e6:.3g}MB/worker")
    compressed = summary.get("lgc_stages", {}).get("compressed")
    if compressed is not None:
        parts.append(f"lgc_compressed_stage_ratio={ratio(compressed['compression_ratio'])}")
    parts.append(f"wall_time={summary['wall_time_s']:.1f}s -> {output_dir}/summary.json")
    return " ".join(parts)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    start = time.perf_counter()
    hydra_cfg = HydraConfig.get()
    try:
        run = _prepare(cfg, hydra_record(hydra_cfg.runtime.choices, hydra_cfg.overrides.task))
    except Exception:
        _remove_refused_run_folder()
        raise
    summary = _fit(run, start)
    if summary:  # rank 0's (the other workers of a torchrun or SLURM launch have none)
        print(_result_line(summary, cfg.output_dir))


if __name__ == "__main__":
    main()
