"""lgc.config_types.check_node_types: wrong-type config values are refused by name, real configs pass."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from lgc.config_types import check_node_types
from lgc.methods import ERROR_FEEDBACK_KEYS

CONF = resources.files("lgc.conf")
#: Config groups whose node is one ``_target_`` (logger and callbacks hold several).
NODE_GROUPS = ("compressor", "model", "data", "trainer", "optimizer", "scheduler")


def _names(group: str) -> list[str]:
    """The options of a config group (``lgc/conf/<group>/**/*.yaml``), as Hydra names them."""
    root = Path(str(CONF / group))
    return sorted(path.relative_to(root).with_suffix("").as_posix() for path in root.rglob("*.yaml"))


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_module("lgc.conf", version_base="1.3"):
        return compose("train", overrides=["logger=csv", "output_dir=/tmp/lgc-config-types", *overrides])


def _node(cfg: DictConfig, group: str) -> dict[str, Any]:
    return OmegaConf.to_container(cfg[group], resolve=True)


def _check(cfg: DictConfig, group: str) -> None:
    check_node_types(_node(cfg, group), group, ignore=ERROR_FEEDBACK_KEYS if group == "compressor" else ())


def _check_all(cfg: DictConfig) -> None:
    """What lgc-train would check: every group's node, each logger and callback."""
    for group in NODE_GROUPS:
        if cfg.get(group) is not None:
            _check(cfg, group)
    for group in ("logger", "callbacks"):
        nodes = cfg.get(group)
        for name, node in (OmegaConf.to_container(nodes, resolve=True) if nodes else {}).items():
            if node is not None:
                check_node_types(node, f"{group}.{name}")


def _refused(overrides: Sequence[str], group: str) -> str:
    cfg = _compose(*overrides)
    with pytest.raises(TypeError) as info:
        _check(cfg, group)
    return str(info.value)


# Wrong types, refused by name.


@pytest.mark.parametrize("value", ["abc", "[0.1]", "true", "{a: 1}"])
def test_a_density_that_is_not_a_number_is_refused_by_name(value):
    message = _refused(["compressor=topk", f"compressor.density={value}"], "compressor")
    assert message.startswith("compressor.density=")
    assert "must be a number in (0, 1]" in message and "TopKCompressor" in message


def test_the_message_shows_the_value_as_given():
    assert _refused(["compressor=topk", "compressor.density=abc"], "compressor").startswith(
        "compressor.density='abc' must be a number in (0, 1]"
    )
    assert _refused(["compressor=topk", "compressor.density=[0.1]"], "compressor").startswith(
        "compressor.density=[0.1] must be a number in (0, 1]"
    )


def test_trainer_max_steps_must_be_an_int():
    message = _refused(["trainer.max_steps=abc"], "trainer")
    assert message.startswith("trainer.max_steps='abc' must be an int")
    assert "pytorch_lightning" in message and "Trainer" in message
    assert _refused(["trainer.max_steps=1.5"], "trainer").startswith("trainer.max_steps=1.5 must be an int")
    assert _refused(["trainer.max_steps=true"], "trainer").startswith("trainer.max_steps=True must be an int")


def test_optional_ints_name_none_as_an_alternative():
    message = _refused(["trainer.max_epochs=abc"], "trainer")
    assert message.startswith("trainer.max_epochs='abc' must be an int or None")


def test_data_fields_are_checked_against_the_data_module():
    assert _refused(["data=digits", "data.batch_size=abc"], "data").startswith(
        "data.batch_size='abc' must be a positive integer"
    )
    message = _refused(["data=digits", "data.partition=7"], "data")
    assert message.startswith("data.partition=7 must be a str") and "DigitsDataModule" in message
    assert _refused(["data=digits", "data.val_fraction=abc"], "data").startswith("data.val_fraction='abc'")


def test_the_optimizers_learning_rate_is_a_float_though_torch_also_takes_a_tensor():
    # torch.optim.SGD(lr: float | Tensor) behind `_partial_: true`.
    assert _refused(["optimizer.lr=abc"], "optimizer").startswith("optimizer.lr='abc' must be a float")
    assert _refused(["optimizer.nesterov=abc"], "optimizer").startswith("optimizer.nesterov='abc' must be a bool")


def test_list_elements_are_checked():
    message = _refused(["compressor=dgc", "compressor.warmup_densities=[0.25,abc]"], "compressor")
    assert message.startswith("compressor.warmup_densities=[0.25, 'abc'] must be a list of float")
    assert _refused(["compressor=dgc", "compressor.warmup_densities=0.25"], "compressor").startswith(
        "compressor.warmup_densities=0.25 must be a list of float"
    )
    assert _refused(["data=camvid", "data.crop_size=[360,abc]"], "data").startswith(
        "data.crop_size=[360, 'abc'] must be a list of int"
    )


def test_literals_list_their_choices():
    message = _refused(["model=pspnet", "model.backbone=resnet99"], "model")
    assert message.startswith("model.backbone='resnet99' must be one of 'resnet18', 'resnet34', 'resnet50'")
    message = _refused(["compressor=redsync", "compressor.method=bogus"], "compressor")
    assert "compressor.method='bogus' must be one of 'trimmed_topk', 'threshold_binary_search'" in message


def test_a_nested_target_is_checked_under_its_own_name():
    message = _refused(
        ["scheduler=warmup_multistep", "scheduler.warmup_steps=10", "scheduler.decay.gamma=abc"], "scheduler"
    )
    assert message.startswith("scheduler.decay.gamma='abc' must be a float") and "MultiStepLR" in message
    # MultiStepLR's `milestones: Iterable[int]` does not resolve (torch imports Iterable only for type
    # checkers): that one parameter goes unchecked, the others still are.
    _check(_compose("scheduler=multistep", "scheduler.milestones=[1,2]"), "scheduler")
    assert _refused(["scheduler=multistep", "scheduler.gamma=abc"], "scheduler").startswith("scheduler.gamma='abc'")


def test_a_group_of_knobs_is_checked_field_by_field():
    # LGC's states take their knobs in groups (stages, leaders, training): each field is checked
    # against the group's annotation and named with its path; a field the group lacks is refused.
    message = _refused(["compressor=lgc_rar", "compressor.density=abc"], "compressor")
    assert (
        message.startswith("compressor.density='abc' must be a number in (0, 1]") and "LGCRingAllreduceState" in message
    )
    assert _refused(["compressor=lgc_ps", "compressor.stages.ae_steps=abc"], "compressor") == (
        "compressor.stages.ae_steps='abc' must be a non-negative integer (a knob of lgc.learned.knobs.Stages)"
    )
    assert _refused(["compressor=lgc_rar", "compressor.leaders.rotate=maybe"], "compressor").startswith(
        "compressor.leaders.rotate='maybe' must be a bool"
    )
    assert _refused(["compressor=lgc_rar", "compressor.training.lr=fast"], "compressor").startswith(
        "compressor.training.lr='fast' must be a positive finite number"
    )
    assert _refused(["compressor=shared_topk", "+compressor.stages.ae_stepz=1"], "compressor").startswith(
        "compressor.stages.ae_stepz is not a knob of lgc.learned.knobs.Stages (its knobs: warmup_steps, warmup,"
    )
    assert _refused(["compressor=lgc_ps", "compressor.innovation_density=abc"], "compressor").startswith(
        "compressor.innovation_density='abc' must be a number in (0, 1]"
    )


def test_an_unknown_key_is_refused_where_the_target_takes_no_kwargs():
    message = _refused(["compressor=topk", "+compressor.densty=0.1"], "compressor")
    assert message == (
        "compressor.densty is not a parameter of lgc.compressors.topk.TopKCompressor (it takes: density, value_dtype)"
    )
    assert _refused(["+trainer.max_step=10"], "trainer").startswith("trainer.max_step is not a parameter of")


def test_an_unknown_key_is_left_to_a_target_with_kwargs():
    # WandbLogger(**kwargs) passes them to wandb.init.
    check_node_types({"_target_": "pytorch_lightning.loggers.WandbLogger", "group": "g", "tags": ["a"]}, "logger.w")
    assert _refused(["compressor=lgc_rar", "+compressor.anything=1"], "compressor").startswith(
        "compressor.anything is not a parameter of lgc.learned.rar.LGCRingAllreduceState (it takes: density, stages,"
    )


# Right types, accepted.


def test_an_int_is_a_float():
    _check(_compose("compressor=topk", "compressor.density=1"), "compressor")
    _check(_compose("optimizer.lr=1", "optimizer.momentum=0"), "optimizer")


def test_a_number_outside_its_knobs_bounds_is_a_value_error_in_the_constructors_words():
    """The constructors' aliases (``levels: Levels``) bound the config's values too, before anything is built."""
    cfg = _compose("compressor=qsgd", "compressor.levels=0")
    with pytest.raises(ValueError, match=r"^compressor.levels=0 must be an integer in \[1, 32767\] \(a parameter of"):
        _check(cfg, "compressor")
    with pytest.raises(ValueError, match=r"^compressor.density=1.5 must be a number in \(0, 1\]"):
        _check(_compose("compressor=lgc_rar", "compressor.density=1.5"), "compressor")
    with pytest.raises(ValueError, match=r"^data.batch_size=0 must be a positive integer"):
        _check(_compose("data=digits", "data.batch_size=0"), "data")
    # The same alias, the same words, from the constructor itself.
    from lgc.compressors import QSGDCompressor

    with pytest.raises(ValueError, match=r"^levels must be an integer in \[1, 32767\], got 0$"):
        QSGDCompressor(levels=0)


def test_null_is_accepted_where_none_is():
    _check(_compose("compressor=qsgd", "compressor.bucket_size=null"), "compressor")
    _check(_compose("compressor=dgc", "compressor.clip_norm=null"), "compressor")
    # DGC's warm-up has no "none": [] turns it off.
    assert _refused(["compressor=dgc", "compressor.warmup_densities=null"], "compressor").startswith(
        "compressor.warmup_densities=None must be a list of float"
    )
    _check(_compose("trainer.max_epochs=null", "trainer.limit_train_batches=null"), "trainer")
    assert _refused(["data=digits", "data.batch_size=null"], "data").startswith(
        "data.batch_size=None must be a positive integer"
    )


def test_unions_take_any_of_their_members():
    for devices in ("2", "auto", "[0,1]"):
        _check(_compose("trainer=gpu", f"trainer.devices={devices}"), "trainer")
    for limit in ("4", "0.5"):
        _check(_compose(f"trainer.limit_train_batches={limit}"), "trainer")
    for precision in ("16-mixed", "bf16-mixed", "16", "32"):
        _check(_compose("trainer=gpu", f"trainer.precision={precision}"), "trainer")
    assert "trainer.precision='fp8' must be one of 64, 32, 16," in _refused(
        ["trainer=gpu", "trainer.precision=fp8"], "trainer"
    )


def test_paths_take_strings():
    check_node_types({"_target_": "pytorch_lightning.loggers.CSVLogger", "save_dir": "out", "name": "csv"}, "logger.c")
    with pytest.raises(TypeError, match=r"logger.c.save_dir=3 must be a str or a path \(str\)"):
        check_node_types({"_target_": "pytorch_lightning.loggers.CSVLogger", "save_dir": 3}, "logger.c")


def test_a_missing_mandatory_value_is_left_to_omegaconf():
    # warmup_*.yaml leave warmup_steps ??? on purpose: OmegaConf names it when it is read.
    _check(_compose("scheduler=warmup_cosine"), "scheduler")


def test_ignored_and_private_keys_are_not_checked():
    node = _node(_compose("compressor=topk"), "compressor")
    assert node["error_feedback"] is True and node["_target_"] == "lgc.compressors.TopKCompressor"
    check_node_types(node, "compressor", ignore=ERROR_FEEDBACK_KEYS)
    with pytest.raises(TypeError, match="compressor.error_feedback is not a parameter"):
        check_node_types(node, "compressor")
    check_node_types(
        {**node, "_partial_": True, "_recursive_": False, "_convert_": "all"}, "compressor", ignore=ERROR_FEEDBACK_KEYS
    )


def test_an_unresolvable_target_is_left_to_hydra():
    check_node_types({"_target_": "lgc.no_such_module.Thing", "density": "abc"}, "compressor")
    check_node_types({"_target_": 3, "density": "abc"}, "compressor")
    check_node_types({"density": "abc"}, "compressor")


def test_annotations_that_do_not_resolve_are_skipped_not_fatal():
    def target(a: int, b: NoSuchName, c: Sequence[NoSuchName]) -> None:  # noqa: F821
        """Two annotations that name nothing."""

    check_node_types({"_target_": target, "b": "anything", "c": 3}, "x")
    with pytest.raises(TypeError, match=r"^x.a='abc' must be an int"):
        check_node_types({"_target_": target, "a": "abc", "b": "anything"}, "x")


def test_other_annotations():
    def target(
        flag: bool = False,
        count: int = 0,
        pair: tuple[int, float] = (0, 0.0),
        many: tuple[int, ...] = (),
        table: dict[str, float] | None = None,
        mode: Literal["a", "b"] | None = None,
        anything: Any = None,
        path: os.PathLike[str] | None = None,
        callback: Any | None = None,
    ) -> None:
        """One parameter of each kind."""

    def ok(**values: Any) -> None:
        check_node_types({"_target_": target, **values}, "x")

    def refused(expected: str, **values: Any) -> None:
        with pytest.raises(TypeError, match=expected):
            check_node_types({"_target_": target, **values}, "x")

    ok(flag=True, count=3, pair=[1, 2], many=[1, 2, 3], table={"a": 1, "b": 0.5}, mode="a", anything=[{}])
    ok(path="some/where", callback="x", table=None, mode=None, many=[])
    refused(r"^x.flag=1 must be a bool", flag=1)
    refused(r"^x.count=True must be an int", count=True)
    refused(r"^x.pair=\[1\] must be a list \[int, float\]", pair=[1])
    refused(r"^x.pair=\[1.5, 2\] must be a list \[int, float\]", pair=[1.5, 2])
    refused(r"^x.many=\[1, 'a'\] must be a list of int", many=[1, "a"])
    refused(r"^x.table=\{'a': 'b'\} must be a dict of str to float or None", table={"a": "b"})
    refused(r"^x.mode='c' must be one of 'a', 'b' or None", mode="c")
    refused(r"^x.path=1 must be a path \(str\) or None", path=1)


# Every shipped config passes (no false refusals).


@pytest.mark.parametrize("name", _names("compressor"))
def test_every_compressor_config_passes(name):
    _check(_compose(f"compressor={name}"), "compressor")


@pytest.mark.parametrize("group", ["model", "data", "trainer", "scheduler"])
def test_every_config_of_the_group_passes(group):
    for name in _names(group):
        cfg = _compose(f"{group}={name}")
        _check(cfg, group)


def test_the_default_config_passes_as_a_whole():
    _check_all(_compose())


@pytest.mark.parametrize("logger", _names("logger"))
def test_every_logger_config_passes(logger):
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"logger={logger}", "output_dir=/tmp/lgc-config-types"])
    _check_all(cfg)


# Every experiment passes too: tests/lit/test_experiments.py checks each as it builds its parts.


@dataclass
class _Settings:
    """A dataclass target: its generated ``__init__`` carries the fields' annotations (strings here)."""

    size: int
    ratio: float = 0.5
    names: Sequence[str] = ()


def test_dataclass_targets_are_checked():
    check_node_types({"_target_": _Settings, "size": 3, "ratio": 1, "names": ["a"]}, "x")
    with pytest.raises(TypeError, match=r"^x.ratio='abc' must be a float"):
        check_node_types({"_target_": _Settings, "size": 3, "ratio": "abc"}, "x")
    with pytest.raises(TypeError, match=r"^x.other is not a parameter of .*_Settings \(it takes: size, ratio, names\)"):
        check_node_types({"_target_": _Settings, "other": 1}, "x")


def test_a_target_without_parameters_takes_no_key():
    with pytest.raises(
        TypeError, match=r"^compressor.density is not a parameter of .*NoneCompressor \(it takes none\)"
    ):
        _check(_compose("compressor=none", "+compressor.density=0.1"), "compressor")


def test_a_dict_config_is_converted_first():
    cfg = _compose("compressor=topk", "compressor.density=[0.1]")
    with pytest.raises(TypeError, match=r"^compressor.density=\[0.1\] must be a number in \(0, 1\]"):
        check_node_types(cfg.compressor, "compressor", ignore=ERROR_FEEDBACK_KEYS)
    check_node_types(_compose("compressor=dgc").compressor, "compressor", ignore=ERROR_FEEDBACK_KEYS)
