"""A Lightning DDP strategy that really registers the compression hook, on every backend.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only when the device is CUDA;
on CPU (gloo) it trains uncompressed without a word. :class:`CompressedDDPStrategy` registers
:func:`lgc.ddp.compression_hook` on gloo and NCCL alike, and fails at the end of fit if the hook
never ran.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy

from lgc.ddp.hook import CompressionHookState
from lgc.ddp.local_sgd import CommunicationDelayState
from lgc.ddp.torch_hooks import TorchHookState

__all__ = ["CompressedDDPStrategy"]


class CompressedDDPStrategy(DDPStrategy):
    """DDP whose gradient averaging goes through ``hook_state.compressor``.

    Add :class:`lgc.lit.CompressionCallback` to the trainer too: it logs the ``comm/*`` metrics and
    puts every rank's compressor state into checkpoints (the strategy refuses to train without it,
    because a checkpoint without residuals cannot resume exactly).

    Args:
        hook_state: the compressor and hook knobs, e.g.
            ``CompressionHookState(ErrorFeedback(TopKCompressor(0.01)), min_numel=1024)``, or one of
            PyTorch's own hooks wrapped by :mod:`lgc.ddp.torch_hooks` (``PowerSGDHookState()``).
        **kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``process_group_backend``,
            ``bucket_cap_mb``, ...); ``ddp_comm_hook`` is not accepted.

    Example::

        >>> state = CompressionHookState(ErrorFeedback(TopKCompressor(density=0.01)))
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CompressedDDPStrategy(state),
        ...                      callbacks=[CompressionCallback()])
    """

    strategy_name = "lgc_ddp"

    def __init__(
        self, hook_state: CompressionHookState | TorchHookState | CommunicationDelayState, **kwargs: Any
    ) -> None:
        for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(key) is not None:
                raise ValueError(f"CompressedDDPStrategy registers its own hook; do not pass {key}={kwargs[key]!r}")
        super().__init__(**kwargs)
        self.hook_state = hook_state

    def setup_environment(self) -> None:
        # Checked before the process group exists: Lightning never destroys it, and one left behind
        # in this process would hold MASTER_PORT for every later run.
        from lgc.lit.callbacks import CompressionCallback

        trainer = self.lightning_module.trainer
        if not any(isinstance(cb, CompressionCallback) for cb in trainer.callbacks):
            raise ValueError(
                "CompressedDDPStrategy needs lgc.lit.CompressionCallback in Trainer(callbacks=...) so that every "
                "rank's compressor state (residuals) is checkpointed"
            )
        super().setup_environment()

    def _register_ddp_hooks(self) -> None:
        # Deliberately not Lightning's CUDA-only path: register on gloo and NCCL alike.
        self.hook_state.process_group = dist.group.WORLD
        self.hook_state.register(self.model)

    def on_train_end(self) -> None:
        super().on_train_end()
        trainer = self.lightning_module.trainer
        if trainer.global_step > 0 and self.hook_state.stats.hook_calls == 0:
            raise RuntimeError(
                f"{self.hook_state.describe()} was configured but the DDP communication hook never ran in "
                f"{trainer.global_step} steps: gradients were averaged uncompressed"
            )
