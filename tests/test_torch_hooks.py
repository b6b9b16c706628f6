"""PyTorch's own hooks, wrapped with lgc statistics, on two gloo workers with several buckets."""

import pytest
import torch
from distributed import run_workers
from test_hook import _count_collective_bytes, _net
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc.ddp.torch_hooks import PowerSGDHookState, TorchHookState

pytestmark = pytest.mark.multiprocess


def _run_wrapped(rank: int, world: int, state, steps: int) -> dict:
    reference = DDP(_net(), bucket_cap_mb=0.01)
    hooked = DDP(_net(), bucket_cap_mb=0.01)
    state.register(hooked)
    log: list[tuple[str, int]] = []
    _count_collective_bytes(log)
    grads = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        for model in (reference, hooked):
            model.zero_grad()
            model(x).square().mean().backward()
        grads.append(([p.grad.clone() for p in reference.parameters()], [p.grad.clone() for p in hooked.parameters()]))
    return {
        "grads": grads,
        "stats": state.stats.as_dict(),
        "numel": sum(p.numel() for p in hooked.parameters()),
        "counted_sent": sum(n for kind, n in log if kind == "sent"),
        "state": state.state_dict(),
    }


def test_torch_fp16_hook_is_wrapped_with_exact_byte_counts():
    steps = 3
    for result in run_workers(_run_wrapped, 2, TorchHookState("fp16"), steps):
        for reference, hooked in result["grads"]:
            for a, b in zip(reference, hooked, strict=True):
                torch.testing.assert_close(b, a, rtol=2e-3, atol=1e-4)
        stats = result["stats"]
        assert stats["bytes_sent"] == result["counted_sent"] == steps * 2 * result["numel"]
        assert stats["dense_equivalent_bytes"] == steps * 4 * result["numel"]
        assert stats["compression_ratio"] == pytest.approx(2.0)


@pytest.mark.parametrize("batched", [False, True])
def test_powersgd_runs_on_gloo_with_several_buckets_and_counts_its_bytes(batched):
    steps = 5
    state = PowerSGDHookState(
        matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.1, batched=batched
    )
    results = run_workers(_run_wrapped, 2, state, steps)
    for result in results:
        stats = result["stats"]
        assert stats["hook_calls"] >= steps
        assert stats["bytes_sent"] == result["counted_sent"]
        # Dense for the first two steps, then strictly fewer bytes than dense.
        assert stats["bytes_sent"] < stats["dense_equivalent_bytes"]
        assert result["state"]["powersgd"]["iter"] == steps
    # Both ranks end with the same averaged (compressed) gradients.
    for (_, g0), (_, g1) in zip(results[0]["grads"], results[1]["grads"], strict=True):
        for a, b in zip(g0, g1, strict=True):
            torch.testing.assert_close(a, b)
