"""lgc's collectives over gloo with the tensors on each device: workers that share a GPU talk this way.

With more workers than GPUs (``ddp.oversubscribe=true``), ``lgc-train`` puts several workers on one
GPU and connects them over gloo, since NCCL takes one worker per GPU. gloo's collectives copy CUDA
tensors through host memory themselves; its point-to-point ``send`` and ``recv`` read and write
host pointers only, so :mod:`lgc.ddp.collectives` stages a CUDA message through a host copy (LGC-PS
sends point to point). Two workers on ``cuda:0`` where a GPU is (the GPU checks; CI has none), and
the same calls with host tensors on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _every_call(rank: int, world_size: int, device_name: str) -> dict[str, torch.Tensor]:
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stats = CommStats()
    mine = torch.arange(6, dtype=torch.float32, device=device) + 10 * rank
    out: dict[str, torch.Tensor] = {}
    if rank == 0:
        counted.send(stats, mine, 1, None)
    else:
        out["recv"] = counted.recv(stats, torch.zeros(6, device=device), 0, None)
        assert out["recv"].device == device
    reduced = mine.clone()
    counted.all_reduce(stats, reduced, None).wait()
    out["all_reduce"] = reduced
    gathered, work = counted.all_gather(stats, mine, None)
    work.wait()
    out["all_gather"] = torch.stack(gathered)
    at_root = counted.gather(stats, mine, 0, None)
    if at_root is not None:
        out["gather"] = torch.stack(at_root)
    out["broadcast"] = counted.broadcast(stats, mine.clone(), 1, None)
    assert all(tensor.device == device for tensor in out.values())
    return {name: tensor.cpu() for name, tensor in out.items()} | {"sent": torch.tensor(stats.bytes_sent)}


@pytest.mark.parametrize("device", DEVICES)
def test_collectives_and_point_to_point_deliver_on_the_device(device):
    rank0, rank1 = run_workers(_every_call, 2, device)
    mine = [torch.arange(6, dtype=torch.float32) + 10 * rank for rank in range(2)]
    torch.testing.assert_close(rank1["recv"], mine[0], rtol=0, atol=0)
    for result in (rank0, rank1):
        torch.testing.assert_close(result["all_reduce"], mine[0] + mine[1], rtol=0, atol=0)
        torch.testing.assert_close(result["all_gather"], torch.stack(mine), rtol=0, atol=0)
        torch.testing.assert_close(result["broadcast"], mine[1], rtol=0, atol=0)
    torch.testing.assert_close(rank0["gather"], torch.stack(mine), rtol=0, atol=0)
    assert "gather" not in rank1
    # The bytes booked do not depend on where the tensors live (24 bytes a message): rank 0 sends,
    # all-reduces and all-gathers; rank 1 all-reduces, all-gathers, gathers to rank 0 and broadcasts.
    assert int(rank0["sent"]) == 3 * 24
    assert int(rank1["sent"]) == 4 * 24
