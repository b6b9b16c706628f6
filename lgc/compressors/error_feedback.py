"""Error feedback (residual accumulation), one wrapper for any compressor.

Each worker keeps, per tensor, the residual ``r`` of what earlier steps did not send. Per step it
compresses ``v = g + r`` and keeps ``r = v - decode(payload)``, so nothing is ever dropped, only
delayed (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019). The invariant
``v == decode(payload) + r`` holds exactly for every compressor and is tested.

With ``decay = beta < 1`` the residual fades: ``v = beta * r + g``. That is the error buffer of
SparseLoCo (Sarfi et al. 2025, ``beta = 0.95`` on the pseudo-gradient, standing in for DiLoCo's
outer momentum) and DeMo's momentum (Peng et al. 2024, ``m = beta * m + g``, then the sent part
is subtracted, ``beta = 0.999``): both are error feedback whose memory decays.

Why one module: the residual is one state in three forms (a tensor per key, a step held until the
ranks agree, a bucket's tensors as slices of one flat), which hand it to each other at every
commit, checkpoint and rebuilt bucket, and are tested against each other bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lgc.compressors.base import Compressor, ForwardsHookCalls, HoldsSteps, Payload
from lgc.compressors.segments import BucketFlats, CodesBuckets, FeedsBackSegments, feeds_back_segments, one_bucket
from lgc.compressors.topk import SparsePayload
from lgc.validation import PositiveFraction, check

__all__ = ["ErrorFeedback"]

#: Largest tensor whose top-k indices are int32 (the batched path sends int32 indices only).
_INT32_NUMEL = torch.iinfo(torch.int32).max


class ErrorFeedback(HoldsSteps, ForwardsHookCalls, Compressor):
    """Wraps ``compressor`` and feeds back what it did not send.

    Residuals are kept per ``key`` (the parameter name in the DDP hook), in fp32 whatever the
    gradient's dtype (so the rounding of half-precision payload values is fed back too). They
    differ between workers, so checkpoints must store every rank's residuals (the DDP hook state
    does).

    Args:
        compressor: the compressor whose error is fed back.
        decay: the factor ``beta`` in ``v = beta * r + g``, in (0, 1]. 1 (default) is plain error
            feedback: nothing is lost. Below 1 the unsent part fades geometrically and the residual
            is a momentum of the inputs: SparseLoCo's 0.95, DeMo's 0.999.
        bucketed: how :meth:`compress_many` encodes a bucket's tensors over a compressor with a
            bucket-level path (top-k, SBC, RedSync, EF-signSGD's scaled sign, chunked top-k and
            SparseLoCo's quantized values, DeMo, QSGD, TernGrad): as one flat (``True``), or tensor
            by tensor (``False``); set, it is also the wrapped compressor's where that one decodes a
            bucket at once (DeMo, QSGD, TernGrad: see the ``bucketed`` property). ``None``
            (default): flat on a GPU, where a few kernels per tensor cost more than the arithmetic,
            and tensor by tensor on the CPU, where the per-tensor selection is the faster one
            (``lgc-bench compressors`` measures both). The payloads and residuals are the same,
            except where a tensor ties at its ``k``-th magnitude: both keep an exact top-k, but may
            keep different entries of that magnitude, and the residuals differ from then on. With
            fp32 gradients such ties are rare; with bf16 or fp16 gradients (few distinct
            magnitudes) expect them.

    Example::

        >>> ef = ErrorFeedback(TopKCompressor(density=0.5))
        >>> g = torch.tensor([3.0, -1.0, 0.5, 2.0])
        >>> sent = ef.decompress(ef.compress(g, key="w"))
        >>> torch.equal(sent + ef.residuals["w"], g)
        True
    """

    def __init__(self, compressor: Compressor, decay: PositiveFraction = 1.0, bucketed: bool | None = None) -> None:
        if isinstance(compressor, ErrorFeedback):
            raise ValueError("error feedback is already applied; do not wrap ErrorFeedback twice")
        if compressor.keeps_own_residual:
            name = type(compressor).__name__
            raise ValueError(
                f"{name.removesuffix('Compressor')} keeps its own error feedback (its accumulator holds what was not "
                f"sent); ErrorFeedback around it would feed the error back twice: pass {name}(...) itself "
                "(lgc-train: compressor.error_feedback=false; lgc.compress: without error_feedback=True)"
            )
        check("decay", decay, PositiveFraction)
        self.compressor = compressor
        self.decay = float(decay)
        self.bucketed = bucketed
        self.combine = compressor.combine
        self.variable_size = compressor.variable_size
        self.codes_every_entry = compressor.codes_every_entry
        self.needs_shared_seed = compressor.needs_shared_seed
        #: Per-key residual: the part of earlier inputs that has not been sent yet.
        self.residuals: dict[str, Tensor] = {}
        #: Residuals of a step encoded by :meth:`compress_pending`, not yet committed.
        self._pending: dict[str, Tensor] = {}
        #: Per-key second buffers that :meth:`compress_pending` writes into (never saved).
        self._spares: dict[str, Tensor] = {}
        #: Buckets' residuals as flats (:meth:`compress_many`) and their held steps' second flats
        #: (:meth:`compress_pending_many`); never saved.
        self._buckets = BucketFlats()

    @property
    def bucketed(self) -> bool | None:
        """Where a bucket is encoded as one flat: None (a GPU), True (everywhere) or False (nowhere).

        Set to True or False, it is the wrapped compressor's too where that one decodes a bucket at
        once (:class:`~lgc.compressors.segments.CodesBuckets`: DeMo, QSGD, TernGrad, fp4), so one
        switch takes a bucket both ways; None leaves the compressor's own setting.
        """
        return self._bucketed

    @bucketed.setter
    def bucketed(self, bucketed: bool | None) -> None:
        if bucketed is not None and not isinstance(bucketed, bool):
            raise ValueError(f"bucketed must be None, True or False, got {bucketed!r}")
        if bucketed is True and not feeds_back_segments(self.compressor):
            raise ValueError(
                "bucketed=True needs a compressor with a bucket-level path (feed_back_segments: TopKCompressor, "
                "SBCCompressor, RedSyncCompressor, SignSGDCompressor, ChunkedTopKCompressor, DeMoCompressor, "
                f"QuantizedValues, QSGDCompressor, TernGradCompressor), got {self.compressor!r}"
            )
        self._bucketed = bucketed
        if bucketed is not None and isinstance(self.compressor, CodesBuckets):
            self.compressor.bucketed = bucketed

    def compress(self, tensor: Tensor, key: str) -> Payload:
        # In place: the residual buffer becomes g + beta * r, then what is not sent stays in it.
        payload, self.residuals[key] = self._encode(self._corrected(tensor, key, into=None), key)
        return payload

    def compress_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """One bucket's tensors at once (``bucketed``), as one flat, over a compressor with a bucket-level path
        (:class:`~lgc.compressors.segments.FeedsBackSegments`: top-k, the scaled sign, chunked top-k).

        The residuals of the bucket's tensors become slices of one flat fp32 tensor (built when the
        bucket is first seen, or when its residuals were replaced since: a checkpoint loaded, a held
        step committed, DDP's buckets rebuilt; ``residuals[key]`` stays each tensor's residual, so
        checkpoints keep one tensor per key and survive any bucketing). Then, whatever the number of
        tensors:

        1. ``r = beta * r + g`` as two multi-tensor operations (``torch._foreach_mul_``,
           ``torch._foreach_add_``: one kernel for many tensors on a GPU); a tensor without a
           residual yet takes its gradient, as :meth:`compress` does;
        2. the compressor's ``feed_back_segments`` encodes every segment and subtracts what it sends
           from the flat. Top-k: every tensor's exact top-k of the flat
           (:func:`~lgc.compressors.segment_topk.segment_topk`, ``k = ceil(density * numel)`` each),
           the values gathered and subtracted at once (one ``index_add_``), each payload a slice of
           them with its indices made local. The scaled sign: every scale in one multi-tensor norm,
           the signs packed at once, one subtraction of what the payloads decode to. Chunked top-k:
           one top-k over the tiles of every tensor of a size
           (:meth:`~lgc.compressors.ChunkedTopKCompressor.feed_back_segments`).

        The arithmetic per entry is :meth:`compress`'s, so residuals are bitwise equal and every
        payload holds the same (value, index) pairs, in another order: each tensor's largest
        magnitude first, where ``torch.topk`` leaves its order unspecified. Only a tie at a tensor's
        k-th magnitude can select other entries of the same magnitude (the lower index here).
        """
        if not self._flat_path(tensors, keys):
            return super().compress_many(tensors, keys)
        flat = self._flat_residuals(tensors, keys)
        assert isinstance(self.compressor, FeedsBackSegments)
        return list(self.compressor.feed_back_segments(flat, [t.numel() for t in tensors], keys))

    def batches_on(self, device: torch.device) -> bool:
        """Whether :meth:`compress_many` encodes as one flat on ``device`` (see ``bucketed``): never where the
        compressor's configuration has no bucket pass (``segments_supported``: DeMo's flat tiles, QSGD's
        codes that straddle bytes), which then goes tensor by tensor here."""
        if not feeds_back_segments(self.compressor) or self.bucketed is False:
            return False
        if isinstance(self.compressor, CodesBuckets) and not self.compressor.segments_supported():
            return False
        return self.bucketed is True or device.type != "cpu"

    def _flat_path(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> bool:
        """Whether :meth:`compress_many` encodes ``tensors`` as one flat (``bucketed``): 1-D, int32-indexable ones."""
        return one_bucket(tensors, keys, self.batches_on) and all(
            t.numel() <= _INT32_NUMEL and t.dim() == 1 for t in tensors
        )

    def _flat_residuals(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> Tensor:
        """``beta * r + g`` of every tensor, in place in the bucket's flat residual (built when needed)."""
        group, fresh = self._buckets.group([self.residuals], tensors, keys, held=False)
        views = group.views[0]
        carried = [i for i in range(len(keys)) if i not in fresh] if fresh else range(len(keys))
        old = [views[i] for i in carried]
        if old:
            if self.decay != 1.0:
                torch._foreach_mul_(old, self.decay)
            torch._foreach_add_(old, [tensors[i] for i in carried])
        for i in fresh:
            views[i].copy_(tensors[i])
        return group.flats[0]

    def _corrected(self, tensor: Tensor, key: str, into: Tensor | None) -> Tensor:
        """``g + beta * r`` in fp32, written into ``into`` (``None``: into the residual itself)."""
        residual = self.residuals.get(key)
        if residual is None:
            # fp32 whatever the gradient's dtype: a half-precision residual would round away the
            # small entries it exists to accumulate.
            return tensor.to(torch.float32, copy=True)
        residual = residual.to(tensor.device)
        out = residual if into is None else into
        if self.decay != 1.0:
            return torch.mul(residual, self.decay, out=out).add_(tensor)
        return torch.add(residual, tensor, out=out)

    def _encode(self, corrected: Tensor, key: str, held: bool = False) -> tuple[Payload, Tensor]:
        """The payload of ``corrected`` (``g + beta * r``) and the new residual (in place where it can).

        ``held``: a step encoded ahead of the agreement; a compressor that holds steps back itself
        holds its own state too.
        """
        holder = self._holder if held else None
        payload = holder.compress_pending(corrected, key) if holder else self.compressor.compress(corrected, key)
        if isinstance(payload, SparsePayload):
            # Cheaper than a dense decode: subtract what was sent at the sent positions only.
            payload.subtract_from(corrected)
            return payload, corrected
        # Out of place: a dense payload may alias ``corrected``.
        return payload, corrected - self.compressor.decompress(payload).to(corrected.dtype)

    # -- encoding ahead of the step's agreement (the hook's overlap) ------------------------------------
    @property
    def speculates(self) -> bool:
        """Whether :meth:`compress_pending` is available: the wrapped compressor keeps no state, or holds it back.

        The wrapped compressor keeps no state of its own, or holds a step back itself (its own
        ``compress_pending`` and ``commit``: QSGD's and TernGrad's counts of draws). Then a step can
        be encoded into a second buffer before the ranks agree on it (:meth:`commit`).
        """
        return self.compressor.stateless or self.compressor.pure_encoding or self._holder is not None

    @property
    def _holder(self) -> HoldsSteps | None:
        """The wrapped compressor where it holds a step back itself (its state moves with every call), else None."""
        inner = self.compressor
        if inner.stateless or inner.pure_encoding or not isinstance(inner, HoldsSteps) or not inner.speculates:
            return None
        return inner

    def compress_pending(self, tensor: Tensor, key: str) -> Payload:
        """:meth:`compress` with the same payload, the new residual held aside until :meth:`commit`.

        The residual stays as it is; ``g + beta * r`` is written into a second buffer per key, so
        holding a step back costs memory (one more fp32 copy of the compressed parameters), not a
        pass over it. For sparse payloads (top-k, SBC) that buffer becomes the new residual and the
        two swap at every commit; a dense payload's residual is a new tensor every step, as in
        :meth:`compress`. The arithmetic is :meth:`compress`'s, operation for operation, so
        payloads and residuals are bitwise equal.
        """
        if not self.speculates:
            raise TypeError(f"{self!r} cannot hold a step back: {self.compressor!r} keeps state of its own")
        residual = self.residuals.get(key)
        spare = self._spares.pop(key, None)
        if residual is not None and (spare is None or spare.shape != residual.shape or spare.device != tensor.device):
            spare = torch.empty_like(residual, device=tensor.device)
        payload, self._pending[key] = self._encode(self._corrected(tensor, key, into=spare), key, held=True)
        return payload

    def compress_pending_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """:meth:`compress_pending` of a bucket's tensors at once where :meth:`compress_many` takes them as one
        flat (``bucketed``; a compressor that keeps no state of its own, or encodes purely: top-k,
        SBC, the scaled sign), with the same payloads and held residuals.

        ``g + beta * r`` is written into a second flat (kept from the bucket's last held step), the
        compressor's ``feed_back_segments`` encodes it and subtracts what it sends, and
        :meth:`commit` adopts it as the bucket's residual flat when every tensor of the bucket was
        used; otherwise each used key takes its slice and the next bucket step builds the flat anew.
        A tensor without a residual yet takes its gradient, as :meth:`compress_pending` does.
        """
        if self._holder is not None or not self.speculates or not self._flat_path(tensors, keys):
            return super().compress_pending_many(tensors, keys)
        state, fresh = self._buckets.group([self.residuals], tensors, keys, held=True)
        out = self._buckets.spare(state, keys)
        flat, views = out.flats[0], out.views[0]
        grads = torch.cat([t.reshape(-1) for t in tensors])
        if self.decay != 1.0:
            torch.mul(state.flats[0], self.decay, out=flat).add_(grads)
        else:
            torch.add(state.flats[0], grads, out=flat)
        for i in fresh:
            views[i].copy_(tensors[i])
        assert isinstance(self.compressor, FeedsBackSegments)
        payloads = list(self.compressor.feed_back_segments(flat, state.numels, keys))
        for key, view in zip(keys, views, strict=True):
            self._pending[key] = view
        return payloads

    def commit(self, keys: frozenset[str] | set[str]) -> None:
        """Adopt the held residuals of ``keys``; drop the others (their residuals stay as before the step).

        ``commit(frozenset())`` drops the whole step (the ranks agreed to skip it).
        """
        held_buckets = self._buckets.commit(keys)
        if (holder := self._holder) is not None:
            holder.commit(keys)
        for key, held in self._pending.items():
            current = self.residuals.get(key)
            if key in keys:
                self.residuals[key] = held
                spare = current
            else:
                spare = held
            if spare is not None and spare is not self.residuals.get(key):
                self._spares[key] = spare
        self._pending = {}
        for signature in held_buckets:
            for key in signature:  # slices of the flats, which serve held bucket steps only
                self._spares.pop(key, None)

    def drop(self) -> None:
        """Drop the held step (the ranks agreed to skip it): its residuals, and the wrapped compressor's held step."""
        if (holder := self._holder) is not None:
            holder.drop()
        self.commit(frozenset())

    def decompress(self, payload: Payload) -> Tensor:
        return self.compressor.decompress(payload)

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        return self.compressor.aggregate(payloads)

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        self.compressor.aggregate_into(payloads, out)

    def aggregate_many(self, payloads: Sequence[list[Payload]], outs: Sequence[Tensor]) -> None:
        self.compressor.aggregate_many(payloads, outs)

    def payload_from_sum(self, summed: Tensor, own: Payload) -> Payload:
        return self.compressor.payload_from_sum(summed, own)

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> Payload:
        return self.compressor.payload_from_wire(wire, numel, key=key)

    def payloads_from_wire_many(
        self, wires: Sequence[Tensor], numels: Sequence[int], keys: Sequence[str]
    ) -> list[Payload]:
        return self.compressor.payloads_from_wire_many(wires, numels, keys)

    @property
    def shared_seed(self) -> int:  # type: ignore[override]
        return self.compressor.shared_seed

    def set_shared_seed(self, seed: int) -> None:
        self.compressor.set_shared_seed(seed)

    def residual_store(self) -> dict[str, Tensor]:
        return self.residuals

    def residual_norm(self) -> float:
        """L2 norm of all residuals together (a health signal: it should stay bounded)."""
        if not self.residuals:
            return 0.0
        return float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(r) for r in self.residuals.values()]))
        )

    def __getstate__(self) -> dict[str, Any]:
        # Second buffers are scratch and a held step belongs to this process: neither travels.
        return {**self.__dict__, "_pending": {}, "_spares": {}, "_buckets": BucketFlats()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        scratch = {"_pending": {}, "_spares": {}, "_buckets": BucketFlats()}
        state = dict(state)
        state.setdefault("_bucketed", state.pop("bucketed", None))
        self.__dict__.update({**scratch, **state})
        self.bucketed = self._bucketed  # the setter hands it to the compressor too

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {key: r.detach().cpu().clone() for key, r in self.residuals.items()},
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {key: r.clone() for key, r in state["residuals"].items()}
        self._pending, self._spares, self._buckets = {}, {}, BucketFlats()
        self.compressor.load_state_dict(state["compressor"])

    def __repr__(self) -> str:
        decay = "" if self.decay == 1.0 else f", decay={self.decay:g}"
        bucketed = "" if self.bucketed is None else f", bucketed={self.bucketed}"
        return f"ErrorFeedback({self.compressor!r}{decay}{bucketed})"
