"""lgc-report: summaries of fake runs (as RunSummary writes them) to labels, table, plot and JSON."""

from __future__ import annotations

import copy
import json
import struct
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from lgc.report import (
    FEWER_BYTES_THAN_DGC,
    LGC_COMPRESSED_RATIO,
    load_runs,
    main,
    plot_tradeoff,
    report_table,
    table_rows,
)
from lgc.train import hydra_record

# ----------------------------------------------------------------------------------------------
# Fake runs: the real composed config, and the summary lgc.lit.RunSummary + lgc.train.train write.

# One step of ResNet-8 on digits in bytes, dense, and the part in tensors of >= comm.min_numel elements.
STEP = 300_000
LARGE = 295_000


@cache
def _composed(overrides: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The resolved config and the Hydra record (choices and overrides) that lgc-train stores."""
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["experiment=smoke", "logger=none", "output_dir=OUT", *overrides],
            return_hydra_config=True,
        )
    record = hydra_record(cfg.hydra.runtime.choices, cfg.hydra.overrides.task)
    config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), resolve=True)
    return config, record


def _config(output_dir: Path, *overrides: str) -> dict[str, Any]:
    """The resolved config that lgc.train.train stores in the summary."""
    config = copy.deepcopy(_composed(overrides)[0])
    config["output_dir"] = str(output_dir)
    return config


def _ratio(dense: float, sent: float) -> float | None:
    return dense / sent if sent else None


def _worker(
    sent: int, payload: int, *, server: int = 0, steps: int = 4, compressed_steps: int = 3, lgc: dict | None = None
) -> dict[str, Any]:
    """One worker's CommStats (plus summary extras) for a run whose first step is a dense allreduce."""
    dense, payload_dense = steps * STEP, compressed_steps * LARGE
    worker = {
        "hook_calls": steps,
        "bytes_sent": sent,
        "bytes_received": sent,
        "dense_equivalent_bytes": dense,
        "server_bytes_sent": server,
        "payload_bytes": payload,
        "payload_dense_equivalent_bytes": payload_dense,
        # Two workers: a ring allreduce or allgather sends what it is handed, wire = logical bytes.
        "wire_bytes_sent": sent,
        "wire_bytes_received": sent,
        "wire_server_bytes_sent": server,
        "wire_dense_equivalent_bytes": dense,
        "compression_ratio": _ratio(dense, sent),
        "logical_compression_ratio": _ratio(dense, sent),
        "upstream_compression_ratio": _ratio(dense, sent - server),
        "payload_compression_ratio": _ratio(payload_dense, payload),
    }
    if lgc is not None:
        worker["lgc"] = lgc
    return worker


def _write_run(
    folder: Path,
    overrides: tuple[str, ...],
    describe: str,
    workers: list[dict[str, Any]],
    metrics: dict[str, float],
    steps: int = 4,
    wall_time_s: float = 21.5,
    step_cpu_time_ms: float | None = None,
) -> dict[str, Any]:
    """Writes folder/summary.json with the fields and aggregation of lgc.lit.RunSummary."""
    sent = sum(w["bytes_sent"] for w in workers)
    dense = sum(w["dense_equivalent_bytes"] for w in workers)
    summary: dict[str, Any] = {
        "metrics": {"train/loss": 1.9, **metrics},
        "steps": steps,
        "epochs": 1,
        "world_size": len(workers),
        "compressor": describe,
        "workers": workers,
        "bytes_sent_per_worker": [w["bytes_sent"] for w in workers],
        "bytes_received_per_worker": [w["bytes_received"] for w in workers],
        "dense_equivalent_bytes_per_worker": [w["dense_equivalent_bytes"] for w in workers],
        "wire_bytes_sent_per_worker": [w["wire_bytes_sent"] for w in workers],
        "wire_bytes_received_per_worker": [w["wire_bytes_received"] for w in workers],
        "wire_dense_equivalent_bytes_per_worker": [w["wire_dense_equivalent_bytes"] for w in workers],
        "wire_bytes_sent": sum(w["wire_bytes_sent"] for w in workers),
        "wire_dense_equivalent_bytes": sum(w["wire_dense_equivalent_bytes"] for w in workers),
        "hook_calls": sum(w["hook_calls"] for w in workers),
        "compression_ratio": _ratio(
            sum(w["wire_dense_equivalent_bytes"] for w in workers), sum(w["wire_bytes_sent"] for w in workers)
        ),
        "logical_compression_ratio": _ratio(dense, sent),
        "upstream_compression_ratio": _ratio(dense, sent - sum(w["server_bytes_sent"] for w in workers)),
        "payload_compression_ratio": _ratio(
            sum(w["payload_dense_equivalent_bytes"] for w in workers), sum(w["payload_bytes"] for w in workers)
        ),
        "fit_time_s": wall_time_s - 20.0,
        "config": _config(folder, *overrides),
        "hydra": copy.deepcopy(_composed(overrides)[1]),
    }
    if all("lgc" in w for w in workers):
        totals: dict[str, dict[str, Any]] = {}
        for w in workers:
            for name, stage in w["lgc"]["stages"].items():
                total = totals.setdefault(name, {})
                for key, value in stage.items():
                    total[key] = total.get(key, 0) + value
        for total in totals.values():
            total["compression_ratio"] = _ratio(total["wire_dense_equivalent_bytes"], total["wire_bytes_sent"])
            total["logical_compression_ratio"] = _ratio(total["dense_equivalent_bytes"], total["bytes_sent"])
            total["upstream_compression_ratio"] = _ratio(
                total["dense_equivalent_bytes"], total["bytes_sent"] - total["server_bytes_sent"]
            )
            total["payload_compression_ratio"] = _ratio(total["payload_dense_equivalent_bytes"], total["payload_bytes"])
        summary["lgc_stages"] = totals
    summary.update({k: v for k, v in metrics.items() if k in ("val/acc", "val/loss", "val/mIoU", "val/pixel_acc")})
    summary["wall_time_s"] = wall_time_s
    if step_cpu_time_ms is not None:
        summary["step_cpu_time_ms"] = step_cpu_time_ms
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _stage(sent: int, dense: int, *, server: int = 0, payload: int = 0, payload_dense: int = 0, calls: int = 1):
    return {
        "hook_calls": calls,
        "bytes_sent": sent,
        "bytes_received": sent,
        "dense_equivalent_bytes": dense,
        "server_bytes_sent": server,
        "payload_bytes": payload,
        "payload_dense_equivalent_bytes": payload_dense,
        "wire_bytes_sent": sent,
        "wire_bytes_received": sent,
        "wire_server_bytes_sent": server,
        "wire_dense_equivalent_bytes": dense,
    }


def _lgc_ps_worker(compressed_sent: int, server: int) -> dict[str, Any]:
    # 2 dense warm-up steps, 1 step of top-k while the autoencoder trains, 1 compressed step.
    stages = {
        "warmup": _stage(2 * STEP, 2 * STEP, calls=2),
        "autoencoder_training": _stage(20_000, STEP, payload=LARGE // 50, payload_dense=LARGE),
        "autoencoder_weights": _stage(0, 0, calls=0),
        "compressed": _stage(compressed_sent + server, STEP, server=server, payload=LARGE // 1000, payload_dense=LARGE),
    }
    sent = sum(stage["bytes_sent"] for stage in stages.values())
    lgc = {"stages": stages, "refreshes": 0, "autoencoder": "GradientAutoencoder(chunk=64, latent=4x4, decoders=2)"}
    return _worker(sent, LARGE // 50 + LARGE // 1000, server=server, compressed_steps=2, lgc=lgc)


def _classification_sweep(root: Path) -> tuple[Path, Path]:
    """A Hydra multirun folder (none, topk twice, dgc, torch_fp16) and a separate LGC-PS run."""
    multirun = root / "multirun" / "2026-11-23" / "13-52-41"
    multirun.mkdir(parents=True)
    (multirun / "multirun.yaml").write_text("hydra: {}\n")
    # Dense: every byte as it is.
    _write_run(
        multirun / "0",
        ("compressor=none",),
        "NoneCompressor()",
        [_worker(4 * STEP, 3 * LARGE)] * 2,
        {"val/acc": 0.515625, "val/loss": 2.11},
        wall_time_s=22.84,
    )
    # Top-k 1 %: 8 bytes per kept entry, small tensors dense; payload ratio 50.
    topk_sent = STEP + 3 * (STEP - LARGE + LARGE // 50)
    _write_run(
        multirun / "1",
        ("compressor=topk",),
        "ErrorFeedback(TopKCompressor(density=0.01))",
        [_worker(topk_sent, 3 * LARGE // 50)] * 2,
        {"val/acc": 0.4296875, "val/loss": 2.18},
    )
    # Top-k 0.1 %: payload ratio 500.
    sparse_sent = STEP + 3 * (STEP - LARGE + LARGE // 500)
    _write_run(
        multirun / "2",
        ("compressor=topk", "compressor.density=0.001"),
        "ErrorFeedback(TopKCompressor(density=0.001))",
        [_worker(sparse_sent, 3 * LARGE // 500)] * 2,
        {"val/acc": 0.40625, "val/loss": 2.2},
    )
    # DGC in its first warm-up epoch (density 0.25: payload ratio 2); its config turns optimizer momentum off.
    dgc_sent = STEP + 3 * (STEP - LARGE + LARGE // 2)
    _write_run(
        multirun / "3",
        ("compressor=dgc",),
        "DGCCompressor(density=0.001, momentum=0.9, nesterov=False, momentum_masking=True, clip_norm=None, "
        "warmup_densities=[0.25, 0.0625, 0.015625, 0.00390625], sample_fraction=0.01)",
        [_worker(dgc_sent, 3 * LARGE // 2)] * 2,
        {"val/acc": 0.3125, "val/loss": 2.22},
    )
    # PyTorch's fp16 hook: half the bytes, no payload of lgc's own (a null payload ratio).
    _write_run(
        multirun / "4",
        ("compressor=torch_fp16",),
        "torch:fp16",
        [_worker(2 * STEP, 0) | {"payload_dense_equivalent_bytes": 0, "payload_compression_ratio": None}] * 2,
        {"val/acc": 0.5078125, "val/loss": 2.12},
        wall_time_s=19.4,
    )
    # LGC-PS: rank 0 is the parameter server and also broadcasts the decoded update.
    lgc_run = root / "outputs" / "2026-11-23" / "14-02-10"
    _write_run(
        lgc_run,
        ("compressor=lgc_ps", "compressor.stages.warmup_steps=2", "compressor.stages.ae_steps=1"),
        "LGCParameterServerState(density=0.01, warmup_steps=2 (dense), ae_steps=1, chunk=64, latent=float32, "
        "indices=raw, leader=0, innovation_density=0.001)",
        [_lgc_ps_worker(5_000, server=10_000), _lgc_ps_worker(5_000, server=0)],
        {"val/acc": 0.75, "val/loss": 1.74},
        wall_time_s=20.21,
    )
    return multirun, lgc_run


# ----------------------------------------------------------------------------------------------
# Loading and labels.


def test_a_multirun_folder_and_a_run_folder_give_one_labelled_record_per_run(tmp_path):
    multirun, lgc_run = _classification_sweep(tmp_path)
    records = load_runs([multirun, lgc_run])
    assert [record.path for record in records] == [multirun / str(i) for i in range(5)] + [lgc_run]
    # The compressor's group, then what differs from its yaml or between runs of the group; not the
    # optimizer momentum that compressor=dgc turns off, nor the output folders.
    assert [record.label for record in records] == [
        "none",
        "topk density=0.01",
        "topk density=0.001",
        "dgc",
        "torch_fp16",
        "lgc_ps stages.warmup_steps=2 stages.ae_steps=1",
    ]
    assert [record.compressor for record in records] == ["none", "topk", "topk", "dgc", "torch_fp16", "lgc_ps"]
    assert [record.is_dense for record in records] == [True, False, False, False, False, False]
    assert records[0].metric_key == "val/acc" and records[0].metric == 0.515625
    assert records[3].config["optimizer"]["momentum"] == 0.0
    assert records[5].value(LGC_COMPRESSED_RATIO) == pytest.approx(2 * STEP / 20_000)
    assert records[4].value("payload_compression_ratio") is None and records[4].value("no.such.field") is None
    # The same file reached twice counts once.
    assert len(load_runs([multirun, multirun / "1", multirun / "1" / "summary.json"])) == 5


def test_labels_leave_out_values_that_configs_derive_from_others(tmp_path):
    runs = [
        ("a", ("compressor=none",)),
        ("b", ("compressor=none", "seed=1")),
        # scheduler.T_max follows trainer.max_epochs in train.yaml.
        ("c", ("compressor=none", "trainer.max_epochs=2")),
        # Another number of workers (DGC's own world size is the hook's to set, not the config's).
        ("d", ("compressor=dgc",)),
        ("e", ("compressor=dgc", "trainer.devices=4", "ddp.oversubscribe=true")),
        # Written by a notebook: forked workers and a CSV log change nothing that is trained.
        ("f", ("compressor=dgc", "ddp.start_method=fork", "logger=csv")),
    ]
    for name, overrides in runs:
        _write_run(tmp_path / name, overrides, "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    labels = [record.label for record in load_runs([tmp_path])]
    assert labels == [
        "none seed=0 trainer.devices=2 trainer.max_epochs=1",
        "none seed=1 trainer.devices=2 trainer.max_epochs=1",
        "none seed=0 trainer.devices=2 trainer.max_epochs=2",
        "dgc seed=0 trainer.devices=2 trainer.max_epochs=1 (d)",
        "dgc seed=0 trainer.devices=4 trainer.max_epochs=1",
        "dgc seed=0 trainer.devices=2 trainer.max_epochs=1 (f)",
    ]


def test_runs_alike_in_every_setting_are_told_apart_by_their_folders(tmp_path):
    for repeat in ("first", "second"):
        _write_run(tmp_path / repeat / "0", ("compressor=topk",), "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    assert [record.label for record in load_runs([tmp_path])] == ["topk (first/0)", "topk (second/0)"]


def test_the_compressor_column_names_the_codec_a_run_overrode_under_a_folder_label(tmp_path):
    for name, codec in (("linear", "linear"), ("ae", "autoencoder")):
        overrides = ("compressor=lgc_rar_linear", f"compressor.training.codec={codec}")
        _write_run(tmp_path / name / "seed0", overrides, "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    records = load_runs([tmp_path], label_by="folder")
    assert [r.label for r in records] == ["ae seed=0", "linear seed=0"]
    assert [r.compressor for r in records] == ["lgc_rar_linear", "lgc_rar_linear"]
    rows = table_rows(records)
    assert [row["compressor"] for row in rows] == [
        "lgc_rar_linear training.codec=autoencoder",
        "lgc_rar_linear training.codec=linear",
    ]
    # Labelled by settings, the label carries the codec and the column the option.
    by_settings = load_runs([tmp_path])
    assert [r.label for r in by_settings] == [
        "lgc_rar_linear training.codec=autoencoder",
        "lgc_rar_linear training.codec=linear",
    ]
    assert [row["compressor"] for row in table_rows(by_settings)] == ["lgc_rar_linear", "lgc_rar_linear"]


def test_a_sweep_filed_by_method_and_seed_is_labelled_by_its_folders_on_request(tmp_path, capsys):
    cell = tmp_path / "iid4"
    for method, overrides in (("dense", ("compressor=none",)), ("default", ("compressor=shared_topk_int8",))):
        for seed in (0, 1):
            folder = cell / method / f"seed{seed}"
            _write_run(folder, (*overrides, f"seed={seed}"), "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5 + seed / 10})
    _write_run(cell / "odd" / "x", ("compressor=topk",), "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    labels = [record.label for record in load_runs([cell], label_by="folder")]
    assert labels == ["default seed=0", "default seed=1", "dense seed=0", "dense seed=1", "odd/x"]
    # A method's folder, or one of its runs, given by itself: the seed folders are named for their method.
    assert [r.label for r in load_runs([cell / "dense"], label_by="folder")] == ["dense seed=0", "dense seed=1"]
    assert [r.label for r in load_runs([cell / "dense" / "seed1"], label_by="folder")] == ["dense seed=1"]
    assert [r.label for r in load_runs([cell / "odd" / "x"], label_by="folder")] == ["x"]
    # The default names runs by their settings.
    assert load_runs([cell])[0].label == "shared_topk_int8 seed=0"
    with pytest.raises(ValueError, match="label_by='path': expected one of settings, folder"):
        load_runs([cell], label_by="path")
    # Seed groups: one row per method folder.
    main([str(cell), "--label", "folder"])
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert {"| default", "| dense", "| odd/x"} <= set(rows)


def test_the_model_or_data_option_labels_a_run_rather_than_its_settings(tmp_path):
    classification = ("compressor=topk",)
    segmentation = ("compressor=topk", "data=camvid", "model=pspnet_r18")
    _write_run(tmp_path / "0", classification, "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    _write_run(tmp_path / "1", segmentation, "?", [_worker(STEP, 0)] * 2, {"val/mIoU": 0.25, "val/pixel_acc": 0.6})
    records = load_runs([tmp_path])
    assert [record.label for record in records] == [
        "topk model=resnet8 data=digits",
        "topk model=pspnet_r18 data=camvid",
    ]
    assert [record.metric_key for record in records] == ["val/acc", "val/mIoU"]
    header = report_table(records).splitlines()[0]
    assert "| val/acc | val/mIoU |" in header
    rows = table_rows(records)
    assert (rows[0]["val/acc"], rows[0]["val/mIoU"], rows[1]["val/acc"], rows[1]["val/mIoU"]) == (0.5, None, None, 0.25)
    figure = plot_tradeoff(records)
    assert [axis.get_ylabel() for axis in figure.axes] == ["val/acc", "val/mIoU"]


def test_a_group_a_run_chose_no_option_of_is_left_out_of_its_label(tmp_path):
    _write_run(tmp_path / "0", ("compressor=none",), "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    _write_run(tmp_path / "1", ("experiment=embedded/topk",), "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    # As lgc-train records a run without any experiment: the group's choice is null.
    path = tmp_path / "0" / "summary.json"
    summary = json.loads(path.read_text())
    summary["hydra"]["choices"]["experiment"] = None
    summary["hydra"]["overrides"] = [o for o in summary["hydra"]["overrides"] if not o.startswith("experiment=")]
    path.write_text(json.dumps(summary))
    assert [record.label for record in load_runs([tmp_path])] == ["none", "topk experiment=embedded/topk"]


def test_a_summary_without_hydras_record_is_labelled_by_its_class_and_what_differs(tmp_path):
    """``train(cfg)`` on a config composed without ``return_hydra_config`` records no choices or overrides."""
    for name, overrides in (("a", ("compressor=topk",)), ("b", ("compressor=topk", "compressor.density=0.001"))):
        summary = _write_run(tmp_path / name, overrides, "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
        del summary["hydra"]
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    records = load_runs([tmp_path])
    assert [record.label for record in records] == ["TopKCompressor density=0.01", "TopKCompressor density=0.001"]
    assert [record.compressor for record in records] == ["TopKCompressor"] * 2


def test_a_node_set_whole_labels_a_run_by_each_value_it_changes(tmp_path):
    chunks = ("compressor=lgc_rar", "compressor.training.autoencoder={chunk:32}")
    _write_run(tmp_path / "0", ("compressor=lgc_rar",), "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    _write_run(tmp_path / "1", chunks, "?", [_worker(STEP, 0)] * 2, {"val/acc": 0.5})
    labels = [record.label for record in load_runs([tmp_path])]
    assert labels == ["lgc_rar training.autoencoder.chunk=64", "lgc_rar training.autoencoder.chunk=32"]


def test_multirun_subfolders_in_natural_order(tmp_path):
    for number in (10, 2, 1):
        _write_run(tmp_path / str(number), ("compressor=topk", f"seed={number}"), "?", [_worker(STEP, 0)] * 2, {})
    assert [record.path.name for record in load_runs([tmp_path])] == ["1", "2", "10"]


def test_a_folder_without_any_summary_is_an_error_that_names_it(tmp_path, capsys):
    (tmp_path / "empty" / "0").mkdir(parents=True)
    (tmp_path / "empty" / "0" / "train.log").write_text("crashed\n")
    with pytest.raises(FileNotFoundError, match=f"no summary.json in {tmp_path / 'empty'}"):
        load_runs([tmp_path / "empty"])
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'missing'} does not exist"):
        load_runs([tmp_path / "missing"])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{")
    with pytest.raises(ValueError, match="summary.json is not valid JSON"):
        load_runs([tmp_path / "broken"])
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "empty")])
    assert exit_info.value.code == 2
    assert f"lgc-report: error: no summary.json in {tmp_path / 'empty'}" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Table, JSON rows and plot.


def test_table_rows_with_null_ratios_and_lgc_stages(tmp_path):
    records = load_runs(_classification_sweep(tmp_path))
    assert report_table(records).splitlines() == [
        "| run                                            | compressor | world size | steps | val/acc "
        "| wire MB/worker | compression ratio (wire) | logical ratio | upstream ratio | payload ratio "
        "| LGC compressed-stage ratio | x fewer bytes than DGC | wall time (s) |",
        "|------------------------------------------------|------------|-----------:|------:|--------:"
        "|---------------:|-------------------------:|--------------:|---------------:|--------------:"
        "|---------------------------:|-----------------------:|--------------:|",
        "| none                                           | none       |          2 |     4 |  0.5156 "
        "|            1.2 |                     1.00 |          1.00 |           1.00 |          1.00 "
        "|                          - |                      - |          22.8 |",
        "| topk density=0.01                              | topk       |          2 |     4 |  0.4297 "
        "|          0.333 |                     3.61 |          3.61 |           3.61 |         50.00 "
        "|                          - |                      - |          21.5 |",
        "| topk density=0.001                             | topk       |          2 |     4 |  0.4062 "
        "|          0.317 |                     3.79 |          3.79 |           3.79 |        500.00 "
        "|                          - |                   2.39 |          21.5 |",
        "| dgc                                            | dgc        |          2 |     4 |  0.3125 "
        "|          0.757 |                     1.58 |          1.58 |           1.58 |          2.00 "
        "|                          - |                   1.00 |          21.5 |",
        "| torch_fp16                                     | torch_fp16 |          2 |     4 |  0.5078 "
        "|            0.6 |                     2.00 |          2.00 |           2.00 |           n/a "
        "|                          - |                      - |          19.4 |",
        "| lgc_ps stages.warmup_steps=2 stages.ae_steps=1 | lgc_ps     |          2 |     4 |  0.7500 "
        "|           0.63 |                     1.90 |          1.90 |           1.92 |         95.24 "
        "|                      30.00 |                      - |          20.2 |",
    ]
    # The numbers above, from the bytes (per worker: a dense first step, then the small tensors
    # dense and the large ones compressed).
    dense = 4 * STEP
    assert dense / (STEP + 3 * (STEP - LARGE + LARGE // 50)) == pytest.approx(3.61, abs=0.005)
    assert dense / (STEP + 3 * (STEP - LARGE + LARGE // 2)) == pytest.approx(1.58, abs=0.005)
    lgc_sent = 2 * (2 * STEP + 20_000 + 5_000) + 10_000  # rank 0 also sends 10,000 bytes as the server
    assert 2 * dense / lgc_sent == pytest.approx(1.90, abs=0.005)
    assert 2 * dense / (lgc_sent - 10_000) == pytest.approx(1.92, abs=0.005)
    assert 2 * 2 * LARGE / (2 * (LARGE // 50 + LARGE // 1000)) == pytest.approx(95.24, abs=0.005)
    assert 2 * STEP / (5_000 + 10_000 + 5_000) == 30.0

    rows = table_rows(records)
    assert list(rows[0]) == [
        "label",
        "compressor",
        "world_size",
        "steps",
        "val/acc",
        "wire_mb_per_worker",
        "compression_ratio",
        "logical_compression_ratio",
        "upstream_compression_ratio",
        "payload_compression_ratio",
        LGC_COMPRESSED_RATIO,
        FEWER_BYTES_THAN_DGC,
        "wall_time_s",
        "path",
    ]
    assert rows[4]["payload_compression_ratio"] is None and rows[4][LGC_COMPRESSED_RATIO] is None
    # The DGC run of the same world size and density (0.001) sends 0.757 / 0.317 times top-k's bytes.
    assert [row[FEWER_BYTES_THAN_DGC] for row in rows] == [None, None, pytest.approx(2.3913, abs=1e-4), 1.0, None, None]
    assert rows[5][LGC_COMPRESSED_RATIO] == pytest.approx(30.0)
    assert rows[5]["path"] == str(records[5].path) and rows[0]["wall_time_s"] == 22.84


def test_a_run_that_sent_nothing_reads_na_and_is_left_off_the_plot(tmp_path):
    # Resumed from the checkpoint of a finished run: no step left, nothing sent.
    _write_run(
        tmp_path / "0", ("compressor=none",), "NoneCompressor()", [_worker(4 * STEP, 3 * LARGE)] * 2, {"val/acc": 0.5}
    )
    _write_run(
        tmp_path / "1",
        ("compressor=topk", "ckpt_path=outputs/x/checkpoints/last.ckpt"),
        "ErrorFeedback(TopKCompressor(density=0.01))",
        [
            _worker(0, 0)
            | {
                "hook_calls": 0,
                "dense_equivalent_bytes": 0,
                "wire_dense_equivalent_bytes": 0,
                "payload_dense_equivalent_bytes": 0,
            }
        ]
        * 2,
        {"val/acc": 0.75},
        wall_time_s=30.0,
    )
    records = load_runs([tmp_path])
    summary = records[1].summary
    assert summary["compression_ratio"] is None and summary["payload_compression_ratio"] is None
    assert report_table(records).splitlines()[3] == (
        "| topk | topk       |          2 |     4 |  0.7500 |              0 |                      n/a "
        "|           n/a |            n/a |           n/a |          30.0 |"
    )
    assert table_rows(records)[1]["compression_ratio"] is None
    (axis,) = plot_tradeoff(records).axes
    assert len(axis.collections) == 1  # only the dense run's marker
    assert "not plotted (no val/acc or compression_ratio): topk" in axis.get_legend_handles_labels()[1]


def test_plot_has_a_labelled_marker_per_run_and_the_dense_baseline(tmp_path):
    records = load_runs(_classification_sweep(tmp_path))
    (axis,) = plot_tradeoff(records).axes
    assert axis.get_xscale() == "log" and axis.get_ylabel() == "val/acc"
    points = [tuple(collection.get_offsets()[0]) for collection in axis.collections]
    expected = [(record.summary["compression_ratio"], record.metric) for record in records]
    # approx() compares flat sequences only: one (x, y) pair at a time.
    assert len(points) == len(expected)
    for point, want in zip(points, expected, strict=True):
        assert point == pytest.approx(want)
    assert [text.get_text() for text in axis.texts] == [record.label for record in records]
    (baseline,) = [line for line in axis.get_lines() if line.get_label() == "dense baseline"]
    assert list(baseline.get_ydata()) == [0.515625, 0.515625]
    assert axis.get_legend_handles_labels()[1] == ["none", "topk", "dgc", "torch_fp16", "lgc_ps", "dense baseline"]

    (axis,) = plot_tradeoff(records, ratio=LGC_COMPRESSED_RATIO).axes
    assert [text.get_text() for text in axis.texts] == ["lgc_ps stages.warmup_steps=2 stages.ae_steps=1"]
    without_dense = plot_tradeoff(records[1:]).axes[0]
    assert not [line for line in without_dense.get_lines() if "dense" in line.get_label()]
    with pytest.raises(ValueError, match="no runs"):
        plot_tradeoff([])


def test_many_runs_get_numbered_markers_and_a_key_that_names_them(tmp_path, monkeypatch):
    """Above MAX_LABELLED_RUNS the labels would overlap: numbers on the markers, labels in a key."""
    import lgc.report.plot

    records = load_runs(_classification_sweep(tmp_path))
    monkeypatch.setattr(lgc.report.plot, "MAX_LABELLED_RUNS", 2)
    axis, key = plot_tradeoff(records).axes
    assert len(axis.collections) == len(records)
    numbers = sorted(int(n) for text in axis.texts for n in text.get_text().split(","))
    assert numbers == list(range(1, len(records) + 1))  # every marker numbered once
    (listing,) = key.texts
    # Each run's whole label, wrapped: joined back, the key lists them in order.
    entries = " ".join(line.strip() for line in listing.get_text().splitlines())
    assert entries == " ".join(f"{n}  {r.label}" for n, r in enumerate(records, start=1))
    assert not key.axison


def test_numbered_markers_close_together_share_one_annotation():
    from lgc.report.plot import NEAR_DECADES, _numbered_groups

    step = NEAR_DECADES / 2
    # 1 and 3 on the same spot, 2 just right of them (chained), 4 far right at the same y, 5 above.
    logs, ys = [0.0, step, 0.0, 1.0, 0.0], [0.9, 0.9, 0.9, 0.9, 0.95]
    groups = _numbered_groups(logs, ys)
    assert [(names, below) for _, _, names, below in groups] == [
        (["1", "3", "2"], False),
        (["4"], True),
        (["5"], False),
    ]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def test_command_prints_the_table_and_writes_report_plot_and_json(tmp_path, capsys):
    multirun, lgc_run = _classification_sweep(tmp_path / "runs")
    out = tmp_path / "report"
    main([str(multirun), str(lgc_run), "--out", str(out), "--json", str(out / "rows.json")])
    records = load_runs([multirun, lgc_run])
    table = report_table(records)
    assert capsys.readouterr().out == table + "\n"
    report = (out / "report.md").read_text()
    assert table in report and "![accuracy against compression ratio](accuracy_vs_ratio.png)" in report
    width, height = _png_size(out / "accuracy_vs_ratio.png")
    assert width > 400 and height > 300
    assert json.loads((out / "rows.json").read_text()) == table_rows(records)


def test_a_summary_written_before_wire_bytes_shows_its_ratio_as_logical_only(tmp_path):
    summary = _write_run(
        tmp_path / "0", ("compressor=none",), "NoneCompressor()", [_worker(4 * STEP, 3 * LARGE)] * 2, {"val/acc": 0.5}
    )
    old = {key: value for key, value in summary.items() if not key.startswith("wire_")}
    old.pop("logical_compression_ratio")
    old["compression_ratio"] = 3.5  # what older versions called the logical ratio
    (tmp_path / "0" / "summary.json").write_text(json.dumps(old))
    (record,) = load_runs([tmp_path])
    assert not record.counts_wire_bytes and record.wire_mb_per_worker is None
    assert record.value("compression_ratio") is None
    assert record.value("logical_compression_ratio") == 3.5
    (row,) = table_rows([record])
    assert row["compression_ratio"] is None and row["logical_compression_ratio"] == 3.5
    assert row["wire_mb_per_worker"] is None
    assert "|                        - |          3.50 |" in report_table([record])


def test_the_measured_premise_gets_its_columns_beside_the_error(tmp_path):
    folders = _classification_sweep(tmp_path)
    path = folders[1] / "summary.json"  # the LGC-PS run
    summary = json.loads(path.read_text())
    summary["lgc_premise"] = {"correlation": 0.4321, "energy_share": 0.0123, "steps": 3.0}
    summary["lgc_true_error"] = 0.25
    path.write_text(json.dumps(summary))
    records = load_runs(folders)
    rows = table_rows(records)
    premise = [row for row in rows if row["lgc_premise.correlation"] is not None]
    keys = ("lgc_premise.correlation", "lgc_premise.energy_share", "lgc_true_error")
    assert [tuple(row[key] for key in keys) for row in premise] == [(0.4321, 0.0123, 0.25)]
    header = report_table(records).splitlines()[0]
    assert "| error at leader positions | premise r | premise energy share |" in header
    assert "codec refreshes" not in header  # no run refreshes its codec or could


def test_a_run_that_can_refresh_its_codec_gets_the_refresh_count(tmp_path):
    folders = _classification_sweep(tmp_path)
    path = folders[1] / "summary.json"  # the LGC-PS run, given a refresh threshold that fired twice
    summary = json.loads(path.read_text())
    summary["config"]["compressor"].setdefault("stages", {})["refresh_threshold"] = 0.5
    summary["lgc_refreshes"] = 2
    path.write_text(json.dumps(summary))
    records = load_runs(folders)
    counts = [(Path(row["path"]) == folders[1], row["lgc_refreshes"]) for row in table_rows(records)]
    assert sorted(counts, key=lambda c: c[0]) == [(False, None)] * (len(counts) - 1) + [(True, 2)]  # only it books one
    assert "| codec refreshes |" in report_table(records).splitlines()[0]
