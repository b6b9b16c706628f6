"""``lgc-bench codecs``: rate against distortion for every codec of the leader's top-k positions.

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
  leader's chunk scale), :class:`lgc.learned.shared_index.SharedIndexStage`;
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
  ``fp32`` or ``fp16``;
* ``pcaae:L:DTYPE[:ORDER][:nosim][:hHIDDEN]``: the PCA-initialised autoencoder
  (:class:`lgc.autoencoder.pca_autoencoder.PCAAutoencoder`): ``pca:L``'s directions plus
  nonlinear corrections of ``HIDDEN`` hidden units (default 64) that start at zero, trained as
  ``ae`` is and applied as LGC-RAR applies it;
* ``leader_scaled``: only the leader sends its values (fp32), ``P`` times them is the estimate.

Every codec sees the raw recorded gradients (no error feedback residuals): the positions are
those of the first steps of a run's compressed stage, not of its later steps.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lgc.autoencoder import chunk_scales, from_chunks, num_chunks, to_chunks
from lgc.bench.autoencoder import leader_positions
from lgc.bench.methods import parse_list
from lgc.learned.leader_code import LeaderIndexCodec
from lgc.learned.shared_index import quantization_levels, round_to_levels

__all__ = ["CodecSpec", "LeaderStep", "benchmark_codecs", "cannot_sum", "leader_steps", "parse_codecs"]

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
    kind: str  # "float", "levels", "pca" or "leader_scaled"
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
        elif entry == "leader_scaled":
            specs.append(CodecSpec(entry, "leader_scaled"))
        else:
            raise ValueError(
                f"unknown codec {entry!r}: fp32, fp16, bf16, int8, int4, levels=M, pca:L:DTYPE[:ORDER], "
                "ae:C:DTYPE[:ORDER][:nosim][:wWIDTH], pcaae:L:DTYPE[:ORDER][:nosim][:hHIDDEN], leader_scaled"
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
    if dtype not in ("fp32", "fp16"):
        raise ValueError(f"{entry!r}: the dtype must be fp32 or fp16")
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
class LeaderStep:
    """One recorded step at the leader's positions (concatenated over the parameters, ascending)."""

    leader: int
    positions: Tensor  # [K] in the concatenated parameters, ascending
    values: Tensor  # [W, K] every worker's gradient there
    numel: int  # entries of the concatenated parameters
    momentum: Tensor | None = None  # [K] the earlier steps' delivered sums' running sum there (None at step 0)


def leader_steps(gradients: Sequence[Tensor], density: float, rotating: bool) -> list[LeaderStep]:
    """Every step's leader positions: ``gradients`` per parameter ``[W, T, n]``; worker 0 or ``t % W`` leads."""
    workers, steps = gradients[0].shape[:2]
    result = []
    momentum = None  # what every worker's momentum buffer holds: the delivered sums, decayed
    numel = sum(grad.shape[2] for grad in gradients)
    for t in range(steps):
        leader = t % workers if rotating else 0
        chosen = leader_positions([grad[leader, t] for grad in gradients], density).sort().values
        flat = torch.cat([grad[:, t] for grad in gradients], dim=1).float()
        values = flat[:, chosen]
        result.append(LeaderStep(leader, chosen, values, numel, None if momentum is None else momentum[chosen]))
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
    if spec.kind == "pca" and spec.dtype == "int8" and quantization_levels(8, world) < 1:
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
        return torch.stack([to_chunks(v, self.chunk) / scales[:, None] for v in values]), scales

    def _round(self, chunks: Tensor, scales: Tensor, levels: int) -> Tensor:
        return round_to_levels(chunks, scales, levels, torch.rand(chunks.shape, generator=self.generator))

    def run(self, step: LeaderStep) -> tuple[Tensor, dict[str, float]]:
        """The delivered sum (in wire order) and the step's wire bits: per worker's payload and the leader's message."""
        spec, world, k = self.spec, self.world, step.values.shape[1]
        rows = num_chunks(k, self.chunk)
        position_bits = 8 * self.index.encode_positions(self._wire_positions(step), step.numel).numel()
        if spec.kind == "leader_scaled":
            return world * step.values[step.leader], {"payload": 0.0, "leader": 32.0 * k + position_bits}
        if spec.kind == "float":
            dtype = _FLOATS[spec.dtype]  # type: ignore[index]
            if dtype == torch.float32:
                return step.values.sum(dim=0), {"payload": 32.0 * k, "leader": float(position_bits)}
            chunks, scales = self._scaled_chunks(step)
            delivered = from_chunks(_wire_sum(chunks.to(dtype)) * scales[:, None], k)
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
            levels = quantization_levels(8, world)
            shared = codes.abs().amax(dim=(0, 2))
            shared = torch.where(shared > 0, shared, torch.ones_like(shared))
            summed = torch.stack([self._round(c, shared, levels) for c in codes]).sum(dim=0) / levels * shared[:, None]
            payload = 8.0 * latent * rows + 32.0 * rows
        else:
            dtype = _FLOATS[spec.dtype]  # type: ignore[index]
            summed = _wire_sum(codes.to(dtype))
            payload = 8.0 * dtype.itemsize * latent * rows
        delivered = from_chunks((summed @ self.basis.T) * scales[:, None], k)
        return delivered, {"payload": payload, "leader": 32.0 * rows + position_bits}

    @torch.no_grad()
    def _run_autoencoder(self, step: LeaderStep, rows: int, position_bits: int) -> tuple[Tensor, dict[str, float]]:
        ae, dtype = self.autoencoder, _FLOATS[self.spec.dtype]  # type: ignore[index]
        assert ae is not None, "fit() first"
        chunks, scales = self._scaled_chunks(step)
        codes = torch.stack([ae.encode(c).to(dtype) for c in chunks])
        mean = ae.decode(_wire_sum(codes) / self.world)
        delivered = from_chunks(self.world * mean * scales[:, None], step.values.shape[1])
        payload = 8.0 * dtype.itemsize * ae.config.latent_numel * rows
        return delivered, {"payload": payload, "leader": 32.0 * rows + position_bits}

    def _wire_positions(self, step: LeaderStep) -> Tensor:
        """The positions as the leader sends them: in value order (the permutation travels), else ascending."""
        if self.spec.order == "value":
            return step.positions[self._order(step)]
        return step.positions  # ascending; "momentum" is an order every worker computes itself


def _evaluate(coder: _Coder, steps: Sequence[LeaderStep]) -> dict[str, float]:
    error = norm = payload = leader = cpu = 0.0
    count = 0
    for step in steps:
        started = time.process_time()
        delivered, bits = coder.run(step)
        cpu += time.process_time() - started
        exact = coder._ordered(step).sum(dim=0)
        error += float((delivered - exact).double().square().sum())
        norm += float(exact.double().square().sum())
        payload += bits["payload"]
        leader += bits["leader"]
        count += step.values.shape[1]
    return {
        "error": error / norm if norm > 0 else 0.0,
        "payload_bits_per_value": payload / count,
        "leader_bits_per_value": leader / count,
        "bits_per_value": (payload + leader) / count,
        "cpu_ms_per_step_and_worker": 1000 * cpu / len(steps) / coder.world,
    }


def benchmark_codecs(
    recording: str | Path,
    codecs: Sequence[CodecSpec],
    density: float = 0.01,
    chunk: int = 64,
    train_fraction: float = 0.5,
    seed: int = 0,
    label: str | None = None,
    ae_updates: int = 1500,
) -> dict[str, Any]:
    """Every codec on one recording, with a fixed (worker 0) and a rotating leader (one thread)."""
    from lgc.analysis import load_recording  # imports Lightning: here, not when lgc-bench starts

    rec = load_recording(recording)
    names = [name for name in rec.names if rec.flat(name).shape[2] >= chunk]
    gradients = [rec.flat(name) for name in names]
    steps = gradients[0].shape[1]
    cut = max(1, min(steps - 1, int(train_fraction * steps)))
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU times are one thread's
    try:
        for rotating in (False, True):
            layouts = leader_steps(gradients, density, rotating)
            for spec in codecs:
                leader = "rotating" if rotating else "fixed"
                unfit = cannot_sum(spec, rec.world_size)
                if unfit is not None:
                    rows.append({"codec": spec.name, "leader": leader, "error": None, "note": unfit})
                    continue
                coder = _Coder(spec, chunk, rec.world_size, seed, ae_updates)
                coder.fit(layouts[:cut])
                rows.append({"codec": spec.name, "leader": leader, **_evaluate(coder, layouts[cut:])})
    finally:
        torch.set_num_threads(threads)
    return {
        "label": label or f"{rec.world_size} workers",
        "workers": rec.world_size,
        "steps": steps,
        "train_steps": cut,
        "parameters": names,
        "density": density,
        "chunk": chunk,
        "ae_updates": ae_updates,
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['label']}: {result['steps']} recorded steps (PCA fitted and autoencoders trained, "
        f"{result['ae_updates']} updates, on the first {result['train_steps']}), "
        f"density {result['density']}, chunk {result['chunk']}",
        "",
        "| leader | codec | payload bits/value | leader's message bits/value | total bits/value | delivered-sum error "
        "| CPU ms/step/worker |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["error"] is None:
            lines.append(f"| {row['leader']} | {row['codec']} | - | - | - | {row['note']} | - |")
            continue
        lines.append(
            f"| {row['leader']} | {row['codec']} | {row['payload_bits_per_value']:.2f} | "
            f"{row['leader_bits_per_value']:.2f} | {row['bits_per_value']:.2f} | {row['error']:.4g} | "
            f"{row['cpu_ms_per_step_and_worker']:.2f} |"
        )
    return "\n".join(lines)


def plot_codecs(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Delivered-sum error against total bits per value, one panel per recording, fixed and rotating leader."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    columns = min(3, len(results))
    figure, axes = plt.subplots(
        -(-len(results) // columns), columns, figsize=(5.5 * columns, 4.2 * -(-len(results) // columns) + 2.5),
        squeeze=False, layout="constrained",
    )  # fmt: skip
    # One colour per codec across every panel (its marker says the leader), one key for the figure.
    codecs = list(dict.fromkeys(row["codec"] for result in results for row in result["rows"]))
    palette = matplotlib.colormaps["tab20"]
    handles: dict[str, Any] = {}
    for axis, result in zip(axes.flat, results, strict=False):
        for row in result["rows"]:
            if row["error"] is None:
                continue  # cannot carry this many workers' sum
            label = f"{row['codec']} ({row['leader']})"
            handles[label] = axis.scatter(
                row["bits_per_value"],
                max(row["error"], 1e-9),
                marker="o" if row["leader"] == "fixed" else "^",
                color=palette(codecs.index(row["codec"]) % 20),
                label=label,
            )
        axis.set_yscale("log")
        axis.set_xlabel("wire bits per value (payload + the leader's message)")
        axis.set_ylabel("delivered-sum error (relative, squared)")
        axis.set_title(result["label"], fontsize=10)
        axis.grid(alpha=0.3, which="both")
    for axis in axes.flat[len(results) :]:
        axis.set_visible(False)
    figure.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=5, fontsize=7)
    figure.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recording", type=Path, action="append", help="a GradientRecorder folder (repeatable; default: record now)"
    )
    parser.add_argument("--data", default="digits", choices=["digits", "fashion_mnist"], help="task to record")
    parser.add_argument("--workers", default="2,4,8", help="comma-separated worker counts to record (default 2,4,8)")
    parser.add_argument("--batch-sizes", default="8,32", help="comma-separated images per worker (default 8,32)")
    parser.add_argument("--steps", type=int, default=40, help="steps per recording (default 40)")
    parser.add_argument("--density", type=float, default=0.01, help="the leader's top-k density (default 0.01)")
    parser.add_argument("--chunk", type=int, default=64, help="values per chunk (default 64)")
    parser.add_argument("--train-fraction", type=float, default=0.5, help="steps PCA is fitted on (default 0.5)")
    parser.add_argument("--ae-updates", type=int, default=1500, help="autoencoder training updates (default 1500)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help="comma-separated codecs (default %(default)s)")
    parser.add_argument(
        "--out",
        type=Path,
        help="write codecs.md, codecs.json and codecs.png here (after every recording; a rerun with the same "
        "settings skips the recordings measured there)",
    )


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(item) for item in parse_list(text, what)]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{what} must be positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        if not 0 < args.density <= 1:
            raise ValueError(f"--density must be in (0, 1], got {args.density}")
        if not 0 < args.train_fraction < 1:
            raise ValueError(f"--train-fraction must be in (0, 1), got {args.train_fraction}")
        if args.ae_updates < 1:
            raise ValueError(f"--ae-updates must be >= 1, got {args.ae_updates}")
        if args.chunk < 2 or args.steps < 2:
            raise ValueError(f"--chunk and --steps must be >= 2, got {args.chunk} and {args.steps}")
        codecs = parse_codecs(args.codecs, args.chunk)
        workers, batch_sizes = _ints(args.workers, "workers"), _ints(args.batch_sizes, "batch-sizes")
    except ValueError as error:
        raise SystemExit(f"lgc-bench codecs: {error}") from None
    settings = {
        "density": args.density,
        "chunk": args.chunk,
        "train_fraction": args.train_fraction,
        "ae_updates": args.ae_updates,
        "codecs": [spec.name for spec in codecs],
    }
    done = _finished(args.out, settings)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, record in _recordings(args, workers, batch_sizes, Path(tmp)):
            if label in done:
                print(f"{label}: measured before, in {args.out / 'codecs.json'}", flush=True)
                results.append(done[label])
                continue
            result = benchmark_codecs(
                record(),
                codecs,
                args.density,
                args.chunk,
                args.train_fraction,
                label=label,
                ae_updates=args.ae_updates,
            )
            result["settings"] = settings
            print(format_table(result) + "\n", flush=True)
            results.append(result)
            if args.out is not None:  # after every recording: a stopped run resumes from here
                _write(args.out, results)
    if args.out is not None:
        _write(args.out, results)
        plot_codecs(results, args.out / "codecs.png")
        print(f"wrote {args.out / 'codecs.md'}, codecs.json and codecs.png")
    return results


def _finished(out: Path | None, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Results already in ``out/codecs.json`` measured with the same settings, by label."""
    path = None if out is None else out / "codecs.json"
    if path is None or not path.is_file():
        return {}
    return {result["label"]: result for result in json.loads(path.read_text()) if result.get("settings") == settings}


def _write(out: Path, results: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "codecs.md").write_text("\n\n".join(format_table(r) for r in results) + "\n")
    (out / "codecs.json").write_text(json.dumps(results, indent=2))


def _recordings(
    args: argparse.Namespace, workers: list[int], batch_sizes: list[int], tmp: Path
) -> Iterator[tuple[str, Callable[[], Path]]]:
    """``(label, record)`` of every recording, ``record()`` making it: the ones given, or one per worker
    count and batch size (recorded only when asked for, so a resumed run skips what it measured)."""
    if args.recording:
        for folder in args.recording:
            yield str(folder), lambda folder=folder: folder
        return

    for world in workers:
        for batch in batch_sizes:

            def record(world: int = world, batch: int = batch) -> Path:
                from lgc.analysis import record_gradients  # Lightning: only once the arguments are good

                return record_gradients(
                    tmp / f"w{world}_b{batch}",
                    partition="iid",
                    max_epochs=-1,  # as many epochs as --steps takes
                    patterns=["model.*.weight"],
                    overrides=[
                        f"data={args.data}",
                        f"data.batch_size={batch}",
                        f"trainer.devices={world}",
                        "ddp.oversubscribe=true",
                        f"trainer.max_steps={args.steps}",
                        "trainer.limit_val_batches=0",
                    ],
                )

            yield f"{args.data}, {world} workers x {batch} images (IID), {args.steps} steps", record
