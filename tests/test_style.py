"""The code style CI enforces: ruff's lint rules and formatting (``pyproject.toml``), on every file."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes_on_the_repository(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
