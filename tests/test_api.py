"""``lgc.compress``: every method by name with its yaml's values, and the misuse it refuses."""

import random
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc
from lgc import (
    CommunicationDelayState,
    CompressionHookState,
    DGCCompressor,
    ErrorFeedback,
    RandomBlockCompressor,
    RedSyncCompressor,
    SBCCompressor,
    SignSGDCompressor,
    TopKCompressor,
    TorchHookState,
)
from lgc.api import _build
from lgc.compressors.tiles import TiledCompressorMixin
from lgc.ddp.local_sgd import register_communication_delay
from lgc.learned.state import LGCHookState, LGCStage
from lgc.methods import Comm, build_compressor, compressor_chain

CONF = Path(lgc.__file__).parent / "conf" / "compressor"
YAML_NAMES = sorted(path.stem for path in CONF.glob("*.yaml"))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + rank))


def _step(model: DDP, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    optimizer.zero_grad()
    model(_batch(rank, step)).square().mean().backward()
    optimizer.step()


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


@pytest.fixture
def model(group) -> DDP:
    return DDP(_net())


# -- the registry and the yamls ------------------------------------------------------------------


def test_the_registry_names_every_yaml():
    assert sorted(lgc.METHODS) == YAML_NAMES


@pytest.mark.parametrize("name", YAML_NAMES)
def test_the_registry_reads_each_yaml_as_hydra_composes_it(name):
    """The registry's own reading of a yaml (its defaults list, a global package) is Hydra's composition."""
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"compressor={name}"])
    method = lgc.METHODS[name]
    # Unresolved: the knobs that follow the run (dgc's weight_decay) are the same references.
    assert OmegaConf.to_container(method.node) == OmegaConf.to_container(cfg.compressor, resolve=False)
    # A global package's settings of other groups (dgc, demo: the optimizer's momentum off) are Hydra's too.
    for group, settings in method.run_settings.items():
        assert {key: cfg[group][key] for key in settings} == settings, group


def test_the_registry_refuses_an_unknown_name_with_the_close_ones():
    with pytest.raises(KeyError, match=r"unknown method 'lgc_rr' \(did you mean 'lgc_rar'"):
        lgc.METHODS["lgc_rr"]


def _fingerprint(obj, depth: int = 0):
    """An object's configuration: its plain attributes, recursively (tensors, generators, locks left out)."""
    if isinstance(obj, bool | int | float | str | torch.dtype) or obj is None:
        return obj
    if isinstance(obj, list | tuple):
        return [_fingerprint(x, depth) for x in obj]
    if isinstance(obj, dict):
        return {k: _fingerprint(v, depth) for k, v in obj.items()}
    if depth > 4 or isinstance(obj, torch.Tensor | random.Random | type(threading.Lock())):
        return "<state>"
    slots = [s for cls in type(obj).__mro__ for s in getattr(cls, "__slots__", ())]
    attrs = {s: getattr(obj, s) for s in slots if hasattr(obj, s)} | getattr(obj, "__dict__", {})
    return (type(obj).__name__, {k: _fingerprint(v, depth + 1) for k, v in sorted(attrs.items())})


@pytest.mark.parametrize("name", YAML_NAMES)
def test_by_name_builds_what_lgc_train_builds_from_the_yaml(name):
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"compressor={name}"])
    from_yaml = build_compressor(cfg.compressor)
    built = _build(name, {}, Comm(prefix=""), error_feedback=None, error_decay=None, process_group=None)
    if isinstance(built, CompressionHookState) and not isinstance(built, LGCHookState):
        built = built.compressor
    assert _fingerprint(built) == _fingerprint(from_yaml)


def test_the_package_exports_the_entry_point_and_every_class_a_method_builds():
    assert all(hasattr(lgc, name) for name in lgc.__all__)
    assert {"compress", "METHODS", "ErrorFeedback", "CommunicationDelayState"} <= set(lgc.__all__)
    assert {method.cls.__name__ for method in lgc.METHODS.values()} <= set(lgc.__all__)


def test_every_method_registers_by_name_and_trains(group):
    for name in lgc.METHODS:
        model = DDP(_net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # DGC's warm-up is per epoch: a plain loop that never calls set_epoch says how long one is.
        knobs = {"steps_per_epoch": 2} if name == "dgc" else {}
        state = lgc.compress(model, name, optimizer=optimizer, **knobs)
        expected = lgc.METHODS[name].cls
        assert isinstance(state, expected if not issubclass(expected, lgc.Compressor) else CompressionHookState)
        for step in range(3):
            _step(model, optimizer, 0, step)
        assert state.stats.hook_calls == 3, name


def _sent_through_the_method(state, model: DDP, optimizer: torch.optim.Optimizer, steps: int) -> dict[str, bool]:
    """Train ``steps`` steps; each parameter's name -> whether the compressor (not a dense average) sent it."""
    for step in range(steps):
        _step(model, optimizer, 0, step)
        if isinstance(state, CommunicationDelayState) and not isinstance(optimizer, _AutoStep):
            state.after_optimizer_step()
    exchange = getattr(state, "exchange_state", state)
    tiled = next(c for c in compressor_chain(exchange) if isinstance(c, TiledCompressorMixin))
    # the compressor tiles every parameter by its shape (the hook attached them, under delay too)
    assert tiled.layout("0.weight", 2048).tile_shape == (32, 64)
    return {name: exchange.layer_stats[name].compressed for name, _ in model.module.named_parameters()}


class _AutoStep(torch.optim.SGD):
    """An optimizer lgc.compress was given (it calls after_optimizer_step itself)."""


@pytest.mark.parametrize(
    "name,delay", [("demo", None), ("sparseloco", None), ("sparseloco", 2), ("chunked_topk", None)]
)
def test_demo_and_sparseloco_send_every_parameter_through_the_method_by_name(group, name, delay):
    """The method's own ``min_numel`` (every tensor, as the references) holds for ``lgc.compress`` by name.

    ``lgc-bench network`` and ``lgc-bench step`` build their methods with ``lgc.compress`` by name too.
    """
    model = DDP(_net())  # 2048- and 128-entry weights, 32- and 4-entry biases
    optimizer = _AutoStep(model.parameters(), lr=0.01)
    state = lgc.compress(model, name, optimizer=optimizer, **({} if delay is None else {"delay": delay}))
    assert getattr(state, "exchange_state", state).min_numel == 1
    assert all(_sent_through_the_method(state, model, optimizer, 4).values())
    # an explicit min_numel still sends the small tensors dense
    model = DDP(_net())
    optimizer = _AutoStep(model.parameters(), lr=0.01)
    state = lgc.compress(
        model, name, optimizer=optimizer, min_numel=1024, **({} if delay is None else {"delay": delay})
    )
    assert _sent_through_the_method(state, model, optimizer, 4) == {
        "0.weight": True,
        "0.bias": False,
        "2.weight": False,
        "2.bias": False,
    }


@pytest.mark.parametrize("overrides", [["compressor=demo"], ["experiment=sparseloco", "comm.delay=2"]])
def test_demo_and_sparseloco_send_every_parameter_through_the_method_under_lgc_train(group, overrides):
    """``lgc-train``'s ``comm.min_numel: null`` follows the method (every parameter); a number overrides it."""
    from lgc.methods import build_hook_state

    for extra, expected in (([], 1), (["comm.min_numel=1024"], 1024)):
        with initialize_config_module("lgc.conf", version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, *extra])
        state = build_hook_state(cfg.compressor, cfg.comm)
        assert getattr(state, "exchange_state", state).min_numel == expected
        model = DDP(_net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        state.register(model)
        sent = _sent_through_the_method(state, model, optimizer, 4)
        assert all(sent.values()) if expected == 1 else sum(sent.values()) == 1


def test_knobs_override_the_defaults_and_dict_knobs_merge(model):
    state = lgc.compress(
        model, "lgc_rar", density=0.05, stages={"warmup_steps": 3}, training={"autoencoder": {"chunk": 32}}
    )
    assert (state.density, state.warmup_steps, state.ae_steps) == (0.05, 3, 60)
    assert state.ae_config.chunk == 32 and state.ae_config.encoder_channels == (64, 128, 256, 64)


def test_sparsifiers_get_error_feedback_by_name(model):
    state = lgc.compress(model, "topk", density=0.1)
    assert isinstance(state.compressor, ErrorFeedback) and state.compressor.compressor.density == 0.1


def test_delay_returns_the_communication_delay_state(model):
    state = lgc.compress(model, "sbc", delay=4, density=0.001)
    assert isinstance(state, CommunicationDelayState) and state.delay == 4
    assert isinstance(state.compressor, ErrorFeedback) and state.compressor.compressor.density == 0.001


# -- refusals ------------------------------------------------------------------------------------


def test_a_plain_module_is_refused_with_how_to_wrap_it():
    with pytest.raises(
        TypeError, match=r"got Sequential: wrap it first.*init_process_group.*DistributedDataParallel\("
    ):
        lgc.compress(_net(), "topk")


def test_no_process_group_is_refused(model):
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match=r"needs an initialized process group.*init_process_group"):
        lgc.compress(model, "topk")


def test_an_unknown_method_names_the_close_ones(model):
    with pytest.raises(ValueError, match=r"unknown method 'top_k' \(did you mean 'topk'\?\).*lgc_rar"):
        lgc.compress(model, "top_k")


def test_an_unknown_knob_lists_the_methods_knobs(model):
    with pytest.raises(TypeError, match=r"'topk' \(TopKCompressor\) has no knob 'densty'; its knobs: density, value"):
        lgc.compress(model, "topk", densty=0.1)


def test_knobs_next_to_a_built_compressor_are_refused(model):
    with pytest.raises(TypeError, match="pass them to its constructor"):
        lgc.compress(model, ErrorFeedback(TopKCompressor(0.01)), density=0.1)


def test_dgc_inside_error_feedback_is_refused(model):
    message = r"DGC keeps its own error feedback .* feed the error back twice"
    with pytest.raises(ValueError, match=message):
        lgc.compress(model, ErrorFeedback(DGCCompressor()), optimizer_momentum=0, optimizer_weight_decay=0)
    with pytest.raises(ValueError, match=message):
        lgc.compress(model, DGCCompressor(), error_feedback=True, optimizer_momentum=0, optimizer_weight_decay=0)
    with pytest.raises(ValueError, match=message):
        lgc.compress(model, "dgc", error_feedback=True, optimizer_momentum=0, optimizer_weight_decay=0)


@pytest.mark.parametrize(
    "compressor",
    [TopKCompressor(0.01), SBCCompressor(0.01), RedSyncCompressor(0.01), RandomBlockCompressor(0.01)],
    ids=lambda c: type(c).__name__,
)
def test_a_sparsifier_without_error_feedback_is_refused_unless_asked(group, compressor):
    with pytest.raises(ValueError, match=r"without error feedback: it sends 0.01 of each gradient.*0.99 is dropped"):
        lgc.compress(DDP(_net()), compressor)
    with pytest.raises(ValueError, match=r"without error feedback.*build the state around ErrorFeedback"):
        lgc.compress(DDP(_net()), CompressionHookState(compressor))
    assert lgc.compress(DDP(_net()), compressor, error_feedback=False).compressor is compressor
    wrapped = lgc.compress(DDP(_net()), compressor, error_feedback=True).compressor
    assert isinstance(wrapped, ErrorFeedback) and wrapped.compressor is compressor


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"error_feedback": "no"}, "error_feedback must be a bool, got 'no'"),
        ({"min_numel": 1.5}, "min_numel must be a non-negative integer or None, got 1.5"),
        ({"min_numel": True}, "min_numel must be a non-negative integer or None, got True"),
        ({"start_iter": 2.7}, "start_iter must be a non-negative integer or None, got 2.7"),
    ],
)
def test_settings_of_the_wrong_type_are_refused_not_converted(group, knobs, message):
    with pytest.raises(ValueError, match=message):
        lgc.compress(DDP(_net()), "topk", **knobs)


@pytest.mark.parametrize(
    ("method", "knob"),
    [
        ("random_block", "shared"),
        ("redsync", "quantize"),
        ("redsync", "reuse_threshold"),
        ("dgc", "nesterov"),
        ("dgc", "momentum_masking"),
        ("demo", "sign"),
        ("shared_topk", "leader_only"),
    ],
)
def test_a_switch_given_as_a_string_is_refused_not_read_as_true(group, method, knob):
    with pytest.raises(ValueError, match=f"{knob} must be a bool, got 'no'"):
        lgc.compress(DDP(_net()), method, **{knob: "no"})


def test_signsgd_without_error_feedback_is_refused_unless_asked(group):
    with pytest.raises(ValueError, match=r"SignSGDCompressor without error feedback: its scaled sign is biased"):
        lgc.compress(DDP(_net()), SignSGDCompressor())
    assert isinstance(lgc.compress(DDP(_net()), "signsgd", error_feedback=False).compressor, SignSGDCompressor)


def test_dgc_refuses_momentum_in_the_optimizer(model):
    message = r"applies momentum too \(SGD param_groups\[0\]\['momentum'\]=0.9\).*momentum to 0.*'dgc', momentum=0.9\)"
    with pytest.raises(ValueError, match=message):
        lgc.compress(model, "dgc", optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"Adam param_groups\[0\]\['betas'\]=0.9"):
        lgc.compress(model, "dgc", optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match=r"applies momentum too \(optimizer_momentum=0.9\)"):
        lgc.compress(model, "dgc", optimizer_momentum=0.9, optimizer_weight_decay=0)


def test_dgc_refuses_weight_decay_in_the_optimizer_and_in_dgc(group):
    model = DDP(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4)
    with pytest.raises(ValueError, match=r"weight_decay'\]=0.0001\) and in DGC \(weight_decay=0.0005\).*twice"):
        lgc.compress(model, "dgc", optimizer=optimizer)
    # With the decay left to the optimizer alone, DGC runs.
    state = lgc.compress(model, "dgc", optimizer=optimizer, weight_decay=0)
    assert state.compressor.weight_decay == 0


def test_dgc_without_an_optimizer_must_be_told_what_it_applies(group):
    with pytest.raises(ValueError, match=r"pass optimizer=.*or declare optimizer_momentum=0, optimizer_weight_decay=0"):
        lgc.compress(DDP(_net()), "dgc")
    with pytest.raises(ValueError, match=r"declare optimizer_momentum=0 for"):
        lgc.compress(DDP(_net()), "dgc", weight_decay=0)
    state = lgc.compress(DDP(_net()), "dgc", optimizer_momentum=0, optimizer_weight_decay=0)
    assert isinstance(state.compressor, DGCCompressor) and state.compressor.momentum == 0.9


def test_the_optimizer_is_given_once_and_must_step_the_model(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not both"):
        lgc.compress(model, "dgc", optimizer=optimizer, optimizer_momentum=0)
    with pytest.raises(ValueError, match="holds none of the model's parameters"):
        lgc.compress(model, "topk", optimizer=torch.optim.SGD(_net().parameters(), lr=0.1))


def test_hook_states_refuse_what_belongs_to_compressors(model):
    with pytest.raises(ValueError, match=r"error_feedback does not apply to 'lgc_rar'.*keeps its own residuals"):
        lgc.compress(model, "lgc_rar", error_feedback=True)
    with pytest.raises(ValueError, match=r"delay=2 needs an lgc compressor .* not 'powersgd'"):
        lgc.compress(model, "powersgd", delay=2)
    with pytest.raises(ValueError, match=r"start_iter=3 does not apply to 'lgc_ps'.*stages.warmup_steps"):
        lgc.compress(model, "lgc_ps", start_iter=3)
    with pytest.raises(ValueError, match=r"min_numel=10 does not apply to 'torch_fp16'"):
        lgc.compress(model, "torch_fp16", min_numel=10)
    with pytest.raises(ValueError, match=r"TorchHookState is a hook state.*delay cannot change it"):
        lgc.compress(model, TorchHookState("fp16"), delay=2)
    with pytest.raises(ValueError, match=r"CompressionHookState is a hook state.*error_feedback, nesterov cannot"):
        lgc.compress(model, CompressionHookState(TopKCompressor(0.1)), error_feedback=True, nesterov=False)


def test_delay_refuses_weight_decay_in_the_compressor(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"delay=2 exchanges weight updates.*weight_decay=0.0005 would decay them"):
        lgc.compress(model, "dgc", optimizer=optimizer, delay=2)
    with pytest.raises(ValueError, match=r"start_iter=3 does not apply with delay=2"):
        lgc.compress(model, "sbc", delay=2, start_iter=3)


def test_a_grad_scaler_is_attached_to_lgc_compressors_and_refused_where_it_cannot_apply(group):
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    state = lgc.compress(DDP(_net()), "topk", grad_scaler=scaler)
    assert state.loss_scale is not None and state.loss_scale() == 256.0
    assert lgc.compress(DDP(_net()), "lgc_rar", grad_scaler=scaler).loss_scale() == 256.0
    with pytest.raises(ValueError, match=r"grad_scaler= unscales.*PowerSGDHookState does not take it"):
        lgc.compress(DDP(_net()), "powersgd", grad_scaler=scaler)
    with pytest.raises(ValueError, match=r"grad_scaler= unscales.*CommunicationDelayState"):
        lgc.compress(DDP(_net()), "sbc", delay=2, grad_scaler=scaler)


# -- two workers ---------------------------------------------------------------------------------


def _by_name_and_by_object(rank: int, world: int) -> dict:
    by_name, by_object = DDP(_net()), DDP(_net())
    opt_name = torch.optim.SGD(by_name.parameters(), lr=0.1)
    opt_object = torch.optim.SGD(by_object.parameters(), lr=0.1)
    state_name = lgc.compress(by_name, "topk", optimizer=opt_name, density=0.05)
    state_object = lgc.compress(by_object, ErrorFeedback(TopKCompressor(0.05)), optimizer=opt_object)
    weights = []
    for step in range(5):
        for model, optimizer in ((by_name, opt_name), (by_object, opt_object)):
            _step(model, optimizer, rank, step)
        weights.append((_weights(by_name), _weights(by_object)))
    # LGC and PyTorch's PowerSGD through the same call.
    lgc_model, psgd_model = DDP(_net()), DDP(_net())
    lgc_opt = torch.optim.SGD(lgc_model.parameters(), lr=0.1)
    psgd_opt = torch.optim.SGD(psgd_model.parameters(), lr=0.1)
    stages, training = {"warmup_steps": 2, "ae_steps": 2}, {"autoencoder": {"chunk": 32}}
    lgc_state = lgc.compress(lgc_model, "lgc_rar", density=0.05, stages=stages, training=training)
    psgd_state = lgc.compress(psgd_model, "powersgd", start_powerSGD_iter=2)
    others = []
    for step in range(6):
        _step(lgc_model, lgc_opt, rank, step)
        _step(psgd_model, psgd_opt, rank, step)
        others.append((_weights(lgc_model), _weights(psgd_model)))
    return {
        "weights": weights,
        "stats": (state_name.stats.as_dict(), state_object.stats.as_dict()),
        "others": others,
        "lgc_stage": int(lgc_state.stage),
        "psgd_ratio": psgd_state.stats.compression_ratio,
    }


@pytest.mark.multiprocess
def test_topk_by_name_equals_topk_by_object_bitwise_and_lgc_runs_through_the_same_call():
    results = run_workers(_by_name_and_by_object, 2)
    for result in results:
        for by_name, by_object in result["weights"]:
            assert torch.equal(by_name, by_object)
        assert result["stats"][0] == result["stats"][1]
        assert result["stats"][0]["bytes_sent"] < result["stats"][0]["dense_equivalent_bytes"] / 2
        assert result["lgc_stage"] == LGCStage.COMPRESSED
        # (LGC's rank 0 also sends the autoencoder's weights, more than this tiny model's gradients.)
        assert result["psgd_ratio"] > 1
    # Averaged gradients: both workers hold the same weights after every step.
    for a, b in zip(results[0]["others"], results[1]["others"], strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _max_difference(model: nn.Module) -> float:
    """The largest difference between any worker's weights and rank 0's, on every rank (collectives)."""
    mine = _weights(model)
    theirs = mine.clone()
    dist.broadcast(theirs, src=0)
    difference = (mine - theirs).abs().max().reshape(1)
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    return float(difference)


def _delay_modes(rank: int, world: int, delay: int, steps: int) -> dict:
    out: dict = {}
    # compress(optimizer=...): after_optimizer_step runs after every optimizer.step().
    model = DDP(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = lgc.compress(model, "topk", optimizer=optimizer, delay=delay, density=0.1)
    out["automatic"] = []
    for step in range(steps):
        _step(model, optimizer, rank, step)
        out["automatic"].append((state.local_steps, _max_difference(model)))

    # Forgetting after_optimizer_step raises before the second local step uses the weights, through
    # compress and through the state's own registration alike.
    for key, register in (
        ("forgotten", lambda model: lgc.compress(model, "topk", delay=delay)),
        ("forgotten_low_level", lambda model: register_communication_delay(model, TopKCompressor(0.1), delay=delay)),
    ):
        model = DDP(_net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        register(model)
        out[key] = None
        for step in range(steps):
            try:
                _step(model, optimizer, rank, step)
            except RuntimeError as err:
                out[key] = (step, str(err))
                break

    # Called by hand as well as by the optimizer's post-hook: exchanges at the wrong steps, refused.
    model = DDP(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = lgc.compress(model, "topk", optimizer=optimizer, delay=delay)
    out["doubled"] = None
    for step in range(steps):
        try:
            _step(model, optimizer, rank, step)
        except RuntimeError as err:
            out["doubled"] = (step, str(err))
            break
        state.after_optimizer_step()

    # Called by hand, once per step, without optimizer=: fine.
    model = DDP(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = lgc.compress(model, "topk", delay=delay)
    out["manual"] = []
    for step in range(steps):
        _step(model, optimizer, rank, step)
        state.after_optimizer_step()
        out["manual"].append(_max_difference(model))
    return out


@pytest.mark.multiprocess
def test_delay_mode_keeps_workers_in_sync_and_a_missed_step_cannot_drift_silently():
    delay, steps = 3, 6
    for result in run_workers(_delay_modes, 2, delay, steps):
        counted = [local_steps for local_steps, _ in result["automatic"]]
        assert counted == list(range(1, steps + 1))
        differences = [difference for _, difference in result["automatic"]]
        exchanges = [step for step in range(steps) if (step + 1) % delay == 0]
        # Identical after every exchange, apart (each its own local steps) in between.
        assert all(differences[step] == 0.0 for step in exchanges), differences
        assert all(differences[step] > 0.0 for step in range(steps) if step not in exchanges), differences
        assert all(result["manual"][step] == 0.0 for step in exchanges), result["manual"]

        for key in ("forgotten", "forgotten_low_level"):
            step, message = result[key]
            assert step == 1
            assert "after_optimizer_step() was not called" in message and "drift apart" in message
            assert "pass optimizer=your_optimizer" in message
        step, message = result["doubled"]
        assert step == 1
        assert "ran 2 times" in message and "remove your own call" in message
