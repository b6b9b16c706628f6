"""Learned Gradient Compression: the hook state both topologies (and the shared-index ablations) share.

Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep
Learning" (IEEE TNNLS 2021, arXiv:2103.08870). Gradients of different workers are correlated; a
codec (the autoencoder) trained on them during the first stages of training captures their common
information, so it need not be sent by every worker. One small module per job:

* :mod:`lgc.ddp.lgc_schedule`: the stages (warm-up, codec training, compressed) and the refresh;
* :mod:`lgc.ddp.lgc_plan`: a step's compressed parameters as one cat-space vector;
* :mod:`lgc.ddp.lgc_codec`: the leader's positions and the values there (order, chunks, scales,
  index code);
* :mod:`lgc.ddp.lgc_samples`: stage 2's samples, gathered at rank 0 for the codec's trainer;
* this module: the hook state that runs them, bucket by bucket, behind the step guard;
* :mod:`lgc.ddp.lgc_rar`, :mod:`lgc.ddp.lgc_ps`, :mod:`lgc.ddp.shared_index`: the compressed
  stage of each topology or ablation.

Stage 2 (codec training): workers communicate top-k (values + int32 indices, error feedback)
exactly like ``compressor=topk``, and every worker's error-corrected gradient at the leader's
positions is gathered at rank 0, which trains the codec on it (``ae_updates_per_step`` updates per
step). Its bytes are counted with the stage's; the trained weights' broadcast apart
(``autoencoder_weights``). Every collective is issued inside the hook, in the same order on every rank.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lgc.autoencoder import (
    AutoencoderConfig,
    AutoencoderTrainer,
    GradientAutoencoder,
    LossWeights,
)
from lgc.autoencoder.saved import load_codec_into, read_codec, save_codec
from lgc.compressors.error_feedback import ErrorFeedback
from lgc.compressors.topk import TopKCompressor
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.lgc_codec import LeaderIndexCodec
from lgc.ddp.lgc_plan import StepPlan, plan_step
from lgc.ddp.lgc_samples import CodecTrainingOps, Sample
from lgc.ddp.lgc_schedule import LGCStage, StageSchedule
from lgc.ddp.lgc_stage_ops import LATENT_DTYPES, CompressedStageOps
from lgc.ddp.step_guard import PendingBucket

__all__ = ["LGCHookState", "LGCStage", "StepPlan", "lgc_hook"]


class LGCHookState(CodecTrainingOps, CompressedStageOps, CompressionHookState):
    """State of an LGC hook: stages, the codec and its trainer, error feedback.

    Subclasses implement the compressed stage (:meth:`_compressed_step`), the codec they need and
    how its weights reach the workers (:meth:`_distribute_weights`). Register with
    :meth:`register` (or ``lgc.lit``'s strategy).

    Args:
        density: top-k density of the leader's selection and of stage 2 (``k = ceil(density * n)``
            per parameter). The paper uses 0.001.
        warmup_steps, warmup, warmup_densities, ae_steps, refresh_threshold, refresh_patience,
            refresh_steps: the stages (:class:`~lgc.ddp.lgc_schedule.StageSchedule`).
        ae_updates_per_step: codec optimizer steps per training step in stage 2.
        autoencoder: :class:`~lgc.autoencoder.AutoencoderConfig` fields (``chunk``,
            ``encoder_channels``, ``latent_channels``, ``decoder_channels``, ``decoder``, ``seed``),
            and ``init``: the path of a ``codec.pt`` saved by an earlier run (:meth:`save_codec`;
            ``lgc-train`` writes one beside ``summary.json``) whose weights start this codec. Stage 2
            then fine-tunes them, or, with ``ae_steps=0``, is skipped: every worker loads the same
            weights, so none are broadcast. A codec of another shape is refused.
        ae_optimizer / ae_lr / ae_batch_size / ae_buffer_size: the autoencoder's trainer
            (:class:`~lgc.autoencoder.AutoencoderTrainer`).
        loss_weights: :class:`~lgc.autoencoder.LossWeights` fields (``reconstruction``,
            ``similarity``, ``mean``).
        leader_rank: the worker whose top-k positions everyone uses (a fixed leader).
        rotate_leader: the leader of step ``t`` is worker ``t % world_size`` instead (ScaleCom's
            cyclic leader: spreads the leader's extra upload, and every worker's big coordinates
            get their turn). A ``leader_rank`` other than 0 with it is refused. LGC-RAR and the
            shared-index codecs rotate by default (:mod:`lgc.ddp.lgc_rar` and
            :mod:`lgc.ddp.shared_index` say what it measured); LGC-PS keeps the server as its
            fixed leader (:mod:`lgc.ddp.lgc_ps` says why).
        index_coding, value_order: the leader's wire layout (:class:`~lgc.ddp.lgc_codec.LeaderIndexCodec`).
        latent_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` latents on the wire.
        measure_error: diagnostics: every compressed step also sums the workers' exact values at the
            leader's positions (one more fp32 allreduce of ``K`` values, **not** counted in the
            bytes) and logs the relative error of what the codec delivered there
            (``lgc/true_error``; its run-wide value in the summary). Off by default.
        world_size: number of workers, if known before the workers start (checks ``leader_rank``
            early; LGC-PS builds one decoder per worker). Otherwise taken at :meth:`register`.
        min_numel: parameters with fewer elements are allreduced dense (``None``: 1,024, the
            default of its top-k, :func:`~lgc.compressors.base.method_min_numel`).
        process_group: the group to communicate in (default: the world).
    """

    #: Whether rank 0 is a parameter server (its broadcasts and sends count as server traffic).
    has_server = False
    #: The smallest ``ae_steps`` this state allows (0 for codecs that learn nothing).
    min_ae_steps = 1

    __slots__ = (
        "density",
        "schedule",  # the stages and the refresh state
        "leader_code",  # the leader's positions and values on the wire
        "ae_updates_per_step",
        "ae_config",
        "trainer_options",
        "leader_rank",
        "rotate_leader",
        "latent_dtype",
        "world_size",
        "measure_error",
        "error_sums",  # [sum of squared errors, sum of squared exact sums] over the measured steps
        "ae_init",  # path of a saved codec that starts this one (autoencoder.init), or None
        "trainer",  # the codec, its optimizer and sample buffer (the buffer only on rank 0)
        "stage",  # stage of the current step
        "current_step",  # the step the hook is in (its first bucket starts it)
        "leader",  # leader of the current step
        "weights_sent",  # whether the workers hold the trained weights (stage 3 may start)
        "step_error",  # [sum of error * K, sum of K] of the current compressed step
        "last_metrics",  # the latest lgc/* values, for logging
        "param_order",  # parameter name -> position in the model (per process, from attach())
        "samples",  # stage-2 samples of the current step's buckets, joined at its last bucket
        "stage_stats",  # stage name -> CommStats of the steps spent in it
        "stats_mark",  # stats at the start of the current step
    )

    def __init__(
        self,
        *,
        density: float = 0.001,
        warmup_steps: int = 100,
        warmup: str = "dense",
        warmup_densities: list[float] | None = None,
        ae_steps: int = 300,
        ae_updates_per_step: int = 1,
        autoencoder: dict[str, Any] | AutoencoderConfig | None = None,
        ae_optimizer: str = "adam",
        ae_lr: float = 1e-3,
        ae_batch_size: int = 64,
        ae_buffer_size: int = 4096,
        loss_weights: dict[str, float] | None = None,
        leader_rank: int = 0,
        rotate_leader: bool = False,
        index_coding: str = "raw",
        latent_dtype: str = "float32",
        value_order: str = "value",
        refresh_threshold: float | None = None,
        refresh_patience: int = 5,
        refresh_steps: int | None = None,
        measure_error: bool = False,
        world_size: int | None = None,
        min_numel: int | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            ErrorFeedback(TopKCompressor(density)), min_numel=min_numel, start_iter=0, process_group=process_group
        )
        if isinstance(autoencoder, Mapping):  # a dict, or Hydra's DictConfig
            autoencoder = dict(autoencoder)
            init = autoencoder.pop("init", None)
        else:
            init = None
        self.ae_init: str | None = None if init is None else str(init)
        if self.ae_init is not None:
            read_codec(self.ae_init)  # a missing or foreign file is named before any worker starts
        self.schedule = StageSchedule(
            warmup_steps=warmup_steps,
            ae_steps=ae_steps,
            warmup=warmup,
            warmup_densities=warmup_densities,
            density=density,
            refresh_threshold=refresh_threshold,
            refresh_patience=refresh_patience,
            refresh_steps=refresh_steps,
            # A warm-started codec may skip its training stage.
            min_ae_steps=0 if self.ae_init is not None else self.min_ae_steps,
        )
        if isinstance(ae_updates_per_step, bool) or not isinstance(ae_updates_per_step, int) or ae_updates_per_step < 0:
            raise ValueError(f"ae_updates_per_step must be an integer >= 0, got {ae_updates_per_step!r}")
        if latent_dtype not in LATENT_DTYPES:
            raise ValueError(f"latent_dtype must be one of {sorted(LATENT_DTYPES)}, got {latent_dtype!r}")
        if isinstance(leader_rank, bool) or not isinstance(leader_rank, int) or leader_rank < 0:
            raise ValueError(f"leader_rank must be a rank (an integer >= 0), got {leader_rank!r}")
        if rotate_leader and leader_rank != 0:
            raise ValueError(
                f"leader_rank={leader_rank} fixes the leader, but rotate_leader=True lets worker "
                "step % world_size lead each step: set rotate_leader=false to keep that leader"
            )
        if world_size is not None:
            self._check_world(int(world_size), leader_rank)
        if isinstance(autoencoder, AutoencoderConfig):
            ae_config = autoencoder
        else:
            ae_config = AutoencoderConfig.from_kwargs(**(autoencoder or {}))
        self.leader_code = LeaderIndexCodec(ae_config.chunk, value_order, index_coding)
        self.density = float(density)
        self.ae_updates_per_step = ae_updates_per_step
        self.ae_config = self._autoencoder_config(ae_config, world_size)
        self.trainer_options = dict(
            optimizer=ae_optimizer,
            lr=ae_lr,
            batch_size=ae_batch_size,
            buffer_size=ae_buffer_size,
            weights=LossWeights(**(loss_weights or {})),
            seed=ae_config.seed,
        )
        self.leader_rank = leader_rank
        self.rotate_leader = bool(rotate_leader)
        self.latent_dtype = latent_dtype
        self.world_size = None if world_size is None else int(world_size)
        self.measure_error = bool(measure_error)
        self.error_sums = [0.0, 0.0]
        self.trainer: Any = None
        if self.world_size is not None:
            self._build_trainer()
        self.stage = LGCStage.WARMUP
        self.current_step = -1
        self.leader = leader_rank
        # Warm-started and not retrained: every worker already holds the same weights.
        self.weights_sent = self.ae_init is not None and self.ae_steps == 0
        self.step_error = [0.0, 0.0]
        self.last_metrics: dict[str, float] = {}
        self.param_order: dict[str, int] = {}
        self.samples: list[Sample] = []
        self.stage_stats: dict[str, CommStats] = {}
        self.stats_mark = CommStats()

    # The stage knobs live in the schedule, the layout knobs in the leader's code.
    warmup_steps = property(lambda self: self.schedule.warmup_steps)
    ae_steps = property(lambda self: self.schedule.ae_steps)
    warmup = property(lambda self: self.schedule.warmup)
    refresh_threshold = property(lambda self: self.schedule.refresh_threshold)
    refreshes = property(lambda self: self.schedule.refreshes)
    value_order = property(lambda self: self.leader_code.value_order)
    index_coding = property(lambda self: self.leader_code.index_coding)

    # -- what the topologies define -------------------------------------------------------------
    def _autoencoder_config(self, config: AutoencoderConfig, world_size: int | None) -> AutoencoderConfig:
        """The autoencoder this topology needs (one decoder; LGC-PS: one per worker, innovation)."""
        return config

    def _make_trainer(self) -> Any:
        """The codec and its trainer (:class:`~lgc.autoencoder.AutoencoderTrainer` by default)."""
        return AutoencoderTrainer(GradientAutoencoder(self.ae_config), **self.trainer_options)

    def _compressed_step(self, plan: StepPlan) -> None:
        """Average the step's gradients in place (every bucket of the step at once), blocking."""
        raise NotImplementedError

    def _distribute_weights(self) -> None:
        """Send the trained weights from rank 0 to the workers that need them (a collective)."""
        raise NotImplementedError

    # -- setup ------------------------------------------------------------------------------------
    def _check_world(self, world_size: int, leader_rank: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size!r}")
        if not 0 <= leader_rank < world_size:
            raise ValueError(f"leader_rank={leader_rank} is outside the world of {world_size} worker(s)")

    def check_total_steps(self, total_steps: int) -> None:
        """Refuse stage lengths that leave no compressed stage in a run of ``total_steps`` steps."""
        self.schedule.check_total_steps(total_steps)

    def stage_at(self, step: int) -> LGCStage:
        """The scheduled stage of ``step`` (refreshes aside)."""
        return self.schedule.stage_at(step)

    def set_world_size(self, world_size: int) -> None:
        """Fix the number of workers before they start (checks the leader; LGC-PS sizes its decoders)."""
        self._check_world(world_size, self.leader_rank)
        if self.world_size != world_size or self.trainer is None:
            self.world_size = world_size
            self._build_trainer()

    def _build_trainer(self) -> None:
        assert self.world_size is not None
        self.ae_config = self._autoencoder_config(self.ae_config, self.world_size)
        self.trainer = self._make_trainer()
        if self.ae_init is not None:
            load_codec_into(self.trainer.autoencoder, self.ae_init)
            if self.ae_steps == 0:
                self.trainer.autoencoder.eval()

    def save_codec(self, path: str | Path) -> Path | None:
        """Write the workers' codec to ``path`` for ``autoencoder.init`` (``None``: it was never trained or loaded)."""
        if not self.weights_sent or self.trainer is None:
            return None
        return save_codec(self.trainer.autoencoder, path)

    def attach(self, model: DistributedDataParallel) -> None:
        super().attach(model)
        self.param_order = {name: i for i, (name, _) in enumerate(model.module.named_parameters())}

    needs_total_steps = True

    def codec_times(self) -> dict[str, float] | None:
        """None: LGC codes inside its own step, between its collectives (no separate encode/decode figures)."""
        return None

    def check_run(self, model: torch.nn.Module, world_size: int, total_steps: int | None) -> None:
        """Fix the world size (checks the leader) and refuse stages that leave no compressed stage."""
        self.set_world_size(world_size)
        if total_steps is not None:
            self.check_total_steps(total_steps)

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Attach to ``model`` and register :func:`lgc_hook` with this state (``optimizer`` is not needed)."""
        world_size = dist.get_world_size(self.process_group)
        if self.world_size is not None and self.world_size != world_size:
            raise ValueError(f"LGC was configured for {self.world_size} workers but the group has {world_size}")
        self._check_world(world_size, self.leader_rank)
        if self.trainer is None:
            self.world_size = world_size
            self._build_trainer()
        self.attach(model)
        self.buffer_sync = module_buffers.register_comm_hook(model, self, lgc_hook)

    @property
    def ef(self) -> ErrorFeedback:
        return self.compressor  # type: ignore[return-value]

    @property
    def topk(self) -> TopKCompressor:
        return self.ef.compressor  # type: ignore[return-value]

    @property
    def autoencoder(self) -> Any:
        """The codec (:class:`~lgc.autoencoder.GradientAutoencoder` unless a subclass trains another)."""
        assert self.trainer is not None, "call register(model) first"
        return self.trainer.autoencoder

    def describe(self) -> str:
        return (
            f"{type(self).__name__}(density={self.density}, warmup_steps={self.warmup_steps} ({self.warmup}), "
            f"ae_steps={self.ae_steps}, chunk={self.ae_config.chunk}, latent={self.latent_dtype}, "
            f"indices={self.index_coding}, leader={'rotating' if self.rotate_leader else self.leader_rank}"
            + (f", init={self.ae_init}" if self.ae_init is not None else "")
            + ")"
        )

    # -- stages -----------------------------------------------------------------------------------
    def _begin_step(self, step: int, device: torch.device) -> None:
        """Called at the first bucket of every step, on every rank alike."""
        if step == self.current_step:
            return
        previous = self.stage
        weight = self.step_error[1]
        self.stage = self.schedule.next_stage(step, previous, self.step_error[0] / weight if weight > 0 else None)
        self.step_error = [0.0, 0.0]
        self.current_step = step
        # The step's bytes so far (its module buffers and the step guard, spent before the stage
        # was known) belong to this step's stage.
        self._book_stage_bytes()
        self.leader = step % self.world_size if self.rotate_leader else self.leader_rank  # type: ignore[operator]
        codec_weight = next(self.trainer.autoencoder.parameters(), None)
        if codec_weight is not None and codec_weight.device != device:
            self.trainer.to(device)
        if self.stage is LGCStage.AUTOENCODER_TRAINING and previous is LGCStage.COMPRESSED:
            # A refresh: train on fresh samples only; the workers need the new weights afterwards.
            self.trainer.clear_buffer()
            self.weights_sent = False
        if self.stage is LGCStage.COMPRESSED and not self.weights_sent:
            self._distribute_weights()
            self.weights_sent = True
            # A one-off cost per (re)training, booked apart from the per-step traffic.
            self._book_stage_bytes("autoencoder_weights")
        self.last_metrics["lgc/stage"] = float(self.stage)

    def _book_stage_bytes(self, name: str | None = None) -> None:
        """Add the communication since the last mark to ``name`` (default: the current stage)."""
        if self.current_step < 0 and name is None:
            return
        now, mark = self.stats, self.stats_mark
        booked = self.stage_stats.setdefault(name or self.stage.name.lower(), CommStats())
        for key in (f.name for f in fields(CommStats)):
            setattr(booked, key, getattr(booked, key) + getattr(now, key) - getattr(mark, key))
        self.stats_mark = CommStats(**vars(now))

    # -- per step -------------------------------------------------------------------------------
    def process_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Hold the bucket; the whole step runs at its last bucket, behind the step guard.

        Every stage needs the whole step: the guard (:meth:`CompressionHookState.agree`) decides
        before any state moves, and the compressed stage encodes all parameters as one vector.
        DDP waits for the buckets' futures only at the end of the backward pass.
        """
        world_size = dist.get_world_size(self.process_group)
        buffer = bucket.buffer()
        self.unscale(buffer, world_size)
        self.stats.hook_calls += 1
        counted.book_dense_equivalent(self.stats, buffer, self.process_group)
        return self.defer(buffer, self.layout(bucket).segments, bucket.is_last())

    def run_step(self, pending: list[PendingBucket]) -> None:
        skipped = self.stats.skipped_steps
        super().run_step(pending)
        # Every step's bytes go to its stage; a skipped step's (guard and dense pass-through) to "skipped".
        self._book_stage_bytes("skipped" if self.stats.skipped_steps > skipped else None)

    def compress_step(self, pending: list[PendingBucket], used: frozenset[str], step: int) -> None:
        self._begin_step(step, pending[0].buffer.device)
        if self.stage is LGCStage.WARMUP:
            dense = step == 0 or self.warmup == "dense" or not any(s.compressed for b in pending for s in b.segments)
            if dense:
                for bucket in pending:
                    for s in bucket.segments:
                        self.book_layer(s.name, s.numel, False, s.numel * bucket.buffer.element_size())
                self.allreduce_dense(pending)
                return
            self.topk.density = self.schedule.warmup_density(step)
            super().compress_step(pending, used, step)
            return
        if self.stage is LGCStage.AUTOENCODER_TRAINING:
            self.topk.density = self.density
            self._codec_training_step(pending, used, step)
        else:
            # Compressed: the whole model's values form one vector.
            self._compressed_step(plan_step(pending, used, self.param_order, self.density))
        for bucket in pending:
            bucket.future.set_result(bucket.buffer)

    def __getstate__(self) -> dict[str, Any]:
        # Per-process and per-step state stays behind (spawned workers attach anew).
        return {**super().__getstate__(), "param_order": {}, "samples": []}

    # -- logging, summaries, checkpoints ----------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return dict(self.last_metrics)

    def summary_extras(self) -> dict[str, Any]:
        self._book_stage_bytes()
        stages = {name: vars(s).copy() for name, s in self.stage_stats.items()}
        lgc = {"stages": stages, "refreshes": self.refreshes, "autoencoder": repr(self.trainer.autoencoder)}
        if self.error_sums[1] > 0:
            lgc["true_error"] = self.error_sums[0] / self.error_sums[1]
        return {**super().summary_extras(), "lgc": lgc}

    def state_dict(self) -> dict[str, Any]:
        assert self.trainer is not None
        return {
            **super().state_dict(),
            **self.schedule.state_dict(),
            "trainer": self.trainer.state_dict(),
            "world_size": self.world_size,
            "stage": int(self.stage),
            "current_step": self.current_step,
            "weights_sent": self.weights_sent,
            "step_error": list(self.step_error),
            "error_sums": list(self.error_sums),
            "last_metrics": dict(self.last_metrics),
            "stage_stats": {name: vars(s).copy() for name, s in self.stage_stats.items()},
            "stats_mark": vars(self.stats_mark).copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.trainer is None:
            self.world_size = state["world_size"]
            self._build_trainer()
        self.trainer.load_state_dict(state["trainer"])
        self.schedule.load_state_dict(state)
        self.stage = LGCStage(state["stage"])
        self.current_step = int(state["current_step"])
        self.weights_sent = bool(state["weights_sent"])
        self.step_error = list(state["step_error"])
        self.error_sums = list(state["error_sums"])
        self.last_metrics = dict(state["last_metrics"])
        self.stage_stats = {name: CommStats(**s) for name, s in state["stage_stats"].items()}
        self.stats_mark = CommStats(**state["stats_mark"])


def lgc_hook(state: LGCHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket of gradients with LGC (register through ``state.register(model)``)."""
    return state.process_bucket(bucket)
