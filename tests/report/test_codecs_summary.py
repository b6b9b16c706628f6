"""The large-model codec summary (``experiments/codecs_summary.py``) on hand-made benchmark results and on
the committed ones."""

import re

import pytest
from experiment_scripts import EXPERIMENTS, import_fresh


@pytest.fixture
def summary(monkeypatch):
    return import_fresh(monkeypatch, "codecs_summary")


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


def test_a_learned_codec_beats_scalar_rounding_where_it_dominates_a_scalar_codec_and_none_dominates_it(summary):
    result = _result(
        [
            _row("fp32", 40.0, 0.0),
            _row("int8", 17.0, 0.001),
            _row("fp16", 20.0, 0.35),  # (not a real fp16: it tells the cheapest beaten from the best beaten)
            _row("int4", 13.0, 0.5),
            _row("levels=3", 13.0, 0.45),  # as cheap as int4, errs less: the cheapest scalar codec
            _row("levels=1", 12.0, None),  # not measured: left out, never compared
            _row("pca:4:fp32", 11.0, 0.6),  # fewer bits than every scalar codec, errs more than each: neither
            _row("pca:16:int8", 11.5, 0.3),  # beats int4 and levels=3 (fewer bits, less error)
            _row("pca:8:int8", 13.0, 0.45),  # ties levels=3 in bits and error, beats int4 (as many bits, less error)
            _row("pca:16:fp32", 17.0, 0.001),  # ties int8 in both (neither beats): beats fp16
            _row("pcaae:16:fp32", 17.0, 0.2),  # int8 at the same bits errs less: beaten (though it would beat fp16)
            _row("ae:4:fp32:value", 33.0, 0.4),  # int8 (fewer bits) errs less: beaten; fp32 (more bits) is not
            _row("ae:4:fp32", 9.0, 0.7),  # below every other codec, a non-scalar errs less at more bits: neither
            _row("topk", 8.0, 0.01),  # neither learned nor scalar rounding: it beats nothing here
            _row("int8", 5.0, 0.0, leader="fixed"),  # the other leader's rows are another comparison
        ]
    )
    verdict = summary.judge(result, "rotating")
    assert verdict["cheapest_scalar"]["codec"] == "levels=3" and verdict["left_out"] == ["levels=1"]
    standing = {
        item["row"]["codec"]: ((item["beats"] or {}).get("codec"), (item["beaten_by"] or {}).get("codec"))
        for item in verdict["learned"]
    }
    assert standing == {
        "pca:4:fp32": (None, None),
        "pca:16:int8": ("levels=3", None),  # the cheapest it beats (int4 ties levels=3 in bits, errs more)
        "pca:8:int8": ("int4", None),
        "pca:16:fp32": ("fp16", None),
        "pcaae:16:fp32": (None, "int8"),
        "ae:4:fp32:value": (None, "int8"),
        "ae:4:fp32": (None, None),
    }
    fixed = summary.judge(result, "fixed")
    assert fixed["learned"] == [] and fixed["cheapest_scalar"]["codec"] == "int8"
    text = summary.reading("resnet50", [result, _result([], images=128, complete=False)])
    assert text.startswith("**ResNet-50**, 1 of 8 recordings x densities measured (still to measure: 4 x 32 at 0.001,")
    assert (
        ": of 7 learned-codec rows, 2 are beaten by a scalar rounding codec (ae:4:fp32:value, pcaae:16:fp32: " in text
    )
    assert (
        "; 3 beat one (pca:16:int8 11.5 bits per value, error 0.3, against levels=3 at 13.0 bits, error 0.45;" in text
    )
    assert "; 2 neither (ae:4:fp32, pca:4:fp32: every scalar codec that errs less sends more bits" in text
    assert text.endswith("left out: levels=1 (1).")
    table = summary.table("resnet50", [result, _result([], images=128, complete=False)])
    assert "| 4 x 128 | 0.01 | - | being measured |" in table
    assert "| 4 x 32 | 0.01 | fixed | 0.30 | 0.40 | int8 5.0 bits, 0 | none | none | none |" in table
    line = summary.readme_line({model: [result] if model == "resnet50" else [] for model in summary.MODELS})
    assert line.endswith(
        "ResNet-50, 1 of 8 measured: of 7 learned-codec rows, 2 beaten by a scalar rounding codec (as many bits per "
        "value or fewer, less error), 3 beating one (pca:16:fp32, pca:16:int8, pca:8:int8), 2 neither; "
        "ResNet-50 PSPNet, 0 of 8 measured; ResNet-50, int8 latents, 0 of 8 measured; ResNet-50 PSPNet, int8 latents, "
        "0 of 8 measured."
    )
    # A model whose only result has no scalar codec: every learned row is neither.
    alone = summary.reading("resnet50", [_result([_row("pca:4:fp32", 11.0, 0.6)])])
    assert "of 1 learned-codec rows, 0 are beaten by a scalar rounding codec; 0 beat one; 1 neither" in alone


def test_the_plan_is_what_the_measuring_script_runs(summary):
    script = (EXPERIMENTS / "codecs_large_models.sh").read_text()
    models = re.search(r"\$\{MODELS:-([^}]*)\}", script).group(1).split()
    passes = re.search(r"\$\{PASSES:-([^}]*)\}", script).group(1).split()
    assert passes == ["main", "int8_latents"]
    workers = re.search(r"\$\{WORKERS:-([^}]*)\}", script).group(1).split(",")
    images = re.search(r"\$\{BATCH_SIZES:-([^}]*)\}", script).group(1).split(",")
    densities = re.search(r"--density ([0-9.,]+)", script).group(1).split(",")
    assert list(summary.MODELS) == models + [f"{model}_int8_latents" for model in models]
    assert script.count('--out "$out/resnet50$suffix"') == script.count('--out "$out/pspnet$suffix"') == 1
    assert "int8_latents) codecs=$int8_latents; suffix=_int8_latents ;;" in script
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
