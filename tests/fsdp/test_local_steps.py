"""The local-step family under hybrid sharding: the replicas step apart, each sharded over its ranks, and exchange."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_workers
from test_fsdp import _batch, _full, _net, assert_resumed_exactly, refusals
from test_hsdp import _mesh, _shard
from torch.nn.parallel import DistributedDataParallel

import lgc

STEPS = 8
LR = 0.1

#: The local-step methods, each with knobs that compress this small model (``lgc.compress`` keywords).
LOCAL = {
    "diloco": ("none", {"delay": 2, "outer": "sgd"}),
    "sparseloco": ("sparseloco", {"delay": 2, "outer": "sgd"}),
    "sbc": ("sbc", {"delay": 2, "density": 0.05}),
    # Three strided fragments of this model cut its weight matrices into pieces.
    "streaming": ("fp4", {"delay": 3, "outer": "sgd", "fragments": 3}),
    "streaming_overlap": ("fp4", {"delay": 4, "outer": "sgd", "fragments": 2, "overlap_steps": 1}),
}


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer, batches, steps: range, poison: int | None = None):
    for step in steps:
        x, y = batches(step)
        if poison == step:
            x[0, 0] = float("nan")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _residuals(state: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.compressor.residual_store().items()}


def _ddp_run(method: str, knobs: dict[str, Any], batches) -> tuple[DistributedDataParallel, Any]:
    """``method`` with local steps under DDP for :data:`STEPS` steps (an exchange in flight applied)."""
    ddp = DistributedDataParallel(_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    state = lgc.compress(ddp, method, optimizer=opt, **knobs)
    _run(ddp, opt, batches, range(STEPS))
    state.flush()
    return ddp, state


def _ddp_and_one_shard(rank: int, world: int) -> dict[str, tuple]:
    mesh = _mesh(2, 1)
    runs = {}
    for label, (method, knobs) in LOCAL.items():
        ddp, ddp_state = _ddp_run(method, knobs, lambda step: _batch(rank, step))
        hybrid = _shard(_net(), mesh["shard"])
        opt = torch.optim.SGD(hybrid.parameters(), lr=LR)
        state = lgc.compress(hybrid, method, optimizer=opt, replicate=mesh["replicate"], **knobs)
        _run(hybrid, opt, lambda step: _batch(rank, step), range(STEPS))
        state.flush()
        with ddp_state.global_model() as synced:
            ddp_synced = {name: p.detach().clone() for name, p in synced.named_parameters()}
        with state.global_model() as synced:
            hybrid_synced = _full(synced)
        ddp_weights = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
        runs[label] = (
            (ddp_weights, ddp_synced, _residuals(ddp_state), ddp_state.stats.as_dict()),
            (_full(hybrid), hybrid_synced, _residuals(state), state.stats.as_dict()),
        )
    return runs


@pytest.fixture(scope="module")
def one_shard_per_replica() -> list[dict[str, tuple]]:
    return run_workers(_ddp_and_one_shard, 2)


@pytest.mark.parametrize("label", sorted(LOCAL))
def test_with_one_shard_per_replica_local_steps_are_the_ddp_run(one_shard_per_replica, label):
    """A 2 x 1 mesh: each replica is one rank holding whole parameters, so the exchange across replicas is the DDP
    run's: local and synchronized weights, residuals and bytes bit for bit, for SBC's delay, DiLoCo, SparseLoCo and
    Streaming DiLoCo (fragments, and an exchange overlapping a local step)."""
    for runs in one_shard_per_replica:
        (ddp, ddp_synced, ddp_res, ddp_stats), (hybrid, hybrid_synced, res, stats) = runs[label]
        for name in ddp:
            assert torch.equal(hybrid[name], ddp[name]), name
            assert torch.equal(hybrid_synced[name], ddp_synced[name]), name
        assert res.keys() == ddp_res.keys()
        assert bool(res) == (label in ("sbc", "sparseloco")), "error feedback's residuals, where the method keeps them"
        for key in res:
            assert torch.equal(res[key], ddp_res[key]), key
        assert stats["payload_bytes"] == ddp_stats["payload_bytes"] > 0
        assert stats["wire_dense_equivalent_bytes"] == ddp_stats["wire_dense_equivalent_bytes"]


#: Elementwise exchanges, which sum the same values however a parameter is cut: on a 2 x 2 mesh the run is the
#: DDP run of two workers that each take their replica's batches, within float summation order.
ELEMENTWISE = {
    "diloco": ("none", {"delay": 2, "outer": "sgd"}),
    # Three contiguous fragments of this model cut a weight matrix inside a shard's rows.
    "streaming": ("none", {"delay": 3, "outer": "sgd", "fragments": 3, "fragment_split": "contiguous"}),
}


def _replica_batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ranks' batches of a replica, as one worker's."""
    parts = [_batch(2 * replica + shard, step) for shard in range(2)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _ddp_by_replica(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for label, (method, knobs) in ELEMENTWISE.items():
        ddp, state = _ddp_run(method, knobs, lambda step: _replica_batch(rank, step))
        out[label] = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
        out[label + "/keys"] = [s.key for s in state.slices]
    return out


def _hybrid_2x2(rank: int, world: int) -> dict[str, Any]:
    mesh = _mesh(2, 2)
    out = {}
    for label, (method, knobs) in ELEMENTWISE.items():
        model = _shard(_net(), mesh["shard"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        state = lgc.compress(model, method, optimizer=opt, replicate=mesh["replicate"], **knobs)
        _run(model, opt, lambda step: _batch(rank, step), range(STEPS))
        out[label] = _full(model)
        out[label + "/slices"] = [(s.key, s.numel) for s in state.slices]
    return out


def test_on_a_2x2_mesh_an_elementwise_exchange_is_the_ddp_run_of_the_replicas():
    """DiLoCo and Streaming DiLoCo (a fragment's piece cut inside a shard) on 2 replicas x 2 shards equal DDP over
    2 workers that each take their replica's two batches: the shards exchange their parts of every piece, every
    rank the same fragment on the same step."""
    expected = run_workers(_ddp_by_replica, 2)
    results = run_workers(_hybrid_2x2, 4)
    for rank, result in enumerate(results):
        replica = rank // 2
        for label in ELEMENTWISE:
            for name, weight in expected[replica][label].items():
                torch.testing.assert_close(result[label][name], weight, rtol=0, atol=2e-6, msg=f"{label} {name}")
    keys = expected[0]["streaming/keys"]
    assert any("[" in key for key in keys), "a parameter is cut between the fragments"
    for result in results:
        assert [key for key, _ in result["streaming/slices"]] == keys, "every rank holds the same pieces"
    assert any(numel == 0 for key, numel in results[1]["streaming/slices"]), "a piece outside the second shard's rows"


def _sharded_sbc(rank: int, world: int, poisons: list[int | None]) -> list[tuple]:
    """SBC every 2 steps on a 2 x 2 mesh, once per entry of ``poisons`` (the step rank 1's batch is NaN at, or none)."""
    mesh = _mesh(2, 2)
    runs = []
    for poison in poisons:
        model = _shard(_net(), mesh["shard"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        state = lgc.compress(model, "sbc", optimizer=opt, replicate=mesh["replicate"], delay=2, density=0.05)
        _run(model, opt, lambda step: _batch(rank, step), range(STEPS), poison=poison if rank == 1 else None)
        shapes = {k: tuple(v.shape) for k, v in state.compressor.residual_store().items()}
        runs.append((_full(model), shapes, state.stats.skipped_steps, state.local_steps))
    return runs


@pytest.fixture(scope="module")
def sharded_sbc() -> dict[str, list[tuple]]:
    """Every rank's SBC runs: ``"clean"`` and ``"nan"`` (a NaN on rank 1 right before the last exchange)."""
    per_rank = run_workers(_sharded_sbc, 4, [None, STEPS - 1])
    return {name: [runs[i] for runs in per_rank] for i, name in enumerate(("clean", "nan"))}


def test_on_a_2x2_mesh_each_shard_is_coded_on_its_own_and_the_replicas_agree_after_an_exchange(sharded_sbc):
    """SBC every 2 steps: residuals are the size of a rank's shard, and after the last exchange both replicas hold
    the same weights."""
    results = sharded_sbc["clean"]
    for rank, (weights, shapes, skipped, steps) in enumerate(results):
        shard = rank % 2
        assert shapes == {
            "0.weight": ((19 if shard == 0 else 18) * 40,),
            "2.weight": ((23 if shard == 0 else 22) * 37,),
        }
        assert (skipped, steps) == (0, STEPS)
        for name, weight in weights.items():
            assert torch.equal(weight, results[0][0][name]), name


def test_a_nan_on_one_rank_skips_that_exchange_on_every_rank(sharded_sbc):
    """A NaN in one rank's batch right before an exchange: its replica's update is not finite, every rank of both
    replicas skips the exchange and returns to the synchronized weights, which stay finite and equal."""
    results = sharded_sbc["nan"]
    for weights, _, skipped, steps in results:
        assert (skipped, steps) == (1, STEPS)
        for name, weight in weights.items():
            assert torch.isfinite(weight).all(), name
            assert torch.equal(weight, results[0][0][name]), name


def _evaluated(rank: int, world: int) -> tuple[dict, dict, torch.Tensor]:
    """DiLoCo on 2 x 2 for 6 steps (an exchange every 4), with and without an evaluation inside ``global_model()``
    after step 3; returns both runs' weights and the evaluation's output."""
    mesh = _mesh(2, 2)
    runs, output = [], torch.empty(0)
    for evaluate in (False, True):
        model = _shard(_net(), mesh["shard"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        state = lgc.compress(model, "none", optimizer=opt, replicate=mesh["replicate"], delay=4, outer="sgd")
        _run(model, opt, lambda step: _batch(rank, step), range(3))
        if evaluate:
            with torch.no_grad(), state.global_model() as synced:
                output = synced(_batch(0, 99)[0])
        _run(model, opt, lambda step: _batch(rank, step), range(3, 6))
        runs.append(_full(model))
    return runs[0], runs[1], output


def test_an_evaluation_of_the_synchronized_model_leaves_training_as_it_was():
    """FSDP2 keeps its root gathered after a forward pass without backward; the evaluation inside
    ``global_model()`` sees the synchronized weights (the same on every rank), and training afterwards takes the
    local ones again: the run equals the one without an evaluation, bit for bit."""
    results = run_workers(_evaluated, 4)
    for plain, evaluated, output in results:
        for name in plain:
            assert torch.equal(plain[name], evaluated[name]), name
        assert torch.equal(output, results[0][2])


def _resumed(rank: int, world: int, path: str) -> tuple[dict, dict]:
    """Three steps of DiLoCo with top-k (an exchange every 2), a DCP save mid-interval, three more; then a fresh
    model loads the save and takes the three again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lgc.fsdp import PerRankState

    def build():
        mesh = _mesh(2, 2)
        model = _shard(_net(), mesh["shard"])
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        state = lgc.compress(
            model, "topk", optimizer=opt, replicate=mesh["replicate"], delay=2, outer="sgd", density=0.05
        )
        return model, opt, state

    def batches(step):
        return _batch(rank, step)

    model, opt, state = build()
    _run(model, opt, batches, range(3))
    weights, optim = get_state_dict(model, opt)
    dcp.save(
        {"model": weights, "optim": optim, "lgc": PerRankState(state), "inner": PerRankState(opt)}, checkpoint_id=path
    )
    _run(model, opt, batches, range(3, 6))
    straight = (_full(model), _residuals(state))

    model, opt, state = build()
    weights, optim = get_state_dict(model, opt)
    saved = {"model": weights, "optim": optim}
    dcp.load(saved, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    # After the model: DCP keeps one replica's weights, and each rank's own come back with its lgc state.
    dcp.load({"lgc": PerRankState(state), "inner": PerRankState(opt)}, checkpoint_id=path)
    assert state.local_steps == 3
    _run(model, opt, batches, range(3, 6))
    return straight, (_full(model), _residuals(state))


@pytest.mark.slow
def test_a_distributed_checkpoint_mid_interval_resumes_bit_for_bit(tmp_path):
    """Saved between exchanges, when the replicas' weights differ (DCP's model state keeps one replica's): every
    rank's own local weights, synchronized shards, residuals and outer momentum come back from its PerRankState."""
    assert_resumed_exactly(run_workers(_resumed, 4, str(tmp_path / "ckpt")))


def _refusals(rank: int, world: int) -> list[str]:
    mesh = _mesh(2, 2)
    attempts = [
        lambda: lgc.compress(_shard(_net(), mesh["shard"]), "none", delay=2, outer="sgd"),
        lambda: lgc.compress(_shard(_net(), mesh["shard"]), "lgc_rar", delay=2, replicate=mesh["replicate"]),
        lambda: lgc.compress(_shard(_net(), mesh["shard"]), "sbc", delay=2, replicate=mesh["replicate"], pack=True),
    ]
    return refusals(attempts)


def test_local_steps_without_replicas_or_with_a_whole_parameter_codec_are_refused():
    for messages in run_workers(_refusals, 4):
        assert "needs hybrid sharding" in messages[0] and "replicate=mesh['replicate']" in messages[0]
        assert "LGCHookState" in messages[1] or "codes whole parameters" in messages[1]
        assert "pack" in messages[2]
