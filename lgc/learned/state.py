"""Learned Gradient Compression: the one hook state that LGC-RAR, LGC-PS and the shared-index codecs are.

Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep
Learning" (IEEE TNNLS 2021, arXiv:2103.08870). Gradients of different workers are correlated; a
codec (the autoencoder) trained on them during the first stages of training captures their common
information, so it need not be sent by every worker.

:class:`LGCHookState` runs the stages bucket by bucket behind the step guard and holds its parts:

* the **schedule** (:class:`~lgc.learned.schedule.StageSchedule`): warm-up, codec training,
  compressed, and the refresh that goes back;
* the **leaders** (:class:`~lgc.learned.step.Leaders`) and the **leader's code**
  (:class:`~lgc.learned.leader_code.LeaderIndexCodec`): whose positions, in what order and code;
* the **codec training** (:class:`~lgc.learned.training.CodecTraining`, none for codecs that learn
  nothing): the trainer, stage 2's samples, the weights the workers get;
* the **compressed stage** of its topology (:class:`~lgc.learned.step.CompressedStage`: LGC-RAR's,
  LGC-PS's or a shared-index one), given one :class:`~lgc.learned.step.StepContext` per step;
* the **byte book** (:class:`~lgc.learned.byte_book.StageByteBook`) and the diagnostic error
  (:class:`~lgc.learned.step.DeliveredError`).

The public classes (:class:`~lgc.learned.rar.LGCRingAllreduceState`,
:class:`~lgc.learned.ps.LGCParameterServerState`, :class:`~lgc.learned.shared_index.SharedIndexState`)
only assemble these parts from their knobs. Every collective is issued inside the hook, in the
same order on every rank.

Why one module: LGC's one hook state composes the parts of :mod:`lgc.learned` (the schedule, the
leader's code, codec training, the compressed stage) and owns the step that runs them in order,
its checkpoint and its summary; the parts live in modules of their own.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.error_feedback import ErrorFeedback
from lgc.compressors.topk import TopKCompressor
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.step_guard import PendingBucket, complete_dense
from lgc.learned.byte_book import StageByteBook
from lgc.learned.knobs import LeaderChoice, Stages
from lgc.learned.leader_code import LeaderIndexCodec
from lgc.learned.plan import plan_step
from lgc.learned.schedule import LGCStage, StageSchedule
from lgc.learned.step import CompressedStage, DeliveredError, Leaders, StepContext
from lgc.learned.training import CodecTraining
from lgc.validation import Density, check

__all__ = ["LGCHookState", "LGCStage", "lgc_hook"]

#: Stage 2's exact exchange (``training.samples="leader"``) measures no delivered error.
_EXACT = DeliveredError(False)


class LGCHookState(CompressionHookState):
    """State of an LGC hook: its parts (see the module docstring) and the step they run.

    Register with :meth:`register` (or ``lgc.lit``'s strategy).

    Args:
        compressed_stage: the topology's compressed stage.
        training: the codec and its training; ``None`` for codecs that learn nothing (then
            ``stages.ae_steps`` must be 0).
        chunk: values per chunk of the leader's code (default: the codec's input length).
            These three are positional: the public classes assemble them.
        density: top-k density of the leader's selection and of stage 2 (``k = ceil(density * n)``
            per parameter). The paper uses 0.001.
        stages: the stages (:class:`~lgc.learned.knobs.Stages`).
        leaders: whose positions, and their wire layout (:class:`~lgc.learned.knobs.LeaderChoice`).
        measure_error: diagnostics (:class:`~lgc.learned.step.DeliveredError`): logs
            ``lgc/true_error`` and the premise (``lgc/premise_r``, ``lgc/premise_share``) every
            compressed step and their run-wide values in the summary, at the cost of one uncounted
            fp32 allgather of ``K + 1`` values a worker.
        world_size: number of workers, if known before the workers start (checks the leader
            early; LGC-PS builds one decoder per worker). Otherwise taken at :meth:`register`.
        min_numel: parameters with fewer elements are allreduced dense (``None``: 1,024, the
            default of its top-k, :func:`~lgc.compressors.base.method_min_numel`).
        process_group: the group to communicate in (default: the world).

    The public classes give every knob a default (their presets); this one gives none.
    """

    __slots__ = (
        "compressed_stage",  # the topology's compressed stage (CompressedStage)
        "training",  # the codec and its training (CodecTraining), or None
        "schedule",  # the stages and the refresh state
        "leaders",  # whose positions each step uses
        "leader_code",  # the leader's positions and values on the wire
        "errors",  # the delivered sum's error against the exact one (measure_error)
        "byte_book",  # bytes per stage
        "density",
        "world_size",
        "stage",  # stage of the current step
        "current_step",  # the step the hook is in (its first bucket starts it)
        "leader",  # leader of the current step
        "last_metrics",  # the latest lgc/* values, for logging
        "param_order",  # parameter name -> position in the model (per process, from attach())
    )

    needs_total_steps = True
    codes_whole_parameters = True
    # Its stages run collectives of their own (lgc.ddp.packed packs the plain compressors' steps).
    packs_steps = False

    def __init__(
        self,
        compressed_stage: CompressedStage,
        training: CodecTraining | None,
        chunk: int | None = None,
        /,
        *,
        density: Density,
        stages: Stages,
        leaders: LeaderChoice,
        measure_error: bool,
        world_size: int | None,
        min_numel: int | None,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        check("density", density, Density)
        super().__init__(
            ErrorFeedback(TopKCompressor(density)), min_numel=min_numel, start_iter=0, process_group=process_group
        )
        if training is None and stages.ae_steps != 0:
            raise ValueError(
                f"a codec that learns nothing has no training stage: stages.ae_steps must be 0, got {stages.ae_steps!r}"
            )
        self.compressed_stage = compressed_stage
        self.training = training
        self.schedule = StageSchedule(
            stages,
            density=density,
            # A warm-started codec may skip its training stage; a codec that learns nothing has none.
            min_ae_steps=0 if training is None or training.init is not None else 1,
        )
        if training is not None:
            training.warm_start(self.schedule.ae_steps)
        self.leaders = Leaders(leaders.rank, leaders.rotate)
        if world_size is not None:
            self._check_world(int(world_size))
        if chunk is None:
            assert training is not None, "a chunk length is needed without a codec"
            chunk = training.chunk
        self.leader_code = LeaderIndexCodec(chunk, leaders.value_order, leaders.index_coding)
        self.errors = DeliveredError(measure_error)
        self.byte_book = StageByteBook()
        self.density = float(density)
        self.world_size = None if world_size is None else int(world_size)
        if self.world_size is not None and training is not None:
            training.build(self.world_size)
        self.stage = LGCStage.WARMUP
        self.current_step = -1
        self.leader = leaders.rank
        self.last_metrics: dict[str, float] = {}
        self.param_order: dict[str, int] = {}

    # The stage knobs live in the schedule, the layout knobs in the leader's code.
    warmup_steps = property(lambda self: self.schedule.warmup_steps)
    ae_steps = property(lambda self: self.schedule.ae_steps)
    warmup = property(lambda self: self.schedule.warmup)
    refresh_threshold = property(lambda self: self.schedule.refresh_threshold)
    refreshes = property(lambda self: self.schedule.refreshes)
    value_order = property(lambda self: self.leader_code.value_order)
    index_coding = property(lambda self: self.leader_code.index_coding)
    leader_rank = property(lambda self: self.leaders.rank)
    rotate_leader = property(lambda self: self.leaders.rotate)
    stage_stats = property(lambda self: self.byte_book.stages)

    @property
    def ef(self) -> ErrorFeedback:
        return self.compressor  # type: ignore[return-value]

    @property
    def topk(self) -> TopKCompressor:
        return self.ef.compressor  # type: ignore[return-value]

    @property
    def trainer(self) -> Any:
        """The codec's trainer (None for codecs that learn nothing, or before the world size is known)."""
        return None if self.training is None else self.training.trainer

    @property
    def autoencoder(self) -> Any:
        """The codec (:class:`~lgc.autoencoder.GradientAutoencoder` or the linear codec)."""
        if self.training is None:
            raise AttributeError(f"{type(self).__name__} learns no codec")
        return self.training.model

    @property
    def ae_config(self) -> Any:
        """The autoencoder's shape (:class:`~lgc.autoencoder.AutoencoderConfig`)."""
        if self.training is None:
            raise AttributeError(f"{type(self).__name__} learns no codec")
        return self.training.config

    # -- setup ------------------------------------------------------------------------------------
    def _check_world(self, world_size: int) -> None:
        self.leaders.check_world(world_size)
        self.compressed_stage.check_world(world_size)

    def check_total_steps(self, total_steps: int) -> None:
        """Refuse stage lengths that leave no compressed stage in a run of ``total_steps`` steps."""
        self.schedule.check_total_steps(total_steps)

    def stage_at(self, step: int) -> LGCStage:
        """The scheduled stage of ``step`` (refreshes aside)."""
        return self.schedule.stage_at(step)

    def set_world_size(self, world_size: int) -> None:
        """Fix the number of workers before they start (checks the leader; LGC-PS sizes its decoders).

        Raises:
            ValueError: the state was configured (or has run) for another number of workers.
        """
        if self.world_size is not None and self.world_size != world_size:
            raise ValueError(f"LGC was configured for {self.world_size} workers but the group has {world_size}")
        self._check_world(world_size)
        built = self.training is None or self.training.trainer is not None
        if self.world_size != world_size or not built:
            self.world_size = world_size
            if self.training is not None:
                self.training.build(world_size)

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        """After the dense warm-up and the codec's training (the compressed stage's first step)."""
        return max(super().steady_from(steps_per_epoch), self.warmup_steps + self.ae_steps)

    def save_codec(self, path: str | Path) -> Path | None:
        """Write the workers' codec to ``path`` for ``training.autoencoder.init`` (``None``: none trained or loaded)."""
        return None if self.training is None else self.training.save(path)

    def attach(self, model: DistributedDataParallel) -> None:
        super().attach(model)
        self.param_order = {name: i for i, (name, _) in enumerate(model.module.named_parameters())}

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
        self.set_world_size(dist.get_world_size(self.process_group))
        self.attach(model)
        self.buffer_sync = module_buffers.register_comm_hook(model, self, lgc_hook, self.buffers)

    def learned_description(self, latent_dtype: str) -> str:
        """What a learned state does, for summaries and logs."""
        assert self.training is not None
        return (
            f"{type(self).__name__}(density={self.density}, warmup_steps={self.warmup_steps} ({self.warmup}), "
            f"ae_steps={self.ae_steps}, codec={self.training.codec}"
            + (", samples=leader" if self.training.sample_exchange is not None else "")
            + f", chunk={self.training.chunk}, latent={latent_dtype}, "
            f"indices={self.index_coding}, leader={'rotating' if self.rotate_leader else self.leader_rank}"
            + (f", init={self.training.init}" if self.training.init is not None else "")
            + ")"
        )

    # -- stages -----------------------------------------------------------------------------------
    def _begin_step(self, step: int, device: torch.device) -> None:
        """Called at the first bucket of every step, on every rank alike."""
        if step == self.current_step:
            return
        previous = self.stage
        self.stage = self.schedule.begin(step, previous)
        self.current_step = step
        # The step's bytes so far (its module buffers and the step guard, spent before the stage
        # was known) belong to this step's stage.
        self._book_stage_bytes()
        assert self.world_size is not None
        self.leader = self.leaders.at(step, self.world_size)
        training = self.training
        if training is not None:
            training.to(device)
            if self.stage is LGCStage.AUTOENCODER_TRAINING and previous is LGCStage.COMPRESSED:
                training.start_refresh()
            if self.stage is LGCStage.COMPRESSED and not training.weights_sent:
                self.compressed_stage.distribute_weights(training.model, self.leaders, self.stats, self.process_group)
                training.weights_sent = True
                # A one-off cost per (re)training, booked apart from the per-step traffic.
                self._book_stage_bytes("autoencoder_weights")
        self.last_metrics["lgc/stage"] = float(self.stage)

    def _book_stage_bytes(self, name: str | None = None) -> None:
        """Add the communication since the last booking to ``name`` (default: the current stage)."""
        if self.current_step < 0 and name is None:
            return
        self.byte_book.book(name or self.stage.name.lower(), self.stats)

    # -- per step -------------------------------------------------------------------------------
    def process_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Hold the bucket; the whole step runs at its last bucket, behind the step guard.

        Every stage needs the whole step: the guard (:func:`~lgc.ddp.step_guard.agree_on_step`) decides
        before any state moves, and the compressed stage encodes all parameters as one vector.
        DDP waits for the buckets' futures only at the end of the backward pass.
        """
        world_size = dist.get_world_size(self.process_group)
        buffer = bucket.buffer()
        self.unscale(buffer, world_size)
        self.stats.hook_calls += 1
        counted.book_dense_equivalent(self.stats, buffer, self.process_group)
        return self.defer(buffer, self.layouts.segments(bucket, self.min_numel), bucket.is_last())

    def step_done(self, skipped: bool) -> None:
        # Every step's bytes go to its stage; a skipped step's (guard and dense pass-through) to "skipped".
        self._book_stage_bytes("skipped" if skipped else None)

    def compress_step(self, pending: list[PendingBucket], used: frozenset[str], step: int) -> None:
        self._begin_step(step, pending[0].buffer.device)
        if self.stage is LGCStage.WARMUP:
            dense = step == 0 or self.warmup == "dense" or not any(s.compressed for b in pending for s in b.segments)
            if dense:
                for bucket in pending:
                    for s in bucket.segments:
                        self.layer_stats.book(s.name, s.numel, False, s.numel * bucket.buffer.element_size())
                complete_dense(self.stats, self.process_group, pending)
                return
            self.topk.density = self.schedule.warmup_density(step)
            super().compress_step(pending, used, step)
            return
        if self.stage is LGCStage.AUTOENCODER_TRAINING:
            assert self.training is not None
            self.topk.density = self.density
            if self.training.sample_exchange is not None:  # training.samples="leader"
                # Its exchange is exact: lgc/true_error measures the compressed stage alone.
                ctx = replace(
                    self._context(plan_step(pending, used, self.param_order, self.density), step), errors=_EXACT
                )
                self.training.step_at_leader(ctx)
                for bucket in pending:
                    bucket.future.set_result(bucket.buffer)
                return
            self.training.step(
                self,
                pending,
                used,
                step,
                leader=self.leader,
                code=self.leader_code,
                param_order=self.param_order,
                metrics=self.last_metrics,
            )
        else:
            # Compressed: the whole model's values form one vector.
            self.compressed_stage.run(self._context(plan_step(pending, used, self.param_order, self.density), step))
        for bucket in pending:
            bucket.future.set_result(bucket.buffer)

    def _context(self, plan: Any, step: int) -> StepContext:
        return StepContext(
            plan=plan,
            step=step,
            leader=self.leader,
            rank=dist.get_rank(self.process_group),
            world_size=dist.get_world_size(self.process_group),
            code=self.leader_code,
            residuals=self.ef.residuals,
            stats=self.stats,
            group=self.process_group,
            book_layer=self.layer_stats.book,
            schedule=self.schedule,
            errors=self.errors,
            metrics=self.last_metrics,
            codec=None if self.training is None else self.training.model,
        )

    def __getstate__(self) -> dict[str, Any]:
        # Per-process state stays behind (spawned workers attach anew).
        return {**super().__getstate__(), "param_order": {}}

    # -- logging, summaries, checkpoints ----------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return dict(self.last_metrics)

    def summary_extras(self) -> dict[str, Any]:
        self._book_stage_bytes()
        lgc: dict[str, Any] = {"stages": self.byte_book.summary(), "refreshes": self.refreshes}
        if self.training is not None:
            lgc["autoencoder"] = repr(self.training.model)
        if self.errors.run_error is not None:
            lgc["true_error"] = self.errors.run_error
        if self.errors.run_premise is not None:
            lgc["premise"] = self.errors.run_premise
        return {**super().summary_extras(), "lgc": lgc}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            **self.schedule.state_dict(),
            **({} if self.training is None else self.training.state_dict()),
            "world_size": self.world_size,
            "stage": int(self.stage),
            "current_step": self.current_step,
            "error_sums": list(self.errors.sums),
            "premise_sums": list(self.errors.premise),
            "last_metrics": dict(self.last_metrics),
            **self.byte_book.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.world_size is None:
            self.set_world_size(state["world_size"])
        if self.training is not None:
            self.training.load_state_dict(state)
        self.schedule.load_state_dict(state)
        self.stage = LGCStage(state["stage"])
        self.current_step = int(state["current_step"])
        self.errors.sums = list(state["error_sums"])
        # A checkpoint written before the premise was measured resumes it from its next measured step.
        self.errors.premise = list(state.get("premise_sums", [0.0, 0.0, 0.0]))
        self.last_metrics = dict(state["last_metrics"])
        self.byte_book.load_state_dict(state)


def lgc_hook(state: LGCHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket of gradients with LGC (register through ``state.register(model)``)."""
    return state.process_bucket(bucket)
