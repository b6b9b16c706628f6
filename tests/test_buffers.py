"""Module buffers (BatchNorm statistics): DDP's broadcast, counted, or local steps' average at exchanges."""

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import NoneCompressor
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState

pytestmark = pytest.mark.multiprocess

#: The model's buffers: BatchNorm1d(32)'s running mean and variance (fp32) and its int64 batch counter.
FLOAT_BUFFER_BYTES = 2 * 32 * 4
INT_BUFFER_BYTES = 8
MOMENTUM = 0.1  # BatchNorm's default


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _train(rank: int, world: int, method: str, steps: int) -> dict:
    model = DDP(_bn_net())
    state = None
    if method == "hooked":
        state = CompressionHookState(NoneCompressor(), min_numel=0)
        state.register(model)
    elif method == "delay":
        state = CommunicationDelayState(NoneCompressor(), delay=3, min_numel=0)
        state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch_means, before_exchange, buffers, weights, evaluations = [], [], [], [], []
    bn = model.module[1]

    def record_batch_mean(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if module.training:
            batch_means.append(inputs[0].detach().mean(dim=0))

    handle = bn.register_forward_hook(record_batch_mean)
    for step in range(steps + 1):
        if step == steps:
            # Two evaluation forwards (DDP broadcasts before the first), then one more training step.
            model.eval()
            with torch.no_grad():
                evaluations = [model(_batch(rank, 99)[0]), model(_batch(rank, 98)[0])]
            model.train()
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        before_exchange.append(bn.running_mean.clone())
        if method == "delay":
            state.after_optimizer_step()
        buffers.append(bn.running_mean.clone())
        weights.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    handle.remove()
    return {
        "means": batch_means,
        "before": before_exchange,
        "buffers": buffers,
        "weights": weights,
        "evaluations": evaluations,
        "stats": state.stats.as_dict() if state is not None else {},
    }


def test_per_step_methods_send_rank_0s_buffers_once_per_step_counted_and_train_as_plain_ddp():
    """DDP broadcasts rank 0's buffers before forward passes; lgc sends them once per step instead, after
    the gradients, counted: every forward (evaluation included) sees the same buffers as under DDP.

    With 2 workers gloo's binomial tree has rank 0 send each dtype's flattened buffers once and rank 1
    nothing; the dense equivalent (plain DDP) holds the same broadcast.
    """
    steps = 4
    plain = run_workers(_train, 2, "plain", steps)
    hooked = run_workers(_train, 2, "hooked", steps)
    for a, b in zip(plain, hooked, strict=True):
        for x, y in zip(a["weights"], b["weights"], strict=True):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)
        for x, y in zip(a["evaluations"], b["evaluations"], strict=True):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-7)
    for step in range(steps + 1):
        # Rank 0's statistics as under DDP; rank 1 holds rank 0's after every step.
        torch.testing.assert_close(hooked[0]["buffers"][step], plain[0]["buffers"][step], rtol=1e-6, atol=1e-7)
        assert torch.equal(hooked[1]["buffers"][step], hooked[0]["buffers"][step])
    sent_steps = steps + 1
    rank0, rank1 = hooked[0]["stats"], hooked[1]["stats"]
    assert rank0["wire_buffer_bytes_sent"] == sent_steps * (FLOAT_BUFFER_BYTES + INT_BUFFER_BYTES)
    assert rank1["wire_buffer_bytes_sent"] == 0
    gradients = 4 * sum(p.numel() for p in _bn_net().parameters())  # a ring allreduce of 2 sends L per worker
    # none sends exactly what plain DDP does: the gradients and the buffers, ratio 1.
    assert (
        rank0["wire_bytes_sent"]
        == rank0["wire_dense_equivalent_bytes"]
        == sent_steps * gradients + rank0["wire_buffer_bytes_sent"]
    )
    assert rank1["wire_bytes_sent"] == rank1["wire_dense_equivalent_bytes"] == sent_steps * gradients


def test_local_steps_keep_each_workers_buffers_and_average_them_at_exchanges():
    """Delay 3: between exchanges every rank's running mean moves from its own value by its own batches
    (no broadcast of rank 0's); at an exchange both ranks take the mean of their buffers, sent as one
    counted allreduce of the floating-point buffers (the int64 counter is the same everywhere)."""
    steps = 6
    results = run_workers(_train, 2, "delay", steps)
    for rank, result in enumerate(results):
        for step in range(1, steps + 1):
            # BatchNorm's own update, from this rank's buffer after the previous step.
            expected = (1 - MOMENTUM) * result["buffers"][step - 1] + MOMENTUM * result["means"][step]
            torch.testing.assert_close(result["before"][step], expected, rtol=1e-5, atol=1e-7, msg=f"{rank} {step}")
    for step in (2, 5):  # the exchanges (local steps 3 and 6)
        mean = (results[0]["before"][step] + results[1]["before"][step]) / 2
        for result in results:
            torch.testing.assert_close(result["buffers"][step], mean, rtol=0, atol=1e-7)
        assert torch.equal(results[0]["buffers"][step], results[1]["buffers"][step])
    for result in results:
        # Two averages of the fp32 buffers; a ring allreduce of L bytes among 2 sends L.
        assert result["stats"]["wire_buffer_bytes_sent"] == 2 * FLOAT_BUFFER_BYTES
    # The dense equivalent: plain DDP's gradients and its broadcast of the buffers, once per step (7).
    gradients = 4 * sum(p.numel() for p in _bn_net().parameters())
    rank0, rank1 = results[0]["stats"], results[1]["stats"]
    assert rank0["wire_dense_equivalent_bytes"] == 7 * (gradients + FLOAT_BUFFER_BYTES + INT_BUFFER_BYTES)
    assert rank1["wire_dense_equivalent_bytes"] == 7 * gradients
