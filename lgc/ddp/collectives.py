"""Collectives that count their bytes: the only calls into :mod:`torch.distributed` lgc makes.

Every helper takes the worker's :class:`CommStats` and adds the logical bytes of the tensors it
passes to and gets from the collective, independent of how the backend routes them:

* allreduce of ``L`` bytes: ``L`` sent, ``L`` received;
* allgather of ``L`` bytes per rank: ``L`` sent, ``(world - 1) * L`` received;
* broadcast of ``L`` bytes: the source sends ``L``, every other rank receives ``L``;
* gather of ``L`` bytes per rank to a root: every other rank sends ``L``, the root receives
  ``(world - 1) * L`` (its own contribution never leaves it);
* send / recv of ``L`` bytes: ``L`` sent by one, received by the other.

Ranks are ranks *in the group*; they are translated to global ranks for torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CommStats",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_bytes",
    "gather",
    "nbytes",
    "recv",
    "send",
]


@dataclass
class CommStats:
    """Cumulative communication of one worker.

    Bytes are the sizes of the tensors this worker passes to and gets from the collectives
    (logical bytes, independent of how the backend routes them): an allreduce of ``L`` bytes
    counts ``L`` sent and ``L`` received; an allgather of ``L`` bytes per rank counts ``L`` sent
    and ``(world - 1) * L`` received.
    """

    #: How many times DDP called the hook (once per bucket per step).
    hook_calls: int = 0
    #: Steps whose gradient was non-finite (inf/NaN) on some rank: passed through uncompressed so
    #: the optimizer or GradScaler skips them, with every compressor state left as it was.
    skipped_steps: int = 0
    #: Bytes this worker contributed to collectives.
    bytes_sent: int = 0
    #: Bytes this worker received from collectives.
    bytes_received: int = 0
    #: Bytes a dense allreduce of the same buckets would have sent (DDP without a hook).
    dense_equivalent_bytes: int = 0
    #: Of ``bytes_sent``, the bytes sent while acting as a parameter server (downstream traffic of
    #: rank 0 in LGC-PS); the rest is this worker's upstream traffic.
    server_bytes_sent: int = 0
    #: Payload bytes of the compressed parameters alone (no dense small tensors, no warm-up).
    payload_bytes: int = 0
    #: Dense bytes of those same compressed parameters.
    payload_dense_equivalent_bytes: int = 0

    @property
    def compression_ratio(self) -> float:
        """Dense-equivalent bytes over bytes sent (higher is better; 1.0 for dense fp32)."""
        return self.dense_equivalent_bytes / self.bytes_sent if self.bytes_sent else math.nan

    @property
    def upstream_compression_ratio(self) -> float:
        """Dense-equivalent bytes over the bytes sent as a worker (server broadcasts left out)."""
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
            "upstream_compression_ratio": self.upstream_compression_ratio,
            "payload_compression_ratio": self.payload_compression_ratio,
        }


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(group or dist.group.WORLD, rank)


def all_reduce(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    """Sum ``tensor`` in place across the group (asynchronous); the future holds ``[tensor]``."""
    stats.bytes_sent += nbytes(tensor)
    stats.bytes_received += nbytes(tensor)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def all_gather(stats: CommStats, tensor: Tensor, group: dist.ProcessGroup | None) -> tuple[list[Tensor], Any]:
    """Every rank's ``tensor`` (same size everywhere), asynchronous: returns the outputs and the work."""
    world_size = dist.get_world_size(group)
    outputs = [torch.empty_like(tensor) for _ in range(world_size)]
    work = dist.all_gather(outputs, tensor, group=group, async_op=True)
    stats.bytes_sent += nbytes(tensor)
    stats.bytes_received += (world_size - 1) * nbytes(tensor)
    return outputs, work


def broadcast(
    stats: CommStats, tensor: Tensor, src: int, group: dist.ProcessGroup | None, *, as_server: bool = False
) -> Tensor:
    """Copy ``tensor`` from group rank ``src`` to every rank, in place (blocking).

    ``as_server`` books the source's bytes as server traffic (:attr:`CommStats.server_bytes_sent`).
    """
    dist.broadcast(tensor, src=_global(group, src), group=group)
    if dist.get_rank(group) == src:
        stats.bytes_sent += nbytes(tensor)
        if as_server:
            stats.server_bytes_sent += nbytes(tensor)
    else:
        stats.bytes_received += nbytes(tensor)
    return tensor


def broadcast_bytes(
    stats: CommStats, wire: Tensor | None, src: int, group: dist.ProcessGroup | None, *, as_server: bool = False
) -> Tensor:
    """Broadcast a ``uint8`` buffer whose length only ``src`` knows: the length (int64) first, then the bytes.

    ``wire`` is read on ``src`` and ignored elsewhere; every rank returns the buffer.
    """
    is_src = dist.get_rank(group) == src
    device = _device_of(group, wire)
    size = torch.tensor([wire.numel() if is_src and wire is not None else 0], dtype=torch.int64, device=device)
    broadcast(stats, size, src, group, as_server=as_server)
    buffer = wire if is_src and wire is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    return broadcast(stats, buffer, src, group, as_server=as_server)


def gather(stats: CommStats, tensor: Tensor, dst: int, group: dist.ProcessGroup | None) -> list[Tensor] | None:
    """Every rank's ``tensor`` (same size everywhere) at group rank ``dst`` (blocking); None elsewhere."""
    world_size = dist.get_world_size(group)
    if dist.get_rank(group) == dst:
        outputs = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.gather(tensor, gather_list=outputs, dst=_global(group, dst), group=group)
        stats.bytes_received += (world_size - 1) * nbytes(tensor)
        return outputs
    dist.gather(tensor, gather_list=None, dst=_global(group, dst), group=group)
    stats.bytes_sent += nbytes(tensor)
    return None


def send(
    stats: CommStats, tensor: Tensor, dst: int, group: dist.ProcessGroup | None, *, as_server: bool = False
) -> None:
    """Send ``tensor`` to group rank ``dst`` (blocking)."""
    dist.send(tensor, dst=_global(group, dst), group=group)
    stats.bytes_sent += nbytes(tensor)
    if as_server:
        stats.server_bytes_sent += nbytes(tensor)


def recv(stats: CommStats, tensor: Tensor, src: int, group: dist.ProcessGroup | None) -> Tensor:
    """Receive into ``tensor`` from group rank ``src`` (blocking)."""
    dist.recv(tensor, src=_global(group, src), group=group)
    stats.bytes_received += nbytes(tensor)
    return tensor


def _device_of(group: dist.ProcessGroup | None, tensor: Tensor | None) -> torch.device:
    """Where the collective's tensors live: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if tensor is not None:
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
