"""PyTorch's own communication hooks (fp16, bf16, PowerSGD), wrapped with lgc's statistics.

The hooks themselves are PyTorch's (``torch.distributed.algorithms.ddp_comm_hooks``), not
rewritten. The wrapper adds what the rest of ``lgc`` expects from a hook state: byte counts of
what the hook passes to the collectives, hook calls, ``state_dict`` for checkpoints, and a fixed
collective order. The bytes are booked after each bucket from what the hook sent, without
intercepting its collectives: the bucket in the hook's wire dtype (fp16, bf16, or as it is), or,
for a bucket PowerSGD compressed, its own ``P`` and ``Q`` (the state's ``p_memory_dict`` and
``q_memory_dict``) and the tensors it sent uncompressed (their element count is the growth of the
state's ``total_numel_after_compression`` less ``P`` and ``Q``, by PyTorch's own compression
statistics). PowerSGD issues its second allreduce from a ``Future.then`` callback, which on
gloo can reach the backend in a different order on each rank when several buckets are in flight;
the wrapper therefore waits for each bucket's future inside the hook, so every rank finishes one
bucket's collectives before it starts the next (this costs the overlap of communication with the
rest of the backward pass; NCCL users who want the overlap can register PyTorch's hook directly).

Non-finite gradients: the stateless hooks (fp16, bf16, allreduce) pass an inf or NaN through their
sum, and the wrapper counts the step in ``stats.skipped_steps``. PowerSGD keeps state (error
feedback, warm-started ``Q``), so it runs behind lgc's step guard (:mod:`lgc.ddp.step_guard`): the buckets
are held until the step's last one; if any rank has an inf or NaN, every bucket is allreduced
dense and unchanged (so the optimizer or GradScaler skips the step everywhere), PyTorch's hook is
not called, and its state, step counter included, stays as it was. PowerSGD's own state, checkpoints
and fixes are :mod:`lgc.ddp.powersgd`.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.protocol import HookState
from lgc.ddp.step_guard import agree_flags, all_finite, allreduce_as_they_are, finite_flag, run_holding

__all__ = ["TorchHookState", "book_all_reduce_of"]


_HOOKS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "allreduce": default_hooks.allreduce_hook,
}
#: The dtype each stateless hook allreduces the bucket in (None: the bucket's own).
_WIRE_DTYPES: dict[str, torch.dtype | None] = {"fp16": torch.float16, "bf16": torch.bfloat16, "allreduce": None}


def book_all_reduce_of(stats: CommStats, numel: int, dtype: torch.dtype, group: Any) -> None:
    """Book an allreduce of ``numel`` elements of ``dtype`` (a meta tensor stands for it: nothing is allocated)."""
    counted.book_all_reduce(stats, torch.empty(numel, dtype=dtype, device="meta"), group)


class TorchHookState(HookState):
    """Runs one of PyTorch's stateless hooks (``fp16``, ``bf16``, ``allreduce``) with lgc statistics.

    Args:
        hook: ``"fp16"`` (``fp16_compress_hook``), ``"bf16"`` (``bf16_compress_hook``) or
            ``"allreduce"`` (PyTorch's reference hook, dense fp32).
    """

    #: Whether steps run behind the step guard (PowerSGD, which keeps state); see the module docstring.
    guards_steps = False
    #: The module buffers kept in step (:class:`lgc.ddp.buffers.BufferSync`), set by :meth:`register`.
    buffer_sync: module_buffers.BufferSync | None = None
    #: How module buffers are kept in step (:data:`lgc.ddp.buffers.BUFFER_MODES`; ``comm.buffers``).
    buffers: str = module_buffers.BROADCAST

    def __init__(self, hook: str = "fp16") -> None:
        if hook not in _HOOKS:
            raise ValueError(f"unknown PyTorch hook {hook!r}; choose one of {sorted(_HOOKS)}")
        self.hook_name = hook
        self.stats = CommStats()
        self.process_group: dist.ProcessGroup | None = None
        self._reset_step()

    def _reset_step(self) -> None:
        # Per step, per process: the buckets held by the step guard, and whether a non-finite
        # result was already counted in this step.
        self._pending: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self._step_counted = False

    # The HookState interface (lgc.ddp.protocol); the rest keeps the protocol's defaults.
    def describe(self) -> str:
        return f"torch:{self.hook_name}"

    @property
    def overlaps_backward(self) -> bool:
        """PyTorch's hooks run bucket by bucket, unless the step guard holds the buckets (PowerSGD)."""
        return not self.guards_steps

    def _inner_state(self) -> Any:
        return self.process_group

    def _inner_hook(self) -> Callable[..., Any]:
        return _HOOKS[self.hook_name]

    def _hook_context(self) -> contextlib.AbstractContextManager[None]:
        """Entered around each call of the inner hook (and the wait for its collectives)."""
        return contextlib.nullcontext()

    def _book_bucket(self, bucket: dist.GradBucket, numel: int, dtype: torch.dtype) -> None:
        """Book what the inner hook sent for ``bucket`` (``numel`` elements of ``dtype`` before it ran)."""
        book_all_reduce_of(self.stats, numel, _WIRE_DTYPES[self.hook_name] or dtype, self.process_group)

    def _after_bucket(self, bucket: dist.GradBucket) -> None:
        """Called once the inner hook has finished ``bucket`` (all of its collectives done)."""

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Register the wrapped hook; module buffers go from rank 0 once per step, counted (:mod:`lgc.ddp.buffers`)."""
        self.buffer_sync = module_buffers.register_comm_hook(model, self, _wrapped_torch_hook, self.buffers)

    def state_dict(self) -> dict[str, Any]:
        return {"stats": vars(self.stats).copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = CommStats(**state["stats"])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "process_group": None, "_pending": [], "_step_counted": False}


def _run_inner(state: TorchHookState, bucket: dist.GradBucket) -> Tensor:
    """PyTorch's hook on one bucket, its collectives finished before the next bucket's start."""
    # Before the hook: the batched PowerSGD hook resizes the buffer to a square.
    numel, dtype = bucket.buffer().numel(), bucket.buffer().dtype
    with state._hook_context():
        future = state._inner_hook()(state._inner_state(), bucket)
        # Finish this bucket's collectives (including those issued from its callbacks) now, so
        # the collective order is identical on every rank.
        result = future.wait()
    state._book_bucket(bucket, numel, dtype)
    state._after_bucket(bucket)
    return result


def _guarded_step(state: TorchHookState) -> None:
    """The step guard for a stateful PyTorch hook: agree on non-finite gradients, then run or pass through."""
    pending, state._pending = state._pending, []
    buffers = [bucket.buffer() for bucket, _ in pending]
    local = torch.stack([finite_flag(buffer) for buffer in buffers]).all()
    flag = agree_flags(state.stats, (~local).to(torch.uint8).reshape(1), state.process_group)
    if bool(flag[0]):
        # Some rank has an inf/NaN: plain DDP's average, unchanged; PyTorch's hook never sees the step.
        world_size = dist.get_world_size(state.process_group)
        allreduce_as_they_are(state.stats, [buffer.div_(world_size) for buffer in buffers], state.process_group)
        state.stats.skipped_steps += 1
        for (_, future), buffer in zip(pending, buffers, strict=True):
            future.set_result(buffer)
        return
    for bucket, future in pending:
        future.set_result(_run_inner(state, bucket))


def _wrapped_torch_hook(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.stats.hook_calls += 1
    buffer = bucket.buffer()
    counted.book_dense_equivalent(state.stats, buffer, state.process_group)
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    if state.guards_steps:
        # Held until the step's last bucket (DDP waits for the futures only at the end of backward).
        state._pending.append((bucket, done))
        if bucket.is_last():
            run_holding([future for _, future in state._pending], lambda: _guarded_step(state))
        return done
    result = _run_inner(state, bucket)
    # Stateless: an inf/NaN passes through the sum; count the step once.
    if not state._step_counted and not all_finite(result):
        state._step_counted = True
        state.stats.skipped_steps += 1
    if bucket.is_last():
        state._step_counted = False
    done.set_result(result)
    return done
