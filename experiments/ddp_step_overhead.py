"""What a method's hook costs inside a real DDP step: CPU and wall time against the no-communication step.

Issue 12's hook target: a DDP step with top-k 0.1 % or DGC at most 1.25x the no-communication step
in CPU time, i.e. no more overhead than PyTorch's own fp16 and PowerSGD hooks. ``--workers`` gloo
processes on this machine (loopback) each train a copy of the model per method (ImageNet ResNet
shapes, 1,000 classes, on small random images so the gradient has the real sizes), past the
method's own warm-up stages; then ``--rounds`` interleaved rounds time ``--steps`` steps of every
method and of the no-communication step (``no_sync``: forward, backward and optimizer, DDP
communicates nothing). Reported per method: median wall time, median CPU time summed over the
workers' processes (all their threads), both as multiples of the no-communication step measured in
the same rounds, and the load average.

    python experiments/ddp_step_overhead.py --model resnet50 --density 0.001
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

METHODS = "none,torch_fp16,powersgd,topk,dgc,redsync,sbc,random_block,qsgd"
NO_COMM = "no_sync"


def _worker(rank: int, args: argparse.Namespace, store: str, results: Any) -> None:
    import lgc
    from lgc.bench.cost_model import profile_knobs, steady_from
    from lgc.bench.network_worker import sgd_for
    from lgc.models.torchvision_resnet import torchvision_resnet

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=args.workers)
    torch.manual_seed(0)
    base = torchvision_resnet(int(args.model.removeprefix("resnet")), num_classes=1000, stem="imagenet")
    generator = torch.Generator().manual_seed(rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
        return x, torch.randint(1000, (args.batch_size,), generator=generator)

    runs: dict[str, Any] = {}
    methods = args.methods.split(",")
    for method in [NO_COMM, *methods]:
        model = DistributedDataParallel(copy.deepcopy(base))
        optimizer = sgd_for(method, model, lr=1e-3)
        warm = 2
        if method != NO_COMM:
            knobs = profile_knobs(args.density).get(method, {})
            state = lgc.compress(model, method, optimizer=optimizer, **knobs)
            state.set_epoch(1000)  # DGC past its density warm-up
            warm = steady_from(state) + 2
        runs[method] = (model, optimizer, warm)

    def step(method: str) -> tuple[float, float]:
        model, optimizer, _ = runs[method]
        x, y = batch()
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        if method == NO_COMM:
            with model.no_sync():
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()
        optimizer.step()
        return time.perf_counter() - wall, time.process_time() - cpu

    for method, (_, _, warm) in runs.items():
        for _ in range(warm):
            step(method)
    timings: dict[str, list[tuple[float, float]]] = {m: [] for m in runs}
    for _ in range(args.rounds):
        for method in runs:
            for _ in range(args.steps):
                timings[method].append(step(method))
    results[rank] = json.dumps(timings)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=("resnet18", "resnet50", "resnet101"))
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from lgc.api import METHODS as KNOWN

    unknown = [m for m in args.methods.split(",") if m not in KNOWN]
    if unknown:
        parser.error(f"unknown method(s) {unknown}")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(args, f"file://{scratch}/store", results), nprocs=args.workers)
        per_rank = [json.loads(results[rank]) for rank in range(args.workers)]
    rows = {}
    for method in per_rank[0]:
        walls = [statistics.median(w for w, _ in rank[method]) for rank in per_rank]
        # CPU of one step summed over the workers, median over steps.
        cpus = [sum(rank[method][i][1] for rank in per_rank) for i in range(len(per_rank[0][method]))]
        rows[method] = (max(walls), statistics.median(cpus))
    wall0, cpu0 = rows[NO_COMM]
    print(
        f"# DDP step overhead: {args.model}, {args.workers} gloo workers on this machine, batch {args.batch_size} "
        f"of {args.image_size}x{args.image_size}, density {args.density}, {args.threads} thread(s) each, "
        f"{args.rounds} rounds x {args.steps} steps\n"
    )
    print("| method | wall (ms) | x no-comm | CPU, all workers (ms) | x no-comm |")
    print("|---|---|---|---|---|")
    for method, (wall, cpu) in rows.items():
        print(f"| {method} | {1000 * wall:.0f} | {wall / wall0:.2f} | {1000 * cpu:.0f} | {cpu / cpu0:.2f} |")
    end = os.getloadavg()
    start_text, end_text = (" ".join(f"{x:.2f}" for x in values) for values in (load, end))
    print(f"\nload average at start {start_text}, at end {end_text}")


if __name__ == "__main__":
    main()
