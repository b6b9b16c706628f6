"""Learned Gradient Compression: the stages both topologies share.

Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep
Learning" (IEEE TNNLS 2021, arXiv:2103.08870). Gradients of different workers are correlated; an
autoencoder trained on them during the first stages of training captures their common
information, so it need not be sent by every worker. Training runs in three stages, driven by the
hook's step counter:

1. **Warm-up** (``warmup_steps``): dense allreduce (``warmup="dense"``) or top-k with error
   feedback at DGC's exponentially falling densities (``warmup="dgc"``). The first step is always
   dense, while DDP rebuilds its buckets.
2. **Autoencoder training** (``ae_steps``): workers communicate top-k (values + int32 indices,
   error feedback) exactly like ``compressor=topk``. Each step the leader's top-k positions are
   read from the gathered payloads and every worker's error-corrected gradient *at those
   positions* (the very vector the autoencoder will encode in stage 3) is gathered at rank 0, which
   trains the autoencoder on it (``ae_updates_per_step`` optimizer steps per training step). The
   collection's bytes are counted with the stage's.
3. **Compressed**: the autoencoder is frozen and carries the values; how depends on the topology
   (:mod:`lgc.ddp.lgc_rar`, :mod:`lgc.ddp.lgc_ps`). Its weights are sent from rank 0 first (counted).

Common to both compressed stages: the *leader* (``leader_rank``, or every worker in turn with
``rotate_leader``) selects the top-k positions per parameter (``k = ceil(density * n)``, as
``compressor=topk`` does), so every worker's values are taken at the same positions and line up.
The ``K`` values of a bucket are cut into chunks of ``autoencoder.chunk`` values (zero-padded),
each divided by the leader's chunk scale (its root mean square), so one small autoencoder serves
every bucket of every model (:mod:`lgc.autoencoder`). The leader's positions go on the wire as raw
int32 (``index_coding="raw"``) or Golomb-coded (``"golomb"``, SBC's codec: about 11.5 bits per
position at density 0.001; with a value order other than positions, plus the permutation to that
order at ``ceil(log2 K)`` bits per position). ``value_order`` sorts the values before they are
chunked: ``"position"`` (ascending positions), ``"magnitude"`` (the leader's ``|v|``, descending,
as the authors' earlier DGC code sorted values) or ``"value"`` (the leader's signed ``v``,
descending). Sorted by the leader's values, the leader's vector is a smooth monotone curve and
every worker correlated with it a noisy version of that curve, which a small convolutional
autoencoder compresses far better than values in position order, which look like noise (measured:
``lgc-bench autoencoder``).

Beyond the paper: leader rotation; Golomb-coded positions; fp16 latents (``latent_dtype``); and an
autoencoder **refresh**: when the reconstruction error of the compressed stage stays above
``refresh_threshold`` for ``refresh_patience`` steps, all workers re-enter stage 2 for
``refresh_steps`` steps (the paper freezes the autoencoder forever, and it can go stale).

Every collective is issued inside the hook, in the same order on every rank.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import enum
import math
from dataclasses import fields
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lgc.autoencoder import (
    AutoencoderConfig,
    AutoencoderTrainer,
    GradientAutoencoder,
    LossWeights,
    chunk_scales,
    from_chunks,
    to_chunks,
)
from lgc.coding import GolombCode, golomb_decode, golomb_encode, pack_bits, pack_uint, packed_nbytes, unpack_uint
from lgc.compressors.dgc import PAPER_WARMUP_DENSITIES
from lgc.compressors.error_feedback import ErrorFeedback
from lgc.compressors.topk import SparsePayload, TopKCompressor, num_selected, topk_indices
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.hook import CompressionHookState, PayloadExchange, PendingBucket, _Segment

__all__ = ["LGCHookState", "LGCStage", "lgc_hook"]

_LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_INDEX_CODINGS = ("raw", "golomb")
_WARMUPS = ("dense", "dgc")
_VALUE_ORDERS = ("position", "magnitude", "value")


class LGCStage(enum.IntEnum):
    """The three stages of LGC (logged as ``lgc/stage``)."""

    WARMUP = 1
    AUTOENCODER_TRAINING = 2
    COMPRESSED = 3


class Part(NamedTuple):
    """One parameter's gradient: a view into its DDP bucket's flat buffer."""

    name: str
    grad: Tensor


class StepPlan(NamedTuple):
    """Every compressed parameter of the model as one vector (their concatenation, "cat space").

    The parameters are in the model's order, not DDP's bucket order: buckets differ between a run's
    first step and the rest (DDP rebuilds them), and between a run and its resumption, while the
    vector the autoencoder sees, and so every result, must not.
    """

    #: The compressed parameters, in the model's order.
    compressed: tuple[Part, ...]
    #: The parameters sent dense (fewer than ``min_numel`` elements).
    dense: tuple[Part, ...]
    #: Start of every compressed parameter in cat space.
    cat_offsets: tuple[int, ...]
    #: Top-k size of every compressed parameter.
    ks: tuple[int, ...]
    #: Length of the cat-space vector.
    numel: int
    #: Values the leader selects: ``sum(ks)``.
    k: int

    def scatter(self, values: Tensor) -> None:
        """Write a cat-space vector into the parameters' gradients."""
        for part, offset in zip(self.compressed, self.cat_offsets, strict=True):
            part.grad.copy_(values[offset : offset + part.grad.numel()])


class _Sample(NamedTuple):
    """One compressed parameter's stage-2 sample of this worker (joined with the others at the last bucket)."""

    order: int
    numel: int
    #: The leader's top-k positions in the parameter and its values there.
    positions: Tensor
    leader_values: Tensor
    #: This worker's error-corrected gradient at those positions.
    values: Tensor
    #: LGC-PS: which of those positions are in this worker's innovation.
    innovation: Tensor | None


class LGCHookState(CompressionHookState):
    """State of an LGC hook: stages, the autoencoder and its trainer, error feedback.

    Subclasses implement the compressed stage's topology (:meth:`_compressed_step`), the
    autoencoder's shape for it, and how its weights reach the workers
    (:meth:`_distribute_weights`). Register with :meth:`register` (or ``lgc.lit``'s strategy).

    Args:
        density: top-k density of the leader's selection and of stage 2 (``k = ceil(density * n)``
            per parameter). The paper uses 0.001.
        warmup_steps: stage 1 length in optimizer steps (at least 1: DDP rebuilds its buckets).
        warmup: ``"dense"`` (allreduce) or ``"dgc"`` (top-k + error feedback at ``warmup_densities``).
        warmup_densities: ``"dgc"`` warm-up's densities, spread evenly over the warm-up steps
            (DGC's 25 %, 6.25 %, 1.5625 %, 0.39 % by default); never below ``density``.
        ae_steps: stage 2 length: steps of top-k communication while the autoencoder trains
            (about 300 in the reference code).
        ae_updates_per_step: autoencoder optimizer steps per training step in stage 2.
        autoencoder: :class:`~lgc.autoencoder.AutoencoderConfig` fields (``chunk``,
            ``encoder_channels``, ``latent_channels``, ``decoder_channels``, ``seed``).
        ae_optimizer / ae_lr / ae_batch_size / ae_buffer_size: the autoencoder's trainer
            (:class:`~lgc.autoencoder.AutoencoderTrainer`).
        loss_weights: :class:`~lgc.autoencoder.LossWeights` fields (``reconstruction``,
            ``similarity``, ``mean``).
        leader_rank: the worker whose top-k positions everyone uses.
        rotate_leader: the leader is ``step % world_size`` instead (spreads the leader's extra
            upload; every worker's big coordinates get their turn).
        index_coding: ``"raw"`` (int32) or ``"golomb"`` (Golomb-Rice positions + the permutation).
        latent_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` latents on the wire.
        value_order: ``"position"``, ``"magnitude"`` or ``"value"`` (the leader's, descending).
        refresh_threshold: relative reconstruction error (``||x - x_hat||^2 / ||x||^2``) above which
            the compressed stage counts a strike; ``None`` never refreshes (the paper).
        refresh_patience: consecutive strikes that send every worker back to stage 2.
        refresh_steps: length of a refresh's stage 2 (default: ``ae_steps``).
        world_size: number of workers, if known before the workers start (checks ``leader_rank``
            early; LGC-PS builds one decoder per worker). Otherwise taken at :meth:`register`.
        min_numel: parameters with fewer elements are allreduced dense.
        process_group: the group to communicate in (default: the world).
    """

    #: Whether rank 0 is a parameter server (its broadcasts and sends count as server traffic).
    has_server = False

    __slots__ = (
        # hyperparameters
        "density",
        "warmup_steps",
        "warmup",
        "warmup_densities",
        "ae_steps",
        "ae_updates_per_step",
        "ae_config",
        "trainer_options",
        "leader_rank",
        "rotate_leader",
        "index_coding",
        "latent_dtype",
        "value_order",
        "refresh_threshold",
        "refresh_patience",
        "refresh_steps",
        "world_size",
        # internal state
        "trainer",  # the autoencoder and its optimizer and sample buffer (the buffer only on rank 0)
        "stage",  # stage of the current step
        "current_step",  # the step the hook is in (its first bucket starts it)
        "leader",  # leader of the current step
        "weights_sent",  # whether the workers hold the trained weights (stage 3 may start)
        "refresh_until",  # a refresh's stage 2 lasts until this step (None: no refresh running)
        "refresh_strikes",  # consecutive compressed steps with too large an error
        "refreshes",  # how many refreshes happened
        "step_error",  # [sum of error * K, sum of K] of the current compressed step
        "last_metrics",  # the latest lgc/* values, for logging
        "param_order",  # parameter name -> position in the model (per process, from attach())
        "samples",  # stage-2 samples of the current step's buckets, joined at its last bucket
        # stats
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
        world_size: int | None = None,
        min_numel: int = 1024,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            ErrorFeedback(TopKCompressor(density)), min_numel=min_numel, start_iter=0, process_group=process_group
        )
        for name, value, low in (
            ("warmup_steps", warmup_steps, 1),
            ("ae_steps", ae_steps, 1),
            ("ae_updates_per_step", ae_updates_per_step, 0),
            ("refresh_patience", refresh_patience, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if warmup not in _WARMUPS:
            raise ValueError(f"warmup must be one of {_WARMUPS}, got {warmup!r}")
        densities = tuple(float(d) for d in (PAPER_WARMUP_DENSITIES if warmup_densities is None else warmup_densities))
        if any(not 0.0 < d <= 1.0 for d in densities):
            raise ValueError(f"warmup_densities must lie in (0, 1], got {list(densities)}")
        if index_coding not in _INDEX_CODINGS:
            raise ValueError(f"index_coding must be one of {_INDEX_CODINGS}, got {index_coding!r}")
        if latent_dtype not in _LATENT_DTYPES:
            raise ValueError(f"latent_dtype must be one of {sorted(_LATENT_DTYPES)}, got {latent_dtype!r}")
        if value_order not in _VALUE_ORDERS:
            raise ValueError(f"value_order must be one of {_VALUE_ORDERS}, got {value_order!r}")
        if refresh_threshold is not None and not float(refresh_threshold) > 0:
            raise ValueError(f"refresh_threshold must be > 0 or None, got {refresh_threshold!r}")
        if refresh_steps is not None and (not isinstance(refresh_steps, int) or refresh_steps < 1):
            raise ValueError(f"refresh_steps must be a positive integer or None, got {refresh_steps!r}")
        if isinstance(leader_rank, bool) or not isinstance(leader_rank, int) or leader_rank < 0:
            raise ValueError(f"leader_rank must be a rank (an integer >= 0), got {leader_rank!r}")
        if world_size is not None:
            self._check_world(int(world_size), leader_rank)
        if isinstance(autoencoder, AutoencoderConfig):
            ae_config = autoencoder
        else:
            ae_config = AutoencoderConfig.from_kwargs(**(autoencoder or {}))
        self.density = float(density)
        self.warmup_steps = warmup_steps
        self.warmup = warmup
        self.warmup_densities = densities
        self.ae_steps = ae_steps
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
        self.index_coding = index_coding
        self.latent_dtype = latent_dtype
        self.value_order = value_order
        self.refresh_threshold = None if refresh_threshold is None else float(refresh_threshold)
        self.refresh_patience = refresh_patience
        self.refresh_steps = ae_steps if refresh_steps is None else refresh_steps
        self.world_size = None if world_size is None else int(world_size)
        self.trainer: AutoencoderTrainer | None = None
        if self.world_size is not None:
            self._build_trainer()
        self.stage = LGCStage.WARMUP
        self.current_step = -1
        self.leader = leader_rank
        self.weights_sent = False
        self.refresh_until: int | None = None
        self.refresh_strikes = 0
        self.refreshes = 0
        self.step_error = [0.0, 0.0]
        self.last_metrics: dict[str, float] = {}
        self.param_order: dict[str, int] = {}
        self.samples: list[_Sample] = []
        self.stage_stats: dict[str, CommStats] = {}
        self.stats_mark = CommStats()

    # -- what the topologies define -------------------------------------------------------------
    def _autoencoder_config(self, config: AutoencoderConfig, world_size: int | None) -> AutoencoderConfig:
        """The autoencoder this topology needs (one decoder; LGC-PS: one per worker, innovation)."""
        return config

    def _compressed_step(self, plan: StepPlan) -> None:
        """Average the step's gradients in place (every bucket of the step at once), blocking."""
        raise NotImplementedError

    def _distribute_weights(self) -> None:
        """Send the trained weights from rank 0 to the workers that need them (a collective)."""
        raise NotImplementedError

    def _innovation_of(self, v: Tensor, positions: Tensor) -> Tensor | None:
        """LGC-PS: which of the leader's ``positions`` of one parameter are in this worker's innovation."""
        return None

    def _add_samples(self, chunks: Tensor, innovation_masks: list[Tensor] | None, k: int) -> None:
        """At rank 0: add the step's samples ``[rows, workers, chunk]`` to the autoencoder's buffer."""
        assert self.trainer is not None
        self._record_held_out(self.trainer.evaluate(chunks) if self.trainer.num_samples else None)
        self.trainer.add(chunks)

    # -- checks -----------------------------------------------------------------------------------
    def _check_world(self, world_size: int, leader_rank: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size!r}")
        if not 0 <= leader_rank < world_size:
            raise ValueError(f"leader_rank={leader_rank} is outside the world of {world_size} worker(s)")

    def check_total_steps(self, total_steps: int) -> None:
        """Refuse stage lengths that leave no compressed stage in a run of ``total_steps`` steps."""
        if self.warmup_steps + self.ae_steps >= total_steps:
            raise ValueError(
                f"LGC stages leave no compressed stage: warmup_steps={self.warmup_steps} + ae_steps={self.ae_steps} "
                f">= the run's {total_steps} optimizer steps"
            )

    # -- setup ------------------------------------------------------------------------------------
    def set_world_size(self, world_size: int) -> None:
        """Fix the number of workers before they start (checks the leader; LGC-PS sizes its decoders)."""
        self._check_world(world_size, self.leader_rank)
        if self.world_size != world_size or self.trainer is None:
            self.world_size = world_size
            self._build_trainer()

    def _build_trainer(self) -> None:
        assert self.world_size is not None
        self.ae_config = self._autoencoder_config(self.ae_config, self.world_size)
        self.trainer = AutoencoderTrainer(GradientAutoencoder(self.ae_config), **self.trainer_options)

    def attach(self, model: DistributedDataParallel) -> None:
        super().attach(model)
        self.param_order = {name: i for i, (name, _) in enumerate(model.module.named_parameters())}

    def register(self, model: DistributedDataParallel) -> None:
        """Attach to ``model`` and register :func:`lgc_hook` with this state."""
        world_size = dist.get_world_size(self.process_group)
        if self.world_size is not None and self.world_size != world_size:
            raise ValueError(f"LGC was configured for {self.world_size} workers but the group has {world_size}")
        self._check_world(world_size, self.leader_rank)
        if self.trainer is None:
            self.world_size = world_size
            self._build_trainer()
        self.attach(model)
        model.register_comm_hook(self, lgc_hook)

    @property
    def ef(self) -> ErrorFeedback:
        return self.compressor  # type: ignore[return-value]

    @property
    def topk(self) -> TopKCompressor:
        return self.ef.compressor  # type: ignore[return-value]

    @property
    def autoencoder(self) -> GradientAutoencoder:
        assert self.trainer is not None, "call register(model) first"
        return self.trainer.autoencoder

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def describe(self) -> str:
        return (
            f"{type(self).__name__}(density={self.density}, warmup_steps={self.warmup_steps} ({self.warmup}), "
            f"ae_steps={self.ae_steps}, chunk={self.ae_config.chunk}, latent={self.latent_dtype}, "
            f"indices={self.index_coding}, leader={'rotating' if self.rotate_leader else self.leader_rank})"
        )

    # -- stages -----------------------------------------------------------------------------------
    def stage_at(self, step: int) -> LGCStage:
        """The scheduled stage of ``step`` (refreshes aside)."""
        if step < self.warmup_steps:
            return LGCStage.WARMUP
        if step < self.warmup_steps + self.ae_steps:
            return LGCStage.AUTOENCODER_TRAINING
        return LGCStage.COMPRESSED

    def _next_stage(self, step: int) -> LGCStage:
        stage = self.stage_at(step)
        if stage is not LGCStage.COMPRESSED:
            return stage
        if self.refresh_until is not None:
            if step < self.refresh_until:
                return LGCStage.AUTOENCODER_TRAINING
            self.refresh_until = None
        weight = self.step_error[1]
        if self.stage is LGCStage.COMPRESSED and self.refresh_threshold is not None and weight > 0:
            # Every rank sees the same (allreduced or broadcast) error, so all decide alike.
            too_large = self.step_error[0] / weight > self.refresh_threshold
            self.refresh_strikes = self.refresh_strikes + 1 if too_large else 0
            if self.refresh_strikes >= self.refresh_patience:
                self.refresh_strikes = 0
                self.refreshes += 1
                self.refresh_until = step + self.refresh_steps
                return LGCStage.AUTOENCODER_TRAINING
        return LGCStage.COMPRESSED

    def _begin_step(self, step: int, device: torch.device) -> None:
        """Called at the first bucket of every step, on every rank alike."""
        if step == self.current_step:
            return
        previous = self.stage
        self.stage = self._next_stage(step)
        self.step_error = [0.0, 0.0]
        self.current_step = step
        # The step guard's bytes (spent before the stage was known) belong to this step's stage.
        self._book_stage_bytes()
        self.leader = step % self.world_size if self.rotate_leader else self.leader_rank  # type: ignore[operator]
        assert self.trainer is not None
        if next(self.trainer.autoencoder.parameters()).device != device:
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

    def _warmup_density(self, step: int) -> float:
        phases = len(self.warmup_densities)
        if not phases:
            return self.density
        phase = min(phases - 1, step * phases // self.warmup_steps)
        return max(self.warmup_densities[phase], self.density)

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
            self.topk.density = self._warmup_density(step)
            super().compress_step(pending, used, step)
            return
        if self.stage is LGCStage.AUTOENCODER_TRAINING:
            # Top-k per parameter, bucket by bucket; the samples are joined once all are exchanged.
            self.topk.density = self.density
            for bucket in pending:
                self._exchange_and_sample(bucket.buffer, bucket.segments, step, used)
            self._collect_samples()
            self._train_autoencoder()
        else:
            # Compressed: the whole model's values form one vector.
            self._compressed_step(self._step_plan(pending, used))
        for bucket in pending:
            bucket.future.set_result(bucket.buffer)

    def _step_plan(self, pending: list[PendingBucket], used: frozenset[str]) -> StepPlan:
        # Parameters with a zero gradient on every rank (unused) take no part: their residuals stay.
        parts = [
            (self.param_order[s.name], s.compressed, Part(s.name, buffer[s.offset : s.offset + s.numel]))
            for buffer, segments, _ in pending
            for s in segments
            if s.name in used
        ]
        compressed = tuple(part for _, _, part in sorted((p for p in parts if p[1]), key=lambda p: p[0]))
        dense = tuple(part for _, is_compressed, part in parts if not is_compressed)
        offsets, ks, total = [], [], 0
        for part in compressed:
            offsets.append(total)
            ks.append(num_selected(part.grad.numel(), self.density))
            total += part.grad.numel()
        return StepPlan(compressed, dense, tuple(offsets), tuple(ks), total, sum(ks))

    # -- stage 2 ----------------------------------------------------------------------------------
    def _exchange_and_sample(
        self, buffer: Tensor, segments: tuple[_Segment, ...], step: int, used: frozenset[str]
    ) -> None:
        """Top-k as usual; keep this worker's values at the leader's positions of every parameter."""
        exchange = PayloadExchange(self, buffer, segments, step, used=used)
        torch.futures.wait_all(exchange.futures)
        exchange.finish()
        for segment, own in zip(exchange.sparse, exchange.own, strict=True):
            assert isinstance(own, SparsePayload)
            leader = exchange.received[segment.name][self.leader]
            # The corrected gradient before sending: what is left plus what this worker sent.
            v = self.ef.residuals[segment.name].clone().index_add_(0, own.indices.long(), own.values.float())
            positions = leader.indices.long()
            self.samples.append(
                _Sample(
                    self.param_order[segment.name],
                    segment.numel,
                    positions,
                    leader.values.float(),
                    v[positions].float(),
                    self._innovation_of(v, positions),
                )
            )

    def _collect_samples(self) -> None:
        """Gather every worker's values at the leader's positions (the whole model's) at rank 0."""
        samples, self.samples = sorted(self.samples, key=lambda sample: sample.order), []
        if not samples:
            return
        offsets = torch.tensor([0] + [sample.numel for sample in samples[:-1]]).cumsum(0).tolist()
        positions = torch.cat([sample.positions + offset for sample, offset in zip(samples, offsets, strict=True)])
        leader_values = torch.cat([sample.leader_values for sample in samples])
        order = self._order(positions, leader_values)
        values = torch.cat([sample.values for sample in samples])[order]
        gathered = counted.gather(self.stats, values, 0, self.process_group)
        masks = None
        if samples[0].innovation is not None:
            mask = torch.cat([sample.innovation for sample in samples])[order]  # type: ignore[misc]
            masks = counted.gather(self.stats, pack_bits(mask).to(values.device), 0, self.process_group)
        if gathered is None:
            return
        scales = chunk_scales(to_chunks(leader_values[order], self.ae_config.chunk))
        chunks = torch.stack([to_chunks(x, self.ae_config.chunk) / scales[:, None] for x in gathered], dim=1)
        self._add_samples(chunks, masks, values.numel())

    def _record_held_out(self, losses: dict[str, float] | None) -> None:
        # Losses on samples before the autoencoder trains on them: an honest generalization estimate.
        if losses:
            self.last_metrics["lgc/recon_error"] = losses["relative_error"]

    def _train_autoencoder(self) -> None:
        assert self.trainer is not None
        if self.rank != 0:
            return
        losses = self.trainer.train(self.ae_updates_per_step)
        if losses:
            self.last_metrics["lgc/ae_loss"] = losses["total"]

    # -- stage 3 helpers --------------------------------------------------------------------------
    def _corrected(self, plan: StepPlan) -> Tensor:
        """Error feedback's ``v = residual + g`` of every compressed parameter, in cat space."""
        parts = []
        for part in plan.compressed:
            residual = self.ef.residuals.get(part.name)
            # fp32 whatever the gradients' dtype, like lgc.compressors.ErrorFeedback's residuals.
            if residual is None:
                parts.append(part.grad.to(torch.float32, copy=True))
            else:
                parts.append(residual.to(part.grad.device).add_(part.grad))
        return torch.cat(parts)

    def _count_payload(self, sent: int, plan: StepPlan) -> None:
        """Book what this worker sent for the compressed parameters (its own compression ratio).

        The parameters share one code, so each is booked the share of its selected values.
        """
        self.stats.payload_bytes += sent
        self.stats.payload_dense_equivalent_bytes += plan.numel * plan.compressed[0].grad.element_size()
        for part, k in zip(plan.compressed, plan.ks, strict=True):
            self.book_layer(part.name, part.grad.numel(), True, round(sent * k / plan.k))

    def _keep_residuals(self, plan: StepPlan, residual: Tensor) -> None:
        for part, offset in zip(plan.compressed, plan.cat_offsets, strict=True):
            self.ef.residuals[part.name] = residual[offset : offset + part.grad.numel()]

    def _allreduce_dense(self, plan: StepPlan, extra: list[Tensor]) -> Tensor | None:
        """Sum the dense parameters (and ``extra`` tensors appended to them) in one allreduce.

        Writes the dense parameters' sums into their gradients; returns the summed ``extra`` part.
        """
        for part in plan.dense:
            self.book_layer(part.name, part.grad.numel(), False, part.grad.numel() * part.grad.element_size())
        pieces = [part.grad for part in plan.dense] + extra
        if not pieces:
            return None
        flat = torch.cat([piece.reshape(-1).float() for piece in pieces])
        counted.all_reduce(self.stats, flat, self.process_group).wait()
        sizes = [piece.numel() for piece in pieces]
        for part, summed in zip(plan.dense, flat.split(sizes), strict=False):
            part.grad.copy_(summed)
        return flat[sum(sizes[: len(plan.dense)]) :]

    def _leader_positions(self, plan: StepPlan, v: Tensor) -> Tensor:
        """The leader's top-k positions (cat space) in wire order."""
        positions = torch.cat(
            [
                topk_indices(v[offset : offset + part.grad.numel()], k) + offset
                for part, offset, k in zip(plan.compressed, plan.cat_offsets, plan.ks, strict=True)
            ]
        )
        return positions[self._order(positions, v[positions])]

    def _order(self, positions: Tensor, leader_values: Tensor) -> Tensor:
        """The permutation that puts the leader's positions in wire order (``value_order``)."""
        if self.value_order == "value":
            return torch.argsort(leader_values, descending=True, stable=True)
        if self.value_order == "magnitude":
            return torch.argsort(leader_values.abs(), descending=True, stable=True)
        return torch.argsort(positions)

    def _encode_positions(self, positions: Tensor, numel: int, ordered: bool = True) -> Tensor:
        """Wire form of ``positions`` (cat space), kept in their order when ``ordered``.

        ``raw``: int32 in the given order. ``golomb``: the Golomb code of the sorted positions and,
        when the order matters (``value_order`` other than position), the permutation back to the
        given order first, as ``ceil(log2 K)``-bit codes: about 8 + 10 bits per position at density
        0.01 and K ~ 1000, against 32 raw.
        """
        if self.index_coding == "raw":
            return positions.to(torch.int32).view(torch.uint8)
        ascending, where = torch.sort(positions)
        code = golomb_encode(ascending, numel).to_wire()
        if not ordered or self.value_order == "position":
            return code
        order = torch.empty_like(where)
        order[where] = torch.arange(where.numel(), device=where.device)
        return torch.cat([pack_uint(order, _order_bits(where.numel())).to(code.device), code])

    def _decode_positions(self, wire: Tensor, count: int, ordered: bool = True) -> Tensor:
        """Inverse of :meth:`_encode_positions` (``count`` positions, known to every worker)."""
        if self.index_coding == "raw":
            return wire.clone().view(torch.int32).long()
        if not ordered or self.value_order == "position":
            return golomb_decode(GolombCode.from_wire(wire))
        bits = _order_bits(count)
        order_bytes = packed_nbytes(count * bits)
        order = unpack_uint(wire[:order_bytes], bits, count).to(wire.device)
        return golomb_decode(GolombCode.from_wire(wire[order_bytes:]))[order]

    def _scaled_chunks(self, values: Tensor, scales: Tensor) -> Tensor:
        return to_chunks(values, self.ae_config.chunk) / scales[:, None]

    def _unscaled(self, chunks: Tensor, scales: Tensor, k: int) -> Tensor:
        return from_chunks(chunks * scales[:, None], k)

    @property
    def latent_torch_dtype(self) -> torch.dtype:
        return _LATENT_DTYPES[self.latent_dtype]

    def _wire_latent(self, latent: Tensor) -> Tensor:
        return latent.to(self.latent_torch_dtype).reshape(-1)

    def _latent_shape(self, rows: int) -> tuple[int, int, int]:
        return rows, self.ae_config.latent_channels, self.ae_config.latent_length

    def _latent_bytes(self, rows: int) -> int:
        """Wire size of the latent code of ``rows`` chunks."""
        return math.prod(self._latent_shape(rows)) * torch.empty((), dtype=self.latent_torch_dtype).itemsize

    def _send_flat_parameters(self, params: list[torch.nn.Parameter], dst: int | None) -> None:
        """Rank 0's ``params`` to rank ``dst`` (``None``: every rank); server traffic where rank 0 is a server."""
        flat = torch.nn.utils.parameters_to_vector(params).detach()
        server = self.has_server
        if dst is None:
            counted.broadcast(self.stats, flat, 0, self.process_group, as_server=server)
        elif self.rank == 0:
            counted.send(self.stats, flat, dst, self.process_group, as_server=server)
        elif self.rank == dst:
            counted.recv(self.stats, flat, 0, self.process_group)
        if dst is None or self.rank == dst:
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(flat, params)

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
        return {**super().summary_extras(), "lgc": lgc}

    def state_dict(self) -> dict[str, Any]:
        assert self.trainer is not None
        return {
            **super().state_dict(),
            "trainer": self.trainer.state_dict(),
            "world_size": self.world_size,
            "stage": int(self.stage),
            "current_step": self.current_step,
            "weights_sent": self.weights_sent,
            "refresh_until": self.refresh_until,
            "refresh_strikes": self.refresh_strikes,
            "refreshes": self.refreshes,
            "step_error": list(self.step_error),
            "last_metrics": dict(self.last_metrics),
            "stage_stats": {name: vars(s).copy() for name, s in self.stage_stats.items()},
            "stats_mark": vars(self.stats_mark).copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.trainer is None:
            self.world_size = state["world_size"]
            self._build_trainer()
        assert self.trainer is not None
        self.trainer.load_state_dict(state["trainer"])
        self.stage = LGCStage(state["stage"])
        self.current_step = int(state["current_step"])
        self.weights_sent = bool(state["weights_sent"])
        self.refresh_until = state["refresh_until"]
        self.refresh_strikes = int(state["refresh_strikes"])
        self.refreshes = int(state["refreshes"])
        self.step_error = list(state["step_error"])
        self.last_metrics = dict(state["last_metrics"])
        self.stage_stats = {name: CommStats(**s) for name, s in state["stage_stats"].items()}
        self.stats_mark = CommStats(**state["stats_mark"])


def _order_bits(count: int) -> int:
    """Bits of one entry of a permutation of ``count`` items."""
    return max(1, math.ceil(math.log2(count))) if count > 1 else 1


def lgc_hook(state: LGCHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one bucket of gradients with LGC (register through ``state.register(model)``)."""
    return state.process_bucket(bucket)
