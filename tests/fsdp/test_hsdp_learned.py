"""LGC's family (LGC-RAR, LGC-PS, the shared-index codecs) across the replicas of a hybrid-sharded FSDP2 model."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from test_fsdp import _batch, _Branchy, _full, _net, refusals, run_steps, train_micro_batches
from test_fsdp import _train as train
from test_hsdp import _mesh, _shard
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import lgc
from lgc.learned.schedule import LGCStage

pytestmark = pytest.mark.multiprocess

#: Warm-up, codec training and compressed steps of every run here.
STAGES = {"warmup_steps": 2, "ae_steps": 3}
STEPS = 8
#: A codec small enough for this model (chunks of 32 values), trained a little every stage-2 step.
TRAINING = {
    "updates_per_step": 2,
    "batch_size": 16,
    "autoencoder": {"chunk": 32, "encoder_channels": [8, 8], "decoder_channels": [8, 8], "latent_channels": 2},
}
#: Every LGC method with knobs that make it code this small model through all its stages.
LEARNED = {
    "lgc_rar": {"density": 0.05, "stages": STAGES, "training": TRAINING},
    "lgc_rar_linear": {"density": 0.05, "stages": STAGES, "training": {"updates_per_step": 2, "batch_size": 16}},
    "lgc_rar_pca": {
        "density": 0.05,
        "stages": STAGES,
        "training": {**TRAINING, "pca_hidden": 8, "loss_weights": {"similarity": 0.0}},
    },
    "lgc_ps": {"density": 0.05, "innovation_density": 0.01, "stages": STAGES, "training": TRAINING},
    "shared_topk_int8": {"density": 0.05, "stages": {"warmup_steps": 2}},
    "shared_topk": {"density": 0.05, "stages": {"warmup_steps": 2}},
    "leader_scaled": {"density": 0.05, "stages": {"warmup_steps": 2}},
}
#: The shared-index codecs: no codec to train.
SHARED_INDEX = ("shared_topk_int8", "shared_topk", "leader_scaled")


#: Steps in each stage, per method (the shared-index codecs train no codec).
STAGE_STEPS = {
    method: {"warmup": 2, "compressed": 6}
    if method in SHARED_INDEX
    else {"warmup": 2, "autoencoder_training": 3, "compressed": 3}
    for method in LEARNED
}
#: The step guard's bytes a step beyond the DDP hook's: the carried and left-out flags of the six parameters, and
#: the refusal flag.
GUARD_EXTRA = 2 * 6 + 1


def _compress(model: torch.nn.Module, method: str, **mesh) -> lgc.HookState:
    return lgc.compress(model, method, measure_error=True, **mesh, **LEARNED[method])


def _outcome(model: torch.nn.Module, state, weights: dict) -> dict:
    return {
        "weights": weights,
        "residuals": {k: v.clone() for k, v in state.ef.residuals.items()},
        "stats": state.stats.as_dict(),
        "extras": state.summary_extras(),
        "iteration": state.iteration,
    }


def _ddp_and_hybrid(rank: int, world: int) -> dict[str, tuple[dict, dict]]:
    mesh = _mesh(2, 1)
    runs = {}
    for method in LEARNED:
        ddp = DistributedDataParallel(_net())
        ddp_state = _compress(ddp, method)
        train(ddp, rank, STEPS)
        hybrid = _shard(_net(), mesh["shard"])
        state = _compress(hybrid, method, replicate=mesh["replicate"])
        train(hybrid, rank, STEPS)
        ddp_weights = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
        runs[method] = (_outcome(ddp, ddp_state, ddp_weights), _outcome(hybrid, state, _full(hybrid)))
    return runs


@pytest.fixture(scope="module")
def one_shard_per_replica() -> list[dict[str, tuple[dict, dict]]]:
    return run_workers(_ddp_and_hybrid, 2)


@pytest.mark.parametrize("method", sorted(LEARNED))
def test_with_one_shard_per_replica_lgc_is_its_ddp_run(one_shard_per_replica, method):
    """A 2 x 1 mesh: each replica's shard is the whole gradient, so LGC across replicas is LGC over two DDP
    workers through warm-up, codec training and the compressed stage: weights, residuals, every stage's bytes
    and the delivered error, bit for bit."""
    for runs in one_shard_per_replica:
        ddp, hybrid = runs[method]
        assert hybrid["iteration"] == ddp["iteration"] == STEPS
        for name in ddp["weights"]:
            assert torch.equal(hybrid["weights"][name], ddp["weights"][name]), name
        assert ddp["residuals"].keys() == hybrid["residuals"].keys() and ddp["residuals"]
        for key in ddp["residuals"]:
            assert torch.equal(hybrid["residuals"][key], ddp["residuals"][key]), key
        stages = ddp["extras"]["lgc"]["stages"]
        assert stages["compressed"]["payload_bytes"] > 0
        # Every count but the hook's calls (one per FSDP2 parameter group here, one per DDP bucket there) and the
        # step guard's two flags more per parameter (carried, left out) and its refusal flag, each step.
        hybrid_stages = hybrid["extras"]["lgc"]["stages"]
        assert hybrid_stages.keys() == stages.keys()
        for stage, counts in stages.items():
            extra = GUARD_EXTRA * STAGE_STEPS[method].get(stage, 0)  # the codec's weights: sent once, no guard
            for key, value in counts.items():
                grown = key in ("bytes_sent", "bytes_received", "wire_bytes_sent", "wire_bytes_received")
                if key != "hook_calls":
                    assert hybrid_stages[stage][key] == value + (extra if grown else 0), (stage, key)
        assert hybrid["extras"]["lgc"]["true_error"] == ddp["extras"]["lgc"]["true_error"]
        for key in ("payload_bytes", "payload_dense_equivalent_bytes", "wire_dense_equivalent_bytes"):
            assert hybrid["stats"][key] == ddp["stats"][key], key
        assert hybrid["stats"]["wire_bytes_sent"] == ddp["stats"]["wire_bytes_sent"] + GUARD_EXTRA * STEPS


def _hybrid(rank: int, world: int, method: str, poison: int | None = None) -> dict:
    mesh = _mesh(2, 2)
    model = _shard(_net(), mesh["shard"])
    state = _compress(model, method, replicate=mesh["replicate"])
    train(model, rank, STEPS, poison=poison)
    out = _outcome(model, state, _full(model))
    out["codec"] = (
        {k: v.clone() for k, v in state.autoencoder.state_dict().items()} if state.training is not None else {}
    )
    out["stage"] = int(state.stage)
    return out


@pytest.mark.parametrize("method", ["lgc_rar", pytest.param("lgc_ps", marks=pytest.mark.slow)])
def test_on_a_2x2_mesh_each_shard_position_runs_lgc_across_the_replicas(method):
    """Each rank codes its shard across the replicas: residuals are shard-sized, the replicas end with the same
    weights, and the two shard positions train codecs of their own (on the first replica's rank, which trains
    them; LGC-RAR gives its codec to every worker, LGC-PS its encoder to the leader only)."""
    results = run_workers(_hybrid, 4, method)
    for rank, result in enumerate(results):
        rows = (19, 23) if rank % 2 == 0 else (18, 22)  # mesh ranks: replicate-major
        shapes = {k: tuple(v.shape) for k, v in result["residuals"].items()}
        assert shapes == {"0.weight": (rows[0] * 40,), "2.weight": (rows[1] * 37,)}
        assert result["iteration"] == STEPS and result["stage"] == LGCStage.COMPRESSED
        assert result["extras"]["lgc"]["stages"]["compressed"]["payload_bytes"] > 0
        same_position = results[rank % 2]
        for name, weight in result["weights"].items():
            assert torch.isfinite(weight).all(), name
            assert torch.equal(weight, results[0]["weights"][name]), name
        if method == "lgc_rar":
            for key, value in result["codec"].items():
                assert torch.equal(value, same_position["codec"][key]), key
    assert any(not torch.equal(results[0]["codec"][k], results[1]["codec"][k]) for k in results[0]["codec"])


def test_a_nan_on_one_rank_skips_the_step_on_every_shard_position():
    """The step guard decides over the world: a NaN in one rank's batch during the compressed stage skips the
    step on all four ranks, which keep the same step count and weights."""
    results = run_workers(_hybrid, 4, "shared_topk_int8", 5)
    for result in results:
        assert (result["stats"]["skipped_steps"], result["iteration"]) == (1, STEPS - 1)
        for name, weight in result["weights"].items():
            assert torch.isfinite(weight).all(), name
            assert torch.equal(weight, results[0]["weights"][name]), name


def _accumulated(rank: int, world: int) -> str:
    mesh = _mesh(2, 2)
    model = _shard(_net(), mesh["shard"])
    _compress(model, "shared_topk_int8", replicate=mesh["replicate"])
    for step in range(2):  # no zero_grad between the backward passes: FSDP2 adds the second into the first
        x, y = _batch(rank, step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 0:
            loss.backward()
            continue
        with pytest.raises(RuntimeError) as info:
            loss.backward()
        return str(info.value)
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_accumulating_gradients_across_backward_passes_is_refused_before_anything_is_sent():
    for message in run_workers(_accumulated, 4):
        assert "zero_grad" in message and "accumulation" in message


def _mixed_unused_accumulated(rank: int, world: int) -> dict:
    mesh = _mesh(2, 2)
    net = _Branchy()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in (net.body, net):
        fully_shard(block, mesh=mesh["shard"], mp_policy=policy)
    before = net.unused.weight.to_local().clone()
    state = _compress(net, "lgc_rar", replicate=mesh["replicate"])
    train_micro_batches(net, rank, STEPS)
    return {
        "weights": _full(net),
        "unused_kept": torch.equal(before, net.unused.weight.to_local()),
        "iteration": state.iteration,
        "stage": int(state.stage),
        "residuals": sorted(state.ef.residuals),
    }


@pytest.mark.slow
def test_bf16_parameters_reduced_in_fp32_an_unused_branch_and_micro_batches_run_through_every_stage():
    """bf16 parameters reduced in fp32 (FSDP2 leaves the gradient as the reduced shard), two micro-batches per step
    (set_requires_gradient_sync: one reduction per step), a branch no rank uses (left out, as stock FSDP2 leaves
    it): LGC-RAR reaches its compressed stage, the replicas agree, and the unused branch never moves."""
    results = run_workers(_mixed_unused_accumulated, 4)
    for result in results:
        assert result["iteration"] == STEPS and result["stage"] == LGCStage.COMPRESSED
        assert result["unused_kept"] and result["residuals"] == ["body.weight"]
        for name, weight in result["weights"].items():
            assert torch.isfinite(weight).all(), name
            assert torch.equal(weight, results[0]["weights"][name]), name


def _used_on_one_replica(rank: int, world: int, unused_params: bool) -> dict:
    """A branch only the first replica's ranks take: FSDP2 leaves it out of the second's reductions unless
    ``set_reduce_scatter_unused_params``."""
    mesh = _mesh(2, 2)
    net = _Branchy()
    for block in (net.body, net):
        fully_shard(block, mesh=mesh["shard"])
    net.set_reduce_scatter_unused_params(unused_params)
    state = _compress(net, "shared_topk_int8", replicate=mesh["replicate"])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x, use_unused=rank < 2), y).backward()
            opt.step()
    except RuntimeError as err:
        return {"error": str(err)}
    return {"weights": _full(net), "iteration": state.iteration}


@pytest.mark.slow
def test_a_parameter_used_on_some_replicas_only_is_refused_naming_the_fix_and_runs_with_it():
    """Without set_reduce_scatter_unused_params the replicas carry different parameters: the step guard's flags
    (one per parameter each group could carry, the same length on every rank) say so, and every rank refuses,
    naming the fix, before anything is sent. With it every rank carries the branch and LGC runs."""
    for result in run_workers(_used_on_one_replica, 4, False):
        assert "set_reduce_scatter_unused_params(True)" in result["error"] and "unused.weight" in result["error"]
    results = run_workers(_used_on_one_replica, 4, True)
    for result in results:
        assert result["iteration"] == STEPS
        for name, weight in result["weights"].items():
            assert torch.equal(weight, results[0]["weights"][name]), name


def _refused(rank: int, world: int) -> list[str]:
    mesh = _mesh(2, 2)

    def sharded(**kwargs) -> torch.nn.Module:
        net = _net()
        for block in (net[0], net[2], net):
            fully_shard(block, mesh=mesh["shard"], **kwargs)
        return net

    bf16_reduce = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    hooked = _shard(_net(), mesh["shard"])
    hooked[0].weight.register_post_accumulate_grad_hook(lambda param: None)
    attempts = [
        lambda: lgc.compress(_shard(_net(), mesh["shard"]), "lgc_rar"),
        lambda: lgc.compress(hooked, "lgc_rar", replicate=mesh["replicate"]),
        lambda: lgc.compress(sharded(mp_policy=bf16_reduce), "lgc_rar", replicate=mesh["replicate"]),
        lambda: lgc.compress(
            sharded(offload_policy=CPUOffloadPolicy(pin_memory=False)), "lgc_rar", replicate=mesh["replicate"]
        ),
    ]
    return refusals(attempts)


def test_lgc_without_replicas_or_with_a_reduced_gradient_it_cannot_write_is_refused_naming_the_fix():
    for messages in run_workers(_refused, 4):
        assert "replicate=mesh['replicate']" in messages[0]
        assert "0.weight: a post-accumulate-grad hook" in messages[1]
        assert "torch.bfloat16" in messages[2] and "reduce_dtype" in messages[2]
        assert "CPUOffloadPolicy" in messages[3]


def _resumed(rank: int, world: int, path: str) -> tuple[dict, dict]:
    """Four steps (warm-up and two of codec training), a DCP save, four more; then a fresh model loads the save
    and takes the four again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lgc.fsdp import PerRankState

    def build():
        mesh = _mesh(2, 2)
        model = _shard(_net(), mesh["shard"])
        return (
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            _compress(model, "lgc_rar", replicate=mesh["replicate"]),
        )

    def run(model, opt, steps):
        run_steps(model, opt, rank, steps)

    def outcome(model, state):
        codec = {k: v.clone() for k, v in state.autoencoder.state_dict().items()}
        return _full(model), {k: v.clone() for k, v in state.ef.residuals.items()}, codec, state.summary_extras()

    model, opt, state = build()
    run(model, opt, range(4))
    weights, optim = get_state_dict(model, opt)
    dcp.save({"model": weights, "optim": optim, "lgc": PerRankState(state)}, checkpoint_id=path)
    run(model, opt, range(4, STEPS))
    straight = outcome(model, state)

    model, opt, state = build()
    weights, optim = get_state_dict(model, opt)
    saved = {"model": weights, "optim": optim, "lgc": PerRankState(state)}
    dcp.load(saved, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    assert state.iteration == 4
    run(model, opt, range(4, STEPS))
    return straight, outcome(model, state)


def test_a_distributed_checkpoint_in_the_codec_training_resumes_bit_for_bit(tmp_path):
    """Saved mid-way through stage 2: every rank's codec, its trainer, its samples and residuals come back from its
    PerRankState (each shard position's are its own), and the resumed run is the straight one's, bit for bit."""
    for straight, resumed in run_workers(_resumed, 4, str(tmp_path / "ckpt")):
        for part, again in zip(straight[:3], resumed[:3], strict=True):
            assert part.keys() == again.keys() and part
            for key in part:
                assert torch.equal(part[key], again[key]), key
        assert straight[3] == resumed[3]
