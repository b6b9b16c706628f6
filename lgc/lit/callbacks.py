"""Lightning callbacks: communication metrics, compressor state in checkpoints, the run summary.

Why one module: the metrics logged during a run and the summary written at its end read one
accounting of the wire (the same per-worker counters gathered the same way, the same ratios), so a
byte logged and a byte summarised cannot drift apart.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.utilities import rank_zero_warn

from lgc.ddp.collectives import CommStats
from lgc.ddp.protocol import HookState
from lgc.lit.checkpoint import (
    load_metric_states,
    load_own_optimizer_state,
    metric_states,
    own_optimizer_state,
    rng_state,
    set_rng_state,
)

__all__ = ["LAYER_COLUMNS", "CompressionCallback", "RunSummary", "ValidateAtMaxSteps", "gather_worker_stats"]

# The counters of CommStats, summed over workers in summaries.
_COUNTS = tuple(field.name for field in fields(CommStats))


def _hook_state(trainer: pl.Trainer) -> HookState:
    state = getattr(trainer.strategy, "hook_state", None)
    if not isinstance(state, HookState):
        raise TypeError(f"expected lgc.lit.CompressedDDPStrategy, the trainer uses {type(trainer.strategy).__name__}")
    return state


def _all_gather_object(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_worker_stats(state: HookState, **extra: Any) -> list[dict[str, Any]]:
    """Every worker's :class:`~lgc.ddp.CommStats` and ``extra`` (its own values) as dicts, on every rank.

    A collective: every rank calls it."""
    return _all_gather_object({**state.stats.as_dict(), **state.summary_extras(), **extra})


def _ratio(dense_bytes: float, sent_bytes: float) -> float | None:
    """Dense over sent bytes; None (null in JSON) when nothing was sent that way, or when what was sent
    carried no gradient (LGC's ``autoencoder_weights`` stage: the codec's weights)."""
    return dense_bytes / sent_bytes if sent_bytes and dense_bytes else None


#: Columns of the per-layer table (``summary.json``'s ``layers`` and wandb's ``comm/layers``).
LAYER_COLUMNS = ("layer", "numel", "compressed", "steps", "bytes_sent", "compression_ratio", "residual_norm")


def _log_layer_table(trainer: pl.Trainer, layers: list[dict[str, Any]]) -> None:
    """The per-layer compression statistics as a wandb Table (``comm/layers``), when wandb logs."""
    from pytorch_lightning.loggers import WandbLogger

    if not layers:
        return
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_table(
                key="comm/layers", columns=list(LAYER_COLUMNS), data=[[row[c] for c in LAYER_COLUMNS] for row in layers]
            )


def _summed(per_worker: list[dict[str, Any]]) -> dict[str, int]:
    """Every :class:`~lgc.ddp.CommStats` count summed over workers (0 for a field a worker lacks)."""
    return {key: sum(worker.get(key, 0) for worker in per_worker) for key in _COUNTS}


def _ratios(total: dict[str, int]) -> dict[str, float | None]:
    """The compression ratios of summed :class:`~lgc.ddp.CommStats` counts (None where nothing was sent)."""
    return {
        # The headline: a dense ring allreduce's wire bytes over the wire bytes sent.
        "compression_ratio": _ratio(total["wire_dense_equivalent_bytes"], total["wire_bytes_sent"]),
        # The same from the tensors handed to the collectives (blind to allgather's (P - 1) copies).
        "logical_compression_ratio": _ratio(total["dense_equivalent_bytes"], total["bytes_sent"]),
        # Without what rank 0 sent as LGC-PS's parameter server (the downstream broadcasts).
        "upstream_compression_ratio": _ratio(
            total["dense_equivalent_bytes"], total["bytes_sent"] - total["server_bytes_sent"]
        ),
        # The compressor's own ratio on the tensors it compresses (small tensors go dense).
        "payload_compression_ratio": _ratio(total["payload_dense_equivalent_bytes"], total["payload_bytes"]),
    }


def _stage_totals(per_worker: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """LGC's per-stage bytes summed over workers, with each stage's compression ratios."""
    names = dict.fromkeys(name for stages in per_worker for name in stages)
    totals: dict[str, dict[str, Any]] = {}
    for name in names:
        total: dict[str, Any] = _summed([stages[name] for stages in per_worker if name in stages])
        totals[name] = {**total, **_ratios(total)}
    return totals


class CompressionCallback(pl.Callback):
    """Logs ``comm/*`` metrics and checkpoints the compressor state of every rank.

    Per training step it logs this worker's ``comm/wire_bytes_up`` and ``comm/wire_bytes_down``
    (wire bytes of the step), ``comm/bytes_up`` and ``comm/bytes_down`` (logical bytes), the
    cumulative ``comm/compression_ratio`` (wire) and ``comm/logical_compression_ratio`` and, with error feedback,
    ``comm/residual_norm``. Checkpoints hold a list with one hook state per rank (residuals differ
    between ranks), each rank's random generators (:func:`lgc.lit.checkpoint.rng_state`) and its
    torchmetrics accumulators (:func:`lgc.lit.checkpoint.metric_states`: a mid-epoch resume logs the
    epoch's ``train/acc`` over the whole epoch); resuming needs the same world size.
    """

    def __init__(self) -> None:
        self._state: HookState | None = None
        self._last = CommStats()
        self._trainer: pl.Trainer | None = None
        # With communication delay, each rank's optimizer state, restored once training starts.
        self._pending_optimizer_states: list[dict[str, Any]] | None = None
        # This rank's random generators from a checkpoint, restored once training starts.
        self._pending_rng: dict[str, Any] | None = None
        # This rank's torchmetrics accumulators from a checkpoint (lgc.lit.checkpoint.metric_states).
        self._pending_metrics: dict[str, Any] | None = None
        # With communication delay, during validation: the synchronized model swapped in (global_model()).
        self._evaluating: contextlib.ExitStack | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._state = _hook_state(trainer)
        self._trainer = trainer
        if self._state.takes_local_steps and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"communication delay counts optimizer steps; trainer.accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} is not supported with it"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._state is not None
        # The epoch every run starts in: a run resumed mid-epoch gets no on_train_epoch_start for
        # it from Lightning, and schedules that follow set_epoch (DGC's warm-up) must hear of it.
        self._state.set_epoch(trainer.current_epoch)
        # With fp16 AMP, compressors must see unscaled gradients (lgc.ddp.hook: CompressionHookState.unscale).
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and self._state.unscales_gradients:
            self._state.loss_scale = scaler.get_scale
        # After Lightning restored rank 0's optimizer state on every rank: put back this rank's own.
        if self._pending_optimizer_states is not None:
            for optimizer, state in zip(trainer.optimizers, self._pending_optimizer_states, strict=True):
                load_own_optimizer_state(optimizer, state)
            self._pending_optimizer_states = None
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None
        if self._pending_metrics is not None:
            load_metric_states(pl_module, self._pending_metrics)
            self._pending_metrics = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Local steps: validate the synchronized (global) model, as DiLoCo and its successors report,
        # and give every rank its own weights and buffers back afterwards (on_validation_end, or
        # on_exception / teardown when validation does not end). A second start without an end
        # raises in global_model() and leaves the first one held, to be closed as usual.
        assert self._state is not None
        evaluating = contextlib.ExitStack()
        evaluating.enter_context(self._state.global_model())
        self._evaluating = evaluating

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_evaluation()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end_evaluation()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end_evaluation()

    def _end_evaluation(self) -> None:
        """Put this rank's local weights and buffers back if validation left the global model in."""
        if self._evaluating is not None:
            evaluating, self._evaluating = self._evaluating, None
            evaluating.close()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._state is not None
        self._state.set_epoch(trainer.current_epoch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        assert self._state is not None
        self._state.after_optimizer_step()
        stats = self._state.stats
        metrics = {
            "comm/bytes_up": float(stats.bytes_sent - self._last.bytes_sent),
            "comm/bytes_down": float(stats.bytes_received - self._last.bytes_received),
            "comm/wire_bytes_up": float(stats.wire_bytes_sent - self._last.wire_bytes_sent),
            "comm/wire_bytes_down": float(stats.wire_bytes_received - self._last.wire_bytes_received),
            "comm/compression_ratio": stats.compression_ratio,
            "comm/logical_compression_ratio": stats.logical_compression_ratio,
            # Steps passed through uncompressed because some rank's gradient was inf/NaN (lgc.ddp.hook).
            "comm/skipped_steps": float(stats.skipped_steps),
        }
        residual_norm = self._state.residual_norm()
        if residual_norm is not None:
            metrics["comm/residual_norm"] = residual_norm
        metrics.update(self._state.metrics())
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        self._last = copy.copy(stats)

    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while a checkpoint is built; rank 0 writes the gathered list.
        assert self._state is not None
        # The random generators too: augmentations and dropout draw from them on every rank.
        state = {**self._state.state_dict(), "rng": rng_state()}
        if self._trainer is not None and not self._trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            # In the middle of an epoch, the epoch's metrics so far (train/acc): Lightning saves none.
            # At an epoch's end they are left out: the next epoch starts them afresh.
            state["metrics"] = metric_states(self._trainer.lightning_module)
        if self._state.takes_local_steps and self._trainer is not None:
            # Between exchanges the ranks' optimizer states (momenta) differ too.
            state = {**state, "optimizers": [own_optimizer_state(opt) for opt in self._trainer.optimizers]}
        return {"per_rank": _all_gather_object(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        assert self._state is not None
        per_rank = state_dict["per_rank"]
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(per_rank) != world:
            raise ValueError(f"the checkpoint holds compressor state of {len(per_rank)} workers, this run has {world}")
        self._state.load_state_dict(per_rank[rank])
        self._pending_optimizer_states = per_rank[rank].get("optimizers")
        self._pending_rng = per_rank[rank].get("rng")
        self._pending_metrics = per_rank[rank].get("metrics")
        self._last = copy.copy(self._state.stats)


class ValidateAtMaxSteps(pl.Callback):
    """Validates a run that ``trainer.max_steps`` stops in the middle of an epoch, at its last step.

    Lightning validates at the end of each epoch; a run whose step budget ends inside an epoch
    would stop with the previous epoch's metrics, or none. At the step that reaches ``max_steps``
    this asks the trainer to stop, which Lightning answers by validating on that step, so the
    summary's metrics are those of the final model. A budget ending on an epoch's last step is
    validated once, as usual.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values, None if any is None (a worker that timed no step)."""
    return None if not values or any(v is None for v in values) else sum(values) / len(values)  # type: ignore[arg-type]


def _environment(world_size: int) -> dict[str, Any]:
    """What a run's times depend on, for its summary: software versions and the CPUs it shared."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "workers": world_size,
    }


class RunSummary(pl.Callback):
    """Writes ``summary.json`` (rank 0) at the end of training.

    Fields: final metrics (``val/acc``, ...) with ``validated_step`` (the step of the validation they
    come from: ``steps`` unless ``trainer.check_val_every_n_epoch`` or ``val_check_interval`` skipped
    the last one, which is warned of; None where this segment never validated), ``steps``, ``epochs``
    (epochs begun, one stopped in its middle by ``trainer.max_steps`` included), per-worker wire bytes (``wire_*``: what
    the collectives' algorithms put on the network, :mod:`lgc.ddp.wire`) and logical bytes (the
    tensors handed to them) sent/received, their dense equivalents, ``compression_ratio`` (wire
    bytes of a dense ring allreduce over wire bytes sent), ``logical_compression_ratio``,
    ``payload_compression_ratio``, ``hook_calls``, ``fit_time_s``, ``step_cpu_time_ms`` (the CPU
    time of a training step, forward to optimizer step, communication included, as the worker's
    process spent it in all its threads: the mean over the steps this process ran (a resumed run's
    since its resumption) and over workers; each worker's own in ``workers``; unlike wall time it
    does not grow when workers share cores), ``eval_model`` (``global``:
    validation saw the synchronized model; with communication delay every fragment's last
    synchronized weights and the buffers of the last exchange, otherwise the model every rank
    shares), ``buffer_sync`` (how module buffers were kept in step: ``broadcast``, rank 0's sent
    to every rank once per step, ``average``, averaged over the workers once per step,
    ``average_at_exchange``, or ``none`` for a model built with ``broadcast_buffers=False``;
    :mod:`lgc.ddp.buffers`) with
    ``wire_buffer_bytes_sent`` (their bytes, part of ``wire_bytes_sent``), the resolved config, and
    ``environment`` (torch and Python versions, the machine's CPU count, rank 0's torch threads,
    the workers: what ``fit_time_s`` depends on), ``hydra``: the option of every config group and
    the overrides the run was given (:func:`lgc.train.hydra_record`; what ``lgc-report`` labels runs by), when known,
    ``provenance``: the commit the run's code came from, whether its tracked files had changes, and
    the versions of lgc, torch, Lightning and torchvision (:func:`lgc.provenance.run_provenance`); a run
    resumed from a checkpoint adds ``earlier_segments``, each earlier segment's provenance, fit time
    and last saved step (the checkpoints carry them), since ``fit_time_s`` is this segment's. An
    LGC run also writes its trained codec to ``codec.pt`` (``lgc_codec``), which another run can
    start from with ``compressor.training.autoencoder.init=PATH``.
    ``lgc.train.train`` adds ``wall_time_s`` (including process start-up) afterwards.
    """

    def __init__(
        self,
        output_dir: str,
        config: dict[str, Any] | None = None,
        hydra: dict[str, Any] | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.config = config or {}
        self.hydra = hydra
        self.provenance = provenance
        self._start = time.perf_counter()
        # CPU seconds spent in training steps, the steps timed, and the current step's start.
        self._step_cpu_s, self._timed_steps, self._batch_cpu = 0.0, 0, None
        #: What the checkpoint this run resumed from recorded of the run's earlier segments.
        self.earlier_segments: list[dict[str, Any]] = []
        self._step = 0
        #: The step of this segment's last validation (not the sanity check), None before any.
        self._validated_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """In every checkpoint: the segments so far, this one as of the checkpoint's step."""
        # Plain JSON values (torch's version string is a class of its own, which weights-only loading refuses).
        provenance = json.loads(json.dumps(self.provenance))
        now = {"provenance": provenance, "fit_time_s": time.perf_counter() - self._start, "step": self._step}
        return {"segments": [*self.earlier_segments, now]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.earlier_segments = list(state_dict["segments"])

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._step_cpu_s, self._timed_steps, self._batch_cpu = 0.0, 0, None
        # The resolved run config, in every logger (wandb's run config, CSV's hparams.yaml).
        if self.config:
            for logger in trainer.loggers:
                logger.log_hyperparams(self.config)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._batch_cpu = time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._batch_cpu is not None:
            self._step_cpu_s += time.process_time() - self._batch_cpu
            self._timed_steps += 1
            self._batch_cpu = None
        self._step = trainer.global_step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step_cpu_ms = 1000 * self._step_cpu_s / self._timed_steps if self._timed_steps else None
        state = _hook_state(trainer)
        state.settle()  # an exchange still in flight (Streaming DiLoCo's overlap) has its bytes counted
        workers = gather_worker_stats(state, step_cpu_time_ms=step_cpu_ms)
        if trainer.global_rank != 0:
            return
        # One per-layer table (rank 0's; every worker sends the same layers) rather than one per worker.
        layers = [w.pop("layers", []) for w in workers][0]
        total = _summed(workers)
        summary = {
            "metrics": {
                k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, (torch.Tensor, float))
            },
            "steps": trainer.global_step,
            "validated_step": self._validated_step,
            "epochs": trainer.current_epoch,
            "world_size": trainer.world_size,
            "compressor": _hook_state(trainer).describe(),
            "workers": workers,
            "bytes_sent_per_worker": [w["bytes_sent"] for w in workers],
            "bytes_received_per_worker": [w["bytes_received"] for w in workers],
            "dense_equivalent_bytes_per_worker": [w["dense_equivalent_bytes"] for w in workers],
            # Bytes on the network by each collective's algorithm (lgc.ddp.wire), and plain DDP's.
            "wire_bytes_sent_per_worker": [w["wire_bytes_sent"] for w in workers],
            "wire_bytes_received_per_worker": [w["wire_bytes_received"] for w in workers],
            "wire_dense_equivalent_bytes_per_worker": [w["wire_dense_equivalent_bytes"] for w in workers],
            "wire_bytes_sent": total["wire_bytes_sent"],
            "wire_dense_equivalent_bytes": total["wire_dense_equivalent_bytes"],
            "hook_calls": total["hook_calls"],
            # Which model validation saw, and how module buffers (BatchNorm statistics) were kept in step.
            "eval_model": _hook_state(trainer).eval_model,
            "buffer_sync": _hook_state(trainer).buffer_sync.mode,
            "wire_buffer_bytes_sent": total["wire_buffer_bytes_sent"],
            # Every rank skips the same steps (they agree on it); the count is rank 0's.
            "skipped_steps": workers[0].get("skipped_steps", 0),
            **_ratios(total),
            "fit_time_s": time.perf_counter() - self._start,
            "step_cpu_time_ms": _mean([w["step_cpu_time_ms"] for w in workers]),
            # Where the times were measured (runs of one sweep may come from several machines).
            "environment": _environment(trainer.world_size),
            "config": self.config,
        }
        if self.hydra is not None:
            summary["hydra"] = self.hydra
        if self.provenance is not None:
            summary["provenance"] = self.provenance
        if self.earlier_segments:
            summary["earlier_segments"] = self.earlier_segments
        if all("lgc" in w for w in workers):
            summary["lgc_stages"] = _stage_totals([w["lgc"]["stages"] for w in workers])
            summary["lgc_refreshes"] = workers[0]["lgc"].get("refreshes", 0)  # decided alike on every rank
            if "true_error" in workers[0]["lgc"]:
                # measure_error: delivered against exact sums at the leader's positions, the same on every rank.
                summary["lgc_true_error"] = workers[0]["lgc"]["true_error"]
            if "premise" in workers[0]["lgc"]:
                # The same on every rank (gathered): r and the energy share at the leader's positions.
                summary["lgc_premise"] = workers[0]["lgc"]["premise"]
        top_level = ("val/acc", "val/loss", "val/mIoU", "val/pixel_acc")
        summary.update({k: summary["metrics"][k] for k in top_level if k in summary["metrics"]})
        if any(k in summary for k in top_level) and self._validated_step != trainer.global_step:
            rank_zero_warn(
                f"summary.json's validation metrics are those of step {self._validated_step}, not of the final "
                f"model (step {trainer.global_step}): trainer.check_val_every_n_epoch or val_check_interval "
                "skipped the last validation"
            )
        summary["layers"] = layers
        self.output_dir.mkdir(parents=True, exist_ok=True)
        state = _hook_state(trainer)
        if state.save_codec(self.output_dir / "codec.pt") is not None:
            # LGC's trained codec, for another run's training.autoencoder.init.
            summary["lgc_codec"] = str(self.output_dir / "codec.pt")
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        _log_layer_table(trainer, layers)
