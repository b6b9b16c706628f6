"""The collectives of one compressed step of a buffer: pack, allreduce or allgather, decode.

:class:`PayloadExchange` compresses every compressed segment of a flat buffer (one parameter's
gradient or weight update each, keyed by the parameter's name), issues the collectives and, once
they are done, decodes the sum into the buffer:

* summable payloads (:attr:`~lgc.compressors.CombineMode.SUM`) go through one allreduce per wire
  dtype; gatherable ones (:attr:`~lgc.compressors.CombineMode.GATHER`) through an allgather of one
  packed byte buffer, with the sizes exchanged first when they may differ between workers;
* segments below the hook's ``min_numel`` are allreduced dense in the buffer's own dtype;
* collectives are issued in the constructor, in the same order on every rank, never from
  ``Future.then`` callbacks (gloo would see them in a different order per rank); callbacks only
  decode;
* once a parameter's sum is in the buffer, :meth:`~lgc.compressors.Compressor.finish_aggregate`
  may complete it with a term every rank computes alike (DGC's weight decay momentum).

Used by the gradient hook (:mod:`lgc.ddp.hook`), communication delay's exchanges of weight updates
(:mod:`lgc.ddp.local_sgd`) and LGC's stages (:mod:`lgc.learned.training`).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, HoldsSteps, Payload
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.layer_stats import LayerLedger

__all__ = [
    "PayloadExchange",
    "Segment",
    "average_compressed",
    "encode_buffers",
    "joined",
    "packed_payloads",
    "prepare_compressor",
    "sum_gathered",
    "wire_sizes",
]


class ExchangeHost(Protocol):
    """What an exchange reads and updates on its hook state (:class:`~lgc.ddp.hook.CompressionHookState`)."""

    compressor: Compressor
    process_group: Any
    stats: CommStats
    #: Wall seconds spent encoding (``encode``) and decoding (``decode``).
    codec_seconds: dict[str, float]
    #: The step ``compressor.begin_step()`` was last called for.
    begun_step: int
    #: Whether rank 0's shared seed has been broadcast.
    seed_shared: bool

    #: Bytes per parameter (:mod:`lgc.ddp.layer_stats`).
    layer_stats: LayerLedger


class Segment(NamedTuple):
    """One parameter's gradient inside a bucket's flat buffer."""

    name: str
    offset: int
    numel: int
    compressed: bool


def _allreduce(state: ExchangeHost, tensor: Tensor) -> torch.futures.Future:
    return counted.all_reduce(state.stats, tensor, state.process_group)


def _allgather(state: ExchangeHost, tensor: Tensor, world_size: int) -> tuple[list[Tensor], Any]:
    return counted.all_gather(state.stats, tensor, state.process_group)


def average_compressed(
    state: ExchangeHost, buffer: Tensor, segments: tuple[Segment, ...], step: int
) -> torch.futures.Future[Tensor]:
    """Sum ``buffer`` (each worker's share, already divided by the world size) across workers.

    Dense segments are allreduced; the others go through ``state.compressor``. The result is
    written into ``buffer``, which the returned future holds. All collectives are issued here, in
    the same order on every rank; the future's callback only decodes. Used by the gradient hook
    and by :mod:`lgc.ddp.local_sgd` for weight updates.
    """
    exchange = PayloadExchange(state, buffer, segments, step)
    return torch.futures.collect_all(exchange.futures).then(lambda _: exchange.finish())


def prepare_compressor(state: ExchangeHost, device: torch.device, step: int) -> None:
    """What the compressor learns before it encodes ``step``: rank, world size, rank 0's seed (once), the step.

    Every rank calls it at the same point (the seed's broadcast is a collective).
    """
    compressor = state.compressor
    compressor.set_rank(dist.get_rank(state.process_group))
    compressor.set_world_size(dist.get_world_size(state.process_group))
    if compressor.needs_shared_seed and not state.seed_shared:
        # Once, on every rank at the same point: everyone adopts rank 0's seed.
        seed = torch.tensor([compressor.shared_seed], dtype=torch.int64, device=device)
        counted.broadcast(state.stats, seed, 0, state.process_group)
        compressor.set_shared_seed(int(seed.item()))
        state.seed_shared = True
    if state.begun_step != step:
        compressor.begin_step(step)
        state.begun_step = step


def encode_buffers(
    state: ExchangeHost, buffers: list[tuple[Tensor, tuple[Segment, ...]]], step: int, used: frozenset[str]
) -> dict[str, Payload]:
    """Every compressed, used segment of several buffers (a step's buckets) in one ``compress_many``.

    A compressor that encodes a bucket in a fixed number of passes (error feedback over top-k on a
    GPU) then makes them once per step rather than once per bucket. The payloads go to each
    bucket's :class:`PayloadExchange` (``encoded``); the encoding is the same as bucket by bucket.
    """
    if not buffers:
        return {}
    prepare_compressor(state, buffers[0][0].device, step)
    started = time.perf_counter()
    chosen = [(buffer, s) for buffer, segments in buffers for s in segments if s.compressed and s.name in used]
    payloads = state.compressor.compress_many(
        [buffer[s.offset : s.offset + s.numel] for buffer, s in chosen], [s.name for _, s in chosen]
    )
    state.codec_seconds["encode"] += time.perf_counter() - started
    return {s.name: payload for (_, s), payload in zip(chosen, payloads, strict=True)}


class PayloadExchange:
    """The collectives of one compressed step of one buffer, and the decoding of their results.

    Constructing it compresses every segment and issues all collectives (in the same order on
    every rank); once :attr:`futures` are done, :meth:`finish` writes the sum into ``buffer``.
    For gathered payloads, :attr:`received` then holds every rank's payload of every compressed
    segment (LGC reads the leader's top-k indices from it).
    """

    def __init__(
        self,
        state: ExchangeHost,
        buffer: Tensor,
        segments: tuple[Segment, ...],
        step: int,
        *,
        used: frozenset[str] | None = None,
        pending: bool = False,
        encoded: dict[str, Payload] | None = None,
    ):
        self.state = state
        self.buffer = buffer
        world_size = dist.get_world_size(state.process_group)
        compressor = state.compressor
        prepare_compressor(state, buffer.device, step)
        # ``pending``: state held until the compressor's commit (encoded ahead of the step's agreement,
        # the hook's overlap, whose payloads are gathered; or after it, FSDP2 holding a step until every
        # parameter group is reduced), compressed segments only; ``buffer`` is left as it is until finish().
        if pending and (used is not None or compressor.combine is CombineMode.SERVER):
            raise ValueError(
                "an exchange whose state is held exchanges every parameter it is given, gathered or summed"
            )
        if pending and any(not s.compressed for s in segments):
            raise ValueError("an exchange encoded ahead of the agreement takes compressed segments only")
        if used is not None:
            # Zero on every rank (unused parameters): the sum is the zero already in the buffer,
            # and the compressor's state for them must not move.
            segments = tuple(s for s in segments if s.name in used)
        self.dense = [s for s in segments if not s.compressed]
        self.sparse = [s for s in segments if s.compressed]
        started = time.perf_counter()
        for s in self.dense:
            piece = buffer[s.offset : s.offset + s.numel]
            sent = compressor.transform_dense(piece, s.name)
            if sent is not piece:
                piece.copy_(sent)
        #: This worker's payload of every compressed segment, in segment order.
        self.own: list[Payload]
        if encoded is not None:
            if pending:
                raise ValueError("an exchange encoded ahead of the agreement encodes its own payloads")
            self.own = [encoded[s.name] for s in self.sparse]
        elif pending:
            assert isinstance(compressor, HoldsSteps), compressor
            self.own = compressor.compress_pending_many(
                [buffer[s.offset : s.offset + s.numel] for s in self.sparse], [s.name for s in self.sparse]
            )
        else:
            pieces = [buffer[s.offset : s.offset + s.numel] for s in self.sparse]
            self.own = compressor.compress_many(pieces, [s.name for s in self.sparse])
        state.codec_seconds["encode"] += time.perf_counter() - started
        #: Segment name -> every rank's payload (gathered payloads only; filled by :meth:`finish`).
        self.received: dict[str, list[Payload]] = {}
        for s, payload in zip(self.sparse, self.own, strict=True):
            state.layer_stats.book(s.name, s.numel, True, payload.nbytes)
        for s in self.dense:
            state.layer_stats.book(s.name, s.numel, False, s.numel * buffer.element_size())
        state.stats.payload_bytes += sum(p.nbytes for p in self.own)
        state.stats.payload_dense_equivalent_bytes += sum(s.numel for s in self.sparse) * buffer.element_size()
        if compressor.combine is CombineMode.SUM:
            self.futures = self._issue_sum()
        else:
            self.futures = self._issue_gather(world_size)

    def _issue_sum(self) -> list[torch.futures.Future]:
        # One allreduce per dtype, the parts in buffer order: dense segments as they are, compressed
        # ones as their payload's single wire tensor. Parts that tile one storage without gaps
        # (``none``: the whole bucket) are allreduced in place, without a copy.
        buffer = self.buffer
        own = dict(zip((s.name for s in self.sparse), self.own, strict=True))
        self.order: list[tuple[Segment, Payload | None]] = []
        self.groups: dict[torch.dtype, list[Tensor]] = {}
        for s in sorted((*self.dense, *self.sparse), key=lambda s: s.offset):
            payload = own.get(s.name) if s.compressed else None
            part = buffer[s.offset : s.offset + s.numel] if payload is None else payload.tensors()[0].reshape(-1)
            self.order.append((s, payload))
            self.groups.setdefault(part.dtype, []).append(part)
        self.flats = {dtype: joined(parts) for dtype, parts in self.groups.items()}
        return [_allreduce(self.state, flat) for flat in self.flats.values()]

    def _issue_gather(self, world_size: int) -> list[torch.futures.Future]:
        # Dense part by allreduce, payloads packed into one byte buffer each.
        state, buffer = self.state, self.buffer
        futures = []
        self.dense_flat = None
        if self.dense:
            self.dense_flat = torch.cat([buffer[s.offset : s.offset + s.numel] for s in self.dense])
            futures.append(_allreduce(state, self.dense_flat))
        self.gathered: list[Tensor] = []
        if self.own:
            parts = [p.wire_parts() for p in self.own]
            # Known on the host: a fixed-size payload's sizes cost no copy from the device.
            local_sizes = wire_sizes(parts)
            if state.compressor.variable_size:
                size_lists, work = counted.all_gather(state.stats, local_sizes.to(buffer.device), state.process_group)
                # Blocking on purpose: the payload allgather below needs the sizes.
                work.wait()
                self.sizes = torch.stack(size_lists).cpu()
            else:
                self.sizes = local_sizes.expand(world_size, -1)
            self.gathered, work = _allgather(state, packed_payloads(parts, self.sizes), world_size)
            futures.append(work.get_future())
        return futures

    def finish(self, used: frozenset[str] | None = None) -> Tensor:
        """Decode the finished collectives into ``buffer`` and return it.

        ``used``: for an exchange encoded ahead of the agreement (gathered payloads of compressed
        segments only), the parameters some rank has a gradient for; the others are left as they
        are in ``buffer`` (zero on every rank), as if they had not been sent.
        """
        started = time.perf_counter()
        try:
            return self._decode(used)
        finally:
            self.state.codec_seconds["decode"] += time.perf_counter() - started

    def _decode(self, used: frozenset[str] | None) -> Tensor:
        compressor, buffer = self.state.compressor, self.buffer
        if compressor.combine is CombineMode.SUM:
            pieces = {
                dtype: iter(flat.split([p.numel() for p in self.groups[dtype]])) for dtype, flat in self.flats.items()
            }
            for s, payload in self.order:
                target = buffer[s.offset : s.offset + s.numel]
                if payload is None:
                    decoded = next(pieces[buffer.dtype])
                    if decoded.data_ptr() != target.data_ptr():
                        target.copy_(decoded)
                else:
                    (values,) = payload.tensors()
                    summed = next(pieces[values.dtype]).view_as(values)
                    compressor.decompress_into(compressor.payload_from_sum(summed, payload), target)
                compressor.finish_aggregate(target, s.name)
            return buffer
        if self.dense_flat is not None:
            for s, piece in zip(self.dense, self.dense_flat.split([s.numel for s in self.dense]), strict=True):
                target = buffer[s.offset : s.offset + s.numel]
                target.copy_(piece)
                compressor.finish_aggregate(target, s.name)
        if self.own:
            targets = [buffer[s.offset : s.offset + s.numel] for s in self.sparse]
            self.received = sum_gathered(
                self.state, list(zip(self.sparse, targets, strict=True)), self.own, self.gathered, self.sizes, used
            )
        return buffer


def wire_sizes(parts: list[list[Tensor]]) -> Tensor:
    """Each payload's wire elements (``[p.wire_parts() for p in payloads]``), as int64 on the host."""
    return torch.tensor([sum(piece.numel() for piece in pieces) for pieces in parts], dtype=torch.int64)


def packed_payloads(parts: list[list[Tensor]], sizes: Tensor) -> Tensor:
    """This rank's payloads' wire pieces (``[p.wire_parts() for p in payloads]``) joined into one byte
    buffer by one ``cat``, padded to the longest rank's total.

    ``sizes``: every rank's wire elements per payload (``world x len(parts)``, on the host).
    """
    pieces = [piece for payload_pieces in parts for piece in payload_pieces]
    own_total = sum(piece.numel() for piece in pieces)
    max_total = int(sizes.sum(dim=1).max())
    if own_total < max_total:
        pieces.append(pieces[0].new_zeros(max_total - own_total))
    return torch.cat(pieces)


def sum_gathered(
    state: ExchangeHost,
    segments: list[tuple[Segment, Tensor]],
    own: list[Payload],
    gathered: list[Tensor],
    sizes: Tensor,
    used: frozenset[str] | None = None,
) -> dict[str, list[Payload]]:
    """Every rank's payloads parsed from an allgather of :func:`packed_payloads`, summed into the targets.

    ``segments``: each payload's segment and the tensor its sum goes to, in the order packed;
    ``used`` (for payloads encoded ahead of the agreement): the names some rank has a gradient for,
    the others left as they are (zero on every rank). Returns every rank's payloads by name.
    """
    compressor = state.compressor
    per_rank = [
        iter(g.split(row.tolist() + [g.numel() - int(row.sum())])) for g, row in zip(gathered, sizes, strict=True)
    ]
    rank = dist.get_rank(state.process_group)
    received: dict[str, list[Payload]] = {}
    decoded: list[tuple[Segment, Tensor]] = []
    numels, names = [s.numel for s, _ in segments], [s.name for s, _ in segments]
    # Each rank's payloads parsed at once (a compressor may parse a bucket in a fixed number of passes).
    by_rank = [compressor.payloads_from_wire_many([next(wires) for _ in segments], numels, names) for wires in per_rank]
    for i, ((s, target), mine) in enumerate(zip(segments, own, strict=True)):
        payloads = [parsed[i] for parsed in by_rank]
        _check_round_trip(compressor, mine, payloads[rank])
        if used is not None and s.name not in used:
            continue
        received[s.name] = payloads
        decoded.append((s, target))
    # The sums at once (one pass per rank where the compressor batches them), then each completed in turn.
    compressor.aggregate_many([received[s.name] for s, _ in decoded], [target for _, target in decoded])
    for s, target in decoded:
        compressor.finish_aggregate(target, s.name)
    return received


def joined(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts)``, or a view when the parts already lie back to back in one storage."""
    first = parts[0]
    end = first.data_ptr()
    for part in parts:
        if (
            not part.is_contiguous()
            or part.data_ptr() != end
            or part.untyped_storage().data_ptr() != (first.untyped_storage().data_ptr())
        ):
            return torch.cat(parts)
        end += part.numel() * part.element_size()
    return first.as_strided((sum(p.numel() for p in parts),), (1,), first.storage_offset())


def _check_round_trip(compressor: Compressor, own: Payload, parsed: Payload) -> None:
    """Refuse a compressor whose wire format does not give back the dtypes it wrote.

    Every rank parses every payload with :meth:`Compressor.payload_from_wire`; a payload written
    in one dtype and parsed as another decodes to garbage without any error. Comparing this
    rank's own payload with its parsed copy costs nothing (metadata only) and catches it.
    """
    written = [(t.dtype, t.numel()) for t in own.tensors()]
    read = [(t.dtype, t.numel()) for t in parsed.tensors()]
    if written != read:
        raise RuntimeError(
            f"{compressor!r} wrote a payload as {written} (dtype, numel) but parses it back as {read}: "
            "its payload_from_wire does not match what compress() puts on the wire"
        )
