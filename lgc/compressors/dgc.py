"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018; arXiv:1712.01887).

DGC is top-k sparsification with error feedback plus four fixes that keep accuracy at a density
of 0.1 % (the paper: 270x-600x compression, ResNet-50's gradient from 97 MB to 0.35 MB per step):

1. **Momentum correction.** Each worker keeps, per tensor, a momentum ``u`` and an accumulator
   ``v`` and selects from ``v``: ``u = m*u + g; v = v + u`` (Nesterov: ``u = m*(u + g);
   v = v + u + g``). DGC owns the momentum, so the optimizer must *not* apply it again
   (``optimizer.momentum=0``). The weight decay (``weight_decay``) is DGC's too, but it is kept
   apart from the gradient as in the authors' code (synxlin/deep-gradient-compression,
   ``dgc/optim/sgd.py``: ``DGCSGD``): a dense momentum of its own, ``d = m*d + wd*w``, that is
   never masked and never sent (every worker computes the same ``d`` from the same weights) and
   is added to every parameter's averaged update (:meth:`DGCCompressor.finish_aggregate`) at every
   compressed step; not at the hook's plain-allreduce steps (``start_iter``, one by default), nor to a
   parameter whose gradient is zero on every rank that step (the step guard leaves it out as unused).
2. **Momentum factor masking.** After sending, ``u`` and ``v`` are zeroed at the sent positions,
   so stale momentum does not keep pushing coordinates that were just updated.
3. **Local gradient clipping** (for RNNs; off by default): each worker clips its own gradient
   before accumulating it, with the threshold scaled by ``N**-0.5``.
4. **Warm-up.** The density falls exponentially over the first epochs (25 %, 6.25 %, 1.5625 %,
   0.39 %, then the final density), so the early, fast-changing gradients are sent densely. The
   epoch comes from :meth:`DGCCompressor.set_epoch` (``lgc-train`` calls it every epoch) or,
   given ``steps_per_epoch``, from the hook's step counter; a warm-up that neither can advance is
   refused at the first compressed step rather than left at 25 % for the whole run.

The top-k threshold is estimated from a strided sample instead of a full top-k, as the paper and
its authors' code do (see :func:`lgc.compressors.selection.sampled_topk` for the exact rule); the
sample's start is drawn per parameter and step from ``(seed, step count, name)``, so one
parameter's draws do not depend on which others a step compressed. That lets the DDP hook's
``overlap`` encode each bucket as it arrives, its momentum and accumulator written into second
buffers and committed once the ranks agree on the step (:meth:`DGCCompressor.compress_pending`),
bitwise as the held step. The accumulator ``v`` *is*
the error-feedback residual, so DGC is never wrapped in :class:`lgc.compressors.ErrorFeedback`.

**When DGC is exactly momentum SGD.** With density 1 and momentum factor masking *off*, every
step going through the compressor (the hook's ``start_iter=0``), everything is sent and ``v`` is
emptied every step, so the sent update is ``u``; with the decay's momentum ``d`` added,
DGC + ``SGD(momentum=0, weight_decay=0)`` equals ``SGD(momentum=m, nesterov=..., weight_decay=wd)``
step for step (to rounding), by linearity. With masking *on* (the default) at density 1 every
position is sent, so ``u`` is zeroed every step: the gradient steps without momentum, while the
decay keeps its own (it is never masked), i.e. ``w -= lr * (g + d)``. The authors' code treats
density 1 as "no compression" instead (plain momentum, no masking), which is lgc's density 1
with ``momentum_masking=False``. Below density 1 masking is what keeps accuracy; the warm-up
never lowers a density below ``density``, so at density 1 it changes nothing.

**Where lgc departs from the authors' code.** Which tensors are compressed: the authors compress
every tensor with more than one dimension and send the others dense (with plain momentum on the
average); lgc's hook decides by size (``min_numel``) and sends the smaller ones dense, with
the same momentum (:meth:`DGCCompressor.apply_momentum`). Density 1: see above. The sampled
threshold is the code's (``dgc/compression.py``: its sample sizes and strides on every tensor, at
least ``2 / density`` entries sampled, the count adapted within ``[0.8 k, 1.3 k]`` and cut to the first
``k`` by position; :func:`~lgc.compressors.selection.sampled_topk`), with one guard: a selection
left empty (only with NaN) sends an exact top-k. ``exact_below_numel`` (0, off, by default) can
send smaller tensors an exact top-k instead. The warm-up densities are the paper's; the
authors' CIFAR configuration (``configs/dgc/wm5.py``) computes five epochs at
``density ** ((e + 1) / 6)`` instead (31.6 %, 10 %, 3.16 %, 1 %, 0.316 % for 0.1 %). A parameter
whose gradient is exactly zero on every rank is left alone by the hook (no update, no decay that
step), where the authors' optimizer would still decay it.

Why one module: DGC's parts (the sampled threshold, momentum correction and factor masking, the
weight decay's momentum of its own, local clipping, the density warm-up) and where it departs from
its authors' code act on the same per-parameter accumulators within one compress call, in the order
the authors' code runs them, and are checked together against that code; the selection kernel is
:mod:`lgc.compressors.selection`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import torch
from pydantic import Field
from torch import Tensor

from lgc.compressors.base import (
    OPTIMIZER_SOURCES,
    CombineMode,
    Compressor,
    HoldsSteps,
    Payload,
    keyed_seed,
)
from lgc.compressors.segment_sampled import sampled_topk_segments
from lgc.compressors.segments import BucketFlats, CodesBuckets, FlatGroup, one_bucket
from lgc.compressors.selection import ColumnScan, SelectionInfo, exact_topk, sampled_topk
from lgc.compressors.topk import (
    ScatterAddAggregation,
    SparsePayload,
    index_dtype_for,
    num_selected,
    segment_starts,
)
from lgc.validation import (
    Density,
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveFraction,
    PositiveInt,
    Seed,
    check,
)

__all__ = ["PAPER_WARMUP_DENSITIES", "DGCCompressor", "StepsPerEpoch"]

#: The paper's warm-up densities, one per epoch (an exponential decay by 4x towards 0.1 %).
PAPER_WARMUP_DENSITIES: tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.00390625)
#: Optimizer steps per epoch, for a warm-up that follows the hook's step counter.
StepsPerEpoch = Annotated[
    int, Field(ge=1, description="a positive integer (optimizer steps per epoch, e.g. len(train_loader))")
]


class DGCCompressor(HoldsSteps, CodesBuckets, ScatterAddAggregation, Compressor):
    """Deep Gradient Compression: momentum-corrected, masked, warmed-up top-k (Lin et al. 2018).

    Per tensor (``key``, the parameter name in the DDP hook) the compressor keeps the momentum
    ``u`` and the accumulator ``v`` and, per step:

    1. optionally clips the incoming gradient ``g`` to norm ``clip_norm / sqrt(world_size)``;
    2. momentum correction: ``u = m*u + g; v = v + u`` (Nesterov: ``u = m*(u + g); v = v + u + g``);
    3. selects about ``k = ceil(density * n)`` entries of ``v`` with :func:`sampled_topk`;
    4. sends them as a :class:`~lgc.compressors.topk.SparsePayload` (fp32 value + int32 index,
       8 bytes per entry) and zeroes ``v`` there (so ``v_before == decoded + v_after`` exactly) and,
       with momentum factor masking, ``u`` too;
    5. once the workers' payloads are summed (the averaged sparse update ``a``), adds the weight
       decay's momentum: ``d = m*d + wd*w`` and ``a + d`` (Nesterov: ``a + wd*w + m*d``), in
       :meth:`finish_aggregate`, for compressed and dense tensors alike.

    ``v`` is the error-feedback residual: do not wrap DGC in :class:`~lgc.compressors.ErrorFeedback`
    (``error_feedback: false`` in the yaml). The sampled threshold makes the number of entries
    differ between workers (``variable_size``): the hook exchanges sizes before its allgather.

    **Weight decay as the authors apply it.** Their optimizer (``DGCSGD`` in
    synxlin/deep-gradient-compression, ``dgc/optim/sgd.py``) keeps ``wd * w`` in a momentum buffer
    of its own, ``d = m*d + wd*w`` (``d = wd*w`` at the first step), and steps
    ``w -= lr * (d + received)`` (Nesterov: ``w -= lr * (wd*w + m*d + received)``), while its
    memory (``dgc/memory.py``) momentum-corrects the gradient alone. ``d`` is dense, never masked
    and never sent: it depends only on the weights, which every worker shares, so every worker
    computes the same ``d`` and the decay costs no bytes. lgc does the same: ``d`` lives here
    (checkpointed with the rest), :meth:`finish_aggregate` adds it to each parameter's averaged
    update after the exchange, and the optimizer is plain SGD. Were the decay added to ``g``
    instead, masking would zero its momentum wherever entries are sent (at density 1: everywhere,
    about 1/10 of the decay at ``m = 0.9``) and below density 1 it would wait in ``v`` with the
    gradient, so the weights the top-k never picks would not decay at all.

    **The optimizer must apply neither momentum nor weight decay**: use
    ``torch.optim.SGD(momentum=0, nesterov=False, weight_decay=0)`` and give the decay to the
    compressor (``weight_decay``); :meth:`DGCCompressor.check_optimizer` refuses momentum in both
    places, and decay in both places. Decay left in the optimizer (``weight_decay=0`` here) acts
    without momentum: at equilibrium the momentum multiplies the gradient by ``1 / (1 - m)`` but
    not the decay, so its effective strength is ``(1 - m) * wd``, 10x weaker than in momentum SGD
    at ``m = 0.9``. The paper also warms the learning rate up; that belongs to the scheduler
    (``scheduler=warmup_multistep``).

    Weight decay needs the weights: :meth:`attach_parameters` receives them by name (the hook calls
    it from :meth:`~lgc.ddp.CompressionHookState.attach`; a plain script calls it itself). The
    mapping is neither pickled nor checkpointed: every process attaches its own model.

    Interplay with :func:`lgc.ddp.register_compression_hook`: the hook divides the gradient by the
    world size *before* :meth:`compress`, so ``u`` and ``v`` hold this worker's share of the mean
    gradient and the aggregate (a scatter-add over workers) is the mean's sparse update. Tensors
    below the hook's ``min_numel`` are allreduced dense and never reach :meth:`compress`; the hook
    passes them through :meth:`transform_dense` (:meth:`apply_momentum`), so they get the same
    momentum, and :meth:`finish_aggregate` gives them the same decay. The decay's momentum advances
    only in steps the hook completes: not in a step it passes through for an inf/NaN, not for a
    parameter whose gradient is zero on every rank, and not in its ``start_iter`` plain-allreduce
    iterations, which bypass DGC entirely, without momentum or decay (the first step's gradient
    then never enters ``u``; with one such step the difference is ``m**t * g_0``). Under
    communication delay (:mod:`lgc.ddp.local_sgd`) the exchanges carry weight updates, which the
    local optimizer's decay already shaped: DGC's own decay is refused there.

    Args:
        density: final fraction of entries sent, in (0, 1]; the paper uses 0.001 (0.1 %). With
            momentum correction and masking, 0.001 trains ResNets on CIFAR-10 and ImageNet to dense
            accuracy; raise it to 0.01 for small models or few steps per epoch.
        momentum: momentum factor ``m`` in [0, 1) (0.9 in the paper). Set what you would have set
            on the optimizer; ``0`` turns DGC into top-k with error feedback (no ``u`` is kept).
        nesterov: Nesterov momentum correction, matching ``torch.optim.SGD(nesterov=True)``.
        momentum_masking: zero ``u`` as well as ``v`` at the sent positions (the paper's momentum
            factor masking). Keep it on; off, stale momentum overshoots on sent coordinates.
        clip_norm: local gradient clipping threshold in units of the *averaged* gradient (the
            value you would give ``clip_grad_norm_`` without compression), or ``None`` (off, the
            paper's default except for RNNs). Each worker clips the tensor it is given (already
            divided by the world size) to ``clip_norm * world_size**-0.5``. Clipping is per tensor,
            because a compressor sees one tensor at a time.
        weight_decay: L2 weight decay ``wd >= 0`` with a momentum of its own, added to every used
            parameter's averaged update at every compressed step (see above); the value you would give
            ``torch.optim.SGD(weight_decay=...)``, which must then be 0. Needs
            :meth:`attach_parameters`. ``0`` (the default) adds none.
        world_size: number of workers ``N`` the hook divides the gradient by: scales ``clip_norm``.
            ``None`` (the default): the hook's process group sets it (:meth:`set_world_size`), 1 outside
            a hook; a number given must be the process group's size (else refused at registration).
        warmup_densities: density per warm-up epoch; from epoch ``len(warmup_densities)`` on,
            ``density`` is used (a warm-up value below ``density`` counts as ``density``). The
            default is the paper's ``[0.25, 0.0625, 0.015625, 0.00390625]`` (4 epochs); ``[]`` disables
            warm-up. Stretch it (repeat values) when epochs are short; the paper's schedule assumes
            ~100+ epochs.
        steps_per_epoch: optimizer steps per epoch: the warm-up then follows the hook's step
            counter (epoch ``step // steps_per_epoch``, counted from the first step, the hook's
            plain-allreduce ones included, skipped inf/NaN steps not; under communication delay,
            one step per exchange), and :meth:`set_epoch` does not move it. ``None`` (the default):
            the epoch is what :meth:`set_epoch` was last told (``lgc-train`` tells it at the start
            of every epoch). With neither, a warm-up is refused at the first compressed step: it
            would stay at its first density for the whole run.
        sample_fraction: minimum fraction of entries sampled to estimate the threshold, in (0, 1]
            (1 % by default). A larger sample gives counts closer to ``k`` (the count's relative
            spread is about ``1 / sqrt(density * sample size)``) at the cost of a larger gather.
        exact_below_numel: tensors with fewer entries use an exact ``torch.topk`` (exactly ``k``
            entries) instead of the authors' sampled threshold; 0 (the default) samples every
            tensor as the authors do.
        seed: seed of the sample's start, drawn per parameter and step (:class:`_SampleStart`).

    ``bucketed`` (an attribute, :class:`~lgc.compressors.segments.CodesBuckets`) chooses where
    :meth:`compress_many` encodes a bucket at once: a GPU by default, everywhere with ``True``.

    Example::

        >>> dgc = DGCCompressor(density=0.01, warmup_densities=[])
        >>> payload = dgc.compress(torch.randn(100_000), key="w")
        >>> 800 <= payload.values.numel() <= 1300, payload.nbytes == 8 * payload.values.numel()
        (True, True)
    """

    combine = CombineMode.GATHER
    variable_size = True
    keeps_own_residual = True
    transforms_dense = True

    def __init__(
        self,
        density: Density = 0.001,
        momentum: Momentum = 0.9,
        *,
        nesterov: bool = False,
        momentum_masking: bool = True,
        clip_norm: PositiveFloat | None = None,
        weight_decay: NonNegativeFloat = 0.0,
        world_size: PositiveInt | None = None,
        warmup_densities: Sequence[float] = PAPER_WARMUP_DENSITIES,
        steps_per_epoch: StepsPerEpoch | None = None,
        sample_fraction: PositiveFraction = 0.01,
        exact_below_numel: NonNegativeInt = 0,
        seed: int = 0,
    ) -> None:
        check("density", density, Density)
        check("momentum", momentum, Momentum)
        check("clip_norm", clip_norm, PositiveFloat | None)
        check("weight_decay", weight_decay, NonNegativeFloat)
        check("world_size", world_size, PositiveInt | None)
        # Hydra hands over a ListConfig, a Sequence of plain values: checked as the list it is.
        if isinstance(warmup_densities, Sequence) and not isinstance(warmup_densities, str):
            warmup_densities = list(warmup_densities)
        check("warmup_densities", warmup_densities, list[Density])
        check("sample_fraction", sample_fraction, PositiveFraction)
        check("exact_below_numel", exact_below_numel, NonNegativeInt)
        check("steps_per_epoch", steps_per_epoch, StepsPerEpoch | None)
        self.density = float(density)
        self.momentum = float(momentum)
        self.nesterov = check("nesterov", nesterov, bool)
        self.momentum_masking = check("momentum_masking", momentum_masking, bool)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.weight_decay = float(weight_decay)
        #: The world size given to the constructor (None: the hook's).
        self.given_world_size = world_size
        self.world_size = 1 if world_size is None else int(world_size)
        self.warmup_densities = tuple(float(d) for d in warmup_densities)
        self.steps_per_epoch = steps_per_epoch
        self.sample_fraction = float(sample_fraction)
        self.exact_below_numel = int(exact_below_numel)
        self.seed = check("seed", seed, Seed)
        #: Epoch of the schedule and its density (a warm-up value until the warm-up is over).
        self.epoch = 0
        self.current_density = self.density
        self._schedule(0)
        #: Whether this process called :meth:`set_epoch` (per process: a restored epoch does not count).
        self._epoch_told = False
        #: Per-key momentum ``u`` (fp32; absent when ``momentum == 0``).
        self.momenta: dict[str, Tensor] = {}
        #: Per-key accumulator ``v``: the unsent, momentum-corrected gradient (the residual).
        self.velocities: dict[str, Tensor] = {}
        #: Per-key momentum of tensors sent dense (see :meth:`apply_momentum`).
        self.dense_momenta: dict[str, Tensor] = {}
        #: Per-key momentum ``d`` of the weight decay (fp32; the same on every worker, never sent).
        self.decay_momenta: dict[str, Tensor] = {}
        #: How the last :meth:`compress` selected its entries (diagnostics; not saved).
        self.last_selection: SelectionInfo | None = None
        #: Per-key count of the steps that key was compressed in: with ``seed`` and the key it
        #: draws the sampled threshold's start (:class:`_SampleStart`), so a key's draws do not
        #: depend on which other keys a step compressed (the hook's overlap encodes a parameter
        #: before knowing whether some rank uses it).
        self.draws: dict[str, int] = {}
        #: A step encoded ahead of the ranks' agreement (:meth:`compress_pending`): key -> the held
        #: (accumulator, momentum or None), until :meth:`commit`.
        self._pending: dict[str, tuple[Tensor, Tensor | None]] = {}
        #: The dense tensors' momenta of a step held so (:meth:`transform_dense_pending`): key -> new ``u``.
        self._dense_pending: dict[str, Tensor] = {}
        #: Second buffers the held steps are written into, per (key, "v" or "u") (never saved).
        self._spares: dict[tuple[str, str], Tensor] = {}
        #: Buckets' accumulators (and momenta) as flats (:meth:`compress_many`) and their held steps' second
        #: flats (:meth:`compress_pending_many`); never saved.
        self._buckets = BucketFlats()
        #: The schedule (epoch, density) before the last :meth:`begin_step`, until a held step commits.
        self._before_step: tuple[int, float] | None = None
        #: The model's parameters by name (:meth:`attach_parameters`), read by the weight decay.
        #: Per process: never pickled (:meth:`__getstate__`) nor checkpointed (:meth:`state_dict`).
        self._parameters: Mapping[str, Tensor] | None = None

    def optimizer_settings_needed(self) -> tuple[str, ...]:
        return ("momentum", "weight_decay") if self.weight_decay > 0 else ("momentum",)

    def check_optimizer(
        self, momentum: float, weight_decay: float | None, *, sources: tuple[str, str] = OPTIMIZER_SOURCES
    ) -> None:
        """Refuse momentum in the optimizer, and weight decay there while DGC applies its own.

        DGC's momentum correction already sends heavy-ball updates; momentum in the optimizer as
        well would apply it twice. A DGC with ``weight_decay > 0`` adds the decay (with its own
        momentum) to the averaged update; decay in the optimizer as well would apply it twice.
        (Error feedback around it is refused where it is built: DGC declares
        ``keeps_own_residual``.) Wrappers and hook states forward the call here, so
        ``state.check_optimizer(...)`` is the one set of rules ``lgc-train`` and ``lgc.compress``
        apply.

        Args:
            momentum: the optimizer's momentum factor.
            weight_decay: the optimizer's weight decay; ``None`` skips that check.
            sources: where the two values come from, named in the messages.

        Raises:
            ValueError: on a nonzero optimizer momentum, or a nonzero optimizer weight decay while
                DGC applies its own.
        """
        momentum_source, decay_source = sources
        momentum = float(momentum)
        if momentum != 0.0:
            raise ValueError(
                f"DGC applies momentum itself (momentum correction, DGC's momentum={self.momentum}), but the "
                f"optimizer applies momentum too ({momentum_source}={momentum:g}), so it would be applied twice: set "
                "the optimizer's momentum to 0 (and nesterov off; lgc-train: optimizer.momentum=0) and give the "
                f"momentum to DGC (lgc-train: compressor.momentum={momentum:g}; "
                f"lgc.compress(model, 'dgc', momentum={momentum:g}))"
            )
        if weight_decay is not None and float(weight_decay) != 0.0 and self.weight_decay > 0.0:
            raise ValueError(
                f"weight decay in the optimizer ({decay_source}={float(weight_decay):g}) and in DGC "
                f"(weight_decay={self.weight_decay:g}) would be applied twice: set the optimizer's weight_decay to 0 "
                "(lgc-train: optimizer.weight_decay=0; DGC gives the decay a momentum of its own, as "
                "SGD(momentum, weight_decay) and DGC's authors do), or DGC's to 0 "
                "(lgc-train: compressor.weight_decay=0) to keep the decay in the optimizer, where it acts outside the "
                "momentum, (1 - momentum) times as strong"
            )

    # -- what the hook tells the compressor ------------------------------------------------------
    def attach_parameters(self, parameters: Mapping[str, Tensor]) -> None:
        """Keep the model's parameters by name (the ``key`` of :meth:`compress`) for the weight decay."""
        self._parameters = parameters

    def set_world_size(self, world_size: PositiveInt) -> None:
        """Number of workers the hook divides gradients by (scales ``clip_norm``); a ``world_size`` given to the
        constructor must be this one."""
        check("world_size", world_size, PositiveInt)
        if self.given_world_size is not None and self.given_world_size != world_size:
            raise ValueError(
                f"DGC world_size={self.given_world_size}, but the hook's process group has {world_size} workers: "
                "leave world_size unset under a hook (it is the process group's)"
            )
        self.world_size = int(world_size)

    def __getstate__(self) -> dict[str, Any]:
        # The parameters belong to this process's model: a spawned worker or a pickled checkpoint
        # must not carry (or share) them; the worker's hook attaches its own.
        state = self.__dict__.copy()
        state["_parameters"] = None
        # Second buffers are scratch and a held step belongs to this process: neither travels.
        state["_pending"], state["_dense_pending"], state["_spares"], state["_before_step"] = {}, {}, {}, None
        state["_buckets"] = BucketFlats()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(
            {
                "_pending": {},
                "_dense_pending": {},
                "_spares": {},
                "draws": {},
                "_before_step": None,
                "given_world_size": None,
                **state,
            }
        )
        self._buckets = BucketFlats()

    # -- schedule --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Pick the warm-up density of ``epoch`` (``density`` once the warm-up is over).

        With ``steps_per_epoch`` the hook's step counter sets the epoch instead, and this only
        notes the call (``lgc-train`` calls it every epoch whatever the compressor).
        """
        self._epoch_told = True
        if self.steps_per_epoch is None:
            self._schedule(epoch)

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        """After the density warm-up: its epochs of ``steps_per_epoch`` steps (DGC's own, where it was given one)."""
        return len(self.warmup_densities) * (self.steps_per_epoch or steps_per_epoch)

    def begin_step(self, step: int) -> None:
        """Follow the step counter (``steps_per_epoch``), or refuse a warm-up nothing advances.

        The hook calls it before the first tensor of every compressed step, on every rank alike.
        """
        # What a dropped held step restores (drop), cleared when a held step commits.
        self._before_step = (self.epoch, self.current_density)
        if self.steps_per_epoch is not None:
            self._schedule(step // self.steps_per_epoch)
        elif not self._epoch_told and self.current_density > self.density:
            raise RuntimeError(
                f"DGC's density warm-up ({', '.join(f'{d:g}' for d in self.warmup_densities)}, one per epoch, then "
                f"density={self.density:g}) is at epoch {self.epoch} and nothing advances it: without steps_per_epoch "
                "its epoch comes from set_epoch, which this program never called, so it would send "
                f"{self.current_density:.4g} of every gradient for the whole run. Pass steps_per_epoch=<optimizer "
                "steps per epoch, e.g. len(train_loader)> (lgc.compress(model, 'dgc', steps_per_epoch=...) or "
                "DGCCompressor(steps_per_epoch=...)), or call state.set_epoch(epoch) at the start of every epoch, "
                "or pass warmup_densities=[] to start at the final density"
            )

    def _schedule(self, epoch: int) -> None:
        self.epoch = int(epoch)
        warmup = self.warmup_densities
        # A warm-up never sends less than the final density (the paper's schedule only falls).
        in_warmup = 0 <= self.epoch < len(warmup)
        self.current_density = max(warmup[self.epoch], self.density) if in_warmup else self.density

    # -- per-tensor state ------------------------------------------------------------------------
    def _buffer(self, store: dict[str, Tensor], key: str, like: Tensor) -> Tensor:
        """``store[key]``, created as fp32 zeros on first use and moved to ``like``'s device (resume)."""
        buffer = store.get(key)
        if buffer is None:
            buffer = store[key] = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        elif buffer.numel() != like.numel():
            raise ValueError(f"key {key!r} had {buffer.numel()} elements, now {like.numel()}")
        elif buffer.device != like.device:
            buffer = store[key] = buffer.to(like.device)
        return buffer

    def _clipped(self, grad: Tensor) -> tuple[Tensor, float]:
        """``grad`` as fp32 and the factor that clips it (1.0 without clipping)."""
        grad = grad.reshape(-1).float()
        if self.clip_norm is None:
            return grad, 1.0
        limit = self.clip_norm / math.sqrt(self.world_size)
        norm = float(torch.linalg.vector_norm(grad))
        # The same rule as torch.nn.utils.clip_grad_norm_ (the 1e-6 guards a zero norm).
        return grad, min(1.0, limit / (norm + 1e-6))

    def _weights(self, key: str, like: Tensor) -> Tensor:
        """The flat weights of ``key`` (``like``'s size), which the weight decay acts on."""
        if self._parameters is None:
            raise ValueError(
                f"DGC's weight_decay={self.weight_decay} needs the model's weights, but none were attached: "
                "the DDP hook attaches them (CompressionHookState.attach / register_compression_hook); "
                "a script calling compress() itself must call attach_parameters(dict(model.named_parameters())) first"
            )
        weight = self._parameters.get(key)
        if weight is None:
            raise ValueError(
                f"DGC's weight decay got an update for {key!r} but no parameter of that name was attached "
                f"({len(self._parameters)} were, e.g. {next(iter(self._parameters), None)!r})"
            )
        if weight.numel() != like.numel():
            raise ValueError(f"parameter {key!r} has {weight.numel()} elements but its update {like.numel()}")
        return weight.detach().reshape(-1)

    def _accumulate(
        self, u: Tensor | None, v: Tensor, grad: Tensor, scale: float, u_out: Tensor | None, v_out: Tensor
    ) -> None:
        """Momentum correction on one span: ``u' = m*u + g; v' = v + u'`` (or the variants); ``g = scale*grad``.

        Written into ``u_out`` and ``v_out``: ``u`` and ``v`` themselves (in place), or second
        buffers for a step held until the ranks agree (:meth:`compress_pending`), by the same
        operations either way, so both give the same bits.
        """
        if u is None or u_out is None:
            # No momentum: u would be g every step, so v += g is all there is (top-k with EF).
            torch.add(v, grad, alpha=scale, out=v_out)
        elif self.nesterov:
            torch.add(u, grad, alpha=scale, out=u_out).mul_(self.momentum)
            torch.add(v, u_out, out=v_out).add_(grad, alpha=scale)
        else:
            if scale == 1.0:
                # One fused pass: g + m*u as an FMA (1 ulp from torch.optim.SGD's mul_ then add_).
                torch.add(grad, u, alpha=self.momentum, out=u_out)
            else:
                torch.mul(u, self.momentum, out=u_out).add_(grad, alpha=scale)
            torch.add(v, u_out, out=v_out)

    def compress(self, tensor: Tensor, key: str) -> SparsePayload:
        payload, _ = self._compress(tensor, key, held=False)
        self.draws[key] = self.draws.get(key, 0) + 1
        return payload

    # -- a bucket at once (CodesBuckets) -----------------------------------------------------------

    def segments_supported(self) -> bool:
        """The bucket path covers the authors' rule: local clipping (a norm per tensor) and
        ``exact_below_numel`` (another selection for small tensors) take the per-tensor loop."""
        return self.clip_norm is None and self.exact_below_numel == 0

    def compress_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """A bucket's tensors at once where :meth:`batches_on` says so (a GPU by default), else :meth:`compress` each.

        The accumulators and momenta of the bucket's tensors become slices of one flat each (built
        when the bucket is first seen, or when a state was replaced since: a checkpoint loaded, a
        held step committed; ``velocities[key]`` stays each tensor's accumulator, so checkpoints
        keep one tensor per key). Then, whatever the number of tensors: the momentum correction
        as one operation over each flat (:meth:`_accumulate`, the per-tensor path's arithmetic),
        every tensor's sampled threshold, survivors and count adaptation together
        (:func:`~lgc.compressors.segment_sampled.sampled_topk_segments`, each tensor drawing its
        sample's start as :meth:`compress` would), one gather of the sent values and one
        ``index_fill_`` of each flat (momentum factor masking). The payloads and the state are
        :meth:`compress`'s, bit for bit, but for the order of a payload's pairs where a tensor's
        survivors are cut to ``k`` (largest first here) and which of several entries tied at that
        cut is sent. ``last_selection`` is left ``None``: there is no one tensor's selection.
        """
        if not self._bucket_path(tensors, keys):
            return super().compress_many(tensors, keys)
        payloads, _ = self._encode_bucket(tensors, keys, held=False)
        for key in keys:
            self.draws[key] = self.draws.get(key, 0) + 1
        return payloads

    def compress_pending_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """:meth:`compress_many`'s payloads, the step held aside until :meth:`commit` (the hook's one message per step).

        The momentum correction writes into a second pair of flats (kept from the bucket's last
        held step), the selection and masking act there, and :meth:`commit` adopts them
        as the bucket's state when every tensor of it was used; otherwise each used key takes its
        slice and the next bucket step builds the flats anew. A key met first in a held step has
        no state until it commits, as in :meth:`compress_pending`.
        """
        if not self._bucket_path(tensors, keys):
            return super().compress_pending_many(tensors, keys)
        payloads, held = self._encode_bucket(tensors, keys, held=True)
        assert held is not None
        momenta = held.views[1] if len(held.views) > 1 else [None] * len(keys)
        for key, v, u in zip(keys, held.views[0], momenta, strict=True):
            self._pending[key] = (v, u)
        return payloads

    def _encode_bucket(
        self, tensors: Sequence[Tensor], keys: Sequence[str], *, held: bool
    ) -> tuple[list[Payload], FlatGroup | None]:
        """One step of DGC for a bucket: in its flats, or (``held``) into second flats returned with the payloads."""
        stores = [self.velocities] if self.momentum == 0.0 else [self.velocities, self.momenta]
        state, _ = self._buckets.group(stores, tensors, keys, held=held)
        out = self._buckets.spare(state, keys) if held else state
        (v, u), (out_v, out_u) = _accumulator_and_momentum(state), _accumulator_and_momentum(out)
        grad = torch.cat([t.reshape(-1) for t in tensors]).float()
        self._accumulate(u, v, grad, 1.0, out_u, out_v)
        numels = state.numels
        ks = [num_selected(numel, self.current_density) for numel in numels]
        rngs = [_SampleStart(self.seed, key, self.draws.get(key, 0)) for key in keys]
        positions, counts = sampled_topk_segments(
            out_v, numels, ks, density=self.current_density, sample_fraction=self.sample_fraction, rngs=rngs
        )
        values = out_v.index_select(0, positions)
        out_v.index_fill_(0, positions, 0.0)
        if out_u is not None and self.momentum_masking:
            out_u.index_fill_(0, positions, 0.0)
        self.last_selection = None
        local = positions - segment_starts(numels, counts, positions.device)
        payloads: list[Payload] = []
        for numel, value, index in zip(numels, values.split(counts), local.split(counts), strict=True):
            payloads.append(SparsePayload(numel=numel, values=value, indices=index.to(index_dtype_for(numel))))
        return payloads, (out if held else None)

    def _bucket_path(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> bool:
        """Whether :meth:`compress_many` takes ``tensors`` at once (see ``bucketed``)."""
        return one_bucket(tensors, keys, self.batches_on)

    # -- encoding ahead of the step's agreement (the hook's overlap: HoldsSteps) -------------------------

    def compress_pending(self, tensor: Tensor, key: str) -> SparsePayload:
        """:meth:`compress`'s payload, the step's momentum and accumulator held aside until :meth:`commit`.

        ``u`` and ``v`` stay as they are; the step writes ``m*u + g`` and ``v + u'`` into a second
        buffer per key (one more fp32 copy of each, no extra pass), selects from it and zeroes the
        sent entries there. :meth:`commit` swaps the buffers of the parameters the ranks used; a
        dropped step leaves everything as before it, draws included.
        """
        payload, held = self._compress(tensor, key, held=True)
        assert held is not None
        self._pending[key] = held
        return payload

    def commit(self, keys: frozenset[str] | set[str]) -> None:
        """Adopt the held step of ``keys``; drop the others' (their state stays as before the step).

        ``commit(frozenset())``: no parameter was used (the step's schedule stands); a step the
        ranks agreed to skip is dropped by :meth:`drop`.
        """
        # Taken first (the buckets' held flats in BucketFlats.commit): a commit interrupted halfway leaves no
        # held step for the hook's drop to reuse.
        pending, self._pending = self._pending, {}
        dense, self._dense_pending = self._dense_pending, {}
        self._before_step = None
        for key, u in dense.items():
            if key in keys:
                self.dense_momenta[key] = u
        for key, (v, u) in pending.items():
            if key in keys:
                v, self.velocities[key] = self.velocities.get(key), v
                if u is not None:
                    u, self.momenta[key] = self.momenta.get(key), u
                self.draws[key] = self.draws.get(key, 0) + 1
            # The buffers left over (the step's, or those it replaced) serve the next held step.
            for which, spare in (("v", v), ("u", u)):
                if spare is not None and spare is not self.velocities.get(key) and spare is not self.momenta.get(key):
                    self._spares[(key, which)] = spare
        for signature in self._buckets.commit(keys):
            for key in signature:  # slices of the flats, which serve held bucket steps only
                self._spares.pop((key, "v"), None)
                self._spares.pop((key, "u"), None)

    def drop(self) -> None:
        """Drop the held step (the ranks agreed to skip it, or it failed): its buffers and its schedule.

        The hook began the step (:meth:`begin_step`) before the ranks agreed on it; a step skipped
        on the held path is never begun, so the warm-up's epoch and density return to what they
        were, and the step that retries it begins it again.
        """
        before = self._before_step
        self.commit(frozenset())
        if before is not None:
            self.epoch, self.current_density = before

    def _state(self, store: dict[str, Tensor], key: str, like: Tensor, held: bool) -> Tensor:
        """``store[key]`` (:meth:`_buffer`); a held step stores nothing, so a key it meets first starts from zeros."""
        if held and key not in store:
            return torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        return self._buffer(store, key, like)

    def _spare(self, key: str, which: str, like: Tensor) -> Tensor:
        spare = self._spares.pop((key, which), None)
        if spare is None or spare.shape != like.shape or spare.device != like.device:
            spare = torch.empty_like(like)
        return spare

    def _compress(
        self, tensor: Tensor, key: str, held: bool
    ) -> tuple[SparsePayload, tuple[Tensor, Tensor | None] | None]:
        """One step of DGC for ``key``: in place, or (``held``) into second buffers returned with the payload."""
        grad, scale = self._clipped(tensor)
        numel = grad.numel()
        v = self._state(self.velocities, key, grad, held)
        u = None if self.momentum == 0.0 else self._state(self.momenta, key, grad, held)
        v_out = self._spare(key, "v", v) if held else v
        u_out = None if u is None else (self._spare(key, "u", u) if held else u)
        k = num_selected(numel, self.current_density)
        if k == numel or numel < self.exact_below_numel:
            self._accumulate(u, v, grad, scale, u_out, v_out)
            if k == numel:
                positions = torch.arange(numel, device=v.device)
                self.last_selection = SelectionInfo("all", k, numel, 0, math.nan)
            else:
                positions = exact_topk(v_out, k)
                self.last_selection = SelectionInfo("exact", k, numel, 0, math.nan)
        else:
            # Accumulate span by span and scan each span's column maxima while it is in cache.
            scan = ColumnScan(v_out)
            for span, (start, stop) in enumerate(scan.spans):
                u_part = None if u is None else u[start:stop]
                u_out_part = None if u_out is None else u_out[start:stop]
                self._accumulate(u_part, v[start:stop], grad[start:stop], scale, u_out_part, v_out[start:stop])
                scan.scan(span)
            positions, self.last_selection = sampled_topk(
                v_out,
                k,
                density=self.current_density,
                sample_fraction=self.sample_fraction,
                rng=_SampleStart(self.seed, key, self.draws.get(key, 0)),
                scan=scan,
            )
        values = v_out.index_select(0, positions)
        # The sent entries leave the accumulator, exactly (v_before == decoded + v_after), and
        # with momentum factor masking the momentum that produced them stops, too.
        v_out.index_fill_(0, positions, 0.0)
        if u_out is not None and self.momentum_masking:
            u_out.index_fill_(0, positions, 0.0)
        payload = SparsePayload(numel=numel, values=values, indices=positions.to(index_dtype_for(numel)))
        return payload, ((v_out, u_out) if held else None)

    def apply_momentum(self, tensor: Tensor, key: str) -> Tensor:
        """Momentum (and clipping) for a tensor that is sent dense instead of compressed.

        DGC owns the momentum, so tensors the hook allreduces dense (biases, norm layers below
        ``min_numel``) need it here (the authors' code, too, gives them momentum without
        sparsification or masking): returns heavy-ball SGD's update ``u = m*u + g`` (Nesterov:
        ``g + m*u``) as a new fp32 tensor; ``tensor`` is not changed. By linearity, summing these
        over workers equals ``torch.optim.SGD(momentum=m)``'s update for the averaged gradient. The
        weight decay is added after the allreduce, by :meth:`finish_aggregate`.
        """
        return self._dense_update(tensor, key, held=False)

    def _dense_update(self, tensor: Tensor, key: str, *, held: bool) -> Tensor:
        """:meth:`apply_momentum`; ``held``: the new momentum kept aside until :meth:`commit` (same bits)."""
        grad, scale = self._clipped(tensor)
        if self.momentum == 0.0:
            return grad * scale
        # torch.optim.SGD's buffer: u = m*u + g (Nesterov then steps along g + m*u).
        if held:
            u = torch.mul(self._state(self.dense_momenta, key, grad, held=True), self.momentum).add_(grad, alpha=scale)
            self._dense_pending[key] = u
        else:
            u = self._buffer(self.dense_momenta, key, grad)
            u.mul_(self.momentum).add_(grad, alpha=scale)
        if self.nesterov:
            return torch.add(grad * scale, u, alpha=self.momentum)
        return u.clone()

    def transform_dense(self, tensor: Tensor, key: str) -> Tensor:
        return self.apply_momentum(tensor, key).to(tensor.dtype)

    def transform_dense_pending(self, tensor: Tensor, key: str) -> Tensor:
        """:meth:`transform_dense` with the dense momentum's step held aside until :meth:`commit`."""
        return self._dense_update(tensor, key, held=True).to(tensor.dtype)

    def finish_aggregate(self, aggregate: Tensor, key: str) -> None:
        """Add the weight decay's own momentum to ``key``'s averaged update (a slice of the bucket).

        The authors' ``DGCSGD.step`` (``dgc/optim/sgd.py``): ``d = wd*w`` at the first step, then
        ``d = m*d + wd*w``, and the optimizer steps along ``d + received`` (Nesterov:
        ``wd*w + m*d + received``; momentum 0: ``wd*w + received``). ``d`` starts at zero here,
        which gives the same first step. It depends only on the weights, which are the same on
        every worker, so every worker adds the same term and nothing is sent for it. Computed in
        fp32 and added once, rounded to the bucket's dtype.
        """
        if self.weight_decay == 0.0:
            return
        weight = self._weights(key, aggregate).float()
        # wd*w formed on its own, as DGCSGD forms d_p, so the buffer rounds as the reference's does.
        decay = weight * self.weight_decay
        if self.momentum != 0.0:
            d = self._buffer(self.decay_momenta, key, aggregate)
            d.mul_(self.momentum).add_(decay)
            decay = decay.add_(d, alpha=self.momentum) if self.nesterov else d
        aggregate.add_(decay.view_as(aggregate))

    # -- decoding --------------------------------------------------------------------------------
    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, SparsePayload)
        # One payload's positions are distinct: a plain index_copy_ (no accumulation) suffices.
        dense = torch.zeros(payload.numel, dtype=torch.float32, device=payload.values.device)
        return dense.index_copy_(0, payload.indices.long(), payload.values.float())

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> SparsePayload:
        return SparsePayload.from_wire(wire, numel)

    # -- health and checkpoints ------------------------------------------------------------------
    def residual_store(self) -> dict[str, Tensor]:
        """The accumulators ``v``: what was not sent yet."""
        return self.velocities

    @property
    def own_weight_decay(self) -> float:
        return float(self.weight_decay)

    def residual_norm(self) -> float:
        """L2 norm of all accumulators ``v`` together (unsent mass; it should stay bounded)."""
        if not self.velocities:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(v).cpu() for v in self.velocities.values()])
        return float(torch.linalg.vector_norm(norms))

    def state_dict(self) -> dict[str, Any]:
        def cpu(store: dict[str, Tensor]) -> dict[str, Tensor]:
            return {key: t.detach().cpu().clone() for key, t in store.items()}

        return {
            "momenta": cpu(self.momenta),
            "velocities": cpu(self.velocities),
            "dense_momenta": cpu(self.dense_momenta),
            "decay_momenta": cpu(self.decay_momenta),
            "draws": dict(self.draws),
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momenta = {key: t.clone() for key, t in state["momenta"].items()}
        self.velocities = {key: t.clone() for key, t in state["velocities"].items()}
        self.dense_momenta = {key: t.clone() for key, t in state.get("dense_momenta", {}).items()}
        self.decay_momenta = {key: t.clone() for key, t in state.get("decay_momenta", {}).items()}
        # (A checkpoint written before the draws were counted per key starts their count at zero.)
        self.draws = {key: int(count) for key, count in state.get("draws", {}).items()}
        self._pending, self._dense_pending, self._spares, self._before_step = {}, {}, {}, None
        self._buckets = BucketFlats()
        # Restored, not told: a resumed program must still advance the schedule itself.
        self._schedule(state["epoch"])

    def __repr__(self) -> str:
        return (
            f"DGCCompressor(density={self.density}, momentum={self.momentum}, nesterov={self.nesterov}, "
            f"momentum_masking={self.momentum_masking}, clip_norm={self.clip_norm}, "
            f"weight_decay={self.weight_decay}, "
            f"warmup_densities={list(self.warmup_densities)}, steps_per_epoch={self.steps_per_epoch}, "
            f"sample_fraction={self.sample_fraction}"
            + ("" if self.bucketed is None else f", bucketed={self.bucketed}")
            + ")"
        )


class _SampleStart:
    """The sampled threshold's random start for one key's ``count``-th compressed step.

    :func:`~lgc.compressors.base.keyed_seed` in place of a generator's next draw: a key's draws never
    depend on which other keys a step compressed, so a step encoded before the ranks agree on it
    (:meth:`DGCCompressor.compress_pending`) draws what :meth:`DGCCompressor.compress` would, and a
    resumed run repeats them (the counts are in the checkpoint). ``randrange`` is all
    :func:`~lgc.compressors.selection.sampled_topk` asks of its ``rng``.
    """

    __slots__ = ("value",)

    def __init__(self, seed: int, key: str, count: int) -> None:
        self.value = keyed_seed(seed, key, count)

    def randrange(self, stop: int) -> int:
        return self.value % stop


def _accumulator_and_momentum(group: FlatGroup) -> tuple[Tensor, Tensor | None]:
    """A bucket's flat accumulator ``v`` and flat momentum ``u`` (None without momentum)."""
    return group.flats[0], (group.flats[1] if len(group.flats) > 1 else None)
