"""Module buffers (BatchNorm's running statistics) across workers, once per step, with every byte counted.

DDP keeps buffers in step itself (``broadcast_buffers``, ``forward_sync_buffers`` in newer torch;
on by default): it broadcasts rank 0's buffers before a forward pass, every training forward and
the first forward after one (an evaluation's first batch), one coalesced broadcast per dtype that
no gradient hook sees, so lgc would not count it. Its schedule also follows the process's history
(no broadcast before the first training forward after an evaluation, one before a restarted
run's first forward), so a resumed run would not send what the run it continues would have.
lgc therefore turns DDP's broadcast off (a buffer hook that does nothing, DDP's
``_register_buffer_comm_hook``) and keeps the buffers in step itself, by method family:

* per-step methods (every lgc compressor, LGC, PyTorch's hooks; :func:`register_comm_hook`): at
  the end of every synchronized backward pass (the step's last bucket, after the gradient
  hook's own collectives) rank 0's buffers go to every rank, one broadcast per dtype of the
  flattened buffers through :func:`lgc.ddp.collectives.broadcast` (gloo: a binomial tree; NCCL:
  a ring; :mod:`lgc.ddp.wire`). Every forward then sees exactly the buffers DDP's broadcast would
  have given it (a BatchNorm forward only adds its batch's statistics to them, and backward
  passes leave them alone), evaluation included, and the bytes are counted per step in
  ``wire_bytes_sent`` and ``wire_buffer_bytes_sent``. The dense equivalent holds the same
  broadcast: plain DDP sends it once per training step too (and once more before each
  evaluation). A model built with ``broadcast_buffers=False`` keeps its buffers local: nothing is
  sent or booked.
* communication delay (:mod:`lgc.ddp.local_sgd`, :func:`keep_buffers_local`): nothing is sent
  between exchanges, so each worker's statistics follow its own local weights (DDP's broadcast
  would overwrite them with rank 0's before every local step); the method averages the
  floating-point buffers at its exchanges (:func:`average_buffers`, a counted allreduce). The
  dense equivalent books plain DDP's broadcast once per local step (:func:`book_dense_broadcast`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _BufferCommHookLocation

from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats

__all__ = [
    "AVERAGE_AT_EXCHANGE",
    "BROADCAST",
    "average_buffers",
    "book_dense_broadcast",
    "broadcast_buffers",
    "keep_buffers_local",
    "register_comm_hook",
    "synchronized_buffers",
]

#: ``summary.json``'s ``buffer_sync`` for the per-step methods: rank 0's buffers broadcast every step, counted.
BROADCAST = "broadcast"
#: ``buffer_sync`` for communication delay: local between exchanges, averaged at them, counted.
AVERAGE_AT_EXCHANGE = "average_at_exchange"


def _by_dtype(buffers: list[Tensor]) -> list[list[Tensor]]:
    """The buffers grouped by dtype and device, in order of first appearance (the same on every rank)."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for buffer in buffers:
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    return list(groups.values())


def synchronized_buffers(model: DistributedDataParallel) -> list[Tensor]:
    """The buffers DDP would broadcast: every buffer of the module but those it was told to ignore."""
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    return [buffer for name, buffer in model.module.named_buffers() if name not in ignored]


def book_dense_broadcast(stats: CommStats, buffers: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Plain DDP's broadcast of ``buffers`` from rank 0 (one per dtype), in the dense-equivalent figures."""
    for tensors in _by_dtype(buffers):
        numel = sum(t.numel() for t in tensors)
        first = tensors[0]
        counted.book_dense_broadcast(stats, torch.empty(numel, dtype=first.dtype, device=first.device), 0, group)


def broadcast_buffers(stats: CommStats, buffers: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Rank 0's ``buffers`` to every rank in place, one counted broadcast per dtype (blocking)."""
    for tensors in _by_dtype(buffers):
        flat = _flatten_dense_tensors(tensors)
        before = stats.wire_bytes_sent
        counted.broadcast(stats, flat, 0, group)
        stats.wire_buffer_bytes_sent += stats.wire_bytes_sent - before
        for buffer, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            buffer.copy_(synced)
    book_dense_broadcast(stats, buffers, group)


def _no_forward_broadcast(state: Any, named_buffers: dict[str, Tensor]) -> None:
    """DDP's buffer hook: nothing before forward passes (lgc keeps the buffers in step itself)."""


def _turn_off_forward_broadcast(model: DistributedDataParallel, state: Any) -> None:
    model._register_buffer_comm_hook(
        state, _no_forward_broadcast, comm_hook_location=_BufferCommHookLocation.PRE_FORWARD
    )


def _ddp_syncs_buffers(model: DistributedDataParallel) -> bool:
    """Whether the model was built to keep its buffers in step (DDP's default); torch 2.13 renamed the flag."""
    return bool(getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", True)))


def register_comm_hook(model: DistributedDataParallel, state: Any, hook: Callable[..., Any]) -> None:
    """``model.register_comm_hook(state, hook)``, and rank 0's buffers broadcast once per step, counted.

    The broadcast follows ``hook``'s call for the step's last bucket, after every collective the
    hook issued there (lgc's hooks issue theirs inside the call), so every rank issues it at the
    same point. DDP's own broadcast before forward passes is turned off.

    Args:
        model: the DDP model.
        state: the hook state (``state.stats`` counts, ``state.process_group`` is the group).
        hook: the DDP communication hook.
    """
    sync = _ddp_syncs_buffers(model)

    @functools.wraps(hook)
    def hook_then_buffers(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        if sync and bucket.is_last():
            buffers = synchronized_buffers(model)
            if buffers:
                with torch.no_grad():
                    broadcast_buffers(state.stats, buffers, state.process_group)
        return future

    model.register_comm_hook(state, hook_then_buffers)
    _turn_off_forward_broadcast(model, state)


def keep_buffers_local(model: DistributedDataParallel, state: Any) -> None:
    """Turn DDP's broadcast of rank 0's buffers off: the method averages them itself (:func:`average_buffers`)."""
    _turn_off_forward_broadcast(model, state)


def average_buffers(stats: CommStats, buffers: list[Tensor], world_size: int, group: dist.ProcessGroup | None) -> bool:
    """Replace every buffer by its mean over the group (one counted allreduce per dtype); blocking.

    Returns whether the mean is finite everywhere; if it is not, the buffers are left as they were
    (every rank sees the same mean, so every rank decides alike).
    """
    averaged = []
    for tensors in _by_dtype(buffers):
        flat = _flatten_dense_tensors(tensors).div_(world_size)
        before = stats.wire_bytes_sent
        counted.all_reduce(stats, flat, group).wait()
        stats.wire_buffer_bytes_sent += stats.wire_bytes_sent - before
        averaged.append((tensors, flat))
    if not all(bool(torch.isfinite(flat).all()) for _, flat in averaged):
        return False
    for tensors, flat in averaged:
        for buffer, mean in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            buffer.copy_(mean)
    return True
