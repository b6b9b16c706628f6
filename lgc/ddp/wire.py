"""Bytes a collective puts on the network, per worker, by the algorithm the backend runs.

:mod:`lgc.ddp.collectives` counts two figures for every collective. The *logical* bytes are the
sizes of the tensors a worker hands to it (an allreduce of ``L`` bytes is ``L``); they describe a
compressor. The *wire* bytes computed here are what the collective's algorithm makes each worker
send and receive; they are what a link carries and what a bandwidth bill (or a step time) depends
on. With ``P`` workers and a message of ``L`` bytes:

=====================  ===========================================  ==============================
collective             algorithm (gloo; NCCL where it differs)      bytes sent per worker
=====================  ===========================================  ==============================
allreduce              ring: reduce-scatter, then allgather         ``2 (P - 1) / P * L``
allgather              ring                                         ``(P - 1) * L``
reduce-scatter (NCCL)  ring (the allreduce's first half)            ``(P - 1) / P * L``
reduce-scatter (gloo)  allreduce of the whole input, a local copy   ``2 (P - 1) / P * L``
broadcast (gloo)       binomial tree (``gloo/broadcast.cc``)        ``L`` x its children; leaves 0
broadcast (NCCL)       pipelined ring from the root                 ``L``; the last in the ring 0
gather                 flat: every rank sends to the root           ``L``; the root 0
send / recv            point to point                               ``L`` / 0
=====================  ===========================================  ==============================

A ring allgather therefore costs ``(P - 1) L`` per worker where a dense ring allreduce of the same
gradient costs ``2 (P - 1) / P`` of its size: allgather-based compressors (top-k, DGC, SBC,
RedSync, the quantizers) lose about ``P / 2`` of their logical ratio on the wire, which is why
:attr:`~lgc.ddp.collectives.CommStats.compression_ratio` is computed from wire bytes.

The ring splits the message into ``P`` chunks of whole elements (the first ``numel % P`` one
element longer, like :func:`torch.tensor_split`); in reduce-scatter step ``s`` rank ``r`` sends
chunk ``(r - s) mod P`` to rank ``r + 1``, in allgather step ``s`` chunk ``(r + 1 - s) mod P``, so a
rank sends every chunk twice except chunks ``r + 1`` and ``r + 2``. Gloo's ring cuts its chunks by
bytes and NCCL may pick a tree for large allreduces (also about ``2 L`` per rank); the totals
over workers are the same. Not counted: TCP/IP and Ethernet headers and the backends' own message
headers (a few percent on a real link; ``lgc-bench network`` measures them against the interface
counters).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "WireBytes",
    "flat_gather",
    "pipeline_broadcast",
    "point_to_point",
    "ring_allgather",
    "ring_allreduce",
    "ring_chunks",
    "ring_reduce_scatter",
    "tree_broadcast",
]


class WireBytes(NamedTuple):
    """What one worker sends and receives in one collective."""

    sent: int
    received: int


def _check(world: int, rank: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world} workers")


def ring_chunks(numel: int, world: int) -> list[int]:
    """Elements of each of the ring's ``world`` chunks: ``numel`` split as evenly as whole elements allow."""
    base, extra = divmod(numel, world)
    return [base + (1 if chunk < extra else 0) for chunk in range(world)]


def ring_allreduce(numel: int, itemsize: int, world: int, rank: int) -> WireBytes:
    """A ring allreduce (reduce-scatter + allgather) of ``numel`` elements of ``itemsize`` bytes."""
    _check(world, rank)
    if world == 1:
        return WireBytes(0, 0)
    chunk = [n * itemsize for n in ring_chunks(numel, world)]
    total = numel * itemsize
    # Every chunk goes out twice except the one this rank finishes reducing (r + 1) and the one it
    # forwards last in the allgather (r + 2); it receives every chunk twice except r and r + 1.
    sent = 2 * total - chunk[(rank + 1) % world] - chunk[(rank + 2) % world]
    received = 2 * total - chunk[rank] - chunk[(rank + 1) % world]
    return WireBytes(sent, received)


def ring_reduce_scatter(numel: int, itemsize: int, world: int, rank: int) -> WireBytes:
    """A ring reduce-scatter of ``numel`` elements of ``itemsize`` bytes per rank: the allreduce's first half.

    In step ``s`` rank ``r`` sends chunk ``(r - s) mod P``: every chunk once except the one it finishes
    reducing (``r + 1`` in :func:`ring_allreduce`'s numbering); it receives every chunk once except ``r``.
    """
    _check(world, rank)
    if world == 1:
        return WireBytes(0, 0)
    chunk = [n * itemsize for n in ring_chunks(numel, world)]
    total = numel * itemsize
    return WireBytes(total - chunk[(rank + 1) % world], total - chunk[rank])


def ring_allgather(nbytes: int, world: int, rank: int) -> WireBytes:
    """A ring allgather of ``nbytes`` from every rank: ``P - 1`` pieces out and in."""
    _check(world, rank)
    return WireBytes((world - 1) * nbytes, (world - 1) * nbytes)


def tree_broadcast(nbytes: int, world: int, rank: int, src: int) -> WireBytes:
    """Gloo's binomial-tree broadcast from ``src``: each rank forwards to its children in the tree.

    With virtual rank ``v = (rank - src) mod P``, round ``i`` has every ``v < 2**i`` send to
    ``v + 2**i`` (when that exists), so ``src`` sends ``ceil(log2 P)`` copies and half the ranks none.
    """
    _check(world, rank)
    _check(world, src)
    vrank = (rank - src) % world
    children = 0
    step = 1
    while step < world:
        if vrank < step and vrank + step < world:
            children += 1
        step *= 2
    return WireBytes(children * nbytes, 0 if vrank == 0 else nbytes)


def pipeline_broadcast(nbytes: int, world: int, rank: int, src: int) -> WireBytes:
    """NCCL's ring broadcast: ``src`` sends, every rank forwards to the next, the last keeps it."""
    _check(world, rank)
    _check(world, src)
    vrank = (rank - src) % world
    return WireBytes(0 if vrank == world - 1 else nbytes, 0 if vrank == 0 else nbytes)


def flat_gather(nbytes: int, world: int, rank: int, dst: int) -> WireBytes:
    """Every rank sends its ``nbytes`` straight to ``dst``, whose own piece stays local."""
    _check(world, rank)
    _check(world, dst)
    if rank == dst:
        return WireBytes(0, (world - 1) * nbytes)
    return WireBytes(nbytes, 0)


def point_to_point(nbytes: int, sender: bool) -> WireBytes:
    """One send of ``nbytes``: the sender's side or the receiver's."""
    return WireBytes(nbytes, 0) if sender else WireBytes(0, nbytes)
