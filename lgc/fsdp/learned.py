"""LGC under hybrid sharding: LGC-RAR, LGC-PS and the shared-index codecs across FSDP2's replicas.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (IEEE TNNLS 2021,
arXiv:2103.08870), on the link it is meant for: under hybrid sharding (each replica one model
sharded over its ranks, ``fully_shard(module, mesh=mesh["shard"])``, and
``lgc.compress(model, "lgc_rar", replicate=mesh["replicate"])``) FSDP2's reduce-scatter inside a
replica stays exact over the fast links, and LGC codes the all-reduce across replicas. Each rank
holds its shard of its replica's averaged gradient; the ranks that hold the same shard in the other
replicas are LGC's workers (the replicate group, the "replicas" below). Among them
:class:`~lgc.learned.state.LGCHookState` runs unchanged, seeing each parameter's shard where under
DDP it sees the parameter: the warm-up's top-k, the codec's training on the leader's positions, and
the compressed stage's latent codes (ring all-reduce, parameter server or shared index).

LGC codes a whole step at once (the leader's positions of every parameter, the model's values as
one vector), and FSDP2 reduces group by group. So FSDP2's all-reduce hook (``set_all_reduce_hook``)
only holds each group's reduced shard, and :class:`HybridLGC` runs the step at the end of the
backward pass over all of them, writing the replicas' average into the held shards in place. That
is where FSDP2's gradients are: each parameter's sharded gradient is a view of its group's reduced
shard, unless FSDP2 casts it to another dtype (``MixedPrecisionPolicy.reduce_dtype`` other than the
parameters' own dtype), offloads it (``CPUOffloadPolicy``) or adds it to a gradient already there
(accumulation without ``zero_grad``, or ``zero_grad(set_to_none=False)``; micro-batches accumulate
with ``set_requires_gradient_sync(False)``, one reduction a step). The first two are refused at
registration, the third at the step on every rank (the step guard carries the refusal), before
LGC sends anything. A post-accumulate-grad hook
(an optimizer stepping in backward), which FSDP2 runs right after the all-reduce hook, would see
the replica's gradient before LGC's average: refused too.

What sharding changes, and what it leaves alone:

* **One codec per shard position.** The replicas of each shard position train their own codec on
  their shard's gradients, pick their own leader's positions among the shard's entries (``k =
  ceil(density * n)`` of the shard's ``n``), keep shard-sized residuals, and decide their own
  refreshes on their own reconstruction error. Every shard position runs the same stages on the
  same steps otherwise (the stage lengths are steps). With one rank per replica the shard is the
  whole gradient and the run is the DDP run's, bit for bit (``tests/fsdp/test_hsdp_learned.py``).
* **The step guard decides over the world**, in one allreduce for the step: an inf or NaN on any
  rank skips the step on every rank (averaged dense across replicas, no state moved), so every rank
  counts the same steps. Its flags are those of lgc's FSDP2 reduce-scatter
  (:func:`~lgc.fsdp.reduce_scatter.guard_flags`: per parameter nonzero, carried, left out) and one
  for a refusal, two bytes a parameter and one a step more than the DDP hook's. So a parameter some
  replicas leave out (used on some ranks only, without ``set_reduce_scatter_unused_params(True)``)
  is refused on every rank, naming the fix, as is a gradient that is not its held shard.
* A parameter under ``min_numel`` goes dense as under DDP, decided by its whole size; a shard
  holding only padding (fewer rows than shards) sends nothing.
* ``state.stats`` counts the replicate dimension's traffic (the dense warm-up's all-reduce carries
  FSDP2's padding rows, as FSDP2's own HSDP all-reduce does); ``lgc/*`` metrics are the logging
  rank's shard position's.

Checkpoints: every rank's state differs (its shard position's codec, leader positions, residuals),
so it goes into DCP as :class:`~lgc.fsdp.checkpoint.PerRankState`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import CPUOffloadPolicy

from lgc.ddp.step_guard import PendingBucket, StepVerdict, agree_flags
from lgc.fsdp.reduce_scatter import (
    CompressedReduceScatter,
    FSDPCompression,
    guard_flags,
    param_groups,
    read_guard_flags,
)
from lgc.learned.state import LGCHookState

__all__ = ["HybridLGC", "check_learned"]


def check_learned(state: LGCHookState, hybrid: bool) -> None:
    """Refuse LGC on an FSDP2 model without hybrid sharding's replicate dimension (``hybrid`` False), naming the
    fix."""
    if not hybrid:
        raise ValueError(
            f"{type(state).__name__} codes the all-reduce across replicas of a hybrid-sharded model: shard each "
            "replica over the mesh's shard dimension (fully_shard(module, mesh=mesh['shard'])) and pass "
            "lgc.compress(model, ..., replicate=mesh['replicate']); with every rank one shard (fully_shard over "
            "the world) there is no all-reduce for LGC to code"
        )


class _Held:
    """One parameter group's reduced shard, held until the end of the backward pass."""

    __slots__ = ("comm", "reduced", "replicas", "segments")

    def __init__(self, comm: CompressedReduceScatter, reduced: Tensor, replicas: int, segments: tuple) -> None:
        self.comm = comm
        self.reduced = reduced
        #: What the replicas' sum is divided by: their number, or 1 under set_gradient_divide_factor.
        self.replicas = replicas
        #: Every parameter the reduction carried, this rank's shard of it (empty where it holds padding only).
        self.segments = segments


class HybridLGC(FSDPCompression):
    """LGC across the replicas of a hybrid-sharded FSDP2 model (see the module docstring).

    Built by :func:`lgc.compress` for an FSDP2 model, an LGC method and ``replicate``.
    """

    def __init__(self, state: LGCHookState, replicate: dist.ProcessGroup | None, buffers: str | None = None) -> None:
        check_learned(state, replicate is not None)
        super().__init__(state, replicate, buffers)
        self.lgc = state
        #: The current backward pass's groups, in the order FSDP2 reduced them.
        self.held: list[_Held] = []

    def register(self, model: torch.nn.Module) -> None:
        """Install the holding all-reduce hook on every FSDP module; refuse what would not leave the gradients
        views of the held shards; fix LGC's workers (the replicas) and the parameters' order."""
        names = {id(p): name for name, p in model.named_parameters()}
        for _, param_group in param_groups(model)[0]:
            for fsdp_param in param_group.fsdp_params:
                _check_in_place(param_group, fsdp_param, names[id(fsdp_param.sharded_param)])
                _check_no_grad_hooks(fsdp_param.sharded_param, names[id(fsdp_param.sharded_param)])
        super().register(model)
        assert self.replicate is not None
        self.lgc.set_world_size(dist.get_world_size(self.replicate))
        self.lgc.param_order = {name: i for i, (name, _) in enumerate(model.named_parameters())}

    def all_reduce(self, comm: CompressedReduceScatter, reduced: Tensor) -> None:
        """Hold ``reduced`` (this rank's shard of its replica's average); the step runs at the backward's end."""
        for fsdp_param in comm.param_group.fsdp_params:
            _check_no_grad_hooks(fsdp_param.sharded_param, _name(comm, fsdp_param))
        replicas = self._open_all_reduce(comm, reduced)
        self.held.append(_Held(comm, reduced, replicas, self._shard_segments(comm, reduced)))

    def _before_forward(self, _module: torch.nn.Module, _args: object) -> None:
        """A backward pass that raised before its end leaves its held shards behind: drop them (LGC's state has not
        moved: its step runs at the end)."""
        self.in_step = False
        self.held = []

    def _end_step(self) -> None:
        """The end of the backward pass: LGC's step over every held shard, the guard deciding over the world."""
        state = self.lgc
        self.in_step = False
        held, self.held = self.held, []
        for part in held:
            _wait_for_reduction(part)
        summed = [name for part in held for name in _not_views(part)]
        for part in held:
            state.unscale(part.reduced, part.replicas)
        verdict = self._agree_on_step(held, refuse=bool(summed))
        if verdict is None:
            raise RuntimeError(
                f"{summed[0] if summed else 'a parameter on another rank'}: its gradient is not FSDP2's reduced shard "
                "but a sum into a gradient already there (accumulation across backward passes, or "
                "zero_grad(set_to_none=False)), which LGC's step cannot write: call optimizer.zero_grad() "
                "(set_to_none=True, its default) after every optimizer step, and accumulate micro-batches with "
                "model.set_requires_gradient_sync(False) before all but the last (FSDP2 then reduces once)"
            )
        if self._buffer_names:
            self._sync_buffers()
        # LGC's step takes the shards that hold entries (the guard listed every parameter carried, so that every
        # rank's flags have the same length).
        pending = [PendingBucket(p.reduced, tuple(s for s in p.segments if s.numel), _unused()) for p in held]
        state.run_step(pending, verdict)

    def _agree_on_step(self, held: list[_Held], refuse: bool) -> StepVerdict | None:
        """The step guard over the world, for every held group in one MAX-allreduce of ``2 + 3 n`` bytes (``n``
        parameters that take a gradient): inf/NaN anywhere; whether some rank refuses the step (``refuse``: a
        gradient that is not its held shard); per parameter whether it is nonzero, carried, and left out on some
        rank (a parameter carried on some ranks only is refused, naming the fix). None: some rank refuses, so every
        rank refuses before LGC's step sends anything."""
        groups = [guard_flags(p.comm, p.reduced, p.segments) for p in held]
        skip = torch.stack([g[0] for g in groups]).amax().reshape(1)
        flags = torch.cat([skip, torch.tensor([int(refuse)], dtype=torch.uint8), *(g[1:] for g in groups)])
        flags = agree_flags(self.state.stats, flags.to(held[0].reduced.device), self.guard_group).cpu()
        if flags[1]:
            return None
        verdicts, start = [], 2
        for part, group in zip(held, groups, strict=True):
            end = start + group.numel() - 1
            verdicts.append(read_guard_flags(part.comm, torch.cat([flags[:1], flags[start:end]])))
            start = end
        return StepVerdict(skip=bool(flags[0]), used=frozenset().union(*(v.used for v in verdicts)))


def _not_views(part: _Held) -> list[str]:
    """The parameters of ``part`` whose gradient FSDP2 did not leave as a view of the held shard (accumulation)."""
    storage = part.reduced.untyped_storage().data_ptr()
    summed = []
    for fsdp_param in part.comm.param_group.fsdp_params:
        grad = fsdp_param.sharded_param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.untyped_storage().data_ptr() != storage:
            summed.append(_name(part.comm, fsdp_param))
    return summed


def _name(comm: CompressedReduceScatter, fsdp_param: object) -> str:
    return comm.names[id(fsdp_param.sharded_param)]  # type: ignore[attr-defined]


def _wait_for_reduction(part: _Held) -> None:
    """On a GPU, the current stream waits for FSDP2's last work on the held shard (its post-reduce event, after the
    all-reduce hook and the division), as FSDP2's own end of backward waits for it (except under
    ``set_is_last_backward(False)``)."""
    event = getattr(part.comm.param_group, "_post_reduce_event", None)
    device = part.reduced.device
    if event is not None and device.type != "cpu":
        # FSDP2's device handle (torch.cuda on a GPU) made the event; its stream type waits on it.
        getattr(torch, device.type).current_stream(device).wait_event(event)


def _check_no_grad_hooks(param: Tensor, name: str) -> None:
    """Refuse a post-accumulate-grad hook: FSDP2 runs it right after the all-reduce hook, before LGC's step."""
    if getattr(param, "_post_accumulate_grad_hooks", None):
        raise ValueError(
            f"{name}: a post-accumulate-grad hook (optimizer in backward?) would see the replica's gradient before "
            "LGC averages it across replicas at the end of the backward pass; step the optimizer after backward "
            "under LGC"
        )


def _unused() -> torch.futures.Future[Tensor]:
    """The future a DDP bucket would carry: LGC's step completes it, nothing waits on it here."""
    return torch.futures.Future()


def _check_in_place(param_group: object, fsdp_param: object, name: str) -> None:
    """Refuse a parameter whose reduced gradient FSDP2 casts or offloads (the gradient is then not the held shard)."""
    if isinstance(param_group.offload_policy, CPUOffloadPolicy):  # type: ignore[attr-defined]
        raise ValueError(
            f"{name}: FSDP2 offloads its gradient to the CPU (CPUOffloadPolicy), a copy of the reduced shard that "
            "LGC's step (at the end of the backward pass) cannot write: shard without offloading under LGC"
        )
    policy = param_group.mp_policy  # type: ignore[attr-defined]
    orig = fsdp_param.sharded_param.dtype  # type: ignore[attr-defined]
    reduced = policy.reduce_dtype or policy.param_dtype or orig
    if reduced != orig:
        raise ValueError(
            f"{name}: FSDP2 reduces its gradient in {reduced} and casts it to the parameter's {orig}, a copy that "
            "LGC's step (at the end of the backward pass) cannot write: give MixedPrecisionPolicy a reduce_dtype "
            f"equal to the parameters' dtype ({orig}) under LGC"
        )
