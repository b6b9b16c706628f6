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
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(lgc.provenance, "package_checkout", lambda: tmp_path)
    return tmp_path


def test_a_clean_checkout_records_its_commit(checkout):
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    record = run_provenance()
    assert record["commit"] == head.strip() and len(record["commit"]) == 40
    assert record["dirty"] is False and record["changed"] == [] and record["changed_count"] == 0
    # Untracked files (run outputs) do not make a tree dirty.
    (checkout / "outputs.txt").write_text("run\n")
    assert run_provenance()["dirty"] is False


def test_a_changed_tracked_file_is_named(checkout):
    (checkout / "code.py").write_text("x = 2\n")
    record = run_provenance()
    assert record["dirty"] is True and record["changed"] == ["code.py"] and record["changed_count"] == 1


def test_outside_a_checkout_the_commit_is_unknown(monkeypatch):
    monkeypatch.setattr(lgc.provenance, "package_checkout", lambda: None)
    record = run_provenance()
    assert record["commit"] is None and record["dirty"] is None
    assert record["versions"]["lgc"] is not None and record["versions"]["torch"]
