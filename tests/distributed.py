"""Run a function in several gloo worker processes and collect what each returns.

Workers start from a fork server (Python's ``forkserver`` start method) that imports torch and lgc
once for the whole session: a worker then starts in about 0.1 s instead of the 3-6 s a spawned
interpreter takes to import them, which is most of a two-worker test's time. The server also
imports what workers would otherwise each import on first use: ``torch._dynamo``, which
``DistributedDataParallel`` imports when it is built (about a second per worker), and the
distributed checkpoint. The server is a clean
single-threaded process, so forking it is as safe as spawning; what a spawned worker would inherit
from the test process at the time of the call, its environment, is handed to each worker explicitly.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

START_METHOD = "forkserver"
mp.set_forkserver_preload(
    [
        "torch",
        "torch._dynamo",
        "torch.distributed",
        "torch.distributed.checkpoint",
        "lgc",
        "lgc.ddp",
        "lgc.compressors",
        "distributed",
    ]
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, out_dir: str, env: dict[str, str], fn: Callable[..., Any], args: tuple
) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        # Every rank is done with every collective before any rank tears its group down.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The result is on disk: skip interpreter teardown. A test may issue collectives through
    # torch.distributed itself, whose last work gloo's thread can free while the interpreter shuts
    # down (SIGABRT, "terminate called without an active exception"; lgc's own collectives keep
    # their handles against it, lgc.ddp.collectives); leaving without teardown rules that out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(fn: Callable[..., Any], world_size: int = 2, *args: Any) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process."""
    with tempfile.TemporaryDirectory() as out_dir:
        worker_args = (world_size, free_port(), out_dir, dict(os.environ), fn, args)
        mp.start_processes(_worker, args=worker_args, nprocs=world_size, join=True, start_method=START_METHOD)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
