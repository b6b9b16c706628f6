"""Communication delay (SBC): local steps, then an exchange of the compressed weight update.

Sattler et al., "Sparse Binary Compression: Towards Distributed Deep Learning with minimal
Communication" (IJCNN 2019), Sec. III-A: every worker runs ``delay`` local optimizer steps on its
own gradients without communicating, then its weight update goes through the compressor (with
error feedback, SBC's residual ``A += dW; A -= sent``) and all workers apply the mean of the decoded
updates. ``delay = 1`` exchanges the update of every single step, which for plain SGD equals
averaging the gradients. This works with any lgc compressor.

What is compressed is the update's negative, the *pseudo-gradient* ``Delta = W_sync - W_local``,
and all workers set ``W_sync -= mean(decoded Delta)``: DiLoCo's outer gradient, and what the
references of the local-step family compress (tplr-ai/templar's SparseLoCo: ``p.grad = saved - p``
in ``src/tplr/distributed.py``; torchft's DiLoCo). A compressor that treats ``x`` and ``-x`` alike
(top-k, random-block, fp16, fp4, int8, the sign and stochastic quantizers) sends the same entries
either way; one that does not must see the reference's sign: SparseLoCo's 2-bit quantizer has
asymmetric bins (values more than 2.25 standard deviations below the mean get a bin of their own,
those above it do not), and on heavy-tailed updates the other sign moves the weights measurably
(``tests/compressors/test_sparseloco.py``), and a learned codec is trained on what it will code.
SBC's reference compresses ``dW = W_local - W_sync``; SBC keeps the side with the larger mean
magnitude, the same entries for ``Delta`` as for ``dW`` except where the two means tie exactly (lgc
then keeps the positive side of ``Delta``, the negative side of ``dW``).

The state is composed of parts, each a module of its own: the outer step (SBC's average, or
DiLoCo's outer Nesterov SGD: :mod:`lgc.ddp.outer_step`), Streaming DiLoCo's fragments and their
schedule (:mod:`lgc.ddp.fragments`), the module buffers averaged at exchanges
(:class:`lgc.ddp.buffers.ExchangedBuffers`), the global-model view evaluation sees
(:mod:`lgc.ddp.global_view`), the DDP hook that leaves gradients local
(:mod:`lgc.ddp.local_step_hook`), the checkpoint (:mod:`lgc.ddp.delay_checkpoint`) and the thread
Streaming DiLoCo's overlapped exchanges run on (:mod:`lgc.ddp.streaming`). DDP's
broadcast of rank 0's buffers is turned off: each worker's statistics follow its own weights, and
the floating-point buffers are averaged with the exchange of the last fragment, counted. The inner
optimizer and its state stay per worker.

Steps:

1. The DDP hook returns each worker's own gradient untouched (no bytes).
2. After every optimizer step, :meth:`CommunicationDelayState.after_optimizer_step` counts local
   steps; on every ``delay``-th (a fragment's turn) it averages the pseudo-gradients through the
   gradient hook's step guard and exchange (:func:`lgc.ddp.step_guard.agree_on_step` and
   ``compress_step``: the same collectives and byte accounting), applies the outer step and moves
   every worker to the new synchronized weights. With ``overlap_steps`` the exchange starts that
   many steps before the turn and runs beside them; at the turn it is applied, the local weights
   mixed in at ``mixing``.

Non-finite values: a local step whose gradient overflows is the optimizer's (or GradScaler's)
to skip, as without lgc. If a rank's weight update is nevertheless inf/NaN at an exchange, every
rank skips that exchange (counted in ``stats.skipped_steps``), returns to the last synchronized
weights (and, with the last fragment, buffers) and keeps its residuals as they were. Parameters
whose update is zero on every rank are not sent.

Why one module: :class:`CommunicationDelayState` is one object that every part above acts through:
its exchange's start and application share the fragments' synchronized weights, the outer step,
the buffers and the exchange state, and the rest is the interface lgc's strategy, callbacks and
``lgc.compress`` read of every hook state, forwarded to the exchange state.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.base import Compressor
from lgc.ddp import buffers as module_buffers
from lgc.ddp import delay_checkpoint
from lgc.ddp.collectives import CommStats
from lgc.ddp.exchange import Segment
from lgc.ddp.fragments import FRAGMENT_SPLITS, FragmentSchedule, FragmentSlice, read_piece, write_piece
from lgc.ddp.global_view import GlobalModelView
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_step_hook import (
    LocalStepCheck,
    checked_exchange,
    checked_local_step_hook,
    local_step_hook,
    register_communication_delay,
)
from lgc.ddp.outer_step import OUTER_OPTIMIZERS, OuterStep
from lgc.ddp.protocol import OPTIMIZER_SOURCES, HookState, RunTooShort
from lgc.ddp.step_guard import PendingBucket, agree_on_step
from lgc.ddp.streaming import ExchangeRunner, InFlight, finished
from lgc.validation import Fraction, Momentum, PositiveFloat, PositiveInt, check

__all__ = ["OUTER_OPTIMIZERS", "CommunicationDelayState", "local_step_hook", "register_communication_delay"]


class CommunicationDelayState(HookState):
    """Local SGD with compressed weight-update exchanges every ``delay`` steps.

    Args:
        exchange_state: the built hook state whose step guard, compressor and collectives exchange
            each parameter's pseudo-gradient ``W_sync - W_local``: a
            :class:`~lgc.ddp.CompressionHookState` around a compressor (e.g.
            ``ErrorFeedback(SBCCompressor(density=0.01))``; its ``min_numel`` sends the smaller
            parameters, or fragment pieces, dense), or a hook state of the LGC family
            (:class:`~lgc.learned.LGCHookState`: LGC-RAR, LGC-PS, the shared-index codecs), which
            then exchanges the weight updates as it would exchange gradients, its stages counted in
            exchanges, a skipped one included (``stages.warmup_steps=30`` is the first 30 exchanges,
            ``30 * delay`` local steps) and whole parameters only (``fragments=1``).
            :func:`lgc.compress` (``delay=``) and ``lgc-train`` (``comm.delay``) build it;
            :func:`register_communication_delay` builds one around a compressor.
        delay: local steps between exchanges (SBC: 1 to 100s; longer delays save bytes linearly
            but let workers drift apart, which costs accuracy on non-IID data).
        outer: ``"average"`` (SBC: ``W_sync -= mean(Delta)``, i.e. ``+= mean(dW)``) or ``"sgd"`` (DiLoCo:
            an outer SGD step with Nesterov momentum on the pseudo-gradient ``mean(Delta)``;
            :class:`~lgc.ddp.outer_step.OuterStep`).
        outer_lr: the outer learning rate (``outer="sgd"`` only; default 0.7, DiLoCo's).
        outer_momentum: the outer Nesterov momentum in ``[0, 1)`` (``outer="sgd"`` only; default
            0.9, DiLoCo's; 0 is plain SGD).
        fragments: Streaming DiLoCo's fragments, exchanged on staggered steps (1: every parameter at
            once, every ``delay`` steps). At most ``delay`` (each fragment its own step) and at most
            the number of rows of the trainable parameters (checked at :meth:`register`;
            :class:`~lgc.ddp.fragments.FragmentSchedule`).
        fragment_split: how the parameters are cut into fragments of about equal size: ``"strided"``
            (default, the paper's) or ``"contiguous"`` (:mod:`lgc.ddp.fragments`).
        overlap_steps: Streaming DiLoCo's overlap ``tau`` (torchft's ``fragment_sync_delay``): a
            fragment's exchange starts ``tau`` local steps before its turn and runs while they
            compute; at its turn it is applied (:mod:`lgc.ddp.streaming`). 0 (default): the
            exchange blocks at its turn. Below ``delay / fragments`` (one exchange in flight at a time).
        mixing: the weight ``alpha`` of the local weights when a fragment's exchange is applied
            (torchft's ``fragment_update_alpha``): its weights become ``lerp(W_sync, W_local, alpha)``.
            0 (default, torchft's): the synchronized weights, the overlapped steps' progress
            discarded; 1: the local weights kept, only the synchronized copy moved.

    Call :meth:`after_optimizer_step` after every ``optimizer.step()`` (the Lightning callback
    does). Checkpoints must hold every rank's :meth:`state_dict`: between exchanges the workers'
    weights and buffers differ. Evaluate inside :meth:`global_model`.
    """

    takes_local_steps = True

    __slots__ = (
        "schedule",  # the fragments and when each is exchanged (lgc.ddp.fragments.FragmentSchedule)
        "outer_step",  # how an exchange moves the synchronized weights (lgc.ddp.outer_step.OuterStep)
        "exchange_state",  # compressor, byte statistics and collectives, shared with the gradient hook
        "local_steps",  # optimizer steps taken; an exchange follows every delay-th
        "slices",  # the fragments' pieces of the parameters, in parameter order (built at register())
        "synced",  # slice key -> weights after its last exchange (identical on every rank)
        "buffers",  # the buffers averaged at exchanges and their last average (lgc.ddp.buffers.ExchangedBuffers)
        "view",  # the synchronized model shown for evaluation (lgc.ddp.global_view.GlobalModelView)
        # The wrapped model, weakly (per process, not saved): DDP's reducer holds this state, and under
        # Lightning the model reaches DDP again (module -> trainer -> strategy), a cycle through C++
        # that the garbage collector cannot see, so a strong reference would keep every model alive.
        "module_ref",
        "pending",  # a loaded state waiting for register()
        "mixing",  # alpha: the local weights' share when an exchange is applied
        "in_flight",  # the exchange started and not yet applied (lgc.ddp.streaming.InFlight), or None
        "runner",  # the thread and process group overlapped exchanges run on (lgc.ddp.streaming.ExchangeRunner)
        # Under FSDP2 (lgc.fsdp.local_steps): the group whose ranks agree on skipping an exchange and average the
        # buffers (the world), where the exchange itself runs across the replicas; None: the exchange's group.
        "guard_group",
        # Under FSDP2: parameter name -> (first row, rows) of this rank's shard; empty under DDP.
        "shards",
    )

    def __init__(
        self,
        exchange_state: CompressionHookState,
        *,
        delay: PositiveInt,
        outer: str = "average",
        outer_lr: PositiveFloat | None = None,
        outer_momentum: Momentum | None = None,
        fragments: PositiveInt = 1,
        fragment_split: str = FRAGMENT_SPLITS[0],
        overlap_steps: int = 0,
        mixing: Fraction = 0.0,
    ) -> None:
        check("delay", delay, PositiveInt)
        check("mixing", mixing, Fraction)
        self.schedule = FragmentSchedule(delay, fragments, fragment_split, overlap_steps)
        self.mixing = float(mixing)
        self.in_flight: InFlight | None = None
        self.runner = ExchangeRunner()
        self.outer_step = OuterStep(outer, outer_lr, outer_momentum)
        self.exchange_state = checked_exchange(exchange_state, delay, fragments)
        self.local_steps = 0
        self.slices: tuple[FragmentSlice, ...] = ()
        self.synced: dict[str, Tensor] = {}
        self.buffers = module_buffers.ExchangedBuffers()
        self.view = GlobalModelView()
        self.module_ref: weakref.ReferenceType[nn.Module] | None = None
        self.pending: dict[str, Any] | None = None
        self.guard_group: dist.ProcessGroup | None = None
        self.shards: dict[str, tuple[int, int]] = {}

    # The settings, as the constructor took them.
    delay = property(lambda self: self.schedule.delay)
    fragments = property(lambda self: self.schedule.fragments)
    fragment_split = property(lambda self: self.schedule.split)
    overlap_steps = property(lambda self: self.schedule.overlap_steps)
    outer = property(lambda self: self.outer_step.kind)
    outer_lr = property(lambda self: self.outer_step.lr)
    outer_momentum = property(lambda self: self.outer_step.momentum)

    # The interface lgc's strategy and callbacks use (shared with CompressionHookState).
    @property
    def module(self) -> nn.Module | None:
        """The wrapped model registered with :meth:`register` (None before, or once the model is gone)."""
        return None if self.module_ref is None else self.module_ref()

    @property
    def buffer_sync(self) -> module_buffers.BufferSync | None:
        """The buffers averaged at exchanges (:class:`lgc.ddp.buffers.BufferSync`), set by :meth:`register`."""
        return self.buffers.sync

    @property
    def held_local(self) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """Inside :meth:`global_model`: this worker's (weights, buffers), put back on leaving it."""
        return self.view.held_local

    @property
    def stats(self) -> CommStats:
        return self.exchange_state.stats

    @property
    def compressor(self) -> Compressor:
        return self.exchange_state.compressor

    def optimizer_settings_needed(self) -> tuple[str, ...]:
        return self.exchange_state.optimizer_settings_needed()

    def check_optimizer(
        self, momentum: float, weight_decay: float | None, *, sources: tuple[str, str] = OPTIMIZER_SOURCES
    ) -> None:
        self.exchange_state.check_optimizer(momentum, weight_decay, sources=sources)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.exchange_state.process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.exchange_state.process_group = group

    def dense_below(self) -> int | None:
        return self.exchange_state.dense_below()

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        """The exchange's stages count exchanges: the local steps up to the first steady exchange's period."""
        exchanges = self.exchange_state.steady_from(max(1, steps_per_epoch // self.delay))
        return -(-exchanges // self.fragments) * self.delay

    def save_codec(self, path: str | Path) -> Path | None:
        return self.exchange_state.save_codec(path)

    def describe(self) -> str:
        text = f"{self.exchange_state.describe()} every {self.delay} local step(s)"
        if self.fragments > 1:
            text += f" in {self.fragments} staggered {self.fragment_split} fragments"
        if self.overlap_steps:
            text += f", each exchange overlapping {self.overlap_steps} local step(s)"
        if self.mixing:
            text += f", local weights mixed in at {self.mixing:g}"
        return text + self.outer_step.describe()

    def set_epoch(self, epoch: int) -> None:
        self.exchange_state.set_epoch(epoch)

    def residual_norm(self) -> float | None:
        return self.exchange_state.residual_norm()

    def metrics(self) -> dict[str, float]:
        return self.exchange_state.metrics()

    def summary_extras(self) -> dict[str, Any]:
        return self.exchange_state.summary_extras()

    def _named_parameters(self) -> list[tuple[str, Tensor]]:
        """The trainable parameters by name; under FSDP2 this rank's shard of each (a view of its weights)."""
        assert self.module is not None, "call register(model) first"
        if not self.shards:
            return [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        self._reshard()
        return [(name, _local(p)) for name, p in self.module.named_parameters() if p.requires_grad]

    def _reshard(self) -> None:
        """Under FSDP2, every module's parameters back to their shards: FSDP2 keeps the root's gathered after a
        forward pass without backward (an evaluation), and the shards would then be read and written beside
        the copy the next forward pass uses."""
        assert self.module is not None
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _slices_of(self, module: nn.Module) -> tuple[FragmentSlice, ...]:
        """The fragments' pieces of ``module``'s trainable parameters; under FSDP2 each one's part of this rank's
        shard (cut as the whole parameters are, so every rank holds the same pieces, some of them empty)."""
        slices = self.schedule.slices_of([(name, p.shape) for name, p in module.named_parameters() if p.requires_grad])
        if not self.shards:
            return slices
        return tuple(s.in_shard(*self.shards[s.name]) for s in slices)

    def segments_of(self, pieces: list[FragmentSlice]) -> tuple[Segment, ...]:
        """The exchange's segments of ``pieces``, laid end to end. Under FSDP2 a shard's part is compressed or sent
        dense as its whole piece is, as the DDP hook decides by the parameter (a shard's own size would send every
        shard of a large parameter dense on enough ranks)."""
        segments = self.exchange_state.segments([(s.key, s.numel) for s in pieces])
        if not self.shards:
            return segments
        dense_below = self.exchange_state.min_numel
        return tuple(
            segment._replace(compressed=bool(s.numel) and s.full_numel >= dense_below)
            for segment, s in zip(segments, pieces, strict=True)
        )

    @property
    def _guard(self) -> dist.ProcessGroup | None:
        """The group that decides whether an exchange is skipped and averages the buffers."""
        return self.process_group if self.guard_group is None else self.guard_group

    @property
    def needs_total_steps(self) -> bool:  # type: ignore[override]
        """Whether the exchange needs the run's length (LGC's stages)."""
        return self.exchange_state.needs_total_steps

    def check_run(self, model: nn.Module, world_size: int, total_steps: int | None) -> None:
        """Refuse more fragments than the model's trainable parameters can be cut into (before workers start).

        The exchange's own checks (LGC's stages) get the run's length in exchanges.
        """
        self._slices_of(model)
        exchanges = None if total_steps is None else total_steps // self.delay
        try:
            self.exchange_state.check_run(model, world_size, exchanges)
        except RunTooShort as err:
            raise ValueError(
                f"{err.what} >= the run's {err.total} exchanges ({total_steps} optimizer steps, an exchange every "
                f"delay={self.delay}: {type(self.exchange_state).__name__}'s stages count exchanges)"
            ) from None

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Register the local-step hook on ``model`` and remember its synchronized weights and buffers.

        The hook is :func:`~lgc.ddp.local_step_hook.local_step_hook`. DDP's broadcast of rank 0's
        buffers before forward passes is turned off (:func:`lgc.ddp.buffers.keep_buffers_local`):
        the buffers are averaged at exchanges instead. With ``optimizer``, :meth:`after_optimizer_step`
        runs after each of its steps (a post-hook); either way a missed or doubled call raises at the
        next forward pass with gradients (:class:`~lgc.ddp.local_step_hook.LocalStepCheck`), before
        the weights are used.
        """
        if self.overlap_steps:
            # The exchanges run on a thread of their own, over a process group of their own (lgc.ddp.streaming).
            self.process_group = self.runner.side_group(self.process_group)
        self.exchange_state.set_world_size(dist.get_world_size(self.process_group))
        # The compressor learns the parameters' names and shapes (DeMo and chunked top-k tile by shape).
        self.exchange_state.attach(model)
        self.take(model.module)
        self.buffers.sync = module_buffers.keep_buffers_local(model)
        check = LocalStepCheck(self, automatic=optimizer is not None)
        model.register_comm_hook(check, checked_local_step_hook)
        model.register_forward_pre_hook(check.before_forward)
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())

    def take(self, module: nn.Module) -> None:
        """Cut ``module``'s parameters into the fragments' pieces and take its synchronized weights and buffers (or a
        loaded state's); the registration's part that DDP and FSDP2 (:mod:`lgc.fsdp.local_steps`) share."""
        self.module_ref = weakref.ref(module)
        self.slices = self._slices_of(module)
        # Every piece of a cut parameter by its key, as a view of its rows (under FSDP2 every shard, whole or cut):
        # a tiled compressor sees the piece's (rows, cols) matrix, and one that reads the weights reads the piece's.
        params = dict(self._named_parameters())
        pieces = {s.key: read_piece(params[s.name], s) for s in self.slices if s.numel and (self.shards or not s.whole)}
        if pieces:
            self.compressor.attach_parameters({**dict(module.named_parameters()), **pieces})
        with torch.no_grad():
            if self.pending is not None:
                delay_checkpoint.restore(self, self.pending)
                self.pending = None
            else:
                self.synced = {s.key: read_piece(params[s.name], s).clone() for s in self.slices}
                self.buffers.snapshot(module)
                self.outer_step.build(list(self.synced.values()))

    @torch.no_grad()
    def after_optimizer_step(self) -> bool:
        """Count a local step; start the exchange of the fragment whose turn is ``overlap_steps`` away and
        apply the one whose turn it is (with no overlap: both, the fragment due now). Returns whether one was applied.
        """
        self.view.refuse_inside("after_optimizer_step()")
        self.local_steps += 1
        for fragment in self.schedule.starting(self.local_steps):
            self._begin(fragment)
        applied = False
        for fragment in self.schedule.due(self.local_steps):
            # Absent only where flush() applied it already.
            if self.in_flight is not None and self.in_flight.fragment == fragment:
                self._finish()
                applied = True
        return applied

    @torch.no_grad()
    def flush(self) -> bool:
        """Apply an exchange still in flight now, before its turn; whether there was one.

        With ``overlap_steps`` an exchange started in a run's last ``overlap_steps`` steps never
        reaches the weights otherwise (torchft leaves it so, and so does lgc-train: the last
        validation sees the synchronized weights without it). Call it after the last step to apply
        it; its fragment's next exchange starts on schedule. A run that flushed and was resumed
        differs from one that was not stopped.
        """
        if self.in_flight is None:
            return False
        self._finish()
        return True

    def settle(self) -> None:
        """Wait for an exchange still in flight (its collectives done, its bytes counted), applying nothing."""
        if self.in_flight is not None:
            self.in_flight.skipped()

    def _begin(self, fragment: int) -> None:
        """Take the fragment's pseudo-gradients and start their exchange (on the runner's thread with an overlap)."""
        assert self.module is not None
        assert self.in_flight is None, "an exchange is already in flight"  # the schedule's shortest gap
        turn = self.local_steps + self.overlap_steps
        # Exchanges are numbered in schedule order (the compressor's step counter).
        number = self.schedule.exchanges_through(turn - 1)
        pieces = [s for s in self.slices if s.fragment == fragment]
        params = dict(self._named_parameters())
        # The pseudo-gradient W_sync - W_local goes through the compressor (see the module docstring).
        update = torch.cat([(self.synced[s.key] - read_piece(params[s.name], s)).reshape(-1) for s in pieces])
        update.div_(dist.get_world_size(self.process_group))
        segments = self.segments_of(pieces)
        pending = [PendingBucket(update, segments, torch.futures.Future())]

        def exchange() -> bool:
            # The hook's step guard, applied to the weight update: every rank agrees whether some
            # rank's weights went non-finite (a local step without a GradScaler to skip it) and
            # which parameters did not move anywhere.
            verdict = agree_on_step(self.stats, self._guard, pending)
            if not verdict.skip:
                self.exchange_state.compress_step(pending, verdict.used, number)
            return verdict.skip

        # The buffers go with the fragment exchanged at the end of every delay steps (the last one).
        with_buffers = self.schedule.step_of(fragment) == 0
        outcome = self.runner.submit(exchange, update.device) if self.overlap_steps else finished(exchange())
        self.in_flight = InFlight(fragment, number, with_buffers, update, segments, outcome)

    def _finish(self) -> None:
        """Wait for the exchange in flight, apply the outer step and mix the local weights in (``mixing``)."""
        assert self.module is not None
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        params = dict(self._named_parameters())
        pieces = [s for s in self.slices if s.fragment == flight.fragment]
        if flight.skipped():
            # A rank's update is inf/NaN: no average can use it. Every rank returns to the last
            # synchronized weights (and buffers), and the residuals stay as they were.
            for s in pieces:
                write_piece(params[s.name], s, self.synced[s.key])
            if flight.with_buffers:
                self.buffers.restore(self.module)
            self.stats.skipped_steps += 1
            self.exchange_state.step_done(skipped=True)
            return
        moves = []
        for s, segment in zip(pieces, flight.segments, strict=True):
            synced = self.synced[s.key]
            moves.append((synced, flight.update[segment.offset : segment.offset + segment.numel].view_as(synced)))
        self.outer_step.apply(moves)
        for s in pieces:
            synced = self.synced[s.key]
            if self.mixing:
                synced = torch.lerp(synced, read_piece(params[s.name], s), self.mixing)
            write_piece(params[s.name], s, synced)
        if flight.with_buffers:
            group = self._guard
            self.buffers.average(self.module, self.stats, dist.get_world_size(group), group)
        self.exchange_state.step_done(skipped=False)  # after the buffers: their bytes belong to this exchange

    @contextlib.contextmanager
    def global_model(self) -> Iterator[nn.Module]:
        """The synchronized model in the wrapped module for the ``with`` block; the local one back after it.

        Every parameter holds its fragments' last synchronized weights and every averaged buffer its
        last average: the model all workers agree on, which DiLoCo and its successors evaluate
        (:class:`~lgc.ddp.global_view.GlobalModelView` says what stays local and what is put back).

        Example::

            >>> with state.global_model() as model:
            ...     accuracy = evaluate(model)
        """
        assert self.module is not None, "call register(model) first"
        synced = [(s, self.synced[s.key]) for s in self.slices]
        averaged = {name: self.buffers.synced[name] for name in self.buffers.averaged(self.module)}
        try:
            with self.view.enter(self.module, dict(self._named_parameters()), synced, averaged) as module:
                yield module
        finally:
            if self.shards:
                self._reshard()  # the evaluation's gathered synchronized weights out of the root

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (:func:`lgc.ddp.delay_checkpoint.save`): its weights differ from the other ranks'."""
        return delay_checkpoint.save(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (:func:`lgc.ddp.delay_checkpoint.load`), refusing one cut or built otherwise."""
        delay_checkpoint.load(self, state)

    def __getstate__(self) -> dict[str, Any]:
        # The per-process parts (the model, its pieces and weights, the outer optimizer over them,
        # the buffers and the view) are rebuilt by register() in the process that unpickles it.
        return {
            "schedule": self.schedule,
            "outer_step": self.outer_step,
            "exchange_state": self.exchange_state,
            "local_steps": self.local_steps,
            "slices": (),
            "synced": {},
            "buffers": module_buffers.ExchangedBuffers(),
            "view": GlobalModelView(),
            "module_ref": None,
            "pending": self.pending,
            "mixing": self.mixing,
            "in_flight": None,
            "runner": ExchangeRunner(),
            "guard_group": None,
            "shards": {},
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)


def _local(param: nn.Parameter) -> Tensor:
    """``param``, or under FSDP2 this rank's shard of it: a plain tensor viewing the parameter's own storage."""
    return param.to_local().detach() if isinstance(param, DTensor) else param
