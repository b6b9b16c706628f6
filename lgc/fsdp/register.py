"""Which of lgc's FSDP2 reductions a hook state gets: one choice for :func:`lgc.compress` and ``lgc-train``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.fsdp.learned import HybridLGC
from lgc.fsdp.local_steps import register_local_steps
from lgc.fsdp.reduce_scatter import FSDPCompression
from lgc.learned.state import LGCHookState

__all__ = ["register_sharded"]


def register_sharded(
    state: CompressionHookState | CommunicationDelayState,
    model: torch.nn.Module,
    replicate: dist.ProcessGroup | None,
    buffers: str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Install ``state`` on the FSDP2 model ``model``: local steps across the replicas
    (:mod:`lgc.fsdp.local_steps`, ``optimizer`` stepping the state after every step), LGC across the
    replicas (:mod:`lgc.fsdp.learned`), or lgc's compressed reduce-scatter or, with ``replicate``,
    all-reduce (:mod:`lgc.fsdp.reduce_scatter`), ``buffers`` kept in step once per step."""
    if isinstance(state, CommunicationDelayState):
        register_local_steps(state, model, replicate, optimizer)
    elif isinstance(state, LGCHookState):
        HybridLGC(state, replicate, buffers).register(model)
    else:
        FSDPCompression(state, replicate, buffers).register(model)
