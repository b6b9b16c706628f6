"""wandb (offline): one metric scheme for every compressor, the resolved config, per-layer tables, sweep groups."""

import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from lgc.analysis import read_offline_run
from lgc.conf import sweep_group, sweep_run_name
from lgc.lit.callbacks import LAYER_COLUMNS
from lgc.models import resnet8
from lgc.train import train

pytestmark = pytest.mark.multiprocess


def summary_run_id(output_dir: Path) -> str:
    (run_dir,) = (output_dir / "wandb").glob("offline-run-*")
    return run_dir.name.rsplit("-", 1)[-1]


def test_outside_a_hydra_sweep_runs_have_no_group_and_no_override_name():
    assert sweep_group() is None and sweep_run_name() is None


@pytest.mark.slow
def test_an_offline_lgc_run_holds_every_metric_the_config_and_the_layer_table(tmp_path):
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"output_dir={tmp_path}",
                "compressor=lgc_rar",
                "compressor.stages.warmup_steps=1",
                "compressor.stages.ae_steps=2",
                "trainer.max_epochs=2",
                "trainer.limit_train_batches=3",
                "trainer.limit_val_batches=1",
                "trainer.log_every_n_steps=1",
                "trainer.enable_progress_bar=false",
                "logger.wandb.group=sweep-7",
            ],
        )
    port_before = os.environ.get("MASTER_PORT")
    summary = train(cfg)
    # Each run picks its own port and keeps wandb's files in its output folder.
    assert os.environ.get("MASTER_PORT") == port_before
    assert not (Path.cwd() / "wandb").exists() or not list((Path.cwd() / "wandb").glob(f"*{summary_run_id(tmp_path)}*"))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_offline_run(run_dir)
    for key in (
        "train/loss",
        "val/acc",
        "comm/bytes_up",
        "comm/bytes_down",
        "comm/compression_ratio",
        "comm/residual_norm",
        "lgc/stage",
        "lgc/ae_loss",
        "lgc/recon_error",
    ):
        assert key in run.history_keys, key
    # Every stage was logged: warm-up, autoencoder training, compressed.
    assert {row["lgc/stage"] for row in run.history if "lgc/stage" in row} == {1.0, 2.0, 3.0}
    assert run.group == "sweep-7"
    assert run.config["compressor"]["_target_"] == "lgc.learned.LGCRingAllreduceState"
    assert run.config["trainer"]["max_epochs"] == 2
    # The per-layer table: one row per parameter of the model, as in summary.json.
    assert run.summary["comm/layers"]["_type"] == "table-file"
    table = json.loads((run_dir / "files" / run.summary["comm/layers"]["path"]).read_text())
    assert table["columns"] == list(LAYER_COLUMNS)
    names = [name for name, _ in resnet8(num_classes=10, in_channels=1).named_parameters()]
    assert sorted(row[0] for row in table["data"]) == sorted(f"model.{name}" for name in names)
    assert [row["layer"] for row in summary["layers"]] == [row[0] for row in table["data"]]
    layers = {row["layer"]: row for row in summary["layers"]}
    assert layers["model.fc.bias"]["compressed"] is False and layers["model.fc.bias"]["compression_ratio"] == 1.0
    assert layers["model.layers.2.conv2.weight"]["compression_ratio"] > 5
    assert all(row["steps"] == summary["steps"] for row in summary["layers"])
