"""SBC's communication delay: local steps, then a compressed weight-update exchange."""

import math

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc
from lgc import ErrorFeedback, NoneCompressor, TopKCompressor
from lgc.ddp import CompressionHookState
from lgc.ddp.fragments import split_into_fragments
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.local_step_hook import local_step_exchange
from lgc.learned import LGCHookState, SharedIndexState

pytestmark = pytest.mark.multiprocess


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def _delayed(compressor, *, min_numel: int | None = None, **settings) -> CommunicationDelayState:
    """``compressor`` (or an LGC-family state) exchanging local steps' updates, wrapped as the builder wraps it."""
    if not isinstance(compressor, CompressionHookState):
        compressor = local_step_exchange(compressor, min_numel=min_numel)
    return CommunicationDelayState(compressor, **settings)


def _train(
    rank: int, world: int, compressor, delay: int | None, steps: int, outer: dict | None = None, net=_net
) -> dict:
    model = DDP(net())
    state = None
    if delay is not None:
        # An LGC-family hook state brings its own min_numel.
        min_numel = None if isinstance(compressor, LGCHookState) else 0
        state = _delayed(compressor, delay=delay, min_numel=min_numel, **(outer or {}))
        state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights, sent, stages = [], [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        if state is not None:
            state.after_optimizer_step()
        weights.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        sent.append(state.stats.bytes_sent if state else 0)
        if isinstance(compressor, LGCHookState):
            stages.append(compressor.stage.name)
    result = {"weights": weights, "sent": sent, "payload": state.stats.payload_bytes if state else 0}
    if isinstance(compressor, LGCHookState):
        result.update(stages=stages, booked=state.summary_extras()["lgc"]["stages"])
    return result


# NoneCompressor's case runs with -m slow: error feedback over a full-density top-k is lossless too and
# also carries a residual through the exchanges.
@pytest.mark.parametrize(
    "compressor",
    [pytest.param(NoneCompressor(), marks=pytest.mark.slow), ErrorFeedback(TopKCompressor(1.0))],
    ids=lambda compressor: repr(compressor),
)
@pytest.mark.slow
def test_delay_one_with_lossless_compression_equals_plain_sgd(compressor):
    steps = 5
    dense = run_workers(_train, 2, None, None, steps)
    delayed = run_workers(_train, 2, compressor, 1, steps)
    for rank in range(2):
        for a, b in zip(dense[rank]["weights"], delayed[rank]["weights"], strict=True):
            torch.testing.assert_close(b, a)


def test_workers_communicate_only_every_delay_steps_and_agree_after_each_exchange():
    delay, steps = 3, 9
    results = run_workers(_train, 2, ErrorFeedback(TopKCompressor(0.1)), delay, steps)
    for result in results:
        sent = result["sent"]
        increments = [b - a for a, b in zip([0, *sent[:-1]], sent, strict=True)]
        assert [step for step, inc in enumerate(increments) if inc] == [2, 5, 8]
    for step in range(steps):
        same = torch.equal(results[0]["weights"][step], results[1]["weights"][step])
        assert same == ((step + 1) % delay == 0), step


@pytest.mark.slow
def test_a_shared_index_state_exchanges_the_exact_mean_update_at_full_density():
    # The LGC family under a delay: the hook state exchanges the weight updates as it exchanges
    # gradients. At density 1 with fp32 values the leader's positions are all of them and the sum
    # is exact, so every step's weights are periodic averaging's; the first exchange is the dense
    # warm-up, the others go through the shared-index stage (a rotating leader).
    delay, steps = 2, 8
    exact = SharedIndexState(values="float32", density=1.0, stages={"warmup_steps": 1}, min_numel=0)
    shared = run_workers(_train, 2, exact, delay, steps)
    averaged = run_workers(_train, 2, NoneCompressor(), delay, steps)
    for rank in range(2):
        for a, b in zip(averaged[rank]["weights"], shared[rank]["weights"], strict=True):
            torch.testing.assert_close(b, a)
        assert shared[rank]["payload"] > 0  # three exchanges through the shared-index stage


def test_the_lgc_familys_stages_count_exchanges_and_only_exchanges_send():
    delay, steps = 3, 12
    shared = SharedIndexState(
        values="int8", density=0.1, stages={"warmup_steps": 2}, leaders={"index_coding": "golomb"}, min_numel=0
    )
    # BatchNorm's statistics are averaged at every exchange: their bytes belong to that exchange's stage.
    results = run_workers(_train, 2, shared, delay, steps, None, _bn_net)
    numel = sum(p.numel() for p in _bn_net().parameters())
    for result in results:
        sent = result["sent"]
        increments = [b - a for a, b in zip([0, *sent[:-1]], sent, strict=True)]
        assert [step for step, inc in enumerate(increments) if inc] == [2, 5, 8, 11]
        # stages.warmup_steps=2: the first two exchanges (six local steps) dense, then the compressed stage.
        assert result["stages"][2] == result["stages"][5] == "WARMUP"
        assert result["stages"][8] == result["stages"][11] == "COMPRESSED"
        # Each dense exchange: the fp32 update and the step guard's byte per parameter (plus one).
        dense = increments[2]
        assert increments[5] == dense and dense >= 4 * numel
        assert 0 < increments[8] < dense / 4 and 0 < increments[11] < dense / 4
        assert result["booked"]["warmup"]["bytes_sent"] == 2 * dense
        assert result["booked"]["compressed"]["bytes_sent"] == increments[8] + increments[11]


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"fragments": 2}, r"fragments=2 cuts parameters into pieces; SharedIndexState codes whole parameters"),
    ],
)
def test_an_lgc_family_state_refuses_what_it_cannot_do_under_a_delay(settings, message):
    with pytest.raises(ValueError, match=message):
        CommunicationDelayState(SharedIndexState(values="int8"), delay=4, **settings)


def test_the_lgc_familys_stages_are_checked_in_exchanges():
    state = CommunicationDelayState(SharedIndexState(values="int8", stages={"warmup_steps": 10}), delay=4)
    state.check_run(_net(), 2, 44)  # 11 exchanges: one after the warm-up
    too_short = r"stages.warmup_steps=10 \+ stages.ae_steps=0 >= the run's 10 exchanges \(40 optimizer"
    with pytest.raises(ValueError, match=too_short):
        state.check_run(_net(), 2, 40)
    with pytest.raises(ValueError, match=r"^leaders.rank=3 is outside"):  # other refusals as they are
        leader_three = SharedIndexState(values="int8", leaders={"rank": 3, "rotate": False})
        CommunicationDelayState(leader_three, delay=4).check_run(_net(), 2, None)


def test_an_lgc_family_state_configured_for_other_workers_is_refused_under_a_delay(group):
    state = CommunicationDelayState(SharedIndexState(values="int8", world_size=2), delay=4)
    with pytest.raises(ValueError, match="LGC was configured for 2 workers but the group has 1"):
        state.register(DDP(_net()))


def test_communication_delay_wraps_a_built_state_and_builds_none():
    """A compressor is wrapped by the builder (lgc.compress, lgc-train), never by the delay itself."""
    with pytest.raises(TypeError, match=r"exchanges through a built CompressionHookState .*got TopKCompressor: wrap"):
        CommunicationDelayState(TopKCompressor(0.1), delay=4)
    with pytest.raises(ValueError, match=r"CompressionHookState has start_iter=1: .*build it with start_iter=0"):
        CommunicationDelayState(CompressionHookState(ErrorFeedback(TopKCompressor(0.1))), delay=4)


def test_delay_rejects_non_positive_steps():
    with pytest.raises(ValueError, match="delay must be a positive integer, got 0"):
        _delayed(NoneCompressor(), delay=0)


@pytest.mark.parametrize(
    "outer,message",
    [
        ({"outer": "adam"}, "outer must be one of .*, got 'adam'"),
        ({"outer": "sgd", "outer_lr": 0.0}, "outer_lr must be a positive finite number or None, got 0.0"),
        ({"outer": "sgd", "outer_lr": -1}, "outer_lr must be a positive finite number or None, got -1"),
        ({"outer": "sgd", "outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\) or None, got 1.0"),
        ({"outer_lr": 0.5}, "outer_lr=0.5 and outer_momentum=None are the outer optimizer's knobs: set outer='sgd'"),
    ],
)
def test_bad_outer_settings_are_named(outer, message):
    with pytest.raises(ValueError, match=message):
        _delayed(NoneCompressor(), delay=4, **outer)


@pytest.mark.slow
def test_outer_sgd_with_lr_one_and_no_momentum_is_periodic_averaging_bit_for_bit():
    """DiLoCo's outer step ``W -= 1 * (-mean dW)`` with no momentum is SBC's ``W += mean dW``."""
    compressor, delay, steps = ErrorFeedback(TopKCompressor(0.2)), 3, 9
    average = run_workers(_train, 2, compressor, delay, steps)
    outer = run_workers(_train, 2, compressor, delay, steps, {"outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0})
    for a, b in zip(average, outer, strict=True):
        for step, (wa, wb) in enumerate(zip(a["weights"], b["weights"], strict=True)):
            assert torch.equal(wa, wb), step


def test_outer_nesterov_sgd_follows_diloco_on_the_pseudo_gradient():
    """Against a one-process simulation of two workers: H local SGD steps each, then the averaged
    pseudo-gradient ``Delta = mean_i (W_sync - W_i)`` drives ``m = mu m + Delta``,
    ``W_sync -= lr (Delta + mu m)`` (Nesterov), and every worker restarts from ``W_sync``."""
    delay, steps, lr, mu = 2, 6, 0.7, 0.9
    outer = {"outer": "sgd", "outer_lr": lr, "outer_momentum": mu}
    results = run_workers(_train, 2, NoneCompressor(), delay, steps, outer)

    workers = [_net(), _net()]
    synced = [p.detach().clone() for p in workers[0].parameters()]
    momentum = [torch.zeros_like(p) for p in synced]
    for step in range(steps):
        for rank, net in enumerate(workers):
            x, y = _batch(rank, step)
            net.zero_grad()
            (net(x) - y).square().mean().backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
        if (step + 1) % delay == 0:
            with torch.no_grad():
                for i, sync in enumerate(synced):
                    local = [list(net.parameters())[i] for net in workers]
                    delta = sum((sync - p) / 2 for p in local)
                    momentum[i] = mu * momentum[i] + delta
                    sync -= lr * (delta + mu * momentum[i])
                for net in workers:
                    for p, sync in zip(net.parameters(), synced, strict=True):
                        p.copy_(sync)
        for rank, net in enumerate(workers):
            expected = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            torch.testing.assert_close(results[rank]["weights"][step], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "outer",
    [
        ["comm=local_sgd"],
        pytest.param(["comm=diloco"], marks=pytest.mark.slow),
        pytest.param(["comm=streaming_diloco", "comm.fragments=2"], marks=pytest.mark.slow),
        # An exchange in flight at the checkpoint (started at step 7, applied at 8), local weights mixed in.
        pytest.param(
            ["comm=streaming_diloco", "comm.fragments=1", "comm.overlap_steps=1", "comm.mixing=0.5"],
            marks=pytest.mark.slow,
        ),
        # The LGC family: its dense warm-up exchange before the checkpoint, compressed ones after.
        pytest.param(["comm=local_sgd", "compressor=shared_topk_int8"], marks=pytest.mark.slow),
        # LGC-RAR's linear codec: warm-up, codec fitting and a compressed exchange before the checkpoint.
        pytest.param(
            [
                "comm=local_sgd",
                "experiment=embedded/lgc_rar_lean",
                "compressor.stages.warmup_steps=1",
                "compressor.stages.ae_steps=1",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["average", "diloco", "streaming", "streaming_overlap", "shared_index", "lgc_rar"],
)
def test_resume_in_the_middle_of_a_delay_period_is_exact(tmp_path, outer):
    # 7 steps per epoch and an exchange every 2: the checkpoint after epoch 1 falls between exchanges,
    # where every rank holds its own weights and momenta (and, with DiLoCo, the outer momentum).
    common = ["trainer.limit_train_batches=7", "trainer.limit_val_batches=1", "comm.delay=2", "scheduler.T_max=2"]
    common += outer
    # Imported here: the workers other tests fork import this module, and need no training stack.
    from test_train import _load, compose_cfg

    from lgc.train import train

    train(compose_cfg(tmp_path / "straight", "trainer.max_epochs=2", *common))
    train(compose_cfg(tmp_path / "first", "trainer.max_epochs=1", *common))
    stopped = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train(compose_cfg(tmp_path / "resumed", "trainer.max_epochs=2", f"ckpt_path={stopped}", *common))

    first = _load(stopped)["callbacks"]["CompressionCallback"]["per_rank"]
    assert first[0]["local_steps"] == 7
    assert (first[0]["in_flight"] is not None) == ("comm.overlap_steps=1" in outer)
    # Between exchanges the ranks' weights and BatchNorm statistics differ: both are checkpointed per rank.
    for key in ("local_weights", "local_buffers"):
        local = [first[rank][key] for rank in range(2)]
        assert any(not torch.equal(local[0][k], local[1][k]) for k in local[0] if local[0][k].is_floating_point())
    if "experiment=embedded/lgc_rar_lean" in outer:  # the trained codec is saved, as without delay
        assert (tmp_path / "straight" / "codec.pt").is_file()
    straight = _load(tmp_path / "straight" / "checkpoints" / "last.ckpt")["callbacks"]["CompressionCallback"]
    resumed = _load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["callbacks"]["CompressionCallback"]
    for a, b in zip(straight["per_rank"], resumed["per_rank"], strict=True):
        assert a["local_steps"] == b["local_steps"] == 14
        for key in ("synced", "synced_buffers", "local_weights", "local_buffers"):
            assert a[key].keys() == b[key].keys()
            for name, tensor in a[key].items():
                assert torch.equal(tensor, b[key][name]), (key, name)
        if outer[0] != "comm=local_sgd":  # DiLoCo: the outer momentum is checkpointed too
            buffers = [[s["momentum_buffer"] for s in r["outer_optimizer"]["state"].values()] for r in (a, b)]
            assert len(buffers[0]) == len(a["synced"]) and all(map(torch.equal, *buffers))
        else:
            assert a["outer_optimizer"] is None


# -- Streaming DiLoCo's fragments ------------------------------------------------------------------


def _fragment_sizes(pieces, fragments: int) -> list[int]:
    sizes = [0] * fragments
    for piece in pieces:
        sizes[piece.fragment] += piece.numel
    return sizes


def _covers_every_row_once(shapes, pieces) -> bool:
    """Every parameter's pieces are its rows in order, without gaps or overlaps, each of its own shape."""
    dims = dict(shapes)
    reached = dict.fromkeys(dims, 0)
    for piece in pieces:  # in parameter order
        shape = tuple(dims[piece.name])
        if piece.start != reached[piece.name] or piece.stop <= piece.start:
            return False
        if piece.shape != ((piece.stop - piece.start, *shape[1:]) if shape else ()):
            return False
        reached[piece.name] = piece.stop
    return all(reached[name] == (shape[0] if shape else 1) for name, shape in dims.items())


def _fragment_masks(module: nn.Module, fragments: int, split: str = "strided") -> list[torch.Tensor]:
    """Per fragment, which entries of the flattened parameters it holds."""
    shapes = [(name, p.shape) for name, p in module.named_parameters()]
    starts, total = {}, 0
    for name, p in module.named_parameters():
        starts[name], total = total, total + p.numel()
    masks = [torch.zeros(total, dtype=torch.bool) for _ in range(fragments)]
    for piece in split_into_fragments(shapes, fragments, split):
        entries = piece.entries
        masks[piece.fragment][starts[piece.name] + entries.start : starts[piece.name] + entries.stop] = True
    return masks


def test_fragments_cut_parameters_only_where_balance_needs_it_and_only_between_rows():
    sizes = [("a", (10,)), ("b", (40, 25)), ("c", (5,)), ("d", (40, 25)), ("e", (3,))]
    whole = split_into_fragments(sizes, 1)
    assert [(p.key, p.fragment) for p in whole] == [(name, 0) for name, _ in sizes]
    # Two fragments of the 2,018 entries: no tensor needs cutting. contiguous: the cut at 1,009 moves
    # onto the boundary after "b" (1,010); strided deals the two matrices to fragments 0 and 1, then
    # the vectors to the emptier one (a: 0, tied at 1,000; c and e: 1).
    for split in ("contiguous", "strided"):
        halves = split_into_fragments(sizes, 2, split)
        assert [(p.key, p.fragment) for p in halves] == [("a", 0), ("b", 0), ("c", 1), ("d", 1), ("e", 1)]
        assert _fragment_sizes(halves, 2) == [1010, 1008]
    # Four: a share is 504.5 entries, and each matrix is cut into its rows 0:20 and 20:40 (500 entries).
    # strided deals them out in turn, then a (10), c (5) and e (3) to fragments 0, 1, 2.
    strided = split_into_fragments(sizes, 4)
    assert [(p.key, p.fragment, p.shape) for p in strided] == [
        ("a", 0, (10,)), ("b[0:20]", 0, (20, 25)), ("b[20:40]", 1, (20, 25)), ("c", 1, (5,)),
        ("d[0:20]", 2, (20, 25)), ("d[20:40]", 3, (20, 25)), ("e", 2, (3,)),
    ]  # fmt: skip
    assert _fragment_sizes(strided, 4) == [510, 505, 503, 500]
    # contiguous cuts at 504.5, 1009 and 1513.5: the middle one onto the boundary after "b", the
    # others onto row 20 of a matrix (entry 510 and 1,515).
    contiguous = split_into_fragments(sizes, 4, "contiguous")
    assert [(p.key, p.fragment) for p in contiguous] == [
        ("a", 0), ("b[0:20]", 0), ("b[20:40]", 1), ("c", 2), ("d[0:20]", 2), ("d[20:40]", 3), ("e", 3),
    ]  # fmt: skip
    # Three: halves of a matrix (500 entries) leave one fragment with two (1,000, 1.49 shares), so
    # the matrices are cut in quarters (rows 0:10, 10:20, ...), dealt out as 0, 1, 2, 0, 1, 2, 0, 1.
    thirds = split_into_fragments(sizes, 3)
    assert [(p.key, p.fragment) for p in thirds][1:5] == [
        ("b[0:10]", 0),
        ("b[10:20]", 1),
        ("b[20:30]", 2),
        ("b[30:40]", 0),
    ]
    assert _fragment_sizes(thirds, 3) == [750, 750, 518]
    for pieces in (whole, halves, strided, contiguous, thirds):
        assert _covers_every_row_once(sizes, pieces)
    with pytest.raises(ValueError, match=r"fragments=99 is more than the model's 98 rows of trainable weights"):
        split_into_fragments(sizes, 99)  # 10 + 40 + 5 + 40 + 3 rows
    with pytest.raises(ValueError, match="fragment_split must be one of .*, got 'layers'"):
        split_into_fragments(sizes, 2, "layers")


def _model_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    from lgc.models import resnet8, resnet20
    from lgc.models.torchvision_resnet import resnet50

    build = {"resnet8": resnet8, "resnet20": resnet20, "resnet50": resnet50}[name]
    with torch.device("meta"):  # shapes only: ResNet-50's 23.5 M weights are never allocated
        model = build(num_classes=10)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("fragments", [2, 4, 8])
@pytest.mark.parametrize("model", ["resnet8", "resnet20", "resnet50"])
def test_no_fragment_holds_more_than_a_quarter_above_an_equal_share(model, fragments, split):
    """Streaming DiLoCo's peak bandwidth falls by F only if the fragments are of about equal size."""
    shapes = _model_shapes(model)
    total = sum(math.prod(shape) for _, shape in shapes)
    pieces = split_into_fragments(shapes, fragments, split)
    sizes = _fragment_sizes(pieces, fragments)
    assert min(sizes) > 0 and max(sizes) <= 1.25 * total / fragments, sizes
    # Every piece is rows of a parameter, of the parameter's dimensions.
    assert _covers_every_row_once(shapes, pieces)


def test_strided_fragments_deal_equal_blocks_round_robin_as_the_paper():
    """Twelve equal blocks (a weight and a bias each, as a transformer's): block b in fragment b % F."""
    shapes = [
        (f"{block}.{kind}", shape) for block in range(12) for kind, shape in (("weight", (32, 32)), ("bias", (32,)))
    ]
    for fragments in (2, 3, 4, 6):
        pieces = split_into_fragments(shapes, fragments)
        assert all(p.whole for p in pieces)
        assert [p.fragment for p in pieces] == [int(p.name.split(".")[0]) % fragments for p in pieces]


def _resnet8_exchanges(method: str, fragments: int, delay: int = 4) -> CommunicationDelayState:
    """ResNet-8 trained for ``delay`` local steps in a group of one under ``method`` with ``fragments``."""
    from lgc.models import resnet8

    torch.manual_seed(0)
    model = DDP(resnet8(num_classes=10))
    state = lgc.compress(model, method, delay=delay, fragments=fragments)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(delay):
        x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        state.after_optimizer_step()
    return state


@pytest.mark.parametrize("method", ["sparseloco", "demo"])
def test_tiled_compressors_send_as_much_per_delay_steps_in_fragments_as_at_once(group, method):
    """SparseLoCo and DeMo keep ``k`` entries (coefficients) of every tile. ResNet-8's two fragments
    cut no tensor, so their payloads over H steps are those of one exchange of everything; four cut
    its 64-channel convolution in two matrices of 32 rows, a row of tiles each (a quarter more)."""
    at_once, halves, quarters = (_resnet8_exchanges(method, f).stats.payload_bytes for f in (1, 2, 4))
    assert halves == at_once > 0
    assert at_once < quarters <= 1.25 * at_once


def test_a_tiled_compressor_tiles_each_piece_of_a_cut_parameter_as_the_matrix_of_its_rows(group):
    """Every piece of a cut parameter is attached to the compressor by its key, as a view of its rows:
    chunked top-k tiles it ``split(rows) x split(cols)`` (the references' rule on the piece's matrix)
    and reads the piece's own entries."""
    from references import get_smaller_split

    from lgc.compressors import ChunkedTopKCompressor
    from lgc.models import resnet8

    class Recording(ChunkedTopKCompressor):
        def attach_parameters(self, parameters):
            super().attach_parameters(parameters)
            self.attached = dict(parameters)

    compressor = Recording(chunk=64, k=64)
    model = DDP(resnet8(num_classes=10))
    state = _delayed(ErrorFeedback(compressor), delay=4, fragments=4)
    state.register(model)
    params = dict(model.module.named_parameters())
    pieces = [s for s in state.slices if not s.whole]
    assert [s.key for s in pieces] == ["layers.2.conv2.weight[0:32]", "layers.2.conv2.weight[32:64]"]
    for piece in pieces:
        rows, cols = piece.stop - piece.start, math.prod(piece.shape[1:])
        h, w = get_smaller_split(rows, 64), get_smaller_split(cols, 64)
        layout = compressor.layout(piece.key, piece.numel)
        assert layout.tile_shape == (h, w) == (32, 64)
        assert layout.count == (rows // h) * (cols // w) * 64 == 9 * 64
        view = compressor.attached[piece.key]
        with torch.no_grad():
            params[piece.name].mul_(2)  # an optimizer step in place: the view follows it
        assert view.shape == piece.shape and torch.equal(view, params[piece.name][piece.start : piece.stop])


@pytest.mark.parametrize("fragments", [0, 5, 2.0, True])
def test_bad_fragment_counts_are_named(fragments):
    with pytest.raises(ValueError, match=f"fragments must be an integer from 1 to delay=4.*got {fragments!r}"):
        _delayed(NoneCompressor(), delay=4, fragments=fragments)


def test_an_unknown_fragment_split_is_named():
    with pytest.raises(ValueError, match="fragment_split must be one of \\('strided', 'contiguous'\\), got 'layers'"):
        _delayed(NoneCompressor(), delay=4, fragments=2, fragment_split="layers")


def _saved_state(**changes) -> dict:
    state = _delayed(NoneCompressor(), delay=4, fragments=2, fragment_split="contiguous")
    return {**state.state_dict(), **changes}


@pytest.mark.parametrize(
    "saved,message",
    [
        ({}, "written with fragment_split='contiguous', this run has fragment_split='strided'"),
        ({"fragment_split": None}, "written with no fragment_split .*whole parameters"),
    ],
)
def test_a_checkpoint_cut_into_other_fragments_is_refused(saved, message):
    state = _saved_state(**saved)
    if saved.get("fragment_split", "") is None:
        del state["fragment_split"]
    with pytest.raises(ValueError, match=message):
        _delayed(NoneCompressor(), delay=4, fragments=2).load_state_dict(state)
    # One fragment is never cut: any split loads.
    _delayed(NoneCompressor(), delay=4).load_state_dict({**state, "fragments": 1})


def test_a_checkpoint_whose_residuals_hold_the_weight_update_is_refused():
    """Residuals built on ``W_local - W_sync`` would be fed back with the wrong sign on the pseudo-gradient."""
    state = _delayed(ErrorFeedback(TopKCompressor(0.1)), delay=4).state_dict()
    assert state["compressed"] == "the pseudo-gradient W_sync - W_local"
    del state["compressed"]
    with pytest.raises(ValueError, match="built on the weight update W_local - W_sync, this run compresses the pseudo"):
        _delayed(ErrorFeedback(TopKCompressor(0.1)), delay=4).load_state_dict(state)


@pytest.mark.slow
def test_fragments_are_exchanged_on_staggered_steps_and_send_the_same_bytes():
    """H = 4, two fragments: fragment 0 is exchanged at local steps 2, 6, fragment 1 at 4, 8.

    Every fragment still waits H steps between exchanges, so over 8 steps the bytes equal those of
    exchanging everything every 4 steps, in two bursts of about half; each exchange makes exactly
    its fragment agree across ranks.
    """
    delay, steps = 4, 8
    whole = run_workers(_train, 2, NoneCompressor(), delay, steps)
    streamed = run_workers(_train, 2, NoneCompressor(), delay, steps, {"fragments": 2})
    masks = _fragment_masks(_net(), 2)
    sizes = [int(mask.sum()) for mask in masks]
    assert 0 < min(sizes) and max(sizes) <= 1.25 * sum(sizes) / 2
    for result in streamed:
        sent = result["sent"]
        increments = [b - a for a, b in zip([0, *sent[:-1]], sent, strict=True)]
        assert [step for step, inc in enumerate(increments) if inc] == [1, 3, 5, 7]
        assert increments[1] == increments[5] and increments[3] == increments[7]
    # The same payload bytes; each exchange adds the step guard's agreement on its own pieces
    # (a flag and a byte per piece: a few bytes, 4 exchanges against 2).
    assert streamed[0]["payload"] == whole[0]["payload"] > 0
    for result, exchanges in ((whole, 2), (streamed, 4)):
        assert 0 < result[0]["sent"][-1] - result[0]["payload"] <= 8 * exchanges
    a, b = streamed[0]["weights"], streamed[1]["weights"]
    for step in range(steps):
        for fragment, due in ((0, (1, 5)), (1, (3, 7))):
            mask = masks[fragment]
            assert torch.equal(a[step][mask], b[step][mask]) == (step in due), (step, fragment)


def traced_local_steps(rank: int, state: CommunicationDelayState, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """Train ``steps`` local steps under ``state``; per step the weights before the exchange, after it, and
    those of :meth:`global_model`."""
    model = DDP(_net())
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def flat(module: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])

    trace = []
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        before = flat(model.module)
        state.after_optimizer_step()
        with state.global_model() as module:
            synced = flat(module)
        trace.append((before, flat(model.module), synced))
    return trace


def _streaming_trace(rank: int, world: int, delay: int, fragments: int, split: str, steps: int) -> dict:
    state = _delayed(NoneCompressor(), delay=delay, min_numel=0, outer="sgd", fragments=fragments, fragment_split=split)
    return {"trace": traced_local_steps(rank, state, steps)}


@pytest.mark.parametrize("split", ["strided", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_streaming_diloco_matches_a_transcription_of_torchfts_fragment_sync(split):
    """lgc's Streaming DiLoCo against meta-pytorch/torchft ``torchft/local_sgd.py``, ``_StreamingDiLoCoFragment``.

    The transcription keeps, per fragment, the global weights (torchft's ``original_parameters``)
    and an outer ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)`` of its own, as torchft
    gives each fragment an outer optimizer. At a fragment's sync step it follows ``prepare_sync``
    and ``perform_sync`` with ``fragment_update_alpha=0`` (no mixing of local weights): the
    pseudo-gradient ``original - local`` of every worker, averaged (``_save_grads``,
    ``_average_grads``); the weights restored to the original (``restore_parameters``); the average
    set as the gradient (``_set_grads``) and the outer optimizer stepped; the result saved as the new
    original (``save_parameters``) and kept by the model (``_merge_parameters`` at alpha 0). Three
    workers, H = 4, two fragments, 12 steps: after every step each worker's weights equal the
    transcription's, and :meth:`global_model` holds its original weights (what torchft would
    restore and evaluate).

    When a fragment syncs is torchft's too, transcribed from ``DiLoCo._step_post_hook`` (with
    ``fragment_sync_delay=0`` and every commit succeeding): a local step counter that reaches
    ``sync_every // len(model_fragments)`` syncs fragment ``manager.current_step() % len(self._fragments)``
    (``_current_fragment``), the manager's step grows by one per commit (``Manager.should_commit``)
    and the counter restarts. Which entries form a fragment is lgc's (torchft takes module fragments
    from the caller).
    """
    delay, fragments, steps, world = 4, 2, 12, 3
    results = run_workers(_streaming_trace, world, delay, fragments, split, steps)
    members = _fragment_masks(_net(), fragments, split)
    total = members[0].numel()
    original = torch.cat([p.detach().reshape(-1) for p in _net().parameters()])
    globals_ = [original[mask].clone() for mask in members]
    outer = []
    for weights in globals_:
        weights.requires_grad_(True)
        outer.append(torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True))
    sync_every = delay // fragments  # torchft: DiLoCo.__init__ divides sync_every by the fragments
    local_step = manager_step = 0
    for step in range(steps):
        local = [r["trace"][step][0] for r in results]
        expected = [w.clone() for w in local]
        local_step += 1
        if local_step == sync_every:
            fragment = manager_step % fragments
            mask, weights = members[fragment], globals_[fragment]
            pseudo = sum(weights.detach() - w[mask] for w in local) / world
            weights.grad = pseudo
            outer[fragment].step()
            outer[fragment].zero_grad()
            for w in expected:
                w[mask] = weights.detach()
            manager_step += 1
            local_step = 0
        for rank, result in enumerate(results):
            _, after, synced = result["trace"][step]
            torch.testing.assert_close(after, expected[rank], rtol=1e-6, atol=1e-7)
            transcribed = torch.empty(total)
            for fragment, mask in enumerate(members):
                transcribed[mask] = globals_[fragment].detach()
            torch.testing.assert_close(synced, transcribed, rtol=1e-6, atol=1e-7)


def test_too_many_fragments_are_refused_before_workers_start(tmp_path):
    from test_train import compose_cfg

    from lgc.train import train

    cfg = compose_cfg(tmp_path, "comm=streaming_diloco", "comm.delay=100000", "comm.fragments=741")
    with pytest.raises(ValueError, match="fragments=741 is more than the model's 740 rows of trainable"):
        train(cfg)
    assert not (tmp_path / ".workers").exists()


# -- evaluation on the synchronized (global) model ----------------------------------------------------


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in (*module.named_parameters(), *module.named_buffers())}


def _train_evaluating(rank: int, world: int, evaluate_after: tuple[int, ...], steps: int) -> dict:
    model = DDP(_bn_net())
    state = _delayed(ErrorFeedback(TopKCompressor(0.5)), delay=4, min_numel=0, fragments=2, outer="sgd")
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    probe = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    trace, evaluated, outputs = [], {}, {}
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        state.after_optimizer_step()
        trace.append(_snapshot(model.module))
        if step in evaluate_after:
            with state.global_model() as module:
                evaluated[step] = _snapshot(module)
                # As lgc-train validates: through the DDP wrapper, in eval mode, without gradients.
                model.eval()
                with torch.no_grad():
                    outputs[step] = model(probe)
                model.train()
    return {"trace": trace, "evaluated": evaluated, "outputs": outputs}


@pytest.mark.slow
def test_the_global_model_is_every_fragments_last_synchronized_weights_and_training_goes_on_untouched():
    """H = 4, two fragments (exchanged at local steps 2 and 4 of every 4), DiLoCo's outer SGD, BatchNorm.

    Evaluated mid-interval (after local steps 3, 5 and 7), the module holds, on both ranks alike,
    each fragment's weights as its last exchange left them (the initial ones before it had one) and
    the floating-point buffers averaged at the last step-4 exchange (BatchNorm's counter of forward
    passes stays the worker's own); the local weights, buffers and optimizer state
    come back, so training continues bit for bit as in a run that never evaluated.
    """
    steps, evaluate_after = 8, (2, 4, 6)
    plain = run_workers(_train_evaluating, 2, (), steps)
    evaluating = run_workers(_train_evaluating, 2, evaluate_after, steps)
    for a, b in zip(plain, evaluating, strict=True):
        for step, (x, y) in enumerate(zip(a["trace"], b["trace"], strict=True)):
            assert all(torch.equal(x[k], y[k]) for k in x), f"training changed after evaluating, step {step}"
    initial = _snapshot(_bn_net())
    pieces = split_into_fragments([(name, p.shape) for name, p in _bn_net().named_parameters()], 2)
    # Step index of each fragment's last exchange before an evaluation (None: not exchanged yet).
    last_exchange = {2: {0: 1, 1: None}, 4: {0: 1, 1: 3}, 6: {0: 5, 1: 3}}
    for step in evaluate_after:
        trace = evaluating[0]["trace"]
        for rank in range(2):
            evaluated = evaluating[rank]["evaluated"][step]
            for piece in pieces:
                source = last_exchange[step][piece.fragment]
                expected = (initial if source is None else trace[source])[piece.name].reshape(-1)
                got = evaluated[piece.name].reshape(-1)
                assert torch.equal(got[piece.entries], expected[piece.entries]), (step, piece)
            buffers = initial if step < 3 else trace[3]
            for name in ("1.running_mean", "1.running_var"):
                assert torch.equal(evaluated[name], buffers[name]), (step, name)
            # The counter of forward passes is never averaged: it stays this worker's, one per local step.
            assert int(evaluated["1.num_batches_tracked"]) == int(trace[step]["1.num_batches_tracked"]) == step + 1
            # The local model differs from it mid-interval: the evaluation did not see it.
            assert not torch.equal(evaluated["0.weight"], evaluating[rank]["trace"][step]["0.weight"])
        assert torch.equal(evaluating[0]["outputs"][step], evaluating[1]["outputs"][step])


def _one_local_step(state: CommunicationDelayState, model: DDP) -> None:
    """A local SGD step on a batch of this rank's (with H = 4 and two fragments: no exchange yet)."""
    x, y = _batch(0, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(x) - y).square().mean().backward()
    optimizer.step()
    state.after_optimizer_step()


def _registered_bn_state() -> tuple[CommunicationDelayState, DDP]:
    model = DDP(_bn_net())
    state = _delayed(NoneCompressor(), delay=4, min_numel=0, fragments=2)
    state.register(model)
    _one_local_step(state, model)
    return state, model


def test_global_model_is_not_nested_and_a_checkpoint_taken_inside_it_keeps_the_local_weights(group):
    """Inside ``global_model()`` the module holds the synchronized weights: ``state_dict()`` saves the
    local ones held aside, and a nested ``global_model()`` (which would hold the global weights as
    local ones and never give the local ones back), an exchange or a load raise."""
    state, model = _registered_bn_state()
    local = _snapshot(model.module)
    outside = state.state_dict()
    with state.global_model() as module:
        assert not torch.equal(module[0].weight, local["0.weight"])  # the synchronized (initial) weights
        inside = state.state_dict()
        with pytest.raises(RuntimeError, match=r"global_model\(\) inside global_model\(\)"):
            with state.global_model():
                pass
        with pytest.raises(RuntimeError, match=r"after_optimizer_step\(\) inside global_model\(\)"):
            state.after_optimizer_step()
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) inside global_model\(\)"):
            state.load_state_dict(outside)
    for key in ("local_weights", "local_buffers", "synced", "synced_buffers"):
        assert inside[key].keys() == outside[key].keys()
        assert all(torch.equal(inside[key][name], outside[key][name]) for name in outside[key]), key
    assert inside["local_steps"] == state.local_steps == 1
    after = _snapshot(model.module)
    assert all(torch.equal(after[name], local[name]) for name in local)


def test_the_lightning_callback_gives_the_local_model_back_when_validation_does_not_end(group):
    """``on_validation_start`` swaps the global model in; an exception or the end of the run (no
    ``on_validation_end``) puts the local one back, and a second start without an end is refused
    without losing the first."""
    from lgc.lit.callbacks import CompressionCallback

    state, model = _registered_bn_state()
    local = _snapshot(model.module)

    def holds_local() -> bool:
        now = _snapshot(model.module)
        return all(torch.equal(now[name], local[name]) for name in local)

    callback = CompressionCallback()
    callback._state = state  # what setup() finds on the trainer's strategy
    for end in ("on_exception", "teardown", "on_validation_end"):
        callback.on_validation_start(None, model)
        assert not holds_local()
        if end == "on_validation_end":
            with pytest.raises(RuntimeError, match=r"global_model\(\) inside global_model\(\)"):
                callback.on_validation_start(None, model)
            assert not holds_local()
        {
            "on_exception": lambda: callback.on_exception(None, model, RuntimeError("a failed validation step")),
            "teardown": lambda: callback.teardown(None, model, "fit"),
            "on_validation_end": lambda: callback.on_validation_end(None, model),
        }[end]()
        assert holds_local(), end
        assert state.held_local is None
    callback.teardown(None, model, "fit")  # nothing held: nothing to do
    assert holds_local()


@pytest.mark.slow
def test_lgc_train_validates_the_global_model_mid_interval_without_changing_training(tmp_path):
    """experiment=streaming_diloco with H = 4: validating every 3 steps (between exchanges) evaluates the
    synchronized model and leaves every rank's training exactly as in a run that never validates."""
    from hydra import compose, initialize_config_module
    from test_train import _load

    from lgc.train import train

    def run(folder, *overrides):
        with initialize_config_module("lgc.conf", version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[
                    "experiment=streaming_diloco",
                    "logger=csv",
                    f"output_dir={folder}",
                    "comm.delay=4",
                    "trainer.max_epochs=1",
                    "trainer.limit_train_batches=7",
                    *overrides,
                ],
            )
        return train(cfg)

    validating = run(tmp_path / "validating", "trainer.limit_val_batches=2", "+trainer.val_check_interval=3")
    silent = run(tmp_path / "silent", "trainer.limit_val_batches=0")
    assert "val/acc" in validating and "val/acc" not in silent
    assert validating["eval_model"] == "global" and validating["buffer_sync"] == "average_at_exchange"
    assert "FP4Compressor" in validating["compressor"] and "2 staggered strided fragments" in validating["compressor"]
    states = [
        _load(tmp_path / name / "checkpoints" / "last.ckpt")["callbacks"]["CompressionCallback"]["per_rank"]
        for name in ("validating", "silent")
    ]
    for a, b in zip(*states, strict=True):
        assert a["local_steps"] == b["local_steps"] == 7
        for key in ("synced", "synced_buffers", "local_weights", "local_buffers"):
            assert a[key].keys() == b[key].keys()
            for name, tensor in a[key].items():
                assert torch.equal(tensor, b[key][name]), (key, name)
        for x, y in zip(a["optimizers"], b["optimizers"], strict=True):
            for index, state in x["state"].items():
                assert torch.equal(state["momentum_buffer"], y["state"][index]["momentum_buffer"])
