"""A probe, not a benchmark of the package: would ``torch.compile``'s fused passes pay in lgc's hot loops?

    python experiments/fused_passes_probe.py [--device cpu|cuda] [--repeats 15] [--threads 1] [--json OUT]

Two passes over the gradient that lgc runs eagerly as separate kernels, each against one
``torch.compile``-d function doing the same arithmetic in one fused loop (inductor: C++/OpenMP on
the CPU, Triton on a GPU), on ResNet-50's parameter shapes (torchvision; 25,557,032 elements):

1. ``unscale_guard`` (every bucket, every step of every compressor with a state): the DDP hook's
   division of a bucket by the world size (``CompressionHookState.unscale``) and the step guard's
   look at it, every parameter's largest magnitude (:func:`lgc.ddp.hook.bucket_maxima`). Buckets
   of 25 MiB in reverse parameter order, as DDP builds them.
2. ``ef_topk_groups`` (CPU only: a GPU takes the flat path of ``segment_topk``): error feedback's
   ``r += g`` (:class:`lgc.compressors.ErrorFeedback`) and top-k's one streaming pass, the group
   maxima that bound the ``k``-th magnitude (:func:`lgc.compressors.selection.topk_grouping`,
   :func:`~lgc.compressors.selection.group_maxima`), per tensor, at densities 0.001 and 0.01.
3. ``ef_flat_maxima`` (error feedback over top-k a bucket at once, the GPU's path): ``r += g`` on
   the residuals as views of one flat (``torch._foreach_add_``,
   :meth:`lgc.compressors.ErrorFeedback.compress_many`) and the block maxima
   :func:`~lgc.compressors.segment_topk.segment_topk` starts from, at density 0.001; the fused
   function reads the gradient as one flat (a bucket whose every parameter is compressed: its best case).

Each compiled function (``fullgraph=True``: no silent fallback to eager pieces) is checked against
the eager pass for equal values (outputs and the buffers it updates in place; a NaN and an inf
planted in one tensor propagate the same way), then all
candidates, with the per-layer fp16 round trip into reused buffers as the reference every ratio
divides by, run in interleaved rounds (``--repeats``; medians of wall and process CPU time). The
compile cost is the first call over every shape (graphs traced, C++/Triton built, dynamic shapes),
timed once with inductor's on-disk caches off (a cold compile), after a throwaway compile has paid
the one-time start-up, so the rows compare; ``break-even steps`` is that cost over the time a step
saves.
The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import Tensor

from lgc.bench.compressors import resnet50_numels
from lgc.compressors.segment_topk import segment_block_size
from lgc.compressors.selection import group_maxima, topk_grouping
from lgc.ddp.exchange import Segment
from lgc.ddp.hook import bucket_maxima

#: DDP's default bucket size (``bucket_cap_mb=25``).
BUCKET_BYTES = 25 * 2**20
WORLD_SIZE = 4.0


def buckets_of(numels: list[int]) -> list[tuple[Segment, ...]]:
    """ResNet-50's parameters in reverse order, cut into buckets of at least 25 MiB of fp32, as DDP does."""
    buckets, current, offset = [], [], 0
    for i, numel in enumerate(reversed(numels)):
        current.append(Segment(f"p{i}", offset, numel, True))
        offset += numel
        if 4 * offset >= BUCKET_BYTES:
            buckets.append(tuple(current))
            current, offset = [], 0
    if current:
        buckets.append(tuple(current))
    return buckets


# -- 1. the hook's division and the step guard's look ------------------------------------------------
def unscale_guard_eager(buffer: Tensor, segments: tuple[Segment, ...]) -> Tensor:
    buffer.div_(WORLD_SIZE)
    return bucket_maxima(buffer, segments)


def unscale_guard_fused(buffer: Tensor, segments: tuple[Segment, ...]) -> Tensor:
    divided = buffer / WORLD_SIZE
    buffer.copy_(divided)
    return torch.stack([divided[s.offset : s.offset + s.numel].abs().amax() for s in segments])


# -- 2. error feedback's add and top-k's group maxima ------------------------------------------------
def ef_groups_eager(residual: Tensor, grad: Tensor, k: int) -> Tensor:
    residual.add_(grad)
    grouped, dim = topk_grouping(residual, k)  # type: ignore[misc]
    return group_maxima(grouped, dim)


def ef_groups_fused(residual: Tensor, grad: Tensor, rows: int, cols: int, dim: int) -> Tensor:
    corrected = residual + grad
    residual.copy_(corrected)
    return corrected[: rows * cols].view(rows, cols).abs().amax(dim=dim)


# -- 3. error feedback a bucket at once and segment_topk's block maxima -------------------------------
def ef_flat_eager(views: list[Tensor], grads: list[Tensor], flat: Tensor, block: int) -> Tensor:
    torch._foreach_add_(views, grads)
    rows = flat[: flat.numel() // block * block].view(-1, block)
    return group_maxima(rows, 1)


def ef_flat_fused(flat: Tensor, grad: Tensor, block: int) -> Tensor:
    corrected = flat + grad
    flat.copy_(corrected)
    return corrected[: flat.numel() // block * block].view(-1, block).abs().amax(1)


def grouped_tensors(numels: list[int], density: float) -> list[tuple[int, int, int, int]]:
    """``(numel, k, rows, cols, dim)`` of every tensor that selects through group maxima at ``density``."""
    shapes = []
    for numel in numels:
        k = max(1, math.ceil(density * numel))
        grouping = topk_grouping(torch.empty(numel), k)
        if grouping is not None:
            grouped, dim = grouping
            shapes.append((numel, k, grouped.shape[0], grouped.shape[1], dim))
    return shapes


def assert_same(a: Tensor, b: Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads on the CPU")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    # A cold compile every run: inductor's caches (read at the first compile) would hide its cost from the second run.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fused_passes_probe_")
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    numels = resnet50_numels()
    gen = torch.Generator().manual_seed(0)
    candidates: dict[str, Callable[[], object]] = {}
    compile_s: dict[str, float] = {}
    notes: dict[str, str] = {}

    # A throwaway compile pays inductor's one-time start-up (imports, toolchain), so the rows' compile times compare.
    torch.compile(lambda x: (x + 1).abs().amax(), fullgraph=True)(torch.ones(64, device=device))
    sync()

    # The reference: per-layer fp16 round trip into buffers allocated once.
    grads = [torch.randn(n, generator=gen).to(device) for n in numels]
    halves = [torch.empty(n, dtype=torch.float16, device=device) for n in numels]
    outs = [torch.empty(n, device=device) for n in numels]

    def fp16_round_trip() -> None:
        for g, h, o in zip(grads, halves, outs, strict=True):
            h.copy_(g)
            o.copy_(h)

    candidates["fp16_per_layer"] = fp16_round_trip

    # 1. unscale + guard, per bucket.
    buckets = buckets_of(numels)
    flats = [torch.randn(sum(s.numel for s in b), generator=gen).to(device) for b in buckets]
    twins = [f.clone() for f in flats]
    fused_guard = torch.compile(unscale_guard_fused, dynamic=False, fullgraph=True)
    sync()
    started = time.perf_counter()
    for flat, segments in zip(twins, buckets, strict=True):
        fused_guard(flat.clone(), segments)
    sync()
    compile_s["unscale_guard"] = time.perf_counter() - started
    for flat, twin, segments in zip(flats, twins, buckets, strict=True):
        flat[7] = float("nan") if segments is buckets[0] else flat[7]
        twin.copy_(flat)
        assert_same(unscale_guard_eager(flat, segments), fused_guard(twin, segments), "unscale_guard maxima")
        assert_same(flat, twin, "unscale_guard buffer")
        flat[7] = twin[7] = 1.0
    candidates["unscale_guard_eager"] = lambda: [unscale_guard_eager(f, s) for f, s in zip(flats, buckets, strict=True)]
    candidates["unscale_guard_fused"] = lambda: [fused_guard(f, s) for f, s in zip(twins, buckets, strict=True)]
    notes["unscale_guard"] = f"{len(buckets)} buckets, divided by {WORLD_SIZE:g}, every parameter's largest magnitude"

    # 2. error feedback + group maxima, per tensor (CPU).
    if device.type == "cpu":
        fused_groups = torch.compile(ef_groups_fused, dynamic=True, fullgraph=True)
        for density in (0.001, 0.01):
            shapes = grouped_tensors(numels, density)
            residuals = [torch.randn(s[0], generator=gen) for s in shapes]
            twins_r = [r.clone() for r in residuals]
            grads_t = [torch.randn(s[0], generator=gen) * 1e-2 for s in shapes]
            started = time.perf_counter()
            for r, g, (_, _, rows, cols, dim) in zip(twins_r, grads_t, shapes, strict=True):
                fused_groups(r.clone(), g, rows, cols, dim)
            compile_s[f"ef_topk_groups_{density:g}"] = time.perf_counter() - started
            grads_t[0][11], grads_t[0][5000] = float("nan"), float("-inf")
            for r, t, g, (_, k, rows, cols, dim) in zip(residuals, twins_r, grads_t, shapes, strict=True):
                assert_same(ef_groups_eager(r, g, k), fused_groups(t, g, rows, cols, dim), "ef_topk_groups maxima")
                assert_same(r, t, "ef_topk_groups residual")
            grads_t[0][11] = grads_t[0][5000] = 0.0
            residuals[0].zero_(), twins_r[0].zero_()

            def eager(rs=residuals, gs=grads_t, ss=shapes) -> None:
                for r, g, s in zip(rs, gs, ss, strict=True):
                    ef_groups_eager(r, g, s[1])

            def fused(rs=twins_r, gs=grads_t, ss=shapes) -> None:
                for r, g, s in zip(rs, gs, ss, strict=True):
                    fused_groups(r, g, s[2], s[3], s[4])

            candidates[f"ef_topk_groups_{density:g}_eager"] = eager
            candidates[f"ef_topk_groups_{density:g}_fused"] = fused
            notes[f"ef_topk_groups_{density:g}"] = f"{len(shapes)} tensors, {sum(s[0] for s in shapes):,} elements"

    # 3. error feedback as one flat + segment_topk's block maxima (any device).
    total = sum(numels)
    block = segment_block_size(total, sum(max(1, math.ceil(0.001 * n)) for n in numels))
    flat_r = torch.randn(total, generator=gen).to(device)
    twin_r = flat_r.clone()
    flat_g = (torch.randn(total, generator=gen) * 1e-2).to(device)
    views, grad_views = list(flat_r.split(numels)), list(flat_g.split(numels))
    fused_flat = torch.compile(ef_flat_fused, dynamic=False, fullgraph=True)
    sync()
    started = time.perf_counter()
    fused_flat(twin_r.clone(), flat_g, block)
    sync()
    compile_s["ef_flat_maxima"] = time.perf_counter() - started
    flat_g[123] = float("nan")
    assert_same(ef_flat_eager(views, grad_views, flat_r, block), fused_flat(twin_r, flat_g, block), "ef_flat maxima")
    assert_same(flat_r, twin_r, "ef_flat residual")
    flat_g[123], flat_r[123], twin_r[123] = 0.0, 0.0, 0.0
    candidates["ef_flat_maxima_eager"] = lambda: ef_flat_eager(views, grad_views, flat_r, block)
    candidates["ef_flat_maxima_fused"] = lambda: fused_flat(twin_r, flat_g, block)
    notes["ef_flat_maxima"] = f"{len(numels)} tensors as one flat, blocks of {block}"

    load_start = os.getloadavg()
    for fn in candidates.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in candidates}
    cpu: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.repeats):
        for name, fn in candidates.items():
            sync()
            w, c = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    load_end = os.getloadavg()
    ms = {name: 1e3 * statistics.median(times) for name, times in wall.items()}
    cpu_ms = {name: 1e3 * statistics.median(times) for name, times in cpu.items()}
    reference = ms["fp16_per_layer"]
    print(f"# Fused passes: eager against torch.compile, {device}, {args.threads} thread(s), {args.repeats} rounds")
    print(f"torch {torch.__version__}; load average at start {load_start}, at end {load_end}\n")
    print(
        "| pass | eager ms | fused ms | fused / eager | eager x fp16 | fused x fp16 | CPU eager / fused ms "
        "| compile s | break-even steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for key in compile_s:
        eager_ms, fused_ms = ms[f"{key}_eager"], ms[f"{key}_fused"]
        saved = eager_ms - fused_ms
        breakeven = compile_s[key] / (saved / 1e3) if saved > 0 else None
        rows.append(
            {
                "pass": key,
                "note": notes[key],
                "eager_ms": eager_ms,
                "fused_ms": fused_ms,
                "cpu_eager_ms": cpu_ms[f"{key}_eager"],
                "cpu_fused_ms": cpu_ms[f"{key}_fused"],
                "compile_s": compile_s[key],
                "break_even_steps": breakeven,
            }
        )
        print(
            f"| {key} ({notes[key]}) | {eager_ms:.2f} | {fused_ms:.2f} | {fused_ms / eager_ms:.2f} "
            f"| {eager_ms / reference:.2f} | {fused_ms / reference:.2f} "
            f"| {cpu_ms[f'{key}_eager']:.1f} / {cpu_ms[f'{key}_fused']:.1f} | {compile_s[key]:.1f} "
            f"| {'never' if breakeven is None else f'{breakeven:,.0f}'} |"
        )
    print(f"\nReference: per-layer fp16 round trip into reused buffers, {reference:.2f} ms (wall, median).")
    result = {
        "device": str(device),
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "fp16_per_layer_ms": reference,
        "rows": rows,
        "wall_s": wall,
        "cpu_s": cpu,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
