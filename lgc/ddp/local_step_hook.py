"""The DDP hook of the local steps, its registration, and the checks that keep local steps honest.

Under :class:`~lgc.ddp.local_sgd.CommunicationDelayState` the DDP hook (:func:`local_step_hook`)
leaves every worker's gradient local and only counts what plain DDP would have sent; the exchange
runs after optimizer steps (:meth:`~lgc.ddp.local_sgd.CommunicationDelayState.after_optimizer_step`).
:class:`LocalStepCheck` makes a forgotten or doubled call of it raise at the next forward pass,
before the weights are used; :func:`checked_exchange` refuses an exchange state that cannot serve
local steps, before any worker starts.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.hook import CompressionHookState

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from lgc.compressors.base import Compressor
    from lgc.ddp.local_sgd import CommunicationDelayState

__all__ = [
    "LocalStepCheck",
    "checked_exchange",
    "checked_local_step_hook",
    "local_step_exchange",
    "local_step_hook",
    "register_communication_delay",
]


def local_step_hook(state: "CommunicationDelayState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
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


class LocalStepCheck:
    """Makes a forgotten or doubled ``after_optimizer_step()`` loud in communication-delay mode.

    Between two synchronized backward passes (those that reach the DDP hook) the optimizer steps
    once, so ``after_optimizer_step()`` must run exactly once: never, and the workers never
    exchange and drift apart; twice, and they exchange at the wrong steps. The count is checked
    at the next forward pass with gradients, before it uses the weights.
    """

    __slots__ = ("state", "automatic", "backward_passes", "checked_passes", "steps_at_backward")

    def __init__(self, state: "CommunicationDelayState", automatic: bool) -> None:
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
                "backward passes per step? Run all but the last under model.no_sync(), or under FSDP2 after "
                "model.set_requires_gradient_sync(False).)"
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


def checked_local_step_hook(check: LocalStepCheck, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`local_step_hook`, counting finished backward passes for the check."""
    future = local_step_hook(check.state, bucket)
    if bucket.is_last():
        check.backward_done()
    return future


def local_step_exchange(
    compressor: "Compressor", *, min_numel: int | None = None, process_group: dist.ProcessGroup | None = None
) -> CompressionHookState:
    """The hook state that exchanges ``compressor``'s pseudo-gradients under local steps (``start_iter`` 0).

    The builder (:func:`lgc.methods.build_hook_state`) and :func:`register_communication_delay` wrap a
    compressor with it; communication delay itself builds none.
    """
    return CompressionHookState(compressor, min_numel=min_numel, start_iter=0, process_group=process_group)


def register_communication_delay(
    model: "DistributedDataParallel", compressor: "Compressor", *, delay: int, min_numel: int | None = None
) -> "CommunicationDelayState":
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
    from lgc.ddp.local_sgd import CommunicationDelayState  # it registers with this module's hook

    state = CommunicationDelayState(local_step_exchange(compressor, min_numel=min_numel), delay=delay)
    state.register(model)
    return state


def checked_exchange(exchange_state: CompressionHookState, delay: int, fragments: int) -> CompressionHookState:
    """``exchange_state``, refused where it cannot exchange the pseudo-gradients of local steps."""
    if not isinstance(exchange_state, CompressionHookState):
        raise TypeError(
            f"communication delay exchanges through a built CompressionHookState (or an LGC-family state), got "
            f"{type(exchange_state).__name__}: wrap a compressor as CompressionHookState(compressor, start_iter=0), "
            "or use lgc.compress(model, method, delay=...)"
        )
    what = type(exchange_state).__name__
    if exchange_state.start_iter != 0:
        raise ValueError(
            f"{what} has start_iter={exchange_state.start_iter}: plain-allreduce iterations do not apply to local "
            "steps, whose exchanges compress from the first: build it with start_iter=0"
        )
    if fragments != 1 and exchange_state.codes_whole_parameters:
        raise ValueError(
            f"fragments={fragments} cuts parameters into pieces; {what} codes whole parameters (its leader's "
            "positions and residuals are keyed by parameter): use fragments=1"
        )
    if exchange_state.overlap:
        raise ValueError(
            f"{what} was built with overlap=True; an exchange after the optimizer step has no backward pass to overlap"
        )
    decay = exchange_state.compressor.own_weight_decay
    if decay != 0.0:
        raise ValueError(
            f"delay={delay} exchanges weight updates, which the local optimizer's weight decay already "
            f"shaped; the compressor's own weight_decay={decay!r} would decay them again: set the compressor's "
            "weight_decay=0 and keep the decay in the optimizer"
        )
    return exchange_state
