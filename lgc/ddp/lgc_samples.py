"""Stage 2, codec training: every worker's values at the leader's positions, gathered at rank 0.

During codec training the workers communicate top-k as ``compressor=topk`` does. Each step, every
worker also keeps, per compressed parameter, its error-corrected gradient at the leader's top-k
positions (the very vector the codec will encode in the compressed stage). At the step's last
bucket the whole model's samples are joined in cat space, put in wire order
(:class:`~lgc.ddp.lgc_codec.LeaderIndexCodec`), gathered at rank 0 (counted with the stage's
bytes), cut into chunks and divided by the leader's chunk scales: ``[rows, workers, chunk]``,
what the codec's trainer takes; rank 0 then trains (``ae_updates_per_step`` updates per step).
:class:`CodecTrainingOps` is that stage, mixed into :class:`~lgc.ddp.lgc_base.LGCHookState`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.coding import pack_bits
from lgc.compressors.topk import SparsePayload
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.exchange import PayloadExchange
from lgc.ddp.lgc_codec import LeaderIndexCodec
from lgc.ddp.step_guard import PendingBucket

__all__ = ["CodecTrainingOps", "GatheredSamples", "Sample", "gather_samples"]


class Sample(NamedTuple):
    """One compressed parameter's stage-2 sample of this worker."""

    #: The parameter's position in the model (samples are joined in this order).
    order: int
    numel: int
    #: The leader's top-k positions in the parameter and its values there.
    positions: Tensor
    leader_values: Tensor
    #: This worker's error-corrected gradient at those positions.
    values: Tensor
    #: LGC-PS: which of those positions are in this worker's innovation.
    innovation: Tensor | None


class GatheredSamples(NamedTuple):
    """A step's samples at rank 0."""

    #: ``[rows, workers, chunk]``: every worker's values in wire order, chunked and scaled.
    chunks: Tensor
    #: LGC-PS: every worker's innovation mask over the ``count`` values, bit-packed.
    innovation_masks: list[Tensor] | None
    #: Values per worker (the step's ``K``).
    count: int


def gather_samples(
    samples: list[Sample], codec: LeaderIndexCodec, stats: CommStats, group: dist.ProcessGroup | None
) -> GatheredSamples | None:
    """Join this worker's samples and gather everyone's at rank 0 (a collective: every rank calls it).

    Returns the gathered samples at rank 0, None elsewhere (and everywhere when there are none).
    """
    samples = sorted(samples, key=lambda sample: sample.order)
    if not samples:
        return None
    offsets = torch.tensor([0] + [sample.numel for sample in samples[:-1]]).cumsum(0).tolist()
    positions = torch.cat([sample.positions + offset for sample, offset in zip(samples, offsets, strict=True)])
    leader_values = torch.cat([sample.leader_values for sample in samples])
    order = codec.order(positions, leader_values)
    values = torch.cat([sample.values for sample in samples])[order]
    gathered = counted.gather(stats, values, 0, group)
    masks = None
    if samples[0].innovation is not None:
        mask = torch.cat([sample.innovation for sample in samples])[order]  # type: ignore[misc]
        masks = counted.gather(stats, pack_bits(mask).to(values.device), 0, group)
    if gathered is None:
        return None
    scales = codec.chunk_scales(leader_values[order])
    chunks = torch.stack([codec.scaled_chunks(x, scales) for x in gathered], dim=1)
    return GatheredSamples(chunks, masks, values.numel())


class CodecTrainingOps:
    """Stage 2 of an LGC hook state: top-k exchange, sample collection and codec training (a mixin).

    It holds no state of its own; it reads and writes the hook state's ``samples``, ``trainer``,
    ``ef``, ``leader``, ``leader_code``, ``param_order``, ``ae_updates_per_step``, ``stats``,
    ``process_group`` and ``last_metrics``. Topologies override :meth:`_innovation_of` and
    :meth:`_add_samples` (LGC-PS: innovation masks).
    """

    __slots__ = ()
    # Provided by the hook state this is mixed into.
    samples: list[Sample]
    trainer: Any
    ef: Any
    leader: int
    leader_code: LeaderIndexCodec
    param_order: dict[str, int]
    ae_updates_per_step: int
    stats: CommStats
    process_group: Any
    last_metrics: dict[str, float]
    rank: int

    def _codec_training_step(self, pending: list[PendingBucket], used: frozenset[str], step: int) -> None:
        """Top-k per parameter, bucket by bucket; then the samples are joined, gathered and trained on."""
        for bucket in pending:
            self._exchange_and_sample(bucket, used, step)
        gathered = gather_samples(self.samples, self.leader_code, self.stats, self.process_group)
        self.samples = []
        if gathered is not None:
            self._add_samples(*gathered)
        if self.rank == 0:
            losses = self.trainer.train(self.ae_updates_per_step)
            if losses:
                self.last_metrics["lgc/ae_loss"] = losses["total"]

    def _exchange_and_sample(self, bucket: PendingBucket, used: frozenset[str], step: int) -> None:
        """Top-k as usual; keep this worker's values at the leader's positions of every parameter."""
        exchange = PayloadExchange(self, bucket.buffer, bucket.segments, step, used=used)  # type: ignore[arg-type]
        torch.futures.wait_all(exchange.futures)
        exchange.finish()
        for segment, own in zip(exchange.sparse, exchange.own, strict=True):
            assert isinstance(own, SparsePayload)
            leader = exchange.received[segment.name][self.leader]
            # The corrected gradient before sending: what is left plus what this worker sent.
            v = self.ef.residuals[segment.name].clone().index_add_(0, own.indices.long(), own.values.float())
            positions = leader.indices.long()
            self.samples.append(
                Sample(
                    self.param_order[segment.name],
                    segment.numel,
                    positions,
                    leader.values.float(),
                    v[positions].float(),
                    self._innovation_of(v, positions),
                )
            )

    def _innovation_of(self, v: Tensor, positions: Tensor) -> Tensor | None:
        """LGC-PS: which of the leader's ``positions`` of one parameter are in this worker's innovation."""
        return None

    def _add_samples(self, chunks: Tensor, innovation_masks: list[Tensor] | None, k: int) -> None:
        """At rank 0: add the step's samples ``[rows, workers, chunk]`` to the codec's buffer."""
        self._record_held_out(self.trainer.evaluate(chunks) if self.trainer.num_samples else None)
        self.trainer.add(chunks)

    def _record_held_out(self, losses: dict[str, float] | None) -> None:
        # Losses on samples before the codec trains on them: an honest generalization estimate.
        if losses:
            self.last_metrics["lgc/recon_error"] = losses["relative_error"]
