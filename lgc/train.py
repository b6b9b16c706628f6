"""``train(cfg)``: one Hydra config in, one trained model and ``summary.json`` out.

``lgc-train`` is a thin Hydra wrapper around :func:`train`. Every value is checked here, in the
launching process, before any worker process starts; a bad value raises an error that names it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from lgc.compressors import Compressor, ErrorFeedback
from lgc.compressors.dgc import check_optimizer_momentum
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.lgc_base import LGCHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.torch_hooks import TorchHookState

__all__ = [
    "build_compressor",
    "build_hook_state",
    "check_devices",
    "expected_optimizer_steps",
    "launched_externally",
    "main",
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


def build_compressor(node: DictConfig | dict[str, Any]) -> Compressor | TorchHookState | LGCHookState:
    """Instantiate a ``compressor`` config node; ``error_feedback: true`` wraps it in :class:`ErrorFeedback`.

    PyTorch's hooks (:mod:`lgc.ddp.torch_hooks`) and LGC (:mod:`lgc.ddp.lgc_rar`,
    :mod:`lgc.ddp.lgc_ps`) are hook states of their own rather than compressors.
    """
    kwargs = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    with_error_feedback = bool(kwargs.pop("error_feedback", False))
    built = _instantiate(kwargs, "compressor")
    if isinstance(built, (TorchHookState, LGCHookState)):
        if with_error_feedback:
            raise ValueError(
                f"compressor.error_feedback=true does not apply to {built.describe()}, which handles its own residuals"
            )
        return built
    if not isinstance(built, Compressor):
        raise TypeError(f"compressor._target_={kwargs.get('_target_')!r} did not build an lgc Compressor")
    return ErrorFeedback(built) if with_error_feedback else built


def build_hook_state(
    compressor_node: DictConfig, comm_node: DictConfig
) -> CompressionHookState | TorchHookState | CommunicationDelayState | LGCHookState:
    """The hook state for ``cfg.compressor`` and ``cfg.comm``.

    ``cfg.compressor`` builds either an lgc :class:`Compressor` (``error_feedback: true`` wraps it in
    :class:`ErrorFeedback`; ``cfg.comm`` configures the hook) or one of PyTorch's hooks wrapped by
    :mod:`lgc.ddp.torch_hooks`. ``comm.delay: n`` switches to SBC's communication delay: ``n``
    local steps, then an exchange of the compressed weight update (:mod:`lgc.ddp.local_sgd`).
    """
    delay = comm_node.get("delay")
    compressor = build_compressor(compressor_node)
    if isinstance(compressor, (TorchHookState, LGCHookState)):
        if delay is not None:
            raise ValueError(f"comm.delay={delay!r} needs an lgc compressor, not {compressor.describe()}")
        return compressor
    if delay is not None:
        return CommunicationDelayState(compressor, delay=delay, min_numel=comm_node.min_numel)
    return CompressionHookState(compressor, min_numel=comm_node.min_numel, start_iter=comm_node.start_iter)


def launched_externally() -> bool:
    """Whether torchrun or SLURM started this process as one of the workers (multi-node runs)."""
    from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    return TorchElasticEnvironment.detect() or (SLURMEnvironment.detect() and "SLURM_NTASKS" in os.environ)


def check_devices(accelerator: str, devices: Any, oversubscribe: bool) -> int:
    """Number of worker processes per node; an error names a count this machine cannot run.

    ``devices=-1`` on GPU means every visible GPU.
    """
    if accelerator in ("gpu", "cuda") and devices == -1 and not isinstance(devices, bool):
        devices = torch.cuda.device_count()
        if devices == 0:
            raise ValueError("trainer.devices=-1 (every visible GPU) but this machine has no CUDA device")
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"trainer.devices must be a positive number of worker processes, got {devices!r}")
    if accelerator in ("gpu", "cuda"):
        available = torch.cuda.device_count()
        if devices > available:
            raise ValueError(f"trainer.devices={devices} but this machine has {available} CUDA device(s)")
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


def expected_optimizer_steps(trainer_node: DictConfig, datamodule: Any, world_size: int) -> int | None:
    """Optimizer steps the run will take (for checks made before workers start), or None if unknown."""
    max_steps = trainer_node.get("max_steps")
    if max_steps is not None and max_steps >= 0:
        return int(max_steps)
    sampler_of = getattr(datamodule, "train_sampler", None)
    if sampler_of is None or trainer_node.get("max_epochs") is None:
        return None
    datamodule.setup("fit")
    batches = len(sampler_of(num_replicas=world_size, rank=0)) // datamodule.batch_size
    limit = trainer_node.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    return batches // int(trainer_node.get("accumulate_grad_batches") or 1) * int(trainer_node.max_epochs)


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


def _task_module(cfg: DictConfig, model: torch.nn.Module, datamodule: Any) -> Any:
    from lgc.lit import ImageClassifier, SemanticSegmenter

    task = getattr(datamodule, "task", "classification")
    if task not in ("classification", "segmentation"):
        raise ValueError(f"data module {type(datamodule).__name__} has an unknown task {task!r}")
    _check_model_fits_task(model, datamodule, task)
    optimizer = hydra.utils.instantiate(cfg.optimizer)
    scheduler = hydra.utils.instantiate(cfg.scheduler) if cfg.get("scheduler") else None
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
    """
    from pytorch_lightning.loggers import WandbLogger

    if spawns_workers and torch.distributed.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialized in the process that launches the workers "
            f"(it holds MASTER_PORT={os.environ.get('MASTER_PORT')}); call torch.distributed.destroy_process_group() "
            "first, or launch with torchrun"
        )
    wandb_loggers = [logger for logger in loggers if isinstance(logger, WandbLogger)]
    saved = {name: os.environ.get(name) for name in ("MASTER_PORT", "WANDB_DIR")}
    if wandb_loggers and wandb_loggers[0].save_dir:
        os.environ["WANDB_DIR"] = str(Path(wandb_loggers[0].save_dir).resolve())
    try:
        if spawns_workers:
            for logger in wandb_loggers:
                _ = logger.experiment
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for logger in wandb_loggers:
            if logger._experiment is not None:
                logger._experiment.finish()


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says and return the run summary (also written to ``output_dir/summary.json``)."""
    import pytorch_lightning as pl

    from lgc.lit import CompressedDDPStrategy, CompressionCallback, RunSummary

    start = time.perf_counter()
    # Validate and build everything in this process, before any worker starts.
    hook_state = build_hook_state(cfg.compressor, cfg.comm)
    check_optimizer_momentum(hook_state, cfg.optimizer.get("momentum", 0.0))
    devices = check_devices(cfg.trainer.accelerator, cfg.trainer.devices, cfg.ddp.oversubscribe)
    world_size = devices * int(cfg.trainer.get("num_nodes") or 1)
    if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path!r} is not a file")
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = _instantiate(cfg.data, "data")
    if isinstance(hook_state, LGCHookState):
        hook_state.set_world_size(world_size)
        total_steps = expected_optimizer_steps(cfg.trainer, datamodule, world_size)
        if total_steps is not None:
            hook_state.check_total_steps(total_steps)
    model = _instantiate(cfg.model, "model", num_classes=datamodule.num_classes, in_channels=datamodule.in_channels)
    module = _task_module(cfg, model, datamodule)
    strategy = CompressedDDPStrategy(
        hook_state,
        start_method="popen" if launched_externally() else cfg.ddp.start_method,
        process_group_backend=cfg.ddp.process_group_backend,
        bucket_cap_mb=cfg.ddp.bucket_cap_mb,
    )
    resolved = OmegaConf.to_container(cfg, resolve=True)
    loggers = [hydra.utils.instantiate(node) for node in (cfg.get("logger") or {}).values() if node is not None]
    callbacks = [
        CompressionCallback(),
        RunSummary(str(output_dir), resolved),
        pl.callbacks.ModelCheckpoint(dirpath=output_dir / "checkpoints", save_last=True, save_top_k=0),
    ]
    # Extra callbacks by name (null drops one), e.g. lgc.analysis.GradientRecorder.
    callbacks += [
        _instantiate(node, f"callbacks.{name}") for name, node in (cfg.get("callbacks") or {}).items() if node
    ]
    trainer = hydra.utils.instantiate(
        cfg.trainer, strategy=strategy, logger=loggers or False, callbacks=callbacks, default_root_dir=str(output_dir)
    )
    with _launch_environment(loggers, spawns_workers=not launched_externally()):
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)

    summary_path = output_dir / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["wall_time_s"] = time.perf_counter() - start
    summary_path.write_text(json.dumps(summary, indent=2, default=str))
    return summary


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    summary = train(cfg)
    ratio = summary["compression_ratio"]
    metrics = " ".join(
        f"{key}={summary[key]:.4f}" for key in ("val/acc", "val/mIoU", "val/pixel_acc") if key in summary
    )
    print(
        f"{metrics or 'no validation metrics'} "
        f"compression_ratio={'n/a' if ratio is None else format(ratio, '.2f')} "
        f"steps={summary['steps']} wall_time={summary['wall_time_s']:.1f}s -> {cfg.output_dir}/summary.json"
    )


if __name__ == "__main__":
    main()
