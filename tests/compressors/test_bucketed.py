"""Error feedback over top-k, a bucket at once (compress_many, bucketed): the per-tensor path's payloads and state."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lgc.compressors import ErrorFeedback, FP4Compressor, SignSGDCompressor, TopKCompressor
from lgc.compressors.topk import SparsePayload, num_selected, scatter_add_sparse_into, scatter_add_sparse_many


def _pairs(payload: SparsePayload) -> list[tuple[int, int]]:
    """A payload's (index, value bits) pairs in index order: what it says, whatever the order on the wire."""
    bits = payload.values.view(torch.int16 if payload.values.element_size() == 2 else torch.int32)
    return sorted(zip(payload.indices.tolist(), bits.tolist(), strict=True))


def _step(loop: ErrorFeedback, batched: ErrorFeedback, grads: list[torch.Tensor], keys: list[str]) -> None:
    expected = loop.compress_many(grads, keys)
    got = batched.compress_many(grads, keys)
    for key, want, have in zip(keys, expected, got, strict=True):
        assert isinstance(have, SparsePayload) and have.numel == want.numel
        assert have.values.dtype == want.values.dtype and have.indices.dtype == want.indices.dtype
        assert have.nbytes == want.nbytes and have.to_wire().numel() == want.to_wire().numel()
        assert _pairs(have) == _pairs(want), key
        assert torch.equal(loop.residuals[key], batched.residuals[key]), key


def _distinct(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``n`` random values of distinct magnitudes: a tie at a tensor's k-th magnitude may select other entries.

    bf16 has 8 significant bits, so its randn values tie often; its magnitudes are drawn without
    replacement from the 7,936 bf16 numbers between 2^-47 and 2^15 (within float16's range), and
    fp16's from its 29,696 normal numbers between 2^-14 and 2^15.
    """
    if dtype == torch.float32:
        return torch.randn(n, generator=gen)
    low, high = (0x2800, 0x4700) if dtype == torch.bfloat16 else (0x0400, 0x7800)
    bits = (torch.randperm(high - low, generator=gen)[:n] + low).to(torch.int16)
    signs = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    return bits.view(dtype) * signs.to(dtype)


def _no_tie_at_k(ef: ErrorFeedback, grads: list[torch.Tensor], keys: list[str], density: float, decay: float) -> bool:
    """Whether no tensor's ``beta * r + g`` ties at its k-th and (k+1)-th largest magnitude (either may go)."""
    for grad, key in zip(grads, keys, strict=True):
        residual = ef.residuals.get(key)
        corrected = grad.float() if residual is None else residual * decay + grad
        k = num_selected(grad.numel(), density)
        if k < grad.numel():
            top = torch.topk(corrected.abs(), k + 1).values
            if top[k - 1] == top[k]:
                return False
    return True


@settings(max_examples=40, deadline=None)
@given(
    numels=st.lists(st.integers(1, 1300), min_size=2, max_size=6),
    density=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
    decay=st.sampled_from([1.0, 0.95]),
    value_dtype=st.sampled_from(["float32", "float16"]),
    grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_a_bucket_at_once_is_the_per_tensor_loop(numels, density, decay, value_dtype, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    loop = ErrorFeedback(TopKCompressor(density, value_dtype), decay, bucketed=False)
    batched = ErrorFeedback(TopKCompressor(density, value_dtype), decay, bucketed=True)
    keys = [f"p{i}" for i in range(len(numels))]
    for _ in range(3):
        bucket = _distinct(sum(numels), grad_dtype, gen)  # the grads are slices of one bucket
        grads = list(bucket.split(numels))
        # Residuals plus gradients can tie (bf16 sums) even where each step's gradients do not.
        assume(_no_tie_at_k(loop, grads, keys, density, decay))
        _step(loop, batched, grads, keys)
        assert torch.equal(bucket, torch.cat(grads)), "the gradient is read, not written"
    views = batched._buckets.flats[tuple(keys)].views[0]
    assert all(batched.residuals[key] is view for key, view in zip(keys, views, strict=True)), "the flat's slices"


def test_residuals_survive_a_new_bucketing_a_checkpoint_and_per_tensor_calls():
    """DDP rebuilds its buckets after the first step; a checkpoint holds one tensor per key; the hook may mix paths."""
    gen = torch.Generator().manual_seed(0)
    numels = [700, 50, 1300, 9, 4000]
    keys = [f"p{i}" for i in range(len(numels))]
    loop = ErrorFeedback(TopKCompressor(0.01), bucketed=False)
    batched = ErrorFeedback(TopKCompressor(0.01), bucketed=True)

    def grads() -> list[torch.Tensor]:
        return list(torch.randn(sum(numels), generator=gen).split(numels))

    _step(loop, batched, grads(), keys)  # one bucket of everything
    g = grads()
    _step(loop, batched, g[:2], keys[:2])  # rebuilt: two buckets
    _step(loop, batched, g[2:], keys[2:])
    assert set(batched._buckets.flats) == {tuple(keys[:2]), tuple(keys[2:])}, "the stale bucket's flat is let go"
    g = grads()
    for key, grad in zip(keys[:2], g[:2], strict=True):  # per tensor into the flat's slices
        assert _pairs(loop.compress(grad, key)) == _pairs(batched.compress(grad, key))
    _step(loop, batched, g[2:], keys[2:])
    state = batched.state_dict()
    assert all(r.untyped_storage().nbytes() == 4 * r.numel() for r in state["residuals"].values()), "one tensor per key"
    resumed = ErrorFeedback(TopKCompressor(0.01), bucketed=True)
    resumed.load_state_dict(state)
    for _ in range(2):
        g = grads()
        _step(loop, resumed, g, keys)


def test_a_step_that_uses_fewer_parameters_lets_the_old_flat_go():
    """The hook's flat holds a step's used parameters; one left out gets a residual of its own, not an old view."""
    gen = torch.Generator().manual_seed(2)
    numels = [3000, 2000, 1000, 4000]
    keys = ["p0", "p1", "p2", "p3"]
    loop = ErrorFeedback(TopKCompressor(0.01), bucketed=False)
    batched = ErrorFeedback(TopKCompressor(0.01), bucketed=True)
    for used in (keys, keys[1:], keys[2:], keys, keys[::2]):
        index = [keys.index(key) for key in used]
        grads = [torch.randn(numels[i], generator=gen) for i in index]
        _step(loop, batched, grads, list(used))
        storages = {r.untyped_storage().data_ptr(): r.untyped_storage().nbytes() for r in batched.residuals.values()}
        assert sum(storages.values()) == 4 * sum(numels), f"residual storage held beyond the residuals after {used}"
        assert list(batched._buckets.flats) == [tuple(used)]
    assert all(torch.equal(loop.residuals[key], batched.residuals[key]) for key in keys)


def test_every_interleaving_of_paths_is_the_loops():
    """Random sequences of bucket, per-tensor, held, dropped, checkpointed and copied steps: the loop's residuals."""
    import copy
    import random

    numels = {"a": 300, "b": 57, "c": 900, "d": 12, "e": 400}
    for trial in range(12):
        rnd, gen = random.Random(trial), torch.Generator().manual_seed(trial)
        decay, value_dtype = rnd.choice([1.0, 0.9]), rnd.choice(["float32", "float16"])
        loop = ErrorFeedback(TopKCompressor(0.05, value_dtype), decay, bucketed=False)
        batched = ErrorFeedback(TopKCompressor(0.05, value_dtype), decay, bucketed=True)
        for step in range(20):
            op = rnd.choice(["many", "many", "many", "one", "held", "drop", "checkpoint", "copy"])
            keys = rnd.sample(sorted(numels), rnd.randint(2, 5))
            grads = [torch.randn(numels[k], generator=gen) for k in keys]
            if op == "many":
                _step(loop, batched, grads, keys)
            elif op == "one":
                for ef in (loop, batched):
                    for grad, key in zip(grads, keys, strict=True):
                        ef.compress(grad, key)
            elif op in ("held", "drop"):
                kept = frozenset(rnd.sample(keys, rnd.randint(0, len(keys))))
                for ef in (loop, batched):
                    for grad, key in zip(grads, keys, strict=True):
                        ef.compress_pending(grad, key)
                    ef.drop() if op == "drop" else ef.commit(kept)
            elif op == "checkpoint":
                for ef in (loop, batched):
                    ef.load_state_dict(ef.state_dict())
            else:
                loop, batched = copy.deepcopy(loop), copy.deepcopy(batched)
            for key in numels:
                mine, theirs = batched.residuals.get(key), loop.residuals.get(key)
                assert (mine is None) == (theirs is None), (trial, step, op, key)
                assert mine is None or torch.equal(mine, theirs), (trial, step, op, key)


def test_a_key_twice_in_one_call_is_applied_twice_as_the_loop_does():
    loop = ErrorFeedback(TopKCompressor(0.25), bucketed=False)
    batched = ErrorFeedback(TopKCompressor(0.25), bucketed=True)
    grads = [torch.tensor([0.1, -2.0, 0.4, 0.6]), torch.tensor([0.1, 2.0, 1.0, 0.5])]
    for ef in (loop, batched):
        ef.compress_many(grads, ["w", "w"])
    assert torch.equal(batched.residuals["w"], loop.residuals["w"])


@pytest.mark.parametrize("bucketed", [0, 1, 0.0, "yes"])
def test_bucketed_takes_none_true_or_false_only(bucketed):
    with pytest.raises(ValueError, match="bucketed must be None, True or False"):
        ErrorFeedback(TopKCompressor(0.01), bucketed=bucketed)


def test_a_held_step_and_its_commit_leave_the_flat_consistent():
    """compress_pending writes other buffers; a commit replaces residuals, and the next bucket rebuilds its flat."""
    gen = torch.Generator().manual_seed(1)
    numels = [500, 800]
    keys = ["a", "b"]
    loop = ErrorFeedback(TopKCompressor(0.02), bucketed=False)
    batched = ErrorFeedback(TopKCompressor(0.02), bucketed=True)
    _step(loop, batched, list(torch.randn(1300, generator=gen).split(numels)), keys)
    g = list(torch.randn(1300, generator=gen).split(numels))
    for ef in (loop, batched):
        for key, grad in zip(keys, g, strict=True):
            ef.compress_pending(grad, key)
        ef.commit(frozenset({"a"}))
    for key in keys:
        assert torch.equal(loop.residuals[key], batched.residuals[key])
    _step(loop, batched, list(torch.randn(1300, generator=gen).split(numels)), keys)


def test_nonfinite_input_selects_as_the_per_tensor_path():
    """An inf or NaN (the hook's step guard keeps them out; a direct caller may not) ranks highest in both paths."""
    numels = [300, 400]
    bucket = torch.randn(700, generator=torch.Generator().manual_seed(2))
    bucket[5], bucket[410] = float("nan"), float("-inf")
    loop = ErrorFeedback(TopKCompressor(0.01), bucketed=False)
    batched = ErrorFeedback(TopKCompressor(0.01), bucketed=True)
    grads, keys = list(bucket.split(numels)), ["a", "b"]
    expected, got = loop.compress_many(grads, keys), batched.compress_many(grads, keys)
    for want, have in zip(expected, got, strict=True):
        assert sorted(want.indices.tolist()) == sorted(have.indices.tolist())
    assert 5 in got[0].indices.tolist() and 110 in got[1].indices.tolist(), "NaN and inf ranked highest"


def test_the_default_batches_on_a_gpu_only():
    ef = ErrorFeedback(TopKCompressor(0.01))
    grads = [torch.randn(100), torch.randn(200)]
    assert not ef._flat_path(grads, ["a", "b"]), "the CPU's per-tensor selection is the faster one"
    assert not ef.batches_on(torch.device("cpu")) and ef.batches_on(torch.device("cuda"))
    assert not ErrorFeedback(TopKCompressor(0.01), bucketed=False).batches_on(torch.device("cuda"))
    assert ErrorFeedback(SignSGDCompressor()).batches_on(torch.device("cuda")), "the scaled sign has a bucket path"
    assert not ErrorFeedback(SignSGDCompressor()).batches_on(torch.device("cpu"))
    assert ErrorFeedback(TopKCompressor(0.01), bucketed=True)._flat_path(grads, ["a", "b"])
    assert not ErrorFeedback(TopKCompressor(0.01), bucketed=True)._flat_path(grads[:1], ["a"]), "nothing to batch"
    assert not ErrorFeedback(TopKCompressor(0.01), bucketed=True)._flat_path(grads, ["a", "a"]), "a key twice"
    with pytest.raises(ValueError, match="bucketed must be None, True or False, got 'yes'"):
        ErrorFeedback(TopKCompressor(0.01), bucketed="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bucketed=True needs a compressor with a bucket-level path .*got FP4"):
        ErrorFeedback(FP4Compressor(), bucketed=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_bucket_is_the_per_tensor_loop():
    gen = torch.Generator(device="cuda").manual_seed(3)
    numels = [64 * 64 * 9, 17, 256 * 128, 5000]
    keys = [f"p{i}" for i in range(len(numels))]
    loop = ErrorFeedback(TopKCompressor(0.001), bucketed=False)
    batched = ErrorFeedback(TopKCompressor(0.001))
    for _ in range(3):
        _step(loop, batched, list(torch.randn(sum(numels), device="cuda", generator=gen).split(numels)), keys)
    assert tuple(keys) in batched._buckets.flats, "the default batches on a GPU"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_a_bucket_decoded_at_once_is_the_loop(out_dtype, ranks, device):
    """scatter_add_sparse_many: every tensor's fp32 sum of the ranks' payloads in rank order, cast once."""
    gen = torch.Generator().manual_seed(4)
    numels = [900, 1, 40, 2500]
    per_tensor = []
    for numel in numels:
        received = []
        for _ in range(ranks):
            k = int(torch.randint(0, numel + 1, (1,), generator=gen))  # k = 0 included
            indices = torch.randperm(numel, generator=gen)[:k].to(torch.int32)
            values = torch.randn(k, generator=gen).to(torch.float16)
            received.append(SparsePayload(numel=numel, values=values.to(device), indices=indices.to(device)))
        per_tensor.append(received)
    bucket = torch.full((sum(numels) + 7,), 9.0, dtype=out_dtype, device=device)  # a bucket's slices, a dense part
    outs = list(bucket[7:].split(numels))
    expected = torch.full_like(bucket, 9.0)
    for received, out in zip(per_tensor, expected[7:].split(numels), strict=True):
        scatter_add_sparse_into(received, out)
    scatter_add_sparse_many(per_tensor, outs)
    assert torch.equal(bucket.view(torch.uint8), expected.view(torch.uint8))
