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
   is added to every parameter's averaged update (:meth:`DGCCompressor.finish_aggregate`).
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
its authors' code do (see :func:`sampled_topk` for the exact rule). The accumulator ``v`` *is*
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
threshold's stride and sample size follow the rule :func:`sampled_topk` states, not the code's
arithmetic, and between ``0.8 k`` and ``1.3 k`` survivors all are sent, where the code keeps the
first ``k`` by position (``dgc/compression.py``). The warm-up densities are the paper's; the
authors' CIFAR configuration (``configs/dgc/wm5.py``) computes five epochs at
``density ** ((e + 1) / 6)`` instead (31.6 %, 10 %, 3.16 %, 1 %, 0.316 % for 0.1 %). A parameter
whose gradient is exactly zero on every rank is left alone by the hook (no update, no decay that
step), where the authors' optimizer would still decay it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, Payload, compressor_chain
from lgc.compressors.error_feedback import ErrorFeedback
from lgc.compressors.topk import (
    ScatterAddAggregation,
    SparsePayload,
    index_dtype_for,
    num_selected,
)

__all__ = ["PAPER_WARMUP_DENSITIES", "DGCCompressor", "SelectionInfo", "check_optimizer_momentum", "sampled_topk"]

#: The paper's warm-up densities, one per epoch (an exponential decay by 4x towards 0.1 %).
PAPER_WARMUP_DENSITIES: tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.00390625)

#: Survivor-count window of the sampled threshold (the paper's and its code's bounds): above
#: ``_UPPER * k`` an exact top-k over the survivors cuts them to ``k``; below ``_LOWER * k`` the
#: threshold is multiplied by ``_LOWER`` and the count retried, at most ``_MAX_ROUNDS`` times.
_UPPER = 1.3
_LOWER = 0.8
_MAX_ROUNDS = 10
#: The sample is enlarged (beyond ``sample_fraction``) until about this many sampled entries are
#: expected above the threshold: an estimate from a handful of order statistics is too noisy.
_MIN_SAMPLE_HITS = 32
#: Rows of the grid each span is viewed as (see ``_ColumnScan``): with 8-16 rows a column-wise
#: max costs about one read of the span, and a candidate column costs 16 gathered entries.
_ROWS = 16
#: Elements per span of the accumulation pass on a single-threaded CPU: the ``u``, ``g`` and ``v``
#: slices of a span (4 MB each) stay in cache from the momentum update through the accumulation to
#: the column scan, which cuts that pass by 15-40 % on a 25M-element tensor (2^18-2^20 measured
#: best). With several intra-op threads every operation on a span opens a parallel region, and on
#: a machine busier than its cores each region waits for a descheduled thread (measured 3-5x
#: slower in total), so multi-threaded CPUs and accelerators take the whole tensor as one span.
_CPU_CHUNK = 1 << 20


@dataclass(frozen=True)
class SelectionInfo:
    """How :func:`sampled_topk` chose the entries it returned (for tests and diagnostics)."""

    #: ``"all"`` (k == n), ``"exact"`` (torch.topk over the whole tensor), ``"threshold"``
    #: (everything at or above the final threshold) or ``"threshold+topk"`` (exact top-k over the
    #: survivors of the final threshold).
    path: str
    #: Target count ``k``.
    k: int
    #: Entries at or above the final threshold (``numel`` for ``"all"``/``"exact"``).
    survivors: int
    #: How many times the threshold was lowered by ``x0.8``.
    rounds: int
    #: The final threshold (``nan`` for ``"all"``/``"exact"``).
    threshold: float


class _ColumnScan:
    """Finds ``{i : |x[i]| >= t}`` for several thresholds ``t`` after a single pass over ``x``.

    ``x`` is cut into spans of at most ``_CPU_CHUNK`` elements (see there), whole
    multiples of ``_ROWS``, each viewed as a ``(_ROWS, cols)`` grid; :meth:`scan` stores the
    largest magnitude of every grid column (two reductions along the outer dimension, ``amax`` and
    ``amin``). A survivor can only sit in a column whose maximum reaches ``t``: those columns are
    gathered (``_ROWS`` entries each) and compared, so every count after the scan costs O(k), not
    another pass. When many columns qualify (large densities: warm-up) one full mask is cheaper
    and is used instead. The last ``n % _ROWS`` entries belong to no grid and are compared directly.

    The compressor calls :meth:`scan` on each span right after accumulating it, while it is in cache.
    """

    def __init__(self, x: Tensor, chunk: int | None = None) -> None:
        self.x = x
        n = x.numel()
        if chunk is None:
            chunk = _CPU_CHUNK if x.device.type == "cpu" and torch.get_num_threads() == 1 else n
        chunk = max(_ROWS, chunk)
        starts, cols = [], []
        start = 0
        while n - start >= _ROWS:
            size = min(chunk, (n - start) // _ROWS * _ROWS)
            starts.append(start)
            cols.append(size // _ROWS)
            start += size
        #: Element ranges to accumulate and scan, in order; a last one without a grid holds the tail.
        self.spans = [(a, a + c * _ROWS) for a, c in zip(starts, cols, strict=True)]
        self.tail = start
        if start < n:
            self.spans.append((start, n))
        self._span_cols = cols
        self._col_starts = [0]
        for c in cols:
            self._col_starts.append(self._col_starts[-1] + c)
        self._col_max = x.new_empty(self._col_starts[-1])
        self._col_min = x.new_empty(self._col_starts[-1])
        self._col_abs_max: Tensor | None = None

    def scan(self, span: int) -> None:
        """Record the column extremes of span number ``span`` (a no-op for the tail)."""
        if span >= len(self._span_cols):
            return
        start, stop = self.spans[span]
        grid = self.x[start:stop].view(_ROWS, self._span_cols[span])
        cols = slice(self._col_starts[span], self._col_starts[span + 1])
        # Written in place: few operations per span (each may start a parallel region, which is
        # costly on a busy machine); |.| is formed once for all spans in col_abs_max.
        torch.amax(grid, dim=0, out=self._col_max[cols])
        torch.amin(grid, dim=0, out=self._col_min[cols])

    @property
    def col_abs_max(self) -> Tensor:
        """Largest magnitude of every grid column (after every span was scanned)."""
        if self._col_abs_max is None:
            # torch.linalg.vector_norm(ord=inf, dim=0) would do it in one go but is ~10x slower on CPU.
            self._col_abs_max = torch.maximum(self._col_max, self._col_min.neg_())
        return self._col_abs_max

    def scan_all(self) -> _ColumnScan:
        for span in range(len(self.spans)):
            self.scan(span)
        return self

    def __call__(self, threshold: float) -> Tensor:
        """int64 positions of the entries with ``|x| >= threshold`` (in no particular order)."""
        x = self.x
        if not self._span_cols:
            return torch.nonzero(x.abs() >= threshold).view(-1)
        columns = torch.nonzero(self.col_abs_max >= threshold).view(-1)
        if columns.numel() * 4 > self.col_abs_max.numel():
            return torch.nonzero(x.abs() >= threshold).view(-1)
        device = x.device
        rows = torch.arange(_ROWS, device=device)
        # Entry r of column j of a span starting at a with c columns sits at a + r * c + j.
        if len(self._span_cols) == 1:
            # One span (the usual case; fewer small operations, each costly on a busy machine).
            candidates = (columns[:, None] + rows[None, :] * self._span_cols[0]).view(-1)
        else:
            col_starts = torch.tensor(self._col_starts[:-1], device=device)
            span = torch.searchsorted(col_starts, columns, right=True) - 1
            span_cols = torch.tensor(self._span_cols, device=device)[span]
            span_starts = torch.tensor([a for a, _ in self.spans[: len(self._span_cols)]], device=device)[span]
            first = span_starts + (columns - col_starts[span])
            candidates = (first[:, None] + rows[None, :] * span_cols[:, None]).view(-1)
        # index_select: about twice as fast as x[candidates] on CPU.
        positions = candidates[x.index_select(0, candidates).abs() >= threshold]
        if self.tail < x.numel():
            tail_hits = torch.nonzero(x[self.tail :].abs() >= threshold).view(-1) + self.tail
            positions = torch.cat([positions, tail_hits])
        return positions


def _exact_topk(x: Tensor, k: int) -> Tensor:
    return torch.topk(x.abs(), k, sorted=False).indices


def sampled_topk(
    x: Tensor,
    k: int,
    *,
    sample_fraction: float = 0.01,
    rng: random.Random | None = None,
    threshold: float | None = None,
    scan: _ColumnScan | None = None,
) -> tuple[Tensor, SelectionInfo]:
    """Positions of about ``k`` largest-magnitude entries of the flat tensor ``x`` (DGC's sampling).

    The rule, exactly:

    1. ``k >= n``: every position. Otherwise the threshold ``t`` is estimated from a strided
       sample ``x[start::stride]`` with a random ``start`` (from ``rng``): the stride is the
       largest odd number giving at least ``sample_fraction * n`` entries (and enough for about
       ``32`` sampled hits), and ``t`` is the ``ceil(k/n * s)``-th largest ``|.|`` of the ``s``
       sampled entries. If no odd stride of at least 3 gives such a sample (``x`` is small), or
       ``t <= 0`` (mostly zeros), sampling cannot help and an exact ``torch.topk`` is used
       (path ``"exact"``).
       Passing ``threshold`` skips the estimate (tests use it to drive the other branches).
    2. Count the survivors ``c = #{|x| >= t}``.

       * ``c > 1.3 k``: an exact top-k over the survivors returns exactly ``k`` entries.
       * ``0.8 k <= c <= 1.3 k``: all survivors are returned (so ``c`` differs between workers).
       * ``c < 0.8 k``: ``t *= 0.8`` and count again, at most 10 times; if after 10 lowerings
         still ``c < 0.8 k``, the ``c`` survivors are returned as they are, unless there are none,
         in which case an exact top-k is used (a payload is never empty).

    Whatever the path, every returned entry is at least as large in magnitude as every entry not
    returned. Only one pass over ``x`` is made for all counts (see ``_ColumnScan``).

    Args:
        x: flat tensor to select from.
        k: target count, ``1 <= k``.
        sample_fraction: minimum fraction of entries in the sample.
        rng: draws the sample's start; ``None`` uses Python's global generator.
        threshold: use this initial threshold instead of the sampled estimate.
        scan: the column maxima of ``x`` if the caller already computed them (the compressor does,
            fused with its accumulation pass).

    Returns:
        int64 positions (in no particular order) and how they were chosen.
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device), SelectionInfo("all", n, n, 0, math.nan)
    if threshold is None:
        wanted = max(math.ceil(sample_fraction * n), math.ceil(_MIN_SAMPLE_HITS * n / k))
        stride = n // wanted if wanted else n
        if stride % 2 == 0:
            # An odd stride does not line up with the power-of-two shapes of conv and linear weights.
            stride -= 1
        if stride < 2:
            return _exact_topk(x, k), SelectionInfo("exact", k, n, 0, math.nan)
        start = (rng or random).randrange(stride)
        sample = x[start::stride].abs()
        hits = min(sample.numel(), math.ceil(k / n * sample.numel()))
        threshold = float(torch.topk(sample, hits, sorted=False).values.min())
        if not threshold > 0.0 or not math.isfinite(threshold):
            return _exact_topk(x, k), SelectionInfo("exact", k, n, 0, math.nan)
    survivors_of = scan if scan is not None else _ColumnScan(x).scan_all()
    rounds = 0
    while True:
        positions = survivors_of(threshold)
        count = positions.numel()
        if count > _UPPER * k:
            keep = torch.topk(x.index_select(0, positions).abs(), k, sorted=False).indices
            return positions[keep], SelectionInfo("threshold+topk", k, count, rounds, threshold)
        if count >= _LOWER * k:
            return positions, SelectionInfo("threshold", k, count, rounds, threshold)
        if rounds == _MAX_ROUNDS:
            if count == 0:
                return _exact_topk(x, k), SelectionInfo("exact", k, 0, rounds, threshold)
            return positions, SelectionInfo("threshold", k, count, rounds, threshold)
        threshold *= _LOWER
        rounds += 1


class DGCCompressor(ScatterAddAggregation, Compressor):
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
    compressor (``weight_decay``); :func:`check_optimizer_momentum` refuses momentum in both
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
        weight_decay: L2 weight decay ``wd >= 0`` with a momentum of its own, added to every
            parameter's averaged update (see above); the value you would give
            ``torch.optim.SGD(weight_decay=...)``, which must then be 0. Needs
            :meth:`attach_parameters`. ``0`` (the default) adds none.
        world_size: number of workers ``N`` the hook divides the gradient by: scales ``clip_norm``.
            :meth:`set_world_size` overrides it.
        warmup_densities: density per warm-up epoch; from epoch ``len(warmup_densities)`` on,
            ``density`` is used (a warm-up value below ``density`` counts as ``density``). ``None``
            is the paper's ``[0.25, 0.0625, 0.015625, 0.00390625]`` (4 epochs); ``[]`` disables
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
        exact_below_numel: tensors with fewer entries use an exact ``torch.topk``: for them
            sampling saves nothing and gives fewer exact counts.
        seed: seed of the random generator that draws the sample's start.

    Example::

        >>> dgc = DGCCompressor(density=0.01, warmup_densities=[])
        >>> payload = dgc.compress(torch.randn(100_000), key="w")
        >>> 800 <= payload.values.numel() <= 1300, payload.nbytes == 8 * payload.values.numel()
        (True, True)
    """

    combine = CombineMode.GATHER
    variable_size = True

    def __init__(
        self,
        density: float = 0.001,
        momentum: float = 0.9,
        *,
        nesterov: bool = False,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        weight_decay: float = 0.0,
        world_size: int = 1,
        warmup_densities: Sequence[float] | None = None,
        steps_per_epoch: int | None = None,
        sample_fraction: float = 0.01,
        exact_below_numel: int = 1 << 17,
        seed: int = 0,
    ) -> None:
        if not 0.0 < float(density) <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and not float(clip_norm) > 0.0:
            raise ValueError(f"clip_norm must be positive or None, got {clip_norm!r}")
        if not (0.0 <= float(weight_decay) < math.inf):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        _check_world_size(world_size)
        if warmup_densities is None:
            warmup_densities = PAPER_WARMUP_DENSITIES
        if isinstance(warmup_densities, (str, bytes)) or not isinstance(warmup_densities, Sequence):
            # Hydra hands over a ListConfig, which is a Sequence; anything else is a mistake.
            warmup_densities = list(warmup_densities)  # type: ignore[arg-type]
        for value in warmup_densities:
            if not 0.0 < float(value) <= 1.0:
                raise ValueError(f"warmup_densities must lie in (0, 1], got {value!r} in {list(warmup_densities)!r}")
        if not 0.0 < float(sample_fraction) <= 1.0:
            raise ValueError(f"sample_fraction must be in (0, 1], got {sample_fraction!r}")
        if isinstance(exact_below_numel, bool) or int(exact_below_numel) != exact_below_numel or exact_below_numel < 0:
            raise ValueError(f"exact_below_numel must be a non-negative integer, got {exact_below_numel!r}")
        if steps_per_epoch is not None and (
            isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1
        ):
            raise ValueError(
                f"steps_per_epoch must be a positive integer (optimizer steps per epoch, e.g. len(train_loader)) "
                f"or None, got {steps_per_epoch!r}"
            )
        self.density = float(density)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.momentum_masking = bool(momentum_masking)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.weight_decay = float(weight_decay)
        self.world_size = int(world_size)
        self.warmup_densities = tuple(float(d) for d in warmup_densities)
        self.steps_per_epoch = steps_per_epoch
        self.sample_fraction = float(sample_fraction)
        self.exact_below_numel = int(exact_below_numel)
        self.seed = int(seed)
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
        # Python's generator, not torch's: it pickles without tensors (spawned workers get a copy).
        self._rng = random.Random(self.seed)
        #: The model's parameters by name (:meth:`attach_parameters`), read by the weight decay.
        #: Per process: never pickled (:meth:`__getstate__`) nor checkpointed (:meth:`state_dict`).
        self._parameters: Mapping[str, Tensor] | None = None

    def check_optimizer(self, momentum: float, weight_decay: float | None) -> None:
        """No momentum in the optimizer, nor decay there while DGC has its own (:func:`check_optimizer_momentum`)."""
        check_optimizer_momentum(self, momentum, weight_decay=weight_decay)

    # -- what the hook tells the compressor ------------------------------------------------------
    def attach_parameters(self, parameters: Mapping[str, Tensor]) -> None:
        """Keep the model's parameters by name (the ``key`` of :meth:`compress`) for the weight decay."""
        self._parameters = parameters

    def set_world_size(self, world_size: int) -> None:
        """Number of workers the hook divides gradients by (scales ``clip_norm``)."""
        _check_world_size(world_size)
        self.world_size = int(world_size)

    def __getstate__(self) -> dict[str, Any]:
        # The parameters belong to this process's model: a spawned worker or a pickled checkpoint
        # must not carry (or share) them; the worker's hook attaches its own.
        state = self.__dict__.copy()
        state["_parameters"] = None
        return state

    # -- schedule --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Pick the warm-up density of ``epoch`` (``density`` once the warm-up is over).

        With ``steps_per_epoch`` the hook's step counter sets the epoch instead, and this only
        notes the call (``lgc-train`` calls it every epoch whatever the compressor).
        """
        self._epoch_told = True
        if self.steps_per_epoch is None:
            self._schedule(epoch)

    def begin_step(self, step: int) -> None:
        """Follow the step counter (``steps_per_epoch``), or refuse a warm-up nothing advances.

        The hook calls it before the first tensor of every compressed step, on every rank alike.
        """
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

    def _accumulate(self, u: Tensor | None, v: Tensor, grad: Tensor, scale: float) -> None:
        """Momentum correction on one span, in place: ``u = m*u + g; v += u`` (or the variants); ``g = scale*grad``."""
        if u is None:
            # No momentum: u would be g every step, so v += g is all there is (top-k with EF).
            v.add_(grad, alpha=scale)
        elif self.nesterov:
            u.add_(grad, alpha=scale).mul_(self.momentum)
            v.add_(u).add_(grad, alpha=scale)
        else:
            if scale == 1.0:
                # One fused pass: g + m*u as an FMA (1 ulp from torch.optim.SGD's mul_ then add_).
                torch.add(grad, u, alpha=self.momentum, out=u)
            else:
                u.mul_(self.momentum).add_(grad, alpha=scale)
            v.add_(u)

    def compress(self, tensor: Tensor, key: str) -> SparsePayload:
        grad, scale = self._clipped(tensor)
        numel = grad.numel()
        v = self._buffer(self.velocities, key, grad)
        u = None if self.momentum == 0.0 else self._buffer(self.momenta, key, grad)
        k = num_selected(numel, self.current_density)
        if k == numel or numel < self.exact_below_numel:
            self._accumulate(u, v, grad, scale)
            if k == numel:
                positions = torch.arange(numel, device=v.device)
                self.last_selection = SelectionInfo("all", k, numel, 0, math.nan)
            else:
                positions = _exact_topk(v, k)
                self.last_selection = SelectionInfo("exact", k, numel, 0, math.nan)
        else:
            # Accumulate span by span and scan each span's column maxima while it is in cache.
            scan = _ColumnScan(v)
            for span, (start, stop) in enumerate(scan.spans):
                part = None if u is None else u[start:stop]
                self._accumulate(part, v[start:stop], grad[start:stop], scale)
                scan.scan(span)
            positions, self.last_selection = sampled_topk(
                v, k, sample_fraction=self.sample_fraction, rng=self._rng, scan=scan
            )
        values = v.index_select(0, positions)
        # The sent entries leave the accumulator, exactly (v_before == decoded + v_after), and
        # with momentum factor masking the momentum that produced them stops, too.
        v.index_fill_(0, positions, 0.0)
        if u is not None and self.momentum_masking:
            u.index_fill_(0, positions, 0.0)
        return SparsePayload(numel=numel, values=values, indices=positions.to(index_dtype_for(numel)))

    def apply_momentum(self, tensor: Tensor, key: str) -> Tensor:
        """Momentum (and clipping) for a tensor that is sent dense instead of compressed.

        DGC owns the momentum, so tensors the hook allreduces dense (biases, norm layers below
        ``min_numel``) need it here (the authors' code, too, gives them momentum without
        sparsification or masking): returns heavy-ball SGD's update ``u = m*u + g`` (Nesterov:
        ``g + m*u``) as a new fp32 tensor; ``tensor`` is not changed. By linearity, summing these
        over workers equals ``torch.optim.SGD(momentum=m)``'s update for the averaged gradient. The
        weight decay is added after the allreduce, by :meth:`finish_aggregate`.
        """
        grad, scale = self._clipped(tensor)
        if self.momentum == 0.0:
            return grad * scale
        u = self._buffer(self.dense_momenta, key, grad)
        # torch.optim.SGD's buffer: u = m*u + g (Nesterov then steps along g + m*u).
        u.mul_(self.momentum).add_(grad, alpha=scale)
        if self.nesterov:
            return torch.add(grad * scale, u, alpha=self.momentum)
        return u.clone()

    def transform_dense(self, tensor: Tensor, key: str) -> Tensor:
        return self.apply_momentum(tensor, key).to(tensor.dtype)

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
            "rng": self._rng.getstate(),
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momenta = {key: t.clone() for key, t in state["momenta"].items()}
        self.velocities = {key: t.clone() for key, t in state["velocities"].items()}
        self.dense_momenta = {key: t.clone() for key, t in state.get("dense_momenta", {}).items()}
        self.decay_momenta = {key: t.clone() for key, t in state.get("decay_momenta", {}).items()}
        self._rng.setstate(state["rng"])
        # Restored, not told: a resumed program must still advance the schedule itself.
        self._schedule(state["epoch"])

    def __repr__(self) -> str:
        return (
            f"DGCCompressor(density={self.density}, momentum={self.momentum}, nesterov={self.nesterov}, "
            f"momentum_masking={self.momentum_masking}, clip_norm={self.clip_norm}, "
            f"weight_decay={self.weight_decay}, "
            f"warmup_densities={list(self.warmup_densities)}, steps_per_epoch={self.steps_per_epoch}, "
            f"sample_fraction={self.sample_fraction})"
        )


def _check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or int(world_size) != world_size or int(world_size) < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


def check_optimizer_momentum(compressor: Any, optimizer_momentum: float, *, weight_decay: float | None = None) -> None:
    """Refuse DGC combined with optimizer momentum or optimizer weight decay, or DGC inside error feedback.

    DGC's momentum correction already sends heavy-ball updates; momentum in the optimizer as well
    would apply it twice. A DGC with ``weight_decay > 0`` adds the decay (with its own momentum) to
    the averaged update; decay in the optimizer as well would apply it twice. Its accumulator is the
    error-feedback residual, so :class:`~lgc.compressors.ErrorFeedback` around it would feed the
    error back twice. Anything that is not (and does not wrap, via ``.compressor``) a
    :class:`DGCCompressor` passes.

    Args:
        compressor: a compressor, a wrapper such as ``ErrorFeedback``, or a hook state.
        optimizer_momentum: the optimizer's momentum factor.
        weight_decay: the optimizer's weight decay; ``None`` skips that check.

    Raises:
        ValueError: if a DGC compressor meets a nonzero optimizer momentum, a nonzero optimizer
            weight decay while it applies its own, or error feedback.
    """
    chain = compressor_chain(compressor)
    dgc = next((c for c in chain if isinstance(c, DGCCompressor)), None)
    if dgc is None:
        return
    if float(optimizer_momentum) != 0.0:
        raise ValueError(
            f"optimizer momentum is {optimizer_momentum!r} but DGC applies momentum correction itself; "
            "set optimizer.momentum=0 (and optimizer.nesterov=false) and put the momentum on the compressor "
            "(compressor.momentum)"
        )
    if weight_decay is not None and float(weight_decay) != 0.0 and dgc.weight_decay > 0.0:
        raise ValueError(
            f"optimizer weight_decay is {weight_decay!r} but DGC applies weight decay itself "
            f"(compressor.weight_decay={dgc.weight_decay!r}), so it would be applied twice; set "
            "optimizer.weight_decay=0 and give the decay to the compressor (compressor.weight_decay=...), "
            "which gives it a momentum of its own as torch.optim.SGD(momentum, weight_decay) and DGC's authors do"
        )
    if any(isinstance(c, ErrorFeedback) for c in chain):
        raise ValueError("DGC keeps its own error feedback (its accumulator v); set compressor.error_feedback=false")
