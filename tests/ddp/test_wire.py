"""Wire bytes: the formulas of :mod:`lgc.ddp.wire` against counting fakes of each collective.

The fakes below run each collective's algorithm message by message on real values among ``P``
simulated ranks (checking that every rank ends with the right result) and count what every rank
sends and receives. The formulas must give exactly those counts for P = 2, 3, 4. Then a 3-worker
gloo run checks that the hooks book, for every collective they issue, what the fake of that
collective counts.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import ErrorFeedback, NoneCompressor, TopKCompressor, register_compression_hook
from lgc.ddp import wire
from lgc.ddp.collectives import CommStats
from lgc.ddp.powersgd import PowerSGDHookState
from lgc.ddp.torch_hooks import TorchHookState
from lgc.learned.ps import LGCParameterServerState
from lgc.learned.rar import LGCRingAllreduceState

WORLDS = (2, 3, 4)


class Ranks:
    """``P`` simulated ranks that count the bytes of every message they send and receive."""

    def __init__(self, world: int, itemsize: int = 4) -> None:
        self.world, self.itemsize = world, itemsize
        self.sent = [0] * world
        self.received = [0] * world

    def message(self, src: int, dst: int, values: list[float]) -> list[float]:
        assert src != dst, "a rank never sends to itself"
        self.sent[src] += len(values) * self.itemsize
        self.received[dst] += len(values) * self.itemsize
        return list(values)

    def counts(self, rank: int) -> wire.WireBytes:
        return wire.WireBytes(self.sent[rank], self.received[rank])


def fake_ring_allreduce(inputs: list[list[float]], itemsize: int = 4) -> tuple[list[list[float]], Ranks]:
    """Reduce-scatter then allgather around the ring, chunk by chunk."""
    world, numel = len(inputs), len(inputs[0])
    ranks = Ranks(world, itemsize)
    sizes = wire.ring_chunks(numel, world)
    bounds = [sum(sizes[:c]) for c in range(world + 1)]
    data = [list(x) for x in inputs]

    def chunk(rank: int, c: int) -> slice:
        c %= world
        return slice(bounds[c], bounds[c + 1])

    for step in range(world - 1):  # reduce-scatter: rank r sends chunk r - step, adds what arrives
        outgoing = [ranks.message(r, (r + 1) % world, data[r][chunk(r, r - step)]) for r in range(world)]
        for r in range(world):
            src = (r - 1) % world
            where = chunk(src, src - step)
            data[r][where] = [a + b for a, b in zip(data[r][where], outgoing[src], strict=True)]
    for step in range(world - 1):  # allgather: rank r sends its finished chunk r + 1 - step onwards
        outgoing = [ranks.message(r, (r + 1) % world, data[r][chunk(r, r + 1 - step)]) for r in range(world)]
        for r in range(world):
            src = (r - 1) % world
            data[r][chunk(src, src + 1 - step)] = outgoing[src]
    return data, ranks


def fake_ring_allgather(inputs: list[list[float]], itemsize: int = 4) -> tuple[list[list[list[float]]], Ranks]:
    world = len(inputs)
    ranks = Ranks(world, itemsize)
    held: list[dict[int, list[float]]] = [{r: list(inputs[r])} for r in range(world)]
    for step in range(world - 1):  # rank r forwards the piece of rank r - step
        outgoing = [ranks.message(r, (r + 1) % world, held[r][(r - step) % world]) for r in range(world)]
        for r in range(world):
            src = (r - 1) % world
            held[r][(src - step) % world] = outgoing[src]
    return [[held[r][q] for q in range(world)] for r in range(world)], ranks


def fake_tree_broadcast(
    world: int, src: int, value: list[float], itemsize: int = 4
) -> tuple[list[list[float] | None], Ranks]:
    """Gloo's binomial tree (gloo/broadcast.cc): round i, virtual rank v < 2**i sends to v + 2**i."""
    ranks = Ranks(world, itemsize)
    held: list[list[float] | None] = [None] * world
    held[src] = list(value)
    dim = math.ceil(math.log2(world)) if world > 1 else 0
    for i in range(dim):
        for vrank in range(world):
            vpeer = vrank ^ (1 << i)
            if vrank < (1 << i) and vpeer < world:
                rank, peer = (vrank + src) % world, (vpeer + src) % world
                assert held[rank] is not None and held[peer] is None
                held[peer] = ranks.message(rank, peer, held[rank])
    return held, ranks


def fake_pipeline_broadcast(world: int, src: int, value: list[float]) -> tuple[list[list[float] | None], Ranks]:
    ranks = Ranks(world)
    held: list[list[float] | None] = [None] * world
    held[src] = list(value)
    for hop in range(world - 1):
        rank = (src + hop) % world
        held[(rank + 1) % world] = ranks.message(rank, (rank + 1) % world, held[rank])
    return held, ranks


def fake_flat_gather(inputs: list[list[float]], dst: int, itemsize: int = 4) -> tuple[list[list[float]], Ranks]:
    ranks = Ranks(len(inputs), itemsize)
    gathered = [list(x) if r == dst else ranks.message(r, dst, x) for r, x in enumerate(inputs)]
    return gathered, ranks


def _inputs(world: int, numel: int) -> list[list[float]]:
    return [[float(100 * r + i) for i in range(numel)] for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 7, 1000, 1001])
def test_ring_allreduce_formula_counts_what_the_ring_sends(world, numel):
    inputs = _inputs(world, numel)
    results, ranks = fake_ring_allreduce(inputs, itemsize=2)
    expected = [sum(column) for column in zip(*inputs, strict=True)] if numel else []
    assert all(result == expected for result in results)
    for rank in range(world):
        assert wire.ring_allreduce(numel, 2, world, rank) == ranks.counts(rank)
    # 2 (P - 1) / P of the message per worker on average, exactly in total.
    assert sum(ranks.sent) == 2 * (world - 1) * numel * 2


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("numel", [0, 3, 64])
def test_ring_allgather_formula_counts_what_the_ring_sends(world, numel):
    inputs = _inputs(world, numel)
    results, ranks = fake_ring_allgather(inputs)
    assert all(result == inputs for result in results)
    for rank in range(world):
        assert wire.ring_allgather(4 * numel, world, rank) == ranks.counts(rank)


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_formulas_count_what_the_tree_and_the_pipeline_send(world):
    value = [1.0, 2.0, 3.0]
    for src in range(world):
        for fake, formula in (
            (fake_tree_broadcast, wire.tree_broadcast),
            (fake_pipeline_broadcast, wire.pipeline_broadcast),
        ):
            held, ranks = fake(world, src, value)
            assert all(h == value for h in held)
            for rank in range(world):
                assert formula(12, world, rank, src) == ranks.counts(rank)
            assert sum(ranks.sent) == (world - 1) * 12  # each rank but the source receives one copy
    # The tree's root sends ceil(log2 P) copies: 1, 2, 2 for P = 2, 3, 4.
    assert wire.tree_broadcast(12, world, 0, 0).sent == 12 * math.ceil(math.log2(world))


@pytest.mark.parametrize("world", WORLDS)
def test_gather_formula_counts_what_every_rank_sends_to_the_root(world):
    inputs = _inputs(world, 5)
    for dst in range(world):
        gathered, ranks = fake_flat_gather(inputs, dst)
        assert gathered == inputs
        for rank in range(world):
            assert wire.flat_gather(20, world, rank, dst) == ranks.counts(rank)


def test_a_single_worker_sends_nothing_and_bad_ranks_are_refused():
    assert wire.ring_allreduce(1000, 4, 1, 0) == (0, 0)
    assert wire.ring_allgather(1000, 1, 0) == (0, 0)
    assert wire.tree_broadcast(1000, 1, 0, 0) == (0, 0)
    with pytest.raises(ValueError, match="rank 3 is not in a group of 3"):
        wire.ring_allreduce(10, 4, 3, 3)


def test_headline_ratio_is_wire_based_and_the_logical_one_is_kept():
    # Top-k's allgather of 1/8 of the gradient among 4 workers: the logical ratio says 8x, the
    # wire 2 (P - 1) / P / (P - 1) * 8 = 4x less than a dense ring allreduce.
    stats = CommStats(
        bytes_sent=100,
        dense_equivalent_bytes=800,
        wire_bytes_sent=300,
        wire_dense_equivalent_bytes=1200,
    )
    assert stats.logical_compression_ratio == 8.0
    assert stats.compression_ratio == 4.0
    assert math.isnan(CommStats().compression_ratio)
    assert {"compression_ratio", "logical_compression_ratio", "wire_bytes_sent"} <= set(stats.as_dict())


# -- the hooks book what each collective they issue sends ------------------------------------------


def _fake_counts(record: dict, world: int, rank: int) -> wire.WireBytes:
    """What the fake of the recorded collective counts for ``rank``."""
    numel, itemsize, kind = record["numel"], record["itemsize"], record["kind"]
    zeros = [[0.0] * numel] * world
    if kind == "all_reduce":
        return fake_ring_allreduce(zeros, itemsize)[1].counts(rank)
    if kind == "all_gather":
        return fake_ring_allgather(zeros, itemsize)[1].counts(rank)
    if kind == "broadcast":
        return fake_tree_broadcast(world, record["peer"], zeros[0], itemsize)[1].counts(rank)
    if kind == "gather":
        return fake_flat_gather(zeros, record["peer"], itemsize)[1].counts(rank)
    if kind in ("send", "isend"):
        return wire.WireBytes(numel * itemsize, 0)
    assert kind in ("recv", "irecv")
    return wire.WireBytes(0, numel * itemsize)


_COLLECTIVES = {
    "all_reduce": None,
    "all_gather": None,
    "broadcast": "src",
    "gather": "dst",
    "send": "dst",
    "recv": "src",
    "isend": "dst",
    "irecv": "src",
}


def _record_collectives(log: list[dict]) -> None:
    """Wrap torch.distributed's collectives so every call is recorded with its size and root."""
    for kind, peer in _COLLECTIVES.items():
        original = getattr(dist, kind)

        def recording(*args, _original=original, _kind=kind, _peer=peer, **kwargs):
            bound = inspect.signature(_original).bind(*args, **kwargs).arguments
            tensor = bound["tensor"]
            record = {"kind": _kind, "numel": tensor.numel(), "itemsize": tensor.element_size()}
            if _peer is not None:
                record["peer"] = bound[_peer]
            log.append(record)
            return _original(*args, **kwargs)

        setattr(dist, kind, recording)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))


def _book_like_the_fakes(rank: int, world: int) -> dict:
    results = {}
    states = {
        "none": lambda: NoneCompressor(),
        "topk": lambda: ErrorFeedback(TopKCompressor(0.05)),
        "torch_fp16": lambda: TorchHookState("fp16"),
        "powersgd": lambda: PowerSGDHookState(matrix_approximation_rank=1, start_powerSGD_iter=2),
        "lgc_rar": lambda: LGCRingAllreduceState(
            density=0.05, stages=_SHORT, min_numel=100, leaders={"index_coding": "golomb"}, training=_SMALL_AE
        ),
        "lgc_ps": lambda: LGCParameterServerState(
            density=0.05, innovation_density=0.01, stages=_SHORT, min_numel=100, leaders={"rank": 1}, training=_SMALL_AE
        ),
    }
    for name, make in states.items():
        model = DDP(_net(), bucket_cap_mb=0.005)
        made = make()
        if isinstance(made, (NoneCompressor, ErrorFeedback)):
            state = register_compression_hook(model, made, min_numel=100)
        else:
            state = made
            state.register(model)
        log: list[dict] = []
        originals = {kind: getattr(dist, kind) for kind in _COLLECTIVES}
        _record_collectives(log)
        try:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(8):
                x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
        finally:
            for kind, original in originals.items():
                setattr(dist, kind, original)
        expected_sent = expected_received = 0
        for record in log:
            counts = _fake_counts(record, world, rank)
            expected_sent += counts.sent
            expected_received += counts.received
        results[name] = {
            "stats": state.stats.as_dict(),
            "expected_sent": expected_sent,
            "expected_received": expected_received,
            "kinds": sorted({record["kind"] for record in log}),
            "numels": [p.numel() for p in model.parameters()],
        }
    return results


_SMALL_AE = dict(
    autoencoder=dict(chunk=32, encoder_channels=[8, 8], decoder_channels=[8, 8], latent_channels=2),
    batch_size=16,
)
_SHORT = {"warmup_steps": 2, "ae_steps": 3}


@pytest.mark.multiprocess
def test_hooks_book_on_the_wire_what_each_of_their_collectives_sends_with_three_workers():
    results = run_workers(_book_like_the_fakes, 3)
    for rank, per_method in enumerate(results):
        for name, result in per_method.items():
            stats = result["stats"]
            assert stats["wire_bytes_sent"] == result["expected_sent"], (rank, name)
            assert stats["wire_bytes_received"] == result["expected_received"], (rank, name)
        # Dense DDP through the hook: the wire bytes are exactly a dense ring allreduce's.
        dense = per_method["none"]["stats"]
        assert dense["wire_bytes_sent"] == dense["wire_dense_equivalent_bytes"]
        assert dense["compression_ratio"] == 1.0
        # Top-k's allgather costs (P - 1) L on the wire: with 3 workers the logical ratio
        # overstates the wire ratio.
        topk = per_method["topk"]["stats"]
        assert "all_gather" in per_method["topk"]["kinds"]
        assert topk["compression_ratio"] < topk["logical_compression_ratio"]
        # LGC-PS exercised every kind of collective: leader 1 sends its message to the server (0).
        point_to_point = {0: {"irecv"}, 1: {"isend"}, 2: set()}[rank]
        assert {"all_reduce", "broadcast", "gather"} | point_to_point <= set(per_method["lgc_ps"]["kinds"])
        assert "broadcast" in per_method["lgc_rar"]["kinds"]
