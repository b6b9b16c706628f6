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
``fragments = F > 1`` the parameters are cut into ``F`` fragments of consecutive parameters of
about equal size (in :meth:`torch.nn.Module.named_parameters` order, every fragment at least one
parameter), and fragment ``f`` is exchanged on the local steps ``t`` with
``t % delay == (f + 1) * delay // F % delay``: every fragment still waits ``delay`` steps between
its exchanges, so the bytes per ``delay`` steps are unchanged, but they are spread over ``F``
exchanges instead of one burst, and the peak bandwidth falls by ``F``. The outer optimizer steps
only the exchanged fragment. The exchange is blocking: Streaming DiLoCo's overlap of an exchange
with the next local steps (``tau > 0``) is not implemented, on gloo or NCCL.

Steps:
1. The DDP hook :func:`local_step_hook` returns each worker's own gradient untouched (no bytes).
2. After every optimizer step, :meth:`CommunicationDelayState.after_optimizer_step` counts local
   steps; on every ``delay``-th it averages the weight updates through the gradient hook's step
   guard and exchange (:meth:`lgc.ddp.CompressionHookState.agree` and ``compress_step``: the same
   collectives and byte accounting) and moves every worker to the new synchronized weights.

Non-finite values: a local step whose gradient overflows is the optimizer's (or GradScaler's)
to skip, as without lgc. If a rank's weight update is nevertheless inf/NaN at an exchange, every
rank skips that exchange (counted in ``stats.skipped_steps``), returns to the last synchronized
weights and keeps its residuals as they were. Parameters whose update is zero on every rank are
not sent.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.base import Compressor, compressor_chain
from lgc.ddp import collectives as counted
from lgc.ddp.hook import CommStats, CompressionHookState, PendingBucket

__all__ = [
    "OUTER_OPTIMIZERS",
    "CommunicationDelayState",
    "local_step_hook",
    "register_communication_delay",
    "split_into_fragments",
]

#: ``outer`` choices: SBC's plain average, or DiLoCo's outer SGD on the pseudo-gradient.
OUTER_OPTIMIZERS = ("average", "sgd")
#: DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023, Sec. 3).
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9


class CommunicationDelayState:
    """Local SGD with compressed weight-update exchanges every ``delay`` steps.

    Args:
        compressor: applied to each parameter's weight update, e.g.
            ``ErrorFeedback(SBCCompressor(density=0.01))``.
        delay: local steps between exchanges (SBC: 1 to 100s; longer delays save bytes linearly
            but let workers drift apart, which costs accuracy on non-IID data).
        min_numel: parameters with fewer elements exchange their update dense (``None``: the
            method's own, as :class:`~lgc.ddp.CompressionHookState`: every parameter for SparseLoCo).
        process_group: group to communicate in (default: the world).
        outer: ``"average"`` (SBC: ``W_sync += mean(dW)``) or ``"sgd"`` (DiLoCo: an outer SGD step
            with Nesterov momentum on the pseudo-gradient ``-mean(dW)``).
        outer_lr: the outer learning rate (``outer="sgd"`` only; default 0.7, DiLoCo's).
        outer_momentum: the outer Nesterov momentum in ``[0, 1)`` (``outer="sgd"`` only; default
            0.9, DiLoCo's; 0 is plain SGD).
        fragments: Streaming DiLoCo's fragments, exchanged on staggered steps (1: every parameter at
            once, every ``delay`` steps). At most ``delay`` (each fragment its own step) and at most
            the number of trainable parameters (checked at :meth:`register`).

    Call :meth:`after_optimizer_step` after every ``optimizer.step()`` (the Lightning callback
    does). Checkpoints must hold every rank's :meth:`state_dict`: between exchanges the workers'
    weights differ.
    """

    __slots__ = (
        # hyperparameters
        "delay",
        "outer",
        "outer_lr",
        "outer_momentum",
        "fragments",
        # internal state
        "exchange_state",  # compressor, byte statistics and collectives, shared with the gradient hook
        "local_steps",  # optimizer steps taken; an exchange follows every delay-th
        "fragment_of",  # name -> its fragment (built at register())
        "synced",  # name -> weights after the last exchange (identical on every rank)
        "module",  # the wrapped model (per process, not saved)
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
    ) -> None:
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 1:
            raise ValueError(f"delay must be a positive number of local steps, got {delay!r}")
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= delay:
            raise ValueError(
                f"fragments must be an integer from 1 to delay={delay} (each fragment is exchanged on a step of its "
                f"own), got {fragments!r}"
            )
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
        self.fragment_of: dict[str, int] = {}
        self.outer_optimizer: torch.optim.SGD | None = None
        self.exchange_state = CompressionHookState(
            compressor, min_numel=min_numel, start_iter=0, process_group=process_group
        )
        self.local_steps = 0
        self.synced: dict[str, Tensor] = {}
        self.module: nn.Module | None = None
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
            text += f" in {self.fragments} staggered fragments"
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
        """Register :func:`local_step_hook` on ``model`` and remember its synchronized weights."""
        self.module = model.module
        # The compressor learns the parameters' names and shapes (DeMo and chunked top-k tile by shape).
        self.exchange_state.attach(model)
        self.fragment_of = split_into_fragments(
            [(name, p.numel()) for name, p in self._named_parameters()], self.fragments
        )
        with torch.no_grad():
            if self.pending is not None:
                self._restore(self.pending)
                self.pending = None
            else:
                self.synced = {name: p.detach().clone() for name, p in self._named_parameters()}
                self._build_outer_optimizer()
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
            self._exchange([(n, p) for n, p in self._named_parameters() if self.fragment_of[n] == fragment], number)
        return bool(due)

    def _exchange(self, named: list[tuple[str, nn.Parameter]], exchange: int) -> None:
        """Average the weight updates of ``named`` (a fragment, or every parameter) and apply the outer step."""
        world_size = dist.get_world_size(self.process_group)
        update = torch.cat([(p - self.synced[name]).reshape(-1) for name, p in named]).div_(world_size)
        segments = self.exchange_state.segments([(name, p.numel()) for name, p in named])
        # The hook's step guard, applied to the weight update: every rank agrees whether some
        # rank's weights went non-finite (a local step without a GradScaler to skip it) and which
        # parameters did not move anywhere.
        pending = [PendingBucket(update, segments, torch.futures.Future())]
        verdict = self.exchange_state.agree(pending)
        if verdict.skip:
            # A rank's update is inf/NaN: no average can use it. Every rank returns to the last
            # synchronized weights, and the residuals stay as they were.
            for name, param in named:
                param.copy_(self.synced[name])
            self.stats.skipped_steps += 1
            return
        self.exchange_state.compress_step(pending, verdict.used, exchange)
        for (name, _), segment in zip(named, segments, strict=True):
            synced = self.synced[name]
            averaged = update[segment.offset : segment.offset + segment.numel].view_as(synced)
            if self.outer_optimizer is None:
                synced += averaged
            else:
                synced.grad = averaged.neg()  # the pseudo-gradient: mean of W_sync - W_local
        if self.outer_optimizer is not None:
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
        for name, param in named:
            param.copy_(self.synced[name])

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: compressor state, counters, synchronized and local weights."""
        local = {name: p.detach().cpu().clone() for name, p in self._named_parameters()} if self.module else {}
        return {
            "exchange": self.exchange_state.state_dict(),
            "local_steps": self.local_steps,
            "fragments": self.fragments,
            "synced": {name: t.detach().cpu().clone() for name, t in self.synced.items()},
            # Between exchanges every rank has its own weights; the model checkpoint holds rank 0's.
            "local_weights": local,
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
        self.local_steps = int(state["local_steps"])
        if self.module is None:
            self.pending = state
        else:
            with torch.no_grad():
                self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        params = dict(self._named_parameters())
        self.synced = {name: t.to(params[name].device).clone() for name, t in state["synced"].items()}
        for name, weights in state["local_weights"].items():
            params[name].copy_(weights)
        self._build_outer_optimizer()
        saved = state.get("outer_optimizer")  # absent before the outer optimizer existed
        if (saved is None) != (self.outer_optimizer is None):
            raise ValueError(
                f"the checkpoint was written with outer={'average' if saved is None else 'sgd'!r}, "
                f"this run has outer={self.outer!r}"
            )
        if self.outer_optimizer is not None:
            self.outer_optimizer.load_state_dict(saved)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "delay": self.delay,
            "outer": self.outer,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "fragments": self.fragments,
            "fragment_of": {},
            "outer_optimizer": None,
            "exchange_state": self.exchange_state,
            "local_steps": self.local_steps,
            "synced": {},
            "module": None,
            "pending": self.pending,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)


def split_into_fragments(numels: list[tuple[str, int]], fragments: int) -> dict[str, int]:
    """Each parameter's fragment: consecutive parameters, fragments of about equal size, none empty.

    A parameter goes to the fragment its first element falls in when the total is cut into
    ``fragments`` equal parts, moved up or down so that every fragment keeps at least one parameter.
    """
    if fragments > len(numels):
        raise ValueError(
            f"fragments={fragments} is more than the model's {len(numels)} trainable parameters: "
            "every fragment needs at least one"
        )
    total = max(1, sum(numel for _, numel in numels))
    assigned: dict[str, int] = {}
    before, previous = 0, 0
    for index, (name, numel) in enumerate(numels):
        share = min(fragments - 1, before * fragments // total)
        # never skip a fragment, and leave one parameter for each fragment still to come
        fragment = max(min(share, previous + 1), previous, fragments - (len(numels) - index))
        assigned[name] = previous = fragment
        before += numel
    return assigned


def local_step_hook(state: CommunicationDelayState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Leave each worker's gradient local (the delay's local steps); count what dense DDP would send."""
    buffer = bucket.buffer()
    state.stats.hook_calls += 1
    counted.book_dense_equivalent(state.stats, buffer, state.process_group)
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
