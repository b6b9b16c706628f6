"""``train(cfg)``: one Hydra config in, one trained model and ``summary.json`` out.

``lgc-train`` is a thin Hydra wrapper around :func:`train`. Every value is checked here, in the
launching process, before any worker process starts; a bad value raises an error that names it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from lgc.compressors import Compressor, ErrorFeedback
from lgc.compressors.dgc import check_optimizer_momentum
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.torch_hooks import TorchHookState

__all__ = ["build_compressor", "build_hook_state", "check_devices", "main", "train"]


def _instantiate(node: Any, what: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``, re-raising a constructor's own error type, prefixed with the group."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, (ValueError, TypeError, FileNotFoundError)):
            raise type(cause)(f"{what}: {cause}") from err
        raise


def build_compressor(node: DictConfig | dict[str, Any]) -> Compressor | TorchHookState:
    """Instantiate a ``compressor`` config node; ``error_feedback: true`` wraps it in :class:`ErrorFeedback`."""
    kwargs = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    with_error_feedback = bool(kwargs.pop("error_feedback", False))
    built = _instantiate(kwargs, "compressor")
    if isinstance(built, TorchHookState):
        if with_error_feedback:
            raise ValueError(f"compressor.error_feedback=true does not apply to PyTorch's {built.describe()} hook")
        return built
    if not isinstance(built, Compressor):
        raise TypeError(f"compressor._target_={kwargs.get('_target_')!r} did not build an lgc Compressor")
    return ErrorFeedback(built) if with_error_feedback else built


def build_hook_state(
    compressor_node: DictConfig, comm_node: DictConfig
) -> CompressionHookState | TorchHookState | CommunicationDelayState:
    """The hook state for ``cfg.compressor`` and ``cfg.comm``.

    ``cfg.compressor`` builds either an lgc :class:`Compressor` (``error_feedback: true`` wraps it in
    :class:`ErrorFeedback`; ``cfg.comm`` configures the hook) or one of PyTorch's hooks wrapped by
    :mod:`lgc.ddp.torch_hooks`. ``comm.delay: n`` switches to SBC's communication delay: ``n``
    local steps, then an exchange of the compressed weight update (:mod:`lgc.ddp.local_sgd`).
    """
    delay = comm_node.get("delay")
    compressor = build_compressor(compressor_node)
    if isinstance(compressor, TorchHookState):
        if delay is not None:
            raise ValueError(
                f"comm.delay={delay!r} needs an lgc compressor, not PyTorch's {compressor.describe()} hook"
            )
        return compressor
    if delay is not None:
        return CommunicationDelayState(compressor, delay=delay, min_numel=comm_node.min_numel)
    return CompressionHookState(compressor, min_numel=comm_node.min_numel, start_iter=comm_node.start_iter)


def check_devices(accelerator: str, devices: Any, oversubscribe: bool) -> int:
    """Number of worker processes per node; an error names a count this machine cannot run."""
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


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says and return the run summary (also written to ``output_dir/summary.json``)."""
    import pytorch_lightning as pl

    from lgc.lit import CompressedDDPStrategy, CompressionCallback, ImageClassifier, RunSummary

    start = time.perf_counter()
    # Validate and build everything in this process, before any worker starts.
    hook_state = build_hook_state(cfg.compressor, cfg.comm)
    check_optimizer_momentum(hook_state, cfg.optimizer.get("momentum", 0.0))
    check_devices(cfg.trainer.accelerator, cfg.trainer.devices, cfg.ddp.oversubscribe)
    if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).is_file():
        raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path!r} is not a file")
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = _instantiate(cfg.data, "data")
    model = _instantiate(cfg.model, "model", num_classes=datamodule.num_classes, in_channels=datamodule.in_channels)
    module = ImageClassifier(
        model,
        num_classes=datamodule.num_classes,
        optimizer=hydra.utils.instantiate(cfg.optimizer),
        scheduler=hydra.utils.instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
    )
    strategy = CompressedDDPStrategy(
        hook_state,
        start_method=cfg.ddp.start_method,
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
    trainer = hydra.utils.instantiate(
        cfg.trainer, strategy=strategy, logger=loggers or False, callbacks=callbacks, default_root_dir=str(output_dir)
    )
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
    print(
        f"val/acc={summary.get('val/acc', float('nan')):.4f} "
        f"compression_ratio={'n/a' if ratio is None else format(ratio, '.2f')} "
        f"steps={summary['steps']} wall_time={summary['wall_time_s']:.1f}s -> {cfg.output_dir}/summary.json"
    )


if __name__ == "__main__":
    main()
