"""Type checks of Hydra config nodes against their ``_target_``'s annotations, before instantiation.

A wrong-type override (``compressor.density=abc``, ``trainer.max_steps=[1]``) otherwise fails deep
inside a constructor with a message that names no field ("could not convert string to float").
:func:`check_node_types` reads the ``_target_`` callable's signature and refuses, with a
:class:`TypeError` that names the field, every value that cannot fit its parameter's annotation.

The check is deliberately lenient where it cannot be sure: an annotation it does not understand
(``Callable``, a class that config values cannot be, a forward reference that does not resolve)
accepts anything, and the constructor's own validation stays the authority on values (ranges,
consistency). Only the shape is checked here: scalars (``bool`` is not an ``int``; an ``int`` is a
``float``), ``None``, unions, literals, sequences, mappings and paths (a ``str`` is a path).
"""

from __future__ import annotations

import collections
import collections.abc as abc
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, NamedTuple, Union

import hydra.utils
from omegaconf import DictConfig, OmegaConf

__all__ = ["check_node_types"]

#: What OmegaConf leaves for a mandatory value nobody set (``key: ???``): OmegaConf reports it itself.
_MISSING = "???"
#: Origins (and bare classes) of annotations whose config value is a YAML list.
_SEQUENCES = (
    list,
    tuple,
    set,
    frozenset,
    abc.Sequence,
    abc.MutableSequence,
    abc.Iterable,
    abc.Collection,
    abc.Set,
    abc.MutableSet,
)
#: Origins (and bare classes) of annotations whose config value is a YAML mapping.
_MAPPINGS = (dict, abc.Mapping, abc.MutableMapping, collections.OrderedDict, collections.defaultdict)
#: Scalar annotations a YAML value is checked against exactly.
_SCALARS = (bool, int, float, str)
_ARTICLES = {int: "an int", float: "a float", bool: "a bool", str: "a str"}


class _Parameters(NamedTuple):
    """The keyword parameters a target takes (name -> annotation, absent when unknown)."""

    names: tuple[str, ...]
    annotations: dict[str, Any]
    takes_any_keyword: bool


def check_node_types(node: Mapping[str, Any], what: str, *, ignore: Collection[str] = ()) -> None:
    """Raise TypeError naming `{what}.{key}={value!r}` and the expected type when a value in a Hydra
    config node (a plain dict after OmegaConf.to_container(resolve=True), with `_target_`) does not
    fit the annotation of the matching parameter of the `_target_` callable.

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
            if not _fits_safely(value, annotation):
                try:
                    expected = _describe(annotation) or f"of type {annotation!r}"
                except Exception:
                    expected = f"of type {annotation!r}"
                raise TypeError(f"{what}.{key}={value!r} must be {expected} (a parameter of {_name_of(target)})")
        if recursive:
            _check_nested(value, f"{what}.{key}")


def _fits_safely(value: Any, annotation: Any) -> bool:
    """:func:`_fits`, accepting the value where an odd annotation makes the check itself fail."""
    try:
        return _fits(value, annotation)
    except Exception:
        return True


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


def _hints(function: Any, signature: inspect.Signature, module: str | None = None) -> dict[str, Any]:
    """``typing.get_type_hints(function)``, plus each other annotation of ``signature`` that evaluates on its own.

    Where ``get_type_hints`` fails (a forward reference or a name imported only for type checkers),
    every annotation is tried alone, so one that does not resolve leaves only its parameter unchecked.
    """
    try:
        hints = {name: hint for name, hint in typing.get_type_hints(function).items() if name != "return"}
    except Exception:
        hints = {}
    unwrapped = inspect.unwrap(function) if callable(function) else function
    globalns = getattr(unwrapped, "__globals__", None)
    if globalns is None:
        found = sys.modules.get(module or getattr(function, "__module__", None) or "")
        globalns = vars(found) if found is not None else {}
    for name, parameter in signature.parameters.items():
        if name in hints or parameter.annotation is inspect.Parameter.empty:
            continue
        try:
            holder = types.SimpleNamespace(__annotations__={name: parameter.annotation})
            hints[name] = typing.get_type_hints(holder, globalns=globalns)[name]
        except Exception:
            continue
    return hints


def _is_path(annotation: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    try:
        return isinstance(origin, type) and issubclass(origin, os.PathLike)
    except TypeError:
        return False


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def _is_known(annotation: Any) -> bool:
    """Whether ``annotation`` states what a YAML value must look like (so it can refuse one)."""
    origin = typing.get_origin(annotation)
    if annotation in _SCALARS or origin is Literal or _is_path(annotation):
        return True
    if _is_union(origin):
        return any(_is_known(member) for member in typing.get_args(annotation))
    return False


def _fits(value: Any, annotation: Any, *, strict: bool = False) -> bool:
    """Whether ``value`` (from YAML / a Hydra override) can be an argument of type ``annotation``.

    An annotation not understood accepts anything, unless ``strict`` (it stands in a union beside
    scalar alternatives, e.g. ``float | Tensor``): then the value must be an instance of it.
    """
    if _is_node(value) or annotation is Any or annotation is object or isinstance(annotation, typing.TypeVar):
        return True
    if annotation is None or annotation is type(None):
        return value is None
    if hasattr(annotation, "__supertype__"):  # typing.NewType
        return _fits(value, annotation.__supertype__, strict=strict)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _fits(value, args[0], strict=strict)
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in args)
    if _is_union(origin):
        strict = any(_is_known(member) for member in args)
        return any(_fits(value, member, strict=strict) for member in args)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if _is_path(annotation):
        return isinstance(value, (str, os.PathLike))
    container = origin if origin is not None else annotation
    if container in _SEQUENCES:
        return isinstance(value, (list, tuple)) and _items_fit(value, container, args)
    if container in _MAPPINGS:
        return isinstance(value, Mapping) and (
            len(args) != 2 or all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
        )
    if strict:
        if isinstance(container, type):
            try:
                return isinstance(value, container)
            except TypeError:
                return True
        if container is abc.Callable:
            return callable(value)
    return True


def _items_fit(value: list[Any] | tuple[Any, ...], container: Any, args: tuple[Any, ...]) -> bool:
    if not args:
        return True
    if container is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if args == ((),):
            return len(value) == 0
        return len(value) == len(args) and all(_fits(item, arg) for item, arg in zip(value, args, strict=True))
    return all(_fits(item, args[0]) for item in value)


def _describe(annotation: Any) -> str | None:
    """What ``annotation`` asks for, in words with an article ("an int or None"); None: not known."""
    if annotation is None or annotation is type(None):
        return "None"
    if hasattr(annotation, "__supertype__"):
        return _describe(annotation.__supertype__)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _describe(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in args)
    if _is_union(origin):
        return _describe_union(args)
    if annotation in _ARTICLES:
        return _ARTICLES[annotation]
    if _is_path(annotation):
        return "a path (str)"
    container = origin if origin is not None else annotation
    if container in _SEQUENCES:
        if not args:
            return "a list"
        if container is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return "an empty list" if args == ((),) else f"a list [{', '.join(_noun(arg) for arg in args)}]"
        return f"a list of {_noun(args[0])}"
    if container in _MAPPINGS:
        return f"a dict of {_noun(args[0])} to {_noun(args[1])}" if len(args) == 2 else "a dict"
    return None


def _describe_union(members: tuple[Any, ...]) -> str | None:
    choices: list[Any] = []
    parts: list[str] = []
    optional = False
    for member in members:
        if member is None or member is type(None):
            optional = True
        elif typing.get_origin(member) is Literal:
            choices.extend(typing.get_args(member))
        elif (part := _describe(member)) is not None and part not in parts:
            parts.append(part)
    if choices:
        parts.append("one of " + ", ".join(repr(choice) for choice in choices))
    if optional:
        parts.append("None")
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _noun(annotation: Any) -> str:
    """``annotation`` as the element of a list or mapping: "int", "(int or None)", "list of float"."""
    if annotation in _ARTICLES:
        return annotation.__name__
    if annotation is Any or annotation is object:
        return "anything"
    description = _describe(annotation)
    if description is None:
        return getattr(annotation, "__name__", None) or repr(annotation)
    for article in ("a ", "an "):
        if description.startswith(article) and " or " not in description:
            return description[len(article) :]
    return f"({description})" if " or " in description or description.startswith("one of") else description
