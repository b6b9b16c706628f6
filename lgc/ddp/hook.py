"""A DDP communication hook that runs any :class:`~lgc.compressors.Compressor`.

This module (with the other modules of :mod:`lgc.ddp`) is the only place that calls
:mod:`torch.distributed`. It follows PyTorch's own hooks (``ddp_comm_hooks/powerSGD_hook.py``):

1. DDP hands the hook one flat bucket of gradients; the hook divides it by the world size.
2. The first ``start_iter`` iterations use a plain allreduce, as PyTorch's PowerSGD hook does
   while DDP rebuilds its buckets after the first iteration; the iteration counter is saved, so a
   resumed run does not repeat them.
3. A stateful compressor (residuals, momenta, random generators) runs once per *step*, at the
   step's last bucket, after one small allreduce in which the ranks agree on two facts (the
   **step guard**, :meth:`CompressionHookState.agree`):

   * **non-finite gradients**: if any rank has an inf or NaN anywhere in the step, every rank
     allreduces its buckets dense and unchanged (what plain DDP does, so the optimizer or AMP's
     GradScaler sees the inf/NaN on every rank and skips the step), touches no compressor state,
     does not advance the step counter and counts the step in ``stats.skipped_steps``. Training
     afterwards is that of a run in which the step never happened.
   * **unused parameters**: a parameter whose gradient is exactly zero on every rank (unused with
     ``find_unused_parameters=True``, where DDP discards the result anyway) is not compressed: its
     residual and momentum stay as they are and nothing is sent for it.

   Stateless compressors (``none``, ``fp16``) need neither: they run bucket by bucket as the
   buckets become ready, overlapping communication with the backward pass, and an inf or NaN
   simply passes through their sum (the step is counted as skipped all the same).
4. Parameters with fewer than ``min_numel`` elements (biases, norm layers) are allreduced dense,
   in the gradient's dtype (by default the method's own threshold: none for DeMo and SparseLoCo,
   whose references compress every tensor).
5. Every other parameter's gradient is compressed on its own, keyed by the parameter's name, so
   compressor state (residuals, momenta) is independent of DDP's bucketing and survives restarts.
6. Payloads are combined as the compressor declares: one allreduce per dtype for summable
   payloads, or an allgather of one packed byte buffer (sizes exchanged first when they may
   differ) for gatherable ones. Collectives are issued inside the hook, never from ``Future.then``
   callbacks, so every rank issues them in the same order; callbacks only decode.
7. Once a parameter's sum is in the bucket, :meth:`~lgc.compressors.Compressor.finish_aggregate`
   may complete it with a term every rank computes alike and nobody sends (DGC's weight decay
   momentum, which the authors keep in their optimizer). Behind the step guard (compressors with
   state, DGC among them, and every exchange of communication delay) a skipped step or an unused
   parameter does not reach it. Stateless compressors run without the guard, so it is called for
   every parameter of every step, unused ones and non-finite steps included: a stateless
   compressor's ``finish_aggregate`` must keep no state. (Filtering there would need the guard's
   collective, which the stateless path leaves out so that it overlaps the backward pass.)

Bytes are counted against what plain DDP would send: the bucket's own dtype (4 bytes per element
for an fp32 model, 2 for a model in fp16 or bf16).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lgc.compressors.base import CombineMode, Compressor, Payload, method_min_numel
from lgc.ddp import buffers as module_buffers
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.ddp.protocol import HookState

__all__ = [
    "CommStats",
    "agree_flags",
    "all_finite",
    "finite_flag",
    "allreduce_as_they_are",
    "run_holding",
    "CompressionHookState",
    "PayloadExchange",
    "StepVerdict",
    "average_compressed",
    "compression_hook",
    "register_compression_hook",
]


@dataclass
class LayerStats:
    """What one parameter cost on the wire (one worker)."""

    numel: int
    #: Whether the compressor handled it (the last step's answer; LGC's warm-up sends everything dense).
    compressed: bool
    #: Steps it was sent in.
    steps: int = 0
    #: Bytes of it this worker sent (a share of a joint code is booked pro rata, see LGC).
    bytes_sent: int = 0


def _residual_store(compressor: Compressor) -> dict[str, Tensor]:
    """The per-parameter error-feedback memory of ``compressor`` (ErrorFeedback, DGC), if any."""
    for attribute in ("residuals", "velocities"):
        store = getattr(compressor, attribute, None)
        if isinstance(store, dict):
            return store
    inner = getattr(compressor, "compressor", None)
    return _residual_store(inner) if isinstance(inner, Compressor) else {}


class _Segment(NamedTuple):
    """One parameter's gradient inside a bucket's flat buffer."""

    name: str
    offset: int
    numel: int
    compressed: bool


class _BucketLayout(NamedTuple):
    #: Identifies the bucket's content, so a layout is rebuilt when DDP rebuilds its buckets.
    signature: tuple[int, ...]
    segments: tuple[_Segment, ...]


class PendingBucket(NamedTuple):
    """A bucket of the current step, held until the step's last bucket (see the step guard)."""

    buffer: Tensor
    segments: tuple[_Segment, ...]
    #: What the hook returned to DDP for this bucket; completed when the step has run.
    future: torch.futures.Future


class StepVerdict(NamedTuple):
    """What every rank agreed on before a compressed step (:meth:`CompressionHookState.agree`)."""

    #: Some rank has an inf or NaN in the step's gradients: pass the step through, change no state.
    skip: bool
    #: Names of the parameters whose gradient is nonzero on some rank (the others are left alone).
    used: frozenset[str]


class CompressionHookState(HookState):
    """State of :func:`compression_hook` for one worker.

    Args:
        compressor: what to apply to every parameter with at least ``min_numel`` elements,
            e.g. ``ErrorFeedback(TopKCompressor(density=0.01))``.
        min_numel: parameters smaller than this are allreduced dense. ``None`` (default): the
            method's own (:func:`~lgc.compressors.base.method_min_numel`): every parameter for
            DeMo and SparseLoCo's chunked top-k, as their references send; 1,024 otherwise, since
            biases and norm layers are a negligible share of the bytes but sensitive to compression.
        start_iter: iterations of plain allreduce before compressing (at least 1 lets DDP rebuild
            its buckets first, as PyTorch's PowerSGD hook does).
        process_group: the group to communicate in (default: the world).

    With AMP's loss scaling, set ``state.loss_scale = scaler.get_scale`` (``lgc.lit``'s callback
    does): compressors then see unscaled gradients (see :meth:`unscale`).
    """

    unscales_gradients = True

    __slots__ = (
        # hyperparameters
        "compressor",
        "min_numel",
        "start_iter",
        "process_group",
        # internal state
        "iteration",  # steps completed (counted at the last bucket); saved, so resume is exact
        "begun_step",  # the step compressor.begin_step() was last called for
        "seed_shared",  # whether rank 0's shared seed has been broadcast (compressors that need one)
        "param_names",  # data_ptr -> parameter name, filled by attach(); per process, not saved
        "bucket_layouts",  # bucket index -> which parts of the flat buffer are compressed
        "loss_scale",  # returns the loss scale of this step (a GradScaler's get_scale), or None; per process
        "step_scale",  # the loss scale the current step's buckets were divided by
        "pending",  # buckets of the current step, run together at its last bucket (the step guard)
        "nonfinite_lock",  # stateless compressors: guards the skipped-step count set from callbacks
        "nonfinite_step",  # stateless compressors: the last step counted as non-finite
        # stats
        "stats",
        "layer_stats",  # parameter name -> LayerStats (bytes per parameter, for the per-layer table)
        "codec_seconds",  # "encode" / "decode" -> wall seconds spent compressing / decoding; per process
        "buffer_sync",  # the module buffers kept in step (lgc.ddp.buffers.BufferSync), set by register(); per process
    )

    def __init__(
        self,
        compressor: Compressor,
        *,
        min_numel: int | None = None,
        start_iter: int = 1,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be an lgc Compressor, got {compressor!r}")
        if compressor.combine is CombineMode.SERVER:
            raise NotImplementedError(f"{compressor!r} combines via a server, which compression_hook does not run")
        if min_numel is None:
            min_numel = method_min_numel(compressor)
        if int(min_numel) < 0:
            raise ValueError(f"min_numel must be >= 0, got {min_numel!r}")
        if int(start_iter) < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter!r}")
        self.compressor = compressor
        self.min_numel = int(min_numel)
        self.start_iter = int(start_iter)
        self.process_group = process_group
        self.iteration = 0
        self.begun_step = -1
        self.seed_shared = False
        self.param_names: dict[int, str] = {}
        self.bucket_layouts: dict[int, _BucketLayout] = {}
        self.loss_scale: Callable[[], float] | None = None
        self.step_scale = 1.0
        self.pending: list[PendingBucket] = []
        self.nonfinite_lock = threading.Lock()
        self.nonfinite_step = -1
        self.stats = CommStats()
        self.layer_stats: dict[str, LayerStats] = {}
        #: Wall seconds this process spent compressing (``encode``) and decoding (``decode``)
        #: payloads, for benchmarks (``lgc-bench network``); not saved in checkpoints.
        self.codec_seconds = {"encode": 0.0, "decode": 0.0}
        self.buffer_sync: module_buffers.BufferSync | None = None

    def book_layer(self, name: str, numel: int, compressed: bool, nbytes: int) -> None:
        """Count ``nbytes`` of payload (logical bytes) for one parameter in one step."""
        layer = self.layer_stats.get(name)
        if layer is None:
            layer = self.layer_stats[name] = LayerStats(numel, compressed)
        layer.steps += 1
        layer.compressed = compressed
        layer.bytes_sent += nbytes

    def layer_table(self) -> list[dict[str, Any]]:
        """One row per parameter: size, steps, bytes sent, compression ratio and residual norm."""
        residuals = _residual_store(self.compressor)
        rows = []
        for name, layer in self.layer_stats.items():
            dense = 4 * layer.numel * layer.steps
            residual = residuals.get(name)
            rows.append(
                {
                    "layer": name,
                    "numel": layer.numel,
                    "compressed": layer.compressed,
                    "steps": layer.steps,
                    "bytes_sent": layer.bytes_sent,
                    "compression_ratio": dense / layer.bytes_sent if layer.bytes_sent else None,
                    "residual_norm": None if residual is None else float(torch.linalg.vector_norm(residual)),
                }
            )
        return rows

    def attach(self, model: DistributedDataParallel) -> None:
        """Learn the parameter names of ``model`` (compressor state is keyed by them)."""
        self.param_names = {p.data_ptr(): name for name, p in model.module.named_parameters()}
        self.compressor.attach_parameters(dict(model.module.named_parameters()))

    # The HookState interface (lgc.ddp.protocol).
    def describe(self) -> str:
        """What this hook does, for summaries and logs."""
        return repr(self.compressor)

    def set_epoch(self, epoch: int) -> None:
        self.compressor.set_epoch(epoch)

    def residual_norm(self) -> float | None:
        """Norm of the error-feedback residuals, or None for compressors without residuals."""
        norm = getattr(self.compressor, "residual_norm", None)
        return norm() if norm is not None else None

    def metrics(self) -> dict[str, float]:
        """Method-specific metrics to log every step besides ``comm/*`` (LGC: ``lgc/stage``, ...)."""
        return {}

    def summary_extras(self) -> dict[str, Any]:
        """Method-specific fields for this worker's entry in ``summary.json`` (and its per-layer table)."""
        return {"layers": self.layer_table()}

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Attach to ``model`` and register :func:`compression_hook` with this state (``optimizer`` is not needed).

        Module buffers (BatchNorm statistics) go from rank 0 to every rank once per step, counted,
        instead of DDP's broadcast before forward passes (:func:`lgc.ddp.buffers.register_comm_hook`).
        """
        self.attach(model)
        self.buffer_sync = module_buffers.register_comm_hook(model, self, compression_hook)

    def segments(self, names_and_numels: list[tuple[str, int]]) -> tuple[_Segment, ...]:
        """Consecutive segments of a flat buffer; those with at least ``min_numel`` elements are compressed."""
        segments, offset = [], 0
        for name, numel in names_and_numels:
            segments.append(_Segment(name, offset, numel, numel >= self.min_numel))
            offset += numel
        return tuple(segments)

    def layout(self, bucket: dist.GradBucket) -> _BucketLayout:
        """The bucket's segments, cached per bucket index and rebuilt when the bucket changes."""
        params = bucket.parameters()
        signature = (bucket.buffer().numel(), *(p.data_ptr() for p in params))
        cached = self.bucket_layouts.get(bucket.index())
        if cached is not None and cached.signature == signature:
            return cached
        names = [self.param_names.get(param.data_ptr()) for param in params]
        if None in names:
            raise RuntimeError("a bucket holds a parameter the hook state does not know; call attach(model)")
        segments = self.segments([(name, param.numel()) for name, param in zip(names, params, strict=True)])
        total = sum(s.numel for s in segments)
        if total != bucket.buffer().numel():
            raise RuntimeError(f"bucket {bucket.index()} has {bucket.buffer().numel()} elements, parameters {total}")
        layout = _BucketLayout(signature, segments)
        self.bucket_layouts[bucket.index()] = layout
        return layout

    # The state travels to spawned workers and into checkpoints without its process group.
    def __getstate__(self) -> dict[str, Any]:
        slots = [slot for cls in type(self).__mro__ for slot in getattr(cls, "__slots__", ())]
        state = {slot: getattr(self, slot) for slot in slots}
        state.update(process_group=None, param_names={}, bucket_layouts={}, begun_step=-1, seed_shared=False)
        state.update(pending=[], nonfinite_lock=None, nonfinite_step=-1, loss_scale=None, step_scale=1.0)
        state.update(codec_seconds={"encode": 0.0, "decode": 0.0}, buffer_sync=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self.nonfinite_lock = threading.Lock()

    # -- the step guard ---------------------------------------------------------------------------
    @property
    def guards_steps(self) -> bool:
        """Whether compressed steps run behind the step guard (every compressor with state)."""
        return not self.compressor.stateless

    def defer(self, buffer: Tensor, segments: tuple[_Segment, ...], is_last: bool) -> torch.futures.Future[Tensor]:
        """Hold a bucket until the step's last bucket, then run the whole step (:meth:`run_step`)."""
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        self.pending.append(PendingBucket(buffer, segments, future))
        if is_last:
            pending, self.pending = self.pending, []
            run_holding([bucket.future for bucket in pending], lambda: self.run_step(pending))
        return future

    def agree(self, pending: list[PendingBucket]) -> StepVerdict:
        """One small allreduce (MAX of a byte per parameter, plus one) that every rank decides the step by.

        Each rank looks at its own gradients once (``aminmax`` per parameter: finite? nonzero?);
        the reduction tells every rank whether some rank saw an inf or NaN, and which parameters
        have a nonzero gradient on some rank. Its bytes are counted like any other collective's.
        """
        names, extremes = [], []
        for bucket in pending:
            for s in bucket.segments:
                piece = bucket.buffer[s.offset : s.offset + s.numel]
                names.append(s.name)
                extremes.append(torch.stack(torch.aminmax(piece)) if s.numel else piece.new_zeros(2))
        table = torch.stack(extremes).float()
        finite = torch.isfinite(table).all()
        # NaN != 0 is True, so a NaN parameter also counts as used (it is skipped anyway).
        flags = torch.cat([(~finite).reshape(1), (table != 0).any(dim=1)]).to(torch.uint8)
        flags = agree_flags(self.stats, flags, self.process_group)
        used = frozenset(name for name, flag in zip(names, flags[1:].tolist(), strict=True) if flag)
        return StepVerdict(skip=bool(flags[0]), used=used)

    def allreduce_dense(self, pending: list[PendingBucket]) -> None:
        """Every bucket allreduced dense and unchanged (what plain DDP does); their futures completed."""
        allreduce_as_they_are(self.stats, [bucket.buffer for bucket in pending], self.process_group)
        for bucket in pending:
            bucket.future.set_result(bucket.buffer)

    def pass_through(self, pending: list[PendingBucket]) -> None:
        """A skipped step: :meth:`allreduce_dense`, counted in ``skipped_steps``; no state touched."""
        self.allreduce_dense(pending)
        self.stats.skipped_steps += 1

    def run_step(self, pending: list[PendingBucket]) -> None:
        """Run one guarded step over all its buckets and complete their futures.

        Subclasses (LGC) override :meth:`compress_step`; the guard itself is shared.
        """
        verdict = self.agree(pending)
        if verdict.skip:
            self.pass_through(pending)
        else:
            step = self.iteration
            self.compress_step(pending, verdict.used, step)
            self.iteration = step + 1
        if self.step_scale != 1.0:
            # Back to the loss-scaled units the optimizer's GradScaler expects (DDP reads the
            # buffers only after the backward pass, so the futures may already hold them).
            for bucket in pending:
                bucket.buffer.mul_(self.step_scale)

    def unscale(self, buffer: Tensor, world_size: int) -> None:
        """Divide a bucket by the world size and, with a loss scale attached, by the loss scale.

        With AMP's GradScaler the gradients arrive multiplied by a scale that changes during
        training (halved at every overflow, doubled every ``growth_interval`` steps). Compressor
        state accumulated at one scale and added to gradients at another (residuals, DGC's momentum
        and its weight decay) would be weighed wrongly, so compressors see unscaled gradients and
        the result is scaled back (:meth:`run_step`). Powers of two, as GradScaler's scales are,
        divide and multiply exactly.
        """
        self.step_scale = float(self.loss_scale()) if self.loss_scale is not None else 1.0
        buffer.div_(world_size * self.step_scale if self.step_scale != 1.0 else world_size)

    def compress_step(self, pending: list[PendingBucket], used: frozenset[str], step: int) -> None:
        """Average every bucket of a finite step through the compressor (collectives in bucket order)."""
        exchanges = [PayloadExchange(self, b.buffer, b.segments, step, used=used) for b in pending]
        for exchange, bucket in zip(exchanges, pending, strict=True):
            torch.futures.wait_all(exchange.futures)
            bucket.future.set_result(exchange.finish())

    def note_result(self, step: int, result: Tensor) -> Tensor:
        """Stateless compressors: count a step whose averaged gradient is non-finite as skipped."""
        if not all_finite(result):
            with self.nonfinite_lock:
                if self.nonfinite_step != step:
                    self.nonfinite_step = step
                    self.stats.skipped_steps += 1
        return result

    def state_dict(self) -> dict[str, Any]:
        """This worker's state: compressor state (residuals), iteration counter and statistics."""
        return {
            "compressor": self.compressor.state_dict(),
            "iteration": self.iteration,
            "stats": asdict(self.stats),
            "layers": {name: asdict(layer) for name, layer in self.layer_stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.iteration = int(state["iteration"])
        self.stats = CommStats(**state["stats"])
        self.layer_stats = {name: LayerStats(**layer) for name, layer in state["layers"].items()}


def all_finite(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds no inf or NaN, in one pass and without a mask.

    ``torch.aminmax`` propagates NaN and shows an inf at either end; ``torch.isfinite(t).all()``
    writes a boolean mask of the whole tensor first and is about 25x slower on a 100 MB bucket.
    """
    return bool(finite_flag(tensor))


def finite_flag(tensor: Tensor) -> Tensor:
    """:func:`all_finite` as a 0-dim bool tensor on ``tensor``'s device (no device sync)."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def agree_flags(stats: CommStats, flags: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The step guard's collective: the MAX of every rank's ``uint8`` flags, counted, on the CPU.

    Shared by :meth:`CompressionHookState.agree` and the guard of PyTorch's stateful hooks
    (:mod:`lgc.ddp.torch_hooks`), so both decide a step by the same reduction.
    """
    counted.all_reduce(stats, flags, group, op=dist.ReduceOp.MAX).wait()
    return flags.cpu()


def allreduce_as_they_are(stats: CommStats, buffers: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum every buffer dense and unchanged across the group (plain DDP's exchange), counted; blocking."""
    torch.futures.wait_all([counted.all_reduce(stats, buffer, group) for buffer in buffers])


def run_holding(futures: list[torch.futures.Future], run: Callable[[], None]) -> None:
    """Run a step that completes ``futures``; if it raises, fail the ones it left, then re-raise.

    DDP waits for every bucket's future at the end of the backward pass: one left pending would
    hang it instead of reporting the error.
    """
    try:
        run()
    except BaseException as err:
        for future in futures:
            if not future.done():
                future.set_exception(err)
        raise


def _allreduce(state: CompressionHookState, tensor: Tensor) -> torch.futures.Future:
    return counted.all_reduce(state.stats, tensor, state.process_group)


def _allgather(state: CompressionHookState, tensor: Tensor, world_size: int) -> tuple[list[Tensor], Any]:
    return counted.all_gather(state.stats, tensor, state.process_group)


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average one bucket of gradients across workers with ``state.compressor``.

    Register it with :func:`register_compression_hook` rather than directly, so parameter names
    are known.
    """
    world_size = dist.get_world_size(state.process_group)
    buffer = bucket.buffer()
    state.stats.hook_calls += 1
    counted.book_dense_equivalent(state.stats, buffer, state.process_group)
    segments = state.layout(bucket).segments
    iteration = state.iteration

    if iteration < state.start_iter:
        buffer.div_(world_size)
        if bucket.is_last():
            state.iteration += 1
        for segment in segments:
            state.book_layer(segment.name, segment.numel, False, segment.numel * buffer.element_size())
        return _allreduce(state, buffer).then(lambda fut: fut.value()[0])

    state.unscale(buffer, world_size)
    if state.guards_steps:
        return state.defer(buffer, segments, bucket.is_last())
    if bucket.is_last():
        state.iteration += 1
    scale = state.step_scale
    return average_compressed(state, buffer, segments, iteration).then(
        lambda fut: state.note_result(iteration, fut.value() if scale == 1.0 else fut.value().mul_(scale))
    )


def average_compressed(
    state: CompressionHookState, buffer: Tensor, segments: tuple[_Segment, ...], step: int
) -> torch.futures.Future[Tensor]:
    """Sum ``buffer`` (each worker's share, already divided by the world size) across workers.

    Dense segments are allreduced; the others go through ``state.compressor``. The result is
    written into ``buffer``, which the returned future holds. All collectives are issued here, in
    the same order on every rank; the future's callback only decodes. Used by the gradient hook
    and by :mod:`lgc.ddp.local_sgd` for weight updates.
    """
    exchange = PayloadExchange(state, buffer, segments, step)
    return torch.futures.collect_all(exchange.futures).then(lambda _: exchange.finish())


class PayloadExchange:
    """The collectives of one compressed step of one buffer, and the decoding of their results.

    Constructing it compresses every segment and issues all collectives (in the same order on
    every rank); once :attr:`futures` are done, :meth:`finish` writes the sum into ``buffer``.
    For gathered payloads, :attr:`received` then holds every rank's payload of every compressed
    segment (LGC reads the leader's top-k indices from it).
    """

    def __init__(
        self,
        state: CompressionHookState,
        buffer: Tensor,
        segments: tuple[_Segment, ...],
        step: int,
        *,
        used: frozenset[str] | None = None,
    ):
        self.state = state
        self.buffer = buffer
        world_size = dist.get_world_size(state.process_group)
        compressor = state.compressor
        compressor.set_rank(dist.get_rank(state.process_group))
        compressor.set_world_size(world_size)
        if compressor.needs_shared_seed and not state.seed_shared:
            # Once, on every rank at the same point: everyone adopts rank 0's seed.
            seed = torch.tensor([compressor.shared_seed], dtype=torch.int64, device=buffer.device)
            counted.broadcast(state.stats, seed, 0, state.process_group)
            compressor.set_shared_seed(int(seed.item()))
            state.seed_shared = True
        if state.begun_step != step:
            compressor.begin_step(step)
            state.begun_step = step
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
        self.own = [compressor.compress(buffer[s.offset : s.offset + s.numel], s.name) for s in self.sparse]
        state.codec_seconds["encode"] += time.perf_counter() - started
        #: Segment name -> every rank's payload (gathered payloads only; filled by :meth:`finish`).
        self.received: dict[str, list[Payload]] = {}
        for s, payload in zip(self.sparse, self.own, strict=True):
            state.book_layer(s.name, s.numel, True, payload.nbytes)
        for s in self.dense:
            state.book_layer(s.name, s.numel, False, s.numel * buffer.element_size())
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
        self.order: list[tuple[_Segment, Payload | None]] = []
        self.groups: dict[torch.dtype, list[Tensor]] = {}
        for s in sorted((*self.dense, *self.sparse), key=lambda s: s.offset):
            payload = own.get(s.name) if s.compressed else None
            part = buffer[s.offset : s.offset + s.numel] if payload is None else payload.tensors()[0].reshape(-1)
            self.order.append((s, payload))
            self.groups.setdefault(part.dtype, []).append(part)
        self.flats = {dtype: _joined(parts) for dtype, parts in self.groups.items()}
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
            wires = [p.to_wire() for p in self.own]
            local_sizes = torch.tensor([w.numel() for w in wires], dtype=torch.int64, device=buffer.device)
            if state.compressor.variable_size:
                size_lists, work = counted.all_gather(state.stats, local_sizes, state.process_group)
                # Blocking on purpose: the payload allgather below needs the sizes.
                work.wait()
                self.sizes = torch.stack(size_lists).cpu()
            else:
                self.sizes = local_sizes.cpu().expand(world_size, -1)
            max_total = int(self.sizes.sum(dim=1).max())
            packed = torch.cat(wires)
            if packed.numel() < max_total:
                packed = torch.cat([packed, packed.new_zeros(max_total - packed.numel())])
            self.gathered, work = _allgather(state, packed, world_size)
            futures.append(work.get_future())
        return futures

    def finish(self) -> Tensor:
        """Decode the finished collectives into ``buffer`` and return it."""
        started = time.perf_counter()
        try:
            return self._decode()
        finally:
            self.state.codec_seconds["decode"] += time.perf_counter() - started

    def _decode(self) -> Tensor:
        compressor, buffer = self.state.compressor, self.buffer
        if compressor.combine is CombineMode.SUM:
            pieces = {
                dtype: iter(flat.split([p.numel() for p in self.groups[dtype]])) for dtype, flat in self.flats.items()
            }
            for s, payload in self.order:
                target = buffer[s.offset : s.offset + s.numel]
                if payload is None:
                    decoded = next(pieces[buffer.dtype])
                else:
                    (values,) = payload.tensors()
                    summed = next(pieces[values.dtype]).view_as(values)
                    decoded = compressor.decompress(compressor.payload_from_sum(summed, payload)).reshape(-1)
                if decoded.data_ptr() != target.data_ptr():
                    target.copy_(decoded)
                compressor.finish_aggregate(target, s.name)
            return buffer
        if self.dense_flat is not None:
            for s, piece in zip(self.dense, self.dense_flat.split([s.numel for s in self.dense]), strict=True):
                target = buffer[s.offset : s.offset + s.numel]
                target.copy_(piece)
                compressor.finish_aggregate(target, s.name)
        if self.own:
            per_rank = [
                iter(g.split(row.tolist() + [g.numel() - int(row.sum())]))
                for g, row in zip(self.gathered, self.sizes, strict=True)
            ]
            rank = dist.get_rank(self.state.process_group)
            for s, own in zip(self.sparse, self.own, strict=True):
                received = [
                    compressor.payload_from_wire(next(wires_of_rank), s.numel, key=s.name) for wires_of_rank in per_rank
                ]
                _check_round_trip(compressor, own, received[rank])
                self.received[s.name] = received
                target = buffer[s.offset : s.offset + s.numel]
                compressor.aggregate_into(received, target)
                compressor.finish_aggregate(target, s.name)
        return buffer


def _joined(parts: list[Tensor]) -> Tensor:
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


def register_compression_hook(
    model: DistributedDataParallel,
    compressor: Compressor,
    *,
    min_numel: int | None = None,
    start_iter: int = 1,
    process_group: dist.ProcessGroup | None = None,
) -> CompressionHookState:
    """Make ``model`` average its gradients through ``compressor``; works on gloo and NCCL.

    Args:
        model: a :class:`~torch.nn.parallel.DistributedDataParallel` model (any DDP program).
        compressor: e.g. ``ErrorFeedback(TopKCompressor(density=0.01))``.
        min_numel: parameters with fewer elements go dense (``None``: the method's own, see
            :class:`CompressionHookState`).
        start_iter: plain-allreduce iterations before compression starts.
        process_group: group to communicate in (default: the world).

    Returns:
        The hook state: its ``stats`` count bytes; save ``state_dict()`` with every rank's
        checkpoint, because residuals differ between ranks.

    Example::

        >>> model = DistributedDataParallel(net)
        >>> state = register_compression_hook(model, ErrorFeedback(TopKCompressor(density=0.01)))
        >>> ...  # train as usual
        >>> state.stats.compression_ratio
    """
    state = CompressionHookState(compressor, min_numel=min_numel, start_iter=start_iter, process_group=process_group)
    state.register(model)
    return state
