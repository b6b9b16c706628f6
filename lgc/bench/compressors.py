"""``lgc-bench compressors``: encode + decode time and bits per element of every compressor.

Every compressor configured in ``conf/compressor/`` (with its yaml's error-feedback setting and
the requested density) compresses and decompresses a gradient with ResNet-50's parameter shapes
(25,557,032 elements; all of them by default, ``min_numel`` can leave small ones out), tensor by
tensor as the DDP hook does. Side by side in the same run: an fp16 round trip
(``g.half().float()``) and an exact ``torch.topk`` of the same flat gradient, as the references
the times are divided by. The median of ``--repeats`` runs is reported, after one warm-up run
(which also fills the error-feedback residuals). DGC is timed past its warm-up epochs, at the
requested density.

Then SBC's Golomb position code: random positions kept with probability ``p`` among the
benchmark's elements, coded with the optimal parameter ``b*``, and the measured bits per position
next to the expected length ``b* + 1 / (1 - (1 - p)^(2^b*))`` and the entropy bound ``H(p) / p``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lgc.compressors import Compressor

__all__ = ["benchmark_compressors", "resnet50_numels"]

_CONF = Path(__file__).resolve().parents[1] / "conf" / "compressor"


def resnet50_numels() -> list[int]:
    """Parameter sizes of torchvision's ResNet-50 (25,557,032 in all)."""
    from torchvision.models import resnet50

    with torch.device("meta"):
        return [p.numel() for p in resnet50().parameters()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _configured_compressors(density: float) -> dict[str, Compressor]:
    from lgc.train import build_compressor

    compressors = {}
    for path in sorted(_CONF.glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path))
        # Configs in the global package (dgc: it also turns the optimizer's momentum off).
        node = node.get("compressor", node)
        if "defaults" in node:
            continue  # variants of another config (e.g. lgc_rar_paper extends lgc_rar), not new methods
        if str(node.get("_target_", "")).startswith("lgc.ddp."):
            continue  # whole hook states (PyTorch's hooks, LGC), not compressors of a tensor
        if "density" in node:
            node["density"] = density
        if "warmup_densities" in node:
            node["warmup_densities"] = []  # DGC after its warm-up epochs: the density asked for
        built = build_compressor(node)
        if isinstance(built, Compressor):
            compressors[path.stem] = built
    return compressors


def benchmark_compressors(
    numels: list[int],
    density: float = 0.001,
    device: str = "cpu",
    repeats: int = 5,
    min_numel: int = 0,
    only: list[str] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Time every configured compressor on a random gradient with tensors of ``numels`` elements."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    grads = {f"t{i}": torch.randn(n, device=dev, generator=gen) for i, n in enumerate(numels) if n >= min_numel}
    flat = torch.cat(list(grads.values()))
    total = flat.numel()
    k = max(1, round(density * total))
    reference = {
        "fp16_round_trip_ms": _median_ms(lambda: flat.half().float(), repeats, dev),
        "torch_topk_ms": _median_ms(lambda: torch.topk(flat.abs(), k, sorted=False), repeats, dev),
    }
    rows = []
    compressors = _configured_compressors(density)
    # Weights for the compressors that read them (DGC's weight decay), as the DDP hook attaches them.
    weights = {key: torch.randn(grad.shape, device=dev, generator=gen) for key, grad in grads.items()}
    for name, compressor in compressors.items():
        if only and name not in only:
            continue
        compressor.attach_parameters(weights)
        payload_bytes = 0

        def round_trip(compressor: Compressor = compressor) -> None:
            nonlocal payload_bytes
            payload_bytes = 0
            for key, grad in grads.items():
                payload = compressor.compress(grad, key)
                compressor.decompress(payload)
                payload_bytes += payload.nbytes

        ms = _median_ms(round_trip, repeats, dev)
        rows.append(
            {
                "compressor": name,
                "description": repr(compressor),
                "encode_decode_ms": ms,
                "x_fp16_round_trip": ms / reference["fp16_round_trip_ms"],
                "x_torch_topk": ms / reference["torch_topk_ms"],
                "bits_per_element": 8 * payload_bytes / total,
            }
        )
    return {
        "golomb": golomb_bits(total, device=dev, seed=seed),
        "device": str(dev),
        "numel": total,
        "tensors": len(grads),
        "density": density,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        **reference,
        "rows": rows,
    }


def golomb_bits(
    numel: int, ps: tuple[float, ...] = (0.01, 0.001, 0.0001), device: torch.device | str = "cpu", seed: int = 0
) -> list[dict[str, float]]:
    """Bits per position of the Golomb code against its expected length and the entropy bound."""
    from lgc.coding import binary_entropy_bits_per_position, expected_bits_per_position, golomb_encode

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for p in ps:
        positions = (torch.rand(numel, generator=gen, device=device) < p).nonzero().squeeze(1)
        code = golomb_encode(positions, numel)
        measured = code.bits_per_position
        expected = expected_bits_per_position(p, code.b)
        entropy = binary_entropy_bits_per_position(p)
        rows.append(
            {
                "p": p,
                "positions": positions.numel(),
                "b": code.b,
                "bits_per_position": measured,
                "expected_bits": expected,
                "entropy_bits": entropy,
                "vs_expected": measured / expected - 1,
                "vs_entropy": measured / entropy - 1,
            }
        )
    return rows


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['numel']:,} elements in {result['tensors']} tensors on {result['device']}, "
        f"density {result['density']}, "
        f"median of {result['repeats']} runs, {result['threads']} threads",
        f"fp16 round trip {result['fp16_round_trip_ms']:.1f} ms; exact torch.topk {result['torch_topk_ms']:.1f} ms",
        "",
        "| compressor | encode+decode ms | x fp16 round trip | x torch.topk | bits/element |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['compressor']} | {row['encode_decode_ms']:.1f} | {row['x_fp16_round_trip']:.2f} | "
            f"{row['x_torch_topk']:.2f} | {row['bits_per_element']:.4f} |"
        )
    lines += [
        "",
        "Golomb position code (SBC), optimal b*:",
        "",
        "| p | positions | b* | bits/position | expected | vs expected | entropy H(p)/p | vs entropy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["golomb"]:
        lines.append(
            f"| {row['p']} | {row['positions']:,} | {row['b']} | {row['bits_per_position']:.3f} | "
            f"{row['expected_bits']:.3f} | {100 * row['vs_expected']:+.2f} % | {row['entropy_bits']:.3f} | "
            f"{100 * row['vs_entropy']:+.2f} % |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--numel", type=int, nargs="*", help="tensor sizes (default: ResNet-50's parameters)")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="compressor config names to run (default: all)")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if not 0 < args.density <= 1:
        raise SystemExit(f"--density must be in (0, 1], got {args.density}")
    numels = args.numel or resnet50_numels()
    result = benchmark_compressors(numels, args.density, args.device, args.repeats, only=args.only)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result
