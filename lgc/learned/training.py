"""LGC's stage 2: the codec, its trainer, the samples it learns from, and the weights the workers get.

During codec training (Abrahamyan et al. 2021, stage 2) the workers communicate top-k with error
feedback exactly as ``compressor=topk`` does, and every worker also keeps its error-corrected
gradient at the step leader's top-k positions, the vector the codec will encode in the compressed
stage. At the step's end those samples are gathered at rank 0 (:mod:`lgc.learned.samples`),
which trains the codec on them (``training.updates_per_step`` updates per step). Rank 0 logs, per step,
``lgc/leader_correlation`` (Pearson's r between the workers' values at the leader's positions, the
mean over pairs: LGC's premise), ``lgc/leader_energy_share`` (the share of rank 0's error-corrected
gradient energy at those positions: the most the codec can carry), ``lgc/recon_error`` (the codec's
relative error on the step's samples before it trains on them) and, for LGC-RAR's autoencoder,
``lgc/pca_recon_error`` (the same for PCA of the autoencoder's latent size fitted on the same
buffer: an autoencoder that does not beat it is starved of data or updates). When the compressed
stage begins, rank 0's weights go to the workers that need them (the topology's stage says which).

The paper's stage 2 learns from a different regime than the one the codec serves: its error
feedback is each worker's own top-k's, while the compressed stage keeps what the leader's positions
leave. With ``training.samples="leader"`` (LGC-RAR) stage 2 communicates as the compressed stage will,
with the codec replaced by the exact sum (shared-index float32:
:class:`~lgc.learned.shared_index.SharedIndexStage`), and learns from the values that exchange
carried: the samples come from the error feedback the codec will see.

Three trainers implement :class:`CodecTrainer`: the paper's autoencoder
(:class:`~lgc.autoencoder.AutoencoderTrainer`), the linear codec
(:class:`~lgc.autoencoder.linear.LinearCodecTrainer`, principal directions, LGC's learned but linear
ablation) and the PCA-initialised autoencoder
(:class:`~lgc.autoencoder.pca_autoencoder.PCAAutoencoderTrainer`: those directions and a nonlinear
correction that starts at zero). The shared-index codecs learn nothing and hold no :class:`CodecTraining` at all.

Why one module: codec training's lifecycle (samples collected in the warm-up, the fit, the
refresh that fits again when the delivered error grows, saving and loading a codec) runs on one
sample buffer and one trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lgc.autoencoder import AutoencoderConfig, AutoencoderTrainer, GradientAutoencoder, LossWeights
from lgc.autoencoder.linear import LinearChunkCodec, LinearCodecTrainer
from lgc.autoencoder.pca_autoencoder import PCAAutoencoder, PCAAutoencoderConfig, PCAAutoencoderTrainer
from lgc.autoencoder.saved import load_codec_into, read_codec, save_codec
from lgc.coding import unpack_bits
from lgc.compressors.selection import topk_indices
from lgc.compressors.topk import SparsePayload, num_selected
from lgc.ddp.exchange import ExchangeHost, PayloadExchange
from lgc.ddp.step_guard import PendingBucket
from lgc.learned.knobs import CodecTrainingKnobs
from lgc.learned.leader_code import LeaderIndexCodec
from lgc.learned.samples import Sample, gather_leader_samples, gather_samples, mean_pairwise_correlation
from lgc.learned.step import StepContext
from lgc.validation import NonNegativeFloat, check

__all__ = ["ChunkCodec", "CodecTrainer", "CodecTraining"]


def _loss_weights(given: Mapping[str, Any], *, ps: bool = False) -> LossWeights:
    """``training.loss_weights`` as :class:`LossWeights`: each a non-negative finite number, not all zero
    (for LGC-PS, ``ps``, not all zero among the terms it trains on: the ``mean`` term is LGC-RAR's)."""
    unknown = sorted(set(given) - set(LossWeights._fields))
    if unknown:
        raise ValueError(
            f"training.loss_weights.{unknown[0]} is not a loss term; they are {', '.join(LossWeights._fields)}"
        )
    for name, value in given.items():
        check(f"training.loss_weights.{name}", value, NonNegativeFloat)
    weights = LossWeights(**given)
    if not any(weights):
        raise ValueError(f"training.loss_weights are all 0 ({dict(given)}): the codec would learn nothing")
    if ps and not (weights.reconstruction or weights.similarity):
        raise ValueError(
            f"training.loss_weights={dict(given)}: LGC-PS trains on reconstruction and similarity only (the "
            "mean term is LGC-RAR's), and both are 0: the codec would learn nothing"
        )
    return weights


@runtime_checkable
class ChunkCodec(Protocol):
    """A codec of ``[rows, chunk]`` value chunks (an ``nn.Module``): what the compressed stage calls."""

    def encode(self, chunks: Tensor) -> Tensor: ...

    def decode(self, latent: Tensor, innovation: Tensor | None = None, decoder: int = 0) -> Tensor: ...

    def latent_shape(self, rows: int) -> tuple[int, ...]: ...


@runtime_checkable
class CodecTrainer(Protocol):
    """What stage 2 needs of a codec's trainer (the autoencoder's and the linear codec's implement it).

    A sample is one chunk position of every worker, ``[workers, chunk]``; LGC-PS adds each worker's
    innovation (its values known exactly, zero elsewhere) of the same shape.
    """

    #: The codec being trained (a :class:`ChunkCodec` module).
    autoencoder: Any

    @property
    def num_samples(self) -> int:
        """Samples in the replay buffer."""
        ...

    def add(self, chunks: Tensor, innovations: Tensor | None = None) -> None:
        """Add ``[rows, workers, chunk]`` samples to the buffer."""

    def evaluate(self, chunks: Tensor, innovations: Tensor | None = None) -> dict[str, float]:
        """Losses on samples not trained on (``relative_error`` among them)."""
        ...

    def train(self, updates: int) -> dict[str, float]:
        """``updates`` optimizer steps on the buffer; their losses (``total`` among them), or ``{}``."""
        ...

    def to(self, device: torch.device) -> CodecTrainer: ...

    def clear_buffer(self) -> None:
        """Forget the samples (a refresh trains on fresh ones)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CodecTraining:
    """The codec of a learned LGC state: how it is built, what it learns from, and where it goes.

    Args:
        knobs: the codec and its training (:class:`~lgc.learned.knobs.CodecTrainingKnobs`). A
            ``knobs.autoencoder["init"]`` (a ``codec.pt`` saved by :meth:`save`; ``lgc-train`` writes
            one beside ``summary.json``) starts this codec from its weights: stage 2 then fine-tunes
            them, or, with ``stages.ae_steps=0``, is skipped: every worker loads the same weights,
            so none are broadcast. A codec of another shape is refused.
        innovation_density: LGC-PS: every worker's innovation density. Its samples then carry
            each worker's innovation mask and the autoencoder has one decoder per worker with an
            innovation input; ``None`` (LGC-RAR): one decoder, no innovation.
        sample_exchange: the exchange stage 2 runs instead of top-k (an object with
            ``exchange(ctx)`` returning this worker's values at the leader's positions in wire
            order, e.g. a float32 :class:`~lgc.learned.shared_index.SharedIndexStage`): the
            samples are then those values (``knobs.samples="leader"``). ``None``: the paper's top-k.
    """

    __slots__ = (
        "config",  # the autoencoder's shape (its decoders set by build() for the world size)
        "codec",
        "linear_latent",
        "pca_hidden",
        "innovation_density",
        "updates_per_step",
        "options",  # the trainer's optimizer, learning rate, batch and buffer sizes, loss weights, seed
        "init",  # path of a saved codec that starts this one, or None
        "frozen",  # a warm-started codec that stage 2 does not retrain (ae_steps=0)
        "trainer",  # built for the world size (build()); rank 0's buffer holds the samples
        "samples",  # this worker's samples of the current step, joined at its end
        "sample_exchange",  # stage 2's exchange in place of top-k (training.samples="leader"), or None
        "weights_sent",  # whether the workers hold the trained weights (the compressed stage may start)
    )

    def __init__(
        self,
        knobs: CodecTrainingKnobs,
        *,
        innovation_density: float | None = None,
        sample_exchange: Any = None,
    ) -> None:
        autoencoder = dict(knobs.autoencoder)
        init = autoencoder.pop("init", None)
        self.init: str | None = None if init is None else str(init)
        if self.init is not None:
            read_codec(self.init)  # a missing or foreign file is named before any worker starts
        if knobs.linear_latent is not None and knobs.codec == "autoencoder":
            raise ValueError(
                f"training.linear_latent={knobs.linear_latent!r} sizes the linear and PCA-initialised codecs, "
                f"but training.codec={knobs.codec!r}"
            )
        if knobs.samples == "leader" and innovation_density is not None:
            raise ValueError(
                "training.samples='leader' learns from the exact exchange at the leader's positions, which "
                "carries no worker's innovation: LGC-PS's codec trains on the paper's top-k samples only"
            )
        if knobs.samples == "leader" and sample_exchange is None:
            raise ValueError("training.samples='leader' needs the compressed stage's exchange (LGC-RAR's)")
        self.updates_per_step = knobs.updates_per_step
        try:
            self.config = AutoencoderConfig.from_kwargs(**autoencoder)
        except (TypeError, ValueError) as err:
            raise type(err)(f"training.autoencoder: {err}") from None
        self.codec = knobs.codec
        self.linear_latent = knobs.linear_latent
        self.pca_hidden = knobs.pca_hidden
        self.innovation_density = None if innovation_density is None else float(innovation_density)
        self.options = dict(
            optimizer=knobs.optimizer,
            lr=knobs.lr,
            batch_size=knobs.batch_size,
            buffer_size=knobs.buffer_size,
            weights=_loss_weights(knobs.loss_weights, ps=innovation_density is not None),
            seed=self.config.seed,
        )
        self.frozen = False
        self.trainer: CodecTrainer | None = None
        self.samples: list[Sample] = []
        self.sample_exchange = sample_exchange
        self.weights_sent = False

    @property
    def chunk(self) -> int:
        """Values per chunk (the codec's input length)."""
        return self.config.chunk

    def warm_start(self, ae_steps: int) -> None:
        """With ``init`` and no stage 2 (``ae_steps=0``), every worker holds the weights from the start."""
        self.frozen = self.init is not None and ae_steps == 0
        self.weights_sent = self.frozen

    def build(self, world_size: int) -> None:
        """Build the codec and its trainer for ``world_size`` workers (LGC-PS: one decoder each)."""
        per_worker = self.innovation_density is not None
        self.config = AutoencoderConfig(
            **{**vars(self.config), "num_decoders": world_size if per_worker else 1, "innovation": per_worker}
        )
        # As many latent floats per chunk as the autoencoder's by default: the same bytes on the wire.
        latent = self.linear_latent if self.linear_latent is not None else self.config.latent_numel
        if self.codec == "autoencoder":
            trainer: CodecTrainer = AutoencoderTrainer(GradientAutoencoder(self.config), **self.options)
        elif self.codec == "pca_autoencoder":
            shape = PCAAutoencoderConfig(self.config.chunk, latent, self.pca_hidden, seed=self.config.seed)
            trainer = PCAAutoencoderTrainer(PCAAutoencoder(shape), **self.options)
        else:
            trainer = LinearCodecTrainer(
                LinearChunkCodec(self.config.chunk, latent), buffer_size=self.options["buffer_size"]
            )
        if self.init is not None:
            load_codec_into(trainer.autoencoder, self.init)
            if self.frozen:
                trainer.autoencoder.eval()
        self.trainer = trainer

    @property
    def model(self) -> nn.Module:
        """The codec (call :meth:`build` first)."""
        assert self.trainer is not None, "call register(model) first"
        return self.trainer.autoencoder

    def to(self, device: torch.device) -> None:
        """Move the codec (and its trainer) to ``device`` if it is elsewhere."""
        assert self.trainer is not None
        weight = next(self.model.parameters(), None)
        if weight is not None and weight.device != device:
            self.trainer.to(device)

    def start_refresh(self) -> None:
        """Stage 2 again: train on fresh samples only; the workers need the new weights afterwards."""
        assert self.trainer is not None
        self.trainer.clear_buffer()
        self.weights_sent = False

    def save(self, path: str | Path) -> Path | None:
        """Write the workers' codec to ``path`` (``None``: it was never trained or loaded)."""
        if not self.weights_sent or self.trainer is None:
            return None
        return save_codec(self.model, path)

    # -- a stage-2 step ---------------------------------------------------------------------------
    def step(
        self,
        hook: ExchangeHost,
        pending: list[PendingBucket],
        used: frozenset[str],
        step: int,
        *,
        leader: int,
        code: LeaderIndexCodec,
        param_order: dict[str, int],
        metrics: dict[str, float],
    ) -> None:
        """Top-k per parameter, bucket by bucket; then the samples are joined, gathered and trained on.

        ``hook`` runs the top-k exchange (its compressor is error feedback around top-k);
        ``param_order`` joins the samples in the model's order; ``metrics`` gets the losses.
        """
        assert self.trainer is not None
        for bucket in pending:
            self._exchange_and_sample(hook, bucket, used, step, leader, param_order)
        at_leader = sum(float(sample.values.square().sum()) for sample in self.samples)
        _log_energy_share(hook.process_group, at_leader, sum(sample.energy for sample in self.samples), metrics)
        gathered = gather_samples(self.samples, code, hook.stats, hook.process_group)
        self.samples = []
        if gathered is not None:
            self._add(*gathered, code, metrics)
        self._train(hook.process_group, metrics)

    def step_at_leader(self, ctx: StepContext) -> None:
        """A stage-2 step with ``sample_exchange``: its exchange, then the values it carried are learned from."""
        assert self.trainer is not None and self.sample_exchange is not None
        energy = ctx.plan.energy(ctx.residuals)
        own = self.sample_exchange.exchange(ctx)
        if own is not None:  # the same on every rank: whether the step compressed any parameter
            _log_energy_share(ctx.group, float(own.square().sum()), energy, ctx.metrics)
            gathered = gather_leader_samples(own, ctx.leader, ctx.code, ctx.stats, ctx.group)
            if gathered is not None:
                self._add(*gathered, ctx.code, ctx.metrics)
        self._train(ctx.group, ctx.metrics)

    def _train(self, group: dist.ProcessGroup | None, metrics: dict[str, float]) -> None:
        """Rank 0 trains the codec on its buffer (``training.updates_per_step`` updates)."""
        assert self.trainer is not None
        if dist.get_rank(group) == 0:
            losses = self.trainer.train(self.updates_per_step)
            if losses:
                metrics["lgc/ae_loss"] = losses["total"]

    def _exchange_and_sample(
        self,
        hook: ExchangeHost,
        bucket: PendingBucket,
        used: frozenset[str],
        step: int,
        leader: int,
        param_order: dict[str, int],
    ) -> None:
        """Top-k as usual; keep this worker's values at the leader's positions of every parameter."""
        exchange = PayloadExchange(hook, bucket.buffer, bucket.segments, step, used=used)
        torch.futures.wait_all(exchange.futures)
        exchange.finish()
        residuals = hook.compressor.residuals  # type: ignore[attr-defined]  # error feedback's
        for segment, own in zip(exchange.sparse, exchange.own, strict=True):
            assert isinstance(own, SparsePayload)
            at_leader = exchange.received[segment.name][leader]
            # The corrected gradient before sending: what is left plus what this worker sent.
            v = residuals[segment.name].clone().index_add_(0, own.indices.long(), own.values.float())
            positions = at_leader.indices.long()
            self.samples.append(
                Sample(
                    param_order[segment.name],
                    segment.numel,
                    positions,
                    at_leader.values.float(),
                    v[positions].float(),
                    self._innovation_of(v, positions),
                    float(v.square().sum()),
                )
            )

    def _innovation_of(self, v: Tensor, positions: Tensor) -> Tensor | None:
        """LGC-PS: which of the leader's ``positions`` of one parameter are in this worker's innovation."""
        if self.innovation_density is None:
            return None
        return torch.isin(positions, topk_indices(v, num_selected(v.numel(), self.innovation_density)))

    def _add(
        self,
        chunks: Tensor,
        innovation_masks: list[Tensor] | None,
        count: int,
        code: LeaderIndexCodec,
        metrics: dict[str, float],
    ) -> None:
        """At rank 0: add the step's samples ``[rows, workers, chunk]`` (and innovations) to the buffer."""
        assert self.trainer is not None
        innovations = None
        if innovation_masks is not None:
            masks = torch.stack([code.chunks(unpack_bits(m.cpu(), count).float()) for m in innovation_masks], dim=1)
            innovations = chunks * masks.to(chunks.device)
        if chunks.shape[1] > 1:
            # How alike the workers' values at the leader's positions are (the scaled chunks the codec sees).
            metrics["lgc/leader_correlation"] = float(mean_pairwise_correlation(chunks.transpose(0, 1).flatten(1)))
        if self.trainer.num_samples:
            # Losses on samples before the codec trains on them: an honest generalization estimate.
            losses = self.trainer.evaluate(chunks, innovations)
            if losses:
                metrics["lgc/recon_error"] = losses["relative_error"]
            if isinstance(self.trainer, AutoencoderTrainer) and innovations is None:
                # The same estimate for PCA of the autoencoder's latent size, fitted on the same buffer:
                # an autoencoder above it has too little data (or too few updates) to beat a linear code.
                metrics["lgc/pca_recon_error"] = _pca_error(self.trainer, chunks)
        self.trainer.add(chunks, innovations)

    # -- checkpoints ------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # The current step's samples are per process (spawned workers start without them).
        return {**{slot: getattr(self, slot) for slot in self.__slots__}, "samples": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)

    def state_dict(self) -> dict[str, Any]:
        assert self.trainer is not None
        return {"trainer": self.trainer.state_dict(), "weights_sent": self.weights_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.trainer is not None
        self.trainer.load_state_dict(state["trainer"])
        self.weights_sent = bool(state["weights_sent"])


def _log_energy_share(
    group: dist.ProcessGroup | None, at_leader: float, total: float, metrics: dict[str, float]
) -> None:
    """Rank 0 logs ``lgc/leader_energy_share``: its corrected gradient's energy share at the leader's positions."""
    if dist.get_rank(group) == 0 and total > 0:
        metrics["lgc/leader_energy_share"] = at_leader / total


@torch.no_grad()
def _pca_error(trainer: AutoencoderTrainer, chunks: Tensor) -> float:
    """Held-out relative error of the workers' mean through PCA of the autoencoder's latent size.

    Fitted on the trainer's buffer (every worker's chunks), scored on ``chunks`` (``[rows, workers,
    chunk]``) as LGC-RAR's autoencoder is: the decoded mean against the mean.
    """
    assert trainer.chunks is not None
    config = trainer.autoencoder.config
    pca = LinearChunkCodec(config.chunk, min(config.latent_numel, config.chunk)).to(trainer.chunks.device)
    pca.fit(trainer.chunks)
    return LinearCodecTrainer(pca).evaluate(chunks)["relative_error"]
