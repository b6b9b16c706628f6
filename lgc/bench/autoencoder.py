"""``lgc-bench autoencoder``: how well LGC's autoencoder carries real gradients, option by option.

LGC's design choices that the paper does not settle are measured here rather than assumed: the
order of the values inside a chunk (``position``, ``magnitude``, ``value``), the latent size,
fp16 latents, and the architecture (``--architecture``: widths and decoder, against the
reference's; with the CPU time of encoding and decoding, since the reference widths cost more
than a ResNet-50 step at density 1 %). The benchmark records every worker's gradients of a short
dense run on the embedded task (:func:`lgc.analysis.record_gradients`; or reads a recording given with ``--recording``),
builds LGC's samples from them exactly as stage 2 does (the leader's top-k positions per
parameter, every worker's values there, chunked and divided by the leader's chunk scales), trains
an autoencoder on the first ``--train-fraction`` of the steps and reports, on the later steps it
never saw:

* ``mean_error``: ``||D(mean_i E(x_i)) - mean_i x_i||^2 / ||mean_i x_i||^2``, what LGC-RAR applies;
* ``worker_error``: the same for every worker's own reconstruction ``D(E(x_i))``;
* ``leader_error``: the leader's values taken as everyone's mean, for reference: an error below
  it means the code carries more than the leader alone knows;
* ``cpu_ms_per_1k_chunks``: one thread's CPU time to encode 1,000 chunks and decode them twice
  (LGC-RAR's work per worker: its own reconstruction and the mean), median of 5.

Simplification: the positions come from the raw gradients (no error feedback residuals), so the
samples resemble stage 2's of the first steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from lgc.autoencoder import (
    AutoencoderConfig,
    AutoencoderTrainer,
    GradientAutoencoder,
    chunk_scales,
    divide_by_scales,
    to_chunks,
)
from lgc.bench.compressors import _time_once
from lgc.bench.methods import parse_overrides
from lgc.compressors.selection import topk_indices
from lgc.compressors.topk import num_selected

__all__ = ["aligned_samples", "benchmark_autoencoder", "leader_positions"]

_ORDERS = ("position", "magnitude", "value")


def leader_positions(leader_gradients: list[torch.Tensor], density: float) -> torch.Tensor:
    """The leader's top-k positions of every parameter (``[n]`` each), in the parameters' concatenation."""
    positions, offset = [], 0
    for grad in leader_gradients:
        positions.append(topk_indices(grad, num_selected(grad.numel(), density)) + offset)
        offset += grad.numel()
    return torch.cat(positions)


def aligned_samples(
    gradients: list[torch.Tensor], density: float, chunk: int, order: str, leader: int = 0
) -> torch.Tensor:
    """LGC's stage-2 samples of one step: ``[rows, workers, chunk]``.

    Args:
        gradients: per parameter, every worker's gradient ``[W, numel]``.
        density: top-k density per parameter.
        chunk: values per chunk.
        order: ``"position"``, ``"magnitude"`` or ``"value"`` (the leader's, descending).
        leader: the worker whose top-k positions everyone uses.
    """
    flat = torch.cat(gradients, dim=1)
    chosen = leader_positions([grad[leader] for grad in gradients], density)
    lead = flat[leader, chosen]
    if order == "value":
        chosen = chosen[torch.argsort(lead, descending=True, stable=True)]
    elif order == "magnitude":
        chosen = chosen[torch.argsort(lead.abs(), descending=True, stable=True)]
    else:
        chosen = torch.sort(chosen).values
    values = flat[:, chosen]
    scales = chunk_scales(to_chunks(values[leader], chunk))
    return torch.stack([divide_by_scales(to_chunks(v, chunk), scales) for v in values], dim=1)


def _relative(estimate: torch.Tensor, target: torch.Tensor) -> float:
    return float((estimate - target).square().sum() / target.square().sum().clamp_min(1e-30))


def _evaluate(ae: GradientAutoencoder, samples: torch.Tensor, latent_dtype: torch.dtype) -> dict[str, float]:
    with torch.no_grad():
        workers = samples.shape[1]
        latents = torch.stack([ae.encode(samples[:, i]) for i in range(workers)], dim=1).to(latent_dtype).float()
        mean = samples.mean(dim=1)
        own = torch.stack([ae.decode(latents[:, i]) for i in range(workers)], dim=1)
        return {
            "mean_error": _relative(ae.decode(latents.mean(dim=1)), mean),
            "worker_error": _relative(own, samples),
            "leader_error": _relative(samples[:, 0], mean),
        }


def codec_cpu_ms(ae: GradientAutoencoder, chunks: int = 1000, repeats: int = 5) -> float:
    """One thread's CPU milliseconds to encode ``chunks`` chunks and decode them twice (median of ``repeats``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(chunks, ae.config.chunk, generator=torch.Generator().manual_seed(0))

        def encode_and_decode_twice() -> None:
            latent = ae.encode(x)
            ae.decode(latent)
            ae.decode(latent)

        with torch.no_grad():
            # The first call is a warm-up.
            times = [_time_once(encode_and_decode_twice, x.device)[1] for _ in range(repeats + 1)]
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def benchmark_autoencoder(
    recording: str | Path,
    density: float = 0.01,
    chunk: int = 64,
    latent_channels: tuple[int, ...] = (4, 2),
    orders: tuple[str, ...] = _ORDERS,
    updates: int = 1500,
    train_fraction: float = 0.7,
    seed: int = 0,
    architectures: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train and evaluate one autoencoder per (value order, architecture, latent channels) on a recording.

    ``architectures``: label -> :class:`~lgc.autoencoder.AutoencoderConfig` fields over the
    reference's (default: ``{"reference": {}}``).
    """
    from lgc.analysis import load_recording  # imports Lightning: here, not when lgc-bench starts

    rec = load_recording(recording)
    names = [name for name in rec.names if rec.flat(name).shape[2] >= chunk]
    steps = rec.steps.numel()
    cut = max(1, int(train_fraction * steps))
    rows = []
    for order in orders:
        per_step = [aligned_samples([rec.flat(n)[:, t] for n in names], density, chunk, order) for t in range(steps)]
        train, held_out = torch.cat(per_step[:cut]), torch.cat(per_step[cut:])
        for label, fields in (architectures or {"reference": {}}).items():
            for channels in latent_channels:
                config = AutoencoderConfig.from_kwargs(
                    **{"chunk": chunk, "latent_channels": channels, "seed": seed, **fields}
                )
                trainer = AutoencoderTrainer(GradientAutoencoder(config), seed=seed, buffer_size=train.shape[0])
                trainer.add(train)
                trainer.train(updates)
                cpu_ms = codec_cpu_ms(trainer.autoencoder)
                for dtype in (torch.float32, torch.float16):
                    rows.append(
                        {
                            "value_order": order,
                            "architecture": label,
                            "parameters": sum(p.numel() for p in trainer.autoencoder.parameters()),
                            "latent_channels": config.latent_channels,
                            "latent_dtype": str(dtype).removeprefix("torch."),
                            "latent_bits_per_value": 8 * config.latent_numel * dtype.itemsize / config.chunk,
                            "cpu_ms_per_1k_chunks": cpu_ms,
                            **_evaluate(trainer.autoencoder, held_out, dtype),
                        }
                    )
    return {
        "recording": str(recording),
        "workers": rec.world_size,
        "steps": steps,
        "train_steps": cut,
        "parameters": names,
        "density": density,
        "chunk": chunk,
        "updates": updates,
        "held_out_samples": int(held_out.shape[0]),
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['workers']} workers, {result['steps']} recorded steps (autoencoder trained on the first "
        f"{result['train_steps']}, {result['updates']} updates), density {result['density']}, chunk {result['chunk']}, "
        f"{result['held_out_samples']} held-out samples",
        "",
        "| value order | architecture (parameters) | CPU ms / 1k chunks | latent | bits/value "
        "| mean decode error | own decode error | leader as mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['value_order']} | {row['architecture']} ({row['parameters']:,}) | "
            f"{row['cpu_ms_per_1k_chunks']:.0f} | "
            f"{row['latent_channels']} ch {row['latent_dtype']} | "
            f"{row['latent_bits_per_value']:.1f} | {row['mean_error']:.3f} | {row['worker_error']:.3f} | "
            f"{row['leader_error']:.3f} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recording", type=Path, help="a GradientRecorder folder (default: record one now)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the recorded run")
    parser.add_argument("--partition", default="iid", choices=["iid", "dirichlet"])
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the recorded run")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--updates", type=int, default=1500)
    parser.add_argument(
        "--orders", default=",".join(_ORDERS), help="comma-separated value orders (default %(default)s)"
    )
    parser.add_argument("--latent-channels", default="4,2", help="comma-separated latent channels (default 4,2)")
    parser.add_argument(
        "--architecture",
        action="append",
        default=None,
        metavar="LABEL[:KNOBS]",
        help="an architecture to compare, AutoencoderConfig fields over the reference's, e.g. "
        "'narrow:encoder_channels=[16,32,64,16];decoder_channels=[16,32,32,16]' (repeatable; default: reference)",
    )
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")


def run(args: argparse.Namespace) -> dict[str, Any]:

    if not 0 < args.density <= 1:
        raise SystemExit(f"--density must be in (0, 1], got {args.density}")
    orders = tuple(filter(None, args.orders.split(",")))
    if not orders or set(orders) - set(_ORDERS):
        raise SystemExit(f"--orders must name some of {_ORDERS}, got {args.orders!r}")
    try:
        channels = tuple(int(c) for c in args.latent_channels.split(","))
        architectures = {}
        for entry in args.architecture or ["reference"]:
            label, _, knobs = entry.partition(":")
            architectures[label] = parse_overrides(knobs)
        for fields in architectures.values():  # bad fields are named before the recording starts
            AutoencoderConfig.from_kwargs(**{"chunk": args.chunk, **fields})
    except (ValueError, TypeError) as error:
        raise SystemExit(f"--latent-channels / --architecture: {error}") from None
    from lgc.analysis import record_gradients  # Lightning: only once the arguments are good

    with tempfile.TemporaryDirectory() as tmp:
        recording = args.recording
        if recording is None:
            recording = record_gradients(
                Path(tmp) / "run",
                partition=args.partition,
                alpha=args.alpha,
                max_epochs=args.epochs,
                patterns=["model.*.weight"],
                overrides=[f"trainer.devices={args.workers}", "ddp.oversubscribe=true"],
            )
        result = benchmark_autoencoder(
            recording,
            args.density,
            args.chunk,
            latent_channels=channels,
            orders=orders,
            updates=args.updates,
            architectures=architectures,
        )
    if args.recording is None:
        result["recording"] = None  # recorded for this run in a temporary folder, not kept
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result
