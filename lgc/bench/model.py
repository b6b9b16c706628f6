"""``lgc-bench model``: the alpha-beta cost model (:mod:`lgc.bench.cost_model`) for ResNet shapes at any scale.

Evaluates :func:`~lgc.bench.cost_model.predict_step` for ResNet shapes at any number of workers and
bandwidth, from each method's profile measured on this machine (:func:`~lgc.bench.profile.profile_method`,
or a ``--profiles`` cache), and finds the bandwidths at which a method beats the fp16 hook and
dense fp32 (``< X``: below X; ``> X``: above X; always; never).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lgc.bench import profile as profiling
from lgc.bench.cost_model import Link, MethodProfile, crossover_bandwidth, predict_step
from lgc.bench.methods import DEFAULT_METHODS, method_color, parse_list, profile_knobs
from lgc.bench.netns import parse_delay, parse_rate

__all__ = ["DEFAULT_COMPUTE_MS", "add_arguments", "run"]


#: Compute per step assumed when ``--compute-ms`` is not given: 100 ms for ResNet-50 at batch 32
#: (a V100-class GPU in fp32; set your own), other models scaled by their forward FLOPs
#: (torchvision's model cards: ResNet-50 4.09 GFLOPs, ResNet-101 7.80, ResNet-18 1.81).
DEFAULT_COMPUTE_MS = {"resnet18": 100 * 1.81 / 4.09, "resnet50": 100.0, "resnet101": 100 * 7.80 / 4.09}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", help="comma-separated: resnet18, resnet50, resnet101")
    parser.add_argument("--workers", default="8,64,512", help="comma-separated worker counts (default 8,64,512)")
    parser.add_argument(
        "--bandwidth", default="1gbit,10gbit,100gbit", help="comma-separated link rates in tc syntax (per direction)"
    )
    parser.add_argument("--latency", default="25us", help="alpha: time per message, tc syntax (default 25us)")
    parser.add_argument("--allreduce", default="ring", choices=("ring", "tree"), help="allreduce algorithm")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated lgc.compress methods")
    parser.add_argument(
        "--compute-ms", type=float, default=None, help="compute per step (default: 100 ms for ResNet-50, by FLOPs)"
    )
    parser.add_argument(
        "--codec",
        default="measured",
        choices=("measured", "free"),
        help="measured: this machine's CPU encode/decode time; free: communication only",
    )
    parser.add_argument("--profiles", type=Path, default=None, help="JSON cache of profiles (read, then written)")
    parser.add_argument("--out", type=Path, default=None, help="write model.md, model.json and model.png here")


def _profiles(models: list[str], methods: list[str], cache: Path | None) -> dict[str, dict[str, MethodProfile]]:
    """Every (model, method) profile, from ``cache`` where it has them, else measured here (one process)."""
    import os

    import torch
    import torch.distributed as dist

    from lgc.models.torchvision_resnet import torchvision_resnet

    stored: dict[str, dict[str, Any]] = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    profiles = {m: {k: MethodProfile.from_json(v) for k, v in stored.get(m, {}).items()} for m in models}
    missing = [(m, method) for m in models for method in methods if method not in profiles[m]]
    if missing:
        started_group = not dist.is_initialized()
        scratch = tempfile.TemporaryDirectory(prefix="lgc-bench-model-")
        if started_group:
            store = f"file://{os.path.join(scratch.name, 'store')}"
            dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        try:
            generator = torch.Generator().manual_seed(0)
            for name, method in missing:
                # ImageNet shapes (1,000 classes, the ImageNet stem) on small images: the gradients
                # have the real model's sizes while compute stays cheap (compute is a knob here).
                module = torchvision_resnet(int(name.removeprefix("resnet")), num_classes=1000, stem="imagenet")

                def batches(generator: torch.Generator = generator) -> tuple[torch.Tensor, torch.Tensor]:
                    return torch.randn(4, 3, 32, 32, generator=generator), torch.randint(
                        1000, (4,), generator=generator
                    )

                started = time.perf_counter()
                profiles[name][method] = profiling.profile_method(
                    module, method, batches, knobs=profile_knobs().get(method, {}), steps=5
                )
                print(f"profiled {name} {method}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        finally:
            if started_group:
                dist.destroy_process_group()
            scratch.cleanup()
        if cache is not None:
            merged = {m: {k: p.to_json() for k, p in per.items()} for m, per in profiles.items()}
            cache.write_text(json.dumps({**stored, **merged}))
    return profiles


def _format_ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}" if seconds >= 0.0995 else f"{1000 * seconds:.1f}"


def _format_crossing(crossing: tuple[str, float | None] | None) -> str:
    if crossing is None:
        return "-"
    side, bytes_per_s = crossing
    if bytes_per_s is None:
        return side
    bits = 8 * bytes_per_s
    rate = f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
    return f"{'<' if side == 'below' else '>'} {rate}"


def run(args: argparse.Namespace) -> None:
    from lgc.api import METHODS

    try:
        models = parse_list(args.model, "model")
        if any(m not in DEFAULT_COMPUTE_MS for m in models):
            raise ValueError(f"--model must name some of {sorted(DEFAULT_COMPUTE_MS)}, got {args.model!r}")
        workers = [int(w) for w in parse_list(args.workers, "workers")]
        if min(workers) < 1:
            raise ValueError(f"--workers must be positive integers, got {args.workers!r}")
        rates = [(text, parse_rate(text) / 8) for text in parse_list(args.bandwidth, "bandwidth")]
        latency = parse_delay(args.latency) / 1e6
        methods = parse_list(args.methods, "methods")
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; known: {sorted(METHODS)}")
        if args.compute_ms is not None and not args.compute_ms > 0:
            raise ValueError(f"--compute-ms must be > 0, got {args.compute_ms!r}")
    except ValueError as error:
        sys.exit(f"lgc-bench model: {error}")
    profiles = _profiles(models, methods, args.profiles)
    codec = args.codec == "measured"
    text = [
        f"# lgc-bench model: step time (ms), alpha {latency * 1e6:g} us, {args.allreduce} allreduce, "
        f"codec {'measured on this CPU' if codec else 'free (communication only)'}\n"
    ]
    results: dict[str, Any] = {}
    for name in models:
        compute = (args.compute_ms if args.compute_ms is not None else DEFAULT_COMPUTE_MS[name]) / 1000
        per_method = profiles[name]

        def predict(
            method: str,
            world: int,
            bytes_per_s: float,
            compute: float = compute,
            per_method: dict[str, MethodProfile] = per_method,
        ) -> float:
            return predict_step(
                per_method[method],
                world,
                Link(latency, bytes_per_s),
                compute_s=compute,
                codec=codec,
                allreduce=args.allreduce,
            )

        columns = [(w, label, rate) for w in workers for label, rate in rates]
        header = "| method | " + " | ".join(f"{w} x {label}" for w, label, _ in columns)
        header += " | " + " | ".join(f"beats fp16 at ({w})" for w in workers)
        header += " | " + " | ".join(f"beats dense at ({w})" for w in workers) + " |"
        lines = [
            f"## {name} (compute {1000 * compute:.0f} ms per step)\n",
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
            cells += [_format_crossing(crossings[f"torch_fp16@{w}"]) for w in workers]
            cells += [_format_crossing(crossings[f"none@{w}"]) for w in workers]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        text.append("\n".join(lines) + "\n")
        results[name] = {"compute_s": compute, "methods": table}
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
    grid = [1e8 / 8 * (1e4 ** (i / 99)) for i in range(100)]  # 100 Mbit/s .. 1 Tbit/s
    for row, name in enumerate(models):
        compute = (args.compute_ms if args.compute_ms is not None else DEFAULT_COMPUTE_MS[name]) / 1000
        for column, world in enumerate(workers):
            axis = axes[row][column]
            for index, method in enumerate(methods):
                times = [
                    predict_step(
                        profiles[name][method],
                        world,
                        Link(latency, b),
                        compute_s=compute,
                        codec=codec,
                        allreduce=args.allreduce,
                    )
                    for b in grid
                ]
                style = "--" if method in ("none", "torch_fp16") else "-"
                color = method_color(index)
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
