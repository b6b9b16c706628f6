"""Values checked against annotations by pydantic: the aliases the constructors annotate with, and one check.

A knob's constraint is written once, as an ``Annotated`` alias in its constructor's signature
(``density: Density``), and read by pydantic in two places: the constructor's own :func:`check`
(``lgc.compress``, scripts) and ``lgc-train``'s check of the config before any worker starts
(:mod:`lgc.config_types`), so both refuse the same values with the same words. Checks are
strict: a bool is not a number, a number is not a string, a float is not an int (an int is a
float).

Messages name the value and what it must be: ``density must be a number in (0, 1], got 1.5``.
"""

from __future__ import annotations

import collections.abc as abc
import json
import os
import types
import typing
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

__all__ = [
    "Density",
    "Fraction",
    "Momentum",
    "NonNegativeFloat",
    "NonNegativeInt",
    "OpenFraction",
    "PositiveFloat",
    "PositiveFraction",
    "PositiveInt",
    "Seed",
    "check",
    "fits_json",
    "json_misfit",
    "spell",
]

#: A fraction of a tensor's entries that is sent (top-k's, DGC's, SBC's ``density``).
Density = Annotated[float, Field(gt=0, le=1, description="a number in (0, 1]")]
#: A share or weight between 0 and 1 inclusive.
Fraction = Annotated[float, Field(ge=0, le=1, description="a number in [0, 1]")]
#: A share above 0 that may be the whole (a decay factor, a sampled share, a starting factor).
PositiveFraction = Annotated[float, Field(gt=0, le=1, description="a number in (0, 1]")]
#: A share strictly between 0 and 1 (a held-out share, a tolerance).
OpenFraction = Annotated[float, Field(gt=0, lt=1, description="a number in (0, 1)")]
#: A momentum or decay coefficient (below 1: it must forget).
Momentum = Annotated[float, Field(ge=0, lt=1, description="a number in [0, 1)")]
#: A count that must be at least one (levels, steps, workers, chunk sizes).
PositiveInt = Annotated[int, Field(ge=1, description="a positive integer")]
#: A count that may be zero.
NonNegativeInt = Annotated[int, Field(ge=0, description="a non-negative integer")]
#: A finite number above zero (a learning rate, a scale).
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False, description="a positive finite number")]
#: A finite number that may be zero (a weight decay, a tolerance).
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False, description="a non-negative finite number")]
#: A run's seed (Lightning's ``seed_everything`` seeds numpy, which takes ``[0, 2**32)``; beyond it
#: Lightning would pick a random seed instead).
RunSeed = Annotated[int, Field(ge=0, lt=2**32, description="an integer in [0, 2**32)")]
#: Any finite number.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False, description="a finite number")]
#: A seed of a random generator (torch's generators take ``[0, 2**63)``).
Seed = Annotated[int, Field(ge=0, lt=2**63, description="an integer in [0, 2**63)")]

_T = TypeVar("_T")
_CONFIG = ConfigDict(arbitrary_types_allowed=True)
_ADAPTERS: dict[int, tuple[Any, TypeAdapter[Any]]] = {}


def _adapter(annotation: Any) -> TypeAdapter[Any]:
    """One pydantic adapter per annotation (kept with the annotation, so the id stays its own)."""
    found = _ADAPTERS.get(id(annotation))
    if found is None or found[0] is not annotation:
        found = (annotation, TypeAdapter(annotation, config=_CONFIG))
        _ADAPTERS[id(annotation)] = found
    return found[1]


def check(name: str, value: _T, annotation: Any) -> _T:
    """``value`` unchanged if it fits ``annotation`` (strictly), else a ValueError naming ``name`` and ``value``.

    >>> check("density", 0.01, Density)
    0.01
    >>> check("density", 1.5, Density)
    Traceback (most recent call last):
    ...
    ValueError: density must be a number in (0, 1], got 1.5
    """
    if _numpy_scalar(value):
        hint = f" (a numpy scalar: pass {type(value.item()).__name__}(x), {value.item()!r})"
        raise ValueError(f"{name} must be {spell(annotation)}, got {value!r}{hint}")
    try:
        _consumed(_adapter(annotation).validate_python(value, strict=True))
    except ValidationError:
        raise ValueError(f"{name} must be {spell(annotation)}, got {value!r}") from None
    return value


def _numpy_scalar(value: Any) -> bool:
    """A numpy scalar that is not a Python number (``np.int64``, ``np.float32``, ``np.bool_``; ``np.float64``
    is a float): refused, consistently, since pydantic would take some as numbers (``np.bool_`` among them),
    and they would reach configs, checkpoints and JSON records as numpy's types."""
    return type(value).__module__ == "numpy" and hasattr(value, "item") and not isinstance(value, (int, float))


def _consumed(validated: Any) -> Any:
    """pydantic checks an ``Iterable[...]`` lazily, item by item as its result is iterated: iterate it, so
    that a bad item is refused here (``milestones=[abc]``) rather than wherever the value is later read."""
    if isinstance(validated, abc.Iterator):
        list(validated)
    return validated


def fits_json(value: Any, annotation: Any) -> bool:
    """Whether a config value (YAML's types: numbers, strings, bools, None, lists, mappings) fits ``annotation``.

    Checked as pydantic checks JSON, strictly: a list is a tuple, a string a path, but a string is
    not a number and a bool not an int. An annotation pydantic cannot build a check for (a
    forward reference, an odd class) accepts anything: the constructor stays the authority.
    """
    return json_misfit(value, annotation) is None


#: pydantic's errors for a value of the right type outside its alias's bounds.
_BOUND_ERRORS = frozenset(
    {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of", "finite_number"}
)


def json_misfit(value: Any, annotation: Any) -> Literal["type", "value"] | None:
    """How a config value misses ``annotation`` (as :func:`fits_json` checks): ``"value"`` when it has
    the right type but lies outside the alias's bounds (``density=1.5``), ``"type"`` otherwise, None
    when it fits."""
    try:
        adapter = _adapter(annotation)
    except Exception:
        return None
    try:
        _consumed(adapter.validate_json(json.dumps(value), strict=True))
    except ValidationError as err:
        return "value" if any(error["type"] in _BOUND_ERRORS for error in err.errors()) else "type"
    except Exception:
        return None
    return None


def _description(annotation: Any) -> str | None:
    if typing.get_origin(annotation) is Annotated:
        for meta in typing.get_args(annotation)[1:]:
            if isinstance(meta, FieldInfo) and meta.description:
                return meta.description
    return None


_ARTICLES = {bool: "a bool", int: "an int", float: "a float", str: "a str"}
_LISTS = (list, tuple, set, frozenset, abc.Sequence, abc.MutableSequence, abc.Iterable, abc.Collection, abc.Set)
_MAPPINGS = (dict, abc.Mapping, abc.MutableMapping)


def spell(annotation: Any) -> str:
    """What ``annotation`` asks for, in words: ``a number in (0, 1] or None``, ``a list of int``, ``one of 'a', 1``."""
    if (description := _description(annotation)) is not None:
        return description
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is None or annotation is type(None):
        return "None"
    if annotation in _ARTICLES:
        return _ARTICLES[annotation]
    if origin is Annotated:
        return spell(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in args)
    if origin is Union or origin is types.UnionType:
        literals = [member for member in args if typing.get_origin(member) is Literal]
        choices = [choice for member in literals for choice in typing.get_args(member)]
        words = [spell(member) for member in args if typing.get_origin(member) is not Literal]
        if choices:
            words.insert(0, spell(Literal[tuple(choices)]))
        return " or ".join(dict.fromkeys(words))
    container = origin or annotation
    if container is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        return "an empty list" if args == ((),) else f"a list [{', '.join(_noun(arg) for arg in args)}]"
    if container in _LISTS:
        return f"a list of {_noun(args[0])}" if args else "a list"
    if container in _MAPPINGS:
        return f"a dict of {_noun(args[0])} to {_noun(args[1])}" if len(args) == 2 else "a dict"
    if isinstance(container, type) and issubclass(container, os.PathLike):
        return "a path (str)"
    if isinstance(annotation, type):
        return f"a {annotation.__name__}"
    return repr(annotation).replace("typing.", "").replace("collections.abc.", "")


def _noun(annotation: Any) -> str:
    """``annotation`` as the element of a list: ``float``, ``(int or None)``."""
    origin = typing.get_origin(annotation)
    if (origin is Union or origin is types.UnionType) and _description(annotation) is None:
        return f"({' or '.join(dict.fromkeys(_noun(member) for member in typing.get_args(annotation)))})"
    words = spell(annotation)
    if " or " in words or words.startswith("one of"):
        return f"({words})"
    return words.removeprefix("an ").removeprefix("a ")
