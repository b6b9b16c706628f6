"""Collectives that count their bytes: the only calls into :mod:`torch.distributed` lgc makes.

Every helper takes the worker's :class:`CommStats` and adds two figures. The *wire* bytes
(``wire_*``) are what the collective's algorithm makes this worker send and receive
(:mod:`lgc.ddp.wire`: a ring allreduce of ``L`` bytes sends ``2 (P - 1) / P * L``, a ring
allgather ``(P - 1) * L``). The *logical* bytes are the tensors it passes to and gets from the
collective, independent of how the backend routes them:

* allreduce of ``L`` bytes: ``L`` sent, ``L`` received;
* allgather of ``L`` bytes per rank: ``L`` sent, ``(world - 1) * L`` received;
* broadcast of ``L`` bytes: the source sends ``L``, every other rank receives ``L``;
* gather of ``L`` bytes per rank to a root: every other rank sends ``L``, the root receives
  ``(world - 1) * L`` (its own contribution never leaves it);
* reduce-scatter of ``L`` bytes per rank: ``L`` sent, ``L / world`` received (this rank's chunk);
* send / recv of ``L`` bytes: ``L`` sent by one, received by the other.

Ranks are ranks *in the group*; they are translated to global ranks for torch.distributed. The
``book_*`` functions add a collective's bytes without running it, for collectives issued by code
lgc does not own (PyTorch's hooks) and for the dense exchange a step is compared with.

Why one module: it is the one door to :mod:`torch.distributed`; each collective sits beside the
booking of its bytes, so none can be issued uncounted or counted by another algorithm than it runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.ddp import wire
from lgc.ddp.held_works import kept

__all__ = [
    "CollectiveCall",
    "CollectiveTrace",
    "CommStats",
    "all_gather",
    "all_reduce",
    "book_all_gather",
    "book_all_reduce",
    "book_broadcast",
    "book_dense_broadcast",
    "book_dense_equivalent",
    "book_gather",
    "book_local_upstream",
    "book_dense_reduce_scatter",
    "book_point_to_point",
    "book_reduce_scatter",
    "broadcast",
    "broadcast_bytes",
    "gather",
    "mark_last_bucket",
    "measure_all_gather",
    "nbytes",
    "record_collectives",
    "recv",
    "reduce_scatter",
    "send",
    "all_to_all",
    "book_all_to_all",
]


@dataclass
class CommStats:
    """Cumulative communication of one worker: wire bytes (``wire_*``) and logical bytes.

    Wire bytes are what the collectives' algorithms send over the network (:mod:`lgc.ddp.wire`);
    the headline :attr:`compression_ratio` compares them with a dense ring allreduce of the same
    buckets. Logical bytes are the sizes of the tensors this worker passes to and gets from the
    collectives: an allreduce of ``L`` bytes counts ``L`` sent and received, an allgather of ``L``
    bytes per rank ``L`` sent and ``(world - 1) * L`` received. ``payload_*`` describe the
    compressor alone.
    """

    #: How many times DDP called the hook (once per bucket per step).
    hook_calls: int = 0
    #: Steps whose gradient was non-finite (inf/NaN) on some rank: passed through uncompressed so
    #: the optimizer or GradScaler skips them, with every compressor state left as it was.
    skipped_steps: int = 0
    #: Logical bytes this worker contributed to collectives.
    bytes_sent: int = 0
    #: Logical bytes this worker received from collectives.
    bytes_received: int = 0
    #: Logical bytes of the buckets DDP handed to the hook (a dense allreduce's tensors), and of
    #: rank 0's module buffers, which plain DDP broadcasts too (once per step; :mod:`lgc.ddp.buffers`).
    dense_equivalent_bytes: int = 0
    #: Of ``bytes_sent``, the bytes sent while acting as a parameter server (downstream traffic of
    #: rank 0 in LGC-PS); the rest is this worker's upstream traffic.
    server_bytes_sent: int = 0
    #: Payload bytes of the compressed parameters alone (no dense small tensors, no warm-up).
    payload_bytes: int = 0
    #: Dense bytes of those same compressed parameters.
    payload_dense_equivalent_bytes: int = 0
    #: Bytes this worker put on the network, by each collective's algorithm.
    wire_bytes_sent: int = 0
    #: Bytes this worker took off the network.
    wire_bytes_received: int = 0
    #: Of ``wire_bytes_sent``, the bytes sent as a parameter server.
    wire_server_bytes_sent: int = 0
    #: What plain DDP would have sent from this worker: a dense ring allreduce of the same buckets,
    #: and its broadcasts of rank 0's module buffers.
    wire_dense_equivalent_bytes: int = 0
    #: Of ``wire_bytes_sent``, the bytes of module buffers (BatchNorm statistics: rank 0's, sent once
    #: per step, or communication delay's average at exchanges; :mod:`lgc.ddp.buffers`).
    wire_buffer_bytes_sent: int = 0

    @property
    def compression_ratio(self) -> float:
        """Dense ring allreduce's wire bytes over the wire bytes sent (higher is better; 1.0 for dense fp32)."""
        return self.wire_dense_equivalent_bytes / self.wire_bytes_sent if self.wire_bytes_sent else math.nan

    @property
    def logical_compression_ratio(self) -> float:
        """Dense over sent logical bytes: blind to the algorithms (an allgather looks ``P / 2`` cheaper)."""
        return self.dense_equivalent_bytes / self.bytes_sent if self.bytes_sent else math.nan

    @property
    def upstream_compression_ratio(self) -> float:
        """Dense over the logical bytes sent as a worker (server broadcasts left out)."""
        upstream = self.bytes_sent - self.server_bytes_sent
        return self.dense_equivalent_bytes / upstream if upstream else math.nan

    @property
    def payload_compression_ratio(self) -> float:
        """The compressor's own ratio on the tensors it compresses (``1 / (2 * density)`` for top-k)."""
        return self.payload_dense_equivalent_bytes / self.payload_bytes if self.payload_bytes else math.nan

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "compression_ratio": self.compression_ratio,
            "logical_compression_ratio": self.logical_compression_ratio,
            "upstream_compression_ratio": self.upstream_compression_ratio,
            "payload_compression_ratio": self.payload_compression_ratio,
        }


class CollectiveCall(NamedTuple):
    """One collective as this worker issued it: what a cost model needs to time it at any size of group.

    ``kind`` is ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``gather``, ``send``
    or ``recv``;
    ``nbytes`` the logical bytes of this worker's tensor (per rank for an allgather or a gather);
    ``root`` the source or destination in the group (broadcast, gather, send, recv), else None.
    """

    kind: str
    nbytes: int
    world: int
    root: int | None = None


class CollectiveTrace(list[CollectiveCall]):
    """The collectives :func:`record_collectives` saw, in order, and where the step's last bucket began."""

    #: Index of the first collective issued at the step's last bucket (:func:`mark_last_bucket`), if any.
    last_bucket_from: int | None = None


_recorders: list[CollectiveTrace] = []


@contextmanager
def record_collectives() -> Iterator[CollectiveTrace]:
    """Collect every collective booked inside the ``with`` block, in order (for :mod:`lgc.bench.cost_model`).

    Recording costs one list append per collective and nothing when no block is open.

    Example::

        >>> with record_collectives() as trace:
        ...     loss.backward()  # a DDP model with an lgc hook
        >>> [(call.kind, call.nbytes) for call in trace]
    """
    trace = CollectiveTrace()
    _recorders.append(trace)
    try:
        yield trace
    finally:
        _recorders.remove(trace)


def mark_last_bucket() -> None:
    """Note, in every open recording, that what follows is issued at the step's last bucket.

    Those collectives wait for the end of the backward pass: even a hook that communicates bucket
    by bucket cannot overlap them with it (:mod:`lgc.bench.cost_model`).
    """
    for trace in _recorders:
        trace.last_bucket_from = len(trace)


def _record(kind: str, tensor: Tensor, group: dist.ProcessGroup | None, root: int | None = None) -> None:
    if _recorders:
        call = CollectiveCall(kind, nbytes(tensor), dist.get_world_size(group), root)
        for trace in _recorders:
            trace.append(call)


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(group or dist.group.WORLD, rank)


def _book(stats: CommStats, logical: wire.WireBytes, on_wire: wire.WireBytes, *, as_server: bool = False) -> None:
    """Add one collective's logical and wire bytes; ``as_server`` also books what was sent as server traffic."""
    stats.bytes_sent += logical.sent
    stats.bytes_received += logical.received
    stats.wire_bytes_sent += on_wire.sent
    stats.wire_bytes_received += on_wire.received
    if as_server:
        stats.server_bytes_sent += logical.sent
        stats.wire_server_bytes_sent += on_wire.sent


# -- booking: a collective's bytes, without running it ------------------------------------------
def book_all_reduce(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    """An allreduce of ``tensor``: ``L`` logical bytes each way, a ring's share on the wire."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _record("all_reduce", tensor, group)
    logical = wire.WireBytes(nbytes(tensor), nbytes(tensor))
    _book(stats, logical, wire.ring_allreduce(tensor.numel(), tensor.element_size(), world, rank))


def book_dense_equivalent(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    """What plain DDP would send for ``tensor`` (one bucket): a dense ring allreduce of it."""
    stats.dense_equivalent_bytes += nbytes(tensor)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    stats.wire_dense_equivalent_bytes += wire.ring_allreduce(tensor.numel(), tensor.element_size(), world, rank).sent


def book_dense_reduce_scatter(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    """What stock FSDP2 would send for ``tensor`` (one parameter group's reduce-scatter input): a dense
    reduce-scatter of it, by the backend's algorithm (:func:`book_reduce_scatter`)."""
    stats.dense_equivalent_bytes += nbytes(tensor)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    stats.wire_dense_equivalent_bytes += _reduce_scatter_algorithm(tensor, group)(
        tensor.numel(), tensor.element_size(), world, rank
    ).sent


def book_reduce_scatter(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    """A reduce-scatter of ``tensor`` (every rank's whole input): ``L`` logical bytes sent, ``L / P`` received.

    On the wire as the backend runs it: NCCL's ring reduce-scatter, ``(P - 1) / P * L``; gloo's, an
    allreduce of the whole input then a local copy of the rank's chunk
    (``ProcessGroupGloo::reduce_scatter_single_coalesced``), ``2 (P - 1) / P * L``, recorded as the
    allreduce it is for the cost model.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    algorithm = _reduce_scatter_algorithm(tensor, group)
    _record("reduce_scatter" if algorithm is wire.ring_reduce_scatter else "all_reduce", tensor, group)
    logical = wire.WireBytes(nbytes(tensor), nbytes(tensor) // world)
    _book(stats, logical, algorithm(tensor.numel(), tensor.element_size(), world, rank))


def book_all_to_all(
    stats: CommStats, input: Tensor, input_splits: list[int], output_splits: list[int], group: dist.ProcessGroup | None
) -> None:
    """An all-to-all of ``input``: split ``i`` (``input_splits[i]`` elements) goes to rank ``i``, ``output_splits[i]``
    come from it. Each split travels once, point to point: logical and wire bytes are what leaves for the other
    ranks and what arrives from them (this rank's own split stays)."""
    rank, size = dist.get_rank(group), input.element_size()
    _record("all_to_all", input, group)
    sent = size * sum(n for i, n in enumerate(input_splits) if i != rank)
    received = size * sum(n for i, n in enumerate(output_splits) if i != rank)
    _book(stats, wire.WireBytes(sent, received), wire.WireBytes(sent, received))


def book_dense_broadcast(stats: CommStats, tensor: Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """What plain DDP sends broadcasting ``tensor`` from ``src`` (its module buffers), in the dense equivalent."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    stats.dense_equivalent_bytes += wire.point_to_point(nbytes(tensor), sender=rank == src).sent
    stats.wire_dense_equivalent_bytes += _broadcast_algorithm(tensor, group)(nbytes(tensor), world, rank, src).sent


def book_all_gather(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    """An allgather of ``tensor`` from every rank (same size everywhere)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _record("all_gather", tensor, group)
    logical = wire.WireBytes(nbytes(tensor), (world - 1) * nbytes(tensor))
    _book(stats, logical, wire.ring_allgather(nbytes(tensor), world, rank))


def book_broadcast(
    stats: CommStats, tensor: Tensor, src: int, group: dist.ProcessGroup | None, *, as_server: bool = False
) -> None:
    """A broadcast of ``tensor`` from group rank ``src``: a binomial tree on gloo, a ring on NCCL."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _record("broadcast", tensor, group, src)
    logical = wire.point_to_point(nbytes(tensor), sender=rank == src)
    _book(stats, logical, _broadcast_algorithm(tensor, group)(nbytes(tensor), world, rank, src), as_server=as_server)


def book_gather(stats: CommStats, tensor: Tensor, dst: int, group: dist.ProcessGroup | None) -> None:
    """A gather of ``tensor`` (same size everywhere) at group rank ``dst``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _record("gather", tensor, group, dst)
    # Logically as on the wire: the root's own piece never leaves it.
    on_wire = wire.flat_gather(nbytes(tensor), world, rank, dst)
    _book(stats, on_wire, on_wire)


def book_point_to_point(stats: CommStats, tensor: Tensor, *, sender: bool, as_server: bool = False) -> None:
    """One send of ``tensor``: this worker's side (the sender's or the receiver's)."""
    bytes_ = wire.point_to_point(nbytes(tensor), sender)
    _book(stats, bytes_, bytes_, as_server=as_server)


def book_local_upstream(stats: CommStats, tensor: Tensor) -> None:
    """A worker's message to the server that the same process hosts (LGC-PS's rank 0).

    Counted in the logical ``bytes_sent`` (the upstream figure then does not depend on where the
    server runs) but not on the wire, which it never touches.
    """
    stats.bytes_sent += nbytes(tensor)


def _on_nccl(group: dist.ProcessGroup | None) -> bool:
    return "nccl" in str(dist.get_backend(group))


def _reduce_scatter_algorithm(tensor: Tensor, group: dist.ProcessGroup | None) -> Any:
    """The wire model of a reduce-scatter of ``tensor``: NCCL's ring for CUDA tensors on NCCL, else gloo's allreduce."""
    return wire.ring_reduce_scatter if tensor.is_cuda and _on_nccl(group) else wire.ring_allreduce


def _broadcast_algorithm(tensor: Tensor, group: dist.ProcessGroup | None) -> Any:
    """The wire model of a broadcast of ``tensor``: NCCL's ring for CUDA tensors on NCCL, else gloo's tree."""
    return wire.pipeline_broadcast if tensor.is_cuda and _on_nccl(group) else wire.tree_broadcast


# -- the collectives ------------------------------------------------------------------------------
def all_reduce(
    stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.futures.Future:
    """Reduce ``tensor`` in place across the group (``op``, SUM by default), asynchronously.

    The future holds ``[tensor]``. Every op sends the same bytes, so all are booked alike.
    """
    book_all_reduce(stats, tensor, group)
    return kept(dist.all_reduce(tensor, op=op, group=group, async_op=True)).get_future()


def reduce_scatter(
    stats: CommStats, output: Tensor, input: Tensor, group: dist.ProcessGroup | None, op: Any = dist.ReduceOp.SUM
) -> Any:
    """Reduce ``input`` (``P`` equal chunks) across the group and leave this rank's chunk in ``output``; the work."""
    book_reduce_scatter(stats, input, group)
    # reduce_scatter_single: torch 2.14's name (FSDP2's own call); reduce_scatter_tensor before it, deprecated since.
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return kept(reduce_scatter_single(output, input, op=op, group=group, async_op=True))


def all_to_all(
    stats: CommStats,
    output: Tensor,
    input: Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
) -> Any:
    """Split ``input`` by ``input_splits`` and send split ``i`` to rank ``i``; ``output`` receives every rank's
    split for this one, in rank order (``output_splits``). Returns the work."""
    book_all_to_all(stats, input, input_splits, output_splits, group)
    return kept(dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=True))


def all_gather(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> tuple[list[Tensor], Any]:
    """Every rank's ``tensor`` (same size everywhere), asynchronous: returns the outputs and the work."""
    world_size = dist.get_world_size(group)
    outputs = [torch.empty_like(tensor) for _ in range(world_size)]
    work = kept(dist.all_gather(outputs, tensor, group=group, async_op=True))
    book_all_gather(stats, tensor, group)
    return outputs, work


def measure_all_gather(tensor: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    """Every rank's ``tensor`` (blocking), not booked: for diagnostics that are not the method's traffic
    (LGC's delivered-sum error and premise statistics), which a deployment would not send."""
    outputs = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    kept(dist.all_gather(outputs, tensor, group=group, async_op=True)).wait()
    return outputs


def broadcast(
    stats: CommStats, tensor: Tensor, src: int, group: dist.ProcessGroup | None, *, as_server: bool = False
) -> Tensor:
    """Copy ``tensor`` from group rank ``src`` to every rank, in place (blocking).

    ``as_server`` books the source's bytes as server traffic (:attr:`CommStats.server_bytes_sent`).
    """
    kept(dist.broadcast(tensor, src=_global(group, src), group=group, async_op=True)).wait()
    book_broadcast(stats, tensor, src, group, as_server=as_server)
    return tensor


def broadcast_bytes(
    stats: CommStats, message: Tensor | None, src: int, group: dist.ProcessGroup | None, *, as_server: bool = False
) -> Tensor:
    """Broadcast a ``uint8`` buffer whose length only ``src`` knows: the length (int64) first, then the bytes.

    ``message`` is read on ``src`` and ignored elsewhere; every rank returns the buffer.
    """
    is_src = dist.get_rank(group) == src
    device = _device_of(group, message)
    size = torch.tensor([message.numel() if is_src and message is not None else 0], dtype=torch.int64, device=device)
    broadcast(stats, size, src, group, as_server=as_server)
    buffer = (
        message if is_src and message is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    return broadcast(stats, buffer, src, group, as_server=as_server)


def gather(stats: CommStats, tensor: Tensor, dst: int, group: dist.ProcessGroup | None) -> list[Tensor] | None:
    """Every rank's ``tensor`` (same size everywhere) at group rank ``dst`` (blocking); None elsewhere."""
    world_size = dist.get_world_size(group)
    book_gather(stats, tensor, dst, group)
    if dist.get_rank(group) == dst:
        outputs = [torch.empty_like(tensor) for _ in range(world_size)]
        kept(dist.gather(tensor, gather_list=outputs, dst=_global(group, dst), group=group, async_op=True)).wait()
        return outputs
    kept(dist.gather(tensor, gather_list=None, dst=_global(group, dst), group=group, async_op=True)).wait()
    return None


def send(
    stats: CommStats, tensor: Tensor, dst: int, group: dist.ProcessGroup | None, *, as_server: bool = False
) -> None:
    """Send ``tensor`` to group rank ``dst`` (blocking).

    gloo sends a buffer from host memory only: a CUDA tensor goes through a host copy there (workers
    that share a GPU, ``ddp.oversubscribe``); NCCL sends it from the device.
    """
    staged = tensor.cpu() if _staged_on_host(tensor, group) else tensor
    kept(dist.isend(staged, dst=_global(group, dst), group=group)).wait()
    _record("send", tensor, group, dst)
    book_point_to_point(stats, tensor, sender=True, as_server=as_server)


def recv(stats: CommStats, tensor: Tensor, src: int, group: dist.ProcessGroup | None) -> Tensor:
    """Receive into ``tensor`` from group rank ``src`` (blocking); on gloo a CUDA tensor through host memory."""
    if _staged_on_host(tensor, group):
        host = torch.empty_like(tensor, device="cpu")
        kept(dist.irecv(host, src=_global(group, src), group=group)).wait()
        tensor.copy_(host)
    else:
        kept(dist.irecv(tensor, src=_global(group, src), group=group)).wait()
    _record("recv", tensor, group, src)
    book_point_to_point(stats, tensor, sender=False)
    return tensor


def _staged_on_host(tensor: Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether a point-to-point message must go through host memory: a non-CPU tensor on a backend other
    than NCCL (gloo's send and recv read and write host pointers; its collectives copy CUDA tensors themselves)."""
    return tensor.device.type != "cpu" and not _on_nccl(group)


def _device_of(group: dist.ProcessGroup | None, tensor: Tensor | None) -> torch.device:
    """Where the collective's tensors live: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if tensor is not None:
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
