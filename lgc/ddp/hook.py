"""A DDP communication hook that runs any :class:`~lgc.compressors.Compressor`: the state and the hook.

This module (with the other modules of :mod:`lgc.ddp`) is the only place that calls
:mod:`torch.distributed`. It follows PyTorch's own hooks (``ddp_comm_hooks/powerSGD_hook.py``):

1. DDP hands the hook one flat bucket of gradients; the hook divides it by the world size.
2. The first ``start_iter`` iterations use a plain allreduce, as PyTorch's PowerSGD hook does
   while DDP rebuilds its buckets after the first iteration; the iteration counter is saved, so a
   resumed run does not repeat them.
3. A stateful compressor (residuals, momenta, random generators) runs once per *step*, at the
   step's last bucket, after the ranks agree whether some rank's gradients are non-finite (then
   the step passes through dense and unchanged, counted in ``stats.skipped_steps``, as if it never
   happened) and which parameters are unused on every rank (left alone): the step guard,
   :mod:`lgc.ddp.step_guard`. Stateless compressors (``none``, ``fp16``) need neither: they run
   bucket by bucket as the buckets become ready, overlapping communication with the backward
   pass, and an inf or NaN simply passes through their sum (the step is counted as skipped all the
   same). With ``overlap``, a compressor that can hold a step back (error feedback over a
   compressor without state of its own, DGC, QSGD, TernGrad, RedSync, unshared random-block) encodes
   each bucket as it arrives into held state and starts its collectives at once; the same
   agreement then commits or drops the step (:meth:`CompressionHookState.encode_ahead`).
4. Parameters with fewer than ``min_numel`` elements (biases, norm layers) are allreduced dense,
   in the gradient's dtype (by default the method's own threshold: none for DeMo and SparseLoCo,
   whose references compress every tensor).
5. Every other parameter's gradient is compressed on its own, keyed by the parameter's name, so
   compressor state (residuals, momenta) is independent of DDP's bucketing and survives restarts.
6. Payloads are combined as the compressor declares and decoded (:mod:`lgc.ddp.exchange`), with
   every collective issued in the hook, in the same order on every rank. Behind the step guard a
   skipped step or an unused parameter does not reach the compressor's ``finish_aggregate``;
   without it (stateless compressors) it is called for every parameter of every step, so a
   stateless compressor's ``finish_aggregate`` must keep no state.

Bytes are counted against what plain DDP would send: the bucket's own dtype (4 bytes per element
for an fp32 model, 2 for a model in fp16 or bf16).

Its length is the hook state, which holds the step guard's and the exchange's bookkeeping (the
guard is :mod:`lgc.ddp.step_guard`, the exchange :mod:`lgc.ddp.exchange`).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.base import (
    CombineMode,
    Compressor,
    HoldsSteps,
    holds_steps,
    method_min_numel,
    method_start_iter,
)
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.exchange import PayloadExchange, Segment, average_compressed, encode_buffers
from lgc.ddp.protocol import HookState
from lgc.ddp.step_guard import PendingBucket, StepVerdict, agree_flags, all_finite, allreduce_as_they_are, run_holding

__all__ = ["CompressionHookState", "LayerStats", "compression_hook", "register_compression_hook"]


@dataclass
class LayerStats:
    """What one parameter cost on the wire (one worker)."""

    numel: int
    #: Whether the compressor handled it (the last step's answer; LGC's warm-up sends everything dense).
    compressed: bool
    #: Steps it was sent in.
    steps: int = 0
    #: Bytes of it this worker sent (a share of a joint code is booked pro rata, see LGC).
    bytes_sent: int = 0


def bucket_maxima(buffer: Tensor, segments: tuple[Segment, ...]) -> Tensor:
    """Every segment's largest magnitude (NaN or inf where it holds one): the step guard's look at a gradient.

    On a GPU one multi-tensor infinity norm (``torch._foreach_norm``: one kernel for many tensors)
    instead of a reduction per parameter; on the CPU ``aminmax`` per parameter, which vectorizes
    there where the norm does not (ResNet-50's gradient on one thread: 15 ms against 84 ms). Both
    propagate NaN, as torch's max reductions do (tested on every device). A segment is used where
    its maximum is nonzero (NaN counts as nonzero; its step is skipped anyway).
    """
    views = [buffer[s.offset : s.offset + s.numel] for s in segments if s.numel]
    if not views:
        return buffer.new_zeros(len(segments))
    if buffer.device.type == "cpu":
        extremes = torch.stack([torch.stack(torch.aminmax(view)) for view in views])
        norms = torch.maximum(extremes[:, 1], extremes[:, 0].neg())
    else:
        norms = torch.stack(torch._foreach_norm(views, float("inf")))
    if len(views) == len(segments):
        return norms
    maxima = buffer.new_zeros(len(segments))
    maxima[[i for i, s in enumerate(segments) if s.numel]] = norms
    return maxima


class _BucketLayout(NamedTuple):
    #: Identifies the bucket's content, so a layout is rebuilt when DDP rebuilds its buckets.
    signature: tuple[int, ...]
    segments: tuple[Segment, ...]


class CompressionHookState(HookState):
    """State of :func:`compression_hook` for one worker.

    Args:
        compressor: what to apply to every parameter with at least ``min_numel`` elements,
            e.g. ``ErrorFeedback(TopKCompressor(density=0.01))``.
        min_numel: parameters smaller than this are allreduced dense. ``None`` (default): the
            method's own (:func:`~lgc.compressors.base.method_min_numel`): every parameter for
            DeMo and SparseLoCo's chunked top-k, as their references send; 1,024 otherwise, since
            biases and norm layers are a negligible share of the bytes but sensitive to compression.
        start_iter: iterations of plain allreduce before compressing. ``None`` (default): the
            method's own (:func:`~lgc.compressors.base.method_start_iter`): 0 for DeMo, whose
            reference compresses from the first step; 1 otherwise, which lets DDP rebuild its
            buckets first, as PyTorch's PowerSGD hook does.
        process_group: the group to communicate in (default: the world).
        overlap: encode every bucket as it arrives and start its collectives at once, so they
            overlap the rest of the backward pass, instead of holding every bucket until the step's
            last one (:meth:`encode_ahead`). Results, state and the step guard's policy are bitwise
            the same; what it costs is memory, a second fp32 residual per compressed parameter (DGC:
            a second momentum and accumulator), and, for a parameter unused on every rank, its
            payload sent for nothing. Needs a compressor that can hold a step back (``speculates``)
            and whose payloads are gathered: error feedback over a compressor that keeps no state of
            its own (top-k, SBC, EF-signSGD, chunked top-k, DeMo, their quantized values, ...),
            DGC, QSGD and TernGrad (with or without error feedback: they hold back their counts of
            draws), or error feedback over RedSync (its thresholds held back) or over random-block
            with unshared offsets (its step held back). Stateless compressors (``none``, ``fp16``)
            overlap anyway; the option changes nothing for them.

    With AMP's loss scaling, set ``state.loss_scale = scaler.get_scale`` (``lgc.lit``'s callback
    does): compressors then see unscaled gradients (see :meth:`unscale`).
    """

    unscales_gradients = True
    #: Whether its state is keyed by whole parameters (LGC's leader positions and residuals), so that
    #: communication delay may not cut parameters into fragments for it.
    codes_whole_parameters: ClassVar[bool] = False

    __slots__ = (
        # hyperparameters
        "compressor",
        "min_numel",
        "start_iter",
        "process_group",
        # internal state
        "iteration",  # steps completed (counted at the last bucket); saved, so resume is exact
        "begun_step",  # the step compressor.begin_step() was last called for
        "seed_shared",  # whether rank 0's shared seed has been broadcast (compressors that need one)
        "param_names",  # data_ptr -> parameter name, filled by attach(); per process, not saved
        "bucket_layouts",  # bucket index -> which parts of the flat buffer are compressed
        "loss_scale",  # returns the loss scale of this step (a GradScaler's get_scale), or None; per process
        "step_scale",  # the loss scale the current step's buckets were divided by
        "pending",  # buckets of the current step, run together at its last bucket (the step guard)
        "overlap",  # encode each bucket as it arrives (encode_ahead) instead of at the step's last bucket
        "ahead",  # overlap: the current step's exchanges, started as their buckets arrived
        "ahead_maxima",  # overlap: their buckets' maxima per parameter (the step guard's look), kept for agree
        "nonfinite_lock",  # stateless compressors: guards the skipped-step count set from callbacks
        "nonfinite_step",  # stateless compressors: the last step counted as non-finite
        # stats
        "stats",
        "layer_stats",  # parameter name -> LayerStats (bytes per parameter, for the per-layer table)
        "codec_seconds",  # "encode" / "decode" -> wall seconds spent compressing / decoding; per process
        "buffer_sync",  # the module buffers kept in step (lgc.ddp.buffers.BufferSync), set by register(); per process
        "buffers",  # how: lgc.ddp.buffers.BUFFER_MODES
    )

    def __init__(
        self,
        compressor: Compressor,
        *,
        min_numel: int | None = None,
        start_iter: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        overlap: bool = False,
        buffers: str = module_buffers.BROADCAST,
    ) -> None:
        module_buffers.check_buffer_mode(buffers)
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be an lgc Compressor, got {compressor!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        speculates = holds_steps(compressor) and compressor.combine is CombineMode.GATHER
        if overlap and not compressor.stateless and not speculates:
            raise ValueError(
                f"overlap=True needs a step that can be encoded before the ranks agree on it, with payloads that "
                f"are gathered: error feedback over a compressor that keeps no state of its own (e.g. topk, sbc, "
                f"signsgd, chunked_topk, demo), dgc, qsgd, terngrad, redsync or random_block with shared=false; "
                f"{compressor!r} is not"
            )
        if compressor.combine is CombineMode.SERVER:
            raise NotImplementedError(f"{compressor!r} combines via a server, which compression_hook does not run")
        if min_numel is None:
            min_numel = method_min_numel(compressor)
        if int(min_numel) < 0:
            raise ValueError(f"min_numel must be >= 0, got {min_numel!r}")
        if start_iter is None:
            start_iter = method_start_iter(compressor)
        if int(start_iter) < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter!r}")
        self.compressor = compressor
        self.min_numel = int(min_numel)
        self.start_iter = int(start_iter)
        self.process_group = process_group
        self.iteration = 0
        self.begun_step = -1
        self.seed_shared = False
        self.param_names: dict[int, str] = {}
        self.bucket_layouts: dict[int, _BucketLayout] = {}
        self.loss_scale: Callable[[], float] | None = None
        self.step_scale = 1.0
        self.pending: list[PendingBucket] = []
        self.overlap = overlap
        self.ahead: list[PayloadExchange] = []
        self.ahead_maxima: list[Tensor] = []
        self.nonfinite_lock = threading.Lock()
        self.nonfinite_step = -1
        self.stats = CommStats()
        self.layer_stats: dict[str, LayerStats] = {}
        #: Wall seconds this process spent compressing (``encode``) and decoding (``decode``)
        #: payloads, for benchmarks (``lgc-bench network``); not saved in checkpoints.
        self.codec_seconds = {"encode": 0.0, "decode": 0.0}
        self.buffer_sync: module_buffers.BufferSync | None = None
        self.buffers = buffers

    def book_layer(self, name: str, numel: int, compressed: bool, nbytes: int) -> None:
        """Count ``nbytes`` of payload (logical bytes) for one parameter in one step."""
        layer = self.layer_stats.get(name)
        if layer is None:
            layer = self.layer_stats[name] = LayerStats(numel, compressed)
        layer.steps += 1
        layer.compressed = compressed
        layer.bytes_sent += nbytes

    def layer_table(self) -> list[dict[str, Any]]:
        """One row per parameter: size, steps, bytes sent, compression ratio and residual norm."""
        residuals = self.compressor.residual_store()
        rows = []
        for name, layer in self.layer_stats.items():
            dense = 4 * layer.numel * layer.steps
            residual = residuals.get(name)
            rows.append(
                {
                    "layer": name,
                    "numel": layer.numel,
                    "compressed": layer.compressed,
                    "steps": layer.steps,
                    "bytes_sent": layer.bytes_sent,
                    "compression_ratio": dense / layer.bytes_sent if layer.bytes_sent else None,
                    "residual_norm": None if residual is None else float(torch.linalg.vector_norm(residual)),
                }
            )
        return rows

    def attach(self, model: DistributedDataParallel) -> None:
        """Learn the parameter names of ``model`` (compressor state is keyed by them)."""
        self.param_names = {p.data_ptr(): name for name, p in model.module.named_parameters()}
        self.compressor.attach_parameters(dict(model.module.named_parameters()))

    # The HookState interface (lgc.ddp.protocol).
    def describe(self) -> str:
        """What this hook does, for summaries and logs."""
        return repr(self.compressor)

    def set_epoch(self, epoch: int) -> None:
        self.compressor.set_epoch(epoch)

    def dense_below(self) -> int | None:
        return self.min_numel

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        """After the plain-allreduce iterations and the compressor's own warm-up (DGC's densities)."""
        return max(self.start_iter, self.compressor.steady_from(steps_per_epoch))

    @property
    def overlaps_backward(self) -> bool:
        """A compressor without state runs bucket by bucket; one with state only with ``overlap``."""
        return not self.guards_steps or self.overlap

    def gathers_payloads(self) -> bool:
        return self.compressor.combine is CombineMode.GATHER

    def residual_norm(self) -> float | None:
        """Norm of the error-feedback residuals, or None for compressors without residuals."""
        return self.compressor.residual_norm()

    def metrics(self) -> dict[str, float]:
        """Method-specific metrics to log every step besides ``comm/*`` (LGC: ``lgc/stage``, ...)."""
        return {}

    def summary_extras(self) -> dict[str, Any]:
        """Method-specific fields for this worker's entry in ``summary.json`` (and its per-layer table)."""
        return {"layers": self.layer_table()}

    def codec_times(self) -> dict[str, float] | None:
        return self.codec_seconds

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Attach to ``model`` and register :func:`compression_hook` with this state (``optimizer`` is not needed).

        Module buffers (BatchNorm statistics) go from rank 0 to every rank once per step, counted,
        instead of DDP's broadcast before forward passes, or are averaged over the workers with
        ``buffers="average"`` (:func:`lgc.ddp.buffers.register_comm_hook`).
        """
        self.attach(model)
        self.buffer_sync = module_buffers.register_comm_hook(model, self, compression_hook, self.buffers)

    def segments(self, names_and_numels: list[tuple[str, int]]) -> tuple[Segment, ...]:
        """Consecutive segments of a flat buffer; those with at least ``min_numel`` elements are compressed."""
        segments, offset = [], 0
        for name, numel in names_and_numels:
            segments.append(Segment(name, offset, numel, numel >= self.min_numel))
            offset += numel
        return tuple(segments)

    def layout(self, bucket: dist.GradBucket) -> _BucketLayout:
        """The bucket's segments, cached per bucket index and rebuilt when the bucket changes."""
        params = bucket.parameters()
        signature = (bucket.buffer().numel(), *(p.data_ptr() for p in params))
        cached = self.bucket_layouts.get(bucket.index())
        if cached is not None and cached.signature == signature:
            return cached
        names = [self.param_names.get(param.data_ptr()) for param in params]
        if None in names:
            raise RuntimeError("a bucket holds a parameter the hook state does not know; call attach(model)")
        segments = self.segments([(name, param.numel()) for name, param in zip(names, params, strict=True)])
        total = sum(s.numel for s in segments)
        if total != bucket.buffer().numel():
            raise RuntimeError(f"bucket {bucket.index()} has {bucket.buffer().numel()} elements, parameters {total}")
        layout = _BucketLayout(signature, segments)
        self.bucket_layouts[bucket.index()] = layout
        return layout

    # The state travels to spawned workers and into checkpoints without its process group.
    def __getstate__(self) -> dict[str, Any]:
        slots = [slot for cls in type(self).__mro__ for slot in getattr(cls, "__slots__", ())]
        state = {slot: getattr(self, slot) for slot in slots}
        state.update(process_group=None, param_names={}, bucket_layouts={}, begun_step=-1, seed_shared=False)
        state.update(
            pending=[],
            ahead=[],
            ahead_maxima=[],
            nonfinite_lock=None,
            nonfinite_step=-1,
            loss_scale=None,
            step_scale=1.0,
        )
        state.update(codec_seconds={"encode": 0.0, "decode": 0.0}, buffer_sync=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self.nonfinite_lock = threading.Lock()

    # -- the step guard ---------------------------------------------------------------------------
    @property
    def guards_steps(self) -> bool:
        """Whether compressed steps run behind the step guard (every compressor with state)."""
        return not self.compressor.stateless

    def defer(self, buffer: Tensor, segments: tuple[Segment, ...], is_last: bool) -> torch.futures.Future[Tensor]:
        """Hold a bucket until the step's last bucket, then run the whole step (:meth:`run_step`)."""
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        self.pending.append(PendingBucket(buffer, segments, future))
        if is_last:
            pending, self.pending = self.pending, []
            run_holding([bucket.future for bucket in pending], lambda: self.run_step(pending))
        return future

    def encode_ahead(
        self, buffer: Tensor, segments: tuple[Segment, ...], is_last: bool
    ) -> torch.futures.Future[Tensor]:
        """Encode a bucket as it arrives and start its collectives; settle the step at its last bucket.

        The compressor encodes every compressed parameter of the bucket into held state
        (``compress_pending``: :meth:`~lgc.compressors.ErrorFeedback.compress_pending`,
        :meth:`~lgc.compressors.DGCCompressor.compress_pending`) and the allgather of the payloads
        starts at once, in bucket order on every rank, while the backward pass goes on. ``buffer``
        is left as it is. At the step's last bucket the ranks agree (:meth:`agree`, the same
        reduction as without overlap), then (:meth:`settle`):

        * a skipped step (inf/NaN on some rank): the held state is dropped and every bucket is
          allreduced dense and unchanged (:meth:`pass_through`), as without overlap; the payloads
          already sent are counted, and not decoded;
        * otherwise the held state of the used parameters is committed, the others' dropped; the
          parameters sent dense are allreduced then, the used ones bucket by bucket (the held
          path's allreduces exactly, so a ring sums them in the same order), and every bucket is
          decoded, a parameter unused on every rank left at its zero. A payload sent for a
          parameter unused on every rank, or in a skipped step, is counted in the statistics.
        """
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        self.pending.append(PendingBucket(buffer, segments, future))
        maxima = bucket_maxima(buffer, segments)
        self.ahead_maxima.append(maxima)
        # A rank that sees an inf or NaN knows the step will be skipped: it encodes zeros instead
        # (its payloads are never decoded), so every compressor gets finite input and every rank
        # issues the same collectives.
        finite = bool(torch.isfinite(maxima).all())
        source = buffer if finite else torch.zeros_like(buffer)
        compressed = tuple(s for s in segments if s.compressed)
        try:
            self.ahead.append(PayloadExchange(self, source, compressed, self.iteration, pending=True))
        except BaseException:
            self.pending, self.ahead, self.ahead_maxima = [], [], []
            self.drop_held()
            raise
        if is_last:
            pending, self.pending = self.pending, []
            exchanges, self.ahead = self.ahead, []
            tables, self.ahead_maxima = self.ahead_maxima, []
            run_holding([bucket.future for bucket in pending], lambda: self.settle(pending, exchanges, tables))
        return future

    def settle(self, pending: list[PendingBucket], exchanges: list[PayloadExchange], maxima: list[Tensor]) -> None:
        """The end of a step encoded ahead (:meth:`encode_ahead`): agree, then commit and decode, or pass it through."""
        # Whatever raises before the commit drops the held step (decoding reads no held state, so
        # the commit comes last).
        try:
            verdict = self.agree(pending, maxima)
            torch.futures.wait_all([future for exchange in exchanges for future in exchange.futures])
            if verdict.skip:
                self.drop_held()
                self.pass_through(pending)
            else:
                step = self.iteration
                dense = [
                    PayloadExchange(
                        self, b.buffer, tuple(s for s in b.segments if not s.compressed), step, used=verdict.used
                    )
                    for b in pending
                ]
                for sent_dense, exchange, bucket in zip(dense, exchanges, pending, strict=True):
                    torch.futures.wait_all(sent_dense.futures)
                    sent_dense.finish()
                    bucket.future.set_result(exchange.finish(verdict.used))
                self.holder.commit(verdict.used)
                self.iteration = step + 1
        except BaseException:
            self.drop_held()
            raise
        self.step_done(skipped=verdict.skip)
        self.scale_back(pending)

    def drop_held(self) -> None:
        """Drop a step encoded ahead (skipped, or failed): the compressor's held state and its schedule.

        ``begin_step`` ran at the step's first bucket, before the agreement; the compressor undoes
        what it moved (DGC's warm-up epoch) and the step that retries this one begins it again, so
        a skipped step leaves the state as the held path, which never began it, does.
        """
        self.holder.drop()
        self.begun_step = -1

    @property
    def holder(self) -> HoldsSteps:
        """The compressor, which holds steps back (``overlap`` is refused at construction otherwise)."""
        assert isinstance(self.compressor, HoldsSteps), self.compressor
        return self.compressor

    def agree(self, pending: list[PendingBucket], maxima: list[Tensor] | None = None) -> StepVerdict:
        """One small allreduce (MAX of a byte per parameter, plus one) that every rank decides the step by.

        Each rank looks at its own gradients once (every parameter's largest magnitude, per bucket:
        finite? nonzero?; ``maxima``: those already taken, one per bucket, see
        :func:`bucket_maxima`); the reduction tells every rank whether some rank saw an inf or
        NaN, and which parameters have a nonzero gradient on some rank. Its bytes are counted like
        any other collective's.
        """
        names = [s.name for bucket in pending for s in bucket.segments]
        if maxima is None:
            maxima = [bucket_maxima(bucket.buffer, bucket.segments) for bucket in pending]
        table = torch.cat(maxima).float()
        finite = torch.isfinite(table).all()
        # NaN != 0 is True, so a NaN parameter also counts as used (it is skipped anyway).
        flags = torch.cat([(~finite).reshape(1), table != 0]).to(torch.uint8)
        flags = agree_flags(self.stats, flags, self.process_group)
        used = frozenset(name for name, flag in zip(names, flags[1:].tolist(), strict=True) if flag)
        return StepVerdict(skip=bool(flags[0]), used=used)

    def allreduce_dense(self, pending: list[PendingBucket]) -> None:
        """Every bucket allreduced dense and unchanged (what plain DDP does); their futures completed."""
        allreduce_as_they_are(self.stats, [bucket.buffer for bucket in pending], self.process_group)
        for bucket in pending:
            bucket.future.set_result(bucket.buffer)

    def pass_through(self, pending: list[PendingBucket]) -> None:
        """A skipped step: :meth:`allreduce_dense`, counted in ``skipped_steps``; no state touched."""
        self.allreduce_dense(pending)
        self.stats.skipped_steps += 1

    def run_step(self, pending: list[PendingBucket]) -> None:
        """Run one guarded step over all its buckets and complete their futures.

        Subclasses (LGC) override :meth:`compress_step`; the guard itself is shared.
        """
        verdict = self.agree(pending)
        if verdict.skip:
            self.pass_through(pending)
        else:
            step = self.iteration
            self.compress_step(pending, verdict.used, step)
            self.iteration = step + 1
        self.step_done(skipped=verdict.skip)
        self.scale_back(pending)

    def step_done(self, skipped: bool) -> None:
        """Called after every guarded step, here and at communication delay's exchanges (LGC books its bytes)."""

    def set_world_size(self, world_size: int) -> None:
        """Learn the number of workers before the first step (LGC checks its leader); nothing to learn here."""

    def scale_back(self, pending: list[PendingBucket]) -> None:
        """Back to the loss-scaled units the optimizer's GradScaler expects (a no-op without a loss scale).

        DDP reads the buffers only after the backward pass, so the futures may already hold them.
        """
        if self.step_scale != 1.0:
            for bucket in pending:
                bucket.buffer.mul_(self.step_scale)

    def unscale(self, buffer: Tensor, world_size: int) -> None:
        """Divide a bucket by the world size and, with a loss scale attached, by the loss scale.

        With AMP's GradScaler the gradients arrive multiplied by a scale that changes during
        training (halved at every overflow, doubled every ``growth_interval`` steps). Compressor
        state accumulated at one scale and added to gradients at another (residuals, DGC's momentum
        and its weight decay) would be weighed wrongly, so compressors see unscaled gradients and
        the result is scaled back (:meth:`run_step`). Powers of two, as GradScaler's scales are,
        divide and multiply exactly.
        """
        self.step_scale = float(self.loss_scale()) if self.loss_scale is not None else 1.0
        buffer.div_(world_size * self.step_scale if self.step_scale != 1.0 else world_size)

    def compress_step(self, pending: list[PendingBucket], used: frozenset[str], step: int) -> None:
        """Average every bucket of a finite step through the compressor (collectives in bucket order).

        A compressor that encodes many tensors in a fixed number of passes (``batches_on`` the
        device: error feedback over top-k on a GPU) encodes the step's compressed parameters
        together first (:func:`encode_buffers`, one ``compress_many`` over every bucket); the others
        bucket by bucket, each bucket's collectives starting while the next one is encoded.
        """
        encoded = None
        if pending and self.compressor.batches_on(pending[0].buffer.device):
            encoded = encode_buffers(self, [(b.buffer, b.segments) for b in pending], step, used)
        exchanges = [PayloadExchange(self, b.buffer, b.segments, step, used=used, encoded=encoded) for b in pending]
        for exchange, bucket in zip(exchanges, pending, strict=True):
            torch.futures.wait_all(exchange.futures)
            bucket.future.set_result(exchange.finish())

    def note_result(self, step: int, result: Tensor) -> Tensor:
        """Stateless compressors: count a step whose averaged gradient is non-finite as skipped."""
        if not all_finite(result):
            with self.nonfinite_lock:
                if self.nonfinite_step != step:
                    self.nonfinite_step = step
                    self.stats.skipped_steps += 1
        return result

    def state_dict(self) -> dict[str, Any]:
        """This worker's state: compressor state (residuals), iteration counter and statistics."""
        return {
            "compressor": self.compressor.state_dict(),
            "iteration": self.iteration,
            "stats": asdict(self.stats),
            "layers": {name: asdict(layer) for name, layer in self.layer_stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.iteration = int(state["iteration"])
        self.stats = CommStats(**state["stats"])
        self.layer_stats = {name: LayerStats(**layer) for name, layer in state["layers"].items()}


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average one bucket of gradients across workers with ``state.compressor``.

    Register it with :func:`register_compression_hook` rather than directly, so parameter names
    are known.
    """
    world_size = dist.get_world_size(state.process_group)
    buffer = bucket.buffer()
    state.stats.hook_calls += 1
    counted.book_dense_equivalent(state.stats, buffer, state.process_group)
    segments = state.layout(bucket).segments
    iteration = state.iteration

    if iteration < state.start_iter:
        buffer.div_(world_size)
        if bucket.is_last():
            state.iteration += 1
        for segment in segments:
            state.book_layer(segment.name, segment.numel, False, segment.numel * buffer.element_size())
        return counted.all_reduce(state.stats, buffer, state.process_group).then(lambda fut: fut.value()[0])

    state.unscale(buffer, world_size)
    if state.guards_steps:
        if state.overlap:
            return state.encode_ahead(buffer, segments, bucket.is_last())
        return state.defer(buffer, segments, bucket.is_last())
    if bucket.is_last():
        state.iteration += 1
    scale = state.step_scale
    return average_compressed(state, buffer, segments, iteration).then(
        lambda fut: state.note_result(iteration, fut.value() if scale == 1.0 else fut.value().mul_(scale))
    )


def register_compression_hook(
    model: DistributedDataParallel,
    compressor: Compressor,
    *,
    min_numel: int | None = None,
    start_iter: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    overlap: bool = False,
) -> CompressionHookState:
    """Make ``model`` average its gradients through ``compressor``; works on gloo and NCCL.

    Args:
        model: a :class:`~torch.nn.parallel.DistributedDataParallel` model (any DDP program).
        compressor: e.g. ``ErrorFeedback(TopKCompressor(density=0.01))``.
        min_numel: parameters with fewer elements go dense (``None``: the method's own, see
            :class:`CompressionHookState`).
        start_iter: plain-allreduce iterations before compression starts (``None``: the method's
            own, see :class:`CompressionHookState`).
        process_group: group to communicate in (default: the world).
        overlap: encode and send every bucket as it arrives (see :class:`CompressionHookState`).

    Returns:
        The hook state: its ``stats`` count bytes; save ``state_dict()`` with every rank's
        checkpoint, because residuals differ between ranks.

    Example::

        >>> model = DistributedDataParallel(net)
        >>> state = register_compression_hook(model, ErrorFeedback(TopKCompressor(density=0.01)))
        >>> ...  # train as usual
        >>> state.stats.compression_ratio
    """
    state = CompressionHookState(
        compressor, min_numel=min_numel, start_iter=start_iter, process_group=process_group, overlap=overlap
    )
    state.register(model)
    return state
