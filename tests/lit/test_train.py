"""Hydra-composed end-to-end runs of train(cfg) (tiny), checkpoint/resume and bad input."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException

from lgc.compressors.topk import num_selected
from lgc.ddp.hook import CompressionHookState
from lgc.lit import CompressedDDPStrategy, CompressionCallback, DigitsDataModule, ImageClassifier
from lgc.models import resnet8
from lgc.report.records import load_runs
from lgc.train import _drop_lightning_tips, _launch_environment, _remove_unused_run_folder, _result_line, train

pytestmark = pytest.mark.multiprocess


#: Workers forked from the test process start in a fraction of a second; spawned ones import torch,
#: Lightning and Hydra again (5-20 s a run on 2 cores). lgc-train's own default, spawn, runs in the
#: tests that pass it (the summary test below, the strategy without the hook).
FORK = "ddp.start_method=fork"


def compose_cfg(output_dir: Path, *overrides: str, hydra: bool = False):
    """The run's config (workers forked unless ``overrides`` say otherwise); with ``hydra``, Hydra's node too."""
    with initialize_config_module("lgc.conf", version_base="1.3"):
        return compose(
            "train",
            overrides=["experiment=smoke", "logger=csv", FORK, f"output_dir={output_dir}", *overrides],
            return_hydra_config=hydra,
        )


def test_tiny_run_writes_a_summary_with_the_expected_compression_ratio(tmp_path):
    density, min_numel = 0.02, 1024
    # lgc-train's default start method: workers spawned.
    overrides = (f"compressor.density={density}", f"comm.min_numel={min_numel}", "ddp.start_method=spawn")
    cfg = compose_cfg(tmp_path, *overrides, hydra=True)
    summary = train(cfg)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    # What the run was asked for (lgc-report's labels), apart from its config.
    assert summary["hydra"]["overrides"] == [
        "experiment=smoke",
        "logger=csv",
        FORK,
        f"output_dir={tmp_path}",
        *overrides,
    ]
    assert summary["hydra"]["choices"]["compressor"] == "topk" and summary["hydra"]["choices"]["data"] == "digits"
    assert (
        not any(group.startswith("hydra/") for group in summary["hydra"]["choices"])
        and "hydra" not in summary["config"]
    )

    steps = cfg.trainer.limit_train_batches
    assert summary["steps"] == steps == summary["validated_step"] and summary["world_size"] == 2
    assert 0.0 <= summary["val/acc"] <= 1.0
    assert summary["hook_calls"] > 0 and summary["skipped_steps"] == 0
    assert summary["config"]["compressor"]["density"] == density
    assert summary["wall_time_s"] > summary["fit_time_s"] > 0
    # What the times depend on: versions, the machine's CPUs, and each worker's threads.
    env = summary["environment"]
    assert env["torch"] == torch.__version__ and env["cpus"] == os.cpu_count() and env["workers"] == 2
    # The code the run came from: this checkout's commit (None where lgc is not in one) and versions.
    provenance = summary["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert provenance["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert provenance["versions"]["torch"] == torch.__version__
    assert provenance["versions"]["pytorch_lightning"] == pl.__version__
    assert env["torch_threads"] >= 1
    # Each worker's CPU time per training step, and their mean.
    per_worker = [w["step_cpu_time_ms"] for w in summary["workers"]]
    assert len(per_worker) == 2 and all(ms > 0 for ms in per_worker)
    assert summary["step_cpu_time_ms"] == pytest.approx(sum(per_worker) / 2)
    assert len(summary["bytes_sent_per_worker"]) == len(summary["bytes_received_per_worker"]) == 2

    net = resnet8(num_classes=10, in_channels=1)
    numels = [p.numel() for p in net.parameters()]
    dense = 4 * sum(numels)
    per_step = sum(8 * num_selected(n, density) if n >= min_numel else 4 * n for n in numels)
    per_step += 4 * (1 + len(numels))  # the step guard's flags: the non-finite one and one per parameter (fp32)
    # Rank 0's BatchNorm statistics go to the other rank once per step (plain DDP sends them too):
    # at the first step (a plain allreduce while DDP rebuilds its buckets) by gloo's binomial tree,
    # rank 0 sending them once and rank 1 nothing; then in every compressed step's header (fp32, the
    # int64 batch counters one byte per element), an allreduce of which each of 2 workers sends all.
    native = sum(b.numel() * b.element_size() for b in net.buffers())
    in_header = 4 * sum(b.numel() if b.is_floating_point() else b.numel() * b.element_size() for b in net.buffers())
    assert summary["buffer_sync"] == "broadcast" and summary["eval_model"] == "global"
    assert summary["wire_buffer_bytes_sent"] == native + 2 * (steps - 1) * in_header
    for rank, (sent, dense_equivalent) in enumerate(
        zip(summary["bytes_sent_per_worker"], summary["dense_equivalent_bytes_per_worker"], strict=True)
    ):
        own_first = native if rank == 0 else 0
        assert dense_equivalent == steps * (dense + own_first)  # plain DDP broadcasts them every step
        assert sent == dense + own_first + (steps - 1) * (per_step + in_header)
    assert summary["compression_ratio"] == pytest.approx(
        (steps * (2 * dense + native)) / (2 * dense + native + 2 * (steps - 1) * (per_step + in_header))
    )
    # With 2 workers a ring allreduce and a ring allgather of L bytes both send L per worker:
    # wire and logical bytes agree (tests/test_wire.py covers 3 and 4 workers).
    assert summary["wire_bytes_sent_per_worker"] == summary["bytes_sent_per_worker"]
    assert summary["wire_dense_equivalent_bytes_per_worker"] == summary["dense_equivalent_bytes_per_worker"]
    assert summary["wire_bytes_sent"] == sum(summary["bytes_sent_per_worker"])
    assert summary["logical_compression_ratio"] == summary["compression_ratio"]
    large = [n for n in numels if n >= min_numel]
    assert summary["payload_compression_ratio"] == pytest.approx(1 / (2 * density), rel=0.02)
    assert summary["payload_compression_ratio"] == pytest.approx(
        4 * sum(large) / sum(8 * num_selected(n, density) for n in large)
    )

    metrics = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    for key in (
        "train/loss",
        "val/acc",
        "comm/bytes_up",
        "comm/bytes_down",
        "comm/wire_bytes_up",
        "comm/wire_bytes_down",
        "comm/compression_ratio",
        "comm/logical_compression_ratio",
        "comm/residual_norm",
        "comm/skipped_steps",
    ):
        assert key in metrics


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_resume_continues_exactly_where_it_stopped(tmp_path):
    # The same LR schedule in all three runs (its length is saved in the checkpoint).
    common = [
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        "compressor.density=0.05",
        "scheduler.T_max=2",
    ]
    train(compose_cfg(tmp_path / "straight", "trainer.max_epochs=2", *common))
    train(compose_cfg(tmp_path / "first", "trainer.max_epochs=1", *common))
    stopped = tmp_path / "first" / "checkpoints" / "last.ckpt"
    # Other data, another seed or another optimizer setting would make another run: refused, named.
    for changed, named in (
        ("data.batch_size=16", "data.batch_size: checkpoint 32, this run 16"),
        ("seed=1", "seed: checkpoint 0, this run 1"),
        ("optimizer.lr=0.05", "optimizer.lr: checkpoint 0.1, this run 0.05"),
        ("scheduler.T_max=3", "scheduler.T_max: checkpoint 2, this run 3"),
        # What a step computes, and the loader's layout of its saved position.
        ("+trainer.gradient_clip_val=0.01", "trainer.gradient_clip_val: checkpoint None, this run 0.01"),
        ("loss.aux_weight=0", "loss.aux_weight: checkpoint 0.4, this run 0"),
        ("data.num_workers=1", "loader.num_workers: checkpoint 0, this run 1"),
    ):
        with pytest.raises(ValueError, match=f"was written with other run settings: {re.escape(named)}"):
            train(compose_cfg(tmp_path / "refused", "trainer.max_epochs=2", f"ckpt_path={stopped}", *common, changed))
    train(compose_cfg(tmp_path / "resumed", "trainer.max_epochs=2", f"ckpt_path={stopped}", *common))

    # Resumed into its own folder (as a sweep resumes a stopped run): it goes on writing last.ckpt.
    shutil.copytree(tmp_path / "first", tmp_path / "in_place")
    train(compose_cfg(tmp_path / "in_place", "trainer.max_epochs=2", f"ckpt_path={tmp_path / 'in_place'}", *common))
    assert sorted(p.name for p in (tmp_path / "in_place" / "checkpoints").iterdir()) == ["last.ckpt"]

    straight = _load(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    resumed = _load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    in_place = _load(tmp_path / "in_place" / "checkpoints" / "last.ckpt")
    assert straight["global_step"] == resumed["global_step"] == in_place["global_step"] == 6
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(tensor, resumed["state_dict"][name]), name
        assert torch.equal(tensor, in_place["state_dict"][name]), name
    first = _load(stopped)["callbacks"]["CompressionCallback"]["per_rank"]
    ranks = [
        straight["callbacks"]["CompressionCallback"]["per_rank"],
        resumed["callbacks"]["CompressionCallback"]["per_rank"],
    ]
    assert len(first) == 2 and len(ranks[0]) == len(ranks[1]) == 2
    # Residuals differ between ranks, and each rank's residuals continue exactly.
    r0, r1 = (first[r]["compressor"]["residuals"] for r in range(2))
    assert any(not torch.equal(r0[key], r1[key]) for key in r0)
    for straight_rank, resumed_rank in zip(*ranks, strict=True):
        assert straight_rank["iteration"] == resumed_rank["iteration"] == 6
        assert straight_rank["stats"] == resumed_rank["stats"]
        for key, residual in straight_rank["compressor"]["residuals"].items():
            assert torch.equal(residual, resumed_rank["compressor"]["residuals"][key]), key


class _StrategyWithoutHook(CompressedDDPStrategy):
    """Behaves like Lightning's DDPStrategy on CPU: the hook is never registered."""

    def _register_ddp_hooks(self) -> None:
        pass


_TINY_LGC = (
    "compressor=lgc_rar",
    "compressor.stages.warmup_steps=1",
    "compressor.stages.ae_steps=2",
    "compressor.training.autoencoder.encoder_channels=[4,4,4,4]",
    "compressor.training.autoencoder.decoder_channels=[4,4,4,4]",
)


def test_metrics_of_an_earlier_model_are_named_with_their_step_and_warned_of(tmp_path):
    """Validation every 2 epochs of a 3-epoch run: the summary's metrics are the second epoch's."""
    overrides = ("trainer.max_epochs=3", "trainer.limit_train_batches=2", "+trainer.check_val_every_n_epoch=2")
    command = [sys.executable, "-m", "lgc.train", "experiment=smoke", "logger=csv", FORK, f"output_dir={tmp_path}"]
    done = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=600, check=True)
    assert "validation metrics are those of step 4, not of the final model (step 6)" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["validated_step"] == 4 and "val/acc" in summary
    (record,) = load_runs([tmp_path])
    assert not record.metric_is_final and record.metric is None


def test_an_lgc_run_saves_its_codec_and_another_run_starts_from_it(tmp_path):
    """lgc-train writes codec.pt; ``training.autoencoder.init`` with ``stages.ae_steps=0`` skips codec training."""
    first = train(compose_cfg(tmp_path / "first", *_TINY_LGC))
    codec = tmp_path / "first" / "codec.pt"
    assert first["lgc_codec"] == str(codec) and codec.is_file()
    assert first["lgc_stages"]["autoencoder_training"]["bytes_sent"] > 0
    assert first["lgc_refreshes"] == 0  # no refresh_threshold: the codec is never retrained

    second = train(
        compose_cfg(
            tmp_path / "second",
            *_TINY_LGC,
            f"compressor.training.autoencoder.init={codec}",
            "compressor.stages.ae_steps=0",
        )
    )
    assert set(second["lgc_stages"]) == {"warmup", "compressed"}  # no training stage, no weights broadcast
    assert second["lgc_stages"]["compressed"]["bytes_sent"] > 0
    assert f"init={codec}" in second["compressor"]


def test_strategy_fails_loudly_when_the_hook_never_ran(tmp_path):
    from lgc.compressors import TopKCompressor

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        strategy=_StrategyWithoutHook(CompressionHookState(TopKCompressor(0.1)), start_method="fork"),
        callbacks=[CompressionCallback()],
    )
    module = ImageClassifier(resnet8(num_classes=10, in_channels=1), 10, optimizer=partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(Exception, match="hook never ran"):
        trainer.fit(module, datamodule=DigitsDataModule())


def test_strategy_refuses_to_train_without_the_checkpoint_callback(tmp_path):
    from lgc.compressors import TopKCompressor

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        strategy=CompressedDDPStrategy(CompressionHookState(TopKCompressor(0.1))),
        default_root_dir=tmp_path,
    )
    module = ImageClassifier(resnet8(num_classes=10, in_channels=1), 10, optimizer=partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match="CompressionCallback"):
        trainer.fit(module, datamodule=DigitsDataModule())
    # Refused before any process group was created (one left behind would hold MASTER_PORT).
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (["compressor.density=1.5"], ValueError, r"compressor.density=1.5 must be a number in \(0, 1\] \(a param"),
        (["compressor.density=0"], ValueError, r"compressor.density=0 must be a number in \(0, 1\]"),
        (["comm.min_numel=-1"], ValueError, "comm.min_numel must be a non-negative integer or None, got -1"),
        (["trainer.devices=4096"], ValueError, "trainer.devices=4096"),
        (["trainer.accelerator=gpu", "trainer.devices=64"], ValueError, "trainer.devices=64 but this machine has"),
        (["data=cifar10", "data.root=/no/such/folder"], FileNotFoundError, "'/no/such/folder' does not exist"),
        (["ckpt_path=/no/such.ckpt"], FileNotFoundError, "ckpt_path='/no/such.ckpt'"),
        (["compressor=dgc", "optimizer.momentum=0.9"], ValueError, r"applies momentum too \(optimizer.momentum=0.9\)"),
        (["compressor=dgc", "compressor.error_feedback=true"], ValueError, "DGC keeps its own error feedback"),
        # A sparsifier's error feedback is on or off as said, never by omission or a stray string.
        (["compressor.error_feedback=null"], ValueError, r"without error feedback \(compressor.error_feedback unset\)"),
        (["~compressor.error_feedback"], ValueError, r"set compressor.error_feedback=true, or compressor.error_feedba"),
        (["compressor.error_feedback=no"], ValueError, "compressor.error_feedback must be a bool or None, got 'no'"),
        (["scheduler=multistep", "scheduler.milestones=[82.5,123]"], TypeError, r"scheduler.milestones=\[82.5, 123\]"),
        (
            ["compressor=lgc_rar", "compressor.training.autoencoder.encoder_channels=[0,-1]"],
            ValueError,
            r"autoencoder encoder_channels must be a list of positive integer, got \[0, -1\]",
        ),
        (
            ["compressor=dgc", "optimizer._target_=torch.optim.Adam", "~optimizer.momentum", "~optimizer.nesterov"],
            ValueError,
            r"the optimizer applies momentum too \(Adam param_groups\[0\]\['betas'\]=0.9\)",
        ),
        (  # a schedule of several configs: the optimizer comes back in a list of its own
            [
                "compressor=dgc",
                "optimizer._target_=torch.optim.Adam",
                "~optimizer.momentum",
                "~optimizer.nesterov",
                "scheduler=warmup_multistep",
                "scheduler.warmup_steps=2",
            ],
            ValueError,
            r"the optimizer applies momentum too \(Adam param_groups\[0\]\['betas'\]=0.9\)",
        ),
        (["trainer.max_steps=0"], ValueError, "trainer.max_steps=0: the run would take no optimizer step"),
        (
            ["trainer.max_steps=50", "trainer.max_epochs=-1"],
            ValueError,
            r"scheduler.T_max=-1 \(scheduler=cosine follows trainer.max_epochs\)",
        ),
        (
            ["scheduler=cosine_steps", "trainer.max_steps=30", "trainer.max_epochs=1"],
            ValueError,
            r"trainer.max_epochs=1 stops the run at step \d+, before trainer.max_steps=30, where scheduler=cosine",
        ),
        (["ddp.oversubscribe=no"], ValueError, "ddp.oversubscribe must be a bool, got 'no'"),
        (["data.partition_seed=-1"], ValueError, r"partition_seed must be an integer in \[0, 2\*\*32\), got -1"),
        (["data.split_seed=-1"], ValueError, r"split_seed must be an integer in \[0, 2\*\*32\), got -1"),
        (["data.val_fraction=0.001"], ValueError, "val_fraction=0.001 holds out 2 of the 1,797 images"),
        (["ddp.bucket_cap_mb=-5"], ValueError, "ddp.bucket_cap_mb must be a positive finite number, got -5"),
        (["ddp.process_group_backend=5"], ValueError, "ddp.process_group_backend must be a str or None, got 5"),
        (["+ddp.foo=1"], ValueError, "ddp.foo is not a DDP setting; they are start_method"),
        (["+lr=0.5"], ValueError, "lr is not a setting of lgc-train; they are callbacks, checkpoint"),
        (["+checkpoint.every_n_steps=5"], ValueError, "checkpoint.every_n_steps is not a checkpoint setting"),
        (["+loss.aux_wieght=1"], ValueError, "loss.aux_wieght is not a loss setting; they are aux_weight"),
        (
            ["+strategy.shard_sz=2"],
            ValueError,
            "strategy.shard_sz is not a strategy setting; they are name, shard_size",
        ),
        (["seed=-1"], ValueError, r"seed must be an integer in \[0, 2\*\*32\), got -1"),
        (
            ["comm=local_sgd", "comm.delay=4", "+trainer.accumulate_grad_batches=2"],
            ValueError,
            r"trainer.accumulate_grad_batches=2: communication delay \(comm.delay=4\) counts optimizer steps",
        ),
        (
            ["compressor=lgc_rar", "compressor.training.loss_weights.mean=-1"],
            ValueError,
            "training.loss_weights.mean must be a non-negative finite number, got -1",
        ),
        (
            [
                "compressor=lgc_ps",
                "compressor.training.loss_weights.reconstruction=0",
                "compressor.training.loss_weights.similarity=0",
            ],
            ValueError,
            r"LGC-PS trains on reconstruction and similarity only \(the mean term is LGC-RAR's\), and both are 0",
        ),
        # Wrong types name the field.
        (["compressor.density=abc"], TypeError, r"compressor.density='abc' must be a number in \(0, 1\]"),
        (["compressor.density=[0.1]"], TypeError, r"compressor.density=\[0.1\] must be a number in \(0, 1\]"),
        (["trainer.max_steps=abc"], TypeError, "trainer.max_steps='abc' must be an int"),
        (["data.batch_size=abc"], TypeError, "data.batch_size='abc' must be a positive integer"),
        (["data.batch_size=0"], ValueError, "data.batch_size=0 must be a positive integer"),
        # A shard smaller than one batch, in a run by epochs and in one by steps.
        (["data.batch_size=5000"], ValueError, r"each of its 2 workers' shard holds fewer than one batch"),
        (
            ["data.batch_size=5000", "trainer.max_steps=10", "trainer.max_epochs=-1"],
            ValueError,
            r"each of its 2 workers' shard holds fewer than one batch of data.batch_size=5000",
        ),
        (["ddp.process_group_backend=nccl"], ValueError, r"'nccl' needs GPUs \(trainer.accelerator='cpu'\)"),
        (["ddp.process_group_backend=mpi"], ValueError, r"process_group_backend='mpi' must be null, 'gloo' or"),
        (["optimizer.lr=-1"], ValueError, "optimizer/scheduler: Invalid learning rate: -1"),
        (["ddp.timeout=0"], ValueError, "ddp.timeout must be a positive number of seconds, got 0"),
        (["ddp.timeout=abc"], ValueError, "ddp.timeout must be a positive number of seconds, got 'abc'"),
        (["checkpoint.every_n_train_steps=0"], ValueError, "checkpoint.every_n_train_steps must be a positive"),
        (
            ["comm=diloco", "comm.delay=4", "comm.outer_lr=0"],
            ValueError,
            r"outer_lr must be a positive finite number or None, got 0.0",
        ),
        (
            ["comm=streaming_diloco", "comm.delay=4", "comm.fragment_split=layers"],
            ValueError,
            "fragment_split must be one of \\('strided', 'contiguous'\\), got 'layers'",
        ),
        (["comm=local_sgd"], ValueError, r"comm=local_sgd needs comm.delay \(e.g. comm.delay=4\)"),
        (["comm=local_sgd", "comm.delay=0"], ValueError, "comm.delay must be a positive integer or None, got 0"),
        (
            ["+comm.delay=4"],
            ValueError,
            "comm.delay is not a setting of comm=every_step .*; it is a setting of comm=local_sgd/diloco/streaming_",
        ),
        (
            ["compressor=lgc_rar", "compressor.training.autoencoder.init=/no/such/codec.pt"],
            FileNotFoundError,
            "autoencoder.init='/no/such/codec.pt': no such file",
        ),
    ],
)
def test_bad_input_is_reported_before_workers_start(tmp_path, no_workers, overrides, error, message):
    with pytest.raises(error, match=message):
        train(compose_cfg(tmp_path / "run", *overrides))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _pretend_gpus(monkeypatch, count: int) -> None:
    """This process and Lightning see ``count`` CUDA devices (none is used: nothing is trained)."""
    import lightning_fabric.accelerators.cuda as fabric_cuda
    import pytorch_lightning.accelerators.cuda as lightning_cuda

    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: count)
    for accelerator in (fabric_cuda.CUDAAccelerator, lightning_cuda.CUDAAccelerator):
        monkeypatch.setattr(accelerator, "is_available", staticmethod(lambda: count > 0))


@pytest.mark.parametrize("gpus,workers,expected", [(1, 4, [0, 0, 0, 0]), (2, 3, [0, 1, 0]), (2, 2, None)])
def test_more_workers_than_gpus_share_them_over_gloo(tmp_path, monkeypatch, gpus, workers, expected):
    from lgc.train import _prepare

    _pretend_gpus(monkeypatch, gpus)
    cfg = compose_cfg(tmp_path / "run", "trainer=gpu", f"trainer.devices={workers}", "ddp.oversubscribe=true")
    strategy = _prepare(cfg).trainer.strategy
    assert strategy.world_size == strategy.num_processes == workers
    if expected is None:  # one worker per GPU: Lightning's own devices and NCCL
        assert strategy.parallel_devices == [torch.device("cuda", i) for i in range(workers)]
        assert strategy._get_process_group_backend() == "nccl"
    else:
        assert strategy.parallel_devices == [torch.device("cuda", i) for i in expected]
        assert strategy._get_process_group_backend() == "gloo"


@pytest.mark.parametrize(
    "gpus,overrides,message",
    [
        (1, [], r"trainer.devices=4 but this machine has 1 CUDA device\(s\); set ddp.oversubscribe=true to let"),
        (0, ["ddp.oversubscribe=true"], r"trainer.devices=4 but this machine has 0 CUDA device\(s\)$"),
        (
            1,
            ["ddp.oversubscribe=true", "ddp.process_group_backend=nccl"],
            r"ddp.process_group_backend='nccl' but trainer.devices=4 workers share 1 GPU\(s\), which only gloo",
        ),
        (1, ["ddp.oversubscribe=true", "trainer.num_nodes=2"], r"run on one node, .*\(trainer.num_nodes=2\)"),
    ],
)
def test_workers_sharing_gpus_are_refused_where_not_allowed(
    tmp_path, no_workers, monkeypatch, gpus, overrides, message
):
    _pretend_gpus(monkeypatch, gpus)
    with pytest.raises(ValueError, match=message):
        train(compose_cfg(tmp_path / "run", "trainer=gpu", "trainer.devices=4", *overrides))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["comm.delay=4"], r"Key 'delay' not in 'EveryStep'"),
        (["comm.outer_lr=0.5"], r"Key 'outer_lr' not in 'EveryStep'"),
        (["comm=local_sgd", "comm.outer_lr=0.5"], r"Key 'outer_lr' not in 'LocalSGD'"),
        (["comm=diloco", "comm.fragments=2"], r"Key 'fragments' not in 'DiLoCo'"),
        (["comm=diloco", "comm.delay=4", "comm.start_iter=2"], r"Key 'start_iter' not in 'DiLoCo'"),
        (["comm.min_numel=abc"], r"'abc' of type 'str' could not be converted to Integer\s+full_key: comm.min_numel"),
        (["comm=diloco", "comm.delay=true"], r"Value 'True' of type 'bool' could not be converted to Integer"),
        (["comm=diloco", "comm.outer_momentum=abc"], r"'abc' .* converted to Float\s+full_key: comm.outer_momentum"),
    ],
)
def test_a_comm_setting_that_does_not_apply_or_is_of_the_wrong_type_is_refused_by_hydra(tmp_path, overrides, message):
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(tmp_path / "run", *overrides)
    assert re.search(message, f"{info.value}\n{info.value.__cause__}"), f"{info.value}\n{info.value.__cause__}"


@pytest.mark.slow
def test_a_refused_run_leaves_no_folder_behind(tmp_path):
    earlier = tmp_path / "outputs" / "2026-01-01" / "10-00-00"
    earlier.mkdir(parents=True)
    (earlier / "summary.json").write_text("{}")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lgc.train",
            "compressor=topk",
            "compressor.density=-1",
            "logger=none",
            "output_dir=pinned",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and "compressor.density=-1 must be a number in (0, 1]" in result.stderr
    # Hydra's outputs/DATE/TIME/ of the refused run is gone, an earlier run's folder is not.
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == [
        "outputs",
        "outputs/2026-01-01",
        "outputs/2026-01-01/10-00-00",
        "outputs/2026-01-01/10-00-00/summary.json",
    ]


def _hydra_run_folder(folder: Path, log: str = "") -> Path:
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text("x: 1\n")
    (folder / "train.log").write_text(log)
    return folder


def test_only_a_run_folder_holding_nothing_but_hydras_files_is_removed(tmp_path):
    cwd = tmp_path / "cwd"
    refused = _hydra_run_folder(cwd / "outputs" / "2026-01-01" / "10-00-00")
    assert _remove_unused_run_folder(refused, "train.log", stop_at=cwd)
    assert list(tmp_path.iterdir()) == [cwd] and list(cwd.iterdir()) == []  # empty parents up to cwd go too

    kept = [
        _hydra_run_folder(cwd / "with_a_log", log="something to read\n"),
        _hydra_run_folder(cwd / "with_a_checkpoint"),
        _hydra_run_folder(cwd / "with_more_hydra_files"),
    ]
    (kept[1] / "checkpoints").mkdir()
    (kept[2] / ".hydra" / "notes.txt").write_text("mine")
    for folder in kept:
        assert not _remove_unused_run_folder(folder, "train.log", stop_at=cwd)
        assert (folder / ".hydra" / "config.yaml").is_file()


def test_a_stage_that_carries_no_gradient_has_no_compression_ratio():
    from lgc.lit.callbacks import _stage_totals

    # LGC's autoencoder_weights stage sends the codec's weights: bytes, but no gradient's dense equivalent.
    weights = {"bytes_sent": 4000, "wire_bytes_sent": 4000, "payload_bytes": 4000}
    compressed = {
        "bytes_sent": 100,
        "wire_bytes_sent": 100,
        "dense_equivalent_bytes": 1000,
        "wire_dense_equivalent_bytes": 1500,
    }
    stages = [{"autoencoder_weights": weights, "compressed": compressed}] * 2
    totals = _stage_totals(stages)
    assert totals["autoencoder_weights"]["bytes_sent"] == 8000
    assert totals["autoencoder_weights"]["compression_ratio"] is None
    assert totals["autoencoder_weights"]["payload_compression_ratio"] is None
    assert totals["compressed"]["compression_ratio"] == 15 and totals["compressed"]["logical_compression_ratio"] == 10


def test_the_final_line_names_the_overall_ratio_and_lgcs_compressed_stage():
    summary = {
        "val/acc": 0.5,
        "compression_ratio": 8.2812,
        "wire_bytes_sent": 24_680_000,
        "world_size": 2,
        "steps": 100,
        "wall_time_s": 61.23,
        "lgc_stages": {"warmup": {"compression_ratio": 1.0}, "compressed": {"compression_ratio": 41.2}},
    }
    assert _result_line(summary, "outputs/x") == (
        "val/acc=0.5000 overall_compression_ratio=8.28 (wire bytes against a dense ring allreduce, all 2 workers, "
        "all 100 steps) wire_sent=12.3MB/worker lgc_compressed_stage_ratio=41.20 wall_time=61.2s "
        "-> outputs/x/summary.json"
    )
    summary = {"compression_ratio": None, "world_size": 2, "steps": 0, "wall_time_s": 3.0}
    assert _result_line(summary, "out") == (
        "no validation metrics overall_compression_ratio=n/a (wire bytes against a dense ring allreduce, "
        "all 2 workers, all 0 steps) wall_time=3.0s -> out/summary.json"
    )


def test_unknown_compressor_is_named(tmp_path):
    with pytest.raises(MissingConfigException, match="nosuchmethod"):
        compose_cfg(tmp_path, "compressor=nosuchmethod")


def test_a_process_group_left_in_the_launching_process_is_reported(tmp_path, no_workers):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="process group is already initialized"):
            train(compose_cfg(tmp_path))
    finally:
        dist.destroy_process_group()


def test_known_third_party_noise_is_left_out_in_the_workers_too(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    with _launch_environment([], spawns_workers=False):
        inherited = os.environ["PYTHONWARNINGS"]
    assert os.environ["PYTHONWARNINGS"] == "default"
    # A worker's interpreter parses it (a malformed entry would print "Invalid -W option ignored").
    warn = (
        "import warnings\n"
        "for module in ('pytorch_lightning.utilities._pytree', 'mine'):\n"
        "    warnings.warn_explicit('`isinstance(treespec, LeafSpec)` is deprecated, use ...', FutureWarning, "
        "'x.py', 1, module=module)\n"
        "for module in ('torchdata.stateful_dataloader.stateful_dataloader', 'mine'):\n"
        "    warnings.warn_explicit(\"'set_vital' is deprecated, please do not call\", UserWarning, 'y.py', 2, "
        "module=module)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", warn], env={**os.environ, "PYTHONWARNINGS": inherited}, capture_output=True, text=True
    )
    assert result.stderr.strip().splitlines() == [
        "x.py:1: FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated, use ...",
        "y.py:2: UserWarning: 'set_vital' is deprecated, please do not call",
    ]

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("pytorch_lightning.utilities.rank_zero", logging.INFO, "x.py", 1, message, (), None)

    assert not _drop_lightning_tips(record("💡 Tip: For seamless cloud logging, try installing litlogger"))
    assert _drop_lightning_tips(record("GPU available: False, used: False"))


@pytest.mark.multiprocess
def test_under_torchrun_rank_0_alone_reads_the_summary_and_reports(tmp_path):
    # Every worker of a torchrun launch returns from fit; the summary is rank 0's (written on its node), so the
    # others neither read it (a race here, a failure on nodes without a shared file system) nor print a result.
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "lgc.train",
    ]
    overrides = ["trainer.devices=2", "trainer.max_steps=3", "logger=csv", "trainer.enable_progress_bar=false"]
    result = subprocess.run(
        [*command, *overrides, f"output_dir={out}", f"hydra.run.dir={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("overall_compression_ratio=") == 1
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
