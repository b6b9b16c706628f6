"""A probe, not a benchmark of the package: where lgc's DDP hook spends the host's time in one step.

    python experiments/gpu_hook_profile.py [METHOD ...]     # default: ddp none topk shared_topk_int8

ResNet-50 (torchvision), batch 32 of 224x224, one worker in a process group of its own (NCCL on a
GPU, gloo on the CPU), plain SGD: each method (``ddp`` is DDP's own allreduce, no hook) takes 3
untimed steps, then Python's cProfile records 5 steps (forward, backward with the hook, optimizer,
the device synchronized after each). Printed per method: the wall time per step and the 18
functions with the most own time, so the host's share of the hook (Python, kernel launches,
synchronizations) shows by function.
"""

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc

CUDA = torch.cuda.is_available()
dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
methods = sys.argv[1:] or ["ddp", "none", "topk", "shared_topk_int8"]
images = torch.randn(32, 3, 224, 224, device=dev)
labels = torch.randint(0, 1000, (32,), device=dev)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


for method in methods:
    torch.manual_seed(0)
    model = DDP(torchvision.models.resnet50().to(dev), device_ids=[0] if CUDA else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.0 if method == "dgc" else 0.9)
    if method != "ddp":
        lgc.compress(model, method, optimizer=optimizer)

    def step(model: DDP = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        sync()

    for _ in range(3):
        step()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(5):
        step()
    profiler.disable()
    wall = (time.perf_counter() - started) / 5
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    print(f"\n## {method}: {1000 * wall:.1f} ms per step (profiled)")
    print("\n".join(line.replace(os.getcwd() + "/", "") for line in lines[start : start + 19]))
dist.destroy_process_group()
