"""Import the scripts under ``experiments/`` (not a package) fresh, as their tests need them."""

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXPERIMENTS = Path(__file__).parents[2] / "experiments"


def import_fresh(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """``experiments/NAME.py`` imported anew (its module-level state as a first import leaves it), with
    ``experiments/`` on the path for the scripts it imports."""
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    sys.modules.pop(name, None)
    return importlib.import_module(name)
