"""Which of lgc's FSDP2 reductions a hook state gets: one choice for :func:`lgc.compress` and ``lgc-train``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.fsdp.learned import HybridLGC, check_learned
from lgc.fsdp.local_steps import check_local_steps, register_local_steps
from lgc.fsdp.reduce_scatter import FSDPCompression, check_fsdp_state
from lgc.learned.state import LGCHookState

__all__ = ["check_sharded", "register_sharded"]


def check_sharded(state: object, method: object, hybrid: bool) -> None:
    """What an FSDP2 model refuses of ``state`` (built for ``method``) before anything is installed, whatever the
    model: local steps and LGC's family without hybrid sharding's replicas (``hybrid`` False), local steps
    exchanging through LGC's family, and a hook state that is not lgc's per-step compression (PyTorch's DDP hooks).
    Each refusal is a ValueError naming the fix."""
    if isinstance(state, CommunicationDelayState):
        check_local_steps(state, hybrid)
    elif isinstance(state, LGCHookState):
        check_learned(state, hybrid)
    else:
        check_fsdp_state(state, method)


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
