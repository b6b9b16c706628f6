"""A DDP communication hook that runs any :class:`~lgc.compressors.Compressor`: the state and the hook.

This module (with the other modules of :mod:`lgc.ddp`) is the only place that calls
:mod:`torch.distributed`. It follows PyTorch's own hooks (``ddp_comm_hooks/powerSGD_hook.py``):

1. DDP hands the hook one flat bucket of gradients; the hook divides it by the world size.
2. The first ``start_iter`` iterations use a plain allreduce, as PyTorch's PowerSGD hook does
   while DDP rebuilds its buckets after the first iteration; the iteration counter is saved, so a
   resumed run does not repeat them.
3. A stateful compressor (residuals, momenta, random generators) runs once per *step*, at the
   step's last bucket, behind the step guard (:mod:`lgc.ddp.step_guard`): a step in which some
   rank has an inf or NaN passes through dense and unchanged (counted in ``stats.skipped_steps``),
   parameters unused on every rank are left alone. The whole step goes out in two collectives
   (:mod:`lgc.ddp.packed`; ``pack=False``: the guard's allreduce, then each bucket's collectives).
   With ``overlap`` it encodes each bucket as it arrives instead (:mod:`lgc.ddp.overlap`). Stateless
   compressors (``none``, ``fp16``) run bucket by bucket as the buckets become ready, overlapping
   the backward pass; an inf or NaN passes through their sum (the step is counted as skipped all
   the same).
4. Parameters with fewer than ``min_numel`` elements (biases, norm layers) are allreduced dense,
   in the gradient's dtype (in one step's header, in fp32: :mod:`lgc.ddp.packed`; by default the
   method's own threshold: none for DeMo and SparseLoCo, whose references compress every tensor).
5. Every other parameter's gradient is compressed on its own, keyed by the parameter's name, so
   compressor state (residuals, momenta) is independent of DDP's bucketing and survives restarts.
6. Payloads are combined as the compressor declares and decoded (:mod:`lgc.ddp.exchange`), with
   every collective issued in the hook, in the same order on every rank. Behind the step guard a
   skipped step or an unused parameter does not reach the compressor's ``finish_aggregate``;
   without it (stateless compressors) it is called for every parameter of every step, so a
   stateless compressor's ``finish_aggregate`` must keep no state.

Bytes are counted against what plain DDP would send: the bucket's own dtype (4 bytes per element
for an fp32 model, 2 for fp16 or bf16). The state composes its parts, each a module of :mod:`lgc.ddp`:
the step guard (``step_guard``), the one-message step (``packed``), the overlap path (``overlap``),
the bucket layouts (``layout``), the exchange (``exchange``) and the byte table (``layer_stats``).

Why one module: the state's knobs, its slots and the hook function DDP calls with it are one unit
(every path of a step starts here and returns here); what a step does lives in the parts above.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.base import CombineMode, Compressor, holds_steps, method_min_numel, method_start_iter
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.exchange import PayloadExchange, Segment, average_compressed, encode_buffers
from lgc.ddp.layer_stats import LayerLedger
from lgc.ddp.layout import BucketLayouts, split_segments
from lgc.ddp.overlap import EncodeAhead
from lgc.ddp.packed import StepBuffers, packing, run_packed_step
from lgc.ddp.protocol import OPTIMIZER_SOURCES, HookState
from lgc.ddp.step_guard import PendingBucket, SkipCounter, StepVerdict, agree_on_step, complete_dense, run_holding
from lgc.validation import NonNegativeInt, check

__all__ = ["CompressionHookState", "compression_hook", "register_compression_hook"]


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
        overlap: encode every bucket as it arrives and start its collectives at once, overlapping
            the rest of the backward pass (:mod:`lgc.ddp.overlap`, which says what it costs):
            bitwise the same results. Needs a compressor that can hold a step back
            (:class:`~lgc.compressors.base.HoldsSteps`) and whose payloads are gathered; stateless
            compressors (``none``, ``fp16``) overlap anyway.
        pack: put each compressed step on the wire in two collectives (:mod:`lgc.ddp.packed`).
            ``None`` (default): wherever the compressor allows it (every lgc compressor with state;
            not with ``overlap``); ``True``: required; ``False``: bucket by bucket.

    With AMP's loss scaling, set ``state.loss_scale = scaler.get_scale`` (``lgc.lit``'s callback
    does): compressors with state then see unscaled gradients (see :meth:`unscale`).
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
        "layouts",  # which parts of each bucket's flat buffer are which parameter (lgc.ddp.layout); per process
        "loss_scale",  # returns the loss scale of this step (a GradScaler's get_scale), or None; per process
        "step_scale",  # the loss scale the current step's buckets were divided by
        "pending",  # buckets of the current step, run together at its last bucket (the step guard)
        "overlap",  # encode each bucket as it arrives (lgc.ddp.overlap) instead of at the step's last bucket
        "ahead",  # overlap: the step's exchanges started as their buckets arrived (EncodeAhead), else None
        "skips",  # stateless compressors: counts a non-finite step once, from DDP's callbacks (SkipCounter)
        # stats
        "stats",
        "layer_stats",  # parameter name -> LayerStats (bytes per parameter, the per-layer table)
        "codec_seconds",  # "encode" / "decode" -> wall seconds spent compressing / decoding; per process
        "buffer_sync",  # the module buffers kept in step (lgc.ddp.buffers.BufferSync), set by register(); per process
        "buffers",  # how: lgc.ddp.buffers.BUFFER_MODES
        "packs",  # whether compressed steps go out as one message (lgc.ddp.packed)
        "step_buffers",  # the module buffers handed over for the current step's header (packs), else None
    )
    #: Whether this class's steps may go out as one message (:mod:`lgc.ddp.packed`); LGC's stages
    #: run collectives of their own.
    packs_steps: ClassVar[bool] = True

    def __init__(
        self,
        compressor: Compressor,
        *,
        min_numel: int | None = None,
        start_iter: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        overlap: bool = False,
        buffers: str = module_buffers.BROADCAST,
        pack: bool | None = None,
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
        check("min_numel", min_numel, NonNegativeInt)
        if start_iter is None:
            start_iter = method_start_iter(compressor)
        check("start_iter", start_iter, NonNegativeInt)
        self.compressor = compressor
        self.min_numel = int(min_numel)
        self.start_iter = int(start_iter)
        self.process_group = process_group
        self.iteration = 0
        self.begun_step = -1
        self.seed_shared = False
        self.layouts = BucketLayouts()
        self.loss_scale: Callable[[], float] | None = None
        self.step_scale = 1.0
        self.pending: list[PendingBucket] = []
        self.overlap = overlap
        self.ahead = EncodeAhead(self) if overlap else None
        self.skips = SkipCounter()
        self.stats = CommStats()
        self.layer_stats = LayerLedger()
        #: Wall seconds this process spent compressing (``encode``) and decoding (``decode``)
        #: payloads, for benchmarks (``lgc-bench network``); not saved in checkpoints.
        self.codec_seconds = {"encode": 0.0, "decode": 0.0}
        self.buffer_sync: module_buffers.BufferSync | None = None
        self.buffers = buffers
        self.packs = packing(type(self), compressor, overlap=overlap, pack=pack)
        self.step_buffers: StepBuffers | None = None

    def attach(self, model: DistributedDataParallel) -> None:
        """Learn the parameter names of ``model`` (compressor state is keyed by them)."""
        self.layouts.attach(model.module)
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

    def optimizer_settings_needed(self) -> tuple[str, ...]:
        return self.compressor.optimizer_settings_needed()

    def check_optimizer(
        self, momentum: float, weight_decay: float | None, *, sources: tuple[str, str] = OPTIMIZER_SOURCES
    ) -> None:
        self.compressor.check_optimizer(momentum, weight_decay, sources=sources)

    def residual_norm(self) -> float | None:
        """Norm of the error-feedback residuals, or None for compressors without residuals."""
        return self.compressor.residual_norm()

    def summary_extras(self) -> dict[str, Any]:
        """Method-specific fields for this worker's entry in ``summary.json`` (and its per-layer table)."""
        return {"layers": self.layer_stats.table(self.compressor.residual_store())}

    def codec_times(self) -> dict[str, float] | None:
        return self.codec_seconds

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Attach to ``model`` and register :func:`compression_hook` with this state (``optimizer`` is not needed).

        Module buffers (BatchNorm statistics) go from rank 0 to every rank once per step, counted,
        instead of DDP's broadcast before forward passes, or are averaged over the workers with
        ``buffers="average"`` (:func:`lgc.ddp.buffers.register_comm_hook`).
        """
        self.attach(model)
        # What the compressor learns of the world is checked now, not at its first compressed step (DGC's
        # world_size, given, must be the group's).
        self.compressor.set_world_size(dist.get_world_size(self.process_group))
        self.buffer_sync = module_buffers.register_comm_hook(model, self, compression_hook, self.buffers)

    def segments(self, names_and_numels: list[tuple[str, int]]) -> tuple[Segment, ...]:
        """Consecutive segments of a flat buffer; those with at least ``min_numel`` elements are compressed."""
        return split_segments(names_and_numels, self.min_numel)

    # The state travels to spawned workers and into checkpoints without its process group.
    def __getstate__(self) -> dict[str, Any]:
        slots = [slot for cls in type(self).__mro__ for slot in getattr(cls, "__slots__", ())]
        state = {slot: getattr(self, slot) for slot in slots}
        state.update(process_group=None, layouts=BucketLayouts(), begun_step=-1, seed_shared=False, pending=[])
        state.update(ahead=None, loss_scale=None, step_scale=1.0, codec_seconds={"encode": 0.0, "decode": 0.0})
        state.update(buffer_sync=None, step_buffers=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self.ahead = EncodeAhead(self) if self.overlap else None

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

    def run_step(self, pending: list[PendingBucket], verdict: StepVerdict | None = None) -> None:
        """Run one guarded step over all its buckets and complete their futures.

        Subclasses (LGC) override :meth:`compress_step`; the guard itself is shared. ``verdict``:
        the step guard's, decided by the caller over a group of its own (hybrid sharding's LGC
        decides over the world, so that every shard position skips the same steps); ``None``: the
        guard runs here over :attr:`process_group`.
        """
        if self.packs:
            assert verdict is None, "a packed step decides its guard in its own header"
            buffers, self.step_buffers = self.step_buffers, None
            skipped = run_packed_step(self, pending, buffers)
        else:
            if verdict is None:
                verdict = agree_on_step(self.stats, self.process_group, pending)
            skipped = verdict.skip
            if skipped:
                complete_dense(self.stats, self.process_group, pending, skipped=True)
            else:
                self.compress_step(pending, verdict.used, self.iteration)
        if not skipped:
            self.iteration += 1
        self.step_done(skipped=skipped)
        self.scale_back(pending)

    def take_buffers(self, buffers: list[Tensor], mode: str) -> bool:
        """Carry the module buffers in this step's header (:mod:`lgc.ddp.packed`); False: synced apart."""
        if not self.packs or self.iteration < self.start_iter:
            return False
        self.step_buffers = StepBuffers(buffers, mode)
        return True

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
        and its weight decay) would be weighed wrongly, so compressors with state see unscaled
        gradients and the result is scaled back (:meth:`run_step`). Powers of two, as GradScaler's
        scales are, divide and multiply exactly. A stateless compressor (fp16, the unbiased
        quantizers) codes the loss-scaled gradient, as PyTorch's hooks do: the scale is what keeps
        small gradients within half precision's range, and nothing of one step carries to the next.
        """
        scaled = self.loss_scale is not None and self.guards_steps
        self.step_scale = float(self.loss_scale()) if scaled else 1.0
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

    def state_dict(self) -> dict[str, Any]:
        """This worker's state: compressor state (residuals), iteration counter and statistics."""
        return {
            "compressor": self.compressor.state_dict(),
            "iteration": self.iteration,
            "stats": asdict(self.stats),
            "layers": self.layer_stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.iteration = int(state["iteration"])
        self.stats = CommStats(**state["stats"])
        self.layer_stats.load_state_dict(state["layers"])


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average one bucket of gradients across workers with ``state.compressor``.

    Register it with :func:`register_compression_hook`, not directly: it needs the parameter names.
    """
    world_size = dist.get_world_size(state.process_group)
    buffer = bucket.buffer()
    state.stats.hook_calls += 1
    counted.book_dense_equivalent(state.stats, buffer, state.process_group)
    segments = state.layouts.segments(bucket, state.min_numel)
    iteration = state.iteration

    if iteration < state.start_iter:
        buffer.div_(world_size)
        if bucket.is_last():
            state.iteration += 1
        for segment in segments:
            state.layer_stats.book(segment.name, segment.numel, False, segment.numel * buffer.element_size())
        # A non-finite step counts as skipped here as in a stateless method's steps (GradScaler skips it).
        return counted.all_reduce(state.stats, buffer, state.process_group).then(
            lambda fut: state.skips.note(state.stats, iteration, fut.value()[0])
        )

    state.unscale(buffer, world_size)
    if state.guards_steps:
        if state.ahead is not None:
            return state.ahead.bucket(buffer, segments, bucket.is_last())
        return state.defer(buffer, segments, bucket.is_last())
    if bucket.is_last():
        state.iteration += 1
    scale = state.step_scale
    return average_compressed(state, buffer, segments, iteration).then(
        lambda fut: state.skips.note(state.stats, iteration, fut.value() if scale == 1.0 else fut.value().mul_(scale))
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

    ``model`` is a :class:`~torch.nn.parallel.DistributedDataParallel` model (any DDP program); the
    keywords are :class:`CompressionHookState`'s. Returns the hook state: its ``stats`` count bytes;
    save ``state_dict()`` with every rank's checkpoint, because residuals differ between ranks.

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
