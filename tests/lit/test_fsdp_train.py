"""lgc-train under FSDP2 and HSDP (strategy=fsdp / hsdp): the DDP run's training, exact resume, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_resume import EPOCHS, LGC_STAGES, STEPS_PER_EPOCH, assert_identical, assert_same_training, load
from test_resume import compose_cfg as compose_resume_cfg
from test_train import compose_cfg

from lgc.fsdp import shard_blocks
from lgc.models import CifarResNet, PSPNet
from lgc.train import train

pytestmark = pytest.mark.multiprocess

TOPK = ("compressor=topk", "compressor.density=0.05")


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def _hsdp_2x2(tmp_path: Path, method: tuple[str, ...]) -> dict:
    """A run of ``method`` on 2 replicas of 2 workers; its summary, whose strategy and accuracy are checked."""
    hsdp = ("strategy=hsdp", "strategy.shard_size=2", "trainer.devices=4", "ddp.oversubscribe=true")
    train(compose_cfg(tmp_path / "run", *method, *hsdp))
    summary = _summary(tmp_path / "run")
    assert summary["config"]["strategy"] == {"name": "hsdp", "shard_size": 2}
    assert 0 <= summary["val/acc"] <= 1
    return summary


@pytest.mark.parametrize(
    "strategy",
    [("strategy=fsdp",), pytest.param(("strategy=hsdp", "strategy.shard_size=1"), marks=pytest.mark.slow)],
    ids=["fsdp", "hsdp_one_worker_per_replica"],
)
def test_a_sharded_run_trains_the_ddp_runs_weights_bit_for_bit(tmp_path, strategy):
    """Top-k with error feedback over ResNet-8 with BatchNorm, 2 workers: FSDP2 (every gradient coded whole) and
    HSDP with one worker per replica (each shard is the whole gradient) take the DDP run's steps: weights, buffers
    and the compressed bytes. The checkpoint is whole and records the strategy."""
    train(compose_cfg(tmp_path / "ddp", *TOPK))
    train(compose_cfg(tmp_path / "sharded", *TOPK, *strategy))
    ddp, sharded = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("ddp", "sharded"))
    assert_identical(ddp["state_dict"], sharded["state_dict"], "weights and buffers")
    name = strategy[0].split("=")[1]
    assert sharded["lgc"]["strategy"]["name"] == name and ddp["lgc"]["strategy"] == {"name": "ddp"}
    ddp_summary, sharded_summary = _summary(tmp_path / "ddp"), _summary(tmp_path / "sharded")
    payloads = [sum(worker["payload_bytes"] for worker in s["workers"]) for s in (ddp_summary, sharded_summary)]
    assert payloads[0] == payloads[1] > 0
    assert sharded_summary["val/acc"] == ddp_summary["val/acc"]
    assert sharded_summary["buffer_sync"] == "broadcast"


LOCAL = ("comm=diloco", "comm.delay=4", "compressor=topk", "compressor.density=0.05")


def test_local_steps_under_hsdp_with_one_worker_per_replica_are_the_ddp_run(tmp_path):
    """DiLoCo's outer Nesterov step over top-k, an exchange every 4 steps, on ResNet-8 with BatchNorm: HSDP with one
    worker per replica trains the DDP run's weights and buffers bit for bit, validates the synchronized model to
    the same accuracy and sends the same payloads."""
    train(compose_cfg(tmp_path / "ddp", *LOCAL))
    train(compose_cfg(tmp_path / "hsdp", *LOCAL, "strategy=hsdp", "strategy.shard_size=1"))
    ddp, hsdp = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("ddp", "hsdp"))
    assert_identical(ddp["state_dict"], hsdp["state_dict"], "weights and buffers")
    ddp_summary, hsdp_summary = _summary(tmp_path / "ddp"), _summary(tmp_path / "hsdp")
    payloads = [sum(worker["payload_bytes"] for worker in s["workers"]) for s in (ddp_summary, hsdp_summary)]
    assert payloads[0] == payloads[1] > 0
    assert hsdp_summary["val/acc"] == ddp_summary["val/acc"]


@pytest.mark.slow
def test_local_steps_under_hsdp_resume_mid_interval_bit_for_bit(tmp_path):
    """Stopped between exchanges on a 2 x 1 mesh, when the replicas' weights and momenta differ: every rank's own
    come back from the checkpoint, and the resumed run is the straight one."""
    _resumes_exactly(tmp_path, (*LOCAL, "strategy=hsdp", "strategy.shard_size=1"), "trainer.max_steps=14")


def _resumes_exactly(tmp_path: Path, overrides: tuple[str, ...], stop: str) -> None:
    """A straight run, one stopped by ``stop`` and its resumption: the resumed run is the straight one."""
    train(compose_resume_cfg(tmp_path / "straight", *overrides))
    train(compose_resume_cfg(tmp_path / "first", *overrides, stop))
    stopped = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train(compose_resume_cfg(tmp_path / "resumed", *overrides, f"ckpt_path={stopped}"))
    straight = load(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    assert_same_training(straight, load(tmp_path / "resumed" / "checkpoints" / "last.ckpt"))


@pytest.mark.slow
def test_local_steps_under_hsdp_on_a_2x2_mesh_train_the_synchronized_model(tmp_path):
    """DiLoCo on 2 replicas of 2 workers: the run validates the synchronized model and sends compressed
    pseudo-gradients across the replicas only."""
    summary = _hsdp_2x2(tmp_path, LOCAL)
    assert summary["compression_ratio"] > 4, "top-k's payloads every 4 steps, against dense every step"


#: LGC-RAR's stages over the resume tests' 24 steps: dense warm-up 0-1, codec training 2-5, compressed 6-23.
LGC = ("compressor=lgc_rar", *LGC_STAGES)


def test_lgc_under_hsdp_with_one_worker_per_replica_is_the_ddp_run(tmp_path):
    """LGC-RAR through its three stages on ResNet-8 with BatchNorm, 2 workers: HSDP with one worker per replica
    (LGC across the replicas, each shard the whole gradient) trains the DDP run's weights and buffers bit for bit,
    sends the same payloads stage by stage and validates to the same accuracy. One epoch: an epoch boundary and a
    longer compressed stage are the slow resume test's."""
    # One epoch of 8 steps (compressed from step 6) and a narrow codec: the three stages, at a third of the cost.
    short = (
        *LGC, "trainer.max_epochs=1", "scheduler.T_max=1",
        "compressor.training.autoencoder.encoder_channels=[4,4,4,4]",
        "compressor.training.autoencoder.decoder_channels=[4,4,4,4]",
    )  # fmt: skip
    train(compose_resume_cfg(tmp_path / "ddp", *short))
    train(compose_resume_cfg(tmp_path / "hsdp", *short, "strategy=hsdp", "strategy.shard_size=1"))
    ddp, hsdp = (load(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("ddp", "hsdp"))
    assert_identical(ddp["state_dict"], hsdp["state_dict"], "weights and buffers")
    ddp_summary, hsdp_summary = _summary(tmp_path / "ddp"), _summary(tmp_path / "hsdp")
    for ddp_worker, hsdp_worker in zip(ddp_summary["workers"], hsdp_summary["workers"], strict=True):
        stages = [
            {stage: counts["payload_bytes"] for stage, counts in worker["lgc"]["stages"].items()}
            for worker in (ddp_worker, hsdp_worker)
        ]
        assert stages[0] == stages[1] and stages[0]["compressed"] > 0
    assert hsdp_summary["val/acc"] == ddp_summary["val/acc"]


@pytest.mark.slow
def test_lgc_under_hsdp_resumes_in_its_compressed_stage_bit_for_bit(tmp_path):
    """Stopped after the first epoch (step 8, in the compressed stage) on a 2 x 1 mesh: the trained codec, the
    stage and every rank's residuals come back from the checkpoint, and the resumed run is the straight one."""
    _resumes_exactly(tmp_path, (*LGC, "strategy=hsdp", "strategy.shard_size=1"), "trainer.max_epochs=1")


@pytest.mark.slow
def test_lgc_under_hsdp_on_a_2x2_mesh_compresses_across_the_replicas(tmp_path):
    """LGC-RAR on 2 replicas of 2 workers: every worker's compressed stage sends a small part of the dense bytes of
    its shard across the replicas (stage 2 and the warm-up send top-k and dense)."""
    hsdp = ("strategy=hsdp", "strategy.shard_size=2", "trainer.devices=4", "ddp.oversubscribe=true")
    train(compose_resume_cfg(tmp_path / "run", *LGC, *hsdp))
    summary = _summary(tmp_path / "run")
    assert summary["config"]["strategy"] == {"name": "hsdp", "shard_size": 2} and 0 <= summary["val/acc"] <= 1
    for worker in summary["workers"]:
        compressed = worker["lgc"]["stages"]["compressed"]
        assert 0 < compressed["wire_bytes_sent"] < compressed["wire_dense_equivalent_bytes"] / 4


@pytest.mark.slow
def test_an_fsdp_run_stopped_mid_epoch_resumes_bit_for_bit(tmp_path):
    """Stopped by max_steps in the middle of an epoch: weights, optimizer state (whole, as the checkpoint holds it),
    the schedule and every rank's residuals are the straight run's."""
    overrides = (*TOPK, "strategy=fsdp")
    train(compose_resume_cfg(tmp_path / "straight", *overrides))
    train(compose_resume_cfg(tmp_path / "first", *overrides, "trainer.max_steps=12"))
    stopped = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert load(stopped)["global_step"] == 12
    train(compose_resume_cfg(tmp_path / "resumed", *overrides, f"ckpt_path={stopped}"))
    straight = load(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    assert straight["global_step"] == STEPS_PER_EPOCH * EPOCHS
    assert_same_training(straight, load(tmp_path / "resumed" / "checkpoints" / "last.ckpt"))


@pytest.mark.slow
def test_an_hsdp_run_on_a_2x2_mesh_trains_and_counts_the_replicate_dimension(tmp_path):
    assert _hsdp_2x2(tmp_path, TOPK)["compression_ratio"] > 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["strategy=fsdp", "compressor=lgc_rar"], "strategy=fsdp shards one model over every worker"),
        (["strategy=fsdp", "compressor=powersgd"], "use it with DistributedDataParallel"),
        (["strategy=fsdp", "comm=local_sgd", "comm.delay=4"], "comm.delay=4: local steps need replicas"),
        (["strategy=hsdp", "comm=local_sgd", "comm.delay=4", "compressor=lgc_rar"], "codes whole parameters"),
        (["strategy=fsdp", "comm.overlap=true"], "overlap=True is a DDP hook setting"),
        (["strategy=fsdp", "comm.pack=true"], "comm.pack=true is a DDP hook setting"),
        (["strategy=fsdp", "+trainer.precision=bf16-mixed"], "trainer.precision='bf16-mixed': strategy=fsdp"),
        (["strategy=fsdp", "trainer.devices=1"], "it needs two or more, this run has 1"),
        (["strategy=hsdp"], "strategy.shard_size=2 on 2 workers: the workers must form two or more replicas"),
        (["strategy=hsdp", "strategy.shard_size=0"], "strategy.shard_size must be a positive number"),
        (["strategy.name=zero"], "strategy.name must be one of ddp, fsdp, hsdp, got 'zero'"),
        (["strategy=fsdp", "+trainer.accumulate_grad_batches=2"], "compresses\\) every micro-batch"),
    ],
)
def test_a_strategy_that_cannot_run_is_refused_before_workers_start(tmp_path, no_workers, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(compose_cfg(tmp_path / "run", *overrides))
    assert not (tmp_path / "run").exists()


def test_a_ddp_checkpoint_is_refused_under_fsdp(tmp_path):
    train(compose_cfg(tmp_path / "ddp", *TOPK, "trainer.max_steps=2"))
    with pytest.raises(ValueError, match="written under strategy {'name': 'ddp'}, this run has {'name': 'fsdp'}"):
        train(compose_cfg(tmp_path / "fsdp", *TOPK, "strategy=fsdp", f"ckpt_path={tmp_path / 'ddp'}"))


@pytest.mark.parametrize(
    "model",
    [
        lambda: PSPNet(num_classes=5, in_channels=1, backbone="resnet18", width=16, output_stride=8),
        lambda: CifarResNet(depth=8, num_classes=10, in_channels=1),
    ],
    ids=["pspnet", "resnet8"],
)
def test_every_block_fsdp2_shards_runs_its_own_forward(model):
    """fully_shard gathers a block's weights in its forward: every block lgc-train shards must have its forward
    called (PSPNet calls its backbone's stages one by one, never the backbone), and together they hold every
    parameter the model trains."""
    net = model()
    blocks = shard_blocks(net)
    called: set[int] = set()
    for block in blocks:
        block.register_forward_pre_hook(lambda module, _args: called.add(id(module)))
    net.train()
    out = net(torch.randn(2, 1, 32, 32))
    loss = sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,)) if o is not None)
    loss.backward()
    assert called == {id(b) for b in blocks}
    trained = {id(p) for p in net.parameters() if p.grad is not None}
    assert trained <= {id(p) for b in blocks for p in b.parameters()}
