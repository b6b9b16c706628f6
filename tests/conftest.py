"""Shared test setup: import path for worker functions, offline wandb, the no_workers, group and device fixtures."""

import os
import sys
from pathlib import Path

import pytest

# Worker functions live in test modules; spawned workers import them by module name. The test
# folders mirror lgc/'s packages, and every test module and helper is importable by its own name.
_TESTS = Path(__file__).parent
for _folder in [
    _TESTS,
    *sorted(path for path in _TESTS.iterdir() if path.is_dir() and not path.name.startswith((".", "_"))),
]:
    sys.path.insert(0, str(_folder))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Every test leaves os.environ as it found it.

    Lightning's launcher sets ``LOCAL_RANK``, ``NODE_RANK`` and ``MASTER_ADDR`` in the process that
    builds a Trainer; a later test's subprocess (a notebook's kernel) inheriting ``LOCAL_RANK`` would
    take its workers as started by someone else and wait for them forever.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(
    params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _cuda_available(), reason="no CUDA device"))]
)
def reference_device(request):
    """Where a comparison with a reference transcription runs: the CPU, and a GPU with TF32 off when there is one.

    TF32 matmuls keep about three significant digits; the comparisons are to fp32 rounding.
    """
    import torch

    if request.param == "cpu":
        yield torch.device("cpu")
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    # fp32_precision replaced allow_tf32 in torch 2.9; the project admits older releases too.
    setting = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    off = "ieee" if setting == "fp32_precision" else False
    saved = getattr(matmul, setting), getattr(cudnn, setting)
    setattr(matmul, setting, off)
    setattr(cudnn, setting, off)
    try:
        yield torch.device("cuda")
    finally:
        setattr(matmul, setting, saved[0])
        setattr(cudnn, setting, saved[1])
