"""Hybrid sharding (HSDP) with lgc: FSDP2's reduce-scatter inside a replica, lgc's compressed all-reduce across them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from test_fsdp import FOLLOWERS, STEPS, _full, _net, _train, ddp_and_sharded, rank_grads, refusals
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import lgc


def _mesh(replicas: int, shards: int):
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _shard(net: torch.nn.Module, mesh) -> torch.nn.Module:
    for block in (net[0], net[2], net):
        fully_shard(block, mesh=mesh)
    return net


def _native_and_none(rank: int, world: int) -> tuple[dict, dict, dict]:
    mesh = _mesh(2, 2)
    native = _shard(_net(), mesh)  # FSDP2's own HSDP: a 2-D mesh
    _train(native, rank)
    hybrid = _shard(_net(), mesh["shard"])
    state = lgc.compress(hybrid, "none", replicate=mesh["replicate"])
    _train(hybrid, rank)
    return _full(native), _full(hybrid), state.stats.as_dict()


def test_none_is_fsdp2s_own_hsdp_bit_for_bit_on_a_2x2_mesh():
    for native, hybrid, stats in run_workers(_native_and_none, 4):
        for name in native:
            assert torch.equal(native[name], hybrid[name]), name
        assert stats["hook_calls"] == 3 * STEPS, "one all-reduce per parameter group per step"
        assert stats["wire_bytes_sent"] == stats["wire_dense_equivalent_bytes"] > 0


#: Every per-step method FSDP2 runs; hybrid sharding runs them all.
HYBRID = tuple(FOLLOWERS)
#: The methods that tile a tensor by its shape: under hybrid sharding they tile each rank's shard.
TILED = ("chunked_topk", "sparseloco", "demo")


def _ddp_and_hybrid(rank: int, world: int) -> dict[str, tuple]:
    mesh = _mesh(2, 1)
    return ddp_and_sharded(rank, lambda net: _shard(net, mesh["shard"]), HYBRID, replicate=mesh["replicate"])


@pytest.fixture(scope="module")
def one_shard_per_replica() -> list[dict[str, tuple]]:
    return run_workers(_ddp_and_hybrid, 2)


@pytest.mark.parametrize("method", sorted(HYBRID))
def test_with_one_shard_per_replica_every_method_is_its_ddp_run(one_shard_per_replica, method):
    """A 2 x 1 mesh: each replica's shard is the whole gradient, so the all-reduce across replicas is the DDP
    hook's exchange over two workers: weights, residuals and payload bytes bit for bit."""
    for runs in one_shard_per_replica:
        ddp, hybrid, (ddp_res, hybrid_res), (ddp_stats, hybrid_stats) = runs[method]
        for name in ddp:
            assert torch.equal(hybrid[name], ddp[name]), name
        assert ddp_res.keys() == hybrid_res.keys()
        for key in ddp_res:
            assert torch.equal(hybrid_res[key], ddp_res[key]), key
        assert hybrid_stats["payload_bytes"] == ddp_stats["payload_bytes"] > 0


DENSITY = 0.05
LR = 0.1


def _reference_topk(replicas: int, shards: int) -> dict[str, torch.Tensor]:
    """HSDP with top-k and error feedback, transcribed in one process: each replica averages its ranks' gradients
    (FSDP2's reduce-scatter), every rank keeps the dim-0 chunk it owns, adds its residual to its share (the
    chunk over the number of replicas), sends the ceil(density * n) entries of largest magnitude and keeps the
    rest; the replicas' sum is the gradient. Parameters under 1,024 elements are averaged dense; the first step
    (start_iter) is dense."""
    net = _net()
    residuals: dict[tuple[str, int, int], torch.Tensor] = {}
    for step in range(STEPS):
        grads = rank_grads(net, replicas * shards, step)
        with torch.no_grad():
            for name, p in net.named_parameters():
                replica_means = [
                    sum(grads[r * shards + s][name] for s in range(shards)) / shards for r in range(replicas)
                ]
                if step == 0 or p.numel() < 1024:
                    p -= LR * sum(replica_means) / replicas
                    continue
                rows = math.ceil(p.shape[0] / shards)
                total = torch.zeros_like(p)
                for r, mean in enumerate(replica_means):
                    for s, chunk in enumerate(mean.split(rows)):
                        v = residuals.get((name, r, s), torch.zeros(chunk.numel())) + chunk.flatten() / replicas
                        keep = torch.topk(v.abs(), max(1, math.ceil(DENSITY * v.numel()))).indices
                        sent = torch.zeros_like(v)
                        sent[keep] = v[keep]
                        residuals[(name, r, s)] = v - sent
                        total[s * rows : s * rows + chunk.shape[0]] += sent.view_as(chunk)
                p -= LR * total
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def _hybrid_topk(rank: int, world: int) -> tuple[dict, dict[str, torch.Size], dict]:
    mesh = _mesh(2, 2)
    model = _shard(_net(), mesh["shard"])
    state = lgc.compress(model, "topk", density=DENSITY, replicate=mesh["replicate"])
    _train(model, rank)
    shapes = {k: v.shape for k, v in state.compressor.residual_store().items()}
    return _full(model), shapes, state.stats.as_dict()


def test_on_a_2x2_mesh_each_rank_codes_its_shard_across_replicas_as_the_transcription_does():
    """Top-k with error feedback over an odd number of rows (the last shard padded): the weights are the
    transcription's, within float summation order; residuals are the size of the rank's shard."""
    expected = _reference_topk(2, 2)
    results = run_workers(_hybrid_topk, 4)
    for rank, (weights, shapes, stats) in enumerate(results):
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=2e-6, msg=name)
        shard = rank % 2  # mesh ranks: replicate-major
        assert shapes == {
            "0.weight": torch.Size([(19 if shard == 0 else 18) * 40]),
            "2.weight": torch.Size([(23 if shard == 0 else 22) * 37]),
        }
        assert stats["compression_ratio"] > 1.5


#: The quantizers on a 2 x 2 mesh, by name: method, knobs and how far the weights may stray from the transcription.
#: The replica's mean reaches a rank through FSDP2's reduce-scatter, in another summation order than the
#: transcription's; bf16, which keeps 8 bits, then rounds a few codes one step apart (observed: 6e-6).
HYBRID_QUANTIZERS = {
    "signsgd": ("signsgd", {}, 2e-6),
    "qsgd": ("qsgd", {}, 2e-6),
    "fp4": ("fp4", {}, 2e-6),
    "bf16": ("fp16", {"dtype": "bfloat16"}, 2e-5),
}


@pytest.fixture(scope="module")
def hybrid_quantized() -> list[dict[str, tuple]]:
    return run_workers(_hybrid_quantized, 4)


def _hybrid_quantized(rank: int, world: int) -> dict[str, tuple]:
    """Each quantizer on a 2 x 2 mesh, and its transcription: every rank's compressor copied before the first step;
    each replica's mean gradient (FSDP2's reduce-scatter inside it), cut into the shards' dim-0 chunks; shard ``s``
    of replica ``r`` coded by rank ``(r, s)``'s copy (its rank in the replicate group ``r``) over the number of
    replicas, and the replicas' codes of a shard decoded and summed; parameters under min_numel averaged dense; the
    first step (start_iter) dense."""
    import copy

    replicas = shards = 2
    mesh = _mesh(replicas, shards)
    runs = {}
    for label, (method, knobs, _) in HYBRID_QUANTIZERS.items():
        model = _shard(_net(), mesh["shard"])
        state = lgc.compress(model, method, replicate=mesh["replicate"], **knobs)
        copies = [copy.deepcopy(state.compressor) for _ in range(world)]
        _train(model, rank)
        net = _net()
        for step in range(STEPS):
            grads = rank_grads(net, world, step)
            with torch.no_grad():
                for name, p in net.named_parameters():
                    means = [sum(grads[r * shards + s][name] for s in range(shards)) / shards for r in range(replicas)]
                    if step == 0 or p.numel() < state.min_numel:
                        p -= LR * sum(means) / replicas
                        continue
                    rows = math.ceil(p.shape[0] / shards)
                    total = torch.zeros_like(p)
                    for r, mean in enumerate(means):
                        for s, chunk in enumerate(mean.split(rows)):
                            compressor = copies[r * shards + s]
                            compressor.set_rank(r)
                            compressor.set_world_size(replicas)
                            compressor.begin_step(step)
                            payload = compressor.compress((chunk / replicas).flatten().contiguous(), name)
                            total[s * rows : s * rows + chunk.shape[0]] += compressor.decompress(payload).view_as(chunk)
                    p -= LR * total
        runs[label] = (_full(model), {n: p.detach().clone() for n, p in net.named_parameters()}, state.stats.as_dict())
    return runs


@pytest.mark.parametrize("label", HYBRID_QUANTIZERS)
def test_on_a_2x2_mesh_a_quantizer_codes_each_ranks_shard_as_the_transcription_does(hybrid_quantized, label):
    """Each rank codes its own shard of its replica's sum (its own scale, rounding and residual) for the all-reduce
    across replicas: the weights are the transcription's, within float summation order, and fewer bytes cross the
    replicas than FSDP2's dense all-reduce sends."""
    tolerance = HYBRID_QUANTIZERS[label][2]
    for weights, expected, stats in (result[label] for result in hybrid_quantized):
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=tolerance, msg=(label, name))
        assert stats["wire_bytes_sent"] < stats["wire_dense_equivalent_bytes"], label


def _poisoned(rank: int, world: int, method: str = "topk") -> tuple[int, int, dict]:
    mesh = _mesh(2, 2)
    model = _shard(_net(), mesh["shard"])
    knobs = {"density": DENSITY} if method == "topk" else {}
    state = lgc.compress(model, method, replicate=mesh["replicate"], **knobs)
    _train(model, rank, poison=2)
    return state.stats.skipped_steps, state.iteration, _full(model)


def test_a_nan_on_one_rank_skips_the_step_on_every_rank():
    """The step guard decides over the world: the NaN reaches one shard of one replica, yet all four ranks skip
    the step, so their step counts (DGC's schedules, the compressors' seeds) stay together."""
    results = run_workers(_poisoned, 4)
    assert [(skipped, iteration) for skipped, iteration, _ in results] == [(1, STEPS - 1)] * 4
    for name, weight in results[0][2].items():
        assert torch.isfinite(weight).all(), name
        for other in results[1:]:
            assert torch.equal(other[2][name], weight), name


def test_none_counts_a_non_finite_step_on_every_rank_as_the_ddp_hook_counts_it():
    """``none`` passes the NaN through as FSDP2's own HSDP does (the optimizer's to skip), and every rank counts
    the step as skipped once, as the DDP hook counts a stateless method's non-finite step."""
    results = run_workers(_poisoned, 4, "none")
    assert [skipped for skipped, _, _ in results] == [1] * 4


def _refusals(rank: int, world: int) -> list[str]:
    mesh = _mesh(2, 2)
    attempts = [
        lambda: lgc.compress(_shard(_net(), mesh), "topk"),  # FSDP2's own HSDP
        lambda: lgc.compress(_shard(_net(), mesh["shard"]), "topk", replicate=mesh),  # 2-D replicate
        lambda: lgc.compress(DistributedDataParallel(_net()), "topk", replicate=mesh["replicate"]),
        lambda: lgc.compress(_shard(_net(), mesh["shard"]), "topk", replicate=dist.new_group([0, 1, 2, 3])),
    ]
    return refusals(attempts)


def test_native_hsdp_and_mismatched_meshes_are_refused_naming_the_fix():
    for messages in run_workers(_refusals, 4):
        assert "mesh=mesh['shard']" in messages[0] and "replicate=mesh['replicate']" in messages[0]
        assert "one dimension" in messages[1]
        assert "FSDP2 models only" in messages[2]
        assert "do not make the world's 4 ranks" in messages[3]


def _tiled(rank: int, world: int) -> dict[str, tuple]:
    mesh = _mesh(2, 2)
    out = {}
    for method in TILED:
        model = _shard(_net(), mesh["shard"])
        state = lgc.compress(model, method, replicate=mesh["replicate"], **FOLLOWERS[method])
        _train(model, rank)
        shapes = {k: tuple(v.shape) for k, v in state.compressor.residual_store().items()}
        out[method] = (_full(model), shapes, state.stats.as_dict())
    return out


def test_on_a_2x2_mesh_a_tiled_compressor_tiles_each_ranks_shard():
    """Chunked top-k, SparseLoCo's selection and DeMo code each rank's shard as a matrix of its rows: residuals are
    shard-sized, the payloads smaller than dense, and both replicas end with the same weights."""
    results = run_workers(_tiled, 4)
    for rank, result in enumerate(results):
        rows = (19, 23) if rank % 2 == 0 else (18, 22)
        for method in TILED:
            weights, shapes, stats = result[method]
            assert shapes["0.weight"] == (rows[0] * 40,) and shapes["2.weight"] == (rows[1] * 37,), method
            assert stats["payload_bytes"] < stats["payload_dense_equivalent_bytes"], method
            for name, weight in weights.items():
                assert torch.isfinite(weight).all()
                assert torch.equal(weight, results[rank % 2][method][0][name]), (method, name)
