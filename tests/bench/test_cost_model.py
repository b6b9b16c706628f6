"""The alpha-beta cost model (``lgc.bench.cost_model``, ``lgc-bench model``), profiles and the collective recorder."""

import json
import re

import pytest
import torch
from distributed import run_workers
from torch import nn

from lgc.bench import profile as profiling
from lgc.bench.cli import main
from lgc.bench.cost_model import (
    Link,
    MethodProfile,
    collective_seconds,
    comm_seconds,
    crossover_bandwidth,
    expected_maximum,
    fit_link,
    predict_step,
)
from lgc.ddp import collectives as counted
from lgc.ddp import wire
from lgc.ddp.collectives import CollectiveCall, CommStats, record_collectives

# -- the collective formulas against lgc.ddp.wire's byte counts ----------------------------------
BYTES_ONLY = Link(latency_s=0.0, bytes_per_s=1.0)  # time == bytes on the busiest link


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_with_no_latency_each_collective_takes_its_busiest_links_bytes(world):
    size = 4 * 1000 * world  # divisible by the world: the ring's chunks are equal
    sent = [wire.ring_allreduce(size // 4, 4, world, r).sent for r in range(world)]
    assert collective_seconds(CollectiveCall("all_reduce", size, world), world, BYTES_ONLY) == max(sent)
    gathered = wire.ring_allgather(size, world, 0).sent
    assert collective_seconds(CollectiveCall("all_gather", size, world), world, BYTES_ONLY) == gathered
    # Gloo's binomial tree: the root sends one copy per round, ceil(log2 P) rounds.
    root_sends = wire.tree_broadcast(size, world, 0, 0).sent
    assert collective_seconds(CollectiveCall("broadcast", size, world, 0), world, BYTES_ONLY) == root_sends
    # A gather ends when the root's link has taken everyone else's piece.
    root_takes = wire.flat_gather(size, world, 0, 0).received
    assert collective_seconds(CollectiveCall("gather", size, world, 0), world, BYTES_ONLY) == root_takes
    assert collective_seconds(CollectiveCall("send", size, world, 0), world, BYTES_ONLY) == size
    assert collective_seconds(CollectiveCall("recv", size, world, 1), world, BYTES_ONLY) == 0  # the sender pays


def test_latency_is_paid_once_per_sequential_round():
    link = Link(latency_s=1.0, bytes_per_s=1e30)  # latency alone
    assert collective_seconds(CollectiveCall("all_reduce", 8, 8), 8, link) == pytest.approx(14)  # 2 (P - 1)
    assert collective_seconds(CollectiveCall("all_reduce", 8, 8), 8, link, "tree") == pytest.approx(6)  # 2 log2 P
    assert collective_seconds(CollectiveCall("all_gather", 8, 8), 8, link) == pytest.approx(7)
    assert collective_seconds(CollectiveCall("broadcast", 8, 5, 0), 5, link) == pytest.approx(3)  # ceil(log2 5)
    assert collective_seconds(CollectiveCall("gather", 8, 8, 0), 8, link) == pytest.approx(1)
    assert comm_seconds([CollectiveCall("all_reduce", 8, 1)] * 3, 1, link) == 0  # alone: nothing to wait for


def test_bad_links_and_algorithms_are_named():
    with pytest.raises(ValueError, match="bytes_per_s must be > 0, got 0"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match="latency_s must be >= 0, got -1"):
        Link(-1, 1)
    with pytest.raises(ValueError, match="allreduce must be 'ring' or 'tree', got 'mesh'"):
        collective_seconds(CollectiveCall("all_reduce", 8, 2), 2, BYTES_ONLY, "mesh")
    with pytest.raises(ValueError, match="unknown collective kind 'scatter'"):
        collective_seconds(CollectiveCall("scatter", 8, 2), 2, BYTES_ONLY)


def test_fit_link_recovers_the_latency_and_bandwidth_the_samples_were_made_with():
    truth = Link(latency_s=150e-6, bytes_per_s=12.5e6)
    samples = [
        (call, world, collective_seconds(call, world, truth))
        for world in (2, 4)
        for kind in ("all_reduce", "all_gather")
        for call in (CollectiveCall(kind, size, world) for size in (4096, 65536, 524288, 4194304))
    ]
    fitted = fit_link(samples)
    assert fitted.latency_s == pytest.approx(truth.latency_s, rel=1e-6)
    assert fitted.bytes_per_s == pytest.approx(truth.bytes_per_s, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_link(samples[:1])


# -- the step -------------------------------------------------------------------------------------
def _profile(trace, overlaps=False, **kwargs):
    fields = {"compute_s": 0.3, "overhead_s": 0.05, "decode_per_peer_s": 0.0}
    return MethodProfile(method="m", overlaps_backward=overlaps, trace=trace, **{**fields, **kwargs})


def test_a_guarded_step_adds_compute_overhead_decoding_per_peer_and_communication():
    trace = [CollectiveCall("all_reduce", 24, 1), CollectiveCall("all_gather", 1000, 1)]
    profile = _profile(trace, decode_per_peer_s=0.01)
    link = Link(1e-4, 1e6)
    comm = 2 * 3 * (1e-4 + 6 / 1e6) + 3 * (1e-4 + 1000 / 1e6)
    assert predict_step(profile, 4, link) == pytest.approx(0.3 + 0.05 + 3 * 0.01 + comm)
    assert predict_step(profile, 4, link, codec=False) == pytest.approx(0.3 + comm)
    assert predict_step(profile, 4, link, compute_s=0.1, codec=False) == pytest.approx(0.1 + comm)


def test_a_local_step_method_pays_its_periods_collectives_at_their_share():
    exchange = CollectiveCall("all_reduce", 10**6, 2)  # 1 s on a 1 MB/s link with 2 workers
    link = Link(0.0, 1e6)
    every_fourth = _profile([exchange], period=4)
    assert predict_step(every_fourth, 2, link) == pytest.approx(0.3 + 0.05 + 1.0 / 4)
    # A period's collectives are blocking: nothing hides under the backward pass.
    assert predict_step(_profile([exchange], overlaps=True, period=4), 2, link) == pytest.approx(0.3 + 0.05 + 0.25)
    with pytest.raises(ValueError, match="period must be >= 1, got 0"):
        predict_step(_profile([exchange], period=0), 2, link)


def test_workers_that_meet_once_per_period_wait_for_the_slowest_sum_not_the_slowest_step():
    from lgc.bench.model import straggler_compute

    samples = [0.1] * 9 + [0.2]  # one step in ten is slow
    assert straggler_compute(samples, 1) == pytest.approx(0.11)
    per_step = straggler_compute(samples, 8)  # at 8 workers someone is usually slow every step
    assert per_step == pytest.approx(0.1 + 0.1 * (1 - 0.9**8))
    # Meeting every 10 steps, the slowest worker's 10-step sum is about 1 to 3 slow steps over 1 s.
    every_tenth = straggler_compute(samples, 8, period=10)
    assert 0.11 < every_tenth < per_step
    with pytest.raises(ValueError, match="needs measured compute samples"):
        straggler_compute([], 4)


def test_per_bucket_hooks_hide_all_but_the_last_buckets_communication_under_the_backward_pass():
    bucket = CollectiveCall("all_reduce", 10**6, 2)  # 1 s each on a 1 MB/s link with 2 workers
    link = Link(0.0, 1e6)
    one_bucket = _profile([bucket], overlaps=True, compute_s=3.0, overhead_s=0.0)
    assert predict_step(one_bucket, 2, link) == pytest.approx(3.0 + 1.0)  # nothing to overlap with
    three = _profile([bucket] * 3, overlaps=True, compute_s=3.0, overhead_s=0.0)
    assert predict_step(three, 2, link) == pytest.approx(3.0 + 1.0)  # 2 s hidden under 2 s of backward
    five = _profile([bucket] * 5, overlaps=True, compute_s=3.0, overhead_s=0.0)
    assert predict_step(five, 2, link) == pytest.approx(1.0 + 4.0 + 1.0)  # forward + 4 s of buckets + last
    guarded = _profile([bucket] * 3, overlaps=False, compute_s=3.0, overhead_s=0.0)
    assert predict_step(guarded, 2, link) == pytest.approx(6.0)
    # What is issued at the last bucket (its payloads, a step guard's agreement) waits for the end.
    trailing = _profile([bucket] * 5, overlaps=True, compute_s=3.0, overhead_s=0.0, trailing=2)
    assert predict_step(trailing, 2, link) == pytest.approx(1.0 + max(2.0, 3.0) + 2.0)


def test_stragglers_the_step_waits_for_the_slowest_of_p_workers():
    assert expected_maximum([1.0, 2.0, 3.0], 1) == pytest.approx(2.0)
    assert expected_maximum([0.0, 1.0], 2) == pytest.approx(0.75)
    assert expected_maximum([5.0] * 4, 64) == pytest.approx(5.0)
    assert expected_maximum([0.0, 1.0], 64) == pytest.approx(1.0 - 0.5**64)
    profile = _profile([], compute_samples_s=[0.1, 0.3], overhead_s=0.0)
    assert predict_step(profile, 2, BYTES_ONLY) == pytest.approx(0.25)
    assert predict_step(profile, 2, BYTES_ONLY, compute_s=0.2) == pytest.approx(0.2)  # a knob has no jitter


def test_crossover_is_where_the_cheaper_to_send_method_stops_winning():
    # 0.1 s + 1 MB per step against 0.2 s + 0.1 MB: equal at 0.9 MB / 0.1 s = 9 MB/s.
    dense = lambda b: 0.1 + 1e6 / b  # noqa: E731
    sparse = lambda b: 0.2 + 1e5 / b  # noqa: E731
    side, crossing = crossover_bandwidth(sparse, dense, low=1e6, high=1e8, points=2001)
    assert side == "below" and crossing == pytest.approx(9e6, rel=0.01)
    side, crossing = crossover_bandwidth(dense, sparse, low=1e6, high=1e8, points=2001)
    assert side == "above" and crossing == pytest.approx(9e6, rel=0.01)
    assert crossover_bandwidth(dense, dense, low=1e6, high=1e8) == ("never", None)
    assert crossover_bandwidth(lambda b: 0.0, dense, low=1e6, high=1e8) == ("always", None)


def test_a_profile_survives_json():
    profile = _profile([CollectiveCall("broadcast", 12, 3, 1)], compute_samples_s=[0.1])
    assert MethodProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile


# -- recording what the hooks issue ----------------------------------------------------------------
def test_the_recorder_sees_every_booked_collective_in_order_and_only_inside_its_block(group):
    stats = CommStats()
    counted.all_reduce(stats, torch.zeros(3), None).wait()  # not recorded: no block open
    with record_collectives() as outer:
        counted.all_reduce(stats, torch.zeros(5), None).wait()
        with record_collectives() as inner:
            _, work = counted.all_gather(stats, torch.zeros(2, dtype=torch.float16), None)
            work.wait()
        counted.broadcast(stats, torch.zeros(4, dtype=torch.int64), 0, None)
        counted.gather(stats, torch.zeros(1), 0, None)
    assert outer == [
        CollectiveCall("all_reduce", 20, 1),
        CollectiveCall("all_gather", 4, 1),
        CollectiveCall("broadcast", 32, 1, 0),
        CollectiveCall("gather", 4, 1, 0),
    ]
    assert inner == [CollectiveCall("all_gather", 4, 1)]
    assert counted._recorders == []


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _batches():
    generator = torch.Generator().manual_seed(0)
    return lambda: (torch.randn(8, 64, generator=generator), torch.randint(10, (8,), generator=generator))


def _profiles(rank: int, world: int) -> dict[str, MethodProfile]:
    return {
        "topk": profiling.profile_method(_net(), "topk", _batches(), knobs={"density": 0.01}, steps=3),
        "dense": profiling.profile_method(_net(), "none", _batches(), steps=3),
        "ahead": profiling.profile_method(
            _net(), "topk", _batches(), knobs={"density": 0.01, "overlap": True}, steps=3
        ),
        "powersgd": profiling.profile_method(_net(), "powersgd", _batches(), steps=2),
    }


def test_a_profile_holds_the_methods_steady_collectives_and_its_own_cost():
    """Profiled in a worker process of a group of one, which leaves without interpreter teardown: PyTorch's
    PowerSGD hook chains Python callbacks on gloo's threads, whose last references can outlive the group."""
    profiles = run_workers(_profiles, 1)[0]
    topk = profiles["topk"]
    # One message (lgc.ddp.packed): the header (fp32: the non-finite flag and one per parameter, then
    # the tensors under min_numel=1024 dense: both biases and the 640-element second weight), then the
    # allgather of the first weight's ceil(0.01 * 4096) (value, index) pairs.
    assert [call.kind for call in topk.trace] == ["all_reduce", "all_gather"]
    assert topk.trace[0].nbytes == 4 * (1 + 4) + 4 * (64 + 640 + 10)
    assert topk.trace[1].nbytes == 8 * 41
    assert topk.decode_per_peer_s > 0 and topk.overhead_s >= 0 and not topk.overlaps_backward
    assert len(topk.compute_samples_s) == 3
    dense = profiles["dense"]
    assert dense.overlaps_backward and dense.decode_per_peer_s == 0
    assert [call.kind for call in dense.trace] == ["all_reduce"] and dense.trace[0].nbytes == 4 * 4810
    assert dense.trailing == 1  # the one bucket's allreduce (the model has no module buffers)
    # Overlap: every bucket's payloads leave as it arrives; the last bucket's and the guard's
    # agreement (issued at the last bucket) are what cannot hide under the backward pass.
    ahead = profiles["ahead"]
    assert ahead.overlaps_backward and ahead.trailing == len(ahead.trace)  # one bucket: nothing before it
    assert sorted(call.kind for call in ahead.trace) == ["all_gather", "all_reduce", "all_reduce"]
    # PowerSGD past its dense iterations: rank-1 factors, far fewer bytes than the model.
    powersgd = profiles["powersgd"]
    assert sum(call.nbytes for call in powersgd.trace) < 4 * 4810 / 4


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_local_step_profile_covers_a_whole_period_and_its_exchanges(group, fragments):
    """DiLoCo-style delay 4: the last 4 steps' collectives are every fragment's exchange once."""
    delayed = profiling.profile_method(
        _net(), "none", _batches(), knobs={"delay": 4, "outer": "sgd", "fragments": fragments}, steps=3
    )
    assert delayed.period == 4 and len(delayed.compute_samples_s) == 4  # 3 steps rounded up to a period
    # Each exchange averages its fragment's pseudo-gradient (fp32) and agrees on finiteness first.
    payload = [call for call in delayed.trace if call.nbytes >= 4 * 64 * 10]
    assert sum(call.nbytes for call in payload) >= 4 * 4810
    assert {call.kind for call in delayed.trace} <= {"all_reduce", "all_gather", "broadcast"}
    # The same exchanges every step would cost 4x: the model divides the period's communication by 4.
    link = Link(1e-3, 1e6)
    per_step = MethodProfile(**{**delayed.__dict__, "period": 1, "overlaps_backward": False})
    comm = predict_step(per_step, 4, link, codec=False, compute_s=0.0)
    assert predict_step(delayed, 4, link, codec=False, compute_s=0.0) == pytest.approx(comm / 4)


def test_steady_from_counts_each_methods_own_stages(group):
    from torch.nn.parallel import DistributedDataParallel

    import lgc

    model = DistributedDataParallel(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = lgc.compress(model, "lgc_rar", optimizer=optimizer, stages={"warmup_steps": 7, "ae_steps": 11})
    assert state.steady_from() == 18
    model = DistributedDataParallel(_net())
    state = lgc.compress(model, "powersgd", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert state.steady_from() == 10
    model = DistributedDataParallel(_net())
    state = lgc.compress(model, "dgc", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    epochs = len(state.compressor.warmup_densities)
    assert epochs > 0 and state.steady_from(steps_per_epoch=5) == 5 * epochs
    model = DistributedDataParallel(_net())
    assert lgc.compress(model, "topk", optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).steady_from() == 1
    model = DistributedDataParallel(_net())
    assert lgc.compress(model, "demo", optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).steady_from() == 0


@pytest.mark.parametrize("fragments", [1, 2])
def test_steady_from_under_communication_delay_counts_the_stages_in_exchanges(group, fragments):
    """A shared-index state's 30 warm-up steps are 30 exchanges under ``delay=4``: 120 optimizer steps.

    Communication delay answers for the state it wraps (asked nothing, a caller would see 0).
    """
    from torch.nn.parallel import DistributedDataParallel

    import lgc

    def build(**comm):
        model = DistributedDataParallel(_net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return lgc.compress(model, "shared_topk", optimizer=optimizer, stages={"warmup_steps": 30}, **comm)

    assert build().steady_from() == 30
    assert build(delay=4).steady_from() == 120
    model = DistributedDataParallel(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    delayed = lgc.compress(model, "topk", optimizer=optimizer, delay=4, fragments=fragments)
    assert delayed.steady_from() == 0  # the local steps compress from the first exchange
    assert delayed.dense_below() == delayed.exchange_state.min_numel


# -- lgc-bench model ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "vgg"], r"--model must name some of"),
        (["--workers", "0"], r"--workers must be positive integers, got '0'"),
        (["--bandwidth", "fast"], "fast"),
        (["--latency", "3"], "3"),
        (["--methods", "none,nosuch"], r"unknown method 'nosuch'"),
        (["--methods", "none,topk:density"], r"a knob must read key=value, got 'density'"),
        (["--methods", "none,demo:lr=0.003"], r"demo:lr=0.003: lr set\(s\) the optimizer"),
        (["--compute-ms", "-1"], r"--compute-ms must be > 0, got -1"),
    ],
)
def test_bad_values_are_named_before_anything_is_measured(monkeypatch, argv, message):
    monkeypatch.setattr(profiling, "profile_method", lambda *a, **k: pytest.fail("profiled before checking"))
    with pytest.raises(SystemExit) as exit_info:
        main(["model", *argv])
    assert re.search(message, str(exit_info.value.code))


def _cached_profiles(path):
    dense = MethodProfile("none", 0.1, 0.0, 0.0, True, [CollectiveCall("all_reduce", 100_000_000, 1)])
    fp16 = MethodProfile("torch_fp16", 0.1, 0.005, 0.0, True, [CollectiveCall("all_reduce", 50_000_000, 1)])
    topk = MethodProfile(
        "topk", 0.1, 0.02, 0.001, False, [CollectiveCall("all_reduce", 24, 1), CollectiveCall("all_gather", 200_000, 1)]
    )
    profiles = {"resnet50": {p.method: p.to_json() for p in (dense, fp16, topk)}}
    path.write_text(json.dumps(profiles))


def test_the_model_command_reads_cached_profiles_and_prints_steps_and_crossovers(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "profiles.json"
    _cached_profiles(cache)
    monkeypatch.setattr(profiling, "profile_method", lambda *a, **k: pytest.fail("re-profiled a cached method"))
    main(
        [
            "model", "--model", "resnet50", "--methods", "none,torch_fp16,topk", "--workers", "8,512",
            "--bandwidth", "1gbit,100gbit", "--latency", "0us", "--compute-ms", "100", "--codec", "free",
            "--profiles", str(cache), "--out", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    saved = json.loads((tmp_path / "out" / "model.json").read_text())
    steps = saved["results"]["resnet50"]["methods"]
    # Dense at 8 workers on 1 Gbit/s: forward + max(backward, nothing before the last bucket) +
    # the one bucket's ring: 14 chunks of 12.5 MB at 125 MB/s.
    assert steps["none"]["step_s"]["8x1gbit"] == pytest.approx(0.1 + 14 * 12.5e6 / 125e6)
    # Top-k's allgather grows with the workers: at 512 it loses to fp16 even at 1 Gbit/s.
    assert steps["topk"]["step_s"]["8x1gbit"] < steps["torch_fp16"]["step_s"]["8x1gbit"]
    assert steps["topk"]["step_s"]["512x1gbit"] > steps["torch_fp16"]["step_s"]["512x1gbit"]
    # Without latency top-k's 200 KB per worker beats fp16's 50 MB ring at any bandwidth with 8
    # workers, and its 511 x 200 KB allgather never beats it with 512.
    assert steps["topk"]["crossover_bytes_per_s"]["torch_fp16@8"] == ["always", None]
    assert steps["topk"]["crossover_bytes_per_s"]["torch_fp16@512"] == ["never", None]
    printed = capsys.readouterr().out
    assert "| topk |" in printed and "beats fp16 at (8)" in printed
    assert (tmp_path / "out" / "model.png").stat().st_size > 0


@pytest.mark.slow
def test_the_model_command_measures_the_comparisons_models_compute_and_tables_every_crossing(tmp_path, capsys):
    """ResNet-8 on Fashion-MNIST's shapes: compute measured here, a local-step method beside per-step ones."""
    cache = tmp_path / "profiles.json"
    main(
        [
            "model", "--model", "resnet8", "--methods", "none,torch_fp16,topk,none:delay=4;outer=sgd",
            "--workers", "4", "--bandwidth", "100mbit,1gbit", "--latency", "1ms", "--profiles", str(cache),
            "--out", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    profiles = json.loads(cache.read_text())["resnet8"]
    assert set(profiles) == {"none", "torch_fp16", "topk", "none:delay=4;outer=sgd"}
    # ResNet-8 on 1 channel, 10 classes: 75,002 parameters allreduced in fp32 (and rank 0's buffers sent).
    assert sum(call[1] for call in profiles["none"]["trace"] if call[0] == "all_reduce") == 4 * 75_002
    assert profiles["none:delay=4;outer=sgd"]["period"] == 4 and profiles["topk"]["period"] == 1
    saved = json.loads((tmp_path / "out" / "model.json").read_text())["results"]["resnet8"]
    assert saved["compute_s"] > 0  # measured: no compute knob for the comparison's models
    printed = capsys.readouterr().out
    assert "## Where each method's step beats the fp16 hook's" in printed
    assert "| none:delay=4;outer=sgd |" in printed and "resnet8, 4 workers" in printed


@pytest.mark.slow
def test_the_model_command_profiles_a_real_resnet_when_nothing_is_cached(tmp_path):
    cache = tmp_path / "profiles.json"
    main(["model", "--model", "resnet18", "--methods", "none,topk", "--workers", "8", "--profiles", str(cache)])
    profiles = json.loads(cache.read_text())["resnet18"]
    # ResNet-18 with 1,000 classes: 11,689,512 parameters; dense allreduces all of them in fp32.
    assert sum(call[1] for call in profiles["none"]["trace"]) == 4 * 11_689_512
    assert profiles["topk"]["trace"][-1][0] == "all_gather"
