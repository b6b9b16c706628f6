"""One worker of ``lgc-bench network``: trains with one method over the shaped link and times its steps.

Started by :mod:`lgc.bench.network` inside the worker's network namespace, with the rendezvous in
the environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``)
and the run's settings as one JSON argument (:class:`WorkerSpec`). It trains a plain
``DistributedDataParallel`` loop (no Lightning: nothing but the step is timed) with the method
registered by :func:`lgc.compress`, and writes one JSON record per rank:

* ``compute_s``: forward + backward without any communication (``no_sync`` steps measured before
  training, the median): what the step would cost on an infinitely fast network (the optimizer's
  own update, a few microseconds for SGD, aside);
* per step: wall and process CPU seconds, the hook's encode and decode seconds (lgc's compressors;
  null for LGC and PyTorch's hooks, whose coding is interleaved with their collectives), and the
  wire and logical bytes this worker sent (:class:`lgc.ddp.CommStats`);
* ``interface_tx_bytes``: what this worker's network interface sent during the training loop
  (headers included), to check the wire bytes against;
* epochs of ``len(train) // (batch_size * world)`` steps, announced with ``state.set_epoch``
  (DGC's density warm-up counts them);
* evaluations every ``eval_every`` steps (the whole validation split, each rank a share of it, once
  the ranks have checked that they hold the same model; the time spent evaluating is left out of
  the training clock): training seconds so far and accuracy. With local steps (``delay``) the
  ranks evaluate the synchronized (global) model, as DiLoCo and its successors report: every
  fragment's last synchronized weights and the buffers of the last exchange
  (:meth:`lgc.ddp.local_sgd.CommunicationDelayState.global_model`), and train on from their own
  weights; ``eval_model`` records it;
* ``profile``: the method measured in a group of this worker alone (:func:`lgc.bench.profile.profile_method`,
  run by all workers at once before training, so the CPU is shared as in training), with the
  collectives of the last training step (``trace``), for the cost model's validation.

With ``mode="collectives"`` it trains nothing and times allreduces and allgathers of
``collective_sizes`` bytes instead (``collectives``: kind, bytes, the seconds of each of
``collective_repeats`` repeats, each started after a barrier), which
:func:`lgc.bench.cost_model.fit_link` calibrates the link from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lgc.bench.methods import sgd_for
from lgc.bench.profile import profile_method

__all__ = ["TASKS", "WorkerSpec", "build_model", "load_task_data", "main", "run_worker", "time_collectives"]

#: Training tasks: the embedded default's model on 8x8 digits, ResNet-8 on Fashion-MNIST (28x28,
#: validated on its 10,000 test images: the task that separates methods), and torchvision ResNets
#: (larger gradients) on the 8x8 digits with the CIFAR stem, where compute stays cheap.
TASKS = ("digits", "fashion_mnist", "resnet18", "resnet50")
#: The learning rate over a measurement's steps: a cosine to 0 at the last step, or constant.
SCHEDULES = ("cosine", "constant")


@dataclass
class WorkerSpec:
    """What every worker of one measurement runs (the same on every rank)."""

    method: str
    #: The ``--methods`` entry as written (``none:delay=10;outer=sgd``): the report's row name.
    label: str = ""
    task: str = "digits"
    steps: int = 120
    batch_size: int = 32
    lr: float = 0.05
    #: One of :data:`SCHEDULES` (:func:`lr_factor`).
    schedule: str = "cosine"
    momentum: float = 0.9
    eval_every: int = 10
    compute_steps: int = 5
    seed: int = 0
    #: fashion_mnist: the folder torchvision's FashionMNIST reads (lgc.data.fashion_mnist.prepare_fashion_mnist).
    data_root: str | None = None
    timeout_s: float = 300.0
    knobs: dict[str, Any] = field(default_factory=dict)
    #: ``train``, or ``collectives`` (time collectives to calibrate the cost model's link).
    mode: str = "train"
    collective_sizes: list[int] = field(default_factory=lambda: [256, 1024, 4096, 16384, 65536, 524288, 4194304])
    collective_repeats: int = 12


def build_model(task: str) -> nn.Module:
    """The model of ``task``: 1-channel images, 10 classes."""
    if task in ("digits", "fashion_mnist"):
        from lgc.models.cifar_resnet import resnet8

        return resnet8(num_classes=10, in_channels=1)
    if task in ("resnet18", "resnet50"):
        from lgc.models.torchvision_resnet import torchvision_resnet

        return torchvision_resnet(int(task.removeprefix("resnet")), num_classes=10, in_channels=1, stem="cifar")
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def load_task_data(spec: WorkerSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training images and labels, validation images and labels (normalized float images, N x 1 x H x W)."""
    if spec.task == "fashion_mnist":
        from torchvision.datasets import FashionMNIST

        from lgc.data.fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD

        def split(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
            data = FashionMNIST(spec.data_root, train=train, download=False)
            images = (data.data.unsqueeze(1).float() / 255 - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0]
            return images, data.targets

        return *split(True), *split(False)
    from lgc.data.digits import load_digits_split

    train_set, val_set = load_digits_split(0.2, spec.seed)
    return *train_set.tensors, *val_set.tensors


def _fingerprint(model: nn.Module) -> float:
    """A float64 sum over the model's parameters and buffers: equal on every rank when the models are."""
    return sum(float(t.detach().double().sum()) for t in [*model.parameters(), *model.buffers()])


def _evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy on all of ``images``, every rank evaluating its share (``rank::world``) of the same model.

    The ranks first check that they hold the same model (a fingerprint of its weights and
    buffers, equal up to float rounding); a mismatch is an error, not an average over different models.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    prints = [0.0] * world
    dist.all_gather_object(prints, _fingerprint(model))
    # Equal up to float rounding (ranks may sum gathered values in different orders).
    if any(abs(value - prints[0]) > 1e-5 * (abs(prints[0]) + 1.0) for value in prints):
        raise RuntimeError(f"the ranks evaluate different models (weight fingerprints {prints})")
    mine, their_labels = images[rank::world], labels[rank::world]
    model.eval()
    with torch.no_grad():
        correct = sum(
            int((model(x).argmax(dim=1) == y).sum())
            for x, y in zip(mine.split(256), their_labels.split(256), strict=True)
        )
    model.train()
    total = torch.tensor([correct], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total) / len(labels)


def _synchronized_model(state: Any, module: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """The model every worker agrees on: the global one with local steps, else the module itself."""
    return state.global_model() if state.takes_local_steps else contextlib.nullcontext(module)


def _interface_counters() -> Any:
    """A reader of the bytes this worker's interface sent (``GLOO_SOCKET_IFNAME``), or of None.

    Inside the worker's namespace ``/sys/class/net`` shows that namespace's interfaces, so the
    count taken around the training loop leaves the rendezvous and DDP's initial broadcast out.
    """
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path("/sys/class/net", name or "-", "statistics", "tx_bytes")
    if not name or not path.exists():
        return lambda: None
    return lambda: int(path.read_text())


def time_collectives(spec: WorkerSpec) -> dict[str, Any]:
    """Seconds of every repeat of allreduces and allgathers of ``spec.collective_sizes`` bytes, this rank's clock."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for kind in ("all_reduce", "all_gather"):
        for size in spec.collective_sizes:
            tensor = torch.ones(max(1, size // 4))
            outputs = [torch.empty_like(tensor) for _ in range(world)]
            times = []
            for _ in range(spec.collective_repeats + 1):
                dist.barrier()
                started = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(tensor)
                else:
                    dist.all_gather(outputs, tensor)
                times.append(time.perf_counter() - started)
            results.append({"kind": kind, "nbytes": tensor.numel() * 4, "times": times[1:]})
    return {"rank": rank, "world_size": world, "spec": asdict(spec), "collectives": results}


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """The learning rate of optimizer step ``step`` (from 0) of ``steps``, as a multiple of ``lr``.

    ``cosine``: ``(1 + cos(pi * step / steps)) / 2``, from 1 at the first step towards 0 after the
    last (what ``lgc-train``'s cosine schedule does per step); ``constant``: 1.
    """
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * step / steps))
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Train ``spec.steps`` steps in an initialized process group; returns this rank's record."""
    import lgc
    from lgc.ddp.collectives import record_collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    images, labels, val_images, val_labels = load_task_data(spec)
    torch.manual_seed(spec.seed)
    model = DistributedDataParallel(build_model(spec.task))
    optimizer = sgd_for(spec.method, model, spec.lr, spec.momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(spec.schedule, step, spec.steps))
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(spec.seed * 1000 + rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(labels), (spec.batch_size,), generator=generator)
        return images[index], labels[index]

    # Compute alone: forward + backward without DDP's communication.
    compute = []
    for _ in range(spec.compute_steps + 1):
        x, y = batch()
        start = time.perf_counter()
        with model.no_sync():
            loss_fn(model(x), y).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        compute.append(time.perf_counter() - start)
    optimizer.zero_grad(set_to_none=True)
    compute_s = statistics.median(compute[1:])

    # The method alone in a group of this worker (every collective a no-op), all workers at once.

    solo = [dist.new_group([r]) for r in range(world)][rank]
    profile_generator = torch.Generator().manual_seed(spec.seed * 1000 + rank + 500)

    def profile_batch() -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(labels), (spec.batch_size,), generator=profile_generator)
        return images[index], labels[index]

    profile = profile_method(model.module, spec.method, profile_batch, knobs=spec.knobs, steps=15, group=solo)
    dist.barrier()

    state = lgc.compress(model, spec.method, optimizer=optimizer, **spec.knobs)
    codec = state.codec_times()
    # Epochs drive DGC's density warm-up (and any compressor's set_epoch): one pass over the data.
    steps_per_epoch = max(1, len(labels) // (spec.batch_size * world))
    interface = _interface_counters()
    records, evaluations = [], []
    training_s = 0.0
    dist.barrier()
    sent_at_start = interface()
    for step in range(spec.steps):
        if step % steps_per_epoch == 0:
            state.set_epoch(step // steps_per_epoch)
        x, y = batch()
        before = state.stats.as_dict()
        codec_before = dict(codec) if codec is not None else None
        lr = optimizer.param_groups[0]["lr"]
        with record_collectives() as trace:
            wall, cpu = time.perf_counter(), time.process_time()
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        scheduler.step()
        training_s += wall
        after = state.stats.as_dict()
        record = {
            "wall_s": wall,
            "cpu_s": cpu,
            "lr": lr,
            "loss": float(loss),
            "wire_bytes_sent": after["wire_bytes_sent"] - before["wire_bytes_sent"],
            "wire_bytes_received": after["wire_bytes_received"] - before["wire_bytes_received"],
            "bytes_sent": after["bytes_sent"] - before["bytes_sent"],
            "encode_s": None,
            "decode_s": None,
        }
        if codec is not None and codec_before is not None:
            record["encode_s"] = codec["encode"] - codec_before["encode"]
            record["decode_s"] = codec["decode"] - codec_before["decode"]
        records.append(record)
        if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
            # Off the training clock; every rank evaluates a share of the validation set.
            with _synchronized_model(state, model.module) as evaluated:
                accuracy = _evaluate(evaluated, val_images, val_labels)
            evaluations.append({"step": step + 1, "training_s": training_s, "accuracy": accuracy})
    sent_at_end = interface()
    profile.trace = list(trace)  # the last step's collectives, over the real group
    return {
        "profile": profile.to_json(),
        "steady_from": state.steady_from(steps_per_epoch),
        "interface_tx_bytes": None if sent_at_start is None else sent_at_end - sent_at_start,
        "rank": rank,
        "world_size": world,
        "spec": asdict(spec),
        "compute_s": compute_s,
        "steps": records,
        "evaluations": evaluations,
        "eval_model": state.eval_model,
        "stats": state.stats.as_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="the WorkerSpec as JSON")
    parser.add_argument("out", type=Path, help="write this rank's record here (JSON)")
    args = parser.parse_args(argv)
    spec = WorkerSpec(**json.loads(args.spec))
    torch.set_num_threads(int(os.environ.get("LGC_BENCH_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.timeout_s))
    try:
        record = run_worker(spec) if spec.mode == "train" else time_collectives(spec)
        args.out.write_text(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
