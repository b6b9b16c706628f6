"""Module buffers (BatchNorm's running statistics) across workers, once per step, with every byte counted.

DDP keeps buffers in step itself (its ``broadcast_buffers`` flag, on by default): it broadcasts
rank 0's buffers before a forward pass, every training forward and the first forward after one
(an evaluation's first batch), one coalesced broadcast per dtype that no gradient hook sees, so
lgc would not count it. Its schedule also follows the process's history (no broadcast before the
first training forward after an evaluation, one before a restarted run's first forward), so a
resumed run would not send what the run it continues would have.

lgc therefore turns DDP's broadcast off when it registers its hook, by the flag every DDP forward
reads (``model.broadcast_buffers = False``; ``forward_sync_buffers`` in torch versions that have
it, where ``broadcast_buffers`` is a property over it), and keeps the buffers in step itself. Which
buffers, and whether any, follows DDP's own rule, the same for every method
(:class:`BufferSync`): every buffer of the module but those DDP was told to ignore
(``parameters_to_ignore``), and none at all for a model built with ``broadcast_buffers=False``
(``forward_sync_buffers=False``), whose workers keep their own buffers: nothing is sent or booked
then, and ``summary.json``'s ``buffer_sync`` says ``none``. How, by method family:

* per-step methods (every lgc compressor, LGC, PyTorch's hooks; :func:`register_comm_hook`): with
  every synchronized backward pass (the step's last bucket, before the gradient hook's call for
  it) rank 0's buffers go to every rank, one broadcast per dtype of the flattened buffers through
  :func:`lgc.ddp.collectives.broadcast` (gloo: a binomial tree; NCCL: a ring;
  :mod:`lgc.ddp.wire`). Every forward then sees exactly the buffers DDP's broadcast would have
  given it (a BatchNorm forward only adds its batch's statistics to them, and backward passes
  leave them alone), evaluation included, and the bytes are counted per step in
  ``wire_bytes_sent`` and ``wire_buffer_bytes_sent``, within the step they belong to (LGC's stage
  statistics book them with the step's gradients). The dense equivalent holds the same
  broadcast: plain DDP sends it once per training step too (and once more before each
  evaluation). ``buffer_sync``: ``broadcast``. With ``buffers="average"`` (``comm.buffers``) the
  floating-point buffers are averaged over the workers instead, at the same point, one counted
  allreduce per dtype (:func:`average_buffers`; the others, such as BatchNorm's batch counter,
  still broadcast from rank 0): on shards that differ in distribution (Dirichlet partitions), rank
  0's statistics describe rank 0's data only, and every rank would evaluate with them; averaged,
  they describe every worker's. The dense equivalent stays plain DDP's broadcast. ``buffer_sync``:
  ``average``.
* communication delay (:mod:`lgc.ddp.local_sgd`, :func:`keep_buffers_local`): nothing is sent
  between exchanges, so each worker's statistics follow its own local weights (DDP's broadcast
  would overwrite them with rank 0's before every local step); the method averages the
  floating-point buffers at its exchanges (:func:`average_buffers`, a counted allreduce). The
  dense equivalent books plain DDP's broadcast once per local step
  (:func:`book_dense_buffer_broadcast`). ``buffer_sync``: ``average_at_exchange``.

A buffer communication hook registered on the model (DDP's ``_register_buffer_comm_hook``) is
refused while DDP's broadcast is on: lgc's registration would silently stop it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats

__all__ = [
    "AVERAGE",
    "AVERAGE_AT_EXCHANGE",
    "BROADCAST",
    "BUFFER_MODES",
    "NO_SYNC",
    "BufferSync",
    "ExchangedBuffers",
    "average_buffers",
    "book_dense_buffer_broadcast",
    "average_step_buffers",
    "broadcast_buffers",
    "check_buffer_mode",
    "keep_buffers_local",
    "register_comm_hook",
]

#: ``summary.json``'s ``buffer_sync`` for the per-step methods: rank 0's buffers broadcast every step, counted.
BROADCAST = "broadcast"
#: ``buffer_sync`` for the per-step methods with ``buffers="average"``: every worker's floating-point
#: buffers averaged every step, counted.
AVERAGE = "average"
#: How a per-step method keeps module buffers in step (``comm.buffers``; the first is the default).
BUFFER_MODES = (BROADCAST, AVERAGE)
#: ``buffer_sync`` for communication delay: local between exchanges, averaged at them, counted.
AVERAGE_AT_EXCHANGE = "average_at_exchange"
#: ``buffer_sync`` of a model built with ``broadcast_buffers=False``: every worker keeps its own buffers.
NO_SYNC = "none"

#: The attributes DDP's forward reads to decide whether to broadcast rank 0's buffers, newest first.
_SYNC_FLAGS = ("forward_sync_buffers", "broadcast_buffers")


class BufferSync(NamedTuple):
    """Which module buffers lgc keeps in step for one DDP model, and how; decided when its hook is registered."""

    #: ``summary.json``'s ``buffer_sync``: :data:`BROADCAST`, :data:`AVERAGE_AT_EXCHANGE` or :data:`NO_SYNC`.
    mode: str
    #: The names of the buffers kept in step, in the module's order (empty for :data:`NO_SYNC`).
    names: tuple[str, ...]

    def buffers(self, module: nn.Module) -> list[Tensor]:
        """The module's buffers kept in step, looked up by name (a module may replace a buffer's tensor)."""
        if not self.names:
            return []
        named = dict(module.named_buffers())
        return [named[name] for name in self.names]


def _sync_flag(model: DistributedDataParallel) -> str:
    """The name of the flag this torch's DDP forward reads (``forward_sync_buffers`` where it exists)."""
    return next((name for name in _SYNC_FLAGS if hasattr(model, name)), _SYNC_FLAGS[-1])


def _buffer_sync(model: DistributedDataParallel, mode: str) -> BufferSync:
    """DDP's rule for ``model``: every buffer but those it was told to ignore, none when it was built not to sync.

    Raises:
        ValueError: ``model`` has a buffer communication hook that taking over the buffers would stop.
    """
    if not bool(getattr(model, _sync_flag(model), True)):
        return BufferSync(NO_SYNC, ())
    if getattr(model, "buffer_hook", None) is not None:
        raise ValueError(
            "the model has a buffer communication hook (DDP's _register_buffer_comm_hook); lgc keeps module buffers "
            "in step itself and turns DDP's buffer broadcast off, which would stop that hook without a word: build "
            "the model without it, or with broadcast_buffers=False to keep every worker's buffers local"
        )
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    return BufferSync(mode, tuple(name for name, _ in model.module.named_buffers() if name not in ignored))


def _turn_off_forward_broadcast(model: DistributedDataParallel) -> None:
    """Set DDP's public flag off, so no forward broadcasts the buffers; refuse a torch whose DDP ignores it."""
    setattr(model, _sync_flag(model), False)
    will_sync = getattr(model, "will_sync_module_buffers", None)
    if will_sync is not None and will_sync():
        raise RuntimeError(
            f"DDP still broadcasts module buffers before forward passes after {_sync_flag(model)}=False "
            f"(torch {torch.__version__}); lgc cannot keep them in step and count them on this version"
        )


def _by_dtype(buffers: list[Tensor]) -> list[list[Tensor]]:
    """The buffers grouped by dtype and device, in order of first appearance (the same on every rank)."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for buffer in buffers:
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    return list(groups.values())


def book_dense_buffer_broadcast(stats: CommStats, buffers: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Plain DDP's broadcast of module ``buffers`` from rank 0 (one per dtype), in the dense-equivalent figures."""
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
    book_dense_buffer_broadcast(stats, buffers, group)


def register_comm_hook(
    model: DistributedDataParallel, state: Any, hook: Callable[..., Any], buffers: str = BROADCAST
) -> BufferSync:
    """``model.register_comm_hook(state, hook)``, and the buffers kept in step once per step, counted.

    The broadcast comes with the step's last bucket, just before ``hook``'s call for it (or the
    step's own header carries the buffers, where the state takes them:
    :meth:`~lgc.ddp.protocol.HookState.take_buffers`, :mod:`lgc.ddp.packed`), so every rank issues
    it at the same point and every byte of a step is spent within the hook calls of that step
    (what per-step statistics, such as LGC's stages, book). DDP's own broadcast before forward
    passes is turned off.

    Args:
        model: the DDP model.
        state: the hook state (``state.stats`` counts, ``state.process_group`` is the group).
        hook: the DDP communication hook.
        buffers: :data:`BROADCAST` (rank 0's, as DDP does) or :data:`AVERAGE` (the floating-point
            buffers averaged over the workers; see the module docstring).

    Returns:
        The buffers kept in step (none for a model built with ``broadcast_buffers=False``).

    Raises:
        ValueError: ``model`` has a buffer communication hook (see the module docstring), or
            ``buffers`` is not one of :data:`BUFFER_MODES`.
    """
    check_buffer_mode(buffers)
    sync = _buffer_sync(model, buffers)
    # Weakly: DDP's reducer (C++) holds this hook, so a strong reference to the model (or to
    # anything that leads back to it, such as a Lightning module's trainer) would close a cycle
    # through the reducer that the garbage collector cannot see, and the model would never be
    # freed. The reducer lives as long as the model, so the reference is alive whenever it runs.
    model_ref = weakref.ref(model)

    @functools.wraps(hook)
    def buffers_then_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.is_last():
            counted.mark_last_bucket()
            if sync.names:
                ddp = model_ref()
                assert ddp is not None, "DDP calls its hook only while the model lives"
                with torch.no_grad():
                    kept = sync.buffers(ddp.module)
                    if state.take_buffers(kept, sync.mode):
                        pass  # the step's own header carries them (lgc.ddp.packed)
                    elif sync.mode == AVERAGE:
                        average_step_buffers(state.stats, kept, state.process_group)
                    else:
                        broadcast_buffers(state.stats, kept, state.process_group)
        return hook(state, bucket)

    model.register_comm_hook(state, buffers_then_hook)
    _turn_off_forward_broadcast(model)
    return sync


def check_buffer_mode(buffers: Any, name: str = "buffers") -> str:
    """``buffers`` if it is one of :data:`BUFFER_MODES`, else a ValueError naming it."""
    if buffers not in BUFFER_MODES:
        raise ValueError(f"{name} must be one of {', '.join(BUFFER_MODES)}, got {buffers!r}")
    return buffers


def average_step_buffers(stats: CommStats, buffers: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """A per-step method's ``buffers="average"``: floating-point buffers averaged, the others broadcast; counted.

    A non-finite mean leaves the floating-point buffers as they were on every rank (each rank sees
    the same mean, so each decides alike). The dense equivalent books plain DDP's broadcast.
    """
    floating = [b for b in buffers if b.is_floating_point()]
    others = [b for b in buffers if not b.is_floating_point()]
    if floating:
        average_buffers(stats, floating, dist.get_world_size(group), group)
    if others:
        broadcast_buffers(stats, others, group)  # books their dense broadcast
    if floating:
        book_dense_buffer_broadcast(stats, floating, group)


def keep_buffers_local(model: DistributedDataParallel) -> BufferSync:
    """Turn DDP's broadcast of rank 0's buffers off: the method averages them itself (:func:`average_buffers`).

    Returns:
        The buffers to average at exchanges (none for a model built with ``broadcast_buffers=False``).

    Raises:
        ValueError: ``model`` has a buffer communication hook (see the module docstring).
    """
    sync = _buffer_sync(model, AVERAGE_AT_EXCHANGE)
    _turn_off_forward_broadcast(model)
    return sync


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


class ExchangedBuffers:
    """The buffers the local-step exchanges average (:func:`keep_buffers_local`), and their last average.

    Integer buffers (BatchNorm's ``num_batches_tracked``) count this worker's forward passes,
    buffers DDP ignores are the worker's own, and with ``broadcast_buffers=False`` there are none:
    only the floating-point buffers of :attr:`sync` are averaged. An average that is not finite (a
    rank's statistics overflowed) is not taken: every rank returns to the last average instead.
    """

    __slots__ = ("sync", "synced")

    def __init__(self) -> None:
        #: Which buffers DDP's rule keeps in step (set at registration; per process).
        self.sync: BufferSync | None = None
        #: Buffer name -> value after the last average (the initial ones before any; identical on every rank).
        self.synced: dict[str, Tensor] = {}

    def averaged(self, module: torch.nn.Module) -> dict[str, Tensor]:
        """The buffers the exchanges average, by name: the floating-point ones DDP's rule keeps in step."""
        assert self.sync is not None, "register the model first"
        named = dict(module.named_buffers())
        return {name: named[name] for name in self.sync.names if named[name].is_floating_point()}

    def snapshot(self, module: torch.nn.Module) -> None:
        """Take every buffer's present value as the last average (at registration)."""
        self.synced = {name: b.detach().clone() for name, b in module.named_buffers()}

    def restore(self, module: torch.nn.Module) -> None:
        """The averaged buffers back to their last average (an exchange or its average was not finite)."""
        for name, buffer in self.averaged(module).items():
            buffer.copy_(self.synced[name])

    def average(
        self, module: torch.nn.Module, stats: CommStats, world_size: int, group: dist.ProcessGroup | None
    ) -> None:
        """Every worker's averaged buffers replaced by their mean (a counted allreduce); all continue from it."""
        averaged = self.averaged(module)
        if not average_buffers(stats, list(averaged.values()), world_size, group):
            self.restore(module)
            return
        self.synced.update({name: b.detach().clone() for name, b in averaged.items()})
