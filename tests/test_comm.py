"""``lgc.comm``: the ``comm`` options, each with only its own settings, and what the builder makes of each."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module

from lgc import CommunicationDelayState, CompressionHookState
from lgc.comm import COMM_OPTIONS, Comm, DiLoCo, EveryStep, LocalSGD, StreamingDiLoCo
from lgc.methods import METHODS, build_hook_state


def _compose(*overrides: str):
    with initialize_config_module("lgc.conf", version_base="1.3"):
        return compose("train", overrides=["compressor=sbc", "logger=none", *overrides])


def test_the_default_option_is_every_step_with_the_general_records_defaults():
    cfg = _compose()
    assert set(cfg.comm) == {"min_numel", "start_iter", "overlap", "pack", "buffers"}
    assert EveryStep().to_comm() == Comm()
    state = build_hook_state(cfg.compressor, cfg.comm)
    assert type(state) is CompressionHookState and state.start_iter == 1 and not state.overlap and state.packs
    assert state.buffers == "broadcast"


def test_buffers_reach_every_per_step_state_and_are_refused_with_local_steps():
    assert build_hook_state(
        _compose("comm.buffers=average").compressor, _compose("comm.buffers=average").comm
    ).buffers == ("average")
    for method in ("shared_topk_int8", "lgc_rar", "torch_fp16", "powersgd"):  # hook states of their own
        with initialize_config_module("lgc.conf", version_base="1.3"):
            cfg = compose("train", overrides=[f"compressor={method}", "logger=none", "comm.buffers=average"])
        assert build_hook_state(cfg.compressor, cfg.comm).buffers == "average", method
    with pytest.raises(ValueError, match="comm.buffers must be one of broadcast, average, got 'rank0'"):
        build_hook_state(METHODS["sbc"].resolve(), {"buffers": "rank0"})
    with pytest.raises(ValueError, match="comm.buffers='average' applies to every-step exchanges"):
        build_hook_state(METHODS["sbc"].resolve(), {"buffers": "average", "delay": 4})
    with pytest.raises(Exception, match="buffers"):  # not a field of comm=local_sgd: Hydra refuses it
        _compose("comm=local_sgd", "comm.delay=4", "comm.buffers=average")


def test_overlap_reaches_the_hook_and_is_refused_by_a_hook_state_of_its_own():
    cfg = _compose("comm.overlap=true")
    assert build_hook_state(cfg.compressor, cfg.comm).overlap
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=["compressor=shared_topk_int8", "logger=none", "comm.overlap=true"])
    with pytest.raises(ValueError, match=r"comm.overlap=True applies to an lgc compressor's every-step exchange"):
        build_hook_state(cfg.compressor, cfg.comm)


def test_pack_reaches_the_hook_and_is_refused_where_a_step_cannot_go_out_as_one_message():
    assert not build_hook_state(_compose("comm.pack=false").compressor, _compose("comm.pack=false").comm).packs
    assert not build_hook_state(_compose("comm.overlap=true").compressor, _compose("comm.overlap=true").comm).packs
    with pytest.raises(ValueError, match=r"pack=True needs steps that can go out as one message: overlap=True"):
        cfg = _compose("comm.pack=true", "comm.overlap=true")
        build_hook_state(cfg.compressor, cfg.comm)
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=["compressor=lgc_rar", "logger=none", "comm.pack=false"])
    with pytest.raises(ValueError, match=r"comm.pack=False applies to an lgc compressor's every-step exchange"):
        build_hook_state(cfg.compressor, cfg.comm)
    with pytest.raises(Exception, match="pack"):  # not a field of comm=local_sgd: Hydra refuses it
        _compose("comm=local_sgd", "comm.delay=4", "comm.pack=true")


@pytest.mark.parametrize(
    "option,overrides,expected",
    [
        ("local_sgd", ["comm.delay=3"], {"delay": 3, "outer": "average", "fragments": 1}),
        ("diloco", ["comm.delay=5", "comm.outer_lr=0.5"], {"delay": 5, "outer": "sgd", "outer_lr": 0.5}),
        ("streaming_diloco", ["comm.delay=6", "comm.fragments=3"], {"delay": 6, "outer": "sgd", "fragments": 3}),
    ],
)
def test_each_local_step_option_builds_the_communication_delay_it_names(option, overrides, expected):
    cfg = _compose(f"comm={option}", *overrides)
    state = build_hook_state(cfg.compressor, cfg.comm)
    assert isinstance(state, CommunicationDelayState)
    assert {key: getattr(state, key) for key in expected} == expected


def test_the_options_settings_are_the_general_records_fields():
    general = {field.name for field in dataclasses.fields(Comm)} - {"prefix"}
    for option in COMM_OPTIONS.values():
        assert {field.name for field in dataclasses.fields(option)} <= general, option
    # Each option's to_comm carries every setting it has (none dropped on the way to the builder).
    for option, values in [
        (LocalSGD(delay=2, min_numel=7), {"delay": 2, "min_numel": 7}),
        (DiLoCo(delay=2, outer_lr=0.3, outer_momentum=0.5), {"outer_lr": 0.3, "outer_momentum": 0.5}),
        (StreamingDiLoCo(delay=4, fragments=4, fragment_split="contiguous"), {"fragments": 4}),
    ]:
        comm = option.to_comm()
        assert all(getattr(comm, key) == value for key, value in values.items())
        assert all(getattr(comm, field.name) == getattr(option, field.name) for field in dataclasses.fields(option))


def test_a_python_option_object_is_accepted_by_the_builder_as_its_config_node_is():
    state = build_hook_state(METHODS["sbc"].resolve(), DiLoCo(delay=4))
    assert isinstance(state, CommunicationDelayState) and (state.delay, state.outer) == (4, "sgd")
