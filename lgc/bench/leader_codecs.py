"""Rate against distortion for every codec of the leader's top-k positions (what ``lgc-bench codecs`` measures).

LGC (Abrahamyan et al., IEEE TNNLS 2021) and its shared-index ablations send every worker's values
at the positions of one worker's top-k (the *leader's*), so the values line up and their sum can
travel in one allreduce. What differs is how those values are coded. This benchmark runs each
codec on recorded gradients (:func:`lgc.analysis.record_gradients`, every worker's own gradients
before DDP averages them) and reports, on the steps after ``--train-fraction`` (the steps a learned
codec never saw):

* the **delivered-sum error** ``sum_t ||y_hat_t - y_t||^2 / sum_t ||y_t||^2`` of the sum ``y_t``
  of the workers' values at the leader's positions (LGC's ``measure_error``:
  :class:`lgc.learned.step.DeliveredError`);
* **wire bits per value**, all of them: each worker's payload in the allreduce (values or latent
  codes, per-chunk scales it sends), and the leader's message (its chunk scales and its positions,
  Golomb-coded as ``index_coding="golomb"`` codes them, with the permutation to the value order
  where the codec orders the values by the leader's), each divided by the ``K`` positions;
* one thread's CPU milliseconds per step and worker to encode and decode.

Codecs (``--codecs``, comma-separated):

* ``fp32``, ``fp16``, ``bf16``: shared-index values (fp16 and bf16 per chunk divided by the
  leader's chunk scale, saturated as lgc's 16-bit wires saturate them),
  :class:`lgc.learned.shared_index.SharedIndexStage`;
* ``int8``, ``int4``: unbiased stochastic rounding to ``2m + 1`` levels of a per-chunk scale
  shared by every worker, summed in ``bits``-wide lanes (``m = (2^bits - 1) // (2P)``; a row says
  so where the lanes cannot hold ``P`` workers' sum, int4 beyond 7 workers);
  ``levels=M``: the same with ``M`` levels per side, in the narrowest lane that holds ``P``
  workers' sum (fewer bits than int4 at large ``P``);
* ``pca:L:DTYPE[:ORDER]``: the linear codec: every chunk of ``--chunk`` values (divided by the
  leader's chunk scale) projected on the ``L`` leading right singular vectors of the training
  steps' chunks (every worker's), the codes summed, the sum decoded: exact on its span, and the
  decoded sum is the projection of the sum. ``DTYPE``: ``fp32``, ``fp16`` or ``int8`` (shared
  per-chunk scale, headroom lanes, as ``int8`` values); ``ORDER``: ``position`` (default),
  ``value`` (the leader's values, descending, which costs the permutation on the wire) or
  ``momentum`` (the running sum, decayed by 0.9 a step, of the sums delivered at earlier steps'
  positions: what every worker's SGD momentum buffer holds, so no permutation travels);
* ``ae:C:DTYPE[:ORDER][:nosim][:wWIDTH]``: LGC's autoencoder
  (:class:`lgc.autoencoder.GradientAutoencoder`, the reference architecture with ``C`` latent
  channels, every width multiplied by ``WIDTH``) trained (``--ae-updates`` Adam updates with
  LGC-RAR's loss: reconstruction, the paper's similarity of the workers' latents, unless ``nosim``,
  and decoding the mean) on the training steps' chunks; every worker encodes, the codes are summed,
  and ``P`` times the decoded mean code is the estimate, as LGC-RAR delivers it. ``DTYPE``:
  ``fp32``, ``fp16`` or ``int8`` (LGC-RAR's ``latent_dtype="int8"``: each chunk's latent rounded to
  a scale every worker shares, summed in 8-bit lanes, the scale's 32 bits per chunk on the wire);
* ``pcaae:L:DTYPE[:ORDER][:nosim][:hHIDDEN]``: the PCA-initialised autoencoder
  (:class:`lgc.autoencoder.pca_autoencoder.PCAAutoencoder`): ``pca:L``'s directions plus
  nonlinear corrections of ``HIDDEN`` hidden units (default 64) that start at zero, trained as
  ``ae`` is and applied as LGC-RAR applies it;
* ``leader_scaled``: only the leader sends its values (fp32), ``P`` times them is the estimate;
* ``topk``: no shared positions: every worker sends its own top-k values (fp32, the same ``k`` per
  parameter) and its own Golomb-coded positions, and the delivered sum is the sum of the workers'
  sparse vectors (what top-k with an allgather delivers); its error at the leader's positions is
  that sum read there.

Two errors per codec: at the leader's positions (the codec's own quality), and of the **whole sum**
``sum_t ||y_hat_t - g_t||^2 / sum_t ||g_t||^2`` against every position of the workers' summed
gradient ``g_t`` (what the selection leaves out counts; error feedback would delay it, not lose
it). Both are given per recorded layer too (every codec fitted once on all of them, as LGC trains
one codec on every layer's chunks), beside the layer's **premise**: Pearson's r of the workers'
values at the leader's positions and the share of a non-leader's squared gradient lying there
(:func:`lgc.analysis.correlation.leader_position_statistics`; chance is the density).

Every codec sees the raw recorded gradients (no error feedback residuals): the positions are
those of the first steps of a run's compressed stage, not of its later steps.

Why one module: every codec is scored on the same recorded steps by the same evaluation (the
leader's positions, delivered-sum and whole-sum errors, per layer, the premise beside them), so the
codec specifications, the coder that fits and runs them and the evaluation share their structures;
``lgc-bench codecs`` keeps only the command around them.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lgc.autoencoder import chunk_scales, divide_by_scales, from_chunks, num_chunks, to_chunks
from lgc.bench.autoencoder import leader_positions
from lgc.coding import golomb_encode
from lgc.compressors.topk import to_wire_float
from lgc.learned.leader_code import LeaderIndexCodec
from lgc.learned.shared_index import quantization_levels, round_to_levels

__all__ = [
    "DEFAULT_CODECS",
    "LEADERS",
    "CodecSpec",
    "LeaderStep",
    "OwnTopK",
    "PlainTopK",
    "benchmark_codecs",
    "cannot_sum",
    "layer_premise",
    "leader_steps",
    "parse_codecs",
    "plain_topk_steps",
]

DEFAULT_CODECS = (
    "fp32,fp16,int8,int4,levels=1,pca:4:fp32,pca:4:int8,pca:8:int8,pca:16:int8,pca:16:fp16,pca:16:int8:value,"
    "pca:16:int8:momentum,ae:4:fp32,ae:4:fp32:position:nosim,ae:4:fp32:value,ae:4:fp32:momentum,ae:4:fp32:w0.125,"
    "pcaae:16:fp32,pcaae:16:fp32:nosim,leader_scaled"
)
_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_LATENTS = ("fp32", "fp16", "int8")
_ORDERS = ("position", "value", "momentum")
#: Decay of the delivered sums' running sum that the ``momentum`` order reads (SGD's usual momentum).
MOMENTUM = 0.9


@dataclass(frozen=True)
class CodecSpec:
    """One ``--codecs`` entry."""

    name: str
    kind: str  # "float", "levels", "pca", "ae", "pcaae", "leader_scaled" or "topk"
    dtype: str | None = None  # float values or the latent: fp32, fp16, bf16, int8
    bits: int | None = None  # integer values: lane bits (None: the narrowest for `levels`)
    levels: int | None = None  # integer values: levels per side (None: from `bits`)
    latent: int | None = None  # pca: latent values per chunk; ae: latent channels
    order: str = "position"
    similarity: bool = True  # ae: train with the paper's similarity term (pulls the workers' latents together)
    width: float = 1.0  # ae: multiplies the reference architecture's widths
    hidden: int = 64  # pcaae: the correction's hidden width


def parse_codecs(text: str, chunk: int) -> list[CodecSpec]:
    """The codecs of ``--codecs``; a ValueError names the first bad entry."""
    specs = []
    for entry in (item.strip() for item in text.split(",")):
        if not entry:
            continue
        if entry in _FLOATS:
            specs.append(CodecSpec(entry, "float", dtype=entry))
        elif entry in ("int8", "int4"):
            specs.append(CodecSpec(entry, "levels", bits=int(entry[3:])))
        elif entry.startswith("levels="):
            levels = entry.removeprefix("levels=")
            if not levels.isdigit() or int(levels) < 1:
                raise ValueError(f"{entry!r}: levels must be a positive integer")
            specs.append(CodecSpec(entry, "levels", levels=int(levels)))
        elif entry.startswith("pca:"):
            parts = entry.split(":")
            if len(parts) not in (3, 4) or not parts[1].isdigit():
                raise ValueError(f"{entry!r}: write pca:LATENT:DTYPE[:ORDER], e.g. pca:8:int8:value")
            latent, dtype, order = int(parts[1]), parts[2], parts[3] if len(parts) == 4 else "position"
            if not 1 <= latent <= chunk:
                raise ValueError(f"{entry!r}: the latent size must be in [1, --chunk={chunk}]")
            if dtype not in _LATENTS or order not in _ORDERS:
                raise ValueError(f"{entry!r}: the dtype must be one of {_LATENTS} and the order one of {_ORDERS}")
            specs.append(CodecSpec(entry, "pca", dtype=dtype, latent=latent, order=order))
        elif entry.startswith(("ae:", "pcaae:")):
            specs.append(_autoencoder_spec(entry, chunk))
        elif entry in ("leader_scaled", "topk"):
            specs.append(CodecSpec(entry, entry))
        else:
            raise ValueError(
                f"unknown codec {entry!r}: fp32, fp16, bf16, int8, int4, levels=M, pca:L:DTYPE[:ORDER], "
                "ae:C:DTYPE[:ORDER][:nosim][:wWIDTH], pcaae:L:DTYPE[:ORDER][:nosim][:hHIDDEN], leader_scaled, topk"
            )
    if not specs:
        raise ValueError(f"--codecs names no codec: {text!r}")
    return specs


def _autoencoder_spec(entry: str, chunk: int) -> CodecSpec:
    """``ae:C:DTYPE`` or ``pcaae:L:DTYPE``, then any of ``:ORDER``, ``:nosim`` and ``:wX`` (ae: ``X``
    multiplies the widths) or ``:hH`` (pcaae: the correction's hidden width)."""
    parts = entry.split(":")
    pca = parts[0] == "pcaae"
    usage = (
        f"{entry!r}: write pcaae:LATENT:DTYPE[:ORDER][:nosim][:hHIDDEN], e.g. pcaae:16:fp32:h32"
        if pca
        else f"{entry!r}: write ae:CHANNELS:DTYPE[:ORDER][:nosim][:wWIDTH], e.g. ae:4:fp32:value or ae:4:fp32:w0.25"
    )
    if len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) < 1:
        raise ValueError(usage)
    dtype, order, similarity, width, hidden = parts[2], "position", True, 1.0, 64
    if dtype not in _LATENTS:
        raise ValueError(f"{entry!r}: the dtype must be one of {_LATENTS}")
    for option in parts[3:]:
        if option in _ORDERS:
            order = option
        elif option == "nosim":
            similarity = False
        elif option.startswith("h" if pca else "w"):
            try:
                width, hidden = (width, int(option[1:])) if pca else (float(option[1:]), hidden)
            except ValueError:
                raise ValueError(usage) from None
        else:
            raise ValueError(f"{usage} (an order is one of {_ORDERS})")
    if pca:
        if not 1 <= int(parts[1]) <= chunk or hidden < 0:
            raise ValueError(f"{entry!r}: the latent size must be in [1, --chunk={chunk}] and the hidden width >= 0")
        return CodecSpec(
            entry, "pcaae", dtype=dtype, latent=int(parts[1]), order=order, similarity=similarity, hidden=hidden
        )
    from lgc.autoencoder import AutoencoderConfig

    try:  # the architecture's own checks (the chunk against its receptive field, the width), before any recording
        AutoencoderConfig.from_kwargs(chunk=chunk, latent_channels=int(parts[1]), width=width)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{entry!r}: {error}") from None
    return CodecSpec(entry, "ae", dtype=dtype, latent=int(parts[1]), order=order, similarity=similarity, width=width)


@dataclass(frozen=True)
class OwnTopK:
    """Plain top-k (:class:`PlainTopK`) as one leader step reads it."""

    at_leader: Tensor  # [K] the sum read at the leader's positions (ascending)
    bits: float  # wire bits a worker sends, on average: 32 per value and its Golomb-coded positions
    whole_error: Tensor  # [L] per parameter, the squared error of the sum against the whole summed gradient


@dataclass(frozen=True)
class LeaderStep:
    """One recorded step at the leader's positions (concatenated over the parameters, ascending)."""

    leader: int
    positions: Tensor  # [K] in the concatenated parameters, ascending
    values: Tensor  # [W, K] every worker's gradient there
    numel: int  # entries of the concatenated parameters
    momentum: Tensor | None = None  # [K] the earlier steps' delivered sums' running sum there (None at step 0)
    bounds: Tensor | None = None  # [L + 1] where each parameter starts in the concatenation, and its end
    energy: Tensor | None = None  # [L] per parameter, the squared norm of the workers' whole summed gradient
    own: OwnTopK | None = None  # plain top-k's delivered sum


@dataclass(frozen=True)
class PlainTopK:
    """Plain top-k at one step, whoever leads: every worker's own top-k, summed as sparse vectors."""

    positions: Tensor  # [M] ascending: every position some worker sent
    values: Tensor  # [M] the workers' sum there
    bits: float  # wire bits a worker sends, on average: 32 per value and its Golomb-coded positions
    whole_error: Tensor  # [L] per parameter, the squared error of the sum against the whole summed gradient


def plain_topk_steps(gradients: Sequence[Tensor], density: float) -> list[PlainTopK]:
    """Plain top-k of every step: ``gradients`` per parameter ``[W, T, n]``; each worker selects its own
    top-k of every parameter (the leader's rule, :func:`leader_positions`)."""
    sizes = [grad.shape[2] for grad in gradients]
    result = []
    for t in range(gradients[0].shape[1]):
        flat = torch.cat([grad[:, t] for grad in gradients], dim=1).float()
        bits, delivered = 0.0, torch.zeros(flat.shape[1])
        sent = torch.zeros(flat.shape[1], dtype=torch.bool)
        for values in flat:
            own = leader_positions(list(values.split(sizes)), density).sort().values
            bits += 32.0 * own.numel() + 8.0 * golomb_encode(own, flat.shape[1]).to_wire().numel()
            delivered.index_add_(0, own, values[own])
            sent[own] = True
        error = (delivered - flat.sum(dim=0)).double().square()
        positions = torch.nonzero(sent).view(-1)
        per_layer = torch.stack([part.sum() for part in error.split(sizes)])
        result.append(PlainTopK(positions, delivered[positions], bits / flat.shape[0], per_layer))
    return result


def leader_steps(
    gradients: Sequence[Tensor], density: float, rotating: bool, plain: Sequence[PlainTopK] | None = None
) -> list[LeaderStep]:
    """Every step's leader positions: ``gradients`` per parameter ``[W, T, n]``; worker 0 or ``t % W`` leads.

    ``plain`` (:func:`plain_topk_steps` of the same gradients, computed once for every leader rule):
    plain top-k's sum, read at the leader's positions for the ``topk`` codec.
    """
    workers, steps = gradients[0].shape[:2]
    result = []
    momentum = None  # what every worker's momentum buffer holds: the delivered sums, decayed
    sizes = [grad.shape[2] for grad in gradients]
    numel = sum(sizes)
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    for t in range(steps):
        leader = t % workers if rotating else 0
        chosen = leader_positions([grad[leader, t] for grad in gradients], density).sort().values
        flat = torch.cat([grad[:, t] for grad in gradients], dim=1).float()
        values = flat[:, chosen]
        energy = torch.stack([part.double().square().sum() for part in flat.sum(dim=0).split(sizes)])
        own = None
        if plain is not None:
            summed = torch.zeros(numel).index_put_((plain[t].positions,), plain[t].values)
            own = OwnTopK(summed[chosen], plain[t].bits, plain[t].whole_error)
        result.append(
            LeaderStep(
                leader, chosen, values, numel, None if momentum is None else momentum[chosen], bounds, energy, own
            )
        )
        # The step delivers (exactly, for this order's purpose) the sum at its positions, nothing elsewhere.
        delivered = torch.zeros(numel).index_put_((chosen,), values.sum(dim=0))
        momentum = delivered if momentum is None else MOMENTUM * momentum + delivered
    return result


def _wire_sum(per_worker: Tensor) -> Tensor:
    """The workers' tensors summed one after another in their own dtype (as an allreduce sums them), as fp32."""
    total = per_worker[0]
    for other in per_worker[1:]:
        total = total + other
    return total.float()


def cannot_sum(spec: CodecSpec, world: int) -> str | None:
    """Why ``spec`` cannot carry ``world`` workers' sum (its lanes are too narrow), or None."""
    if spec.kind in ("pca", "ae", "pcaae") and spec.dtype == "int8" and quantization_levels(8, world) < 1:
        return f"8-bit latent lanes cannot hold the sum of {world} workers' codes (at most 127)"
    if spec.bits is not None and quantization_levels(spec.bits, world) < 1:
        return (
            f"{spec.bits}-bit lanes cannot hold the sum of {world} workers' codes (at most {(2**spec.bits - 1) // 2})"
        )
    return None


def _lanes(world: int, levels: int) -> int:
    """Bits of the narrowest lane that holds ``world`` workers' offset codes in ``[0, 2 levels]``."""
    return max(1, math.ceil(math.log2(2 * levels * world + 1)))


class _Coder:
    """One codec, fitted (PCA) and applied to the steps of one recording and leader rule."""

    def __init__(self, spec: CodecSpec, chunk: int, world: int, seed: int, ae_updates: int = 1500) -> None:
        self.spec, self.chunk, self.world, self.seed, self.ae_updates = spec, chunk, world, seed, ae_updates
        self.generator = torch.Generator().manual_seed(seed)
        self.basis: Tensor | None = None
        self.autoencoder: Any = None
        self.index = LeaderIndexCodec(chunk, "value" if spec.order == "value" else "position", "golomb")

    def fit(self, steps: Sequence[LeaderStep]) -> None:
        """PCA: the leading right singular vectors of every worker's scaled chunks of the training steps;
        the autoencoder: trained on them (``[rows, W, chunk]`` samples, as LGC's stage 2 collects)."""
        if self.spec.kind in ("ae", "pcaae"):
            from lgc.autoencoder import AutoencoderConfig, AutoencoderTrainer, GradientAutoencoder
            from lgc.autoencoder.losses import DEFAULT_WEIGHTS
            from lgc.autoencoder.pca_autoencoder import PCAAutoencoder, PCAAutoencoderConfig, PCAAutoencoderTrainer

            samples = torch.cat([self._scaled_chunks(step)[0].transpose(0, 1) for step in steps])
            weights = DEFAULT_WEIGHTS if self.spec.similarity else DEFAULT_WEIGHTS._replace(similarity=0.0)
            options = dict(seed=self.seed, buffer_size=samples.shape[0], weights=weights)
            if self.spec.kind == "pcaae":
                shape = PCAAutoencoderConfig(self.chunk, self.spec.latent, self.spec.hidden, seed=self.seed)  # type: ignore[arg-type]
                trainer: AutoencoderTrainer = PCAAutoencoderTrainer(PCAAutoencoder(shape), **options)  # type: ignore[arg-type]
            else:
                config = AutoencoderConfig.from_kwargs(
                    chunk=self.chunk, latent_channels=self.spec.latent, seed=self.seed, width=self.spec.width
                )
                trainer = AutoencoderTrainer(GradientAutoencoder(config), **options)  # type: ignore[arg-type]
            trainer.add(samples)
            trainer.train(self.ae_updates)
            self.autoencoder = trainer.autoencoder.eval()
            return
        if self.spec.kind != "pca":
            return
        rows = torch.cat([self._scaled_chunks(step)[0].reshape(-1, self.chunk) for step in steps])
        _, _, vh = torch.linalg.svd(rows.double(), full_matrices=False)
        self.basis = vh[: self.spec.latent].T.float()  # [chunk, L]

    def _order(self, step: LeaderStep) -> Tensor | None:
        """The permutation into wire order (None: ascending positions)."""
        if self.spec.order == "value":
            return torch.argsort(step.values[step.leader], descending=True, stable=True)
        if self.spec.order == "momentum" and step.momentum is not None:
            return torch.argsort(step.momentum, descending=True, stable=True)
        return None

    def _ordered(self, step: LeaderStep) -> Tensor:
        """The workers' values in wire order: ascending positions, by the leader's value or by the momentum."""
        order = self._order(step)
        return step.values if order is None else step.values[:, order]

    def _scaled_chunks(self, step: LeaderStep) -> tuple[Tensor, Tensor]:
        """``[W, rows, chunk]`` every worker's chunks divided by the leader's chunk scales, and those scales."""
        values = self._ordered(step)
        scales = chunk_scales(to_chunks(values[step.leader], self.chunk))
        return torch.stack([divide_by_scales(to_chunks(v, self.chunk), scales) for v in values]), scales

    def _round(self, chunks: Tensor, scales: Tensor, levels: int) -> Tensor:
        return round_to_levels(chunks, scales, levels, torch.rand(chunks.shape, generator=self.generator))

    def run(self, step: LeaderStep) -> tuple[Tensor, dict[str, float]]:
        """The delivered sum (in wire order) and the step's wire bits: per worker's payload and the leader's message."""
        spec, world, k = self.spec, self.world, step.values.shape[1]
        rows = num_chunks(k, self.chunk)
        position_bits = 8 * self.index.encode_positions(self._wire_positions(step), step.numel).numel()
        if spec.kind == "leader_scaled":
            return world * step.values[step.leader], {"payload": 0.0, "leader": 32.0 * k + position_bits}
        if spec.kind == "topk":
            assert step.own is not None, "pass plain_topk_steps() to leader_steps()"
            return step.own.at_leader, {"payload": step.own.bits, "leader": 0.0}
        if spec.kind == "float":
            dtype = _FLOATS[spec.dtype]  # type: ignore[index]
            if dtype == torch.float32:
                return step.values.sum(dim=0), {"payload": 32.0 * k, "leader": float(position_bits)}
            chunks, scales = self._scaled_chunks(step)
            delivered = from_chunks(_wire_sum(to_wire_float(chunks, dtype, world)) * scales[:, None], k)
            return delivered, {"payload": 16.0 * self.chunk * rows, "leader": 32.0 * rows + position_bits}
        if spec.kind == "levels":
            levels = spec.levels if spec.levels is not None else quantization_levels(spec.bits, world)  # type: ignore[arg-type]
            if levels < 1:
                raise ValueError(f"{spec.name}: {spec.bits}-bit lanes cannot hold the sum of {world} workers' codes")
            lane = spec.bits if spec.bits is not None else _lanes(world, levels)
            chunks = torch.stack([to_chunks(v, self.chunk) for v in self._ordered(step)])
            shared = chunks.abs().amax(dim=(0, 2))
            shared = torch.where(shared > 0, shared, torch.ones_like(shared))
            codes = torch.stack([self._round(c, shared, levels) for c in chunks]).sum(dim=0)
            delivered = from_chunks(codes / levels * shared[:, None], k)
            return delivered, {"payload": float(lane * self.chunk * rows + 32 * rows), "leader": float(position_bits)}
        if spec.kind in ("ae", "pcaae"):
            return self._run_autoencoder(step, rows, position_bits)
        assert self.basis is not None, "fit() first"
        chunks, scales = self._scaled_chunks(step)
        codes = chunks @ self.basis  # [W, rows, L]
        latent = spec.latent or 0
        if spec.dtype == "int8":
            summed = self._int8_sum(codes)
            payload = 8.0 * latent * rows + 32.0 * rows
        else:
            dtype = _FLOATS[spec.dtype]  # type: ignore[index]
            summed = _wire_sum(to_wire_float(codes, dtype, world))
            payload = 8.0 * dtype.itemsize * latent * rows
        delivered = from_chunks((summed @ self.basis.T) * scales[:, None], k)
        return delivered, {"payload": payload, "leader": 32.0 * rows + position_bits}

    def _int8_sum(self, codes: Tensor) -> Tensor:
        """``[W, rows, n]`` codes rounded to a per-row scale every worker shares (the largest magnitude over
        the workers) and summed in 8-bit lanes, as shared-index int8 and LGC-RAR's int8 latents do."""
        levels = quantization_levels(8, self.world)
        shared = codes.abs().amax(dim=(0, 2))
        shared = torch.where(shared > 0, shared, torch.ones_like(shared))
        return torch.stack([self._round(c, shared, levels) for c in codes]).sum(dim=0) / levels * shared[:, None]

    @torch.no_grad()
    def _run_autoencoder(self, step: LeaderStep, rows: int, position_bits: int) -> tuple[Tensor, dict[str, float]]:
        ae = self.autoencoder
        assert ae is not None, "fit() first"
        chunks, scales = self._scaled_chunks(step)
        latent_numel = ae.config.latent_numel
        encoded = torch.stack([ae.encode(c) for c in chunks])  # [W, rows, *latent]
        if self.spec.dtype == "int8":
            summed = self._int8_sum(encoded.reshape(self.world, rows, -1)).view(encoded.shape[1:])
            payload = 8.0 * latent_numel * rows + 32.0 * rows
        else:
            dtype = _FLOATS[self.spec.dtype]  # type: ignore[index]
            summed = _wire_sum(torch.stack([to_wire_float(e, dtype, self.world) for e in encoded]))
            payload = 8.0 * dtype.itemsize * latent_numel * rows
        mean = ae.decode(summed / self.world)
        delivered = from_chunks(self.world * mean * scales[:, None], step.values.shape[1])
        return delivered, {"payload": payload, "leader": 32.0 * rows + position_bits}

    def _wire_positions(self, step: LeaderStep) -> Tensor:
        """The positions as the leader sends them: in value order (the permutation travels), else ascending."""
        if self.spec.order == "value":
            return step.positions[self._order(step)]
        return step.positions  # ascending; "momentum" is an order every worker computes itself


def _ratio(error: Tensor, norm: Tensor) -> list[float]:
    return [float(e / n) if n > 0 else 0.0 for e, n in zip(error.tolist(), norm.tolist(), strict=True)]


def _evaluate(coder: _Coder, steps: Sequence[LeaderStep], names: Sequence[str] | None = None) -> dict[str, Any]:
    """The codec's errors (at the leader's positions and of the whole sum, overall and per parameter),
    wire bits per value and CPU time over ``steps``; ``names`` labels the parameters (per-parameter
    errors need the steps' ``bounds`` and ``energy``)."""
    payload = leader = cpu = 0.0
    count = 0
    layers = 1 if steps[0].bounds is None else steps[0].bounds.numel() - 1
    error, norm = torch.zeros(layers, dtype=torch.float64), torch.zeros(layers, dtype=torch.float64)
    whole_error, whole_norm = torch.zeros(layers, dtype=torch.float64), torch.zeros(layers, dtype=torch.float64)
    threads = torch.get_num_threads()
    for step in steps:
        torch.set_num_threads(1)  # the CPU times are one thread's
        try:
            started = time.process_time()
            delivered, bits = coder.run(step)
            cpu += time.process_time() - started
        finally:
            torch.set_num_threads(threads)
        order = coder._order(step)
        positions = step.positions if order is None else step.positions[order]
        layer = (
            torch.zeros_like(positions)
            if step.bounds is None
            else torch.bucketize(positions, step.bounds[1:], right=True)
        )
        exact = coder._ordered(step).sum(dim=0).double()
        step_error = torch.zeros(layers, dtype=torch.float64).index_add_(0, layer, (delivered - exact).square())
        step_norm = torch.zeros(layers, dtype=torch.float64).index_add_(0, layer, exact.square())
        error += step_error
        norm += step_norm
        if step.energy is not None:
            whole_norm += step.energy
            # A leader's codec delivers nothing elsewhere: the rest of the sum is its error there.
            own = step.own.whole_error if coder.spec.kind == "topk" and step.own is not None else None
            whole_error += own if own is not None else step.energy - step_norm + step_error
        payload += bits["payload"]
        leader += bits["leader"]
        count += step.values.shape[1]
    result: dict[str, Any] = {
        "error": _ratio(error.sum()[None], norm.sum()[None])[0],
        "whole_error": _ratio(whole_error.sum()[None], whole_norm.sum()[None])[0] if whole_norm.sum() > 0 else None,
        "payload_bits_per_value": payload / count,
        "leader_bits_per_value": leader / count,
        "bits_per_value": (payload + leader) / count,
        "cpu_ms_per_step_and_worker": 1000 * cpu / len(steps) / coder.world,
    }
    if names is not None and steps[0].bounds is not None:
        result["layers"] = {
            name: {"error": at, "whole_error": whole}
            for name, at, whole in zip(names, _ratio(error, norm), _ratio(whole_error, whole_norm), strict=True)
        }
    return result


def layer_premise(gradients: Sequence[Tensor], names: Sequence[str], density: float, scored: slice) -> list[dict]:
    """Per parameter, over the ``scored`` steps: its size and LGC's premise with a fixed and a rotating
    leader (the mean over steps of r at the leader's positions and of the energy share there)."""
    from lgc.analysis.correlation import leader_position_statistics  # imports Lightning: only when measuring

    rows = []
    for name, grad in zip(names, gradients, strict=True):
        workers = grad.shape[0]
        row: dict[str, Any] = {"name": name, "numel": grad.shape[2]}
        for rotating in (False, True):
            per_step: dict[str, list[float]] = {}
            for t in range(grad.shape[1])[scored]:  # one step at a time: the statistics work in float64
                leader = t % workers if rotating else 0
                workers_first = [leader, *(w for w in range(workers) if w != leader)]  # the leader leads index 0
                for key, value in leader_position_statistics(grad[workers_first, t : t + 1], density).items():
                    per_step.setdefault(key, []).append(float(value[0]))
            row["rotating" if rotating else "fixed"] = {
                key: float(torch.tensor(values).nanmean()) for key, values in per_step.items()
            }
        rows.append(row)
    return rows


#: The leader rules a benchmark can run: worker 0 always, or worker ``t % W`` at step ``t``.
LEADERS = ("fixed", "rotating")


def benchmark_codecs(
    recording: str | Path,
    codecs: Sequence[CodecSpec],
    density: float = 0.01,
    chunk: int = 64,
    train_fraction: float = 0.5,
    seed: int = 0,
    label: str | None = None,
    ae_updates: int = 1500,
    leaders: Sequence[str] = LEADERS,
    done_rows: Sequence[dict[str, Any]] = (),
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every codec on one recording, with each of ``leaders`` (CPU times: one thread's).

    ``done_rows``: rows measured before (same recording and settings), kept rather than measured
    again; ``on_row(result)`` is called with the result so far after every row (``complete`` False
    until the last), so a stopped benchmark can resume from its last row.
    """
    from lgc.analysis import load_recording  # imports Lightning: here, not when lgc-bench starts

    unknown = [leader for leader in leaders if leader not in LEADERS]
    if unknown or not leaders:
        raise ValueError(f"leaders must be some of {LEADERS}, got {list(leaders)!r}")
    rec = load_recording(recording)
    names = [name for name in rec.names if rec.flat(name).shape[2] >= chunk]
    gradients = [rec.flat(name) for name in names]
    steps = gradients[0].shape[1]
    cut = max(1, min(steps - 1, int(train_fraction * steps)))
    earlier = {(row["codec"], row["leader"]): row for row in done_rows}
    result: dict[str, Any] = {
        "layers": layer_premise(gradients, names, density, slice(cut, None)),
        "label": label or f"{rec.world_size} workers",
        "workers": rec.world_size,
        "steps": steps,
        "train_steps": cut,
        "parameters": names,
        "density": density,
        "chunk": chunk,
        "ae_updates": ae_updates,
        "load_average": [os.getloadavg()[0], None],  # 1 minute, before and after: the CPU times' context
        "rows": [],
        "complete": False,
    }
    # Plain top-k does not depend on the leader: computed once, and only when it is measured.
    plain = plain_topk_steps(gradients, density) if any(spec.kind == "topk" for spec in codecs) else None
    for leader in leaders:
        layouts = leader_steps(gradients, density, leader == "rotating", plain)
        for spec in codecs:
            row = earlier.get((spec.name, leader))
            if row is None:
                unfit = cannot_sum(spec, rec.world_size)
                if unfit is not None:
                    row = {"codec": spec.name, "leader": leader, "error": None, "note": unfit}
                else:
                    coder = _Coder(spec, chunk, rec.world_size, seed, ae_updates)
                    coder.fit(layouts[:cut])  # (with every thread: only the codec's run is timed)
                    row = {"codec": spec.name, "leader": leader, **_evaluate(coder, layouts[cut:], names)}
            result["rows"].append(row)
            if on_row is not None:
                on_row(result)
    result["load_average"][1] = os.getloadavg()[0]
    result["complete"] = True
    return result
