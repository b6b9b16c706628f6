"""The hook's overlap path: every bucket encoded as it arrives, its collectives started at once.

Without overlap a compressor with state runs once per step, at the step's last bucket, after the
ranks agree on the step (the step guard, :mod:`lgc.ddp.step_guard`); its collectives wait for the
whole backward pass. With ``overlap=True`` (:class:`~lgc.ddp.CompressionHookState`) a compressor
that can hold a step back (:class:`~lgc.compressors.base.HoldsSteps`) encodes each bucket into held
state as DDP hands it over and its payloads' allgather starts while the backward pass goes on; the
same agreement then commits the held step or drops it. It costs memory, a second fp32 residual per
compressed parameter (DGC: a second momentum and accumulator), and a payload sent for nothing for a
parameter unused on every rank. Results, compressor state and the step
guard's policy are bitwise those of the held path (``tests/ddp/test_overlap.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lgc.compressors.base import HoldsSteps
from lgc.ddp.exchange import PayloadExchange, Segment
from lgc.ddp.step_guard import PendingBucket, agree_on_step, bucket_maxima, complete_dense, run_holding

if TYPE_CHECKING:
    from lgc.ddp.hook import CompressionHookState

__all__ = ["EncodeAhead"]


class EncodeAhead:
    """The current step's exchanges started ahead of the agreement, for one hook state.

    Args:
        state: the hook state whose buckets, step guard and compressor it runs (``overlap=True``).
    """

    __slots__ = ("maxima", "started", "state")

    def __init__(self, state: CompressionHookState) -> None:
        self.state = state
        #: The current step's exchanges, started as their buckets arrived.
        self.started: list[PayloadExchange] = []
        #: Their buckets' largest magnitude per parameter (the step guard's look), kept for the agreement.
        self.maxima: list[Tensor] = []

    @property
    def holder(self) -> HoldsSteps:
        """The compressor, which holds steps back (``overlap`` is refused at construction otherwise)."""
        compressor = self.state.compressor
        assert isinstance(compressor, HoldsSteps), compressor
        return compressor

    def bucket(self, buffer: Tensor, segments: tuple[Segment, ...], is_last: bool) -> torch.futures.Future[Tensor]:
        """Encode a bucket as it arrives and start its collectives; settle the step at its last bucket.

        The compressor encodes every compressed parameter of the bucket into held state
        (``compress_pending``: :meth:`~lgc.compressors.ErrorFeedback.compress_pending`,
        :meth:`~lgc.compressors.DGCCompressor.compress_pending`) and the allgather of the payloads
        starts at once, in bucket order on every rank, while the backward pass goes on. ``buffer``
        is left as it is. At the step's last bucket the ranks agree (:func:`~lgc.ddp.step_guard.agree_on_step`,
        the same reduction as without overlap), then (:meth:`settle`):

        * a skipped step (inf/NaN on some rank): the held state is dropped and every bucket is
          allreduced dense and unchanged, as without overlap; the payloads already sent are
          counted, and not decoded;
        * otherwise the held state of the used parameters is committed, the others' dropped; the
          parameters sent dense are allreduced then, the used ones bucket by bucket (the held
          path's allreduces exactly, so a ring sums them in the same order), and every bucket is
          decoded, a parameter unused on every rank left at its zero. A payload sent for a
          parameter unused on every rank, or in a skipped step, is counted in the statistics.
        """
        state = self.state
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        state.pending.append(PendingBucket(buffer, segments, future))
        maxima = bucket_maxima(buffer, segments)
        self.maxima.append(maxima)
        # A rank that sees an inf or NaN knows the step will be skipped: it encodes zeros instead
        # (its payloads are never decoded), so every compressor gets finite input and every rank
        # issues the same collectives.
        finite = bool(torch.isfinite(maxima).all())
        source = buffer if finite else torch.zeros_like(buffer)
        compressed = tuple(s for s in segments if s.compressed)
        try:
            self.started.append(PayloadExchange(state, source, compressed, state.iteration, pending=True))
        except BaseException:
            state.pending, self.started, self.maxima = [], [], []
            self.drop()
            raise
        if is_last:
            pending, state.pending = state.pending, []
            exchanges, self.started = self.started, []
            tables, self.maxima = self.maxima, []
            run_holding([bucket.future for bucket in pending], lambda: self.settle(pending, exchanges, tables))
        return future

    def settle(self, pending: list[PendingBucket], exchanges: list[PayloadExchange], maxima: list[Tensor]) -> None:
        """The end of a step encoded ahead: agree, then commit and decode, or pass it through."""
        state = self.state
        # Whatever raises before the commit drops the held step (decoding reads no held state, so
        # the commit comes last).
        try:
            verdict = agree_on_step(state.stats, state.process_group, pending, maxima)
            torch.futures.wait_all([future for exchange in exchanges for future in exchange.futures])
            if verdict.skip:
                self.drop()
                complete_dense(state.stats, state.process_group, pending, skipped=True)
            else:
                step = state.iteration
                dense = [
                    PayloadExchange(
                        state, b.buffer, tuple(s for s in b.segments if not s.compressed), step, used=verdict.used
                    )
                    for b in pending
                ]
                for sent_dense, exchange, bucket in zip(dense, exchanges, pending, strict=True):
                    torch.futures.wait_all(sent_dense.futures)
                    sent_dense.finish()
                    bucket.future.set_result(exchange.finish(verdict.used))
                self.holder.commit(verdict.used)
                state.iteration = step + 1
        except BaseException:
            self.drop()
            raise
        state.step_done(skipped=verdict.skip)
        state.scale_back(pending)

    def drop(self) -> None:
        """Drop a step encoded ahead (skipped, or failed): the compressor's held state and its schedule.

        ``begin_step`` ran at the step's first bucket, before the agreement; the compressor undoes
        what it moved (DGC's warm-up epoch) and the step that retries this one begins it again, so
        a skipped step leaves the state as the held path, which never began it, does.
        """
        self.holder.drop()
        self.state.begun_step = -1
