"""One message per step: a guarded step's header (flags, sizes, dense tensors, buffers) and its payloads.

Packing a step must change how many collectives carry it and nothing else: with two workers (a sum
of two numbers does not depend on its order) gradients, weights, compressor state, the step guard's
policy and the payloads' bytes are bitwise those of the bucket-by-bucket path; with three the dense
tensors' sums round as another ring order rounds them. And a test counts every method's collectives
per step.
"""

import pytest
import torch
from distributed import run_workers
from test_overlap import HELD_STEP_NAMES, NAN_LOSS_STEP, NAN_PARAM_STEP, STEPS, _assert_same_state, _train
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc
from lgc import ErrorFeedback, FP16Compressor, TopKCompressor
from lgc.compressors import DGCCompressor, SBCCompressor
from lgc.compressors.base import Payload
from lgc.ddp import CompressionHookState
from lgc.ddp import packed as packed_module
from lgc.ddp.buffers import AVERAGE, BROADCAST
from lgc.ddp.collectives import record_collectives
from lgc.ddp.exchange import wire_sizes
from lgc.methods import METHODS

SKIPPED = (NAN_PARAM_STEP, NAN_LOSS_STEP)


#: The steps compressed and not skipped (step 0 is the plain allreduce of ``start_iter``).
COMPRESSED = [step for step in range(1, STEPS) if step not in SKIPPED]


def _compare(a: dict, b: dict, name: str, exact: bool) -> None:
    assert a["skipped"] == b["skipped"] == 2
    assert a["nonfinite"] == b["nonfinite"]

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        if exact:
            return torch.equal(x.nan_to_num(), y.nan_to_num())
        return torch.allclose(x.nan_to_num(), y.nan_to_num(), rtol=1e-5, atol=1e-7)

    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
            assert (x is None) == (y is None) and (x is None or same(x, y)), (step, i)
    assert all(same(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    if not exact:
        return
    if name.startswith("dgc"):
        _assert_same_state(a["state"], b["state"])
        assert a["epochs"] == b["epochs"]
    elif name == "qsgd_alone":
        assert a["state"] == b["state"]
    else:
        assert a["state"]["compressor"] == b["state"]["compressor"]
        ra, rb = a["state"]["residuals"], b["state"]["residuals"]
        assert set(ra) == set(rb) and all(torch.equal(ra[key], rb[key]) for key in ra)


@pytest.mark.multiprocess
# Fixed-size payloads encoded after the header (top-k), and payloads encoded ahead of it into held
# state: variable sizes and DGC's momentum of the dense tensors, which rides in the header too. The
# other ways (SBC, random-block's summed payload, ...) run with -m slow.
@pytest.mark.parametrize(
    "name",
    [name if name == "topk" else pytest.param(name, marks=pytest.mark.slow) for name in HELD_STEP_NAMES],
)
def test_one_message_changes_the_collectives_and_nothing_else(name):
    """Two workers, unused parameters (on every rank, on one), a NaN in one layer, a NaN everywhere: bitwise."""
    bucketwise = run_workers(_train, 2, name, False, False)
    packed = run_workers(_train, 2, name, False, True)
    for rank in range(2):
        a, b = bucketwise[rank], packed[rank]
        _compare(a, b, name, exact=True)
        assert a["payload_bytes"] == b["payload_bytes"]
        # A compressed step is two collectives, whatever the number of buckets (three or more here);
        # the first one also broadcasts rank 0's seed where the compressor shares one (random-block).
        shares_seed = name.startswith("random_block")
        assert [b["traces"][step][1] for step in COMPRESSED] == [2 + shares_seed] + [2] * (len(COMPRESSED) - 1)
        assert all(a["traces"][step][1] >= 4 for step in COMPRESSED)
        # A skipped step: the header, then every bucket dense and unchanged.
        assert all(b["traces"][step][1] == 1 + b["buckets"] for step in SKIPPED)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dgc", "sbc"])
def test_one_message_with_three_workers_sums_the_dense_tensors_in_another_order(name):
    """Every rank's row of sizes lands where the others read it; the dense sums differ in rounding only."""
    bucketwise = run_workers(_train, 3, name, False, False)
    packed = run_workers(_train, 3, name, False, True)
    for rank in range(3):
        _compare(bucketwise[rank], packed[rank], name, exact=False)
        # Every rank decodes the same sums.
        for x, y in zip(packed[rank]["params"], packed[0]["params"], strict=True):
            assert torch.equal(x, y), rank


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 4)
    )


def _train_bn(rank: int, world: int, pack: bool, buffers: str) -> dict:
    net = _bn_net()
    model = DDP(net, bucket_cap_mb=0.01)
    state = CompressionHookState(ErrorFeedback(SBCCompressor(0.1)), min_numel=100, pack=pack, buffers=buffers)
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counts = []
    for step in range(5):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=gen) * (1 + rank), torch.randn(8, 4, generator=gen)
        with record_collectives() as trace:
            nn.functional.mse_loss(model(x), y).backward()
        counts.append(len(trace))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "buffers": {name: b.clone() for name, b in net.named_buffers()},
        "counts": counts,
        "stats": state.stats.as_dict(),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("buffers", [BROADCAST, pytest.param(AVERAGE, marks=pytest.mark.slow)])
def test_the_header_carries_the_module_buffers_as_their_own_sync_would(buffers):
    bucketwise = run_workers(_train_bn, 2, False, buffers)
    packed = run_workers(_train_bn, 2, True, buffers)
    for rank in range(2):
        a, b = bucketwise[rank], packed[rank]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        assert a["buffers"].keys() == b["buffers"].keys()
        assert all(torch.equal(a["buffers"][key], b["buffers"][key]) for key in a["buffers"]), rank
        assert b["counts"][1:] == [2, 2, 2, 2]  # header and payloads; the buffers' broadcasts are gone
        assert a["counts"][1] >= 2 + 2 + 2  # flags, per bucket dense and payloads (and sizes), two broadcasts
        assert b["stats"]["wire_buffer_bytes_sent"] > 0
        assert a["stats"]["payload_bytes"] == b["stats"]["payload_bytes"]
        assert a["stats"]["wire_dense_equivalent_bytes"] == b["stats"]["wire_dense_equivalent_bytes"]
    # Every rank ends with the same buffers: rank 0's (broadcast) or the mean (average).
    assert all(torch.equal(packed[0]["buffers"][k], packed[1]["buffers"][k]) for k in packed[0]["buffers"])


def test_sizes_travel_as_two_exact_digits():
    """A size past fp32's 2**24 integers, and one past a digit's 20 bits, come back exact from rank 1's row."""

    class Wire(Payload):
        def __init__(self, n: int) -> None:
            self.n = n

        def tensors(self) -> list[torch.Tensor]:
            return [torch.empty(0)]

        def wire_parts(self) -> list[torch.Tensor]:
            return [torch.empty(self.n, dtype=torch.uint8)]

        @property
        def nbytes(self) -> int:
            return self.n

    own = [Wire(3), Wire(2**20 + 7), Wire(2**25 + 2**21 + 1)]
    local = wire_sizes([p.wire_parts() for p in own])
    maxima = torch.tensor([1.0, 0.0, 2.0])
    header, layout = packed_module._header(True, maxima, [torch.ones(4)], [], None, local, world=3, rank=1)
    assert header.dtype == torch.float32 and header[0] == 0 and header[1:4].tolist() == [1.0, 0.0, 1.0]
    sizes = packed_module._sizes(header, layout, [0, 2], world=3)
    assert sizes[1].tolist() == [3, 2**25 + 2**21 + 1] and sizes[0].tolist() == sizes[2].tolist() == [0, 0]
    assert header[layout.dense : layout.buffers].tolist() == [1.0] * 4


def test_pack_is_refused_where_a_step_cannot_go_out_as_one_message():
    with pytest.raises(ValueError, match="pack=True .* overlap=True"):
        CompressionHookState(ErrorFeedback(TopKCompressor(0.1)), overlap=True, pack=True)
    with pytest.raises(ValueError, match="pack=True .* FP16Compressor"):
        CompressionHookState(FP16Compressor(), pack=True)
    with pytest.raises(TypeError, match="pack must be None, True or False, got 'yes'"):
        CompressionHookState(ErrorFeedback(TopKCompressor(0.1)), pack="yes")
    assert CompressionHookState(DGCCompressor(0.1), pack=True).packs
    assert not CompressionHookState(DGCCompressor(0.1), pack=False).packs
    assert not CompressionHookState(DGCCompressor(0.1), overlap=True).packs
    assert not CompressionHookState(FP16Compressor()).packs


#: Module buffers of :func:`_count_net`: BatchNorm's float statistics and its int64 batch counter,
#: broadcast one dtype at a time where the step does not carry them.
BUFFER_DTYPES = 2


def expected_collectives(name: str, buckets: int, mixed: int) -> int:
    """Collectives per steady step of ``name`` on :func:`_count_net` with 2 workers: ``buckets`` DDP
    buckets, ``mixed`` of them holding parameters sent dense and compressed (fp16's ``min_numel``)."""
    if name in ONE_MESSAGE:
        return 2  # the header (flags, sizes, dense tensors, buffers) and the payloads (lgc.ddp.packed)
    if name in ("none", "torch_fp16", "torch_bf16", "fp4"):
        # No state: each bucket's allreduce (fp4: allgather) as DDP hands it over, as DDP's own.
        return buckets + BUFFER_DTYPES
    if name == "fp16":  # one allreduce per dtype of a bucket: fp16 payloads, fp32 small tensors
        return buckets + mixed + BUFFER_DTYPES
    if name == "powersgd":  # the step guard, then per bucket P, Q and the rank-1 tensors (PyTorch's hook)
        return 1 + 3 * buckets + BUFFER_DTYPES
    if name == "batched_powersgd":  # one matrix per bucket: P and Q
        return 1 + 2 * buckets + BUFFER_DTYPES
    # LGC's family codes the whole model as one vector, whatever the buckets: the step guard, then
    # its stage's collectives (lgc.learned), then the buffers' broadcasts.
    return BUFFER_DTYPES + 1 + LGC_STAGE[name]


ONE_MESSAGE = ["topk", "dgc", "sbc", "redsync", "random_block", "qsgd", "terngrad", "signsgd"]
ONE_MESSAGE += ["chunked_topk", "sparseloco", "demo"]
#: The compressed stage's collectives: shared-index values and dense tensors (two allreduces; int8:
#: the leader's scales by two broadcasts and a third allreduce); LGC-RAR the leader's code by one
#: broadcast, then the latents' allreduce; LGC-PS a gather to the server, its reply by two broadcasts
#: and the dense tensors' allreduce.
LGC_STAGE = {
    **dict.fromkeys(["shared_topk", "leader_scaled"], 2),
    "shared_topk_int8": 5,
    **dict.fromkeys(["lgc_rar", "lgc_rar_linear", "lgc_rar_pca", "lgc_rar_paper"], 2),
    **dict.fromkeys(["lgc_ps", "lgc_ps_paper"], 4),
}
LGC_FAMILY = sorted(LGC_STAGE)
KINDS = False  # to debug: each step's collectives by kind instead of their number


def _count_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 100),
        nn.ReLU(),
        nn.Linear(100, 10),
    )


def _count(rank: int, world: int, names: list[str]) -> dict:
    counts, buckets, mixed = {}, None, None
    for name in names:
        model = DDP(_count_net(), bucket_cap_mb=0.03)
        needs_plain_sgd = METHODS[name].run_settings.get("optimizer", {}).get("momentum") == 0
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0 if needs_plain_sgd else 0.9)
        # One step per epoch: DGC's density warm-up (epochs) is over in a few steps; its steady step is the same.
        knobs: dict = {"steps_per_epoch": 1} if name == "dgc" else {}
        if name in LGC_FAMILY:  # short stages
            knobs = {"stages": {"warmup_steps": 2, "ae_steps": min(METHODS[name].cls.STAGES.ae_steps, 2)}}
        state = lgc.compress(model, name, optimizer=optimizer, **knobs)
        steady = state.steady_from(100)
        per_step = []
        for step in range(steady + 4):
            gen = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(8, 3, 8, 8, generator=gen), torch.randint(10, (8,), generator=gen)
            with record_collectives() as trace:
                nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            per_step.append(len(trace) if not KINDS else "+".join(call.kind for call in trace))
        # From the second steady step: the first may still rebuild DDP's buckets or share a seed.
        counts[name] = per_step[steady + 1 :]
        if name == "fp16":
            layouts = list(state.layouts.cached.values())
            buckets = len(layouts)
            mixed = sum(len({s.compressed for s in layout.segments}) == 2 for layout in layouts)
    return {"counts": counts, "buckets": buckets, "mixed": mixed}


@pytest.mark.multiprocess
def test_every_per_step_method_puts_its_steady_step_on_the_wire_in_as_many_collectives_as_listed():
    names = sorted(METHODS)  # every method runs every step (local steps are a comm option of any)
    assert set(ONE_MESSAGE) <= set(names) and set(LGC_FAMILY) <= set(names)
    result = run_workers(_count, 2, names)
    assert result[0] == result[1]
    buckets, mixed = result[0]["buckets"], result[0]["mixed"]
    assert buckets >= 2 and mixed >= 1
    expected = {name: {expected_collectives(name, buckets, mixed)} for name in names}
    assert {name: set(steps) for name, steps in result[0]["counts"].items()} == expected
