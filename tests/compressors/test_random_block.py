"""Random-block sparsification: placement, bytes, error feedback, shared offsets across workers, state."""

import pickle

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import register_compression_hook
from lgc.compressors import CombineMode, ErrorFeedback
from lgc.compressors.random_block import BlockPayload, OffsetBlockPayload, RandomBlockCompressor, block_offset
from lgc.compressors.topk import num_selected


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _step_with_wrapping_block(seed: int, numel: int, k: int) -> int:
    return next(s for s in range(10_000) if block_offset(seed, s, numel) > numel - k)


# ------------------------------------------------------------------------------------------------
# placement and bytes


@pytest.mark.parametrize("wraps", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_block_is_k_consecutive_entries_decoded_in_place(shared, wraps):
    numel, density = 1000, 0.05
    k = num_selected(numel, density)
    step = _step_with_wrapping_block(3, numel, k) if wraps else 0
    g = _randn(numel)
    compressor = RandomBlockCompressor(density, shared=shared, seed=3)
    if shared:
        assert (block_offset(3, step, numel) > numel - k) == wraps
    compressor.begin_step(step)
    payload = compressor.compress(g, "w")
    positions = (payload.offset + torch.arange(k)) % numel
    if shared:
        assert payload.offset == block_offset(3, step, numel)
    assert torch.equal(payload.indices, positions)
    assert torch.equal(payload.values, g[positions])
    expected = torch.zeros(numel)
    expected[positions] = g[positions]
    assert torch.equal(compressor.decompress(payload), expected)
    wire = payload.to_wire()
    assert wire.numel() == payload.nbytes == (4 * k if shared else 8 + 4 * k)
    rebuilt = compressor.payload_from_wire(wire, numel)
    assert type(rebuilt) is type(payload) and rebuilt.offset == payload.offset
    assert torch.equal(compressor.decompress(rebuilt), expected)


def test_shared_payload_is_values_only_and_unshared_carries_an_int64_offset():
    g = _randn(25_000)
    shared = RandomBlockCompressor(0.001).compress(g, "w")
    unshared = RandomBlockCompressor(0.001, shared=False).compress(g, "w")
    assert type(shared) is BlockPayload and type(unshared) is OffsetBlockPayload
    assert [t.dtype for t in shared.tensors()] == [torch.float32] and shared.nbytes == 4 * 25
    assert [t.dtype for t in unshared.tensors()] == [torch.int64, torch.float32] and unshared.nbytes == 8 + 4 * 25
    assert int(unshared.offset_wire) == unshared.offset


def test_combine_modes_and_shared_seed_flags():
    shared, unshared = RandomBlockCompressor(0.01), RandomBlockCompressor(0.01, shared=False)
    assert shared.combine is CombineMode.SUM and shared.needs_shared_seed and not shared.variable_size
    # Unshared mode adopts rank 0's seed too: its offsets differ by rank, never by inherited generator state.
    assert unshared.combine is CombineMode.GATHER and unshared.needs_shared_seed and not unshared.variable_size
    ef = ErrorFeedback(shared)
    assert ef.combine is CombineMode.SUM and ef.needs_shared_seed
    ef.set_shared_seed(42)
    assert shared.shared_seed == ef.shared_seed == 42


def test_summed_shared_payloads_decode_to_the_sum_of_blocks():
    compressor, other_worker = RandomBlockCompressor(0.02, seed=5), RandomBlockCompressor(0.02, seed=5)
    compressor.begin_step(7)
    other_worker.begin_step(7)
    pa, pb = compressor.compress(_randn(3000, 1), "w"), other_worker.compress(_randn(3000, 2), "w")
    assert pa.offset == pb.offset
    summed = (pa.values + pb.values).view(torch.uint8)  # what the allreduce returns
    decoded = compressor.decompress(compressor.payload_from_wire(summed, 3000))
    torch.testing.assert_close(decoded, compressor.decompress(pa) + compressor.decompress(pb), rtol=0, atol=0)


def test_unshared_aggregate_adds_every_block_at_its_offset():
    compressor = RandomBlockCompressor(0.3, shared=False, seed=1)
    payloads = [compressor.compress(_randn(500, s), f"w{s}") for s in range(4)]
    assert len({p.offset for p in payloads}) > 1  # overlapping and wrapping blocks included
    wires = [compressor.payload_from_wire(p.to_wire(), 500) for p in payloads]
    torch.testing.assert_close(compressor.aggregate(wires), sum(compressor.decompress(p) for p in payloads))


# ------------------------------------------------------------------------------------------------
# offsets


def test_offsets_are_a_function_of_seed_step_and_length_and_cover_every_entry_evenly():
    assert block_offset(1, 2, 1000) == block_offset(1, 2, 1000)
    assert len({block_offset(1, s, 1000) for s in range(50)}) > 40
    assert block_offset(1, 2, 1000) != block_offset(2, 2, 1000)
    # Wrap-around makes every entry equally likely to be sent: k / n per step.
    numel, k, steps = 100, 10, 4000
    counts = torch.zeros(numel)
    for step in range(steps):
        counts[(block_offset(0, step, numel) + torch.arange(k)) % numel] += 1
    assert counts.min() > 0.8 * steps * k / numel and counts.max() < 1.2 * steps * k / numel


def test_a_repeated_key_without_begin_step_moves_the_block():
    compressor = RandomBlockCompressor(0.01, seed=0)
    g = _randn(10_000)
    offsets = [compressor.compress(g, "w").offset for _ in range(5)]
    assert len(set(offsets)) == 5 and compressor.step == 4
    compressor.begin_step(0)
    assert compressor.compress(g, "w").offset == offsets[0]
    assert compressor.compress(_randn(10_000), "other").offset == offsets[0]  # same step, same length


# ------------------------------------------------------------------------------------------------
# error feedback and state


@pytest.mark.parametrize("shared", [True, False])
def test_error_feedback_invariant_is_exact(shared):
    ef = ErrorFeedback(RandomBlockCompressor(0.05, shared=shared, seed=2))
    total_in, total_sent = torch.zeros(2000), torch.zeros(2000)
    for step in range(30):
        ef.begin_step(step)
        g = _randn(2000, seed=step)
        corrected = g + ef.residuals.get("w", torch.zeros(2000))
        payload = ef.compress(g, "w")
        sent = ef.decompress(payload)
        assert torch.equal(sent + ef.residuals["w"], corrected)
        assert bool((ef.residuals["w"][payload.indices] == 0).all())  # the sent block is cleared
        total_in += g
        total_sent += sent
    torch.testing.assert_close(total_sent + ef.residuals["w"], total_in)


@pytest.mark.parametrize("shared", [True, False])
def test_state_dict_round_trip_continues_identically(shared):
    original = ErrorFeedback(RandomBlockCompressor(0.02, shared=shared, seed=11))
    for step in range(3):
        original.compress(_randn(4000, step), "a")  # no begin_step: the step advances by itself
        original.compress(_randn(1000, step), "b")
    restored = ErrorFeedback(RandomBlockCompressor(0.02, shared=shared, seed=99))
    restored.load_state_dict(pickle.loads(pickle.dumps(original.state_dict())))
    for step in range(3, 6):
        for key, numel in (("a", 4000), ("b", 1000)):
            expected, got = original.compress(_randn(numel, step), key), restored.compress(_randn(numel, step), key)
            assert got.offset == expected.offset
            assert torch.equal(got.values, expected.values)
    with pytest.raises(ValueError, match="unknown state"):
        restored.compressor.load_state_dict({"thresholds": {}})


@pytest.mark.parametrize("seed", [0, None])
def test_unshared_offsets_are_independent_per_rank_whatever_the_seed(seed):
    # Every spawned worker starts from a pickled copy of the launching process's compressor (same
    # seed, or the same entropy with seed=None): the rank alone must make their offsets differ.
    built = RandomBlockCompressor(0.01, shared=False, seed=seed)
    workers = [pickle.loads(pickle.dumps(built)) for _ in range(4)]
    offsets = []
    for rank, worker in enumerate(workers):
        worker.set_rank(rank)
        worker.set_shared_seed(workers[0].shared_seed)  # what the hook's broadcast does
        row = []
        for step in range(200):
            worker.begin_step(step)
            row.append(worker.compress(_randn(1000), "w").offset)
        offsets.append(row)
    for a in range(4):
        for b in range(a + 1, 4):
            same = sum(x == y for x, y in zip(offsets[a], offsets[b], strict=True))
            assert same < 5, f"ranks {a} and {b} drew {same} equal offsets in 200 steps"
    # Independent, uniform offsets: no rank's offsets cluster (each covers most of the 10 deciles).
    for row in offsets:
        assert len({o // 100 for o in row}) == 10
    # A pure function of (seed, step, length, rank, name): a copy of a worker draws the same offsets.
    again = pickle.loads(pickle.dumps(workers[2]))
    again.begin_step(7)
    workers[2].begin_step(7)
    assert again.compress(_randn(1000), "w").offset == workers[2].compress(_randn(1000), "w").offset


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="density"):
        RandomBlockCompressor(1.5)
    with pytest.raises(ValueError, match="seed"):
        RandomBlockCompressor(0.1, seed=-1)
    everything = RandomBlockCompressor(1.0)
    assert torch.equal(everything.decompress(everything.compress(_randn(9), "w")), _randn(9))


# ------------------------------------------------------------------------------------------------
# two processes, through the DDP hook


class _RecordingRandomBlock(RandomBlockCompressor):
    """Records every payload it makes (offset and values), to check what the hook decoded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[int, torch.Tensor]] = []
        self.sent_by_key: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def compress(self, tensor: torch.Tensor, key: str) -> BlockPayload:
        payload = super().compress(tensor, key)
        self.sent.append((payload.offset, payload.values.clone()))
        self.sent_by_key.setdefault(key, []).append((payload.offset, payload.values.clone()))
        return payload


def _train_least_squares(rank: int, world: int, modes: list, density: float, steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(512, 64, generator=gen)
    target = features @ torch.randn(64, 16, generator=gen)
    shard = slice(rank * 256, (rank + 1) * 256)  # each worker has its own half of the data
    results = []
    for mode in modes:
        torch.manual_seed(0)
        model = DDP(nn.Linear(64, 16, bias=False))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        compressor, state = None, None
        if mode is not None:
            # Shared: deliberately different seeds per rank, it must adopt rank 0's. Unshared: the
            # same default seed on every rank (what a config gives), the offsets must still differ.
            seed = 1000 * rank + 1 if mode == "shared" else 0
            compressor = _RecordingRandomBlock(density, shared=mode == "shared", seed=seed)
            state = register_compression_hook(model, ErrorFeedback(compressor), min_numel=0)
        losses, grads = [], []
        for _ in range(steps):
            optimizer.zero_grad()
            (model(features[shard]) - target[shard]).square().sum(1).mean().backward()
            grads.append(model.module.weight.grad.flatten().clone())
            optimizer.step()
            with torch.no_grad():
                losses.append(float((model(features) - target).square().sum(1).mean()))
        results.append(
            {
                "losses": losses,
                "grads": grads[:20],
                "sent": compressor.sent[:19] if compressor else [],
                "shared_seed": compressor.shared_seed if compressor else None,
                "stats": state.stats.as_dict() if state else None,
            }
        )
    return results


def _same_sized_layers_in_separate_buckets(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False), nn.Tanh())
    net.append(nn.Linear(64, 64, bias=False))
    model = DDP(net, bucket_cap_mb=0.01)  # one bucket per layer, decoded in gloo's callback threads
    compressor = _RecordingRandomBlock(0.05, seed=rank + 5)
    state = register_compression_hook(model, ErrorFeedback(compressor), min_numel=0)
    grads = []
    for step in range(steps):
        model.zero_grad()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        grads.append({name: p.grad.flatten().clone() for name, p in model.module.named_parameters()})
    return {"grads": grads, "sent": compressor.sent_by_key, "buckets": len(state.layouts)}


def _both_scenarios(rank: int, world: int, steps: int) -> dict:
    return {
        "least_squares": _train_least_squares(rank, world, [None, "shared", "unshared"], 0.25, steps),
        "buckets": _same_sized_layers_in_separate_buckets(rank, world, 6),
    }


@pytest.fixture(scope="module")
def two_workers() -> list[dict]:
    """One spawn of two gloo workers for all multi-process tests here (spawning dominates their time)."""
    return run_workers(_both_scenarios, 2, 300)


@pytest.mark.multiprocess
def test_two_workers_share_offsets_send_only_values_and_converge(two_workers):
    density, steps, numel = 0.25, 300, 64 * 16
    k = num_selected(numel, density)
    (dense0, shared0, unshared0), (dense1, shared1, unshared1) = (r["least_squares"] for r in two_workers)

    # Shared: both ranks adopted rank 0's seed (rank 1 was built with another) and drew the same offsets.
    assert shared0["shared_seed"] == shared1["shared_seed"] == 1
    assert [o for o, _ in shared0["sent"]] == [o for o, _ in shared1["sent"]]
    assert len({o for o, _ in shared0["sent"]}) > 10
    # The hook's result is exactly the sum of both blocks at that offset, on both ranks (step 0 is dense).
    for step, ((offset, v0), (_, v1)) in enumerate(zip(shared0["sent"], shared1["sent"], strict=True), start=1):
        expected = torch.zeros(numel)
        expected[(offset + torch.arange(k)) % numel] = v0 + v1
        assert torch.equal(shared0["grads"][step], expected) and torch.equal(shared1["grads"][step], expected)
    # Bytes: step 0 is a dense allreduce; rank 0 broadcasts its 8-byte seed once; then per step the
    # header (the non-finite flag and the parameter's, fp32) and 4 k bytes.
    for rank, run in enumerate((shared0, shared1)):
        stats = run["stats"]
        assert stats["payload_bytes"] == (steps - 1) * 4 * k
        assert stats["bytes_sent"] == 4 * numel + (8 if rank == 0 else 0) + (steps - 1) * (4 * k + 8)

    # Unshared: each rank draws its own offsets and sends offset + values (8 + 4 k bytes).
    assert [o for o, _ in unshared0["sent"]] != [o for o, _ in unshared1["sent"]]
    for step, ((o0, v0), (o1, v1)) in enumerate(zip(unshared0["sent"], unshared1["sent"], strict=True), start=1):
        expected = torch.zeros(numel)
        expected[(o0 + torch.arange(k)) % numel] += v0
        expected[(o1 + torch.arange(k)) % numel] += v1
        torch.testing.assert_close(unshared0["grads"][step], expected, rtol=0, atol=0)
    for rank, run in enumerate((unshared0, unshared1)):
        # Rank 0 broadcasts the run's seed (8 bytes); every step also has its header (the guard's
        # flags as fp32: one parameter plus the non-finite flag, 8 bytes).
        guard = 8
        assert run["stats"]["bytes_sent"] == 4 * numel + (8 if rank == 0 else 0) + (steps - 1) * (8 + 4 * k + guard)

    # Convergence (lr 0.1): dense reaches 1e-13 of the initial loss; both modes reach 1e-9 (measured
    # ~2e-14). Error feedback delays an entry ~1 / density steps: at density 0.1 this lr diverges.
    for name, run in (("dense", dense0), ("shared", shared0), ("unshared", unshared0)):
        first, last = run["losses"][0], run["losses"][-1]
        assert last < 1e-9 * first, f"{name}: {first:.3g} -> {last:.3g}"
    assert dense1["losses"] == dense0["losses"] and shared1["losses"] == shared0["losses"]
    assert unshared1["losses"] == unshared0["losses"]


@pytest.mark.multiprocess
def test_same_sized_tensors_in_several_buckets_decode_at_the_shared_offset(two_workers):
    r0, r1 = (r["buckets"] for r in two_workers)
    assert r0["buckets"] == 3 and set(r0["sent"]) == {"0.weight", "2.weight", "4.weight"}
    for key in ("2.weight", "4.weight"):  # both 4096 entries: same offset every step
        assert [o for o, _ in r0["sent"][key]] == [o for o, _ in r0["sent"]["2.weight"]]
    for key, sent0 in r0["sent"].items():
        numel = r0["grads"][0][key].numel()
        for step, ((offset, v0), (other, v1)) in enumerate(zip(sent0, r1["sent"][key], strict=True), start=1):
            assert offset == other == block_offset(5, step, numel)
            expected = torch.zeros(numel)
            expected[(offset + torch.arange(v0.numel())) % numel] = v0 + v1
            assert torch.equal(r0["grads"][step][key], expected) and torch.equal(r1["grads"][step][key], expected)
