"""A Lightning strategy that shards the model with FSDP2 (``fully_shard``) and compresses its gradients with lgc.

:class:`CompressedFSDPStrategy` is Lightning's ``ModelParallelStrategy`` (FSDP2, one data-parallel
dimension) with lgc's reduction installed (:mod:`lgc.fsdp`): the task module's ``configure_model``
calls :meth:`CompressedFSDPStrategy.shard_model`, which shards every block of the model
(:func:`lgc.fsdp.shard_blocks`) and then the model itself, and registers the compressed
reduce-scatter. With ``shard_size`` it is hybrid sharding (HSDP): the workers form a
``replicas x shard_size`` mesh, the model is sharded within a replica (FSDP2's exact
reduce-scatter) and lgc compresses the all-reduce across replicas, or, with communication delay
(a :class:`~lgc.ddp.local_sgd.CommunicationDelayState`), the replicas take local steps and exchange
their shards' pseudo-gradients (:mod:`lgc.fsdp.local_steps`).

What it shares with :class:`~lgc.lit.CompressedDDPStrategy`: it refuses to train without
:class:`~lgc.lit.CompressionCallback` (every rank's compressor state goes into checkpoints), it
fails at the end of fit if the compressed reduction never ran, and every worker writes heartbeats.
Checkpoints are whole (``save_distributed_checkpoint=False``: rank 0 writes one file with the full
weights and optimizer state), so that a run resumes through the same checks and files as a DDP run.
Workers start as the DDP strategy's do (``spawn``, ``fork``, or ``popen`` under torchrun/SLURM).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from pytorch_lightning.strategies import ModelParallelStrategy
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.fsdp import register_sharded, shard_model
from lgc.lit.strategy import WorkerChecks

__all__ = ["CompressedFSDPStrategy", "shard_for_strategy"]


class _WorkerResultsLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for spawned or forked workers, without sending rank 0's weights back to the launching
    process: they are one shard of the model there (lgc-train reads the run's summary, not the module)."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        return _WorkerOutput(None, None, trainer.state, results, self.get_extra_results(trainer))


class CompressedFSDPStrategy(WorkerChecks, ModelParallelStrategy):
    """FSDP2 over every worker (or HSDP, ``shard_size`` workers per replica) whose gradients go through lgc.

    Args:
        hook_state: the compressor and its settings (:class:`~lgc.ddp.CompressionHookState`; methods with
            collectives of their own are refused by :func:`lgc.fsdp.check_fsdp_state`), or with HSDP local
            steps through one (:class:`~lgc.ddp.local_sgd.CommunicationDelayState`) or LGC across the
            replicas (:class:`~lgc.learned.state.LGCHookState`, :mod:`lgc.fsdp.learned`).
        shard_size: None shards over every worker (FSDP); an integer makes a ``world / shard_size`` x
            ``shard_size`` mesh, sharded within a replica, compressed across replicas (HSDP).
        buffers: module buffers kept in step once per step, as the DDP strategy keeps them
            (``"broadcast"``, ``"average"``); None leaves each rank its own, as FSDP2 does.
        heartbeat_dir: where every worker writes its heartbeat; None writes none.
        start_method: ``spawn``, ``fork``, ``forkserver`` or ``popen`` (workers started by the launcher).
        timeout: of every collective.
        process_group_backend: None picks gloo on CPU and NCCL on GPU.
    """

    strategy_name = "lgc_fsdp"
    reduction = "the compressed FSDP2 reduction"

    def __init__(
        self,
        hook_state: CompressionHookState | CommunicationDelayState,
        shard_size: int | None = None,
        buffers: str | None = None,
        heartbeat_dir: str | Path | None = None,
        start_method: str = "spawn",
        timeout: timedelta = timedelta(minutes=30),
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.hook_state = hook_state
        self.shard_size = shard_size
        self.buffers = buffers
        self.heartbeat_dir = None if heartbeat_dir is None else Path(heartbeat_dir)
        self._start_method = start_method
        self.shard_mesh: DeviceMesh | None = None
        self.replicate_mesh: DeviceMesh | None = None

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen" or self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _WorkerResultsLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        self.require_compression_callback()
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        world = self.world_size
        if self.shard_size is None:
            self.shard_mesh = self.device_mesh["data_parallel"]
        else:
            shape = (world // self.shard_size, self.shard_size)
            mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))
            self.shard_mesh, self.replicate_mesh = mesh["shard"], mesh["replicate"]
        self.start_heartbeat()

    def shard_model(self, model: nn.Module) -> None:
        """``fully_shard`` every block of ``model`` and ``model`` (:func:`lgc.fsdp.shard_model`), and install lgc's
        reduction.

        Called by the task module's ``configure_model``; a model sharded already is left as it is."""
        if isinstance(model, FSDPModule):
            return
        shard_model(model, mesh=self.shard_mesh)
        replicate = None if self.replicate_mesh is None else self.replicate_mesh.get_group()
        # With local steps the compression callback steps the state after each batch (no optimizer here).
        register_sharded(self.hook_state, model, replicate, self.buffers)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


def shard_for_strategy(strategy: Any, model: nn.Module) -> None:
    """A task module's ``configure_model``: shard ``model`` when the trainer's strategy is
    :class:`CompressedFSDPStrategy` (every other strategy wraps the model itself)."""
    if isinstance(strategy, CompressedFSDPStrategy):
        strategy.shard_model(model)
