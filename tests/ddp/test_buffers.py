"""Module buffers (BatchNorm statistics): DDP's broadcast, counted, or local steps' average at exchanges."""

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from distributed import run_workers
from test_lgc import _LGC_AE
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc
from lgc import NoneCompressor
from lgc.ddp.buffers import AVERAGE_AT_EXCHANGE, BROADCAST, NO_SYNC
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.powersgd import PowerSGDHookState
from lgc.ddp.torch_hooks import TorchHookState
from lgc.learned.ps import LGCParameterServerState
from lgc.learned.rar import LGCRingAllreduceState
from lgc.learned.shared_index import SharedIndexState
from lgc.learned.state import LGCStage

#: The model's buffers: BatchNorm1d(32)'s running mean and variance (fp32) and its int64 batch counter.
FLOAT_BUFFER_BYTES = 2 * 32 * 4
INT_BUFFER_BYTES = 8
BUFFER_BYTES = FLOAT_BUFFER_BYTES + INT_BUFFER_BYTES
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
    elif method == "averaged":
        state = CompressionHookState(NoneCompressor(), min_numel=0, buffers="average")
        state.register(model)
    elif method == "delay":
        state = CommunicationDelayState(CompressionHookState(NoneCompressor(), min_numel=0, start_iter=0), delay=3)
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
        "mode": state.buffer_sync.mode if state is not None else None,
    }


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
def test_per_step_methods_can_average_the_workers_buffers_every_step_counted():
    """``buffers="average"``: after every step each rank holds the mean of the ranks' statistics (each
    moved by its own batch from the common value), not rank 0's; the floating-point buffers go in one
    counted allreduce, the int64 batch counter still from rank 0; the dense equivalent is plain DDP's."""
    steps = 4
    results = run_workers(_train, 2, "averaged", steps)
    previous = torch.zeros(32)
    for step in range(steps + 1):
        local = [(1 - MOMENTUM) * previous + MOMENTUM * result["means"][step] for result in results]
        for result in results:
            torch.testing.assert_close(result["buffers"][step], (local[0] + local[1]) / 2, rtol=1e-5, atol=1e-7)
        assert torch.equal(results[0]["buffers"][step], results[1]["buffers"][step])
        assert not torch.allclose(results[0]["buffers"][step], local[0])  # not rank 0's
        previous = results[0]["buffers"][step]
    sent_steps = steps + 1
    rank0, rank1 = results[0]["stats"], results[1]["stats"]
    assert results[0]["mode"] == results[1]["mode"] == "average"
    # A ring allreduce of L bytes among 2 sends L per worker; rank 0's tree broadcast of the counter.
    assert rank0["wire_buffer_bytes_sent"] == sent_steps * (FLOAT_BUFFER_BYTES + INT_BUFFER_BYTES)
    assert rank1["wire_buffer_bytes_sent"] == sent_steps * FLOAT_BUFFER_BYTES
    gradients = 4 * sum(p.numel() for p in _bn_net().parameters())
    assert rank0["wire_dense_equivalent_bytes"] == sent_steps * (gradients + FLOAT_BUFFER_BYTES + INT_BUFFER_BYTES)
    assert rank1["wire_dense_equivalent_bytes"] == sent_steps * gradients


def test_buffers_mode_is_checked_and_refused_with_a_delay(group):
    model = DDP(_bn_net())
    with pytest.raises(ValueError, match="buffers must be one of broadcast, average, got 'mean'"):
        lgc.compress(model, "topk", buffers="mean")
    with pytest.raises(ValueError, match="buffers='average' applies to every-step exchanges"):
        lgc.compress(model, "sbc", delay=4, buffers="average")
    with pytest.raises(ValueError, match="buffers must be one of"):
        CompressionHookState(NoneCompressor(), buffers="local")
    state = lgc.compress(model, "torch_fp16", buffers="average")
    assert state.buffer_sync.mode == "average"


@pytest.mark.multiprocess
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


# -- every per-step method: rank 0's buffers once per step, within the step's statistics -----------
def _per_step_state(method: str):
    lgc_common = dict(density=0.05, min_numel=100)  # both weight matrices compressed
    codec = dict(
        stages={"warmup_steps": 1, "ae_steps": 2},
        training={"updates_per_step": 1, "autoencoder": dict(_LGC_AE), "batch_size": 16},
    )
    if method == "powersgd":
        return PowerSGDHookState(start_powerSGD_iter=2, min_compression_rate=1.1)
    if method == "fp16":
        return TorchHookState("fp16")
    if method == "lgc_rar":
        return LGCRingAllreduceState(**lgc_common, **codec)
    if method == "lgc_ps":
        return LGCParameterServerState(innovation_density=0.01, **lgc_common, **codec)
    assert method == "shared_index"
    return SharedIndexState(chunk=32, stages={"warmup_steps": 1}, **lgc_common)


def _counter_sums(stages: dict) -> dict[str, float]:
    return {key: sum(vars(stage)[key] for stage in stages.values()) for key in vars(next(iter(stages.values())))}


def _train_per_step(rank: int, world: int, method: str, steps: int) -> dict:
    model = DDP(_bn_net(), bucket_cap_mb=0.001)  # several buckets
    state = _per_step_state(method)
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffers, stage_of_step, stage_checks = [], [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        buffers.append(torch.cat([b.float().reshape(-1) for b in model.module.buffers()]))
        if hasattr(state, "stage_stats"):
            # Read after the step, as a checkpoint or a log would: every byte of it is in a stage.
            stage_of_step.append(LGCStage(int(state.metrics()["lgc/stage"])).name.lower())
            stage_checks.append(
                {
                    "sums": _counter_sums(state.stage_stats),
                    "totals": vars(state.stats).copy(),
                    "buffer_bytes": {name: s.wire_buffer_bytes_sent for name, s in state.stage_stats.items()},
                }
            )
    return {
        "buffers": buffers,
        "stats": state.stats.as_dict(),
        "mode": state.buffer_sync.mode,
        "stages": stage_of_step,
        "stage_checks": stage_checks,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "method",
    [
        "lgc_rar",
        "powersgd",
        pytest.param("fp16", marks=pytest.mark.slow),
        pytest.param("lgc_ps", marks=pytest.mark.slow),
        pytest.param("shared_index", marks=pytest.mark.slow),
    ],
)
def test_every_per_step_method_sends_rank_0s_buffers_once_per_step_in_that_steps_stage(method):
    """PyTorch's hooks (PowerSGD, fp16) and LGC's hooks send rank 0's buffers once per step: rank 0 puts
    exactly ``steps`` x the buffers' bytes on the wire (gloo's binomial tree among 2), rank 1 nothing,
    and both hold the same buffers after every step. LGC books every byte of a step in that step's stage:
    read after any step, the stages sum to the totals and each stage holds its own steps' buffer bytes."""
    steps = 5  # LGC: one warm-up step, two codec-training steps, two compressed steps
    results = run_workers(_train_per_step, 2, method, steps)
    rank0, rank1 = results[0]["stats"], results[1]["stats"]
    assert rank0["wire_buffer_bytes_sent"] == steps * BUFFER_BYTES
    assert rank1["wire_buffer_bytes_sent"] == 0
    for a, b in zip(results[0]["buffers"], results[1]["buffers"], strict=True):
        assert torch.equal(a, b)
    assert results[0]["mode"] == results[1]["mode"] == BROADCAST
    if not method.startswith(("lgc", "shared")):
        return
    for rank, result in enumerate(results):
        stages = result["stages"]
        assert stages[0] == "warmup" and stages[-1] == "compressed"
        for step, check in enumerate(result["stage_checks"]):
            assert check["sums"] == check["totals"], f"rank {rank}, after step {step}"
            expected = BUFFER_BYTES if rank == 0 else 0
            for name in set(stages[: step + 1]):
                assert check["buffer_bytes"][name] == expected * stages[: step + 1].count(name), (rank, step, name)


# -- one rule for both paths: DDP's own (parameters_to_ignore, broadcast_buffers=False) ---------------
def _train_with_ddps_rule(rank: int, world: int) -> dict:
    gradients = 4 * sum(p.numel() for p in _bn_net().parameters())

    def run(model: DDP, register: Callable[[DDP, torch.optim.Optimizer], object], steps: int) -> dict:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = register(model, optimizer)
        for step in range(steps):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            (model(x) - y).square().mean().backward()
            optimizer.step()
        bn = model.module[1]
        seen = {}
        if state.takes_local_steps:  # the model a delay run evaluates: which buffers does it take?
            with state.global_model() as module:
                seen = {"global_mean": module[1].running_mean.clone(), "global_var": module[1].running_var.clone()}
        return {
            "mean": bn.running_mean.clone(),
            "var": bn.running_var.clone(),
            "stats": state.stats.as_dict(),
            "mode": state.buffer_sync.mode,
            **seen,
        }

    def delay(model: DDP, optimizer: torch.optim.Optimizer) -> object:
        return lgc.compress(model, NoneCompressor(), delay=2, min_numel=0, optimizer=optimizer)

    def hooked(model: DDP, optimizer: torch.optim.Optimizer) -> object:
        return lgc.compress(model, NoneCompressor(), min_numel=0)

    ignoring = _bn_net()
    DDP._set_params_and_buffers_to_ignore_for_model(ignoring, ["1.running_var"])
    return {
        "gradients": gradients,
        "hooked_off": run(DDP(_bn_net(), broadcast_buffers=False), hooked, 2),
        "delay_off": run(DDP(_bn_net(), broadcast_buffers=False), delay, 5),  # ends a local step after an exchange
        "delay_ignoring": run(DDP(ignoring), delay, 4),
    }


@pytest.mark.multiprocess
def test_both_paths_keep_in_step_only_the_buffers_ddp_would():
    """``broadcast_buffers=False``: every worker keeps its own buffers on both paths (nothing sent, nothing
    in the dense equivalent, ``buffer_sync`` ``none``); a buffer DDP ignores is neither averaged at
    exchanges nor booked, while the others are. The global model a delay run evaluates takes the
    averaged buffers and leaves the others the worker's own (not the values they had at registration)."""
    results = run_workers(_train_with_ddps_rule, 2)
    gradients = results[0]["gradients"]
    for kind, steps in (("hooked_off", 2), ("delay_off", 5)):
        for result in results:
            run = result[kind]
            assert run["mode"] == NO_SYNC, kind
            assert run["stats"]["wire_buffer_bytes_sent"] == 0, kind
            assert run["stats"]["wire_dense_equivalent_bytes"] == steps * gradients, kind
        # Each worker's statistics of its own batches, never averaged.
        assert not torch.equal(results[0][kind]["mean"], results[1][kind]["mean"]), kind
    for result in results:
        run = result["delay_off"]
        assert torch.equal(run["global_mean"], run["mean"]) and torch.equal(run["global_var"], run["var"])
    ignoring = [result["delay_ignoring"] for result in results]
    assert ignoring[0]["mode"] == AVERAGE_AT_EXCHANGE
    assert torch.equal(ignoring[0]["mean"], ignoring[1]["mean"])  # averaged at the exchange of step 4
    assert not torch.equal(ignoring[0]["var"], ignoring[1]["var"])  # ignored: each worker's own
    for run in ignoring:
        assert torch.equal(run["global_mean"], ignoring[0]["mean"])  # the average of the exchange at step 4
        assert torch.equal(run["global_var"], run["var"])
    mean_bytes, counter_bytes = FLOAT_BUFFER_BYTES // 2, INT_BUFFER_BYTES
    for rank, run in enumerate(ignoring):
        # Two averages of the running mean (fp32); the dense equivalent broadcasts mean and counter.
        assert run["stats"]["wire_buffer_bytes_sent"] == 2 * mean_bytes
        broadcast = mean_bytes + counter_bytes if rank == 0 else 0
        assert run["stats"]["wire_dense_equivalent_bytes"] == 4 * (gradients + broadcast)


# -- registration: no reference cycle through DDP's reducer, no user buffer hook stopped -------------
@pytest.mark.parametrize(
    "make_state",
    [
        lambda: CompressionHookState(NoneCompressor()),
        lambda: LGCRingAllreduceState(),
        lambda: PowerSGDHookState(),
        lambda: CommunicationDelayState(CompressionHookState(NoneCompressor(), start_iter=0), delay=2),
    ],
    ids=["compression_hook", "lgc", "powersgd", "delay"],
)
def test_a_registered_model_is_freed(group, make_state):
    """The hook DDP's reducer (C++) holds must not lead back to the model: the garbage collector cannot
    see a cycle through the reducer, and such a model (and its gradients, buckets, optimizer views)
    would live as long as the process. The wrapped module here holds the DDP model, as a
    LightningModule does through its trainer and strategy."""
    model = DDP(_bn_net())
    model.module.owner = [model]  # a list: not registered as a submodule, as Lightning's trainer is not
    make_state().register(model)
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None


def test_a_buffer_comm_hook_is_refused_not_silently_stopped(group):
    model = DDP(_bn_net())
    model._register_buffer_comm_hook(None, lambda state, buffers: None)
    with pytest.raises(ValueError, match="buffer communication hook"):
        CompressionHookState(NoneCompressor()).register(model)
