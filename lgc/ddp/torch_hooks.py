"""PyTorch's own communication hooks (fp16, bf16, PowerSGD), wrapped with lgc's statistics.

The hooks themselves are PyTorch's (``torch.distributed.algorithms.ddp_comm_hooks``), not
rewritten. The wrapper adds what the rest of ``lgc`` expects from a hook state: byte counts of
what the hook passes to the collectives, hook calls, ``state_dict`` for checkpoints, and a fixed
collective order. PowerSGD issues its second allreduce from a ``Future.then`` callback, which on
gloo can reach the backend in a different order on each rank when several buckets are in flight;
the wrapper therefore waits for each bucket's future inside the hook, so every rank finishes one
bucket's collectives before it starts the next (this costs the overlap of communication with the
rest of the backward pass; NCCL users who want the overlap can register PyTorch's hook directly).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lgc.ddp.hook import CommStats

__all__ = ["PowerSGDHookState", "TorchHookState"]

_HOOKS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "allreduce": default_hooks.allreduce_hook,
}


@contextlib.contextmanager
def _counting_collectives(stats: CommStats) -> Iterator[None]:
    """Count the bytes of every tensor passed to ``dist.all_reduce`` / ``dist.all_gather`` meanwhile."""
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def counting_all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        stats.bytes_sent += nbytes
        stats.bytes_received += nbytes
        return all_reduce(tensor, *args, **kwargs)

    def counting_all_gather(outputs: list[Tensor], tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        stats.bytes_sent += nbytes
        stats.bytes_received += (len(outputs) - 1) * nbytes
        return all_gather(outputs, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = counting_all_reduce, counting_all_gather
    try:
        yield
    finally:
        dist.all_reduce, dist.all_gather = all_reduce, all_gather


@contextlib.contextmanager
def _batched_orthogonalize_accepts_matrices() -> Iterator[None]:
    """Work around torch 2.14's ``batched_powerSGD_hook``, which passes a 2-D ``Q`` to an
    ``_orthogonalize`` that only accepts batches (3-D) and fails with a bare AssertionError.
    The shim views a single matrix as a batch of one; the orthogonalization itself is PyTorch's."""
    original = powerSGD_hook._orthogonalize

    def orthogonalize(matrices: Tensor, epsilon: float = 0) -> None:
        original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    powerSGD_hook._orthogonalize = orthogonalize
    try:
        yield
    finally:
        powerSGD_hook._orthogonalize = original


class TorchHookState:
    """Runs one of PyTorch's stateless hooks (``fp16``, ``bf16``, ``allreduce``) with lgc statistics.

    Args:
        hook: ``"fp16"`` (``fp16_compress_hook``), ``"bf16"`` (``bf16_compress_hook``) or
            ``"allreduce"`` (PyTorch's reference hook, dense fp32).
    """

    def __init__(self, hook: str = "fp16") -> None:
        if hook not in _HOOKS:
            raise ValueError(f"unknown PyTorch hook {hook!r}; choose one of {sorted(_HOOKS)}")
        self.hook_name = hook
        self.stats = CommStats()
        self.process_group: dist.ProcessGroup | None = None

    # The interface lgc's strategy and callbacks use (shared with CompressionHookState).
    def describe(self) -> str:
        return f"torch:{self.hook_name}"

    def set_epoch(self, epoch: int) -> None:
        pass

    def residual_norm(self) -> float | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def summary_extras(self) -> dict[str, Any]:
        return {}

    def _inner_state(self) -> Any:
        return self.process_group

    def _inner_hook(self) -> Callable[..., Any]:
        return _HOOKS[self.hook_name]

    def register(self, model: DistributedDataParallel) -> None:
        model.register_comm_hook(self, _wrapped_torch_hook)

    def state_dict(self) -> dict[str, Any]:
        return {"stats": vars(self.stats).copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = CommStats(**state["stats"])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "process_group": None}


class PowerSGDHookState(TorchHookState):
    """PyTorch's PowerSGD hook (Vogels et al., NeurIPS 2019) with lgc statistics and checkpoints.

    Args:
        matrix_approximation_rank: rank ``r`` of the ``P Q^T`` approximation (1-4 is typical; higher
            is more accurate and sends more).
        start_powerSGD_iter: dense steps before compressing (PyTorch's default warm-up is 1,000;
            at least 2 is needed so DDP can rebuild its buckets).
        min_compression_rate: tensors that would compress less than this go dense.
        use_error_feedback / warm_start: PowerSGD's error feedback and reuse of ``Q`` across steps.
        batched: use ``batched_powerSGD_hook`` (one matrix per bucket instead of one per tensor:
            faster, less accurate).
        random_seed: seed of the initial ``Q`` (identical on every rank).
    """

    def __init__(
        self,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 10,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        batched: bool = False,
        random_seed: int = 0,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank!r}")
        if start_powerSGD_iter < 2:
            raise ValueError(
                f"start_powerSGD_iter must be >= 2 (DDP rebuilds buckets first), got {start_powerSGD_iter!r}"
            )
        self.hook_name = "batched_powerSGD" if batched else "powerSGD"
        self.stats = CommStats()
        self.process_group = None
        self.batched = batched
        self.options = dict(
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            random_seed=random_seed,
        )
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        self._pending_state: dict[str, Any] | None = None

    def register(self, model: DistributedDataParallel) -> None:
        # Built here, in the worker: PowerSGDState needs the default process group.
        self.powersgd = powerSGD_hook.PowerSGDState(process_group=self.process_group, **self.options)
        if self._pending_state is not None:
            self.powersgd.__setstate__(self._pending_state)
            self._pending_state = None
        super().register(model)

    def _inner_state(self) -> Any:
        return self.powersgd

    def _inner_hook(self) -> Callable[..., Any]:
        return powerSGD_hook.batched_powerSGD_hook if self.batched else powerSGD_hook.powerSGD_hook

    def residual_norm(self) -> float | None:
        if self.powersgd is None or not self.powersgd.error_dict:
            return None
        return float(torch.linalg.vector_norm(torch.stack([e.norm() for e in self.powersgd.error_dict.values()])))

    def state_dict(self) -> dict[str, Any]:
        inner = None
        if self.powersgd is not None:
            inner = {slot: getattr(self.powersgd, slot) for slot in self.powersgd.__slots__ if slot != "process_group"}
        return {"stats": vars(self.stats).copy(), "powersgd": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state["powersgd"] is not None:
            if self.powersgd is None:
                self._pending_state = state["powersgd"]
            else:
                self.powersgd.__setstate__(state["powersgd"])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "process_group": None, "powersgd": None}


def _wrapped_torch_hook(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.stats.hook_calls += 1
    buffer = bucket.buffer()
    state.stats.dense_equivalent_bytes += buffer.numel() * buffer.element_size()
    shim = (
        _batched_orthogonalize_accepts_matrices() if state.hook_name == "batched_powerSGD" else contextlib.nullcontext()
    )
    with _counting_collectives(state.stats), shim:
        future = state._inner_hook()(state._inner_state(), bucket)
        # Finish this bucket's collectives (including those issued from its callbacks) now, so
        # the collective order is identical on every rank.
        result = future.wait()
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(result)
    return done
