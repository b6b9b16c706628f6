"""Values of a run's summary as the report compares and prints them: missing ones, dotted keys, Hydra syntax."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["MISSING", "flatten", "format_value", "lookup", "markdown_table", "norm", "varies"]


class _Missing:
    """A value the summary does not have (shown as ``-``), unlike a null one (``n/a``)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def lookup(mapping: Any, dotted: str) -> Any:
    """``mapping["a"]["b"]`` for ``"a.b"`` (an exact key such as ``val/acc`` first); MISSING if absent."""
    if isinstance(mapping, dict) and dotted in mapping:
        return mapping[dotted]
    for part in dotted.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return MISSING
        mapping = mapping[part]
    return mapping


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested dict by dotted key (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def norm(value: Any) -> str:
    """Comparable and hashable; True and 1 stay apart, 1 and 1.0 do not."""
    if value is MISSING:
        return "<missing>"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(float(value))
    return json.dumps(value, sort_keys=True, default=str)


def varies(values: Iterable[Any]) -> bool:
    """Whether the values are not all alike (:func:`norm`)."""
    return len({norm(value) for value in values}) > 1


def format_value(value: Any) -> str:
    """As one would type it in a Hydra override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, list):
        return "[" + ",".join(format_value(item) for item in value) + "]"
    return str(value)


def markdown_table(header: list[str], rows: Iterable[list[str]]) -> str:
    """A markdown table of ``header`` and the ``rows`` of cells (already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(cells) + " |" for cells in rows)])
