"""Two-process gloo DDP tests of the compression hook against plain DDP."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import (
    DeMoCompressor,
    DGCCompressor,
    ErrorFeedback,
    FP16Compressor,
    NoneCompressor,
    SBCCompressor,
    TopKCompressor,
    register_compression_hook,
)
from lgc.compressors.base import Compressor
from lgc.compressors.topk import num_selected

pytestmark = pytest.mark.multiprocess

MIN_NUMEL = 100


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 5)
    )


def _count_collective_bytes(log: list[tuple[str, int]]) -> None:
    """Wrap the collectives the hook calls so every tensor passed to them is recorded."""
    world = dist.get_world_size()
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def counting_all_reduce(tensor, *args, **kwargs):
        log.append(("sent", tensor.numel() * tensor.element_size()))
        log.append(("received", tensor.numel() * tensor.element_size()))
        return all_reduce(tensor, *args, **kwargs)

    def counting_all_gather(outputs, tensor, *args, **kwargs):
        log.append(("sent", tensor.numel() * tensor.element_size()))
        log.append(
            ("received", sum(o.numel() * o.element_size() for o in outputs) - tensor.numel() * tensor.element_size())
        )
        assert len(outputs) == world
        return all_gather(outputs, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = counting_all_reduce, counting_all_gather


def _compare_with_plain_ddp(rank: int, world: int, compressor, steps: int) -> dict:
    reference = DDP(_net(), bucket_cap_mb=0.01)
    hooked = DDP(_net(), bucket_cap_mb=0.01)
    state = register_compression_hook(hooked, compressor, min_numel=MIN_NUMEL)
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
        "counted_sent": sum(n for kind, n in log if kind == "sent"),
        "counted_received": sum(n for kind, n in log if kind == "received"),
        "buckets": len(state.layouts),
        "numels": [p.numel() for p in hooked.parameters()],
    }


@pytest.mark.parametrize(
    "compressor", [NoneCompressor(), TopKCompressor(1.0), ErrorFeedback(TopKCompressor(1.0))], ids=repr
)
def test_lossless_compressors_give_plain_ddp_gradients(compressor):
    for result in run_workers(_compare_with_plain_ddp, 2, compressor, 3):
        assert result["buckets"] >= 3
        for reference, hooked in result["grads"]:
            for a, b in zip(reference, hooked, strict=True):
                torch.testing.assert_close(b, a)
        stats = result["stats"]
        assert stats["hook_calls"] > 3
        assert stats["bytes_sent"] == result["counted_sent"]
        assert stats["bytes_received"] == result["counted_received"]


def test_fp16_is_plain_ddp_to_half_precision():
    for result in run_workers(_compare_with_plain_ddp, 2, FP16Compressor(), 2):
        for reference, hooked in result["grads"]:
            for a, b in zip(reference, hooked, strict=True):
                torch.testing.assert_close(b, a, rtol=2e-3, atol=1e-4)
        assert result["stats"]["bytes_sent"] == result["counted_sent"]


class _PerTensorFP16(FP16Compressor):
    """fp16 through the base class's per-tensor encode and decode-then-copy (the fast path's reference)."""

    compress_many = Compressor.compress_many
    decompress_into = Compressor.decompress_into


def _fp16_paths(rank: int, world: int, steps: int) -> dict:
    models = {name: DDP(_net(), bucket_cap_mb=0.01) for name in ("per_tensor", "bucket")}
    states = {
        "per_tensor": register_compression_hook(models["per_tensor"], _PerTensorFP16(), min_numel=MIN_NUMEL),
        "bucket": register_compression_hook(models["bucket"], FP16Compressor(), min_numel=MIN_NUMEL),
    }
    grads: dict[str, list[list[torch.Tensor]]] = {name: [] for name in models}
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        for name, model in models.items():
            model.zero_grad()
            model(x).square().mean().backward()
            grads[name].append([p.grad.clone() for p in model.parameters()])
    return {"grads": grads, "stats": {name: state.stats.as_dict() for name, state in states.items()}}


def test_fp16_bucket_path_equals_the_per_tensor_path_bit_for_bit():
    # One cast into a flat half-precision buffer allreduced in place, and one casting copy back,
    # against a cast per tensor, a cat, and a decode to fp32 then a copy: the same bits and bytes.
    for result in run_workers(_fp16_paths, 2, 3):
        for per_tensor, bucket in zip(result["grads"]["per_tensor"], result["grads"]["bucket"], strict=True):
            for a, b in zip(per_tensor, bucket, strict=True):
                assert torch.equal(a, b)
        assert result["stats"]["per_tensor"] == result["stats"]["bucket"]


def test_topk_statistics_equal_bytes_passed_to_collectives_and_the_formula():
    density, steps = 0.05, 4
    results = run_workers(_compare_with_plain_ddp, 2, ErrorFeedback(TopKCompressor(density)), steps)
    for result in results:
        stats = result["stats"]
        assert stats["bytes_sent"] == result["counted_sent"]
        assert stats["bytes_received"] == result["counted_received"]
        numels = result["numels"]
        dense_bytes = 4 * sum(numels)
        # Step 1 is a plain allreduce (DDP rebuilds its buckets); then k (value, index) pairs per
        # large parameter and every small parameter dense, per step.
        # ... plus the step guard's flags, one per parameter and one for "non-finite somewhere", as
        # fp32 in the allreduce that carries the small parameters (lgc.ddp.packed).
        per_step = sum(8 * num_selected(n, density) if n >= MIN_NUMEL else 4 * n for n in numels) + 4 * (
            1 + len(numels)
        )
        assert stats["dense_equivalent_bytes"] == steps * dense_bytes
        assert stats["bytes_sent"] == dense_bytes + (steps - 1) * per_step
        assert stats["compression_ratio"] == pytest.approx(steps * dense_bytes / (dense_bytes + (steps - 1) * per_step))
        large = [n for n in numels if n >= MIN_NUMEL]
        assert stats["payload_compression_ratio"] == pytest.approx(
            4 * sum(large) / sum(8 * num_selected(n, density) for n in large)
        )


def _train_least_squares(rank: int, world: int, compressor, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(512, 64, generator=gen)
    target = features @ torch.randn(64, 8, generator=gen)
    shard = slice(rank * 256, (rank + 1) * 256)  # each worker has its own half of the data
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 8, bias=False))
    if compressor is not None:
        register_compression_hook(model, compressor, min_numel=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (model(features[shard]) - target[shard]).square().sum(1).mean()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            losses.append(float((model(features) - target).square().sum(1).mean()))
    return losses


def test_topk_with_error_feedback_converges_like_dense():
    steps = 300
    dense = run_workers(_train_least_squares, 2, None, steps)[0]
    topk = run_workers(_train_least_squares, 2, ErrorFeedback(TopKCompressor(0.05)), steps)[0]
    without_feedback = run_workers(_train_least_squares, 2, TopKCompressor(0.05), steps)[0]
    assert dense[-1] < 1e-9 * dense[0]
    assert topk[-1] < 1e-6 * topk[0], f"top-k + EF did not converge: {topk[0]:.3g} -> {topk[-1]:.3g}"
    # Error feedback is what makes 5 % top-k converge: without it the loss stalls far higher.
    assert topk[-1] < 1e-3 * without_feedback[-1]


def _train_with_loss_scaling(rank: int, world: int, scaled: bool, attach_scale: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model = DDP(_net(), bucket_cap_mb=0.01)
    state = register_compression_hook(model, ErrorFeedback(TopKCompressor(0.05)), min_numel=MIN_NUMEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # The scale doubles every step (a GradScaler's growth, compressed into a few steps).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1, enabled=scaled)
    if attach_scale:
        state.loss_scale = scaler.get_scale
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        optimizer.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "residuals": {k: v.clone() for k, v in state.compressor.residuals.items()},
        "scale": scaler.get_scale(),
    }


def test_loss_scaled_gradients_are_compressed_unscaled():
    # With the scale attached, training under a changing loss scale equals training without one,
    # bitwise (the scales are powers of two); without it, residuals accumulated at one scale are
    # added to gradients at another, and the runs differ.
    steps = 6
    plain = run_workers(_train_with_loss_scaling, 2, False, False, steps)
    attached = run_workers(_train_with_loss_scaling, 2, True, True, steps)
    unattached = run_workers(_train_with_loss_scaling, 2, True, False, steps)
    for rank in range(2):
        assert attached[rank]["scale"] == 2.0 ** (10 + steps)
        for a, b in zip(plain[rank]["params"], attached[rank]["params"], strict=True):
            assert torch.equal(a, b)
        for key, residual in plain[rank]["residuals"].items():
            assert torch.equal(residual, attached[rank]["residuals"][key])
        assert any(
            not torch.equal(a, b) for a, b in zip(plain[rank]["params"], unattached[rank]["params"], strict=True)
        )


def _fp16_under_loss_scaling(rank: int, world: int, attach_scale: bool) -> dict:
    """fp16 of gradients about 1e-9 (a loss far below 1) under a loss scale of 2**16, against plain DDP."""
    reference, hooked = DDP(_net(), bucket_cap_mb=0.01), DDP(_net(), bucket_cap_mb=0.01)
    state = register_compression_hook(hooked, FP16Compressor(), min_numel=MIN_NUMEL, start_iter=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    if attach_scale:
        state.loss_scale = scaler.get_scale
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    for model in (reference, hooked):
        scaler.scale(model(x).square().mean() * 1e-6).backward()
    return {"reference": [p.grad for p in reference.parameters()], "hooked": [p.grad for p in hooked.parameters()]}


@pytest.mark.parametrize("attach_scale", [False, True])
def test_fp16_casts_the_loss_scaled_gradient_whether_or_not_the_scale_is_attached(attach_scale):
    # Unscaled first, gradients of about 1e-9 would underflow fp16 (its smallest subnormal is 6e-8): the
    # loss scale is what keeps them in range, and a stateless compressor has no residual to keep in one unit.
    for result in run_workers(_fp16_under_loss_scaling, 2, attach_scale):
        for a, b in zip(result["reference"], result["hooked"], strict=True):
            assert ((b == 0) & (a != 0)).float().mean() < 0.01  # (the ReLU's dead units are 0 in both)
            torch.testing.assert_close(b, a, rtol=2e-3, atol=1e-3 * float(a.abs().max()))


class _OddParameters(nn.Module):
    """Two distinct parameters over one tensor (same address) and two empty ones (address 0 both)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        base = torch.randn(40, 40) * 0.1
        self.w1, self.w2 = nn.Parameter(base), nn.Parameter(base)
        self.empty1, self.empty2 = nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0, 7))
        self.inp, self.out = nn.Linear(64, 40), nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(torch.relu(h @ self.w1) @ self.w2.t()) + self.empty1.sum() + self.empty2.sum()


def _odd_parameters(rank: int, world: int, compressor: Compressor, min_numel: int) -> dict:
    reference, hooked = DDP(_OddParameters()), DDP(_OddParameters())
    state = register_compression_hook(hooked, compressor, min_numel=min_numel)
    steps = []
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + rank))
        for model in (reference, hooked):
            model.zero_grad()
            model(x).square().mean().backward()
        steps.append(
            {
                name: (p.grad.clone(), q.grad.clone())
                for (name, p), q in zip(reference.module.named_parameters(), hooked.module.parameters(), strict=True)
            }
        )
    return {"steps": steps, "layers": {row["layer"]: row["steps"] for row in state.summary_extras()["layers"]}}


@pytest.mark.parametrize(
    ("compressor", "min_numel"), [(ErrorFeedback(TopKCompressor(1.0)), 1), (SBCCompressor(0.1), 0)], ids=["topk", "sbc"]
)
def test_parameters_sharing_an_address_are_told_apart(compressor, min_numel):
    # Parameters were named by address: the second over a shared tensor took the first's name, state and
    # gradient, and every empty parameter the last one's (SBC then tried to code an empty tensor).
    for result in run_workers(_odd_parameters, 2, compressor, min_numel):
        names = ["w1", "w2", "empty1", "empty2", "inp.weight", "inp.bias", "out.weight", "out.bias"]
        assert sorted(result["layers"]) == sorted(names)
        assert result["layers"]["w1"] == result["layers"]["w2"] == 3
        if isinstance(compressor, ErrorFeedback):  # lossless: plain DDP's gradients
            for step in result["steps"]:
                for name, (theirs, ours) in step.items():
                    assert torch.equal(ours, theirs), name


def _inf_at_the_plain_step(rank: int, world: int) -> int:
    model = DDP(_net(), bucket_cap_mb=0.01)
    state = register_compression_hook(model, ErrorFeedback(TopKCompressor(0.1)), min_numel=MIN_NUMEL, start_iter=1)
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        if step == 0 and rank == 1:
            x[0, 0] = float("inf")
        model.zero_grad()
        model(x).square().mean().backward()
    return state.stats.skipped_steps


def test_a_non_finite_step_among_the_plain_allreduce_steps_counts_as_skipped():
    assert run_workers(_inf_at_the_plain_step, 2) == [1, 1]


def _misuses(rank: int, world: int) -> dict:
    """A DGC told another world size; a hook state registered on a second model."""
    found = {}
    try:
        register_compression_hook(DDP(_net()), DGCCompressor(0.01, world_size=4, steps_per_epoch=10))
    except ValueError as err:
        found["world_size"] = str(err)
    first, second = DDP(_net()), DDP(_net())
    state = register_compression_hook(first, ErrorFeedback(TopKCompressor(0.1)), min_numel=MIN_NUMEL)
    register_compression_hook(second, state.compressor, min_numel=MIN_NUMEL)
    state.attach(second)  # the same state now knows the second model's parameters only
    try:
        first(torch.randn(4, 32)).square().mean().backward()
    except RuntimeError as err:
        found["reused"] = str(err)
    return found


def test_a_wrong_world_size_and_a_state_moved_to_another_model_are_named():
    for found in run_workers(_misuses, 2):
        assert "DGC world_size=4, but the hook's process group has 2 workers" in found["world_size"]
        assert "the state was attached to another model since (one hook state per model" in found["reused"]


def _dense_in_dtype(rank: int, world: int, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    reference = DDP(_net().to(dtype), bucket_cap_mb=0.01)
    hooked = DDP(_net().to(dtype), bucket_cap_mb=0.01)
    state = register_compression_hook(hooked, NoneCompressor(), min_numel=MIN_NUMEL)
    grads = []
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank)).to(dtype)
        for model in (reference, hooked):
            model.zero_grad()
            model(x).float().square().mean().backward()
        grads.append(([p.grad.clone() for p in reference.parameters()], [p.grad.clone() for p in hooked.parameters()]))
    return {"grads": grads, "stats": state.stats.as_dict(), "numel": sum(p.numel() for p in hooked.parameters())}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_none_sends_half_precision_gradients_as_plain_ddp_does(dtype):
    # A model in fp16/bf16: plain DDP sends 2 bytes per element, and so must `none` (it sent fp32,
    # twice the bytes, and reported a compression ratio of 0.51).
    for result in run_workers(_dense_in_dtype, 2, dtype):
        for reference, hooked in result["grads"]:
            for a, b in zip(reference, hooked, strict=True):
                assert b.dtype == dtype and torch.equal(a, b)
        stats = result["stats"]
        assert stats["dense_equivalent_bytes"] == 3 * 2 * result["numel"]
        assert stats["bytes_sent"] == stats["dense_equivalent_bytes"]
        assert stats["compression_ratio"] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_step_guard_look_sees_every_nan_and_inf_and_every_nonzero_parameter(reference_device, dtype):
    """bucket_maxima: each segment's largest magnitude; NaN and inf show wherever they sit in a large segment."""
    from lgc.ddp.exchange import Segment
    from lgc.ddp.step_guard import bucket_maxima

    numels = [300_001, 0, 5, 70_000, 1]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    segments = tuple(Segment(f"p{i}", o, n, True) for i, (o, n) in enumerate(zip(offsets, numels, strict=True)))
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(sum(numels), generator=gen).to(dtype)
    clean[offsets[2] : offsets[2] + 5] = 0.0
    clean[offsets[2] + 1] = -0.0
    maxima = bucket_maxima(clean.to(reference_device), segments).cpu()
    zero = torch.tensor(0.0, dtype=dtype)
    expected = [clean[o : o + n].abs().max() if n else zero for o, n in zip(offsets, numels, strict=True)]
    assert torch.equal(maxima, torch.stack(expected)), "each segment's largest magnitude; empty and zero ones 0"
    for position in [0, 1, 4095, 65_536, 131_071, 299_999, 300_000, offsets[3] + 69_999, offsets[4]]:
        for bad in (float("nan"), float("inf"), float("-inf")):
            buffer = clean.clone()
            buffer[position] = bad
            maxima = bucket_maxima(buffer.to(reference_device), segments).cpu()
            owner = max(i for i, o in enumerate(offsets) if o <= position and numels[i])
            assert not bool(torch.isfinite(maxima[owner])), (position, bad)
            assert bool(torch.isfinite(maxima[[i for i in range(len(numels)) if i != owner]]).all())


def _bucketed_compressor(which: str, bucketed: bool) -> Compressor:
    if which == "topk":
        return ErrorFeedback(TopKCompressor(0.05), bucketed=bucketed)
    if which == "sbc":  # sizes vary: each step encoded ahead and held until the ranks agree
        return ErrorFeedback(SBCCompressor(0.05), bucketed=bucketed)
    if which == "demo":  # encoded and decoded a bucket at once (the decode follows error feedback's switch)
        return ErrorFeedback(DeMoCompressor(chunk=8, k=4), decay=0.999, bucketed=bucketed)
    dgc = DGCCompressor(density=0.05, warmup_densities=[0.5], steps_per_epoch=2, weight_decay=1e-4)
    dgc.bucketed = bucketed
    return dgc


def _train_bucketed(rank: int, world: int, which: str, bucketed: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model = DDP(_net(), bucket_cap_mb=0.01)  # several buckets, rebuilt after the first step
    state = register_compression_hook(model, _bucketed_compressor(which, bucketed), min_numel=0)
    decoded_at_once = []
    if which == "demo":  # count the bucket decodes the hook's aggregate_many takes
        demo = state.compressor.compressor
        decode = demo.decode_segments
        demo.decode_segments = lambda payloads, outs: decoded_at_once.append(len(outs)) or decode(payloads, outs)
    momentum = 0.0 if which in ("dgc", "demo") else 0.9  # DGC applies its own, DeMo keeps it in the residual
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    grads = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        if step == 3:  # a checkpoint in the middle: one tensor per key, loaded back into the flat's place
            state.load_state_dict(state.state_dict())
    return {
        "grads": grads,
        "residuals": {k: v.clone() for k, v in state.compressor.residual_store().items()},
        "flats": len(state.compressor._buckets.flats),
        "decoded_at_once": len(decoded_at_once),
        "stats": state.stats.as_dict(),
    }


@pytest.mark.parametrize(
    "which", [pytest.param("topk", marks=pytest.mark.slow), "dgc", pytest.param("sbc", marks=pytest.mark.slow), "demo"]
)
def test_a_step_encoded_as_one_flat_trains_as_tensor_by_tensor(which):
    """ErrorFeedback(TopK), ErrorFeedback(SBC), ErrorFeedback(DeMo) and DGC with bucketed=True in DDP (the GPU's
    default path, forced on gloo; SBC and DGC encode each step ahead and hold it): the same bits (DGC: its
    warm-up, momentum correction, masking and weight decay; pairs in another order where cut)."""
    steps = 7
    loop = run_workers(_train_bucketed, 2, which, False, steps)
    flat = run_workers(_train_bucketed, 2, which, True, steps)
    for by_loop, by_flat in zip(loop, flat, strict=True):
        assert by_flat["flats"] == 1 and by_loop["flats"] == 0, "one flat for the step's parameters"
        if which == "demo":
            assert by_flat["decoded_at_once"] == steps and by_loop["decoded_at_once"] == 0, "decoded a bucket at once"
        for step, (want, have) in enumerate(zip(by_loop["grads"], by_flat["grads"], strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True)), step
        assert by_loop["residuals"].keys() == by_flat["residuals"].keys()
        assert all(torch.equal(by_loop["residuals"][k], by_flat["residuals"][k]) for k in by_loop["residuals"])
        assert by_loop["stats"] == by_flat["stats"], "the same bytes on the wire"
