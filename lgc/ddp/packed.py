"""One message per step: a guarded step's control, dense tensors and buffers in one allreduce, its payloads in one more.

On a slow link every collective pays the link's latency, whatever its size, and a compressed step
held bucket by bucket issues many: the step guard's flags, per bucket an allreduce of the tensors
sent dense, an allgather of the payloads' sizes (variable-size payloads) and one of the payloads,
and the module buffers' broadcast (one per dtype). :func:`run_packed_step` puts a whole step on the
wire in two collectives, whatever the number of buckets:

1. **the header**, one SUM allreduce (fp32, or fp64 for a float64 model) of

   * the step guard's flags (:mod:`lgc.ddp.step_guard`): whether this rank saw an inf or NaN, and
     which parameters have a nonzero gradient here;
   * the payloads' sizes, each rank writing its own row (two digits of 20 bits per size, exact in
     fp32; others write zeros, so the sum is every rank's row), where the sizes may differ between
     ranks (DGC, SBC, RedSync);
   * every tensor sent dense (below ``min_numel``), summed as the per-bucket path sums them, in the
     header's dtype (a bf16 or fp16 model's small tensors are summed in fp32 and rounded once);
   * the module buffers (:mod:`lgc.ddp.buffers`): rank 0's (others send zeros; integer buffers as
     their bytes, one per element), or the floating-point ones' mean with ``buffers="average"``;

2. **the payloads** of the parameters some rank used: one allgather of every bucket's payloads
   packed into one byte buffer, or one allreduce per wire dtype for summable payloads
   (random-block).

The header decides the step before any payload is sent, so nothing is sent for a parameter unused
on every rank. Where the header carries sizes or transformed dense tensors (DGC's momentum), the
payloads are encoded before it, into held state
(:class:`~lgc.compressors.base.HoldsSteps`: committed for the used parameters once the header is
in, dropped for a skipped step), as the hook's overlap path encodes them; fixed-size payloads are
encoded after it, exactly as the per-bucket path encodes them. A skipped step (an inf or NaN on some
rank) then allreduces its buckets dense and unchanged, as the per-bucket path does (one collective
per bucket, off the steady state).

What it trades: the buckets' payloads leave together at the end of the backward pass (the
per-bucket path's did too, behind the step guard); module buffers go through the ring allreduce,
``2 (P - 1) / P`` of their size per worker, where gloo's binomial-tree broadcast sends ``(P - 1) / P``
on average (its root ``ceil(log2 P)`` copies): BatchNorm statistics cost about twice the bytes over
all workers, one message fewer per dtype. Every byte is counted (the buffers' share of the header in
``wire_buffer_bytes_sent``). With two workers a sum of two numbers does not depend on its order,
so the result, the compressor state and every byte but the buffers' and the header's equal the
per-bucket path's bit for bit (``tests/ddp/test_packed.py``); with more, the dense tensors' sums
round as a different ring order rounds them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, HoldsSteps, Payload, holds_steps
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.exchange import Segment, joined, packed_payloads, prepare_compressor, sum_gathered, wire_sizes
from lgc.ddp.step_guard import PendingBucket, bucket_maxima, complete_dense

if TYPE_CHECKING:
    from lgc.ddp.hook import CompressionHookState

__all__ = ["StepBuffers", "can_pack", "encodes_ahead", "packing", "run_packed_step"]

#: A payload's size in wire elements travels as two digits of this many bits (exact in fp32).
_DIGIT_BITS = 20
_DIGIT = 1 << _DIGIT_BITS


class StepBuffers(NamedTuple):
    """The module buffers a step carries in its header, handed over by :func:`lgc.ddp.buffers.register_comm_hook`."""

    tensors: list[Tensor]
    #: :data:`~lgc.ddp.buffers.BROADCAST` (rank 0's) or :data:`~lgc.ddp.buffers.AVERAGE`.
    mode: str


def encodes_ahead(compressor: Compressor) -> bool:
    """Whether the header needs the step encoded first: its payloads' sizes differ between ranks, or
    what it sends for the dense tensors moves its state (DGC's momentum)."""
    return compressor.variable_size or compressor.transforms_dense


def can_pack(compressor: Compressor) -> bool:
    """Whether a guarded step of ``compressor`` can go out as one message: fixed-size payloads and dense
    tensors sent as they are, or a compressor that holds a step back until the ranks agree."""
    if compressor.stateless or compressor.combine is CombineMode.SERVER:
        return False
    return not encodes_ahead(compressor) or holds_steps(compressor)


def packing(state_class: type, compressor: Compressor, *, overlap: bool, pack: bool | None) -> bool:
    """Whether a hook state of ``state_class`` packs its steps, from its ``pack`` knob; refuses ``pack=True``
    where a step cannot go out as one message, saying why."""
    if pack not in (None, True, False):
        raise TypeError(f"pack must be None, True or False, got {pack!r}")
    packable = state_class.packs_steps and not overlap and can_pack(compressor)
    if pack is True and not packable:
        why = (
            "overlap=True sends each bucket as it arrives"
            if overlap
            else f"{state_class.__name__} runs collectives of its own"
            if not state_class.packs_steps
            else f"{compressor!r} has no state (its buckets go out as DDP hands them over), or its payloads "
            "vary in size or it transforms the dense tensors without being able to hold a step back"
        )
        raise ValueError(f"pack=True needs steps that can go out as one message: {why}")
    return packable and pack is not False


class _Layout(NamedTuple):
    """Where each part of the header lies."""

    sizes: int  # offset of the sizes' rows
    dense: int  # offset of the dense tensors
    buffers: int  # offset of the module buffers
    total: int


def _header_dtype(dense: list[Tensor], buffers: list[Tensor]) -> torch.dtype:
    wide = any(t.dtype == torch.float64 for t in dense) or any(b.dtype == torch.float64 for b in buffers)
    return torch.float64 if wide else torch.float32


def _buffer_numel(buffer: Tensor) -> int:
    """Header elements of a buffer: one per element (floating point), one per byte (integers, bools)."""
    return buffer.numel() if buffer.is_floating_point() else buffer.numel() * buffer.element_size()


def _buffer_as_header(buffer: Tensor, dtype: torch.dtype) -> Tensor:
    flat = buffer.detach().reshape(-1)
    return flat.to(dtype) if buffer.is_floating_point() else flat.contiguous().view(torch.uint8).to(dtype)


def _buffer_from_header(piece: Tensor, buffer: Tensor) -> Tensor:
    if buffer.is_floating_point():
        return piece.view_as(buffer)
    return piece.to(torch.uint8).view(buffer.dtype).view_as(buffer)


def run_packed_step(state: CompressionHookState, pending: list[PendingBucket], buffers: StepBuffers | None) -> bool:
    """One guarded step of ``state`` over all its buckets in two collectives; returns whether it was skipped.

    Completes every bucket's future; the caller counts the step (``state.iteration``) when it was not skipped.
    """
    group = state.process_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    compressor = state.compressor
    step = state.iteration
    device = pending[0].buffer.device
    segments = [(b.buffer[s.offset : s.offset + s.numel], s) for b in pending for s in b.segments]
    compressed = [(view, s) for view, s in segments if s.compressed]
    dense = [(view, s) for view, s in segments if not s.compressed]
    maxima = torch.cat([bucket_maxima(b.buffer, b.segments) for b in pending]).float()
    finite = bool(torch.isfinite(maxima).all())
    kept = buffers.tensors if buffers is not None else []

    ahead = encodes_ahead(compressor)
    holder: HoldsSteps | None = None
    own_ahead: list[Payload] = []
    dense_sent = [view for view, _ in dense]
    if ahead:
        assert isinstance(compressor, HoldsSteps), compressor
        holder = compressor
        prepare_compressor(state, device, step)
        started = time.perf_counter()
        try:
            # A rank that sees an inf or NaN knows the step will be skipped: it encodes zeros (never decoded).
            own_ahead = holder.compress_pending_many(
                [v if finite else torch.zeros_like(v) for v, _ in compressed], [s.name for _, s in compressed]
            )
            if compressor.transforms_dense:
                dense_sent = [holder.transform_dense_pending(v, s.name) for v, s in dense]
        except BaseException:
            _drop(state, holder)
            raise
        state.codec_seconds["encode"] += time.perf_counter() - started

    try:
        sizes = wire_sizes([p.wire_parts() for p in own_ahead]) if compressor.variable_size else None
        header, layout = _header(finite, maxima, dense_sent, kept, buffers, sizes, world, rank)
        before = state.stats.wire_bytes_sent
        counted.all_reduce(state.stats, header, group).wait()
        if kept:
            share = (layout.total - layout.buffers) / layout.total
            state.stats.wire_buffer_bytes_sent += round((state.stats.wire_bytes_sent - before) * share)
        _adopt_buffers(header[layout.buffers :], kept, buffers, world)
        if kept:
            module_buffers.book_dense_buffer_broadcast(state.stats, kept, group)
        control = header[: layout.dense].cpu()  # flags and sizes, read on the host
        skip = bool(control[0] > 0)
        names_used = control[1 : 1 + len(segments)] > 0
        used = frozenset(s.name for (_, s), flag in zip(segments, names_used.tolist(), strict=True) if flag)
        if skip:
            if holder is not None:
                _drop(state, holder)
            complete_dense(state.stats, group, pending, skipped=True)
            return True

        # The dense tensors: their sums are in the header.
        sums = header[layout.dense : layout.buffers].split([s.numel for _, s in dense])
        for (view, s), summed in zip(dense, sums, strict=True):
            if s.name not in used:
                continue  # zero on every rank, and left so
            view.copy_(summed)
            state.layer_stats.book(s.name, s.numel, False, s.numel * view.element_size())

        chosen = [(i, view, s) for i, (view, s) in enumerate(compressed) if s.name in used]
        if ahead:
            own = [own_ahead[i] for i, _, _ in chosen]
        else:
            prepare_compressor(state, device, step)
            started = time.perf_counter()
            own = compressor.compress_many([view for _, view, _ in chosen], [s.name for _, _, s in chosen])
            state.codec_seconds["encode"] += time.perf_counter() - started
        for (_, _, s), payload in zip(chosen, own, strict=True):
            state.layer_stats.book(s.name, s.numel, True, payload.nbytes)
        state.stats.payload_bytes += sum(p.nbytes for p in own)
        state.stats.payload_dense_equivalent_bytes += sum(s.numel * view.element_size() for _, view, s in chosen)
        if own:
            every = None if sizes is None else _sizes(control, layout, [i for i, _, _ in chosen], world)
            _exchange_payloads(state, [(s, view) for _, view, s in chosen], own, every, world)
        for view, s in dense:
            if s.name in used:
                compressor.finish_aggregate(view, s.name)
        if holder is not None:
            holder.commit(used)
    except BaseException:
        if holder is not None:
            _drop(state, holder)
        raise
    for bucket in pending:
        bucket.future.set_result(bucket.buffer)
    return False


def _drop(state: CompressionHookState, holder: HoldsSteps) -> None:
    """Drop a step encoded ahead: the held state and its schedule (the step that retries it begins it again)."""
    holder.drop()
    state.begun_step = -1


def _header(
    finite: bool,
    maxima: Tensor,
    dense: list[Tensor],
    kept: list[Tensor],
    buffers: StepBuffers | None,
    local: Tensor | None,
    world: int,
    rank: int,
) -> tuple[Tensor, _Layout]:
    """This rank's header (see the module docstring) and its layout; ``local``: this rank's payload sizes
    (:func:`~lgc.ddp.exchange.wire_sizes`) where they differ between ranks, else None."""
    dtype = _header_dtype(dense, kept)
    device = maxima.device
    flags = 1 + maxima.numel()
    sizes = world * local.numel() * 2 if local is not None else 0
    dense_numel = sum(t.numel() for t in dense)
    buffer_numel = sum(_buffer_numel(b) for b in kept)
    layout = _Layout(flags, flags + sizes, flags + sizes + dense_numel, flags + sizes + dense_numel + buffer_numel)
    header = torch.zeros(layout.total, dtype=dtype, device=device)
    header[0] = float(not finite)
    # NaN != 0 is True, so a NaN parameter also counts as used (the step is skipped anyway).
    header[1:flags] = (maxima != 0).to(dtype)
    if local is not None:
        row = torch.stack([local // _DIGIT, local % _DIGIT], dim=1).reshape(-1)
        start = layout.sizes + rank * row.numel()
        header[start : start + row.numel()] = row.to(dtype)
    if dense:
        torch.cat([t.reshape(-1).to(dtype) for t in dense], out=header[layout.dense : layout.buffers])
    if kept:
        assert buffers is not None
        offset = layout.buffers
        for buffer in kept:
            n = _buffer_numel(buffer)
            averaged = buffers.mode == module_buffers.AVERAGE and buffer.is_floating_point()
            if averaged:
                header[offset : offset + n] = _buffer_as_header(buffer, dtype).div_(world)
            elif rank == 0:
                header[offset : offset + n] = _buffer_as_header(buffer, dtype)
            offset += n
    return header, layout


def _adopt_buffers(section: Tensor, kept: list[Tensor], buffers: StepBuffers | None, world: int) -> None:
    """The module buffers from the summed header: rank 0's, or the floating-point ones' mean where it is finite."""
    if not kept:
        return
    assert buffers is not None
    pieces = section.split([_buffer_numel(b) for b in kept])
    averaged = buffers.mode == module_buffers.AVERAGE
    # A mean that is not finite leaves the averaged buffers as they were on every rank (each sees the same mean).
    keep_floats = averaged and not all(
        bool(torch.isfinite(p).all()) for p, b in zip(pieces, kept, strict=True) if b.is_floating_point()
    )
    with torch.no_grad():
        for piece, buffer in zip(pieces, kept, strict=True):
            if buffer.is_floating_point() and keep_floats:
                continue
            buffer.copy_(_buffer_from_header(piece, buffer))


def _sizes(control: Tensor, layout: _Layout, chosen: list[int], world: int) -> Tensor:
    """Every rank's wire elements per chosen payload (``world x len(chosen)``), from the header's rows (on the host)."""
    digits = control[layout.sizes : layout.dense].to(torch.int64).reshape(world, -1, 2)
    return (digits[..., 0] * _DIGIT + digits[..., 1])[:, chosen]


def _exchange_payloads(
    state: CompressionHookState,
    targets: list[tuple[Segment, Tensor]],
    own: list[Payload],
    sizes: Tensor | None,
    world: int,
) -> None:
    """The step's second collective: the payloads of the used parameters, summed into their targets."""
    compressor = state.compressor
    if compressor.combine is CombineMode.SUM:
        groups: dict[torch.dtype, list[Tensor]] = {}
        for payload in own:
            (values,) = payload.tensors()
            groups.setdefault(values.dtype, []).append(values.reshape(-1))
        flats = {dtype: joined(parts) for dtype, parts in groups.items()}
        torch.futures.wait_all([counted.all_reduce(state.stats, flat, state.process_group) for flat in flats.values()])
        started = time.perf_counter()
        pieces = {dtype: iter(flat.split([p.numel() for p in groups[dtype]])) for dtype, flat in flats.items()}
        for (s, target), payload in zip(targets, own, strict=True):
            (values,) = payload.tensors()
            summed = next(pieces[values.dtype]).view_as(values)
            compressor.decompress_into(compressor.payload_from_sum(summed, payload), target)
            compressor.finish_aggregate(target, s.name)
        state.codec_seconds["decode"] += time.perf_counter() - started
        return
    parts = [p.wire_parts() for p in own]
    if sizes is None:  # fixed-size payloads: the same everywhere
        sizes = wire_sizes(parts).expand(world, -1)
    gathered, work = counted.all_gather(state.stats, packed_payloads(parts, sizes), state.process_group)
    work.wait()
    started = time.perf_counter()
    sum_gathered(state, targets, own, gathered, sizes)
    state.codec_seconds["decode"] += time.perf_counter() - started
