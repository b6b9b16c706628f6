"""``lgc-bench step``: what a method's hook costs inside a real DDP step, against the no-communication step.

``--workers`` gloo processes on this machine (loopback) each train a copy of the model per method
(ImageNet ResNet shapes, 1,000 classes, on small random images so the gradients have the real
sizes), past the method's own warm-up stages (LGC: past its autoencoder training, so its
compressed stage is timed); then ``--rounds`` interleaved rounds time ``--steps`` steps of every
method and of the no-communication step (``no_sync``: forward, backward and optimizer, DDP
communicates nothing); ``ddp`` is DDP's own allreduce without a hook, beside which ``none`` shows
what lgc's dense hook adds. Reported per method: median wall time, median CPU time summed over
the workers' processes (all their threads), both as multiples of the no-communication step measured in
the same rounds, the same as means over every timed step, and the load average. Beside the times,
each method's arithmetic: the floating-point operations of a further step per worker (averaged over
a delay's worth of steps for a method with ``delay``): matrix products and convolutions, the
model's and the method's codec's alike, counted by ``torch.utils.flop_counter``, and their multiple
of the no-communication step's. Where a step is compute-bound (a CPU), that multiple is the floor
under the CPU ratio that no implementation of the same arithmetic can pass; a learned codec's share
of it falls as the model's work per step grows (``--batch-size``, ``--image-size``). The count sees
what runs on the worker's own thread (and, on a GPU, in autograd's device threads): work a hook
leaves to a communication future's callback, which gloo may run on its own thread (PyTorch's
PowerSGD hook: its second and third products), or to an overlapped exchange's thread, is missed,
so such rows count the model's work and part of the method's, or none of it. With
``--device cuda`` each worker is one GPU (NCCL; ``--workers`` at most the GPUs there are), every step is timed
between two device synchronizations, and the CPU time is the host's. A method with
``delay`` (communication delay: local steps, then an exchange) is read by its mean, which counts its
exchanges at their share when the timed steps (``--rounds`` x ``--steps``) are a multiple of the
delay (the report says when they are not); its median is a local step. Its CPU ratio to DDP's step
gets an interval over the rounds only when each round holds whole delays (``--steps`` a multiple of
the delay): otherwise a round's ratio depends on whether an exchange fell in it, and the spread
over rounds measures where the exchanges fell, not the noise.

``--fsdp`` times methods on the same model sharded with FSDP2 (``fully_shard`` on every block:
:func:`lgc.fsdp.shard_model`), in the same rounds, as rows ``fsdp/NAME`` beside ``fsdp``, FSDP2's
own reduce-scatter; each gets its CPU ratio to DDP's step like every other row. ``--hsdp`` does the
same hybrid-sharded: replicas of ``--shard-size`` workers (default half of them, so two replicas),
FSDP2's exact reduce-scatter inside a replica and lgc's compressed all-reduce across replicas
(``lgc.compress(..., replicate=mesh["replicate"])``), as rows ``hsdp/NAME`` beside ``hsdp``, FSDP2's
own HSDP (a 2-D mesh, a dense all-reduce across replicas).

A method is an ``lgc.compress`` name, optionally with knobs after a colon, ``;``-separated, dotted
for nested knobs and YAML-valued; e.g. LGC-RAR with a narrower autoencoder::

    lgc-bench step --density 0.01 --methods \\
      'none,dgc,lgc_rar,lgc_rar:training.autoencoder.encoder_channels=[16,32,64,16];training.autoencoder.decoder_channels=[16,32,32,16]'

Targets it measures: top-k 0.1 % and DGC at most 1.25x the no-communication step in CPU time,
no more than PyTorch's fp16 and PowerSGD hooks; LGC's compressed stage at most 1.5x at densities
1 % and 0.1 %.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

from lgc.bench.methods import NO_COMM, MethodSpec, parse_methods, profile_knobs, sgd_for
from lgc.bench.step_rows import PLAIN_DDP, flop_rows, step_rows
from lgc.methods import merge_knobs
from lgc.provenance import run_provenance

__all__ = ["add_arguments", "run"]

METHODS = "ddp,none,torch_fp16,powersgd,topk,dgc,redsync,sbc,random_block,qsgd"
#: Stock FSDP2 (``fully_shard`` on every block, its own reduce-scatter): the ``--fsdp`` rows' yardstick.
PLAIN_FSDP = "fsdp"
#: Stock HSDP (``fully_shard`` on a 2-D mesh, a dense all-reduce across replicas): the ``--hsdp`` rows' yardstick.
PLAIN_HSDP = "hsdp"


def _worker(
    rank: int,
    args: argparse.Namespace,
    specs: list[MethodSpec],
    sharded: list[tuple[str, MethodSpec]],
    store: str,
    results: Any,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import lgc
    from lgc.fsdp import shard_model
    from lgc.models.torchvision_resnet import torchvision_resnet

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = {"backend": "nccl", "device_id": device} if cuda else {"backend": "gloo"}
    dist.init_process_group(**backend, init_method=store, rank=rank, world_size=args.workers)
    torch.manual_seed(0)
    base = torchvision_resnet(int(args.model.removeprefix("resnet")), num_classes=1000, stem="imagenet").to(device)
    generator = torch.Generator().manual_seed(rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
        return x.to(device), torch.randint(1000, (args.batch_size,), generator=generator).to(device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    runs: dict[str, Any] = {}
    for spec in [MethodSpec(NO_COMM, NO_COMM, {}), *specs]:
        model = DistributedDataParallel(copy.deepcopy(base), device_ids=[rank] if cuda else None)
        optimizer = sgd_for(spec.name, model, lr=1e-3)
        warm = 2
        if spec.name not in (NO_COMM, PLAIN_DDP):
            # Dict knobs (LGC's stages, training) merge into the method's defaults key by key, at any depth.
            knobs = merge_knobs(profile_knobs(args.density).get(spec.name, {}), spec.knobs)
            state = lgc.compress(model, spec.name, optimizer=optimizer, **knobs)
            state.set_epoch(1000)  # DGC past its density warm-up
            warm = state.steady_from() + 2
        runs[spec.label] = (model, optimizer, warm, spec.name == NO_COMM)
    mesh = None
    if any(kind == PLAIN_HSDP for kind, _ in sharded):  # built once, in the same order on every rank
        shards = args.workers // 2 if args.shard_size is None else args.shard_size
        mesh = init_device_mesh(device.type, (args.workers // shards, shards), mesh_dim_names=("replicate", "shard"))
    # The same model sharded with FSDP2 (every worker a shard) or hybrid-sharded (replicas of shards), through
    # lgc's collectives or FSDP2's own.
    for kind, spec in sharded:
        hybrid = {} if kind == PLAIN_FSDP else {"replicate": mesh["replicate"]}
        if spec.name == kind:
            model = shard_model(copy.deepcopy(base), **({} if mesh is None or kind == PLAIN_FSDP else {"mesh": mesh}))
        else:
            model = shard_model(copy.deepcopy(base), **({"mesh": mesh["shard"]} if hybrid else {}))
        optimizer = sgd_for(spec.name, model, lr=1e-3)
        warm = 2
        if spec.name != kind:
            knobs = merge_knobs(profile_knobs(args.density).get(spec.name, {}), spec.knobs)
            state = lgc.compress(model, spec.name, optimizer=optimizer, **hybrid, **knobs)
            state.set_epoch(1000)
            warm = state.steady_from() + 2
        runs[spec.label] = (model, optimizer, warm, False)

    def step(label: str) -> tuple[float, float]:
        model, optimizer, _, no_comm = runs[label]
        x, y = batch()
        dist.barrier()
        synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        if no_comm:
            with model.no_sync():
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()
        optimizer.step()
        synchronize()
        return time.perf_counter() - wall, time.process_time() - cpu

    for label, (_, _, warm, _) in runs.items():
        for _ in range(warm):
            step(label)
    timings: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    for _ in range(args.rounds):
        for label in runs:
            for _ in range(args.steps):
                timings[label].append(step(label))
    # Further steps per method, their arithmetic counted (every rank runs them, in the same order): one,
    # or a delay's worth, so that a method exchanging every few steps is counted at its exchanges' share.
    delays = _delays(specs, sharded)
    flops = {label: _counted_flops(step, label, delays.get(label, 1)) for label in runs}
    results[rank] = json.dumps({"timings": timings, "flops": flops})
    dist.barrier()
    dist.destroy_process_group()


def _delays(specs: list[MethodSpec], sharded: list[tuple[str, MethodSpec]]) -> dict[str, int]:
    """Every row's label -> steps between its exchanges, the sharded rows' included."""
    return {spec.label: spec.delay for spec in [*specs, *(spec for _, spec in sharded)]}


def _counted_flops(step: Any, label: str, steps: int = 1) -> float:
    """Floating-point operations per step over ``steps`` steps of ``label`` on this worker (a flop counter)."""
    counter = FlopCounterMode(display=False)
    with counter:
        for _ in range(steps):
            step(label)
    return float(counter.get_total_flops()) / steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", choices=("resnet18", "resnet50", "resnet101"))
    parser.add_argument("--methods", default=METHODS, help="comma-separated name[:key=value;...] (default %(default)s)")
    parser.add_argument(
        "--fsdp",
        default="",
        help="methods also timed on the model sharded with FSDP2 (fully_shard on every block), as rows fsdp/NAME; "
        "'fsdp' is FSDP2's own reduce-scatter (e.g. --fsdp fsdp,none,fp16,topk,qsgd)",
    )
    parser.add_argument(
        "--hsdp",
        default="",
        help="methods also timed hybrid-sharded (replicas of --shard-size workers, lgc across the replicas), as rows "
        "hsdp/NAME; 'hsdp' is FSDP2's own HSDP on a 2-D mesh (e.g. --hsdp hsdp,none,fp16,topk,qsgd,lgc_rar)",
    )
    parser.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="workers per replica for --hsdp (default: half of --workers, two replicas)",
    )
    parser.add_argument("--density", type=float, default=0.001, help="the sparsifiers' and LGC's density")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: gloo workers on this machine's cores; cuda: one NCCL worker per GPU (default cpu)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 < args.density <= 1:
        raise SystemExit(f"--density must be in (0, 1], got {args.density}")
    if args.workers < 1 or args.rounds < 1 or args.steps < 1:
        raise SystemExit(
            f"--workers, --rounds and --steps must be >= 1, got {args.workers}, {args.rounds}, {args.steps}"
        )
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("--device cuda: no CUDA device is available")
        if args.workers > gpus:
            raise SystemExit(f"--device cuda runs one NCCL worker per GPU: --workers {args.workers}, but {gpus} GPU(s)")
    try:
        specs = parse_methods(args.methods, plain=(PLAIN_DDP,))
    except ValueError as error:
        raise SystemExit(f"--methods: {error}") from None
    sharded: list[tuple[str, MethodSpec]] = []
    for kind, given in ((PLAIN_FSDP, args.fsdp), (PLAIN_HSDP, args.hsdp)):
        try:
            sharded += [
                (kind, spec if spec.name == kind else spec._replace(label=f"{kind}/{spec.label}"))
                for spec in parse_methods(given, plain=(kind,))
            ]
        except ValueError as error:
            raise SystemExit(f"--{kind}: {error}") from None
    if args.fsdp and args.workers < 2:
        raise SystemExit("--fsdp shards the model over the workers: it needs --workers 2 or more")
    if args.shard_size is not None and not args.hsdp:
        raise SystemExit(f"--shard-size {args.shard_size} sizes the replicas of --hsdp, which is not given")
    shards = args.workers // 2 if args.shard_size is None else args.shard_size
    if args.hsdp and (shards < 1 or args.workers % shards or args.workers // shards < 2):
        given = "" if args.shard_size is None else f" --shard-size {shards}"
        raise SystemExit(
            f"--hsdp{given} on --workers {args.workers}: the workers must form two or more replicas of "
            f"--shard-size workers each (default: half of them, {shards})"
        )
    from lgc.api import check_sharded_method

    for kind, spec in sharded:  # what lgc.compress would refuse in every worker, refused here first
        if spec.name != kind:
            try:
                knobs = merge_knobs(profile_knobs(args.density).get(spec.name, {}), spec.knobs)
                check_sharded_method(spec.name, hybrid=kind == PLAIN_HSDP, **knobs)
            except (ValueError, TypeError) as error:
                raise SystemExit(f"--{kind} {spec.label}: {error}") from None
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(args, specs, sharded, f"file://{scratch}/store", results), nprocs=args.workers)
        per_rank = [json.loads(results[rank]) for rank in range(args.workers)]
    delays = _delays(specs, sharded)
    rows = step_rows([rank["timings"] for rank in per_rank], args.rounds, delays)
    flop_rows(rows, [rank["flops"] for rank in per_rank])
    timed = args.rounds * args.steps
    where = "NCCL workers, one GPU each" if args.device == "cuda" else "gloo workers on this machine"
    uneven = [spec.label for spec in specs if timed % spec.delay]
    print(
        f"# DDP step overhead: {args.model}, {args.workers} {where}, batch {args.batch_size} "
        f"of {args.image_size}x{args.image_size}, density {args.density}, {args.threads} thread(s) each, "
        f"{args.rounds} rounds x {args.steps} steps\n"
    )
    print(
        "| method | wall (ms) | x no-comm | CPU, all workers (ms) | x no-comm | mean wall (ms) | x no-comm "
        "| mean CPU (ms) | x no-comm | GFLOP/worker | x no-comm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        print(
            f"| {label} | {1000 * row['wall_s']:.0f} | {row['wall_x']:.2f} | {1000 * row['cpu_s']:.0f} "
            f"| {row['cpu_x']:.2f} | {1000 * row['mean_wall_s']:.0f} | {row['mean_wall_x']:.2f} "
            f"| {1000 * row['mean_cpu_s']:.0f} | {row['mean_cpu_x']:.2f} | {row['gflop']:.2f} | {row['gflop_x']:.2f} |"
        )
    print(
        "\nMedians are the step of a method that sends every step; with a delay most steps are local and "
        "only the mean (every step timed, the exchanges included) is its cost. GFLOP/worker: the matrix "
        "products and convolutions of a further step (a delay's worth of steps, averaged, with a delay; the "
        "model's and the codec's; the most of any worker), the arithmetic floor of the CPU ratio where the "
        "step is compute-bound; work left to a communication callback on another thread (PyTorch's "
        "PowerSGD hook on gloo) is not counted."
    )
    against = [(label, row["cpu_vs_ddp"]) for label, row in rows.items() if "cpu_vs_ddp" in row]
    if against:
        print(f"\nMean CPU step over DDP's own in the same round, mean ± 95 % interval over the {args.rounds} rounds:")
        print("\n| method | CPU x DDP |\n|---|---|")
        for label, ratio in against:
            print(f"| {label} | {ratio['mean']:.3f} ± {ratio['half_width']:.3f} |")
    # Rows step_rows gave no interval while others have one: their rounds hold a part of their delay.
    partial = [label for label, row in rows.items() if against and "cpu_vs_ddp" not in row]
    if partial:
        print(
            f"No interval for {', '.join(partial)}: a round of {args.steps} steps does not hold whole delays "
            "(--steps a multiple of each delay gives one)."
        )
    if uneven:
        print(
            f"The {timed} timed steps per method (--rounds x --steps) are not a multiple of the delay of "
            f"{', '.join(uneven)}: their means count a share of exchanges that is not theirs."
        )
    end = os.getloadavg()
    start_text, end_text = (" ".join(f"{x:.2f}" for x in values) for values in (load, end))
    print(f"\nload average at start {start_text}, at end {end_text}")
    table = {
        "model": args.model,
        "device": args.device,
        "workers": args.workers,
        "density": args.density,
        "load_average": [load, end],
        # The commit the timings belong to (and whether the tree had changes), with the versions.
        "provenance": run_provenance(),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(table, handle, indent=2)
    return table
