"""lgc-bench runs end to end on a small gradient (a smoke test; timings are not asserted)."""

import json

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
    assert "| topk |" in capsys.readouterr().out
