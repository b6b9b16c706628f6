"""Shared test setup: import path for worker functions, offline wandb, the no_workers and group fixtures."""

import os
import sys
from pathlib import Path

import pytest

# Worker functions live in test modules; spawned workers import them by module name.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if a worker process is started."""
    import torch.multiprocessing

    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started before the bad value was reported")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)


@pytest.fixture
def group(tmp_path):
    """A one-process gloo group in this process (registration checks, profiles in a group of one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
