"""Overlap: every bucket encoded and sent as it arrives, the step committed after the ranks agree.

The hook's ``overlap`` must change when the collectives start and nothing else: gradients,
residuals and the step guard's policy (a skipped step, unused parameters) bitwise as without it.
"""

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import ErrorFeedback, FP16Compressor, SBCCompressor, SignSGDCompressor, TopKCompressor
from lgc.compressors import (
    DGCCompressor,
    QSGDCompressor,
    QuantizedValues,
    RandomBlockCompressor,
    RedSyncCompressor,
    TernGradCompressor,
)
from lgc.compressors import dgc as dgc_module
from lgc.ddp import CompressionHookState
from lgc.ddp import hook as hook_module
from lgc.ddp.collectives import record_collectives
from lgc.methods import build_hook_state

COMPRESSORS = {
    "topk": lambda: TopKCompressor(density=0.1),
    "topk_fp16_values": lambda: TopKCompressor(density=0.1, value_dtype="float16"),
    "sbc": lambda: SBCCompressor(density=0.1),
    "signsgd": SignSGDCompressor,
    "quantized_topk": lambda: QuantizedValues(TopKCompressor(density=0.1), bits=2),
    # Their counts of draws are state of their own: error feedback holds them back with its residuals.
    "qsgd": lambda: QSGDCompressor(bucket_size=64),
    "terngrad": lambda: TernGradCompressor(bucket_size=64),
    # Each key's threshold, tried first the next step.
    "redsync": lambda: RedSyncCompressor(density=0.1, reuse_threshold=True),
    "redsync_search": lambda: RedSyncCompressor(
        density=0.1, reuse_threshold=True, method="threshold_binary_search", epsilon=1e-3
    ),
}


def _same_payload(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))


@pytest.mark.parametrize("decay", [1.0, 0.95])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_compress_pending_then_commit_is_compress(name, dtype, decay):
    """Held steps give compress()'s payloads and residuals bitwise; a key left out, or a dropped step, moves nothing."""
    held, plain = ErrorFeedback(COMPRESSORS[name](), decay), ErrorFeedback(COMPRESSORS[name](), decay)
    assert held.speculates
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        grads = {key: torch.randn(300, generator=generator).to(dtype) for key in ("a", "b")}
        before = {key: r.clone() for key, r in held.residuals.items()}
        payloads = {key: held.compress_pending(g, key) for key, g in grads.items()}
        assert {key: torch.equal(r, before[key]) for key, r in held.residuals.items()} == dict.fromkeys(before, True)
        if step == 3:  # the ranks agreed to skip the step
            held.commit(frozenset())
            assert all(torch.equal(held.residuals[key], before[key]) for key in before)
            continue
        kept = {"a"} if step == 4 else {"a", "b"}  # b unused on every rank at step 4
        held.commit(frozenset(kept))
        for key in sorted(kept):
            assert _same_payload(payloads[key], plain.compress(grads[key], key)), (step, key)
        assert set(held.residuals) == set(plain.residuals)
        for key in held.residuals:
            assert torch.equal(held.residuals[key], plain.residuals[key]), (step, key)
        assert held.compressor.state_dict() == plain.compressor.state_dict(), step  # QSGD's counts of draws


@pytest.mark.parametrize("make", [QSGDCompressor, TernGradCompressor], ids=["qsgd", "terngrad"])
def test_a_stochastic_quantizer_holds_its_draws_back_until_the_commit(make):
    held, plain = make(bucket_size=64), make(bucket_size=64)
    generator = torch.Generator().manual_seed(1)
    for step in range(5):
        g = torch.randn(300, generator=generator)
        payload = held.compress_pending(g, "w")
        assert held.draws == plain.draws, step  # nothing moves before the commit
        if step == 2:
            held.drop()  # the ranks agreed to skip the step
            continue
        held.commit(frozenset({"w"}))
        assert _same_payload(payload, plain.compress(g, "w")), step
        assert held.draws == plain.draws == {"w": step if step > 2 else step + 1}


def test_redsync_held_step_that_removes_its_threshold_removes_it_at_the_commit():
    # Binary search drops a key's threshold when none passes k to 2k - 1 entries (here: all ties);
    # the next step must then search afresh on both paths, not try the stale threshold first.
    def make():
        return ErrorFeedback(RedSyncCompressor(density=0.01, method="threshold_binary_search", reuse_threshold=True))

    held, plain = make(), make()
    generator = torch.Generator().manual_seed(0)
    skewed = torch.randn(10_000, generator=generator) * 0.01
    skewed[:120], skewed[120:190], skewed[5_000] = 4.0, 2.568, 20.0
    for step, target in enumerate([torch.randn(10_000, generator=generator), torch.ones(10_000), skewed]):
        g = target - plain.residuals.get("w", torch.zeros(10_000))
        expected = plain.compress(g.clone(), "w")
        payload = held.compress_pending(g.clone(), "w")
        held.commit(frozenset({"w"}))
        assert held.compressor.thresholds == plain.compressor.thresholds, step
        assert _same_payload(payload, expected), step
        assert torch.equal(held.residuals["w"], plain.residuals["w"]), step
    assert "w" in plain.compressor.thresholds  # the last step found one again


def test_random_block_holds_its_step_back_until_the_commit_and_a_drop_restores_it():
    held, plain = (
        ErrorFeedback(RandomBlockCompressor(0.1, shared=False)),
        ErrorFeedback(RandomBlockCompressor(0.1, shared=False)),
    )
    generator = torch.Generator().manual_seed(2)
    for step in range(1, 6):
        grads = {key: torch.randn(500, generator=generator) for key in ("a", "b")}
        before = held.compressor.state_dict()
        held.compressor.begin_step(step)  # as the hook does at the step's first bucket
        payloads = {key: held.compress_pending(g, key) for key, g in grads.items()}
        if step == 2:  # skipped: as if never begun
            held.drop()
            assert held.compressor.state_dict() == before
            continue
        used = {"a"} if step == 4 else {"a", "b"}
        held.commit(frozenset(used))
        plain.compressor.begin_step(step)
        for key in sorted(used):
            assert _same_payload(payloads[key], plain.compress(grads[key], key)), (step, key)
        assert held.compressor.state_dict() == plain.compressor.state_dict(), step
        assert all(torch.equal(held.residuals[key], plain.residuals[key]) for key in plain.residuals)


def test_a_dropped_first_step_leaves_no_residual():
    ef, plain = ErrorFeedback(TopKCompressor(density=0.25)), ErrorFeedback(TopKCompressor(density=0.25))
    g = torch.arange(8.0)
    ef.compress_pending(g, "w")
    ef.commit(frozenset())
    assert ef.residuals == {}
    ef.compress_pending(g, "w")
    ef.commit(frozenset({"w"}))
    plain.compress(g, "w")
    assert torch.equal(ef.residuals["w"], plain.residuals["w"])


DGC_VARIANTS = {
    "momentum": {},
    "nesterov": {"nesterov": True},
    "clipped": {"clip_norm": 0.5},  # the accumulation's scale != 1 branch
    "no_momentum": {"momentum": 0.0},
    "no_masking": {"momentum_masking": False},
}


@pytest.mark.parametrize("variant", sorted(DGC_VARIANTS))
def test_dgc_compress_pending_then_commit_is_compress(variant):
    """DGC held back: compress()'s payloads, momenta, accumulators and draws bitwise; a dropped step moves nothing."""
    knobs = {"density": 0.01, "warmup_densities": [], "exact_below_numel": 1000, **DGC_VARIANTS[variant]}
    held, plain = DGCCompressor(**knobs), DGCCompressor(**knobs)
    assert held.speculates
    generator = torch.Generator().manual_seed(0)
    sizes = {"big": 50_000, "small": 300, "late": 40_000}  # sampled threshold, exact top-k, first seen at step 2
    for step in range(7):
        grads = {key: torch.randn(n, generator=generator) for key, n in sizes.items() if key != "late" or step >= 2}
        before = held.state_dict()
        payloads = {key: held.compress_pending(g, key) for key, g in grads.items()}
        _assert_same_state(held.state_dict(), before)
        if step in (2, 4):  # the ranks agreed to skip the step (at 2, the step "late" would have begun with)
            held.drop()
            _assert_same_state(held.state_dict(), before)
            continue
        kept = set(grads) - {"small"} if step == 5 else set(grads)  # "small" unused on every rank at step 5
        held.commit(frozenset(kept))
        for key in sorted(kept):
            assert _same_payload(payloads[key], plain.compress(grads[key], key)), (step, key)
        _assert_same_state(held.state_dict(), plain.state_dict())
    assert held.draws == plain.draws == {"big": 5, "small": 4, "late": 3}


def test_a_dropped_dgc_step_undoes_the_warm_up_epoch_it_began_and_its_retry_begins_it_again():
    dgc = DGCCompressor(density=0.01, steps_per_epoch=2)  # the paper's warm-up: 25 %, then 6.25 %, ...
    dgc.begin_step(1)
    dgc.compress_pending(torch.ones(100), "w")
    dgc.commit(frozenset({"w"}))
    assert (dgc.epoch, dgc.current_density) == (0, 0.25)
    dgc.begin_step(2)  # the hook begins the step at its first bucket, before the ranks agree
    assert (dgc.epoch, dgc.current_density) == (1, 0.0625)
    dgc.compress_pending(torch.ones(100), "w")
    dgc.drop()  # skipped: as if never begun
    assert (dgc.epoch, dgc.current_density) == (0, 0.25) and dgc.draws == {"w": 1}
    dgc.begin_step(2)
    dgc.compress_pending(torch.ones(100), "w")
    dgc.commit(frozenset())  # begun and agreed, but no parameter used: the epoch stands
    assert (dgc.epoch, dgc.current_density) == (1, 0.0625)
    dgc.drop()  # nothing held, nothing begun since: nothing to undo
    assert (dgc.epoch, dgc.current_density) == (1, 0.0625)


def test_a_dropped_dgc_step_creates_no_state_even_where_one_store_lacks_the_key():
    # A checkpoint written with momentum 0 has accumulators and no momenta: a held step resumed
    # with momentum must not create the momentum before its commit.
    without = DGCCompressor(density=0.1, momentum=0.0, warmup_densities=[])
    without.compress(torch.arange(8.0), "w")
    dgc = DGCCompressor(density=0.1, momentum=0.9, warmup_densities=[])
    dgc.load_state_dict(without.state_dict())
    before = dgc.state_dict()
    dgc.compress_pending(torch.ones(8), "w")
    dgc.commit(frozenset())
    _assert_same_state(dgc.state_dict(), before)
    assert dgc.momenta == {}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a["draws"] == b["draws"] and a["epoch"] == b["epoch"]
    for store in ("momenta", "velocities", "dense_momenta", "decay_momenta"):
        assert a[store].keys() == b[store].keys(), store
        assert all(torch.equal(a[store][key], b[store][key]) for key in a[store]), store


def test_dgc_draws_its_sample_start_per_parameter_and_step():
    # The hook's overlap encodes a parameter before knowing whether it is used: one key's draws
    # must not depend on the others'. They differ between steps and keys, and repeat on resume.
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    alone, mixed = DGCCompressor(density=0.01, warmup_densities=[]), DGCCompressor(density=0.01, warmup_densities=[])
    starts, paths = set(), set()
    for step in range(4):
        mixed.compress(x * 0.5, f"other{step}")
        assert _same_payload(alone.compress(x, "w"), mixed.compress(x, "w")), step
        paths.add(mixed.last_selection.path)
    assert "threshold" in paths  # steps whose kept entries depend on the sampled start
    for step in range(20):
        draw = dgc_module._SampleStart(0, "w", step).randrange(1_000_003)
        assert draw == dgc_module._SampleStart(0, "w", step).randrange(1_000_003)
        starts.add(draw)
    assert len(starts) == 20 and dgc_module._SampleStart(0, "v", 0).value != dgc_module._SampleStart(0, "w", 0).value


@pytest.mark.parametrize(
    "compressor",
    [
        # Shared offsets sum the workers' payloads: an unused parameter would change the sum.
        lambda: ErrorFeedback(RandomBlockCompressor(density=0.1)),
        lambda: RandomBlockCompressor(density=0.1),
    ],
    ids=["random_block_error_feedback", "random_block"],
)
def test_overlap_is_refused_for_a_compressor_with_state_of_its_own(compressor):
    with pytest.raises(ValueError, match="overlap=True needs"):
        CompressionHookState(compressor(), overlap=True)


@pytest.mark.parametrize(
    ("node", "comm", "match"),
    [
        ({"_target_": "lgc.compressors.RandomBlockCompressor"}, {"overlap": True}, "overlap=True needs"),
        ({"_target_": "lgc.compressors.TopKCompressor", "density": 0.1}, {"overlap": True, "delay": 2}, "delay"),
    ],
)
def test_overlap_is_refused_where_it_cannot_apply(node, comm, match):
    with pytest.raises(ValueError, match=match):
        build_hook_state(node, comm, error_feedback=node["_target_"].endswith("TopKCompressor"))


def test_overlap_is_refused_for_summed_payloads():
    # A ring allreduce's sum depends on what else is in the flat: unused parameters would change it.
    with pytest.raises(ValueError, match="with payloads that are gathered"):
        CompressionHookState(ErrorFeedback(FP16Compressor()), overlap=True)


def test_the_stateless_and_the_speculating_accept_overlap():
    assert CompressionHookState(ErrorFeedback(TopKCompressor(0.1)), overlap=True).overlap
    assert CompressionHookState(FP16Compressor(), overlap=True).overlap
    node = {"_target_": "lgc.compressors.TopKCompressor", "density": 0.1}
    state = build_hook_state(node, {"overlap": True}, error_feedback=True)
    assert state.overlap and isinstance(state.compressor, ErrorFeedback)
    assert CompressionHookState(DGCCompressor(density=0.1), overlap=True).overlap
    node = {"_target_": "lgc.compressors.DGCCompressor", "density": 0.1, "warmup_densities": []}
    assert build_hook_state(node, {"overlap": True}, error_feedback=False).overlap


# -- in DDP ------------------------------------------------------------------------------------------

# Three workers: a ring allreduce then sums in an order that depends on the tensor's layout, so
# the dense parameters must travel in the same flat as without overlap (two workers cannot tell).
WORLD = 3
STEPS = 8
NAN_PARAM_STEP = 3  # rank 1's first layer (DDP's last bucket) gets a NaN; the earlier buckets are finite
NAN_LOSS_STEP = 6  # rank 2's whole gradient is NaN
UNUSED_STEPS = (2, 5)  # the aux branch is unused on every rank
ONE_RANK_UNUSED_STEP = 4  # the aux branch is unused on rank 0 only


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 48))
        self.head = nn.Linear(48, 5)
        self.aux = nn.Linear(48, 5)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        hidden = self.body(x)
        return self.head(hidden) + self.aux(hidden) if use_aux else self.head(hidden)


def _error_feedback(name: str) -> ErrorFeedback | DGCCompressor | QSGDCompressor:
    if name == "qsgd_alone":  # as the method's config runs it: no error feedback, its draws its only state
        return QSGDCompressor(bucket_size=64)
    if name.startswith("dgc"):  # DGC keeps its own residual (the accumulator), momentum and weight decay's momentum
        nesterov = name == "dgc_nesterov"
        # Three steps per epoch: the step skipped for rank 1's NaN is hook step 3, the first of an epoch.
        return DGCCompressor(density=0.1, weight_decay=1e-3, nesterov=nesterov, steps_per_epoch=3, exact_below_numel=0)
    base, _, decay = name.partition(":decay=")
    if base == "random_block_unshared":  # its step from the hook's begin_step (test_random_block_holds_...)
        return ErrorFeedback(RandomBlockCompressor(density=0.1, shared=False), float(decay or 1.0))
    return ErrorFeedback(COMPRESSORS[base](), float(decay or 1.0))


def _train(rank: int, world: int, name: str, overlap: bool, pack: bool | None = None) -> dict:
    events: list[str] = []
    hook = hook_module.compression_hook

    def logged_hook(state, bucket):
        events.append(f"bucket{bucket.index()}")
        return hook(state, bucket)

    gather, reduce = dist.all_gather, dist.all_reduce

    def logged_gather(*args, **kwargs):
        events.append("all_gather")
        return gather(*args, **kwargs)

    def logged_reduce(*args, **kwargs):
        events.append("all_reduce")
        return reduce(*args, **kwargs)

    hook_module.compression_hook = logged_hook
    dist.all_gather, dist.all_reduce = logged_gather, logged_reduce
    try:
        net = _Net()
        model = DDP(net, bucket_cap_mb=0.01, find_unused_parameters=True)
        state = CompressionHookState(_error_feedback(name), min_numel=100, overlap=overlap, pack=pack)
        state.register(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, step_events, traces, epochs = [], [], [], []
        for step in range(STEPS):
            events.clear()
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
            use_aux = step not in UNUSED_STEPS and not (step == ONE_RANK_UNUSED_STEP and rank == 0)
            loss = model(x, use_aux).square().mean()
            if step == NAN_LOSS_STEP and rank == world - 1:
                loss = loss * float("nan")
            poison = None
            if step == NAN_PARAM_STEP and rank == 1:
                poison = net.body[0].weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), torch.nan))
            with record_collectives() as trace:
                loss.backward()
            if poison is not None:
                poison.remove()
            assert state.compressor._pending == {}, f"step {step}: held state left after the step"
            traces.append((trace.last_bucket_from, len(trace)))
            grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
            epochs.append(getattr(state.compressor, "epoch", None))  # DGC's warm-up epoch, skipped steps included
            step_events.append(list(events))
            if all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in net.parameters()):
                optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    finally:
        hook_module.compression_hook = hook
        dist.all_gather, dist.all_reduce = gather, reduce
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in net.parameters()],
        "state": state.state_dict()["compressor"],
        "skipped": state.stats.skipped_steps,
        "nonfinite": [any(g is not None and not bool(torch.isfinite(g).all()) for g in step) for step in grads],
        "events": step_events,
        "epochs": epochs,
        "traces": traces,
        "payload_bytes": state.stats.payload_bytes,
        "buckets": len(state.layouts),
    }


#: One of each way to hold a step back: error feedback over a stateless compressor (fixed and
#: variable-size payloads), DGC's momenta, QSGD's draws, RedSync's thresholds, random-block's step.
#: The default suite runs error feedback over top-k; the others run with -m slow.
HELD_STEP_NAMES = ["topk", "sbc", "dgc", "qsgd_alone", "redsync", "random_block_unshared"]
HELD_STEP_NAMES += ["signsgd", "quantized_topk", "topk_fp16_values:decay=0.95", "dgc_nesterov", "terngrad"]
HELD_STEP_CASES = [name if name == "topk" else pytest.param(name, marks=pytest.mark.slow) for name in HELD_STEP_NAMES]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", HELD_STEP_CASES)
def test_overlap_changes_when_collectives_start_and_nothing_else(name):
    held = run_workers(_train, WORLD, name, False, False)  # bucket by bucket, as overlap sends
    ahead = run_workers(_train, WORLD, name, True)
    for rank in range(WORLD):
        a, b = held[rank], ahead[rank]
        assert a["skipped"] == b["skipped"] == 2
        expected = [step in (NAN_PARAM_STEP, NAN_LOSS_STEP) for step in range(STEPS)]
        assert a["nonfinite"] == b["nonfinite"] == expected
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
            for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
                assert torch.equal(x.nan_to_num(), y.nan_to_num()), (rank, step, i)
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        if name.startswith("dgc"):  # with its warm-up (steps_per_epoch), sampled thresholds and weight decay
            _assert_same_state(a["state"], b["state"])
            residuals_a = a["state"]["velocities"]
            # Compressed steps 1-7 less the two skipped: hook steps 1-5; aux used in 3 of them. The
            # epoch after every step: the first skip would have opened epoch 1, the retry opens it.
            assert a["epochs"] == b["epochs"] == [0, 0, 0, 0, 1, 1, 1, 1]
            assert a["state"]["draws"]["aux.weight"] == 3
        elif name == "qsgd_alone":
            # Steps 1-7 less the two skipped; aux used in 3 of them.
            assert a["state"] == b["state"] and a["state"]["draws"]["aux.weight"] == 3
            residuals_a = a["state"]["draws"]
        else:
            assert a["state"]["compressor"] == b["state"]["compressor"]
            residuals_a, residuals_b = a["state"]["residuals"], b["state"]["residuals"]
            assert set(residuals_a) == set(residuals_b)
            assert all(torch.equal(residuals_a[key], residuals_b[key]) for key in residuals_a)
        assert "aux.weight" in residuals_a
        # A compressed step (past the dense first one): with overlap the first bucket's payloads
        # leave before DDP hands over the next bucket; without it, after the last bucket.
        steady = b["events"][1]
        buckets = [i for i, event in enumerate(steady) if event.startswith("bucket")]
        assert len(buckets) >= 3, steady
        assert "all_gather" in steady[buckets[0] : buckets[1]], steady
        # The cost model's mark: what is issued at the last bucket (lgc.bench.cost_model).
        first_at_last, total = b["traces"][1]
        assert 0 < first_at_last < total
        assert a["traces"][1][0] == 0  # held: everything waits for the last bucket
        held_events = a["events"][1]
        first_gather = held_events.index("all_gather")
        assert first_gather > max(i for i, event in enumerate(held_events) if event.startswith("bucket")), held_events
