"""The local-step family under hybrid sharding: SBC's delay, DiLoCo, SparseLoCo and Streaming DiLoCo over FSDP2.

Under hybrid sharding each replica is one model sharded over its ranks
(``fully_shard(module, mesh=mesh["shard"])``), and the replicas are the local-step family's workers,
as torchft's DiLoCo places them (FSDP inside a replica group, the outer step across the groups).
Inside a replica every step is stock FSDP2: its exact reduce-scatter averages the replica's
gradients over the fast links. Across replicas nothing moves between exchanges; every ``delay``
steps each rank sends the pseudo-gradient of its shard, ``W_sync - W_local``, through the
compressor to the ranks that hold the same shard in the other replicas, which average it and apply
the outer step. :class:`~lgc.ddp.local_sgd.CommunicationDelayState` runs it unchanged, seeing each
parameter's shard where under DDP it sees the parameter; :func:`register_local_steps` registers it.

What sharding changes, and what it leaves alone:

* Each parameter's shard is coded on its own, keyed by the parameter's name: top-k, SBC and
  SparseLoCo select among the shard's entries, a tiled compressor (SparseLoCo's chunks) tiles the
  shard's rows, and residuals and the outer momentum are shard-sized. With one rank per replica the
  shard is the whole parameter and the run is the DDP run's, bit for bit; an elementwise exchange
  (``none``, fp16) sums the same values however the parameter is cut (``tests/fsdp/test_local_steps.py``).
* Streaming DiLoCo's fragments are cut from the whole parameters, as under DDP, and each rank
  exchanges its shard's part of every piece, so every rank exchanges the same fragment on the same
  step (a piece outside a rank's rows is empty there and sends nothing).
* The step guard decides over the world: a non-finite update on any rank skips the exchange on every
  rank, which all return to the synchronized weights.
* The module buffers (BatchNorm's statistics, each rank's own between exchanges, as stock FSDP2
  keeps them) are averaged over the world with the last fragment's exchange, so every rank of every
  replica agrees on them there.
* Parameters are broadcast from the first replica at registration, and buffers from the first
  rank, so the replicas start equal.
* An evaluation forward pass leaves FSDP2's root gathered; the state reshards every module before
  it reads or writes a shard and after :meth:`~lgc.ddp.local_sgd.CommunicationDelayState.global_model`.
* ``overlap_steps`` runs on the CPU (gloo) only: on a GPU its exchange thread would share the
  compute stream with FSDP2's collectives, untested, so it is refused there.

Between exchanges FSDP2's all-reduce hook (which runs on each group's reduced shard, FSDP2 doing no
all-reduce of its own over a 1-D mesh) counts what plain HSDP would send across the replicas and
notes each backward pass, for the check that ``after_optimizer_step`` runs once per step.
Checkpoints: :class:`~lgc.fsdp.checkpoint.PerRankState` of the state and of the optimizer beside
the model's and the optimizer's DCP state dicts, loaded after them: between exchanges every rank's
local weights, inner optimizer state, residuals and synchronized shards are its own, where DCP
keeps one replica's copy of each shard (saved between exchanges, DCP's model state mixes shards of
different replicas: export the model inside ``global_model()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.local_step_hook import LocalStepCheck
from lgc.ddp.streaming import new_side_group
from lgc.fsdp.reduce_scatter import broadcast_from_first_replica, check_replicate, fsdp_modules, param_groups

__all__ = ["check_local_steps", "register_local_steps", "shard_rows"]


def register_local_steps(
    state: CommunicationDelayState,
    model: torch.nn.Module,
    replicate: dist.ProcessGroup | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Run ``state``'s local steps on the FSDP2 ``model`` (its root), the replicas of ``replicate`` its workers.

    Refuses, before anything is installed: no ``replicate`` (FSDP2 over every rank holds one model,
    which has nothing to step apart), an exchange of the LGC family (its codec and leader are built
    for whole parameters), and what :func:`~lgc.fsdp.reduce_scatter.param_groups` refuses.
    """
    exchange = check_local_steps(state, replicate is not None)
    _, shard_pg = param_groups(model)
    check_replicate(replicate, shard_pg)
    shards = shard_rows(model, shard_pg)
    if state.overlap_steps and any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError(
            f"overlap_steps={state.overlap_steps} under hybrid sharding runs on the CPU (gloo) only: on a GPU the "
            "exchange's thread would share the compute stream with FSDP2's own collectives, untested; use "
            "overlap_steps=0 there"
        )
    broadcast_from_first_replica(model, replicate)
    with torch.no_grad():  # and every buffer from the first rank, as DDP does at construction
        for buffer in model.buffers():
            dist.broadcast(buffer, dist.get_global_rank(dist.group.WORLD, 0))
    if state.overlap_steps:
        # Overlapped exchanges run on a thread of their own, over groups of their own (lgc.ddp.streaming): the
        # world's for the guard and the buffers, made first by every rank, then each replicate group's.
        state.guard_group = new_side_group(dist.group.WORLD)
        state.process_group = state.runner.side_group(replicate)
    else:
        state.guard_group, state.process_group = dist.group.WORLD, replicate
    exchange.set_world_size(dist.get_world_size(replicate))
    state.shards = shards
    state.take(model)
    state.buffers.sync = module_buffers.BufferSync(
        module_buffers.AVERAGE_AT_EXCHANGE, tuple(name for name, _ in model.named_buffers())
    )
    check = LocalStepCheck(state, automatic=optimizer is not None)
    hook = _LocalStepHook(check, replicate)
    for module in fsdp_modules(model):
        module.set_all_reduce_hook(hook)
    model.register_forward_pre_hook(hook.before_forward)
    model.register_forward_pre_hook(check.before_forward)
    if optimizer is not None:
        optimizer.register_step_post_hook(lambda *_: state.after_optimizer_step())


def check_local_steps(state: CommunicationDelayState, hybrid: bool = True) -> CompressionHookState:
    """Refuse local steps without hybrid sharding's replicas (``hybrid`` False) and an exchange of the LGC family
    (its codec and leader are built for whole parameters), naming the fix; return the exchange state."""
    if not hybrid:
        raise ValueError(
            "communication delay under FSDP2 needs hybrid sharding: each replica steps on its own and the replicas "
            "exchange (FSDP2 over every rank holds one model, with nothing to step apart): shard over "
            "mesh['shard'] and pass replicate=mesh['replicate']"
        )
    exchange = state.exchange_state
    if type(exchange) is not CompressionHookState:
        raise ValueError(
            f"communication delay under FSDP2 exchanges through an lgc compressor (e.g. 'none' with outer='sgd' for "
            f"DiLoCo, 'sparseloco', 'sbc'); {type(exchange).__name__} codes whole parameters: use it with "
            "DistributedDataParallel"
        )
    return exchange


def shard_rows(model: torch.nn.Module, shard_pg: dist.ProcessGroup) -> dict[str, tuple[int, int]]:
    """Every trainable parameter's ``(first row, rows)`` on this rank: FSDP2's dim-0 chunk (``torch.chunk``'s)."""
    world, rank = dist.get_world_size(shard_pg), dist.get_rank(shard_pg)
    rows = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if not isinstance(param, DTensor):
            raise ValueError(f"{name} is not sharded (fully_shard its module, or the root): every parameter must be")
        chunk = -(-param.shape[0] // world)
        first = min(rank * chunk, param.shape[0])
        local = param.to_local().shape[0]
        if local != min(chunk, param.shape[0] - first):
            raise ValueError(
                f"{name}: this rank holds {local} of its {param.shape[0]} rows, where FSDP2's dim-0 chunk of rank "
                f"{rank} of {world} is {min(chunk, param.shape[0] - first)}"
            )
        rows[name] = (first, local)
    return rows


class _LocalStepHook:
    """FSDP2's all-reduce hook under local steps: the gradient stays the replica's. Counts what plain HSDP would
    send across replicas and notes the end of each backward pass (:class:`~lgc.ddp.local_step_hook.LocalStepCheck`)."""

    def __init__(self, check: LocalStepCheck, replicate: dist.ProcessGroup) -> None:
        self.check = check
        self.replicate = replicate
        self.queued = False

    def __call__(self, reduced: Tensor) -> None:
        stats = self.check.state.stats
        stats.hook_calls += 1
        counted.book_dense_equivalent(stats, reduced, self.replicate)
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self.queued = True

    def before_forward(self, *_: object) -> None:
        """A forward pass starts no backward's end: one that raised before its end leaves nothing queued."""
        self.queued = False

    def _backward_done(self) -> None:
        self.queued = False
        self.check.backward_done()
