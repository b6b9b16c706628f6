"""SBC's communication delay: local steps, then a compressed weight-update exchange."""

import pytest
import torch
from distributed import run_workers
from test_train import _load, compose_cfg
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import ErrorFeedback, NoneCompressor, TopKCompressor
from lgc.ddp.local_sgd import CommunicationDelayState, register_communication_delay

pytestmark = pytest.mark.multiprocess


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _train(rank: int, world: int, compressor, delay: int | None, steps: int) -> dict:
    model = DDP(_net())
    state = None if delay is None else register_communication_delay(model, compressor, delay=delay, min_numel=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights, sent = [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        if state is not None:
            state.after_optimizer_step()
        weights.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        sent.append(state.stats.bytes_sent if state else 0)
    return {"weights": weights, "sent": sent}


@pytest.mark.parametrize("compressor", [NoneCompressor(), ErrorFeedback(TopKCompressor(1.0))], ids=repr)
def test_delay_one_with_lossless_compression_equals_plain_sgd(compressor):
    steps = 5
    dense = run_workers(_train, 2, None, None, steps)
    delayed = run_workers(_train, 2, compressor, 1, steps)
    for rank in range(2):
        for a, b in zip(dense[rank]["weights"], delayed[rank]["weights"], strict=True):
            torch.testing.assert_close(b, a)


def test_workers_communicate_only_every_delay_steps_and_agree_after_each_exchange():
    delay, steps = 3, 9
    results = run_workers(_train, 2, ErrorFeedback(TopKCompressor(0.1)), delay, steps)
    for result in results:
        sent = result["sent"]
        increments = [b - a for a, b in zip([0, *sent[:-1]], sent, strict=True)]
        assert [step for step, inc in enumerate(increments) if inc] == [2, 5, 8]
    for step in range(steps):
        same = torch.equal(results[0]["weights"][step], results[1]["weights"][step])
        assert same == ((step + 1) % delay == 0), step


def test_delay_rejects_non_positive_steps():
    with pytest.raises(ValueError, match="delay must be a positive number of local steps, got 0"):
        CommunicationDelayState(NoneCompressor(), delay=0)


def test_resume_in_the_middle_of_a_delay_period_is_exact(tmp_path):
    # 3 steps per epoch and an exchange every 2: the checkpoint after epoch 1 falls between exchanges,
    # where every rank holds its own weights and momenta.
    common = ["trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "comm.delay=2", "scheduler.T_max=2"]
    from lgc.train import train

    train(compose_cfg(tmp_path / "straight", "trainer.max_epochs=2", *common))
    train(compose_cfg(tmp_path / "first", "trainer.max_epochs=1", *common))
    stopped = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train(compose_cfg(tmp_path / "resumed", "trainer.max_epochs=2", f"ckpt_path={stopped}", *common))

    first = _load(stopped)["callbacks"]["CompressionCallback"]["per_rank"]
    assert first[0]["local_steps"] == 3
    assert any(not torch.equal(first[0]["local_weights"][k], first[1]["local_weights"][k]) for k in first[0]["synced"])
    straight = _load(tmp_path / "straight" / "checkpoints" / "last.ckpt")["callbacks"]["CompressionCallback"]
    resumed = _load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["callbacks"]["CompressionCallback"]
    for a, b in zip(straight["per_rank"], resumed["per_rank"], strict=True):
        assert a["local_steps"] == b["local_steps"] == 6
        for key in ("synced", "local_weights"):
            for name, tensor in a[key].items():
                assert torch.equal(tensor, b[key][name]), (key, name)
