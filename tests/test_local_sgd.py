"""SBC's communication delay: local steps, then a compressed weight-update exchange."""

import pytest
import torch
from distributed import run_workers
from test_train import _load, compose_cfg
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import ErrorFeedback, NoneCompressor, TopKCompressor
from lgc.ddp.local_sgd import CommunicationDelayState, split_into_fragments

pytestmark = pytest.mark.multiprocess


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _train(rank: int, world: int, compressor, delay: int | None, steps: int, outer: dict | None = None) -> dict:
    model = DDP(_net())
    state = None
    if delay is not None:
        state = CommunicationDelayState(compressor, delay=delay, min_numel=0, **(outer or {}))
        state.register(model)
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
    return {"weights": weights, "sent": sent, "payload": state.stats.payload_bytes if state else 0}


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


@pytest.mark.parametrize(
    "outer,message",
    [
        ({"outer": "adam"}, "outer must be one of .*, got 'adam'"),
        ({"outer": "sgd", "outer_lr": 0.0}, "outer_lr must be a positive number, got 0.0"),
        ({"outer": "sgd", "outer_lr": -1}, "outer_lr must be a positive number, got -1"),
        ({"outer": "sgd", "outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\), got 1.0"),
        ({"outer_lr": 0.5}, "outer_lr=0.5 and outer_momentum=None are the outer optimizer's knobs: set outer='sgd'"),
    ],
)
def test_bad_outer_settings_are_named(outer, message):
    with pytest.raises(ValueError, match=message):
        CommunicationDelayState(NoneCompressor(), delay=4, **outer)


def test_outer_sgd_with_lr_one_and_no_momentum_is_periodic_averaging_bit_for_bit():
    """DiLoCo's outer step ``W -= 1 * (-mean dW)`` with no momentum is SBC's ``W += mean dW``."""
    compressor, delay, steps = ErrorFeedback(TopKCompressor(0.2)), 3, 9
    average = run_workers(_train, 2, compressor, delay, steps)
    outer = run_workers(_train, 2, compressor, delay, steps, {"outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0})
    for a, b in zip(average, outer, strict=True):
        for step, (wa, wb) in enumerate(zip(a["weights"], b["weights"], strict=True)):
            assert torch.equal(wa, wb), step


def test_outer_nesterov_sgd_follows_diloco_on_the_pseudo_gradient():
    """Against a one-process simulation of two workers: H local SGD steps each, then the averaged
    pseudo-gradient ``Delta = mean_i (W_sync - W_i)`` drives ``m = mu m + Delta``,
    ``W_sync -= lr (Delta + mu m)`` (Nesterov), and every worker restarts from ``W_sync``."""
    delay, steps, lr, mu = 2, 6, 0.7, 0.9
    outer = {"outer": "sgd", "outer_lr": lr, "outer_momentum": mu}
    results = run_workers(_train, 2, NoneCompressor(), delay, steps, outer)

    workers = [_net(), _net()]
    synced = [p.detach().clone() for p in workers[0].parameters()]
    momentum = [torch.zeros_like(p) for p in synced]
    for step in range(steps):
        for rank, net in enumerate(workers):
            x, y = _batch(rank, step)
            net.zero_grad()
            (net(x) - y).square().mean().backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
        if (step + 1) % delay == 0:
            with torch.no_grad():
                for i, sync in enumerate(synced):
                    local = [list(net.parameters())[i] for net in workers]
                    delta = sum((sync - p) / 2 for p in local)
                    momentum[i] = mu * momentum[i] + delta
                    sync -= lr * (delta + mu * momentum[i])
                for net in workers:
                    for p, sync in zip(net.parameters(), synced, strict=True):
                        p.copy_(sync)
        for rank, net in enumerate(workers):
            expected = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            torch.testing.assert_close(results[rank]["weights"][step], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "outer",
    [
        [],
        pytest.param(["comm.outer=sgd"], marks=pytest.mark.slow),
        pytest.param(["comm.outer=sgd", "comm.fragments=2"], marks=pytest.mark.slow),
    ],
    ids=["average", "diloco", "streaming"],
)
def test_resume_in_the_middle_of_a_delay_period_is_exact(tmp_path, outer):
    # 3 steps per epoch and an exchange every 2: the checkpoint after epoch 1 falls between exchanges,
    # where every rank holds its own weights and momenta (and, with DiLoCo, the outer momentum).
    common = ["trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "comm.delay=2", "scheduler.T_max=2"]
    common += outer
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
        if outer:
            buffers = [[s["momentum_buffer"] for s in r["outer_optimizer"]["state"].values()] for r in (a, b)]
            assert len(buffers[0]) == len(a["synced"]) and all(map(torch.equal, *buffers))
        else:
            assert a["outer_optimizer"] is None


# -- Streaming DiLoCo's fragments ------------------------------------------------------------------


def test_fragments_are_consecutive_balanced_and_never_empty():
    sizes = [("a", 10), ("b", 1000), ("c", 5), ("d", 1000), ("e", 3)]
    assert split_into_fragments(sizes, 1) == dict.fromkeys("abcde", 0)
    assert split_into_fragments(sizes, 2) == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}
    assert split_into_fragments(sizes, 5) == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4}
    # one huge parameter first: the small ones still fill the other fragments
    assert split_into_fragments([("a", 1000), ("b", 1), ("c", 1), ("d", 1)], 3) == {"a": 0, "b": 1, "c": 2, "d": 2}
    with pytest.raises(ValueError, match="fragments=6 is more than the model's 5 trainable parameters"):
        split_into_fragments(sizes, 6)


@pytest.mark.parametrize("fragments", [0, 5, 2.0, True])
def test_bad_fragment_counts_are_named(fragments):
    with pytest.raises(ValueError, match=f"fragments must be an integer from 1 to delay=4.*got {fragments!r}"):
        CommunicationDelayState(NoneCompressor(), delay=4, fragments=fragments)


def test_fragments_are_exchanged_on_staggered_steps_and_send_the_same_bytes():
    """H = 4, two fragments: the first layer's weight is exchanged at local steps 2, 6, the rest at 4, 8.

    Every fragment still waits H steps between exchanges, so over 8 steps the bytes equal those of
    exchanging everything every 4 steps; each exchange makes exactly its fragment agree across ranks.
    """
    delay, steps = 4, 8
    whole = run_workers(_train, 2, NoneCompressor(), delay, steps)
    streamed = run_workers(_train, 2, NoneCompressor(), delay, steps, {"fragments": 2})
    first = 16 * 32  # the first Linear's weight: fragment 0 (512 of the 676 entries)
    for result in streamed:
        sent = result["sent"]
        increments = [b - a for a, b in zip([0, *sent[:-1]], sent, strict=True)]
        assert [step for step, inc in enumerate(increments) if inc] == [1, 3, 5, 7]
        assert increments[1] == increments[5] and increments[3] == increments[7]
        assert increments[1] > increments[3]  # the 512-entry fragment against the 164-entry one
    # The same payload bytes; each exchange adds the step guard's agreement on its own parameters
    # (a flag and a bit per parameter: a few bytes, 4 exchanges against 2).
    assert streamed[0]["payload"] == whole[0]["payload"] > 0
    for result, exchanges in ((whole, 2), (streamed, 4)):
        assert 0 < result[0]["sent"][-1] - result[0]["payload"] <= 8 * exchanges
    a, b = streamed[0]["weights"], streamed[1]["weights"]
    for step in range(steps):
        assert torch.equal(a[step][:first], b[step][:first]) == (step in (1, 5)), step
        assert torch.equal(a[step][first:], b[step][first:]) == (step in (3, 7)), step


def test_too_many_fragments_are_refused_before_workers_start(tmp_path):
    from lgc.train import train

    cfg = compose_cfg(tmp_path, "comm.delay=1000", "comm.fragments=1000")
    with pytest.raises(ValueError, match="comm.fragments: fragments=1000 is more than the model's"):
        train(cfg)
    assert not (tmp_path / ".workers").exists()
