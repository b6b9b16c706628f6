"""Every experiment config builds, and every paper reproduction's smoke variant trains on fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import hydra
import pytest
import torch
from fixtures import CIFAR_NAMES, cifar_checksums, write_camvid, write_cifar10
from hydra import compose, initialize_config_module
from test_config_types import _check_all

from lgc.methods import build_hook_state
from lgc.train import _check_model_fits_task, train

CONF = Path(__file__).resolve().parents[2] / "lgc" / "conf" / "experiment"
EXPERIMENTS = sorted(str(p.relative_to(CONF).with_suffix("")) for p in CONF.rglob("*.yaml"))
PAPER_SMOKE = [name for name in EXPERIMENTS if name.startswith("paper/") and name.endswith("_smoke")]
EMBEDDED = [name for name in EXPERIMENTS if name.startswith("embedded/")]


def test_every_paper_reproduction_has_a_smoke_variant():
    full = [name for name in EXPERIMENTS if name.startswith("paper/") and not name.endswith("_smoke")]
    assert len(full) >= 7
    assert sorted(f"{name}_smoke" for name in full) == PAPER_SMOKE
    assert len(EMBEDDED) >= 17


@pytest.mark.parametrize("name", PAPER_SMOKE)
def test_smoke_variants_keep_their_papers_compressor_model_and_data(name):
    """A smoke variant only shortens the run: a smoke that silently trained another method would test nothing."""
    with initialize_config_module("lgc.conf", version_base="1.3"):
        smoke = compose("train", overrides=[f"experiment={name}", "output_dir=OUT"])
        full = compose("train", overrides=[f"experiment={name.removesuffix('_smoke')}", "output_dir=OUT"])
    for group in ("compressor", "model", "data"):
        assert smoke[group]._target_ == full[group]._target_, group
    assert smoke.optimizer == full.optimizer
    assert smoke.trainer.limit_train_batches == 4 and smoke.trainer.accelerator == "cpu"


def test_smoke_is_top_k_unless_told():
    with initialize_config_module("lgc.conf", version_base="1.3"):
        assert compose("train", ["experiment=smoke"])["compressor"]._target_ == "lgc.compressors.TopKCompressor"
        told = compose("train", ["experiment=smoke", "compressor=dgc"])
    assert told["compressor"]._target_ == "lgc.compressors.dgc.DGCCompressor" and told.trainer.limit_train_batches == 4


@pytest.fixture(scope="module")
def data_roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    # 10 images per batch file: 50 training images, enough for 4 steps of 2 workers x 4 images.
    cifar = write_cifar10(root / "cifar10", per_batch=10)
    camvid = write_camvid(root / "camvid", train=12, val=4, test=2)
    return {"cifar10": cifar, "camvid": camvid}


@pytest.fixture
def cifar_checksums_patched(data_roots, monkeypatch):
    """torchvision checks the files' MD5s: give it the fixture's (workers are forked, so they inherit this)."""
    from torchvision.datasets import CIFAR10

    md5 = cifar_checksums(data_roots["cifar10"])
    monkeypatch.setattr(CIFAR10, "train_list", [[name, md5[name]] for name in CIFAR_NAMES[:5]])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5["batches.meta"]})


def _compose(name: str, output_dir: Path, data_roots: dict, *overrides: str):
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={name}", f"output_dir={output_dir}", *overrides])
    dataset = cfg.data._target_.rsplit(".", 1)[-1]
    root = {"CIFAR10DataModule": "cifar10", "CamVidDataModule": "camvid"}.get(dataset)
    if root is not None:
        cfg.data.root = str(data_roots[root])
    return cfg


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_builds_its_parts(name, tmp_path, data_roots):
    """Every experiment's settings pass their types; its compressor, data, model, optimizer and scheduler
    instantiate and fit together.

    No worker starts: this is what ``train`` checks in the launching process, for every file.
    """
    cfg = _compose(name, tmp_path, data_roots)
    _check_all(cfg)
    hook_state = build_hook_state(cfg.compressor, cfg.comm)
    world = cfg.trainer.devices if cfg.trainer.devices > 0 else 4
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model, num_classes=datamodule.num_classes, in_channels=datamodule.in_channels)
    hook_state.check_run(model, world * cfg.trainer.num_nodes, None)
    if "resnet110" in name or "resnet101" in name or "pspnet" in name:
        assert sum(p.numel() for p in model.parameters()) > 1_000_000
    else:
        _check_model_fits_task(model, datamodule, datamodule.task)
    optimizer = hydra.utils.instantiate(cfg.optimizer)(model.parameters())
    if cfg.get("scheduler"):
        hydra.utils.instantiate(cfg.scheduler)(optimizer)


#: The smoke variants of the larger models (LGC's ResNet-50 and ResNet-101, DGC's ResNet-110, LGC's PSPNet
#: on CamVid) differ from the others mainly in model size (their parts are built by
#: test_every_experiment_builds_its_parts, their data loaders tested in test_data); they train with -m slow.
LARGE_SMOKE = {
    "paper/lgc_cifar10_resnet50_smoke",
    "paper/lgc_cifar10_resnet101_smoke",
    "paper/lgc_camvid_pspnet_smoke",
    "paper/dgc_cifar10_resnet110_smoke",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name in LARGE_SMOKE else name for name in PAPER_SMOKE]
)
def test_paper_smoke_variant_trains_on_fixtures(name, tmp_path, data_roots, cifar_checksums_patched):
    cfg = _compose(name, tmp_path, data_roots, "logger=csv", "ddp.start_method=fork")
    summary = train(cfg)
    assert summary["steps"] >= 3 and summary["hook_calls"] > 0
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    metric = "val/mIoU" if "camvid" in name else "val/acc"
    assert 0.0 <= summary[metric] <= 1.0
    if "lgc" in name:
        assert summary["lgc_stages"]["compressed"]["hook_calls"] > 0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_experiment_trains_a_few_steps(name, tmp_path, data_roots):
    overrides = ["logger=csv", "trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2"]
    if "lgc" in name:
        overrides += ["compressor.stages.warmup_steps=1", "compressor.stages.ae_steps=2"]
    summary = train(_compose(name, tmp_path, data_roots, *overrides))
    assert summary["steps"] == 8 and summary["hook_calls"] > 0
    assert torch.isfinite(torch.tensor(summary["val/loss"]))


@pytest.mark.parametrize(
    "name", ["paper/lgc_cifar10_resnet50", "paper/lgc_camvid_pspnet", "paper/dgc_cifar10_resnet110"]
)
@pytest.mark.parametrize("compressor", ["lgc_rar_paper", "lgc_ps_paper", "dgc", "none"])
def test_a_tables_rows_swap_only_the_compressor(name, compressor, tmp_path, data_roots):
    """The launch scripts sweep ``compressor=...`` over these: no compressor knob may leak across rows."""
    cfg = _compose(name, tmp_path, data_roots, f"compressor={compressor}")
    build_hook_state(cfg.compressor, cfg.comm)
    assert cfg.optimizer.momentum == (0.0 if compressor == "dgc" else 0.9)
