"""A run's provenance: the commit of the checkout holding lgc, whether its tracked files changed."""

import subprocess
from pathlib import Path

import pytest

import lgc.provenance
from lgc.provenance import run_provenance


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git checkout with one committed file, standing in for the one that holds lgc."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "lgc").mkdir()
    (tmp_path / "lgc" / "__init__.py").write_text("")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py", "lgc/__init__.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(lgc.provenance, "package_checkout", lambda: tmp_path)
    return tmp_path


def test_a_clean_checkout_records_its_commit(checkout):
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    record = run_provenance()
    assert record["commit"] == head.strip() and len(record["commit"]) == 40
    assert record["dirty"] is False and record["changed"] == [] and record["changed_count"] == 0
    # Untracked files outside the package (run outputs) do not make a tree dirty; inside it they do.
    (checkout / "outputs.txt").write_text("run\n")
    assert run_provenance()["dirty"] is False
    (checkout / "lgc" / "new_module.py").write_text("y = 1\n")
    record = run_provenance()
    assert record["dirty"] is True and record["changed"] == ["lgc/new_module.py (untracked)"]


def test_a_changed_tracked_file_is_named(checkout):
    (checkout / "code.py").write_text("x = 2\n")
    record = run_provenance()
    assert record["dirty"] is True and record["changed"] == ["code.py"] and record["changed_count"] == 1


def test_the_package_is_credited_to_a_checkout_only_where_git_tracks_it(tmp_path, monkeypatch):
    # This test run's own package: in a checkout that tracks it (the project's), or in none.
    checkout = lgc.provenance.package_checkout()
    if checkout is not None:
        assert (checkout / "lgc" / "__init__.py").resolve() == Path(lgc.__file__).resolve()
    # A folder inside a checkout that does not track it is not credited to that checkout.
    _git(tmp_path, "init", "-q")
    (tmp_path / "site" / "lgc").mkdir(parents=True)
    (tmp_path / "site" / "lgc" / "provenance.py").write_text("")
    monkeypatch.setattr(lgc.provenance, "__file__", str(tmp_path / "site" / "lgc" / "provenance.py"))
    assert lgc.provenance.package_checkout() is None


def test_outside_a_checkout_the_commit_is_unknown(monkeypatch):
    monkeypatch.setattr(lgc.provenance, "package_checkout", lambda: None)
    record = run_provenance()
    assert record["commit"] is None and record["dirty"] is None
    assert record["versions"]["lgc"] is not None and record["versions"]["torch"]
