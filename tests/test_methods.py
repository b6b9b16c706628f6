"""``lgc.methods``: the registry read from the yamls, and the one builder every entry point uses."""

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from lgc import CommunicationDelayState, CompressionHookState, ErrorFeedback, HookState, TopKCompressor
from lgc.comm import EveryStep
from lgc.compressors import SBCCompressor
from lgc.ddp.powersgd import PowerSGDHookState
from lgc.learned.rar import LGCRingAllreduceState
from lgc.learned.shared_index import SharedIndexState
from lgc.methods import CONF, METHODS, Comm, build_compressor, build_hook_state, instantiate


def test_a_variant_is_its_base_yaml_with_its_own_changes():
    base, variant = METHODS["shared_topk"].resolve(), METHODS["shared_topk_int8"].resolve()
    changed = {key for key in base if base[key] != variant[key]}
    assert changed == {"values", "stages", "leaders"}
    assert variant["values"] == "int8" and variant["stages"] == {**base["stages"], "warmup_steps": 1}
    assert variant["leaders"] == {**base["leaders"], "index_coding": "golomb"}


def _plain(value: Any) -> Any:
    """A default as a yaml holds it: tuples as lists, dataclass groups and mappings as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return [_plain(item) for item in value] if isinstance(value, tuple) else value


def _given_differs(default: Any, given: Any, where: str) -> list[str]:
    """Where a yaml's value differs from a default; a mapping compares the keys the yaml gives."""
    if isinstance(given, Mapping) and isinstance(default, Mapping):
        missing = [f"{where}.{key} (no such knob)" for key in given if key not in default]
        inner = [_given_differs(default[key], given[key], f"{where}.{key}") for key in given if key in default]
        return missing + [line for lines in inner for line in lines]
    return [] if default == given else [f"{where}: {given!r} in the yaml, {default!r} in the constructor"]


def _constructor_defaults(cls: type) -> dict[str, Any]:
    """The keyword defaults of ``cls(...)``, through ``**kwargs`` to its bases (``empty``: none)."""
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                defaults.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return defaults


_ROOTS = [name for name in METHODS if "defaults" not in yaml.safe_load((CONF / f"{name}.yaml").read_text())]


@pytest.mark.parametrize("name", _ROOTS)
def test_a_yaml_without_a_base_gives_its_constructors_defaults(name):
    # One source of truth per default: a method's own yaml gives what its class's constructor
    # defaults to (or the constructor has no default); a variant (defaults: [base]) lists its changes.
    method = METHODS[name]
    defaults = _constructor_defaults(method.cls)
    differs = []
    for key, given in method.defaults.items():
        if OmegaConf.is_interpolation(method.node, key):
            continue  # follows the run (DGC's weight decay follows regularization.weight_decay)
        assert key in defaults, f"{name}: {key} is not a knob of {method.cls.__name__}"
        if defaults[key] is not inspect.Parameter.empty:
            differs += _given_differs(_plain(defaults[key]), given, f"{name}: {key}")
    assert not differs, "\n".join(differs)


def test_the_tie_sees_a_default_that_differs():
    # The check above, on a changed yaml value inside a group and on a plain knob.
    stages = _plain(_constructor_defaults(LGCRingAllreduceState)["stages"])
    assert _given_differs(stages, {**stages, "ae_steps": 61}, "lgc_rar: stages") == [
        "lgc_rar: stages.ae_steps: 61 in the yaml, 60 in the constructor"
    ]
    assert _given_differs(stages, {"ae_stepz": 60}, "s") == ["s.ae_stepz (no such knob)"]
    assert _given_differs(0.01, 0.001, "d") and not _given_differs([0.5], [0.5], "d")


def test_knobs_that_follow_the_run_resolve_for_a_plain_script():
    # DGC's decay follows the run's regularization.weight_decay, else the paper's 5e-4.
    assert METHODS["dgc"].defaults["weight_decay"] == 5e-4
    # No yaml reads another node: the hook's min_numel reaches a hook state from comm, through the builder.
    for name in METHODS:
        assert "min_numel" not in METHODS[name].defaults and "world_size" not in METHODS["dgc"].defaults
        assert all("${comm." not in str(value) for value in METHODS[name].node.values()), name
    assert build_hook_state(METHODS["lgc_rar"].resolve(), Comm(min_numel=77)).min_numel == 77
    assert build_hook_state(METHODS["lgc_rar"].resolve(), EveryStep(min_numel=77)).min_numel == 77
    with pytest.raises(ValueError, match=r"compressor.min_numel=77: .* the hook's setting, comm.min_numel"):
        build_hook_state({**METHODS["lgc_rar"].resolve(), "min_numel": 77})
    # A global package's other settings stay apart from the compressor's knobs.
    assert METHODS["dgc"].run_settings["optimizer"]["momentum"] == 0.0
    assert "optimizer" not in METHODS["dgc"].defaults


def test_dict_knobs_merge_key_by_key():
    node = METHODS["lgc_rar_paper"].resolve(training={"autoencoder": {"width": 0.25}}, stages={"ae_steps": 5})
    paper = METHODS["lgc_rar_paper"].resolve()
    assert node["training"]["autoencoder"] == {**paper["training"]["autoencoder"], "width": 0.25}
    assert node["training"]["autoencoder"]["chunk"] == 256  # the variant's, kept at depth two
    assert node["stages"] == {**paper["stages"], "ae_steps": 5}
    assert {key: value for key, value in node.items() if key not in ("training", "stages")} == {
        key: value for key, value in paper.items() if key not in ("training", "stages")
    }


def test_error_feedback_follows_the_node_unless_told():
    topk = METHODS["topk"].resolve(density=0.1)
    built = build_compressor(topk)
    assert isinstance(built, ErrorFeedback) and built.decay == 1.0 and built.compressor.density == 0.1
    assert isinstance(build_compressor(topk, error_feedback=False), TopKCompressor)
    assert build_compressor(METHODS["sparseloco"].resolve()).decay == 0.95
    assert build_compressor(topk, error_decay=0.9).decay == 0.9
    # A built compressor is wrapped when asked, never twice.
    wrapped = build_compressor(SBCCompressor(0.01), error_feedback=True)
    assert isinstance(wrapped, ErrorFeedback) and build_compressor(wrapped, error_feedback=True) is wrapped
    with pytest.raises(ValueError, match=r"compressor.error_decay=0.9 is the decay .* needs compressor.error_feedback"):
        build_compressor({"_target_": "lgc.compressors.TopKCompressor", "density": 0.1, "error_decay": 0.9})


def test_every_step_or_local_steps_is_chosen_in_one_place():
    node = METHODS["sbc"].resolve()
    every_step = build_hook_state(node, Comm(min_numel=5, start_iter=2))
    assert type(every_step) is CompressionHookState and (every_step.min_numel, every_step.start_iter) == (5, 2)
    local = build_hook_state(node, {"delay": 4, "outer": "sgd", "min_numel": 5})
    assert isinstance(local, CommunicationDelayState) and (local.delay, local.outer) == (4, "sgd")
    assert isinstance(every_step, HookState) and isinstance(local, HookState)
    # The LGC family under a delay: the hook state itself exchanges the updates, its stages in exchanges.
    shared = build_hook_state(METHODS["shared_topk_int8"].resolve(), {"delay": 4, "min_numel": 5})
    assert isinstance(shared, CommunicationDelayState) and isinstance(shared.exchange_state, SharedIndexState)
    assert shared.exchange_state.min_numel == 5 and shared.needs_total_steps


@pytest.mark.parametrize(
    "method,comm,message",
    [
        ("lgc_rar", Comm(start_iter=3), r"comm.start_iter=3 does not apply to LGC"),
        ("lgc_rar", Comm(start_iter=3, prefix=""), r"^start_iter=3 does not apply to"),
        ("powersgd", Comm(delay=2), r"comm.delay=2 needs an lgc compressor .* or an LGC-family method"),
        ("lgc_rar", Comm(delay=2, fragments=2), r"fragments=2 cuts parameters into pieces; LGCRingAllreduceState"),
        ("powersgd", Comm(min_numel=10), r"comm.min_numel=10 does not apply to .*every parameter"),
        ("sbc", Comm(delay=2, start_iter=3), r"comm.start_iter=3 does not apply with comm.delay=2"),
        ("topk", Comm(outer="sgd"), r"comm.outer='sgd', .* act on the exchanges of local steps: they need comm.delay"),
        ("topk", {"delay": 2, "startiter": 3}, r"comm.startiter is not a communication setting"),
    ],
)
def test_settings_that_do_not_apply_are_refused_naming_the_value(method, comm, message):
    with pytest.raises(ValueError, match=message):
        build_hook_state(METHODS[method].resolve(), comm)


def test_hook_states_keep_their_own_residuals():
    lgc_rar = build_hook_state(METHODS["lgc_rar"].resolve())
    assert isinstance(lgc_rar, LGCRingAllreduceState) and lgc_rar.needs_total_steps
    assert isinstance(build_hook_state(METHODS["powersgd"].resolve()), PowerSGDHookState)
    with pytest.raises(ValueError, match=r"compressor.error_feedback does not apply to .*keeps its own residuals"):
        build_hook_state(METHODS["lgc_rar"].resolve(), error_feedback=True)


def test_instantiate_builds_nested_targets_and_refuses_what_it_does_not_do():
    node = {key: value for key, value in METHODS["sparseloco"].resolve().items() if not key.startswith("error_")}
    built = instantiate(node, "compressor")
    assert type(built.sparsifier).__name__ == "ChunkedTopKCompressor"
    with pytest.raises(ValueError, match=r"compressor: _partial_: lgc builds a method from _target_ and knobs only"):
        instantiate({"_target_": "lgc.compressors.TopKCompressor", "_partial_": True}, "compressor")
    with pytest.raises(ValueError, match=r"_target_='lgc.compressors.Nothing' names nothing importable"):
        instantiate({"_target_": "lgc.compressors.Nothing"})
    with pytest.raises(ValueError, match=r"^compressor: density must be a number in \(0, 1\], got 2"):
        instantiate({"_target_": "lgc.compressors.TopKCompressor", "density": 2}, "compressor")
