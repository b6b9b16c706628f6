"""lgc.compress on FSDP2 models (fully_shard) over gloo: stock equality, DDP equality, bytes, the step guard."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import lgc
from lgc.ddp import wire
from lgc.fsdp import GroupLayout

STEPS = 4


def _net(seed: int = 0) -> torch.nn.Module:
    """Two sharded blocks and a root: weights over min_numel (compressed), biases under it (dense), odd row counts."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 37), torch.nn.ReLU(), torch.nn.Linear(37, 45), torch.nn.ReLU(), torch.nn.Linear(45, 3)
    )


def _shard(net: torch.nn.Module) -> torch.nn.Module:
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    return net


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 40, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _train(model: torch.nn.Module, rank: int, steps: int | None = None, poison: int | None = None) -> None:
    steps = STEPS if steps is None else steps
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(rank, step)
        if poison == step and rank == 1:
            x[0, 0] = float("nan")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if poison == step:
            continue  # what a GradScaler does with a non-finite step
        opt.step()


def rank_grads(net: torch.nn.Module, world: int, step: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's gradient of ``net`` on its batch of ``step``, computed in this process (for transcriptions)."""
    grads = []
    for r in range(world):
        net.zero_grad()
        x, y = _batch(r, step)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        grads.append({name: p.grad.clone() for name, p in net.named_parameters()})
    return grads


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (allgathered from its shards), on every rank."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _stock_and_none(rank: int, world: int) -> tuple[dict, dict, dict]:
    stock = _shard(_net())
    _train(stock, rank)
    dense = _shard(_net())
    state = lgc.compress(dense, "none")
    _train(dense, rank)
    return _full(stock), _full(dense), state.stats.as_dict()


def test_none_is_stock_fsdp2_bit_for_bit_and_counts_its_reduce_scatters():
    world = 2
    # Each parameter group's reduce-scatter input: its parameters padded on dim 0 to whole chunks of the world.
    inputs = [sum(-(-p.shape[0] // world) * world * p[0].numel() for p in block.parameters()) for block in _net()[::2]]
    for rank, (stock, dense, stats) in enumerate(run_workers(_stock_and_none, world)):
        for name in stock:
            assert torch.equal(stock[name], dense[name]), name
        assert stats["hook_calls"] == 3 * STEPS, "one reduce-scatter per parameter group per step"
        # gloo runs a reduce-scatter as an allreduce of the whole input: a ring's 2 (P - 1) / P of it.
        expected = STEPS * sum(wire.ring_allreduce(n, 4, world, rank).sent for n in inputs)
        assert stats["wire_bytes_sent"] == stats["wire_dense_equivalent_bytes"] == expected
        assert stats["compression_ratio"] == 1.0


#: Every per-step lgc method FSDP2 runs, with knobs that make it compress this small model.
FOLLOWERS = {
    "topk": {"density": 0.05},
    "signsgd": {},
    "sbc": {"density": 0.05},
    "redsync": {"density": 0.05},
    "random_block": {"density": 0.05},  # shared offsets: the payloads summed
    "chunked_topk": {},
    "sparseloco": {},
    "demo": {},
    "dgc": {"density": 0.05, "steps_per_epoch": 2, "weight_decay": 0.0},
    "qsgd": {},
    "terngrad": {},
    "fp4": {},
    "fp16": {},
}


#: The quantizers, by name: method and knobs. Under FSDP2 each rank codes every chunk of a gradient on its own and
#: sends it to the rank that owns it (codes_shards), so their runs follow the transcription below, not the DDP
#: hook's. int8 is QSGD at 127 levels (8-bit codes), bf16 lgc's fp16 hook in bfloat16.
QUANTIZERS = {
    "signsgd": ("signsgd", {}),
    "qsgd": ("qsgd", {}),
    "int8": ("qsgd", {"levels": 127}),
    "terngrad": ("terngrad", {}),
    "fp4": ("fp4", {}),
    "fp16": ("fp16", {}),
    "bf16": ("fp16", {"dtype": "bfloat16"}),
}
#: The methods whose FSDP2 run is the DDP hook's, bit for bit: each selects on (or codes) the whole gradient.
SELECTORS = tuple(m for m in FOLLOWERS if m not in {method for method, _ in QUANTIZERS.values()})


def ddp_and_sharded(rank: int, shard=None, methods=tuple(FOLLOWERS), **mesh: Any) -> dict[str, tuple]:
    """Every follower trained under DDP and sharded (``shard``, default :func:`_shard`; ``mesh``: ``lgc.compress``'s
    mesh settings): per method, DDP's weights, the sharded run's, both runs' residuals and statistics."""
    runs = {}
    for method in methods:
        knobs = FOLLOWERS[method]
        ddp = DistributedDataParallel(_net())
        ddp_state = lgc.compress(ddp, method, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1), **knobs)
        _train(ddp, rank)
        fsdp = (shard or _shard)(_net())
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        fsdp_state = lgc.compress(fsdp, method, optimizer=opt, **mesh, **knobs)
        _train(fsdp, rank)
        residuals = [
            {k: v.clone() for k, v in state.compressor.residual_store().items()} for state in (ddp_state, fsdp_state)
        ]
        full = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
        runs[method] = (full, _full(fsdp), residuals, [s.stats.as_dict() for s in (ddp_state, fsdp_state)])
    return runs


@pytest.fixture(scope="module")
def followed() -> list[dict[str, tuple]]:
    return run_workers(_ddp_and_fsdp, 2)


def _ddp_and_fsdp(rank: int, world: int) -> dict[str, tuple]:
    return ddp_and_sharded(rank, methods=SELECTORS)


@pytest.mark.parametrize("method", sorted(SELECTORS))
def test_a_compressor_selects_on_the_whole_gradient_and_follows_its_ddp_trajectory(followed, method):
    """Each rank compresses every parameter's full unsharded gradient, keyed by name, as the DDP hook does:
    parameters, residuals and payload bytes equal the DDP run's, bit for bit (the dense small tensors are
    summed divided by the world size, as the DDP hook sums them)."""
    for runs in followed:
        ddp, fsdp, (ddp_res, fsdp_res), (ddp_stats, fsdp_stats) = runs[method]
        assert ddp.keys() == fsdp.keys()
        for name in ddp:
            assert torch.equal(fsdp[name], ddp[name]), name
        assert ddp_res.keys() == fsdp_res.keys()
        for key in ddp_res:
            assert torch.equal(fsdp_res[key], ddp_res[key]), key
        assert fsdp_stats["payload_bytes"] == ddp_stats["payload_bytes"] > 0
        assert fsdp_stats["skipped_steps"] == 0


def _quantized(rank: int, world: int) -> dict[str, tuple]:
    """Each quantizer trained under FSDP2, and its transcription: every rank's compressor copied before the first
    step, each rank's gradient (all ranks' batches are known here) cut into the owners' dim-0 chunks, chunk ``j``
    coded by rank ``r``'s copy under ``name@j``, the codes of a chunk decoded and summed in fp32; parameters under
    min_numel averaged dense; the first step (start_iter) dense. Beside them, the bytes this rank's payload
    all-to-alls sent (the collectives' own booking) and the bytes of the transcription's codes of the chunks this
    rank does not own."""
    import copy

    from lgc.ddp import collectives
    from lgc.fsdp.reduce_scatter import codes_shards

    booked = collectives.book_all_to_all
    runs = {}
    for label, (method, knobs) in QUANTIZERS.items():
        model = _shard(_net())
        state = lgc.compress(model, method, **knobs)
        assert codes_shards(state.compressor), label
        copies = [copy.deepcopy(state.compressor) for _ in range(world)]
        payload_sent = []

        def book(stats, input, input_splits, output_splits, group, payload_sent=payload_sent):
            if input.dtype == torch.uint8:  # the payloads (their sizes go first, in int64)
                payload_sent.append(sum(n for i, n in enumerate(input_splits) if i != rank))
            booked(stats, input, input_splits, output_splits, group)

        collectives.book_all_to_all = book
        try:
            _train(model, rank)
        finally:
            collectives.book_all_to_all = booked
        to_others = 0
        reference = _net()
        for step in range(STEPS):
            grads = rank_grads(reference, world, step)
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    if step == 0 or p.numel() < state.min_numel:
                        p -= 0.1 * sum(g[name] / world for g in grads)
                        continue
                    rows = -(-p.shape[0] // world)
                    total = torch.zeros(p.numel())
                    for j in range(world):
                        lo, hi = j * rows * p[0].numel(), min(p.numel(), (j + 1) * rows * p[0].numel())
                        for r, compressor in enumerate(copies):
                            compressor.set_rank(r)
                            compressor.set_world_size(world)
                            compressor.begin_step(step)
                            share = (grads[r][name] / world).reshape(-1)[lo:hi].contiguous()
                            payload = compressor.compress(share, f"{name}@{j}")
                            if r == rank and j != rank:
                                to_others += payload.to_wire().numel()
                            total[lo:hi] += compressor.decompress(payload)
                    p -= 0.1 * total.view_as(p)
        runs[label] = (
            _full(model),
            {n: p.detach().clone() for n, p in reference.named_parameters()},
            state.stats.as_dict(),
            (sum(payload_sent), to_others),
        )
    return runs


@pytest.fixture(scope="module")
def quantized() -> list[dict[str, tuple]]:
    return run_workers(_quantized, 2)


@pytest.mark.parametrize("label", QUANTIZERS)
def test_a_quantizer_codes_each_chunk_for_its_owner_as_the_transcription_does(quantized, label):
    """Each rank's chunk of a gradient is coded on its own (its own scale and rounding, its own residual) and goes
    only to the rank that owns it: the weights are the transcription's, and the payload all-to-alls carry exactly
    the codes of the chunks the rank does not own, ``(P - 1) / P`` of its coded gradient, less than a dense
    reduce-scatter."""
    for runs in quantized:
        weights, expected, stats, (sent, to_others) = runs[label]
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-6, msg=name)
        assert sent == to_others > 0
        assert stats["wire_bytes_sent"] < stats["wire_dense_equivalent_bytes"]


def _guarded(rank: int, world: int) -> tuple[dict, dict, int]:
    poisoned = _shard(_net())
    state = lgc.compress(poisoned, "topk", density=0.05)
    _train(poisoned, rank, steps=STEPS + 1, poison=1)
    clean = _shard(_net())
    clean_state = lgc.compress(clean, "topk", density=0.05)
    opt = torch.optim.SGD(clean.parameters(), lr=0.1)
    for step in [0, 2, 3, 4]:
        x, y = _batch(rank, step)
        loss = torch.nn.functional.cross_entropy(clean(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert clean_state.iteration == state.iteration == STEPS
    store = {k: v.clone() for k, v in state.compressor.residual_store().items()}
    clean_store = {k: v.clone() for k, v in clean_state.compressor.residual_store().items()}
    return (_full(poisoned), store), (_full(clean), clean_store), state.stats.skipped_steps


def test_a_step_with_a_nan_on_one_rank_leaves_every_residual_as_it_was():
    """A NaN in the first layer's input reaches every group's gradient on rank 1; the step is skipped whole,
    the held state dropped, so the run equals one that never saw the step."""
    for (poisoned, store), (clean, clean_store), skipped in run_workers(_guarded, 2):
        assert skipped == 1
        for name in clean:
            assert torch.equal(poisoned[name], clean[name]), name
        for key in clean_store:
            assert torch.equal(store[key], clean_store[key]), key


def test_the_layout_rebuilds_each_gradient_from_fsdp2s_chunks():
    """chunk_cat's layout (each gradient padded on dim 0 to whole chunks, row r = rank r's chunks) round trips."""
    world = 3
    grads = {"a": torch.randn(7, 5), "b": torch.randn(2), "c": torch.randn(10, 1, 2)}
    layout = GroupLayout([(k, tuple(v.shape)) for k, v in grads.items()], world, min_numel=3)
    padded = [
        torch.cat([g, g.new_zeros(-(-g.shape[0] // world) * world - g.shape[0], *g.shape[1:])]) for g in grads.values()
    ]
    rows = torch.cat([p.reshape(world, -1) for p in padded], dim=1)
    assert rows.shape == (world, layout.row)
    out = torch.empty(layout.unsharded_numel())
    segments = layout.gather_unsharded(rows, out)
    assert [(s.name, s.compressed) for s in segments] == [("a", True), ("b", False), ("c", True)]
    for s in segments:
        assert torch.equal(out[s.offset : s.offset + s.numel], grads[s.name].reshape(-1))
    for rank in range(world):
        output = torch.full((layout.row,), float("nan"))
        layout.scatter_own(out, output, rank)
        assert torch.equal(output, rows[rank])


def test_a_reduce_scatter_is_booked_as_the_backend_runs_it(monkeypatch):
    from types import SimpleNamespace

    from lgc.ddp import collectives

    cpu, cuda = SimpleNamespace(is_cuda=False), SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(collectives, "_on_nccl", lambda group: False)
    assert collectives._reduce_scatter_algorithm(cpu, None) is wire.ring_allreduce
    assert collectives._reduce_scatter_algorithm(cuda, None) is wire.ring_allreduce
    monkeypatch.setattr(collectives, "_on_nccl", lambda group: True)
    assert collectives._reduce_scatter_algorithm(cuda, None) is wire.ring_reduce_scatter
    assert collectives._reduce_scatter_algorithm(cpu, None) is wire.ring_allreduce
    assert wire.ring_reduce_scatter(12, 4, 3, 0) == wire.WireBytes(32, 32)
    assert sum(wire.ring_reduce_scatter(10, 4, 3, r).sent for r in range(3)) == 2 * 40
    assert wire.ring_reduce_scatter(10, 4, 1, 0) == wire.WireBytes(0, 0)


def refusals(attempts: list) -> list[str]:
    """The message of the ValueError each attempt raises (each must raise one)."""
    messages = []
    for attempt in attempts:
        with pytest.raises(ValueError) as info:
            attempt()
        messages.append(str(info.value))
    return messages


def _refusals(rank: int, world: int) -> list[str]:
    settings = [
        ("topk", {"overlap": True}),
        ("topk", {"delay": 4}),
        ("powersgd", {}),
        ("lgc_rar", {}),
        ("dgc", {"steps_per_epoch": 2}),  # its own weight decay, 5e-4 by default
    ]
    attempts = [
        lambda method=method, kwargs=kwargs: lgc.compress(_shard(_net()), method, **kwargs)
        for method, kwargs in settings
    ]
    attempts.append(lambda: lgc.compress(_shard(_net()), "topk", process_group=dist.group.WORLD))
    return refusals(attempts)


def test_ddp_only_settings_and_methods_are_refused_naming_them():
    messages = run_workers(_refusals, 2)[0]
    assert len(messages) == 6
    assert "overlap" in messages[0] and "delay" in messages[1]
    assert "DistributedDataParallel" in messages[2] and "replicate=mesh['replicate']" in messages[3]
    assert "weight_decay=0.0005" in messages[4] and "compressor.weight_decay=0 optimizer.weight_decay" in messages[4]
    assert "mesh" in messages[5]


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """The optimizer steps ``steps`` on this rank's batches of those steps."""
    for step in steps:
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _resumed(rank: int, world: int, path: str, hybrid: bool = False, method: str = "topk") -> tuple[dict, dict]:
    """Three steps, a DCP save, three more; then a fresh model loads the save and takes the three again.

    ``hybrid``: a 2 x 2 mesh, sharded over its shard dimension, lgc's all-reduce across its replicas. ``method``: a
    key of :data:`FOLLOWERS` (its knobs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lgc.fsdp import PerRankState

    def run(model, opt, steps):
        run_steps(model, opt, rank, steps)

    def build():
        if hybrid:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            model = _net()
            for block in (model[0], model[2], model):
                fully_shard(block, mesh=mesh["shard"])
            replicate = {"replicate": mesh["replicate"]}
        else:
            model, replicate = _shard(_net()), {}
        # DGC applies the momentum itself (momentum correction).
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if method == "dgc" else 0.9)
        return model, opt, lgc.compress(model, method, optimizer=opt, **FOLLOWERS[method], **replicate)

    model, opt, state = build()
    run(model, opt, range(3))
    weights, optim = get_state_dict(model, opt)
    dcp.save({"model": weights, "optim": optim, "lgc": PerRankState(state)}, checkpoint_id=path)
    run(model, opt, range(3, 6))
    straight = (_full(model), {k: v.clone() for k, v in state.compressor.residual_store().items()})

    model, opt, state = build()
    assert not state.compressor.residual_store()
    weights, optim = get_state_dict(model, opt)
    saved = {"model": weights, "optim": optim, "lgc": PerRankState(state)}
    dcp.load(saved, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    assert state.iteration == 3
    run(model, opt, range(3, 6))
    return straight, (_full(model), {k: v.clone() for k, v in state.compressor.residual_store().items()})


def assert_resumed_exactly(results: list) -> None:
    """Every rank's ``((weights, residuals), (resumed weights, resumed residuals))``: equal, bit for bit, and some
    residuals."""
    for (weights, residuals), (resumed, resumed_residuals) in results:
        for name in weights:
            assert torch.equal(weights[name], resumed[name]), name
        assert residuals.keys() == resumed_residuals.keys() and residuals
        for key in residuals:
            assert torch.equal(residuals[key], resumed_residuals[key]), key


@pytest.mark.parametrize(
    ("hybrid", "method"),
    [
        (False, "topk"),
        # DGC's momentum and accumulator; EF-signSGD's residual of each chunk it codes (name@chunk).
        (False, "dgc"),
        (False, "signsgd"),
        pytest.param(True, "topk", marks=pytest.mark.slow),
    ],
    ids=["fsdp-topk", "fsdp-dgc", "fsdp-signsgd", "hsdp-topk"],
)
def test_a_distributed_checkpoint_resumes_bit_for_bit(tmp_path, hybrid, method):
    """DCP with the model, the optimizer and every rank's own residuals (PerRankState): the resumed run is the
    straight run's, bit for bit, though the ranks' residuals differ."""
    results = run_workers(_resumed, 4 if hybrid else 2, str(tmp_path / "ckpt"), hybrid, method)
    assert_resumed_exactly(results)
    first, second = results[0][0][1], results[1][0][1]
    assert any(not torch.equal(first[k], second[k]) for k in first), "each rank has residuals of its own"


class _Branchy(torch.nn.Module):
    """A body, a head and a branch that no rank uses (its gradient stays None under stock FSDP2)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(40, 45)
        self.head = torch.nn.Linear(45, 3)
        self.unused = torch.nn.Linear(45, 40)

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        hidden = torch.relu(self.body(x))
        out = self.head(hidden)
        return out + self.unused(hidden)[:, :3] if use_unused else out


def _branchy(policy=None) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    net = _Branchy()
    policy = policy or MixedPrecisionPolicy()
    fully_shard(net.body, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    return net


def _unused_everywhere(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for method in ("stock", "none", "topk"):
        net = _branchy()
        before = net.unused.weight.full_tensor().clone()
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
        if method != "stock":
            lgc.compress(net, method, optimizer=opt, **({"density": 0.05} if method == "topk" else {}))
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            assert net.unused.weight.grad is None, "a parameter without a gradient anywhere keeps None"
            opt.step()
        out[method] = (_full(net), torch.equal(before, net.unused.weight.full_tensor()))
    # bf16 parameters reduced in fp32, two micro-batches accumulated, the branch unused in both.
    net = _branchy(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    state = lgc.compress(net, "topk", density=0.05)
    train_micro_batches(net, rank)
    out["accumulated"] = (state.iteration, state.stats.payload_bytes)
    return out


def train_micro_batches(net: torch.nn.Module, rank: int, steps: int = STEPS) -> None:
    """``steps`` SGD steps of two micro-batches each, FSDP2 reducing once a step (at the second); the branch of
    :class:`_Branchy` unused in both, its gradient None at every step."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        for micro in range(2):
            net.set_requires_gradient_sync(micro == 1)
            x, y = _batch(rank, 10 * step + micro)
            torch.nn.functional.cross_entropy(net(x), y).backward()
        assert net.unused.weight.grad is None, "a parameter without a gradient anywhere keeps None"
        opt.step()
        opt.zero_grad()


def test_a_parameter_without_a_gradient_on_every_rank_is_left_out_as_stock_fsdp2_leaves_it():
    """Its .grad stays None (AdamW's weight decay leaves it alone), none stays stock FSDP2 bit for bit, and
    accumulation in bf16 reduced in fp32 runs with the branch unused in every micro-batch."""
    for out in run_workers(_unused_everywhere, 2):
        for method in ("stock", "none", "topk"):
            assert out[method][1], f"{method}: the unused branch moved"
        for name, p in out["stock"][0].items():
            assert torch.equal(p, out["none"][0][name]), name
        iterations, payload = out["accumulated"]
        assert iterations == STEPS and payload > 0


def test_a_forward_while_a_step_is_open_drops_what_the_step_held():
    """A backward that raised after some groups reduced never reaches the step's end: the next forward pass
    drops the state those groups held (residuals as before the step) and opens the next step afresh."""
    from lgc.compressors import ErrorFeedback, TopKCompressor
    from lgc.ddp import CompressionHookState
    from lgc.fsdp import FSDPCompression

    state = CompressionHookState(ErrorFeedback(TopKCompressor(0.5)))
    compression = FSDPCompression(state)
    state.compressor.compress(torch.ones(4), "w")
    before = state.compressor.residuals["w"].clone()
    state.compressor.compress_pending(torch.arange(4.0), "w")
    compression.in_step, compression.compressing, state.begun_step = True, True, 7
    compression._before_forward(torch.nn.Identity(), ())
    assert not compression.in_step and state.begun_step == -1
    state.compressor.commit(frozenset({"w"}))
    assert torch.equal(state.compressor.residuals["w"], before), "the held step was dropped, not committed"


def _alone(rank: int, world: int) -> str:
    with pytest.raises(ValueError, match="one rank reduces nothing") as err:
        lgc.compress(_shard(_net()), "topk")
    return str(err.value)


def test_one_rank_is_refused_rather_than_compressing_nothing():
    assert "two or more ranks" in run_workers(_alone, 1)[0]


def _used_on_one_rank(rank: int, world: int) -> str:
    net = _Branchy()
    fully_shard(net.body)
    fully_shard(net)
    # From the first step: the dense start is stock FSDP2's reduce-scatter, which would not match either.
    lgc.compress(net, "topk", density=0.05, start_iter=0)
    for step in range(2):
        x, y = _batch(rank, step)
        try:
            torch.nn.functional.cross_entropy(net(x, use_unused=rank == 0), y).backward()
        except RuntimeError as err:
            return str(err)
    return "no error"


def test_a_parameter_used_on_some_ranks_only_is_refused_naming_it_and_the_fix():
    """Without set_reduce_scatter_unused_params the ranks' reduce-scatters differ (stock FSDP2's would not match
    either): the step guard's flags, of one length on every rank, tell every rank, which refuses."""
    for message in run_workers(_used_on_one_rank, 2):
        assert "unused.weight" in message and "set_reduce_scatter_unused_params(True)" in message


def _normed(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 37), torch.nn.BatchNorm1d(37), torch.nn.ReLU(), torch.nn.Linear(37, 3)
    )


def _buffers_kept(rank: int, world: int) -> dict[str, tuple]:
    ddp = DistributedDataParallel(_normed())
    lgc.compress(ddp, "topk", density=0.05)
    _train(ddp, rank)
    runs = {"ddp": (dict(ddp.module.named_buffers()), {n: p.detach() for n, p in ddp.module.named_parameters()}, 0)}
    for buffers in (None, "broadcast"):
        model = _normed()
        fully_shard(model[0])
        fully_shard(model)
        state = lgc.compress(model, "topk", density=0.05, buffers=buffers)
        _train(model, rank)
        runs[str(buffers)] = (dict(model.named_buffers()), _full(model), state.stats.wire_buffer_bytes_sent)
    return runs


def test_module_buffers_are_each_ranks_own_unless_kept_in_step_as_under_ddp():
    """buffers='broadcast' keeps BatchNorm's statistics as lgc's DDP hook keeps them (rank 0's, once per step,
    counted): weights and buffers bitwise the DDP run's. Without it each rank keeps its own, as FSDP2 does."""
    ranks = run_workers(_buffers_kept, 2)
    for runs in ranks:
        ddp_buffers, ddp_weights, _ = runs["ddp"]
        buffers, weights, _ = runs["broadcast"]
        for name in ddp_weights:
            assert torch.equal(weights[name], ddp_weights[name]), name
        for name in ddp_buffers:
            assert torch.equal(buffers[name], ddp_buffers[name]), name
        assert runs["None"][2] == 0
    assert sum(runs["broadcast"][2] for runs in ranks) > 0, "rank 0's broadcast is counted"
    own = [runs["None"][0]["1.running_mean"] for runs in ranks]
    assert not torch.equal(own[0], own[1]), "without buffers=, each rank's statistics are its own batches'"
