"""The documentation site builds offline with warnings as errors, and its API reference covers every module."""

import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_site_builds_offline_with_warnings_as_errors(tmp_path):
    """Every page, its links and includes, and every docstring autodoc renders (napoleon's Args: too)."""
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    for page in ("index", "methods", "lgc", "local-steps", "usage", "evidence", "benchmarks", "experiments", "api"):
        assert (tmp_path / f"{page}.html").is_file(), page
    api = (tmp_path / "api.html").read_text()
    assert "CompressionHookState" in api and "steady_from" in api, "autodoc rendered the classes and their methods"


def test_the_api_reference_documents_every_module():
    modules = {
        m.name
        for m in pkgutil.walk_packages([str(ROOT / "lgc")], prefix="lgc.")
        if not m.name.rsplit(".", 1)[-1].startswith("_")
    }
    text = (DOCS / "api.md").read_text()
    documented = {line.split("::", 1)[1].strip() for line in text.splitlines() if line.startswith(".. automodule::")}
    assert modules - documented == set(), "add them to docs/api.md"
    assert documented - modules - {"lgc"} == set(), "docs/api.md names modules that do not exist"


def test_the_readme_is_a_first_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: the rest belongs on a page of docs/"
    text = (ROOT / "README.md").read_text()
    pages = ("methods", "lgc", "evidence", "usage", "benchmarks", "layout")
    assert [page for page in pages if f"docs/{page}.md" not in text] == [], "the README links every page"
