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


#: A module longer than this says in its docstring why it is one module ("Why one module: ...").
MODULE_LINE_LIMIT = 400


def _module_docstrings() -> dict[str, tuple[int, str]]:
    import ast

    found = {}
    for path in sorted((ROOT / "lgc").rglob("*.py")):
        text = path.read_text()
        found[str(path.relative_to(ROOT))] = (len(text.splitlines()), ast.get_docstring(ast.parse(text)) or "")
    return found


def test_a_module_over_the_limit_says_why_it_is_one_module():
    modules = _module_docstrings()
    unexplained = [
        f"{name} ({lines} lines)"
        for name, (lines, doc) in modules.items()
        if lines > MODULE_LINE_LIMIT and "Why one module:" not in doc
    ]
    assert unexplained == [], "say why in the module docstring ('Why one module: ...'), or split it"


def test_no_docstring_quotes_a_line_count():
    import re

    quoting = [name for name, (_, doc) in _module_docstrings().items() if re.search(r"\b\d[\d,]* lines\b", doc)]
    assert quoting == [], "a line count in prose goes stale with the next edit: give the reason instead"
