"""lgc-bench runs end to end on a small gradient (a smoke test; timings are not asserted)."""

import json
import subprocess
import sys

import pytest

from lgc.bench.cli import main
from lgc.bench.compressors import resnet50_numels


def test_resnet50_has_the_documented_number_of_elements():
    assert sum(resnet50_numels()) == 25_557_032


def test_compressor_benchmark_reports_every_configured_compressor(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["compressors", "--numel", "5000", "70000", "--repeats", "1", "--density", "0.01", "--json", str(out)])
    result = json.loads(out.read_text())
    names = {row["compressor"] for row in result["rows"]}
    assert {"none", "fp16", "topk"} <= names
    assert result["numel"] == 75_000
    rows = {row["compressor"]: row for row in result["rows"]}
    assert rows["none"]["bits_per_element"] == 32
    assert rows["fp16"]["bits_per_element"] == 16
    # top-k sends ceil(0.01 n) (fp32 value, int32 index) pairs per tensor: 50 + 700 pairs of 64 bits.
    assert rows["topk"]["bits_per_element"] == 64 * (50 + 700) / 75_000
    # DGC is timed after its warm-up, at the density asked for (same k per tensor as top-k).
    assert rows["dgc"]["bits_per_element"] == rows["topk"]["bits_per_element"]
    assert "| topk |" in capsys.readouterr().out


def test_golomb_section_measures_the_code_against_its_formula_and_the_entropy_bound():
    from lgc.bench.compressors import golomb_bits

    rows = golomb_bits(2_000_000, ps=(0.01, 0.001))
    for row in rows:
        assert row["positions"] == pytest.approx(row["p"] * 2_000_000, rel=0.1)
        assert row["bits_per_position"] == pytest.approx(row["expected_bits"], rel=0.01)
        assert row["bits_per_position"] == pytest.approx(row["entropy_bits"], rel=0.02)
    assert [row["b"] for row in rows] == [6, 9]


def test_help_is_plain_text_and_loads_no_training_stack():
    # In a fresh interpreter: this test process has Lightning loaded already.
    code = """
import sys
from lgc.bench.cli import main
for argv in (["--help"], ["compressors", "--help"], ["autoencoder", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = ("pytorch_lightning", "lightning_fabric", "torchvision", "torchmetrics", "wandb", "hydra", "lgc.analysis")
print("loaded:", sorted(name for name in heavy if name in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "loaded: []"
    assert "encode + decode time and bits per element" in out and "``" not in out and ":func:" not in out
