"""The large-model codec summary (``experiments/codecs_summary.py``) on hand-made benchmark results and on
the committed ones."""

import importlib
import re
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).parents[2] / "experiments"


@pytest.fixture
def summary(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    sys.modules.pop("codecs_summary", None)
    return importlib.import_module("codecs_summary")


def _row(codec: str, bits: float, error: float | None, leader: str = "rotating") -> dict:
    if error is None:
        return {"codec": codec, "leader": leader, "error": None, "note": "cannot sum"}
    return {"codec": codec, "leader": leader, "error": error, "bits_per_value": bits}


def _result(rows: list[dict], workers: int = 4, images: int = 32, density: float = 0.01, complete: bool = True):
    layer = {"correlation": 0.3, "energy_share": 0.4}
    return {
        "label": f"fashion_mnist resnet50, {workers} workers x {images} images (IID), 40 steps, density {density:g}",
        "density": density,
        "chunk": 64,
        "rows": rows,
        "layers": [{"name": "a", "numel": 10, "fixed": layer, "rotating": layer}],
        "complete": complete,
    }


def test_a_learned_codec_is_beaten_by_a_scalar_codec_at_as_many_bits_or_fewer_and_on_the_front_below_them(summary):
    result = _result(
        [
            _row("fp32", 40.0, 0.0),
            _row("int8", 17.0, 0.001),
            _row("int4", 13.0, 0.5),
            _row("levels=1", 13.0, None),  # not measured: left out
            _row("pca:4:fp32", 11.0, 0.6),  # below every scalar's rate, but errs more than the cheapest
            _row("pca:16:int8", 11.5, 0.3),  # on the front and below the cheapest scalar's error
            _row("pcaae:16:fp32", 17.0, 0.2),  # int8 at the same bits errs less
            _row("ae:4:fp32:value", 33.0, 0.4),  # int8 (fewer bits) errs less, fp32 (more bits) is not counted
            _row("topk", 40.4, 0.01),  # neither learned nor scalar rounding
        ]
    )
    verdict = summary.judge(result, "rotating")
    assert verdict["cheapest_scalar"]["codec"] == "int4" and verdict["left_out"] == ["levels=1"]
    standing = {item["row"]["codec"]: item for item in verdict["learned"]}
    assert standing["pca:4:fp32"]["on_front"] and not standing["pca:4:fp32"]["undercuts"]
    assert standing["pca:4:fp32"]["beaten_by"] is None
    assert standing["pca:16:int8"]["on_front"] and standing["pca:16:int8"]["undercuts"]
    assert standing["pcaae:16:fp32"]["beaten_by"]["codec"] == "int8" and not standing["pcaae:16:fp32"]["on_front"]
    assert standing["ae:4:fp32:value"]["beaten_by"]["codec"] == "int8"
    text = summary.reading("resnet50", [result, _result([], images=128, complete=False)])
    assert text.startswith("**ResNet-50**, 1 of 8 recordings x densities measured (still to measure: 4 x 32 at 0.001,")
    assert (
        "of 4 learned-codec rows, a scalar rounding codec sending as many bits per value or fewer errs less in 2"
        in text
    )
    assert "in 1 of these 2 rows the learned codec sends fewer bits than every scalar codec" in text
    assert text.endswith("left out: levels=1 (1).")
    table = summary.table("resnet50", [result, _result([], images=128, complete=False)])
    assert "| 4 x 128 | 0.01 | - | being measured |" in table
    line = summary.readme_line({"resnet50": [result], "pspnet": []})
    assert line.endswith(
        "ResNet-50, 1 of 8 measured: a scalar rounding codec at as many bits per value or fewer errs less than 2 of "
        "4 learned-codec rows; on the rate-distortion front: pca:16:int8, pca:4:fp32 (in 1 rows with fewer bits than "
        "any scalar codec and less error than the cheapest); ResNet-50 PSPNet, 0 of 8 measured."
    )


def test_the_plan_is_what_the_measuring_script_runs(summary):
    script = (EXPERIMENTS / "codecs_large_models.sh").read_text()
    models = re.search(r"\$\{MODELS:-([^}]*)\}", script).group(1).split()
    workers = re.search(r"\$\{WORKERS:-([^}]*)\}", script).group(1).split(",")
    images = re.search(r"\$\{BATCH_SIZES:-([^}]*)\}", script).group(1).split(",")
    densities = re.search(r"--density ([0-9.,]+)", script).group(1).split(",")
    assert list(summary.MODELS) == models
    assert summary.PLANNED_RECORDINGS == tuple((int(w), int(i)) for w in workers for i in images)
    assert summary.PLANNED_DENSITIES == tuple(float(d) for d in densities)


def test_the_committed_summary_and_lgc_page_follow_the_committed_results(summary):
    page, block, line = summary.summary()
    assert (summary.RESULTS / "summary.md").read_text() == page, "python experiments/codecs_summary.py --write"
    lgc_page = summary.LGC_PAGE.read_text()
    begin, end = lgc_page.index(summary.BEGIN) + len(summary.BEGIN), lgc_page.index(summary.END)
    assert lgc_page[begin:end].strip() == block, "docs/lgc.md drifted: python experiments/codecs_summary.py --write"
    readme = summary.README.read_text()
    begin, end = readme.index(summary.README_BEGIN) + len(summary.README_BEGIN), readme.index(summary.README_END)
    assert readme[begin:end].strip() == line, "README.md drifted: python experiments/codecs_summary.py --write"
