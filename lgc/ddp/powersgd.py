"""PyTorch's PowerSGD hook (Vogels et al., NeurIPS 2019), wrapped as :mod:`lgc.ddp.torch_hooks` wraps the others.

PowerSGD's Gram-Schmidt divides each column of ``P`` and ``Q`` by its norm, which is 0/0 = NaN for a
matrix that is zero on every rank (a layer unused in this step, or unused at the first compressed
step, whose error-feedback buffer is still zero: the NaN reaches the gradients one step later).
The wrapper therefore sets PyTorch's ``orthogonalization_epsilon`` by default, makes the batched hook
(which ignores it) and half precision (where 1e-8 rounds to 0) honour it, and re-draws a warm-started
``Q`` column that such a step left at zero (it would otherwise stay zero, and the layer untrained, for
the rest of the run). The per-tensor hook views every gradient as a matrix of ``shape[0]`` rows, which
fails on a 0-dim gradient (a learnable scalar) and on an empty one: the wrapper hands it such a bucket's
scalars as vectors of one (sent uncompressed, as the hook sends every vector) and leaves the empty ones
out.

The wrapper's byte counts, fixed collective order and step guard are :mod:`lgc.ddp.torch_hooks`'s;
this module adds PowerSGD's checkpoints (its error, ``P``, ``Q`` and random generator) and the
fixes above.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.torch_hooks import TorchHookState, book_all_reduce_of
from lgc.validation import NonNegativeFloat, PositiveInt, check

__all__ = ["PowerSGDHookState"]

#: The first step PowerSGD compresses.
StartIter = Annotated[int, Field(ge=2, description="an integer >= 2 (DDP rebuilds its buckets first)")]
#: The seed of PowerSGD's numpy generator.
RandomSeed = Annotated[int, Field(ge=0, lt=2**32, description="an integer in [0, 2**32) (numpy's RandomState)")]


def _smallest_positive(dtype: torch.dtype) -> float:
    """The smallest positive (subnormal) value of a floating dtype: 2**-24 for float16."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps


@contextlib.contextmanager
def _orthogonalize_with_epsilon(epsilon: float) -> Iterator[None]:
    """Make PyTorch's ``_orthogonalize`` use ``epsilon`` wherever the hooks call it, meanwhile.

    Three gaps in torch 2.14's hooks, closed here without touching the orthogonalization itself:
    ``batched_powerSGD_hook`` calls ``_orthogonalize`` without the state's epsilon (so a zero bucket
    still gives NaN); in float16 an epsilon below 2**-24 (1e-8 included) rounds to 0 when added to
    the norm; and the batched hook passes a 2-D ``Q`` to an ``_orthogonalize`` that only accepts
    batches (3-D) and fails with a bare AssertionError (viewed here as a batch of one).
    """
    original = powerSGD_hook._orthogonalize

    def orthogonalize(matrices: Tensor, epsilon_passed: float = 0) -> None:
        eps = max(epsilon_passed, epsilon)
        if eps > 0:
            eps = max(eps, _smallest_positive(matrices.dtype))
        original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, eps)

    powerSGD_hook._orthogonalize = orthogonalize
    try:
        yield
    finally:
        powerSGD_hook._orthogonalize = original


class _MatrixViews:
    """A DDP bucket whose ``gradients()`` PyTorch's per-tensor hook can view as matrices: a 0-dim gradient (a
    learnable scalar) as a vector of one, which the hook then allreduces uncompressed, and empty ones left out
    (they hold nothing). The hook views every gradient as ``(shape[0], -1)``, which fails on both; the views
    share the bucket's memory, so what the hook writes lands there."""

    __slots__ = ("_bucket",)

    def __init__(self, bucket: dist.GradBucket) -> None:
        self._bucket = bucket

    def gradients(self) -> list[torch.Tensor]:
        return _matrix_gradients(self._bucket)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bucket, name)


class PowerSGDHookState(TorchHookState):
    """PyTorch's PowerSGD hook (Vogels et al., NeurIPS 2019) with lgc statistics and checkpoints.

    Args:
        matrix_approximation_rank: rank ``r`` of the ``P Q^T`` approximation (1-4 is typical; higher
            is more accurate and sends more).
        start_powerSGD_iter: dense steps before compressing (PyTorch's default warm-up is 1,000;
            at least 2 is needed so DDP can rebuild its buckets).
        min_compression_rate: tensors that would compress less than this go dense (``>= 0``; below 1
            even tensors that PowerSGD makes larger are compressed).
        use_error_feedback / warm_start: PowerSGD's error feedback and reuse of ``Q`` across steps.
        batched: use ``batched_powerSGD_hook`` (one matrix per bucket instead of one per tensor:
            faster, less accurate).
        random_seed: seed of the initial ``Q`` (identical on every rank; ``0 <= seed < 2**32``).
        orthogonalization_epsilon: added to each column norm before Gram-Schmidt divides by it, so a
            matrix that is zero on every rank (an unused layer, see the module docstring) gives zero
            instead of NaN. PyTorch's default is 0; 1e-8 is the value its documentation suggests, and
            it is negligible against real column norms (those of ``P = M Q`` are of the order of the
            gradient's norm: a column of norm 1e-4 shrinks by 1e-4 relative, one of norm 1e-2 by
            1e-6). In float16 it is rounded up to 2**-24, the smallest positive value.
            0 reproduces PyTorch's default, NaN included.

    Example::

        >>> state = PowerSGDHookState(matrix_approximation_rank=2, start_powerSGD_iter=1000)
        >>> state.register(ddp_model)  # doctest: +SKIP (in each worker, after init_process_group)
    """

    # PowerSGDState slots that hold hyperparameters: they come from this constructor, never from a
    # checkpoint (a checkpoint's values are checked against them where its buffers depend on them).
    _HYPERPARAMETERS = (
        "matrix_approximation_rank",
        "start_powerSGD_iter",
        "min_compression_rate",
        "orthogonalization_epsilon",
        "use_error_feedback",
        "warm_start",
        "batch_tensors_with_same_shape",
        "compression_stats_logging_frequency",
    )
    # Of those, the ones that decide the sizes of the saved P, Q and error buffers.
    _LAYOUT_HYPERPARAMETERS = ("matrix_approximation_rank", "min_compression_rate")

    guards_steps = True

    def __init__(
        self,
        matrix_approximation_rank: PositiveInt = 1,
        start_powerSGD_iter: StartIter = 10,
        min_compression_rate: NonNegativeFloat = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        batched: bool = False,
        random_seed: RandomSeed = 0,
        orthogonalization_epsilon: NonNegativeFloat = 1e-8,
    ) -> None:
        check("matrix_approximation_rank", matrix_approximation_rank, PositiveInt)
        check("start_powerSGD_iter", start_powerSGD_iter, StartIter)
        check("random_seed", random_seed, RandomSeed)
        check("min_compression_rate", min_compression_rate, NonNegativeFloat)
        check("orthogonalization_epsilon", orthogonalization_epsilon, NonNegativeFloat)
        flags = {"use_error_feedback": use_error_feedback, "warm_start": warm_start, "batched": batched}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        self.hook_name = "batched_powerSGD" if batched else "powerSGD"
        self.stats = CommStats()
        self.process_group = None
        self.batched = batched
        # Plain Python types: they end up in state_dict(), which torch.load(weights_only=True) reads.
        self.options = dict(
            matrix_approximation_rank=int(matrix_approximation_rank),
            start_powerSGD_iter=int(start_powerSGD_iter),
            min_compression_rate=float(min_compression_rate),
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            random_seed=int(random_seed),
            orthogonalization_epsilon=float(orthogonalization_epsilon),
        )
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        self._pending_state: dict[str, Any] | None = None
        # The gradient shapes of each bucket whose PowerSGD state (error, P, Q) is held: after a
        # restart, DDP's first iteration runs on other buckets than the ones the state was built for.
        self._bucket_shapes: dict[int, tuple[tuple[int, ...], ...]] = {}
        # Whether PyTorch's hook compressed the bucket being finished (see _after_bucket), and its
        # total_numel_after_compression before it did (see _book_bucket).
        self._compressed = False
        self._numel_after_before = 0
        # PowerSGD's iteration when its state was restored (None: never): DDP's first iteration after it
        # runs on other buckets, and only that one may (see _powersgd_hook).
        self._restored_iter: int | None = None
        self._reset_step()

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        # Built here, in the worker: PowerSGDState needs the default process group.
        self.powersgd = powerSGD_hook.PowerSGDState(process_group=self.process_group, **self.options)
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None
        super().register(model)

    def _inner_state(self) -> Any:
        return self.powersgd

    def _inner_hook(self) -> Callable[..., Any]:
        return self._powersgd_hook

    def _powersgd_hook(self, state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future:
        """PyTorch's hook, or a plain allreduce while DDP's buckets are not those of the state.

        That happens in the first iteration after a restart (``load_state_dict``): unless it finds
        unused parameters, DDP puts every parameter in one bucket until it rebuilds its buckets after
        that iteration, and the restored error and ``Q`` of bucket 0 would not fit. PyTorch's hook
        avoids this at the start of training with its dense warm-up; this is the same, for one step.
        """
        shapes = _gradient_shapes(bucket)
        held = self._bucket_shapes.get(bucket.index())
        self._numel_after_before = state.total_numel_after_compression
        self._compressed = state.iter >= state.start_powerSGD_iter
        if self._compressed and held is not None and held != shapes:
            if self._restored_iter is None or state.iter > self._restored_iter:
                # Past DDP's first iteration after the restart, its buckets are the ones it keeps: another
                # layout (another ddp.bucket_cap_mb, another model) would leave this bucket dense for good.
                raise ValueError(
                    f"PowerSGD's state holds bucket {bucket.index()} as {len(held)} gradients of shapes "
                    f"{list(held)[:4]}..., DDP's bucket {bucket.index()} now holds {len(shapes)} of shapes "
                    f"{list(shapes)[:4]}...: resume with the DDP settings (ddp.bucket_cap_mb) and model the "
                    "checkpoint was written with"
                )
            self._compressed = False
            state.maybe_increase_iter(bucket)
            group = state.process_group if state.process_group is not None else dist.group.WORLD
            return default_hooks._allreduce_fut(group, bucket.buffer())
        if self.batched:
            return powerSGD_hook.batched_powerSGD_hook(state, bucket)
        odd = any(not shape or 0 in shape for shape in shapes)  # a 0-dim or an empty gradient
        return powerSGD_hook.powerSGD_hook(state, _MatrixViews(bucket) if odd else bucket)  # type: ignore[arg-type]

    def _hook_context(self) -> contextlib.AbstractContextManager[None]:
        return _orthogonalize_with_epsilon(self.options["orthogonalization_epsilon"])

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        """After PyTorch's dense warm-up (``start_powerSGD_iter``)."""
        return int(self.options["start_powerSGD_iter"])

    def _book_bucket(self, bucket: dist.GradBucket, numel: int, dtype: torch.dtype) -> None:
        """A dense bucket: one allreduce of it. A compressed one: its uncompressed tensors (the
        per-tensor hook only, even when there are none), then ``P``, then ``Q``, as PyTorch's hook
        allreduces them."""
        state = self.powersgd
        assert state is not None
        if not self._compressed:
            book_all_reduce_of(self.stats, numel, dtype, self.process_group)
            return
        p, q = state.p_memory_dict[bucket.index()], state.q_memory_dict[bucket.index()]
        if not self.batched:
            uncompressed = state.total_numel_after_compression - self._numel_after_before - p.numel() - q.numel()
            book_all_reduce_of(self.stats, uncompressed, dtype, self.process_group)
        counted.book_all_reduce(self.stats, p, self.process_group)
        counted.book_all_reduce(self.stats, q, self.process_group)

    def _after_bucket(self, bucket: dist.GradBucket) -> None:
        # A Q column that is zero (the layer's matrix was zero on every rank, so P = 0 and Q = M^T P = 0)
        # stays zero under warm start: orthogonalizing it gives 0, then P = M 0 = 0 at every later step.
        # Draw it again, as PyTorch draws a first Q. Q is the allreduced result and the generator's seed
        # comes from the shared RNG, so every rank draws the same columns.
        if not self._compressed:
            return
        self._bucket_shapes[bucket.index()] = _gradient_shapes(bucket)
        state = self.powersgd
        if state is None or not state.warm_start or bucket.index() not in state.q_memory_dict:
            return
        blocks = self._q_blocks(bucket)
        dead = [q.abs().amax(dim=0) == 0 for q in blocks]
        if not blocks or not bool(torch.cat(dead).any()):  # one device sync per bucket
            return
        for q, dead_columns in zip(blocks, dead, strict=True):
            if bool(dead_columns.any()):
                generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
                fresh = torch.randn(q.shape[0], int(dead_columns.sum()), generator=generator, dtype=q.dtype)
                q[:, dead_columns] = fresh.to(q.device)

    def _q_blocks(self, bucket: dist.GradBucket) -> list[Tensor]:
        """Views ``(m, r)`` of each compressed tensor's ``Q`` in ``q_memory_dict[bucket.index()]``.

        Follows the layout of PyTorch's hooks: the batched hook keeps one ``(side, r)`` matrix; the
        per-tensor hook concatenates, grouped by shape in first-seen order, one ``m * r`` block per
        tensor (of shape ``n x m``) that ``_should_compress`` accepts.
        """
        state = self.powersgd
        assert state is not None
        memory = state.q_memory_dict[bucket.index()]
        if self.batched:
            return [memory]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for tensor in _matrix_gradients(bucket):
            n = tensor.shape[0]
            m = tensor.numel() // n
            rank = min(n, m, state.matrix_approximation_rank)
            if powerSGD_hook._should_compress(n, m, rank, state.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append(rank)
        blocks, offset = [], 0
        for (_, m), ranks in by_shape.items():
            for rank in ranks:
                blocks.append(memory[offset : offset + m * rank].view(m, rank))
                offset += m * rank
        if offset != memory.numel():
            warnings.warn(
                f"PowerSGD's Q layout is not the one lgc expects ({offset} != {memory.numel()} elements): "
                "zero Q columns are not re-drawn",
                RuntimeWarning,
                stacklevel=2,
            )
            return []
        return blocks

    def residual_norm(self) -> float | None:
        if self.powersgd is None or not self.powersgd.error_dict:
            return None
        return float(torch.linalg.vector_norm(torch.stack([e.norm() for e in self.powersgd.error_dict.values()])))

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain Python values only, so ``torch.load(weights_only=True)`` reads it.

        ``powersgd`` holds every ``PowerSGDState`` slot but the process group; its numpy RNG (which
        seeds each new ``Q``) is stored as ``_rng_state_dict`` describes.
        """
        inner = None
        if self.powersgd is not None:
            inner = {slot: getattr(self.powersgd, slot) for slot in self.powersgd.__slots__ if slot != "process_group"}
            inner["rng"] = _rng_state_dict(self.powersgd.rng)
        return {
            "stats": vars(self.stats).copy(),
            "batched": self.batched,
            "bucket_shapes": dict(self._bucket_shapes),
            "powersgd": inner,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["powersgd"] is not None:
            saved_batched = state["batched"]
            if saved_batched != self.batched:
                raise ValueError(
                    f"checkpoint was written with batched={saved_batched!r}, this state has batched={self.batched!r}"
                )
            for name in self._LAYOUT_HYPERPARAMETERS:
                if name in state["powersgd"] and state["powersgd"][name] != self.options[name]:
                    raise ValueError(
                        f"checkpoint was written with {name}={state['powersgd'][name]!r}, this state has "
                        f"{self.options[name]!r}: its P, Q and error buffers do not fit"
                    )
        super().load_state_dict(state)
        held = state["bucket_shapes"]
        self._bucket_shapes = {int(i): tuple(tuple(shape) for shape in shapes) for i, shapes in held.items()}
        if state["powersgd"] is not None:
            if self.powersgd is None:
                self._pending_state = state["powersgd"]
            else:
                self._restore(state["powersgd"])

    def _restore(self, inner: dict[str, Any]) -> None:
        # Not PowerSGDState.__setstate__: that resets the process group to the default one. Copies:
        # the hook updates its buffers in place, and the caller's dict must stay the checkpoint.
        assert self.powersgd is not None
        for slot, value in inner.items():
            if slot in self._HYPERPARAMETERS or slot == "process_group":
                continue
            setattr(self.powersgd, slot, _rng_from_state_dict(value) if slot == "rng" else copy.deepcopy(value))
        self._restored_iter = int(self.powersgd.iter)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "process_group": None, "powersgd": None}


def _matrix_gradients(bucket: dist.GradBucket) -> list[Tensor]:
    """The bucket's gradients as the per-tensor hook is handed them (:class:`_MatrixViews`)."""
    return [g.view(1) if g.dim() == 0 else g for g in bucket.gradients() if g.numel()]


def _gradient_shapes(bucket: dist.GradBucket) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(gradient.shape) for gradient in bucket.gradients())


def _rng_state_dict(rng: np.random.RandomState) -> dict[str, Any]:
    """``rng.get_state()`` as a tensor and plain numbers (no numpy objects for ``torch.load`` to refuse)."""
    algorithm, keys, pos, has_gauss, cached_gaussian = rng.get_state(legacy=True)
    return {
        "algorithm": str(algorithm),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _rng_from_state_dict(state: dict[str, Any]) -> np.random.RandomState:
    rng = np.random.RandomState()
    keys = state["keys"].numpy().astype(np.uint32)
    rng.set_state((state["algorithm"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))
    return rng
