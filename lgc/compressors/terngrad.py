"""TernGrad: stochastic ternary gradients {-1, 0, +1} * s_t (Wen et al., NeurIPS 2017).

"TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning" sends every
gradient entry as one of three values:

    ``t_i = s_t * sign(g_i) * b_i``,  ``s_t = max_i |g_i|``,  ``b_i ~ Bernoulli(|g_i| / s_t)``,

so ``E[t] = g`` (unbiased). Steps, per tensor (``key``):

1. **Gradient clipping** (optional, ``clip_sigma = c``, the paper's ``c = 2.5``): entries beyond
   ``c * sigma`` (``sigma`` the standard deviation of the tensor's entries) are clipped to
   ``+-c * sigma``. The paper shows this removes few entries yet shrinks ``s_t`` and with it the
   variance. Clipping makes the estimate biased toward smaller outliers.
2. ``s_t = max |g_i|`` of the clipped tensor, per tensor ("layer-wise ternarizing", the paper's
   default) or per bucket of ``bucket_size`` consecutive entries (lower variance, 32 more bits
   per bucket).
3. Ternarize stochastically and send ``s_t`` (fp32) per bucket and ``t_i / s_t + 1`` as a 2-bit
   code, packed 4 per byte with :mod:`lgc.coding.bitpack`.

This is :class:`~lgc.compressors.qsgd.StochasticQuantizer` with one level and the max-norm: the
Bernoulli draw is the stochastic rounding ``floor(g_i / s_t + u)``, ``u ~ U[0, 1)``, and the wire
format is :class:`~lgc.compressors.qsgd.QuantizedPayload`: ``4 * buckets + ceil(numel / 4)``
bytes, about 2 bits per element (16x smaller than fp32). Clipping needs no clipped copy of the
tensor: with ``s_t = min(max |g|, c * sigma)`` every entry at or beyond ``+-s_t`` maps to
``+-s_t`` with probability one (the rounded value is clamped to the extreme levels), which is
exactly what clipping first and ternarizing after gives.

**Deviation: no scaler sharing.** The paper also makes all workers use one shared
``s_t = max over workers``, which costs an extra allreduce before the gradients can be sent.
Here each worker sends its own ``s_t`` (4 bytes per bucket) with its codes; payloads are
allgathered (:attr:`CombineMode.GATHER`) and every worker's ternary vector is decoded with its
own scale and summed, which keeps each worker unbiased.

Randomness: per tensor and call, from ``seed``, the tensor's name and its count of draws (the
state), as QSGD's; ranks may share the seed (see :mod:`lgc.compressors.qsgd` for what that does to
the variance).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lgc.compressors.qsgd import Buckets, StochasticQuantizer
from lgc.compressors.selection import group_maxima
from lgc.validation import PositiveFloat, PositiveInt, Seed, check

__all__ = ["TernGradCompressor"]


class TernGradCompressor(StochasticQuantizer):
    """TernGrad (Wen et al., 2017): unbiased stochastic ternarization with per-tensor max scaling.

    See the module docstring for the algorithm and the wire format.

    Args:
        bucket_size: entries sharing one scaler ``s_t``; None (default) is the paper's one scaler
            per tensor. Buckets (e.g. 512) lower the variance, which is
            ``sum_i |g_i| (s_t - |g_i|)``, when a few large entries dominate ``max |g|``.
        clip_sigma: the paper's clipping factor ``c``: entries beyond ``c`` standard deviations of
            the tensor are clipped before ternarizing (default 2.5, the paper's value); None
            disables clipping and makes the compressor unbiased. Lower values shrink ``s_t``
            (less variance, more bias). A constant tensor (``sigma = 0``) is not clipped.
        seed: seed of the Bernoulli draws.

    Example::

        >>> payload = TernGradCompressor().compress(torch.randn(1000), key="w")
        >>> payload.nbytes  # one fp32 scaler + 1000 two-bit codes
        254
    """

    def __init__(
        self, bucket_size: PositiveInt | None = None, clip_sigma: PositiveFloat | None = 2.5, seed: Seed = 0
    ) -> None:
        super().__init__(levels=1, bucket_size=bucket_size, seed=seed)
        check("clip_sigma", clip_sigma, PositiveFloat | None)
        self.clip_sigma = None if clip_sigma is None else float(clip_sigma)

    @property
    def scale_covers_input(self) -> bool:
        return self.clip_sigma is None

    def bucket_scales(self, flat: Tensor, buckets: Buckets) -> Tensor:
        # Two reductions per bucket row instead of rows.abs().amax(1), which allocates a gradient-sized |v|.
        scales = buckets.reduce(flat, lambda rows: group_maxima(rows, 1))
        if self.clip_sigma is not None and flat.numel():
            sigma = torch.std(flat, correction=0)
            # sigma = 0 (a constant tensor) would clip everything to zero: leave it unclipped.
            threshold = torch.where(sigma > 0, self.clip_sigma * sigma, math.inf)
            scales = torch.minimum(scales, threshold)  # NaN in the input propagates to the scale
        return scales

    def __repr__(self) -> str:
        return f"TernGradCompressor(bucket_size={self.bucket_size}, clip_sigma={self.clip_sigma}, seed={self.seed})"
