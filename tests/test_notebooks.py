"""The notebooks are stored without outputs and run from top to bottom (nbclient, a real kernel)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# Each notebook runs in under 2 minutes on 2 cores; the margin is for a machine busy with other work.
TIMEOUT_S = 300


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_there_are_notebooks():
    names = [path.name for path in _notebooks()]
    assert "gradient_correlation.ipynb" in names and "compression_tradeoffs.ipynb" in names


@pytest.mark.parametrize("path", _notebooks(), ids=lambda path: path.stem)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip the outputs"


def _run(path: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[nbformat.NotebookNode, float]:
    """Execute the notebook in ``cwd``; it must leave none of its temporary folders (in ``cwd/tmp``) behind."""
    notebook = nbformat.read(path, as_version=4)
    tmp = cwd / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # inherited by the kernel (tempfile.gettempdir())
    start = time.perf_counter()
    nbclient.NotebookClient(
        notebook, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    seconds = time.perf_counter() - start
    assert not list(tmp.glob(f"{path.stem}_*")), f"{path.name} left its temporary folder behind"
    return notebook, seconds


def _printed_json(notebook: nbformat.NotebookNode) -> object:
    """The last line printed by the cell that prints ``json.dumps(...)``."""
    (cell,) = [cell for cell in notebook.cells if cell.cell_type == "code" and "print(json.dumps(" in cell.source]
    return json.loads(cell.outputs[-1]["text"].strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gradient_correlation_notebook_runs_and_reports_both_partitions(tmp_path, monkeypatch):
    notebook, seconds = _run(NOTEBOOKS / "gradient_correlation.ipynb", tmp_path, monkeypatch)
    printed = _printed_json(notebook)
    summary = printed["partitions"]
    assert list(summary) == ["IID", "Dirichlet alpha=0.1"]
    for layers in summary.values():
        assert len(layers) == 3  # the first, a middle and the last conv weight
        for row in layers.values():
            assert -1.0 <= row["cosine_mean"] <= 1.0 and 0.0 <= row["jaccard_mean"] <= 1.0
    # The values at the leader's positions, per layer, leader kind and per-worker batch size.
    leader = printed["leader"]
    assert len(leader) == 2  # the first conv (144 weights) has one position at 1 %: left out
    for kinds in leader.values():
        assert set(kinds) == {"fixed", "rotating"}
        for sizes in kinds.values():
            assert list(sizes) == ["8", "32", "128"]
            for row in sizes.values():
                assert -1.0 <= row["correlation"] <= 1.0 and 0.0 < row["energy_share"] <= 1.0
    figures = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(figures) == 3
    assert seconds < TIMEOUT_S


@pytest.mark.multiprocess
def test_compression_tradeoffs_notebook_runs_its_sweep_and_reports_it(tmp_path, monkeypatch):
    notebook, seconds = _run(NOTEBOOKS / "compression_tradeoffs.ipynb", tmp_path, monkeypatch)
    rows = _printed_json(notebook)
    # Labels from what each run was asked for: the compressor option, then the overrides that tell it apart.
    assert [row["label"] for row in rows] == [
        "none",
        "topk density=0.01",
        "topk density=0.1",
        "dgc warmup_densities=[]",
    ]
    for row in rows:
        assert row["world_size"] == 2 and row["steps"] == 22 and 0.0 <= row["val/acc"] <= 1.0
    dense, topk, topk_10pct, dgc = rows
    assert dense["compression_ratio"] == dense["payload_compression_ratio"] == 1.0
    # The compressor's own ratio: 8 bytes per kept entry (top-k), fewer entries kept by DGC at 0.1 %.
    assert topk["payload_compression_ratio"] == pytest.approx(50, rel=0.02)
    assert topk_10pct["payload_compression_ratio"] == pytest.approx(5, rel=0.02)
    assert dgc["payload_compression_ratio"] > topk["payload_compression_ratio"]
    # Overall, the dense first step and the small tensors count too.
    assert 1.0 < topk_10pct["compression_ratio"] < topk["compression_ratio"] < topk["payload_compression_ratio"]
    table = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "| topk density=0.1        | topk       |          2 |    22 |" in table
    figures = [o for cell in notebook.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(figures) == 2
    assert seconds < TIMEOUT_S
