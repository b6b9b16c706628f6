"""``lgc-bench compressors``: encode + decode time and bits per element of every compressor.

Every compressor configured in ``conf/compressor/`` (with its yaml's error-feedback setting and
the requested density) compresses and decompresses a gradient with ResNet-50's parameter shapes
(25,557,032 elements; all of them by default, ``--min-numel`` leaves small ones out as the hook's
``min_numel`` does), as the DDP hook hands it a bucket: one flat slice per parameter of one flat
gradient, with the parameters' shapes attached as the hook attaches them (DeMo and chunked top-k
tile by shape; ``--numel`` sizes are vectors), encoded by ``compress_many`` and decoded into the
slices of one flat by ``aggregate_many``. DGC is timed past its warm-up epochs, at the requested
density. Every codec with a bucket-level path (:data:`BUCKET_CODECS`: error feedback over top-k,
EF-signSGD's scaled sign, chunked top-k and SparseLoCo's quantized chunked top-k, QSGD, TernGrad,
fp4, DGC, SBC, RedSync, DeMo) runs twice more, tensor by tensor
(``qsgd_per_tensor``) and a bucket at once (``qsgd_bucketed``; ``bucketed`` set on the compressor or
its error feedback), whichever the device's default (the ``qsgd`` row) is.

The reference every time is divided by ("x fp16") is the cheapest honest thing a DDP fp16 hook
does: for every tensor, ``half.copy_(g)`` then ``out.copy_(half)`` into buffers allocated once
before timing. Three more references run in the same rounds: an exact ``torch.topk`` of the whole
flat gradient ("x topk"); every tensor's exact top-k with the gradient laid out as one flat, as a
bucket-level codec would select (:func:`~lgc.compressors.segment_topk.segment_topk`, selection
only); and ``g.half().float()`` of the flat gradient, which allocates 100 MB per call and mostly
measures page faults (shown so readers see the difference; no ratio uses it).

How it is timed. Every candidate (references and compressors) runs once untimed (this also fills
the error-feedback residuals), then ``--repeats`` interleaved rounds run each candidate once, in
the same order, so load changes during the run hit all candidates alike. Each run is timed by
wall clock (``time.perf_counter``) and by process CPU time (``time.process_time``, all threads of
the process); the medians are reported, with the per-round times in the JSON. CPU time above wall
time means torch ran on several threads. With ``--device cuda`` the device is synchronized before
and after each run, and CPU time is host time (Python, kernel launches and the wait in the
synchronize), not GPU time. The load average (1, 5, 15 min) before and after the rounds and
torch's thread counts are printed so readers can judge the noise.

Then SBC's Golomb position code: random positions kept with probability ``p`` among the
benchmark's elements, coded with the optimal parameter ``b*``, and the measured bits per position
next to the expected length ``b* + 1 / (1 - (1 - p)^(2^b*))`` and the entropy bound ``H(p) / p``.

JSON (``--json``): ``device``, ``numel``, ``tensors``, ``min_numel``, ``density``, ``repeats``,
``threads`` and ``interop_threads`` (torch's), ``cpu_count``, ``load_average_start`` and
``load_average_end`` (``[1 min, 5 min, 15 min]``), ``cpu_time`` (``"process"``, or ``"host"`` on
cuda), ``reference`` (the name of the row every "x fp16" divides by), ``schedule`` (the names in
one round, in order), ``references`` and ``rows`` (one per compressor), and ``golomb``. Each
reference or row has ``name``, ``description``, ``wall_ms`` and ``cpu_ms`` (medians),
``wall_ms_runs`` and ``cpu_ms_runs`` (one per round), ``x_fp16_wall`` and ``x_fp16_cpu`` (over the
per-layer fp16 reference), ``x_torch_topk_wall`` and ``x_torch_topk_cpu`` (ratios are ``null``
where the reference's median is 0, as a tiny ``--numel`` can finish within a tick of the CPU
clock), and ``bits_per_element`` (``null`` for ``torch_topk_flat`` and ``segment_topk_flat``,
which are not codecs); compressor rows also carry ``compressor`` (the config name).

Why one module: the timing protocol above and its table; SBC's Golomb-parameter sweep
(:func:`golomb_bits`) stays beside them because it times the same ResNet-50 gradient.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lgc.compressors import Compressor
from lgc.compressors.segment_topk import segment_topk
from lgc.compressors.topk import num_selected

__all__ = [
    "BUCKET_CODECS",
    "benchmark_compressors",
    "golomb_bits",
    "interleaved_schedule",
    "resnet50_numels",
    "resnet50_shapes",
]


#: The reference every "x fp16" ratio divides by.
REFERENCE = "fp16_per_layer"


#: The configs whose codec has a bucket-level path, timed both ways (``bucketed`` False and True).
BUCKET_CODECS = (
    "topk",
    "dgc",
    "sbc",
    "redsync",
    "signsgd",
    "chunked_topk",
    "sparseloco",
    "qsgd",
    "terngrad",
    "fp4",
    "demo",
)


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50."""
    from torchvision.models import resnet50

    with torch.device("meta"):
        return [tuple(p.shape) for p in resnet50().parameters()]


def resnet50_numels() -> list[int]:
    """Parameter sizes of torchvision's ResNet-50 (25,557,032 in all)."""
    return [math.prod(shape) for shape in resnet50_shapes()]


def interleaved_schedule(names: list[str], repeats: int) -> list[list[str]]:
    """The timed rounds: ``repeats`` rounds, each running every candidate once, in the order given.

    Interleaving (rather than all repeats of one candidate, then the next) spreads a change of
    machine load over all candidates alike, so their ratios stay fair on a busy machine.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if len(set(names)) != len(names):
        raise ValueError(f"candidate names must be unique, got {names}")
    return [list(names) for _ in range(repeats)]


@dataclass
class _Candidate:
    """One thing timed: a reference or a compressor's encode + decode of every tensor."""

    name: str
    description: str
    run: Callable[[], None]
    #: Wire bits per gradient element (set by the run for compressors); None when not a codec.
    bits_per_element: float | None = None
    #: Name of the compressor config; None for references.
    compressor: str | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call, the device synchronized on both sides."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return 1000 * (time.perf_counter() - wall), 1000 * (time.process_time() - cpu)


def _configured_compressors(density: float) -> dict[str, Compressor]:
    from lgc.methods import METHODS, build_compressor

    compressors = {}
    for name, method in METHODS.items():
        if not issubclass(method.cls, Compressor):
            continue  # whole hook states (PyTorch's hooks, LGC), not compressors of a tensor
        node = method.resolve()
        if "density" in node:
            node["density"] = density
        if "warmup_densities" in node:
            node["warmup_densities"] = []  # DGC after its warm-up epochs: the density asked for
        compressors[name] = build_compressor(node)
    return compressors


def _references(grads: dict[str, torch.Tensor], k: int, density: float) -> list[_Candidate]:
    flat = torch.cat(list(grads.values()))
    numels = [grad.numel() for grad in grads.values()]
    ks = [num_selected(numel, density) for numel in numels]
    # Allocated once, before timing: what a DDP fp16 hook reuses step after step.
    halves = {key: torch.empty_like(grad, dtype=torch.half) for key, grad in grads.items()}
    outs = {key: torch.empty_like(grad) for key, grad in grads.items()}

    def fp16_per_layer() -> None:
        for key, grad in grads.items():
            halves[key].copy_(grad)
            outs[key].copy_(halves[key])

    return [
        _Candidate(
            REFERENCE, "fp16 round trip per tensor into reused buffers (the x fp16 reference)", fp16_per_layer, 16
        ),
        _Candidate(
            "torch_topk_flat",
            f"exact torch.topk of the flat gradient's magnitudes, k={k} (the x topk reference)",
            lambda: torch.topk(flat.abs(), k, sorted=False),
        ),
        _Candidate(
            "segment_topk_flat",
            "exact top-k of every tensor, the gradient as one flat (bucket-level selection, no error feedback)",
            lambda: segment_topk(flat, numels, ks),
        ),
        _Candidate(
            "fp16_flat_alloc",
            "g.half().float() of the flat gradient, allocating per call (the old reference; no ratio uses it)",
            lambda: flat.half().float(),
            16,
        ),
    ]


def _compressor_candidate(
    name: str, compressor: Compressor, grads: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]
) -> _Candidate:
    # Weights for the compressors that read them (DGC's weight decay), as the DDP hook attaches them.
    compressor.attach_parameters(weights)
    keys, tensors = list(grads), list(grads.values())
    total = sum(grad.numel() for grad in tensors)
    # The bucket the sums are decoded into, reused every step.
    bucket = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    outs = list(bucket.split([t.numel() for t in tensors]))
    candidate = _Candidate(name, repr(compressor), run=lambda: None, compressor=name)
    step = 0

    def round_trip() -> None:
        nonlocal step
        compressor.begin_step(step)  # as the hook does before every compressed step
        step += 1
        # As the DDP hook does with one bucket: every tensor encoded, then every sum decoded
        # straight into the tensor's slice of the bucket and completed there (DGC's weight decay).
        payloads = compressor.compress_many(tensors, keys)
        compressor.aggregate_many([[payload] for payload in payloads], outs)
        for key, out in zip(keys, outs, strict=True):
            compressor.finish_aggregate(out, key)
        candidate.bits_per_element = 8 * sum(payload.nbytes for payload in payloads) / total

    candidate.run = round_trip
    return candidate


def _ratio(value: float, reference: float) -> float | None:
    # None rather than inf: a tiny --numel can finish within one tick of the process CPU clock.
    return value / reference if reference > 0 else None


def _row(
    candidate: _Candidate, walls: list[float], cpus: list[float], medians: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    fp16_wall, fp16_cpu = medians[REFERENCE]
    topk_wall, topk_cpu = medians["torch_topk_flat"]
    row: dict[str, Any] = {"compressor": candidate.compressor} if candidate.compressor else {}
    return row | {
        "name": candidate.name,
        "description": candidate.description,
        "wall_ms": wall,
        "cpu_ms": cpu,
        "wall_ms_runs": walls,
        "cpu_ms_runs": cpus,
        "x_fp16_wall": _ratio(wall, fp16_wall),
        "x_fp16_cpu": _ratio(cpu, fp16_cpu),
        "x_torch_topk_wall": _ratio(wall, topk_wall),
        "x_torch_topk_cpu": _ratio(cpu, topk_cpu),
        "bits_per_element": candidate.bits_per_element,
    }


def benchmark_compressors(
    numels: list[int] | list[tuple[int, ...]],
    density: float = 0.001,
    device: str = "cpu",
    repeats: int = 5,
    min_numel: int = 0,
    only: list[str] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Time every configured compressor and the references on a random gradient of ``numels`` tensors.

    Args:
        numels: sizes (vectors) or shapes of the gradient's tensors, one per parameter; each is
            compressed flat, as the hook sees it, with its shape attached.
        density: fraction of elements the sparsifiers send.
        device: ``"cpu"`` or ``"cuda"``.
        repeats: interleaved timed rounds (after one untimed warm-up run of every candidate).
        min_numel: tensors smaller than this are left out of everything timed, as the hook
            allreduces them dense.
        only: compressor config names to run (default: all); the references always run.
        seed: seed of the random gradient, weights and Golomb positions.

    Returns:
        The result described in the module docstring's JSON paragraph.
    """
    load_start = os.getloadavg()
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    shapes = {f"t{i}": (n,) if isinstance(n, int) else tuple(n) for i, n in enumerate(numels)}
    kept = {key: math.prod(shape) for key, shape in shapes.items() if math.prod(shape) >= min_numel}
    if not kept:
        raise ValueError(f"no tensor has at least min_numel={min_numel} elements")
    # The tensors are slices of one flat gradient, as a DDP bucket holds them.
    flat = torch.randn(sum(kept.values()), device=dev, generator=gen)
    grads = dict(zip(kept, flat.split(list(kept.values())), strict=True))
    total = sum(grad.numel() for grad in grads.values())
    k = max(1, round(density * total))
    weights = {key: torch.randn(shapes[key], device=dev, generator=gen) for key in grads}
    configured = _configured_compressors(density)
    if unknown := sorted(set(only or ()) - set(configured)):
        raise ValueError(f"no compressor config named {unknown}; configured: {sorted(configured)}")
    candidates = _references(grads, k, density) + [
        _compressor_candidate(name, compressor, grads, weights)
        for name, compressor in configured.items()
        if not only or name in only
    ]
    for name in BUCKET_CODECS:
        if name in configured and (not only or name in only):
            # Both encodings of a codec with a bucket-level path, whichever the device's default is.
            for bucketed in (False, True):
                variant = copy.deepcopy(configured[name])
                variant.bucketed = bucketed  # type: ignore[attr-defined]
                label = f"{name}_bucketed" if bucketed else f"{name}_per_tensor"
                candidates.append(_compressor_candidate(label, variant, grads, weights))
    schedule = interleaved_schedule([candidate.name for candidate in candidates], repeats)  # names unique
    by_name = {candidate.name: candidate for candidate in candidates}

    for candidate in candidates:  # warm-up: residuals filled, allocator and caches settled
        candidate.run()
    walls: dict[str, list[float]] = {name: [] for name in by_name}
    cpus: dict[str, list[float]] = {name: [] for name in by_name}
    for round_ in schedule:
        for name in round_:
            wall, cpu = _time_once(by_name[name].run, dev)
            walls[name].append(wall)
            cpus[name].append(cpu)
    load_end = os.getloadavg()

    medians = {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in by_name}
    rows = [_row(c, walls[c.name], cpus[c.name], medians) for c in candidates]
    return {
        "device": str(dev),
        "numel": total,
        "tensors": len(grads),
        "min_numel": min_numel,
        "density": density,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_start": list(load_start),
        "load_average_end": list(load_end),
        "cpu_time": "host" if dev.type == "cuda" else "process",
        "reference": REFERENCE,
        "schedule": schedule[0],
        "references": [row for row in rows if "compressor" not in row],
        "rows": [row for row in rows if "compressor" in row],
        "golomb": golomb_bits(total, device=dev, seed=seed),
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


def _load(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def format_table(result: dict[str, Any]) -> str:
    cpu = "host CPU" if result["cpu_time"] == "host" else "CPU"
    lines = [
        f"{result['numel']:,} elements in {result['tensors']} tensors on {result['device']}, "
        f"density {result['density']}, median of {result['repeats']} interleaved rounds; "
        f"torch threads {result['threads']} (interop {result['interop_threads']}), {result['cpu_count']} CPUs",
        f"load average (1 / 5 / 15 min): start {_load(result['load_average_start'])}, "
        f"end {_load(result['load_average_end'])}",
        f"x fp16 = over '{result['reference']}' (fp16 round trip per tensor into reused buffers); "
        "x topk = over an exact torch.topk of the flat gradient; "
        f"{cpu} = {'host' if result['cpu_time'] == 'host' else 'process'} CPU time, all threads",
        "",
        f"| candidate | wall ms | wall min-max | {cpu} ms | x fp16 wall | x fp16 {cpu} | x topk wall | bits/element |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["references"] + result["rows"]:
        name = row["compressor"] if "compressor" in row else f"ref: {row['name']}"
        bits = "-" if row["bits_per_element"] is None else f"{row['bits_per_element']:.4f}"
        lines.append(
            f"| {name} | {row['wall_ms']:.2f} | {min(row['wall_ms_runs']):.2f}-{max(row['wall_ms_runs']):.2f} | "
            f"{row['cpu_ms']:.2f} | {_x(row['x_fp16_wall'])} | {_x(row['x_fp16_cpu'])} | "
            f"{_x(row['x_torch_topk_wall'])} | {bits} |"
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
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds (default: 5)")
    parser.add_argument(
        "--min-numel",
        type=int,
        default=0,
        help="leave out tensors with fewer elements, as the hook's min_numel (default: 0)",
    )
    parser.add_argument(
        "--only", nargs="*", help="compressor config names to run (default: all; references always run)"
    )
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if not 0 < args.density <= 1:
        raise SystemExit(f"--density must be in (0, 1], got {args.density}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.min_numel < 0:
        raise SystemExit(f"--min-numel must be >= 0, got {args.min_numel}")
    numels = args.numel or resnet50_shapes()
    result = benchmark_compressors(numels, args.density, args.device, args.repeats, args.min_numel, only=args.only)
    print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result
