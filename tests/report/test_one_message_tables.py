"""The step-speed tables (``experiments/one_message_tables.py``) on hand-made records: the crossover
table, its check against a shaped network's measured steps, and the before/after time to accuracy."""

import gzip
import json
from pathlib import Path

import pytest
from experiment_scripts import import_fresh

from lgc.bench.cli import main
from lgc.bench.cost_model import CollectiveCall, MethodProfile


@pytest.fixture
def tables(monkeypatch):
    return import_fresh(monkeypatch, "one_message_tables")


def _profile(method: str, overhead: float, trace: list[tuple[str, int, int]], overlaps: bool) -> dict:
    return MethodProfile(method, 0.05, overhead, 0.0, overlaps, [CollectiveCall(*c) for c in trace]).to_json()


def _model(tmp_path: Path) -> Path:
    """lgc-bench model over cached ResNet-8 and ResNet-50 profiles: dense, fp16, a cheap sparse codec, a costly one."""
    profiles = {
        "none": _profile("none", 0.0, [("all_reduce", 300_000, 1)], True),
        "torch_fp16": _profile("torch_fp16", 0.001, [("all_reduce", 150_000, 1)], True),
        "dgc": _profile("dgc", 0.005, [("all_reduce", 24, 1), ("all_gather", 3_000, 1)], False),
        "demo": _profile("demo", 0.5, [("all_gather", 20_000, 1)], False),
    }
    cache = tmp_path / "profiles.json"
    cache.write_text(json.dumps({"resnet8": profiles, "resnet50": profiles}))
    main(
        [
            "model", "--model", "resnet50,resnet8", "--workers", "4,8", "--bandwidth", "100mbit",
            "--latency", "1ms", "--methods", "none,torch_fp16,dgc,demo", "--profiles", str(cache),
            "--out", str(tmp_path / "model"),
        ]
    )  # fmt: skip
    return tmp_path / "model" / "model.json"


def _network(tmp_path: Path, steps_ms: dict[str, tuple[float, float]]) -> Path:
    """A shaped-network record at 100 Mbit/s and 1 Gbit/s with these measured steps (ms)."""
    settings = {"4 workers, 100mbit": (0, 11.5e6), "4 workers, 1gbit": (1, 22e6)}
    record = {
        "results": {
            setting: [{"method": m, "step_s": steps[index] / 1000} for m, steps in steps_ms.items()]
            for setting, (index, _) in settings.items()
        },
        "calibrations": {s: {"latency_s": 0.001, "bytes_per_s": rate} for s, (_, rate) in settings.items()},
    }
    path = tmp_path / "network.json.gz"
    path.write_bytes(gzip.compress(json.dumps(record).encode()))
    return path


def test_the_check_reads_each_methods_side_against_the_models_crossing(tables, tmp_path):
    model = _model(tmp_path)
    crossings = json.loads(model.read_text())["results"]["resnet8"]["methods"]
    # DGC's few bytes beat fp16's 150 KB ring below some bandwidth; DeMo's 0.5 s codec only on a slow link.
    assert crossings["dgc"]["crossover_bytes_per_s"]["torch_fp16@4"][0] == "below"
    side, demo_at = crossings["demo"]["crossover_bytes_per_s"]["torch_fp16@4"]
    assert side == "below" and demo_at < 11.5e6
    dgc_at = crossings["dgc"]["crossover_bytes_per_s"]["torch_fp16@4"][1]
    # Measured: DGC beats fp16 on both links, DeMo on neither; the training-only knobs map to the model's rows.
    network = _network(
        tmp_path, {"torch_fp16": (100, 60), "dgc:steps_per_epoch=6": (80, 50), "demo:lr=0.003": (150, 120)}
    )
    lines, agreed, total = tables._check_lines(crossings, json.loads(gzip.decompress(network.read_bytes())))
    # DGC agrees wherever the delivered bandwidth lies below its crossing; DeMo everywhere.
    expected = 2 + sum(rate < dgc_at for rate in (11.5e6, 22e6))
    assert (agreed, total) == (expected, 4)
    assert any(line.startswith("| dgc:steps_per_epoch=6 | 0.80 |") for line in lines)
    text = tables.check_table(model, network, "abc1234")
    assert "(abc1234)" in text and "| method | resnet50, 4 workers | resnet50, 8 workers | resnet8, 4 workers |" in text
    block = tables.evidence_block(model, network)
    assert f"agrees with the measured one in {expected} of 4 cases" in block
    assert "| method | resnet8, 4 workers |" in block and "| demo | < " in block


def test_the_model_label_drops_only_the_knobs_that_do_not_change_a_steps_cost(tables):
    assert tables._model_label("dgc:steps_per_epoch=6") == "dgc"
    assert tables._model_label("demo:lr=0.003") == "demo"
    assert tables._model_label("none:delay=10;outer=sgd") == "none:delay=10;outer=sgd"
    assert tables._model_label("sparseloco:delay=10;lr=0.1") == "sparseloco:delay=10"


def test_the_evidence_block_is_replaced_between_its_markers_only(tables):
    page = f"before\n{tables.BEGIN}\nold\n{tables.END}\nafter\n"
    assert tables.replace_in(page, "new") == f"before\n{tables.BEGIN}\nnew\n{tables.END}\nafter\n"
    with pytest.raises(SystemExit, match="no <!-- crossover:begin -->"):
        tables.replace_in("nothing here", "new")


def test_the_time_table_sets_before_beside_after_for_every_method_of_the_after_record(tables, tmp_path):
    def record(name: str, steps: dict[str, float], x_bound: dict[str, float]) -> Path:
        setting = "4 workers, 100mbit"
        methods = [
            {"method": m, "seeds": [0, 1, 2], "reached": 3, "x_bound": {"mean": x, "half_width": 0.1}}
            for m, x in x_bound.items()
        ]
        data = {
            "results": {setting: [{"method": m, "step_s": ms / 1000} for m, ms in steps.items()]},
            "over_seeds": {setting: {"target": 0.86, "bound_s": {"mean": 40.0, "half_width": 5.0}, "methods": methods}},
        }
        path = tmp_path / name / "network.json.gz"
        path.parent.mkdir()
        path.write_bytes(gzip.compress(json.dumps(data).encode()))
        return path

    before = record("before", {"none": 127.4, "dgc": 108.9, "demo": 147.5}, {"none": 1.61, "dgc": 1.79, "demo": 1.97})
    after = record("after", {"none": 120.0, "dgc": 90.0}, {"none": 1.6, "dgc": 1.4})
    text = tables.time_table(before, after, "4 workers, 100mbit", "abc1234")
    assert text.startswith("# Time to 0.86 at 100mbit, before and after (after: abc1234)")
    assert "| dgc | 3/3 | 1.79 ± 0.10 | 108.9 | 3/3 | 1.40 ± 0.10 | 90.0 |" in text
    assert "| demo |" not in text  # only the after record's methods


def test_the_evidence_page_holds_the_tables_the_committed_records_give(tables):
    """docs/evidence.md's crossover and time-to-accuracy blocks are generated from the committed records."""
    page = tables.EVIDENCE.read_text()

    def block(begin: str, end: str) -> str:
        return page[page.index(begin) + len(begin) : page.index(end)].strip()

    crossover = tables.evidence_block(tables.RECORDS / "model.json", tables.RECORDS / "network" / "network.json.gz")
    assert block(tables.BEGIN, tables.END) == crossover, "one_message_tables.py check --write"
    before = tables.HERE / "results" / "fashion_mnist_network" / "network.json.gz"
    text = tables.time_table(before, tables.TIME_RECORDS / "network.json.gz", "4 workers, 100mbit", "-")
    expected = text.split("\n", 2)[2].strip()
    assert block(tables.TIME_BEGIN, tables.TIME_END) == expected, "one_message_tables.py time --write"


def test_the_evidence_page_holds_the_network_tables_the_committed_records_give(monkeypatch):
    """docs/evidence.md's time-to-accuracy and Streaming DiLoCo overlap blocks are generated from their records."""
    network = import_fresh(monkeypatch, "network_tables")
    page = network.EVIDENCE.read_text()
    for name, record in network.BLOCKS.items():
        begin, end = network.markers(name)
        block = page[page.index(begin) + len(begin) : page.index(end)].strip()
        assert block == network.block(network.read_record(record)), "python experiments/network_tables.py --write"
        assert "x no-communication bound" in block and "Mbit/s" in block, name
    begin, end = network.markers("streaming-overlap")
    assert "overlap_steps=4" in page[page.index(begin) : page.index(end)]
