"""``lgc-bench model``: the alpha-beta cost model (:mod:`lgc.bench.cost_model`) at any scale.

Evaluates :func:`~lgc.bench.cost_model.predict_step` for a model's gradient shapes at any number of
workers and bandwidth, from each method's profile measured on this machine
(:func:`~lgc.bench.profile.profile_method`, or a ``--profiles`` cache), and finds the bandwidths at
which a method beats the fp16 hook and dense fp32 (``< X``: below X; ``> X``: above X; always;
never). The models (:data:`MODELS`): torchvision's ImageNet ResNets, whose compute per step is a
knob (a GPU's, by FLOPs), and the models of lgc's comparison on the data they train on there,
whose compute is measured on this machine at the comparison's batch.

Why one module: the ``lgc-bench model`` command: its models, the profiles it measures or reads, the
compute it charges them, and its tables and plot of the same predictions.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lgc.bench import profile as profiling
from lgc.bench.cost_model import Link, MethodProfile, crossover_bandwidth, expected_maximum, predict_step
from lgc.bench.methods import (
    DEFAULT_METHODS,
    OPTIMIZER_KNOBS,
    MethodSpec,
    method_color,
    parse_list,
    parse_methods,
    profile_knobs,
)
from lgc.bench.netns import parse_delay, parse_rate
from lgc.methods import merge_knobs

__all__ = [
    "DEFAULT_COMPUTE_MS",
    "MODELS",
    "ModelShapes",
    "add_arguments",
    "crossover_table",
    "format_crossing",
    "run",
    "straggler_compute",
]


#: Compute per step assumed for the ImageNet ResNets when ``--compute-ms`` is not given: 100 ms
#: for ResNet-50 at batch 32 (a V100-class GPU in fp32; set your own), the others scaled by their
#: forward FLOPs (torchvision's model cards: ResNet-50 4.09 GFLOPs, ResNet-101 7.80, ResNet-18 1.81).
DEFAULT_COMPUTE_MS = {"resnet18": 100 * 1.81 / 4.09, "resnet50": 100.0, "resnet101": 100 * 7.80 / 4.09}


@dataclass(frozen=True)
class ModelShapes:
    """A model whose step the cost model predicts: how to build it, one batch, its loss."""

    #: What the report's heading says.
    title: str
    #: A fresh model (randomly initialized).
    build: Callable[[], Any]
    #: One training batch from a generator (the shapes the model trains on).
    batch: Callable[[Any], tuple[Any, Any]]
    #: Compute per step (ms) when ``--compute-ms`` is not given; None: measured on this machine
    #: (the profile's plain DDP steps, the slowest of the workers expected).
    compute_ms: float | None
    #: The training loss of ``(output, target)``; None: cross-entropy.
    loss: Callable[[Any, Any], Any] | None = None


def _imagenet_resnet(depth: int) -> ModelShapes:
    import torch

    from lgc.models.torchvision_resnet import torchvision_resnet

    # ImageNet shapes (1,000 classes, the ImageNet stem) on small images: the gradients have the
    # real model's sizes while compute stays cheap (compute is a knob here).
    return ModelShapes(
        title=f"ResNet-{depth} (ImageNet shapes, compute a knob)",
        build=lambda: torchvision_resnet(depth, num_classes=1000, stem="imagenet"),
        batch=lambda g: (torch.randn(4, 3, 32, 32, generator=g), torch.randint(1000, (4,), generator=g)),
        compute_ms=DEFAULT_COMPUTE_MS[f"resnet{depth}"],
    )


def _fashion_resnet(depth: int, batch: int) -> ModelShapes:
    import torch

    from lgc.models.cifar_resnet import CifarResNet

    return ModelShapes(
        title=f"ResNet-{depth} on Fashion-MNIST, {batch} images per worker (compute measured here)",
        build=lambda: CifarResNet(depth=depth, num_classes=10, in_channels=1),
        batch=lambda g: (torch.randn(batch, 1, 28, 28, generator=g), torch.randint(10, (batch,), generator=g)),
        compute_ms=None,
    )


def _scenes_pspnet() -> ModelShapes:
    import hydra
    import torch
    from omegaconf import OmegaConf

    import lgc
    from lgc.data.fashion_scenes import FASHION_SCENE_CLASSES
    from lgc.lit.segmentation import pixel_cross_entropy

    classes = len(FASHION_SCENE_CLASSES)

    def build() -> Any:
        config = OmegaConf.load(Path(lgc.__file__).parent / "conf" / "model" / "pspnet_small.yaml")
        return hydra.utils.instantiate(config, num_classes=classes, in_channels=1)

    def loss(output: Any, target: Any) -> Any:
        main, aux = output  # training mode: PSPNet's main and auxiliary logits
        return pixel_cross_entropy(main, target) + 0.4 * pixel_cross_entropy(aux, target)

    return ModelShapes(
        title="PSPNet (pspnet_small) on Fashion scenes, 32 scenes of 64 x 64 per worker (compute measured here)",
        build=build,
        batch=lambda g: (torch.randn(32, 1, 64, 64, generator=g), torch.randint(classes, (32, 64, 64), generator=g)),
        compute_ms=None,
        loss=loss,
    )


#: The models ``--model`` takes: torchvision's ImageNet ResNets, and the comparison's models on
#: their data (``resnet8``: the Fashion-MNIST cells, 32 images per worker; ``resnet20``: the
#: ResNet-20 cells, 128 per worker; ``pspnet_small``: the segmentation cell, 32 scenes per worker).
MODELS: dict[str, Callable[[], ModelShapes]] = {
    "resnet18": lambda: _imagenet_resnet(18),
    "resnet50": lambda: _imagenet_resnet(50),
    "resnet101": lambda: _imagenet_resnet(101),
    "resnet8": lambda: _fashion_resnet(8, 32),
    "resnet20": lambda: _fashion_resnet(20, 128),
    "pspnet_small": _scenes_pspnet,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--workers", default="8,64,512", help="comma-separated worker counts (default 8,64,512)")
    parser.add_argument(
        "--bandwidth", default="1gbit,10gbit,100gbit", help="comma-separated link rates in tc syntax (per direction)"
    )
    parser.add_argument("--latency", default="25us", help="alpha: time per message, tc syntax (default 25us)")
    parser.add_argument("--allreduce", default="ring", choices=("ring", "tree"), help="allreduce algorithm")
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated lgc.compress methods, each optionally with knobs: name[:key=value;...]",
    )
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="compute per step (default: 100 ms for ResNet-50, the other ImageNet ResNets by FLOPs; "
        "the comparison's models measured here)",
    )
    parser.add_argument(
        "--codec",
        default="measured",
        choices=("measured", "free"),
        help="measured: this machine's CPU encode/decode time; free: communication only",
    )
    parser.add_argument("--profiles", type=Path, default=None, help="JSON cache of profiles (read, then written)")
    parser.add_argument("--out", type=Path, default=None, help="write model.md, model.json and model.png here")


def _profiles(models: list[str], methods: list[MethodSpec], cache: Path | None) -> dict[str, dict[str, MethodProfile]]:
    """Every (model, method) profile, from ``cache`` where it has them, else measured here (one process)."""
    import os

    import torch
    import torch.distributed as dist

    stored: dict[str, dict[str, Any]] = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    profiles = {m: {k: MethodProfile.from_json(v) for k, v in stored.get(m, {}).items()} for m in models}
    missing = [(m, spec) for m in models for spec in methods if spec.label not in profiles[m]]
    if missing:
        started_group = not dist.is_initialized()
        scratch = tempfile.TemporaryDirectory(prefix="lgc-bench-model-") if started_group else None
        if scratch is not None:
            store = f"file://{os.path.join(scratch.name, 'store')}"
            dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        try:
            generator = torch.Generator().manual_seed(0)
            for name, spec in missing:
                shapes = MODELS[name]()
                torch.manual_seed(0)
                started = time.perf_counter()
                profiles[name][spec.label] = profiling.profile_method(
                    shapes.build(),
                    spec.name,
                    lambda shapes=shapes: shapes.batch(generator),
                    knobs=merge_knobs(profile_knobs().get(spec.name, {}), spec.knobs),
                    steps=5,
                    loss=shapes.loss,
                )
                print(
                    f"profiled {name} {spec.label}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True
                )
                if cache is not None:  # each profile kept as it arrives: a long run can be resumed
                    merged = {m: {k: p.to_json() for k, p in per.items()} for m, per in profiles.items()}
                    cache.write_text(json.dumps({**stored, **merged}))
        finally:
            if scratch is not None:
                dist.destroy_process_group()
                scratch.cleanup()
    return profiles


def _format_ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}" if seconds >= 0.0995 else f"{1000 * seconds:.1f}"


def format_crossing(crossing: tuple[str, float | None] | None) -> str:
    if crossing is None:
        return "-"
    side, bytes_per_s = crossing
    if bytes_per_s is None:
        return side
    bits = 8 * bytes_per_s
    rate = f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
    return f"{'<' if side == 'below' else '>'} {rate}"


def _compute_s(name: str, args: argparse.Namespace) -> float | None:
    """The compute per step of ``name`` (seconds): ``--compute-ms``, else the model's; None: measured."""
    if args.compute_ms is not None:
        return float(args.compute_ms) / 1000
    default = MODELS[name]().compute_ms
    return None if default is None else default / 1000


def _pooled_compute(profiles: Iterable[MethodProfile]) -> list[float]:
    """The plain DDP steps of every profile of one model (each profile's median where it kept none)."""
    profiles = list(profiles)
    return [t for p in profiles for t in p.compute_samples_s] or [p.compute_s for p in profiles]


def straggler_compute(samples: list[float], world: int, period: int = 1, draws: int = 4000) -> float:
    """Compute per step of ``world`` workers that wait for each other once every ``period`` steps.

    Per step (``period`` 1): the expected maximum of ``world`` draws from ``samples``
    (:func:`~lgc.bench.cost_model.expected_maximum`). A local-step method's workers wait only at
    its exchanges, so the slowest worker's sum of ``period`` steps sets the pace: the expected
    maximum of ``world`` such sums (``draws`` of them resampled from ``samples`` with a fixed
    seed), divided by ``period``.
    """
    if not samples:
        raise ValueError("straggler_compute needs measured compute samples")
    if period == 1:
        return expected_maximum(samples, world)
    import random

    rng = random.Random(0)
    sums = [sum(rng.choices(samples, k=period)) for _ in range(draws)]
    return expected_maximum(sums, world) / period


def run(args: argparse.Namespace) -> None:
    try:
        models = parse_list(args.model, "model")
        if any(m not in MODELS for m in models):
            raise ValueError(f"--model must name some of {', '.join(MODELS)}, got {args.model!r}")
        workers = [int(w) for w in parse_list(args.workers, "workers")]
        if min(workers) < 1:
            raise ValueError(f"--workers must be positive integers, got {args.workers!r}")
        rates = [(text, parse_rate(text) / 8) for text in parse_list(args.bandwidth, "bandwidth")]
        latency = parse_delay(args.latency) / 1e6
        specs = parse_methods(args.methods)
        for spec in specs:
            if taken := [key for key in OPTIMIZER_KNOBS if key in spec.knobs]:
                raise ValueError(
                    f"{spec.label}: {', '.join(taken)} set(s) the optimizer, which the model does not time; "
                    "drop it (a step's cost does not depend on it)"
                )
        if args.compute_ms is not None and not args.compute_ms > 0:
            raise ValueError(f"--compute-ms must be > 0, got {args.compute_ms!r}")
    except ValueError as error:
        sys.exit(f"lgc-bench model: {error}")
    profiles = _profiles(models, specs, args.profiles)
    methods = [spec.label for spec in specs]
    codec = args.codec == "measured"
    text = [
        f"# lgc-bench model: step time (ms), alpha {latency * 1e6:g} us, {args.allreduce} allreduce, "
        f"codec {'measured on this CPU' if codec else 'free (communication only)'}\n"
    ]
    results: dict[str, Any] = {}
    for name in models:
        compute = _compute_s(name, args)
        per_method = {method: profiles[name][method] for method in methods}
        # Measured compute: every method's plain DDP steps are steps of the same model, so they are
        # pooled (one distribution per model, not each method's few samples).
        pooled = _pooled_compute(per_method.values())
        # Once per (workers, period): the crossings evaluate hundreds of bandwidths per method.
        measured_compute = functools.cache(functools.partial(straggler_compute, pooled))

        def predict(
            method: str,
            world: int,
            bytes_per_s: float,
            compute: float | None = compute,
            per_method: dict[str, MethodProfile] = per_method,
            measured_compute: Callable[[int, int], float] = measured_compute,
        ) -> float:
            profile = per_method[method]
            return predict_step(
                profile,
                world,
                Link(latency, bytes_per_s),
                compute_s=compute if compute is not None else measured_compute(world, profile.period),
                codec=codec,
                allreduce=args.allreduce,
            )

        columns = [(w, label, rate) for w in workers for label, rate in rates]
        header = "| method | " + " | ".join(f"{w} x {label}" for w, label, _ in columns)
        header += " | " + " | ".join(f"beats fp16 at ({w})" for w in workers)
        header += " | " + " | ".join(f"beats dense at ({w})" for w in workers) + " |"
        measured = statistics.median(pooled) if pooled else math.nan
        compute_text = (
            f"compute {1000 * compute:.0f} ms per step"
            if compute is not None
            else f"compute measured: median plain step {1000 * measured:.0f} ms, the slowest of the workers expected"
        )
        lines = [
            f"## {name}: {MODELS[name]().title} ({compute_text})\n",
            header,
            "|" + "---|" * (header.count("|") - 1),
        ]
        table: dict[str, Any] = {}
        for method in methods:
            steps = {f"{w}x{label}": predict(method, w, rate) for w, label, rate in columns}
            crossings = {}
            for reference in ("torch_fp16", "none"):
                for w in workers:
                    crossings[f"{reference}@{w}"] = (
                        None
                        if reference not in per_method or reference == method
                        else crossover_bandwidth(
                            lambda b, m=method, w=w: predict(m, w, b), lambda b, r=reference, w=w: predict(r, w, b)
                        )
                    )
            table[method] = {"step_s": steps, "crossover_bytes_per_s": crossings}
            cells = [_format_ms(steps[f"{w}x{label}"]) for w, label, _ in columns]
            cells += [format_crossing(crossings[f"torch_fp16@{w}"]) for w in workers]
            cells += [format_crossing(crossings[f"none@{w}"]) for w in workers]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        text.append("\n".join(lines) + "\n")
        results[name] = {"compute_s": compute if compute is not None else measured, "methods": table}
    text.append(
        "## Where each method's step beats the fp16 hook's\n\n"
        "The link bandwidth (per direction, at this alpha) below which (`<`) or above which (`>`) the "
        "method's predicted step is shorter than PyTorch's fp16 hook's; `always`, `never`.\n\n"
        + crossover_table(models, workers, methods, results)
    )
    report = "\n".join(text)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "model.md").write_text(report + "\n")
        arguments = {k: str(v) for k, v in vars(args).items()}
        profiles_json = {m: {k: p.to_json() for k, p in per.items()} for m, per in profiles.items()}
        (args.out / "model.json").write_text(
            json.dumps({"arguments": arguments, "results": results, "profiles": profiles_json}, default=str)
        )
        _plot(models, workers, methods, profiles, latency, codec, args, args.out / "model.png")
        print(f"wrote {args.out / 'model.md'}, model.json and model.png")


def crossover_table(models: list[str], workers: list[int], methods: list[str], results: dict[str, Any]) -> str:
    """One markdown table of every method's crossing with the fp16 hook, a column per model and worker count.

    ``results``: :func:`run`'s (``model.json``'s ``results``): each model's methods with their
    ``crossover_bytes_per_s``.
    """
    columns = [(m, w) for m in models for w in workers]
    header = "| method | " + " | ".join(f"{m}, {w} workers" for m, w in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 1)]
    for method in methods:
        if method == "torch_fp16":
            continue
        cells = [
            format_crossing(results[m]["methods"][method]["crossover_bytes_per_s"].get(f"torch_fp16@{w}"))
            for m, w in columns
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(
    models: list[str],
    workers: list[int],
    methods: list[str],
    profiles: dict[str, dict[str, MethodProfile]],
    latency: float,
    codec: bool,
    args: argparse.Namespace,
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(models), len(workers), figsize=(5 * len(workers), 4 * len(models)), squeeze=False)
    grid = [1e7 / 8 * (1e5 ** (i / 119)) for i in range(120)]  # 10 Mbit/s .. 1 Tbit/s
    for row, name in enumerate(models):
        compute = _compute_s(name, args)
        pooled = _pooled_compute(profiles[name][method] for method in methods)
        for column, world in enumerate(workers):
            axis = axes[row][column]
            for index, method in enumerate(methods):
                profile = profiles[name][method]
                per_step = compute if compute is not None else straggler_compute(pooled, world, profile.period)
                times = [
                    predict_step(
                        profile, world, Link(latency, b), compute_s=per_step, codec=codec, allreduce=args.allreduce
                    )
                    for b in grid
                ]
                style = "--" if method in ("none", "torch_fp16") else "-"
                color = "black" if method == "torch_fp16" else method_color(index)
                axis.plot([8 * b / 1e9 for b in grid], [1000 * t for t in times], style, color=color, label=method)
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.set_title(f"{name}, {world} workers")
            axis.set_xlabel("link bandwidth (Gbit/s)")
            axis.set_ylabel("predicted step (ms)")
            axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
