"""Hydra config nodes checked against their ``_target_``'s annotations, before instantiation.

A wrong-type override (``compressor.density=abc``, ``trainer.max_steps=[1]``) otherwise fails deep
inside a constructor with a message that names no field ("could not convert string to float").
:func:`check_node_types` reads the ``_target_`` callable's signature and has pydantic check every
value against its parameter's annotation (:func:`lgc.validation.json_misfit`: strictly, as JSON,
so a bool is not an int and a string not a number, a list is a tuple and a string a path); a
value that does not fit is refused with an error that names the field: a :class:`TypeError`, or
a :class:`ValueError` for a number outside its bounds. lgc's own knobs are annotated with
constrained aliases (``density: Density``), so their ranges are refused here too, in the same
words as the constructor's own check.

An annotation pydantic cannot check (a forward reference that does not resolve) accepts anything;
the constructor stays the authority on consistency between knobs.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import hydra.utils
from omegaconf import DictConfig, OmegaConf

from lgc.validation import json_misfit, spell

__all__ = ["check_node_types"]

#: What OmegaConf leaves for a mandatory value nobody set (``key: ???``): OmegaConf reports it itself.
_MISSING = "???"


class _Parameters(NamedTuple):
    """The keyword parameters a target takes (name -> annotation, absent when unknown)."""

    names: tuple[str, ...]
    annotations: dict[str, Any]
    takes_any_keyword: bool


def check_node_types(node: Mapping[str, Any], what: str, *, ignore: Collection[str] = ()) -> None:
    """Raise an error naming ``{what}.{key}={value!r}`` and what it must be when a value in a Hydra
    config node (a plain dict after OmegaConf.to_container(resolve=True), with `_target_`) does not
    fit the annotation of the matching parameter of the `_target_` callable: a TypeError, or a
    ValueError for a number of the right type outside its alias's bounds.

    Keys starting with ``_`` (``_target_``, ``_partial_``, ...) and those in ``ignore`` (lgc's own
    keys, popped before instantiation, e.g. ``compressor.error_feedback``) are not checked. A key
    the target does not take is refused when its signature has no ``**kwargs``; with ``**kwargs``,
    keys matching a base class's ``__init__`` (where ``**kwargs`` usually goes) are checked against
    its annotations and the rest are left to the target. A nested node with a ``_target_`` (Hydra
    instantiates it first) is checked in turn, as ``{what}.{key}``. Values left ``???`` (missing)
    are OmegaConf's to report. A target that cannot be resolved is Hydra's to report: nothing is
    checked then.
    """
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    target = _resolve_target(node.get("_target_"))
    if target is None:
        return
    try:
        parameters = _parameters(target)
    except Exception:  # an odd signature is the target's to report, never the checker's crash
        return
    if parameters is None:
        return
    recursive = node.get("_recursive_", True) is not False
    for key, value in node.items():
        if not isinstance(key, str) or key.startswith("_") or key in ignore:
            continue
        if key not in parameters.names and not parameters.takes_any_keyword:
            takes = f"it takes: {', '.join(parameters.names)}" if parameters.names else "it takes none"
            raise TypeError(f"{what}.{key} is not a parameter of {_name_of(target)} ({takes})")
        if isinstance(value, str) and value == _MISSING:
            continue
        if key in parameters.annotations and not _is_node(value):
            annotation = parameters.annotations[key]
            group = _knob_group(annotation)
            if group is not None and isinstance(value, Mapping):
                _check_group(value, group, f"{what}.{key}")
                continue
            misfit = json_misfit(value, annotation)
            if misfit is not None:
                error = ValueError if misfit == "value" else TypeError
                raise error(f"{what}.{key}={value!r} must be {spell(annotation)} (a parameter of {_name_of(target)})")
        if recursive:
            _check_nested(value, f"{what}.{key}")


def _knob_group(annotation: Any) -> type | None:
    """The dataclass a parameter takes as a group of knobs (``stages: Stages | Mapping[str, Any]``), if any."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _check_group(node: Mapping[str, Any], group: type, what: str) -> None:
    """Check a mapping given for a group of knobs field by field, naming ``{what}.{field}``.

    A mapping changes the fields it names of the target's preset: a key the group lacks is
    refused, and each value is checked against its field's annotation (a field that is itself a
    mapping, such as ``training.loss_weights``, by its value type).
    """
    hints = typing.get_type_hints(group, include_extras=True)
    names = [f.name for f in dataclasses.fields(group)]
    for key, value in node.items():
        if key not in names:
            raise TypeError(f"{what}.{key} is not a knob of {_name_of(group)} (its knobs: {', '.join(names)})")
        if isinstance(value, str) and value == _MISSING:
            continue
        misfit = json_misfit(value, hints[key])
        if misfit is not None:
            error = ValueError if misfit == "value" else TypeError
            raise error(f"{what}.{key}={value!r} must be {spell(hints[key])} (a knob of {_name_of(group)})")


def _resolve_target(target: Any) -> Callable[..., Any] | None:
    """The ``_target_`` callable, or None when it cannot be resolved (Hydra reports that itself)."""
    if callable(target):
        return target
    if not isinstance(target, str):
        return None
    try:
        resolved = hydra.utils.get_object(target)
    except Exception:
        return None
    return resolved if callable(resolved) else None


def _name_of(target: Any) -> str:
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(target)


def _is_node(value: Any) -> bool:
    """Whether Hydra instantiates ``value`` (a mapping with a ``_target_``) before passing it on."""
    return isinstance(value, Mapping) and "_target_" in value


def _check_nested(value: Any, what: str) -> None:
    """Check the nodes with a ``_target_`` in ``value``, at any depth of lists and mappings."""
    if _is_node(value):
        check_node_types(value, what)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_nested(item, f"{what}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_nested(item, f"{what}[{index}]")


def _parameters(target: Callable[..., Any]) -> _Parameters | None:
    """The keyword parameters of ``target`` and their evaluated annotations (None: no signature)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    function = target.__init__ if isinstance(target, type) else target
    annotations = {
        name: hint
        for name, hint in _hints(function, signature, getattr(target, "__module__", None)).items()
        if name in signature.parameters
    }
    names = [name for name, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    if takes_any and isinstance(target, type):
        # **kwargs of a subclass's __init__ usually go on to its base's __init__: take the base's
        # annotations for type checks (never to refuse a key: the kwargs may go elsewhere).
        for base in target.__mro__[1:]:
            if base is object or "__init__" not in vars(base):
                continue
            try:
                base_signature = inspect.signature(base.__init__)
            except (TypeError, ValueError):
                break
            for name, hint in _hints(base.__init__, base_signature, base.__module__).items():
                if name in base_signature.parameters and name not in names and name != "self":
                    annotations.setdefault(name, hint)
            if not any(p.kind is p.VAR_KEYWORD for p in base_signature.parameters.values()):
                break
    return _Parameters(tuple(names), annotations, takes_any)


#: The names an annotation may use from ``typing`` and ``collections.abc`` without its module importing them.
_TYPING_NAMES = {name: getattr(typing, name) for name in typing.__all__} | {
    name: getattr(collections.abc, name) for name in collections.abc.__all__
}


def _hints(function: Any, signature: inspect.Signature, module: str | None = None) -> dict[str, Any]:
    """``typing.get_type_hints(function)``, plus each other annotation of ``signature`` that evaluates on its own.

    Where ``get_type_hints`` fails (a forward reference or a name imported only for type checkers),
    every annotation is tried alone, so one that does not resolve leaves only its parameter unchecked;
    the names of ``typing`` and ``collections.abc`` stand in for such imports (``MultiStepLR``'s
    ``milestones: Iterable[int]``, imported by torch for type checkers only), the module's own first.
    """
    try:
        hints = {
            name: hint
            for name, hint in typing.get_type_hints(function, include_extras=True).items()
            if name != "return"
        }
    except Exception:
        hints = {}
    left = [
        (name, parameter)
        for name, parameter in signature.parameters.items()
        if name not in hints and parameter.annotation is not inspect.Parameter.empty
    ]
    if not left:
        return hints
    unwrapped = inspect.unwrap(function) if callable(function) else function
    globalns = getattr(unwrapped, "__globals__", None)
    if globalns is None:
        found = sys.modules.get(module or getattr(function, "__module__", None) or "")
        globalns = vars(found) if found is not None else {}
    globalns = {**_TYPING_NAMES, **globalns}
    for name, parameter in left:
        try:
            holder = types.SimpleNamespace(__annotations__={name: parameter.annotation})
            hints[name] = typing.get_type_hints(holder, globalns=globalns, include_extras=True)[name]
        except Exception:
            continue
    return hints
