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

Outer optimizer (DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023): with ``outer="sgd"`` the averaged pseudo-gradient ``mean_i (W_sync -
W_local,i)`` is not subtracted as it is but is the gradient of an outer SGD step with Nesterov
momentum on ``W_sync`` (``torch.optim.SGD``; DiLoCo's defaults: learning rate 0.7, momentum 0.9,
Nesterov). The inner optimizer and its state stay per worker. ``outer="average"``
(default) is SBC's plain average; ``outer="sgd"`` with ``outer_lr=1`` and ``outer_momentum=0`` gives
the same weights bit for bit.

Streaming (Douillard et al., "Streaming DiLoCo with overlapping communication", 2025): with
``fragments = F > 1`` the parameters are cut into ``F`` fragments of about equal size (by element
count, :func:`~lgc.ddp.fragments.split_into_fragments`), and fragment ``f`` is exchanged on the
local steps ``t`` with ``t % delay == (f + 1) * delay // F % delay``: every fragment still waits ``delay`` steps between
its exchanges, so the bytes per ``delay`` steps are unchanged, but they are spread over ``F``
exchanges instead of one burst, and the peak bandwidth falls by about ``F``. The outer optimizer
steps only the exchanged fragment. When ``F`` divides ``delay`` this is torchft's schedule
(``DiLoCo._step_post_hook``: every ``delay / F`` local steps one fragment, fragment ``n % F`` at
the ``n``-th); torchft refuses other ``F``, where lgc keeps the formula above (torchft's
``fragment_sync_offset``), so the gaps between consecutive fragments differ by a step. A skipped
exchange (below) keeps the schedule: its fragment waits for its next turn, where torchft, whose
fragment counter counts committed syncs, would retry the same fragment ``delay / F`` steps later
and shift the later ones. ``fragment_split`` says how the parameters are cut:

* ``"strided"`` (default; the paper's strided pattern): the parameters, and pieces of those too
  large to balance the fragments, are dealt out largest first to the fragment with the fewest
  entries, so layers of equal size go round-robin as the paper's every ``F``-th transformer block.
* ``"contiguous"``: ``F`` consecutive ranges of about equal size (the paper's sequential pattern).

Either way a parameter is cut only where balance needs it, and then only between rows of its
``(out, in * kh * kw)`` matrix: every fragment holds at most ``1.25 * total / F`` entries (1.00 to
1.16 times ``total / F`` on ResNet-8, -20 and -50 at 2 to 8 fragments), none is empty, and a
parameter that straddles a cut is exchanged in pieces, keyed ``name[start:stop]`` (its rows
``start:stop``) in the compressor's state and the per-layer table, and attached to the compressor
as a view of those rows, so a compressor that tiles by shape tiles each piece as a matrix (whole
parameters keep their names). Where this departs from the paper and torchft: they assign whole
transformer blocks (torchft: the modules the user passes), which are of equal size; a CNN's layers
are not (ResNet-8's two largest convolutions hold 73 % of its weights), so balanced fragments
may cut inside tensors, and they are balanced by size rather than spread over the depth. The
exchange is blocking: Streaming DiLoCo's overlap of an exchange with the next local steps
(``tau > 0``) and its mixing of local and synchronized weights (``alpha``) are not implemented, on
gloo or NCCL. The paper's 4-bit outer gradients are a compressor
(:class:`lgc.compressors.FP4Compressor`, ``experiment=streaming_diloco``).

Module buffers (BatchNorm's running statistics; :mod:`lgc.ddp.buffers`): DDP's broadcast of rank
0's buffers before every forward is turned off, so each worker's statistics follow its own local
weights, and the workers average their floating-point buffers at the end of every ``delay`` steps,
with the exchange of the last fragment (all of them when ``F = 1``), counted as a dense allreduce;
every worker continues from the average (a model built with ``broadcast_buffers=False`` keeps
every worker's buffers local: nothing is averaged).

Evaluation (:meth:`CommunicationDelayState.global_model`): DiLoCo, Streaming DiLoCo, SparseLoCo
and DeMo report the synchronized (global) model, not a worker's local weights. Inside
``global_model()`` the module holds every fragment's last synchronized weights and the buffers of
the last exchange; on leaving it, the local weights and buffers are back bit for bit (optimizer
state is never touched). ``lgc-train`` and ``lgc-bench network`` validate inside it.

Steps:

1. The DDP hook :func:`local_step_hook` returns each worker's own gradient untouched (no bytes).
2. After every optimizer step, :meth:`CommunicationDelayState.after_optimizer_step` counts local
   steps; on every ``delay``-th it averages the weight updates through the gradient hook's step
   guard and exchange (:meth:`lgc.ddp.CompressionHookState.agree` and ``compress_step``: the same
   collectives and byte accounting) and moves every worker to the new synchronized weights.

Non-finite values: a local step whose gradient overflows is the optimizer's (or GradScaler's)
to skip, as without lgc. If a rank's weight update is nevertheless inf/NaN at an exchange, every
rank skips that exchange (counted in ``stats.skipped_steps``), returns to the last synchronized
weights (and, with the last fragment, buffers) and keeps its residuals as they were. Parameters
whose update is zero on every rank are not sent.

Its length is one state: the exchange, the module buffers, the global-model view and the
checkpoint all change the same synchronized weights and must change together (the fragments'
cutting is :mod:`lgc.ddp.fragments`).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import contextlib
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.base import Compressor
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.fragments import FRAGMENT_SPLITS, FragmentSlice, read_piece, split_into_fragments, write_piece
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.protocol import HookState, RunTooShort
from lgc.ddp.step_guard import PendingBucket
from lgc.validation import Momentum, PositiveFloat, PositiveInt, check

__all__ = ["OUTER_OPTIMIZERS", "CommunicationDelayState", "local_step_hook", "register_communication_delay"]

#: What goes through the compressor at an exchange (recorded in checkpoints: it fixes the residuals' sign).
COMPRESSED = "the pseudo-gradient W_sync - W_local"

#: ``outer`` choices: SBC's plain average, or DiLoCo's outer SGD on the pseudo-gradient.
OUTER_OPTIMIZERS = ("average", "sgd")
#: DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023, Sec. 3).
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9


class CommunicationDelayState(HookState):
    """Local SGD with compressed weight-update exchanges every ``delay`` steps.

    Args:
        compressor: applied to each parameter's pseudo-gradient ``W_sync - W_local``, e.g.
            ``ErrorFeedback(SBCCompressor(density=0.01))``; or a hook state of the LGC family
            (:class:`~lgc.learned.LGCHookState`: LGC-RAR, LGC-PS, the shared-index codecs), which
            then exchanges the weight updates as it would exchange gradients, its stages counted in
            exchanges, a skipped one included (``warmup_steps=30`` is the first 30 exchanges,
            ``30 * delay`` local steps).
            Such a state brings its own ``min_numel`` and exchanges whole parameters
            (``fragments=1``).
        delay: local steps between exchanges (SBC: 1 to 100s; longer delays save bytes linearly
            but let workers drift apart, which costs accuracy on non-IID data).
        min_numel: parameters (or fragment pieces) with fewer elements exchange their update dense
            (``None``: the method's own, as :class:`~lgc.ddp.CompressionHookState`: every parameter
            for SparseLoCo).
        process_group: group to communicate in (default: the world).
        outer: ``"average"`` (SBC: ``W_sync -= mean(Delta)``, i.e. ``+= mean(dW)``) or ``"sgd"`` (DiLoCo:
            an outer SGD step with Nesterov momentum on the pseudo-gradient ``mean(Delta)``).
        outer_lr: the outer learning rate (``outer="sgd"`` only; default 0.7, DiLoCo's).
        outer_momentum: the outer Nesterov momentum in ``[0, 1)`` (``outer="sgd"`` only; default
            0.9, DiLoCo's; 0 is plain SGD).
        fragments: Streaming DiLoCo's fragments, exchanged on staggered steps (1: every parameter at
            once, every ``delay`` steps). At most ``delay`` (each fragment its own step) and at most
            the number of rows of the trainable parameters (checked at :meth:`register`;
            :func:`~lgc.ddp.fragments.split_into_fragments`).
        fragment_split: how the parameters are cut into fragments of about equal size: ``"strided"``
            (default, the paper's) or ``"contiguous"`` (see the module docstring).

    Call :meth:`after_optimizer_step` after every ``optimizer.step()`` (the Lightning callback
    does). Checkpoints must hold every rank's :meth:`state_dict`: between exchanges the workers'
    weights and buffers differ. Evaluate inside :meth:`global_model`.
    """

    takes_local_steps = True

    __slots__ = (
        # hyperparameters
        "delay",
        "outer",
        "outer_lr",
        "outer_momentum",
        "fragments",
        "fragment_split",
        # internal state
        "exchange_state",  # compressor, byte statistics and collectives, shared with the gradient hook
        "local_steps",  # optimizer steps taken; an exchange follows every delay-th
        "slices",  # the fragments' pieces of the parameters, in parameter order (built at register())
        "synced",  # slice key -> weights after its last exchange (identical on every rank)
        "synced_buffers",  # buffer name -> value after the last buffer average (identical on every rank)
        # The wrapped model, weakly (per process, not saved): DDP's reducer holds this state, and under
        # Lightning the model reaches DDP again (module -> trainer -> strategy), a cycle through C++
        # that the garbage collector cannot see, so a strong reference would keep every model alive.
        "module_ref",
        "buffer_sync",  # the buffers averaged at exchanges (lgc.ddp.buffers.BufferSync), set by register(); per process
        "pending",  # a loaded state waiting for register()
        "held_local",  # inside global_model(): this worker's (weights, buffers), put back on leaving it
        "outer_optimizer",  # torch.optim.SGD over the synchronized weights (outer="sgd"), built at register()
    )

    def __init__(
        self,
        compressor: Compressor | CompressionHookState,
        *,
        delay: PositiveInt,
        min_numel: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        outer: str = "average",
        outer_lr: PositiveFloat | None = None,
        outer_momentum: Momentum | None = None,
        fragments: PositiveInt = 1,
        fragment_split: str = FRAGMENT_SPLITS[0],
    ) -> None:
        check("delay", delay, PositiveInt)
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= delay:
            raise ValueError(
                f"fragments must be an integer from 1 to delay={delay} (each fragment is exchanged on a step of its "
                f"own), got {fragments!r}"
            )
        if fragment_split not in FRAGMENT_SPLITS:
            raise ValueError(f"fragment_split must be one of {FRAGMENT_SPLITS}, got {fragment_split!r}")
        if outer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer must be one of {OUTER_OPTIMIZERS}, got {outer!r}")
        if outer == "average" and (outer_lr is not None or outer_momentum is not None):
            raise ValueError(
                f"outer_lr={outer_lr!r} and outer_momentum={outer_momentum!r} are the outer optimizer's knobs: "
                "set outer='sgd' (DiLoCo), or leave them null for outer='average'"
            )
        check("outer_lr", outer_lr, PositiveFloat | None)
        check("outer_momentum", outer_momentum, Momentum | None)
        lr = DILOCO_OUTER_LR if outer_lr is None else outer_lr
        momentum = DILOCO_OUTER_MOMENTUM if outer_momentum is None else outer_momentum
        if isinstance(compressor, CompressionHookState):
            what = type(compressor).__name__
            if fragments != 1:
                raise ValueError(
                    f"fragments={fragments} cuts parameters into pieces; {what} codes whole parameters (its leader's "
                    "positions and residuals are keyed by parameter): use fragments=1"
                )
            if min_numel is not None:
                raise ValueError(f"min_numel={min_numel!r} is {what}'s own setting: build it with that min_numel")
            if compressor.overlap:
                raise ValueError(
                    f"{what} was built with overlap=True; an exchange after the optimizer step has no backward pass "
                    "to overlap"
                )
            exchange_state = compressor
            if process_group is not None:
                exchange_state.process_group = process_group
        elif isinstance(compressor, Compressor):
            exchange_state = CompressionHookState(
                compressor, min_numel=min_numel, start_iter=0, process_group=process_group
            )
        else:
            raise TypeError(
                f"compressor must be an lgc Compressor or an LGC-family hook state, got {type(compressor).__name__}"
            )
        decay = exchange_state.compressor.own_weight_decay
        if decay != 0.0:
            raise ValueError(
                f"delay={delay} exchanges weight updates, which the local optimizer's weight decay already "
                f"shaped; the compressor's own weight_decay={decay!r} would decay them again: set the compressor's "
                "weight_decay=0 and keep the decay in the optimizer"
            )
        self.delay = delay
        self.outer = outer
        self.outer_lr = float(lr)
        self.outer_momentum = float(momentum)
        self.fragments = fragments
        self.fragment_split = fragment_split
        self.slices: tuple[FragmentSlice, ...] = ()
        self.outer_optimizer: torch.optim.SGD | None = None
        self.exchange_state = exchange_state
        self.local_steps = 0
        self.synced: dict[str, Tensor] = {}
        self.synced_buffers: dict[str, Tensor] = {}
        self.module_ref: weakref.ReferenceType[nn.Module] | None = None
        self.buffer_sync: module_buffers.BufferSync | None = None
        self.pending: dict[str, Any] | None = None
        self.held_local: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None

    # The interface lgc's strategy and callbacks use (shared with CompressionHookState).
    @property
    def module(self) -> nn.Module | None:
        """The wrapped model registered with :meth:`register` (None before, or once the model is gone)."""
        return None if self.module_ref is None else self.module_ref()

    @property
    def stats(self) -> CommStats:
        return self.exchange_state.stats

    @property
    def compressor(self) -> Compressor:
        return self.exchange_state.compressor

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
        if self.outer == "sgd":
            text += f", outer SGD (lr {self.outer_lr:g}, Nesterov momentum {self.outer_momentum:g})"
        return text

    def set_epoch(self, epoch: int) -> None:
        self.exchange_state.set_epoch(epoch)

    def residual_norm(self) -> float | None:
        return self.exchange_state.residual_norm()

    def metrics(self) -> dict[str, float]:
        return self.exchange_state.metrics()

    def summary_extras(self) -> dict[str, Any]:
        return self.exchange_state.summary_extras()

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        assert self.module is not None, "call register(model) first"
        return [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]

    def _slices_of(self, module: nn.Module) -> tuple[FragmentSlice, ...]:
        """The fragments' pieces of ``module``'s trainable parameters (:func:`split_into_fragments`)."""
        trainable = [(name, p.shape) for name, p in module.named_parameters() if p.requires_grad]
        return split_into_fragments(trainable, self.fragments, self.fragment_split)

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
        """Register :func:`local_step_hook` on ``model`` and remember its synchronized weights and buffers.

        DDP's broadcast of rank 0's buffers before forward passes is turned off
        (:func:`lgc.ddp.buffers.keep_buffers_local`): the buffers are averaged at exchanges instead.
        With ``optimizer``, :meth:`after_optimizer_step` runs after each of its steps (a post-hook);
        either way a missed or doubled call raises at the next forward pass with gradients
        (:class:`_LocalStepCheck`), before the weights are used.
        """
        self.module_ref = weakref.ref(model.module)
        self.exchange_state.set_world_size(dist.get_world_size(self.process_group))
        # The compressor learns the parameters' names and shapes (DeMo and chunked top-k tile by shape).
        self.exchange_state.attach(model)
        named = self._named_parameters()
        self.slices = self._slices_of(model.module)
        # And every piece of a cut parameter by its key, as a view of its rows: a tiled compressor sees
        # the piece's (rows, cols) matrix, and one that reads the weights reads the piece's.
        params = dict(named)
        pieces = {s.key: read_piece(params[s.name], s) for s in self.slices if not s.whole}
        if pieces:
            self.compressor.attach_parameters({**dict(model.module.named_parameters()), **pieces})
        with torch.no_grad():
            if self.pending is not None:
                self._restore(self.pending)
                self.pending = None
            else:
                params = dict(self._named_parameters())
                self.synced = {s.key: read_piece(params[s.name], s).clone() for s in self.slices}
                self.synced_buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
                self._build_outer_optimizer()
        self.buffer_sync = module_buffers.keep_buffers_local(model)
        check = _LocalStepCheck(self, automatic=optimizer is not None)
        model.register_comm_hook(check, _checked_local_step_hook)
        model.register_forward_pre_hook(check.before_forward)
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())

    def _build_outer_optimizer(self) -> None:
        """DiLoCo's outer SGD over the synchronized weights (``outer="sgd"``)."""
        if self.outer != "sgd":
            return
        self.outer_optimizer = torch.optim.SGD(
            list(self.synced.values()),
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            nesterov=self.outer_momentum > 0,
        )

    def fragment_step(self, fragment: int) -> int:
        """The step within every ``delay`` local steps (``0`` for the last) at which ``fragment`` is exchanged."""
        return (fragment + 1) * self.delay // self.fragments % self.delay

    def exchanges_through(self, step: int) -> int:
        """Exchanges (of a fragment, or of everything) due on local steps ``1..step``, skipped ones included."""
        total = 0
        for fragment in range(self.fragments):
            first = self.fragment_step(fragment) or self.delay
            if step >= first:
                total += (step - first) // self.delay + 1
        return total

    @torch.no_grad()
    def after_optimizer_step(self) -> bool:
        """Count a local step; exchange the fragments due at it (all: every ``delay``-th). Returns whether it did."""
        self._refuse_inside_global_model("after_optimizer_step()")
        self.local_steps += 1
        due = [f for f in range(self.fragments) if self.local_steps % self.delay == self.fragment_step(f)]
        # Exchanges are numbered in schedule order (the compressor's step counter).
        first = self.exchanges_through(self.local_steps - 1)
        for number, fragment in enumerate(due, start=first):
            # The buffers go with the fragment exchanged at the end of every delay steps (the last one).
            with_buffers = self.fragment_step(fragment) == 0
            self._exchange([s for s in self.slices if s.fragment == fragment], number, with_buffers)
        return bool(due)

    def _exchange(self, pieces: list[FragmentSlice], exchange: int, with_buffers: bool) -> None:
        """Average the weight updates of ``pieces`` (a fragment, or every parameter) and apply the outer step."""
        world_size = dist.get_world_size(self.process_group)
        params = dict(self._named_parameters())
        # The pseudo-gradient W_sync - W_local goes through the compressor (see the module docstring).
        update = torch.cat([(self.synced[s.key] - read_piece(params[s.name], s)).reshape(-1) for s in pieces])
        update.div_(world_size)
        segments = self.exchange_state.segments([(s.key, s.numel) for s in pieces])
        # The hook's step guard, applied to the weight update: every rank agrees whether some
        # rank's weights went non-finite (a local step without a GradScaler to skip it) and which
        # parameters did not move anywhere.
        pending = [PendingBucket(update, segments, torch.futures.Future())]
        verdict = self.exchange_state.agree(pending)
        if verdict.skip:
            # A rank's update is inf/NaN: no average can use it. Every rank returns to the last
            # synchronized weights (and buffers), and the residuals stay as they were.
            for s in pieces:
                write_piece(params[s.name], s, self.synced[s.key])
            if with_buffers:
                self._restore_synced_buffers()
            self.stats.skipped_steps += 1
            self.exchange_state.step_done(skipped=True)
            return
        self.exchange_state.compress_step(pending, verdict.used, exchange)
        for s, segment in zip(pieces, segments, strict=True):
            synced = self.synced[s.key]
            averaged = update[segment.offset : segment.offset + segment.numel].view_as(synced)
            if self.outer_optimizer is None:
                synced -= averaged
            else:
                synced.grad = averaged.clone()  # the outer step's gradient: mean of W_sync - W_local
        if self.outer_optimizer is not None:
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
        for s in pieces:
            write_piece(params[s.name], s, self.synced[s.key])
        if with_buffers:
            self._average_buffers(world_size)
        self.exchange_state.step_done(skipped=False)  # after the buffers: their bytes belong to this exchange

    def _average_buffers(self, world_size: int) -> None:
        """Every worker's floating-point buffers averaged (a counted allreduce); all continue from the average.

        Integer buffers (BatchNorm's ``num_batches_tracked``) count forward passes, the same on every
        rank: they stay as they are. An average that is not finite (a rank's statistics overflowed)
        is not taken: every rank returns to the last averaged buffers instead.
        """
        assert self.module is not None
        floating = list(self._averaged_buffers().values())
        finite = module_buffers.average_buffers(self.stats, floating, world_size, self.process_group)
        if not finite:
            self._restore_synced_buffers()
            return
        self.synced_buffers.update({name: b.detach().clone() for name, b in self._averaged_buffers().items()})

    def _averaged_buffers(self) -> dict[str, Tensor]:
        """The buffers the exchanges average, by name: the floating-point ones DDP's rule keeps in step.

        Integer buffers (BatchNorm's ``num_batches_tracked``) count this worker's forward passes,
        buffers DDP ignores are the worker's own, and with ``broadcast_buffers=False`` there are none.
        """
        assert self.module is not None and self.buffer_sync is not None
        named = dict(self.module.named_buffers())
        return {name: named[name] for name in self.buffer_sync.names if named[name].is_floating_point()}

    def _restore_synced_buffers(self) -> None:
        """The averaged buffers back to their last average (an exchange or its average was not finite)."""
        for name, buffer in self._averaged_buffers().items():
            buffer.copy_(self.synced_buffers[name])

    @contextlib.contextmanager
    def global_model(self) -> Iterator[nn.Module]:
        """The synchronized model in the wrapped module for the ``with`` block; the local one back after it.

        Inside, every parameter holds its fragments' last synchronized weights and every averaged
        buffer (:meth:`_averaged_buffers`) the value of the last buffer average (the initial ones
        before any exchange): the model all workers agree on, which DiLoCo and its successors
        evaluate. The other buffers stay this worker's own: integer ones (BatchNorm's
        ``num_batches_tracked``) count its forward passes, and with ``broadcast_buffers=False`` (or
        buffers DDP ignores) there is no agreed value to take. On leaving, even by an exception, this
        worker's local weights and buffers are copied back bit for bit; the optimizer's state and the random
        generators are not touched, so training continues as if nothing had been evaluated. Inside,
        :meth:`state_dict` saves the local weights held aside, and a second ``global_model()``,
        :meth:`after_optimizer_step` and :meth:`load_state_dict` raise.

        Example::

            >>> with state.global_model() as model:
            ...     accuracy = evaluate(model)
        """
        assert self.module is not None, "call register(model) first"
        self._refuse_inside_global_model("global_model()")
        params = dict(self._named_parameters())
        local = {name: p.detach().clone() for name, p in params.items()}
        local_buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        self.held_local = (local, local_buffers)
        try:
            with torch.no_grad():
                for s in self.slices:
                    write_piece(params[s.name], s, self.synced[s.key])
                for name, buffer in self._averaged_buffers().items():
                    buffer.copy_(self.synced_buffers[name])
            yield self.module
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(local[name])
                for name, buffer in self.module.named_buffers():
                    buffer.copy_(local_buffers[name])
            self.held_local = None

    def _refuse_inside_global_model(self, what: str) -> None:
        if self.held_local is not None:
            raise RuntimeError(
                f"{what} inside global_model(): the module holds the synchronized weights until the with block ends "
                "(leave it first)"
            )

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: compressor state, counters, synchronized and local weights and buffers.

        Inside :meth:`global_model` the local weights and buffers are the ones held aside, not the
        module's (which then holds the synchronized model).
        """
        module = self.module
        if self.held_local is not None:
            weights, buffers = self.held_local
        elif module is not None:
            weights, buffers = dict(self._named_parameters()), dict(module.named_buffers())
        else:
            weights, buffers = {}, {}
        return {
            "exchange": self.exchange_state.state_dict(),
            "local_steps": self.local_steps,
            "fragments": self.fragments,
            "fragment_split": self.fragment_split,
            # What the compressor's residuals hold (their sign): see load_state_dict.
            "compressed": COMPRESSED,
            "synced": {key: t.detach().cpu().clone() for key, t in self.synced.items()},
            "synced_buffers": {name: t.detach().cpu().clone() for name, t in self.synced_buffers.items()},
            # Between exchanges every rank has its own weights and buffers; the model checkpoint holds rank 0's.
            "local_weights": {name: t.detach().cpu().clone() for name, t in weights.items()},
            "local_buffers": {name: t.detach().cpu().clone() for name, t in buffers.items()},
            "outer_optimizer": None if self.outer_optimizer is None else self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._refuse_inside_global_model("load_state_dict()")
        compressed = state.get("compressed", "the weight update W_local - W_sync")
        if compressed != COMPRESSED:
            raise ValueError(
                f"the checkpoint's compressor state was built on {compressed}, this run compresses {COMPRESSED}: its "
                "error-feedback residuals have the opposite sign; resume it with the lgc version that wrote it"
            )
        self.exchange_state.load_state_dict(state["exchange"])
        saved_fragments = int(state["fragments"])
        if saved_fragments != self.fragments:
            raise ValueError(
                f"the checkpoint was written with fragments={saved_fragments}, this run has "
                f"fragments={self.fragments}: the fragments' schedule would change mid-run"
            )
        # One fragment is never cut, whatever the rule; more are cut by the recorded rule only.
        saved_split = state.get("fragment_split")
        if self.fragments > 1 and saved_split != self.fragment_split:
            recorded = (
                f"fragment_split={saved_split!r}"
                if saved_split is not None
                else "no fragment_split (its fragments held whole parameters, cut where their first entry fell)"
            )
            raise ValueError(
                f"the checkpoint was written with {recorded}, this run has fragment_split={self.fragment_split!r}: "
                "its synchronized weights, outer momentum and residuals belong to other fragments"
            )
        self.local_steps = int(state["local_steps"])
        if self.module is None:
            self.pending = state
        else:
            with torch.no_grad():
                self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        assert self.module is not None
        params = dict(self._named_parameters())
        keys = [s.key for s in self.slices]
        if sorted(state["synced"]) != sorted(keys):
            missing = sorted(set(keys) - set(state["synced"]))
            extra = sorted(set(state["synced"]) - set(keys))
            raise ValueError(
                f"the checkpoint's synchronized weights are cut otherwise than this run's fragments "
                f"(missing: {missing[:3]}, not in this run: {extra[:3]})"
            )
        for s in self.slices:
            saved = tuple(state["synced"][s.key].shape)
            if saved != s.shape:
                raise ValueError(
                    f"the checkpoint's synchronized weights of {s.key!r} have shape {saved}, this run's piece has "
                    f"{s.shape}: they are cut otherwise"
                )
        self.synced = {s.key: state["synced"][s.key].to(params[s.name].device).clone() for s in self.slices}
        for name, weights in state["local_weights"].items():
            params[name].copy_(weights)
        # Absent from checkpoints written while DDP broadcast rank 0's buffers before every forward:
        # every rank then held the buffers the model checkpoint restored, the best value for both.
        buffers = dict(self.module.named_buffers())
        for name, value in state.get("local_buffers", {}).items():
            buffers[name].copy_(value)
        saved = state.get("synced_buffers")
        source = buffers if saved is None else saved
        self.synced_buffers = {name: source[name].to(b.device).clone() for name, b in buffers.items()}
        self._build_outer_optimizer()
        saved_outer = state["outer_optimizer"]
        if (saved_outer is None) != (self.outer_optimizer is None):
            raise ValueError(
                f"the checkpoint was written with outer={'average' if saved_outer is None else 'sgd'!r}, "
                f"this run has outer={self.outer!r}"
            )
        if self.outer_optimizer is not None:
            self.outer_optimizer.load_state_dict(saved_outer)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "delay": self.delay,
            "outer": self.outer,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "fragments": self.fragments,
            "fragment_split": self.fragment_split,
            "slices": (),
            "outer_optimizer": None,
            "exchange_state": self.exchange_state,
            "local_steps": self.local_steps,
            "synced": {},
            "synced_buffers": {},
            "module_ref": None,
            "buffer_sync": None,
            "pending": self.pending,
            "held_local": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.held_local = None
        for slot, value in state.items():
            setattr(self, slot, value)


def local_step_hook(state: CommunicationDelayState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Leave each worker's gradient local (the delay's local steps); count what plain DDP would send."""
    buffer = bucket.buffer()
    state.stats.hook_calls += 1
    counted.book_dense_equivalent(state.stats, buffer, state.process_group)
    if bucket.is_last() and state.module is not None and state.buffer_sync is not None:
        # Plain DDP would also broadcast rank 0's buffers once per step (lgc.ddp.buffers).
        buffers = state.buffer_sync.buffers(state.module)
        module_buffers.book_dense_buffer_broadcast(state.stats, buffers, state.process_group)
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class _LocalStepCheck:
    """Makes a forgotten or doubled ``after_optimizer_step()`` loud in communication-delay mode.

    Between two synchronized backward passes (those that reach the DDP hook) the optimizer steps
    once, so ``after_optimizer_step()`` must run exactly once: never, and the workers never
    exchange and drift apart; twice, and they exchange at the wrong steps. The count is checked
    at the next forward pass with gradients, before it uses the weights.
    """

    __slots__ = ("state", "automatic", "backward_passes", "checked_passes", "steps_at_backward")

    def __init__(self, state: CommunicationDelayState, automatic: bool) -> None:
        self.state = state
        #: Whether an optimizer step post-hook calls after_optimizer_step (register(model, optimizer)).
        self.automatic = automatic
        #: Synchronized backward passes finished, and how many of them the forward check has seen.
        self.backward_passes = 0
        self.checked_passes = 0
        #: ``state.local_steps`` when the last backward pass finished.
        self.steps_at_backward = 0

    def backward_done(self) -> None:
        self.backward_passes += 1
        self.steps_at_backward = self.state.local_steps

    def before_forward(self, module: nn.Module, args: Any) -> None:
        if self.checked_passes == self.backward_passes or not torch.is_grad_enabled():
            return
        self.checked_passes = self.backward_passes
        calls = self.state.local_steps - self.steps_at_backward
        if calls == 1:
            return
        delay = self.state.delay
        if calls == 0:
            how = (
                "the optimizer's step post-hook did not run: optimizer.step() was skipped (a GradScaler skips it "
                "for an inf/NaN on this rank only); with a GradScaler, do not pass optimizer= and call "
                "state.after_optimizer_step() after every scaler.step(optimizer)"
                if self.automatic
                else "pass optimizer=your_optimizer to lgc.compress (it then calls after_optimizer_step after every "
                "optimizer.step()), or call state.after_optimizer_step() after every optimizer.step()"
            )
            raise RuntimeError(
                f"communication delay (delay={delay}): a backward pass finished but state.after_optimizer_step() "
                "was not called before this forward pass, so this local step is not counted and the workers would "
                f"drift apart without exchanging their updates: {how}. (Accumulating gradients over several "
                "backward passes per step? Run all but the last under model.no_sync().)"
            )
        fix = (
            "lgc.compress(..., optimizer=...) already calls it after every optimizer.step(): remove your own call"
            if self.automatic
            else "call it once per optimizer step"
        )
        raise RuntimeError(
            f"communication delay (delay={delay}): state.after_optimizer_step() ran {calls} times since the last "
            f"backward pass, so the workers would exchange at the wrong steps: {fix}"
        )


def _checked_local_step_hook(check: _LocalStepCheck, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`lgc.ddp.local_sgd.local_step_hook`, counting finished backward passes for the check."""
    future = local_step_hook(check.state, bucket)
    if bucket.is_last():
        check.backward_done()
    return future


def register_communication_delay(
    model: DistributedDataParallel, compressor: Compressor, *, delay: int, min_numel: int | None = None
) -> CommunicationDelayState:
    """Make ``model`` train with local steps and a compressed weight-update exchange every ``delay`` steps.

    Prefer ``lgc.compress(model, "sbc", optimizer=optimizer, delay=4)``: it checks the method
    against the optimizer and calls :meth:`CommunicationDelayState.after_optimizer_step` after every
    ``optimizer.step()``; here the caller calls it (a missed or doubled call raises at the next
    forward pass either way).

    Example::

        >>> state = register_communication_delay(model, ErrorFeedback(SBCCompressor(0.01)), delay=4)
        >>> for batch in loader:
        ...     loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        ...     state.after_optimizer_step()
    """
    state = CommunicationDelayState(compressor, delay=delay, min_numel=min_numel)
    state.register(model)
    return state
