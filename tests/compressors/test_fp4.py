"""FP4 (E3M0) outer gradients: nearest rounding, exact bytes, and a 2-worker Streaming DiLoCo exchange."""

import math

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc.compressors import CombineMode, FP4Compressor
from lgc.compressors.fp4 import e3m0_values
from lgc.ddp.fragments import split_into_fragments
from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _nearest_e3m0(values: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Brute force: every entry to the nearest of ``scale * {0, +-2**-6, ..., +-1}`` (ties away from zero)."""
    out = torch.empty_like(values)
    grid = e3m0_values()[:8].double()  # 0, 1/64, ..., 1
    for start in range(0, values.numel(), bucket_size):
        bucket = values[start : start + bucket_size].double()
        scale = bucket.abs().max()
        candidates = grid * scale
        distance = (bucket.abs()[:, None] - candidates[None, :]).abs()
        # Ties: the larger magnitude (the last of the equally near candidates).
        best = (distance <= distance.min(dim=1, keepdim=True).values).int().cumsum(dim=1).argmax(dim=1)
        out[start : start + bucket_size] = (candidates[best] * bucket.sign()).float()
    return out


@pytest.mark.parametrize("numel,bucket_size", [(1, 256), (255, 256), (1000, 256), (4097, 64), (300, None)])
def test_every_entry_becomes_the_nearest_e3m0_value_of_its_buckets_scale(numel, bucket_size):
    g = _randn(numel, seed=numel) * torch.logspace(-3, 1, numel)  # magnitudes over four decades
    fp4 = FP4Compressor(bucket_size)
    decoded = fp4.decompress(fp4.compress(g, "w"))
    assert torch.equal(decoded, _nearest_e3m0(g, bucket_size or numel))
    # The largest entry of every bucket is exact, and no entry is off by more than a third of itself
    # (or, below the smallest level, by more than half of it).
    scale = g.abs().max()
    assert decoded.abs().max() == scale
    error = (decoded - g).abs()
    assert bool((error <= torch.maximum(g.abs() / 3, torch.full_like(g, 2.0**-7) * scale) + 1e-7 * scale).all())


def test_the_rounding_from_the_floats_bits_is_the_nearest_value_at_every_boundary():
    """Each ratio at and one ulp around a midpoint 1.5 * 2**k and the zero threshold 2**-7, and a stride of all."""
    points = torch.tensor([1.5 * 2.0**k for k in range(-7, 0)] + [2.0**-7, 2.0**-6, 1.0], dtype=torch.float32)
    bits = points.view(torch.int32)
    near = torch.cat([bits - 1, bits, bits + 1]).view(torch.float32).clamp(max=1.0)
    stride = torch.arange(0, 0x3F800000, 4099, dtype=torch.int32).view(torch.float32)  # every 4099th float in [0, 1)
    g = torch.cat([torch.ones(1), near, -near, stride, -stride])  # scale 1: each entry is its own ratio
    fp4 = FP4Compressor(None)
    assert torch.equal(fp4.decompress(fp4.compress(g, "w")), _nearest_e3m0(g, g.numel()))


def test_ties_go_away_from_zero_and_tiny_entries_to_zero():
    fp4 = FP4Compressor(None)
    g = torch.tensor([1.0, 0.75, -0.375, 2.0**-7, 0.99 * 2.0**-7, 0.0, -1.0])
    assert fp4.decompress(fp4.compress(g, "w")).tolist() == [1.0, 1.0, -0.5, 2.0**-6, 0.0, 0.0, -1.0]


@pytest.mark.parametrize("numel,bucket_size", [(1, 256), (1000, 256), (1001, 7), (256, None)])
def test_payload_bytes_are_the_scales_and_half_a_byte_per_entry_and_round_trip_the_wire(numel, bucket_size):
    fp4 = FP4Compressor(bucket_size)
    payload = fp4.compress(_randn(numel), "w")
    buckets = 1 if bucket_size is None else math.ceil(numel / bucket_size)
    assert payload.nbytes == fp4.payload_nbytes(numel) == 4 * buckets + math.ceil(numel / 2)
    wire = payload.to_wire()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    parsed = fp4.payload_from_wire(wire, numel)
    assert torch.equal(fp4.decompress(parsed), fp4.decompress(payload))
    with pytest.raises(ValueError, match=f"payload for {numel} elements"):
        fp4.payload_from_wire(wire[:-1], numel)


def test_gathered_payloads_are_decoded_and_summed_in_fp32():
    fp4 = FP4Compressor(64)
    assert fp4.combine is CombineMode.GATHER and fp4.stateless
    parts = [_randn(500, seed=s) for s in range(3)]
    payloads = [fp4.compress(p, "w") for p in parts]
    expected = sum(fp4.decompress(p) for p in payloads)
    assert torch.equal(fp4.aggregate(payloads), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_quantize_their_fp32_values(dtype):
    g = _randn(700).to(dtype)
    fp4 = FP4Compressor(128)
    decoded = fp4.decompress(fp4.compress(g, "w"))
    assert decoded.dtype == torch.float32
    assert torch.equal(decoded, fp4.decompress(fp4.compress(g.float(), "w")))


def test_zero_buckets_stay_zero_and_a_non_finite_bucket_decodes_to_nan():
    fp4 = FP4Compressor(4)
    g = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, float("inf"), 2.0, 3.0, float("nan"), 1.0, 1.0, 1.0, 1.0, -2.0, 0.5])
    decoded = fp4.decompress(fp4.compress(g, "w"))
    assert decoded[:4].tolist() == [0.0] * 4
    assert bool(decoded[4:12].isnan().all())
    assert decoded[12:].tolist() == [1.0, -2.0, 0.5]


@pytest.mark.parametrize("bucket_size", [0, -1, 2.5, True])
def test_bad_bucket_sizes_are_named(bucket_size):
    with pytest.raises(ValueError, match=f"bucket_size must be a positive integer or None, got {bucket_size!r}"):
        FP4Compressor(bucket_size)


# -- Streaming DiLoCo's exchange with 4-bit outer gradients, two gloo workers -------------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _streaming(rank: int, world: int, steps: int) -> dict:
    model = DDP(_net())
    state = CommunicationDelayState(
        CompressionHookState(FP4Compressor(64), min_numel=1, start_iter=0), delay=4, fragments=2
    )
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        state.after_optimizer_step()
        after = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        flat.append((before, after))
    return {"flat": flat, "stats": state.stats.as_dict()}


def test_two_workers_exchange_4_bit_outer_gradients_per_fragment_and_count_their_bytes():
    """H = 4 with two fragments (steps 2 and 4 of every 4), outer average: after each exchange the
    fragment's weights are ``W_sync + sum_i decode(quantize((W_i - W_sync) / 2))``, quantized piece by
    piece, and the allgathered bytes are the payloads' (with 2 workers a ring allgather sends one)."""
    steps = 8
    results = run_workers(_streaming, 2, steps)
    shapes = [(name, p.shape) for name, p in _net().named_parameters()]
    pieces = split_into_fragments(shapes, 2)
    offsets = {name: sum(math.prod(s) for _, s in shapes[:i]) for i, (name, _) in enumerate(shapes)}
    fp4 = FP4Compressor(64)
    synced = torch.cat([p.detach().reshape(-1) for p in _net().parameters()])
    payload = 0
    for step in range(steps):
        fragment = {1: 0, 3: 1, 5: 0, 7: 1}.get(step)
        if fragment is None:
            continue
        for piece in (p for p in pieces if p.fragment == fragment):
            where = slice(offsets[piece.name] + piece.entries.start, offsets[piece.name] + piece.entries.stop)
            update = sum(
                fp4.decompress(fp4.compress((r["flat"][step][0][where] - synced[where]) / 2, piece.key))
                for r in results
            )
            synced[where] += update
            payload += fp4.payload_nbytes(piece.numel)
            for r in results:
                assert torch.equal(r["flat"][step][1][where], synced[where]), (step, piece.key)
    for r in results:
        assert r["stats"]["payload_bytes"] == payload
        # Wire: the allgathered payloads plus the step guard's flags (a byte per piece and one).
        guard = sum(1 + sum(1 for p in pieces if p.fragment == f) for f in (0, 1, 0, 1))
        assert r["stats"]["wire_bytes_sent"] == payload + guard
