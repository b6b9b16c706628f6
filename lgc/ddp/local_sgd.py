"""Communication delay (SBC): local steps, then an exchange of the compressed weight update.

Sattler et al., "Sparse Binary Compression: Towards Distributed Deep Learning with minimal
Communication" (IJCNN 2019), Sec. III-A: every worker runs ``delay`` local optimizer steps on its
own gradients without communicating, then sends its weight update ``dW = W_local - W_sync``
through the compressor (with error feedback, SBC's residual ``A += dW; A -= sent``); all workers
set ``W_sync += mean(decoded dW)``. ``delay = 1`` exchanges the update of every single step, which
for plain SGD equals averaging the gradients. This works with any lgc compressor.

Outer optimizer (DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023): with ``outer="sgd"`` the averaged update is not added as it is. Its
negative, the *pseudo-gradient* ``mean_i (W_sync - W_local,i)``, is the gradient of an outer SGD
step with Nesterov momentum on ``W_sync`` (``torch.optim.SGD``; DiLoCo's defaults: learning rate
0.7, momentum 0.9, Nesterov). The inner optimizer and its state stay per worker. ``outer="average"``
(default) is SBC's plain average; ``outer="sgd"`` with ``outer_lr=1`` and ``outer_momentum=0`` gives
the same weights bit for bit.

Streaming (Douillard et al., "Streaming DiLoCo with overlapping communication", 2025): with
``fragments = F > 1`` the parameters are cut into ``F`` fragments of equal size (by element count,
:func:`split_into_fragments`), and fragment ``f`` is exchanged on the local steps ``t`` with
``t % delay == (f + 1) * delay // F % delay`` (torchft's ``fragment_sync_offset``): every fragment
still waits ``delay`` steps between its exchanges, so the bytes per ``delay`` steps are unchanged,
but they are spread over ``F`` exchanges instead of one burst, and the peak bandwidth falls by
``F``. The outer optimizer steps only the exchanged fragment. ``fragment_split`` says how the
parameters are cut:

* ``"strided"`` (default; the paper's strided pattern): the parameters, flattened in
  :meth:`torch.nn.Module.named_parameters` order, are cut into ``F * ceil(N / F)`` blocks of equal
  size (``N`` trainable parameter tensors, so a block is about an average tensor), and block ``b``
  goes to fragment ``b % F``: every fragment holds pieces from every depth of the network, as the
  paper's fragments hold every ``F``-th transformer block.
* ``"contiguous"``: ``F`` consecutive ranges of equal size (the paper's sequential pattern).

Either way a cut that falls near a boundary between parameters moves onto it, so small tensors
stay whole; every fragment holds at most ``1.2 * total / F`` entries (up to one more per block; 1.00
to 1.12 times ``total / F`` on ResNet-8, -20 and -50 at 2 to 16 fragments), none is empty, and a
parameter that straddles a cut is exchanged in pieces (keyed ``name[start:stop]`` in the
compressor's state and the per-layer table; whole parameters keep their names). Where this departs
from the paper and torchft: they assign whole transformer blocks (torchft: the modules the user
passes), which are of equal size; a CNN's layers are not (ResNet-8's two largest convolutions
hold 98 % of its weights), so equal fragments must cut inside tensors. The exchange is blocking:
Streaming DiLoCo's overlap of an exchange with the next local steps (``tau > 0``) and its mixing
of local and synchronized weights (``alpha``) are not implemented, on gloo or NCCL. The paper's
4-bit outer gradients are a compressor (:class:`lgc.compressors.FP4Compressor`,
``experiment=streaming_diloco``).

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
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import bisect
import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.base import Compressor, compressor_chain
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.hook import CommStats, CompressionHookState, PendingBucket

__all__ = [
    "FRAGMENT_SPLITS",
    "OUTER_OPTIMIZERS",
    "CommunicationDelayState",
    "FragmentSlice",
    "local_step_hook",
    "register_communication_delay",
    "split_into_fragments",
]

#: ``outer`` choices: SBC's plain average, or DiLoCo's outer SGD on the pseudo-gradient.
OUTER_OPTIMIZERS = ("average", "sgd")
#: DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023, Sec. 3).
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9
#: ``fragment_split`` choices (the module docstring); the first is the default.
FRAGMENT_SPLITS = ("strided", "contiguous")


class FragmentSlice(NamedTuple):
    """Entries ``start:stop`` of parameter ``name`` (flattened), exchanged with fragment ``fragment``."""

    name: str
    start: int
    stop: int
    fragment: int
    #: Whether the slice is the whole parameter (its key is then the parameter's name).
    whole: bool

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> str:
        """The slice's name in the compressor's state, the synchronized weights and the per-layer table."""
        return self.name if self.whole else f"{self.name}[{self.start}:{self.stop}]"


class CommunicationDelayState:
    """Local SGD with compressed weight-update exchanges every ``delay`` steps.

    Args:
        compressor: applied to each parameter's weight update, e.g.
            ``ErrorFeedback(SBCCompressor(density=0.01))``.
        delay: local steps between exchanges (SBC: 1 to 100s; longer delays save bytes linearly
            but let workers drift apart, which costs accuracy on non-IID data).
        min_numel: parameters (or fragment pieces) with fewer elements exchange their update dense
            (``None``: the method's own, as :class:`~lgc.ddp.CompressionHookState`: every parameter
            for SparseLoCo).
        process_group: group to communicate in (default: the world).
        outer: ``"average"`` (SBC: ``W_sync += mean(dW)``) or ``"sgd"`` (DiLoCo: an outer SGD step
            with Nesterov momentum on the pseudo-gradient ``-mean(dW)``).
        outer_lr: the outer learning rate (``outer="sgd"`` only; default 0.7, DiLoCo's).
        outer_momentum: the outer Nesterov momentum in ``[0, 1)`` (``outer="sgd"`` only; default
            0.9, DiLoCo's; 0 is plain SGD).
        fragments: Streaming DiLoCo's fragments, exchanged on staggered steps (1: every parameter at
            once, every ``delay`` steps). At most ``delay`` (each fragment its own step) and at most
            the number of trainable entries (checked at :meth:`register`).
        fragment_split: how the parameters are cut into fragments of equal size: ``"strided"``
            (default, the paper's) or ``"contiguous"`` (see the module docstring).

    Call :meth:`after_optimizer_step` after every ``optimizer.step()`` (the Lightning callback
    does). Checkpoints must hold every rank's :meth:`state_dict`: between exchanges the workers'
    weights and buffers differ. Evaluate inside :meth:`global_model`.
    """

    #: Which model evaluation sees (``summary.json``'s ``eval_model``): the synchronized one.
    eval_model = "global"

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
        "module",  # the wrapped model (per process, not saved)
        "buffer_sync",  # the buffers averaged at exchanges (lgc.ddp.buffers.BufferSync), set by register(); per process
        "pending",  # a loaded state waiting for register()
        "outer_optimizer",  # torch.optim.SGD over the synchronized weights (outer="sgd"), built at register()
    )

    def __init__(
        self,
        compressor: Compressor,
        *,
        delay: int,
        min_numel: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        outer: str = "average",
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        fragments: int = 1,
        fragment_split: str = FRAGMENT_SPLITS[0],
    ) -> None:
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 1:
            raise ValueError(f"delay must be a positive number of local steps, got {delay!r}")
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
        lr = DILOCO_OUTER_LR if outer_lr is None else outer_lr
        momentum = DILOCO_OUTER_MOMENTUM if outer_momentum is None else outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        for inner in compressor_chain(compressor):
            if float(getattr(inner, "weight_decay", 0.0) or 0.0) != 0.0:
                raise ValueError(
                    f"delay={delay} exchanges weight updates, which the local optimizer's weight decay already "
                    f"shaped; {type(inner).__name__}'s weight_decay={inner.weight_decay!r} would decay them again: "
                    "set the compressor's weight_decay=0 and keep the decay in the optimizer"
                )
        self.delay = delay
        self.outer = outer
        self.outer_lr = float(lr)
        self.outer_momentum = float(momentum)
        self.fragments = fragments
        self.fragment_split = fragment_split
        self.slices: tuple[FragmentSlice, ...] = ()
        self.outer_optimizer: torch.optim.SGD | None = None
        self.exchange_state = CompressionHookState(
            compressor, min_numel=min_numel, start_iter=0, process_group=process_group
        )
        self.local_steps = 0
        self.synced: dict[str, Tensor] = {}
        self.synced_buffers: dict[str, Tensor] = {}
        self.module: nn.Module | None = None
        self.buffer_sync: module_buffers.BufferSync | None = None
        self.pending: dict[str, Any] | None = None

    # The interface lgc's strategy and callbacks use (shared with CompressionHookState).
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

    def register(self, model: DistributedDataParallel) -> None:
        """Register :func:`local_step_hook` on ``model`` and remember its synchronized weights and buffers.

        DDP's broadcast of rank 0's buffers before forward passes is turned off
        (:func:`lgc.ddp.buffers.keep_buffers_local`): the buffers are averaged at exchanges instead.
        """
        self.module = model.module
        # The compressor learns the parameters' names and shapes (DeMo and chunked top-k tile by shape).
        self.exchange_state.attach(model)
        self.slices = split_into_fragments(
            [(name, p.numel()) for name, p in self._named_parameters()], self.fragments, self.fragment_split
        )
        with torch.no_grad():
            if self.pending is not None:
                self._restore(self.pending)
                self.pending = None
            else:
                params = dict(self._named_parameters())
                self.synced = {s.key: _read(params[s.name], s).clone() for s in self.slices}
                self.synced_buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
                self._build_outer_optimizer()
        self.buffer_sync = module_buffers.keep_buffers_local(model)
        model.register_comm_hook(self, local_step_hook)

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
        update = torch.cat([(_read(params[s.name], s) - self.synced[s.key]).reshape(-1) for s in pieces])
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
                _write(params[s.name], s, self.synced[s.key])
            if with_buffers:
                self._restore_synced_buffers()
            self.stats.skipped_steps += 1
            return
        self.exchange_state.compress_step(pending, verdict.used, exchange)
        for s, segment in zip(pieces, segments, strict=True):
            synced = self.synced[s.key]
            averaged = update[segment.offset : segment.offset + segment.numel].view_as(synced)
            if self.outer_optimizer is None:
                synced += averaged
            else:
                synced.grad = averaged.neg()  # the pseudo-gradient: mean of W_sync - W_local
        if self.outer_optimizer is not None:
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
        for s in pieces:
            _write(params[s.name], s, self.synced[s.key])
        if with_buffers:
            self._average_buffers(world_size)

    def _average_buffers(self, world_size: int) -> None:
        """Every worker's floating-point buffers averaged (a counted allreduce); all continue from the average.

        Integer buffers (BatchNorm's ``num_batches_tracked``) count forward passes, the same on every
        rank: they stay as they are. An average that is not finite (a rank's statistics overflowed)
        is not taken: every rank returns to the last averaged buffers instead.
        """
        assert self.module is not None and self.buffer_sync is not None
        floating = [b for b in self.buffer_sync.buffers(self.module) if b.is_floating_point()]
        finite = module_buffers.average_buffers(self.stats, floating, world_size, self.process_group)
        if not finite:
            self._restore_synced_buffers()
            return
        self.synced_buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}

    def _restore_synced_buffers(self) -> None:
        assert self.module is not None
        for name, buffer in self.module.named_buffers():
            buffer.copy_(self.synced_buffers[name])

    @contextlib.contextmanager
    def global_model(self) -> Iterator[nn.Module]:
        """The synchronized model in the wrapped module for the ``with`` block; the local one back after it.

        Inside, every parameter holds its fragments' last synchronized weights and every buffer the
        value of the last buffer average (the initial ones before any exchange): the model all
        workers agree on, which DiLoCo and its successors evaluate. On leaving, this worker's local
        weights and buffers are copied back bit for bit; the optimizer's state and the random
        generators are not touched, so training continues as if nothing had been evaluated.

        Example::

            >>> with state.global_model() as model:
            ...     accuracy = evaluate(model)
        """
        assert self.module is not None, "call register(model) first"
        params = dict(self._named_parameters())
        local = {name: p.detach().clone() for name, p in params.items()}
        local_buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        try:
            with torch.no_grad():
                for s in self.slices:
                    _write(params[s.name], s, self.synced[s.key])
                self._restore_synced_buffers()
            yield self.module
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(local[name])
                for name, buffer in self.module.named_buffers():
                    buffer.copy_(local_buffers[name])

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: compressor state, counters, synchronized and local weights and buffers."""
        module = self.module
        local = {name: p.detach().cpu().clone() for name, p in self._named_parameters()} if module else {}
        buffers = {name: b.detach().cpu().clone() for name, b in module.named_buffers()} if module else {}
        return {
            "exchange": self.exchange_state.state_dict(),
            "local_steps": self.local_steps,
            "fragments": self.fragments,
            "fragment_split": self.fragment_split,
            "synced": {key: t.detach().cpu().clone() for key, t in self.synced.items()},
            "synced_buffers": {name: t.detach().cpu().clone() for name, t in self.synced_buffers.items()},
            # Between exchanges every rank has its own weights and buffers; the model checkpoint holds rank 0's.
            "local_weights": local,
            "local_buffers": buffers,
            "outer_optimizer": None if self.outer_optimizer is None else self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exchange_state.load_state_dict(state["exchange"])
        saved_fragments = int(state.get("fragments", 1))  # absent before fragments existed
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
        saved_outer = state.get("outer_optimizer")  # absent before the outer optimizer existed
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
            "module": None,
            "buffer_sync": None,
            "pending": self.pending,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)


def _read(param: Tensor, piece: FragmentSlice) -> Tensor:
    """The weights of ``piece`` (a view where possible): the parameter, or entries of it flattened."""
    if piece.whole:
        return param.detach()
    return param.detach().reshape(-1)[piece.start : piece.stop]


def _write(param: Tensor, piece: FragmentSlice, values: Tensor) -> None:
    """Copy ``values`` into the entries of ``param`` that ``piece`` covers."""
    if piece.whole:
        param.copy_(values)
    elif param.is_contiguous():
        param.view(-1)[piece.start : piece.stop].copy_(values.reshape(-1))
    else:  # channels_last and other strided layouts: no flat view to write through
        flat = param.detach().reshape(-1).clone()
        flat[piece.start : piece.stop] = values.reshape(-1)
        param.copy_(flat.view_as(param))


def split_into_fragments(
    numels: list[tuple[str, int]], fragments: int, split: str = FRAGMENT_SPLITS[0]
) -> tuple[FragmentSlice, ...]:
    """Cut parameters (name, numel; in model order) into ``fragments`` fragments of equal size.

    The parameters, flattened one after the other, are cut into blocks of equal size (whole
    entries: sizes differ by at most one) and block ``b`` goes to fragment ``b % fragments``:
    ``fragments`` blocks for ``split="contiguous"``, ``fragments * ceil(N / fragments)`` for
    ``"strided"`` (``N = len(numels)``; fewer when the model has fewer entries). A cut that falls
    within a tenth of a block of a boundary between parameters moves onto it, so small tensors
    (biases, norm layers) stay whole. A fragment then holds at most ``1.2 * total / fragments``
    entries (1.00 to 1.12 times it on ResNet-8, -20 and -50 at 2 to 16 fragments), and none is empty.

    Returns:
        The pieces in parameter order; a parameter inside one block is one whole piece.

    Raises:
        ValueError: an unknown ``split``, or fewer trainable entries than ``fragments``.
    """
    if split not in FRAGMENT_SPLITS:
        raise ValueError(f"fragment_split must be one of {FRAGMENT_SPLITS}, got {split!r}")
    total = sum(numel for _, numel in numels)
    if fragments > total:
        raise ValueError(
            f"fragments={fragments} is more than the model's {total} trainable entries: every fragment needs "
            "at least one"
        )
    per_fragment = 1 if split == "contiguous" else math.ceil(len(numels) / fragments)
    blocks = min(fragments * per_fragment, fragments * (total // fragments))
    # Block b holds the entries bounds[b]:bounds[b + 1] of the flattened parameters. A cut within a
    # tenth of a block of a boundary between parameters moves onto it (small tensors stay whole);
    # blocks then differ from total / blocks by at most a fifth, and none becomes empty.
    bounds = [block * total // blocks for block in range(blocks + 1)]
    edges = list(itertools.accumulate(numel for _, numel in numels))
    slack = total // (10 * blocks)
    for block in range(1, blocks):
        cut = bounds[block]
        index = bisect.bisect_left(edges, cut)
        nearest = min(edges[max(0, index - 1) : index + 1], key=lambda edge: abs(edge - cut))
        if abs(nearest - cut) <= slack and bounds[block - 1] < nearest < bounds[block + 1]:
            bounds[block] = nearest
    pieces: list[FragmentSlice] = []
    offset = 0
    for name, numel in numels:
        end, position = offset + numel, offset
        while True:
            block = min(bisect.bisect_right(bounds, position) - 1, blocks - 1)
            stop = min(end, bounds[block + 1])
            start, fragment = position - offset, block % fragments
            if pieces and pieces[-1].name == name and pieces[-1].fragment == fragment:
                start = pieces.pop().start  # consecutive blocks of one fragment (fragments == 1): one piece
            pieces.append(FragmentSlice(name, start, stop - offset, fragment, start == 0 and stop == end))
            if stop >= end:
                break
            position = stop
        offset = end
    return tuple(pieces)


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


def register_communication_delay(
    model: DistributedDataParallel, compressor: Compressor, *, delay: int, min_numel: int | None = None
) -> CommunicationDelayState:
    """Make ``model`` train with local steps and a compressed weight-update exchange every ``delay`` steps.

    Prefer ``lgc.compress(model, "sbc", optimizer=optimizer, delay=4)``: it calls
    :meth:`CommunicationDelayState.after_optimizer_step` after every ``optimizer.step()`` and
    raises on a missed or doubled call, where this function leaves both to the caller.

    Example::

        >>> state = register_communication_delay(model, ErrorFeedback(SBCCompressor(0.01)), delay=4)
        >>> for batch in loader:
        ...     loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        ...     state.after_optimizer_step()
    """
    state = CommunicationDelayState(compressor, delay=delay, min_numel=min_numel)
    state.register(model)
    return state
