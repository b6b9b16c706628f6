"""What every hook state offers the code that drives training: :class:`HookState`.

A hook state is what :func:`lgc.compress` returns and what ``lgc-train``'s strategy registers:
:class:`~lgc.ddp.CompressionHookState` (a compressor every step, LGC and the shared-index codecs
among its subclasses), :class:`~lgc.ddp.local_sgd.CommunicationDelayState` (local steps, then an
exchange of weight updates) and :class:`~lgc.ddp.torch_hooks.TorchHookState` (PyTorch's own hooks).
The code around them (``lgc.compress``, ``lgc-train``, the Lightning callback, the benchmarks)
asks a state what it needs through this interface instead of asking what class it is:

* the class attributes say whether compressors see unscaled gradients under AMP
  (:attr:`~HookState.unscales_gradients`), whether workers take local steps between exchanges
  (:attr:`~HookState.takes_local_steps`) and whether the run's length must be known before it
  starts (:attr:`~HookState.needs_total_steps`);
* :meth:`~HookState.check_optimizer` and :meth:`~HookState.check_run` refuse, before any worker
  starts, what the method would run wrongly;
* :meth:`~HookState.after_optimizer_step` is called after every optimizer step (an exchange
  under communication delay; nothing otherwise), and :meth:`~HookState.global_model` is entered
  for evaluation (the synchronized weights under communication delay);
* the questions a run, its summary and the benchmarks ask: which parameters go dense
  (:meth:`~HookState.dense_below`), from which step the method sends what it sends for the rest
  of the run (:meth:`~HookState.steady_from`), its learned codec (:meth:`~HookState.save_codec`),
  which model evaluation sees (:attr:`~HookState.eval_model`), and how its collectives meet the
  backward pass (:attr:`~HookState.overlaps_backward`, :meth:`~HookState.gathers_payloads`).
  A wrapper (communication delay) answers them for what it wraps, so no caller looks inside.

The three classes subclass :class:`HookState`, which gives the optional parts their defaults; an
object of another class is a hook state too if it has every member (``isinstance`` checks this).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from lgc.compressors.base import OPTIMIZER_SOURCES

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lgc.ddp.collectives import CommStats

# OPTIMIZER_SOURCES (lgc.compressors.base's): check_optimizer's default, for the states that implement it.
__all__ = ["OPTIMIZER_SOURCES", "HookState", "RunTooShort"]


class RunTooShort(ValueError):
    """A method's stages do not fit the run (``check_run``): ``what`` does not fit in ``total`` steps.

    Communication delay re-counts the run in exchanges and says so (the stages of a state it
    exchanges through count exchanges).
    """

    def __init__(self, what: str, total: int) -> None:
        self.what = what
        self.total = total
        super().__init__(f"{what} >= the run's {total} optimizer steps")


@runtime_checkable
class HookState(Protocol):
    """The interface of every hook state (see the module docstring)."""

    __slots__ = ()

    #: Bytes sent and received, steps skipped: this worker's communication counts.
    stats: CommStats
    #: Whether the compressors see unscaled gradients under AMP loss scaling: the caller then sets
    #: ``state.loss_scale = scaler.get_scale``. PyTorch's hooks compress scaled gradients, and
    #: communication delay exchanges weight updates, so neither takes it.
    unscales_gradients: ClassVar[bool] = False
    #: Whether workers take local optimizer steps between exchanges: their weights and optimizer
    #: states differ between ranks (checkpoints keep every rank's), and an optimizer step must be
    #: one backward pass (no gradient accumulation).
    takes_local_steps: ClassVar[bool] = False
    #: Whether :meth:`check_run` needs the run's length in optimizer steps (LGC's stages must fit).
    needs_total_steps: ClassVar[bool] = False
    #: Which model evaluation sees (``summary.json``'s ``eval_model``): ``global``, the one every
    #: worker agrees on (under local steps, the synchronized weights inside :meth:`global_model`).
    eval_model: ClassVar[str] = "global"

    def describe(self) -> str:
        """What this hook does, for summaries and logs."""
        ...

    def register(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Register the hook on ``model``; ``optimizer`` lets a state that acts after optimizer steps hook them."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This worker's state, for its share of a checkpoint (residuals differ between ranks)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result."""
        ...

    def set_epoch(self, epoch: int) -> None:
        """The epoch that starts (per-epoch schedules such as DGC's warm-up follow it)."""

    def after_optimizer_step(self) -> bool:
        """Called after every optimizer step; whether the workers exchanged (communication delay)."""
        return False

    def settle(self) -> None:
        """Wait for communication still in flight, applying nothing (its bytes then counted; training is over).

        Streaming DiLoCo's overlapped exchange (:meth:`~lgc.ddp.local_sgd.CommunicationDelayState.settle`) only.
        """

    def residual_norm(self) -> float | None:
        """Norm of the error-feedback residuals, or None without residuals."""
        return None

    def metrics(self) -> dict[str, float]:
        """Method-specific metrics to log every step besides ``comm/*`` (LGC: ``lgc/stage``, ...)."""
        return {}

    def summary_extras(self) -> dict[str, Any]:
        """Method-specific fields for this worker's entry in ``summary.json``."""
        return {}

    def optimizer_settings_needed(self) -> tuple[str, ...]:
        """The optimizer settings the method must know before it runs (its compressor's; none by default)."""
        return ()

    def check_optimizer(
        self, momentum: float, weight_decay: float | None, *, sources: tuple[str, str] = OPTIMIZER_SOURCES
    ) -> None:
        """Refuse an optimizer that applies what the method applies itself (DGC's momentum and decay, DeMo's momentum).

        ``weight_decay=None``: not known, not checked; ``sources`` name the values in the messages.
        A state that runs a compressor applies its rules
        (:meth:`lgc.compressors.Compressor.check_optimizer`, forwarded by wrappers); nothing by default.
        """

    def check_run(self, model: nn.Module, world_size: int, total_steps: int | None) -> None:
        """Refuse a run the method cannot serve, before any worker starts (and learn its world size)."""

    def codec_times(self) -> dict[str, float] | None:
        """Wall seconds this process spent encoding (``encode``) and decoding (``decode``), for benchmarks.

        None where the method's coding is not separable from its collectives (LGC codes between
        them, PyTorch's hooks inside them, communication delay at its exchanges).
        """
        return None

    def dense_below(self) -> int | None:
        """Parameters with fewer elements go dense (the ``min_numel`` in effect); None without such a rule."""
        return None

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        """The first optimizer step from which the method sends what it sends for the rest of the run.

        Its stages before that (plain-allreduce iterations, warm-ups, codec training, DGC's density
        warm-up of ``steps_per_epoch`` steps an epoch unless DGC was given its own) send more, so
        benchmarks of the steady state skip them. Under communication delay the stages count
        exchanges, and the answer is in the optimizer steps they take.
        """
        return 0

    def save_codec(self, path: str | Path) -> Path | None:
        """Write the method's learned codec to ``path`` (for ``training.autoencoder.init``); None without one."""
        return None

    @property
    def overlaps_backward(self) -> bool:
        """Whether a bucket's collectives start as DDP hands it over, while the backward pass still runs."""
        return False

    def gathers_payloads(self) -> bool:
        """Whether every worker decodes every other worker's payload (an allgather), so decoding grows with them."""
        return False

    def take_buffers(self, buffers: list[torch.Tensor], mode: str) -> bool:
        """Whether the state carries this step's module buffers in its own collectives (a step that goes out
        as one message, :mod:`lgc.ddp.packed`); False (default): :mod:`lgc.ddp.buffers` syncs them apart.

        Called at every step's last bucket, before the hook's call for it, with the buffers kept in
        step and the mode (``broadcast`` or ``average``).
        """
        return False

    def global_model(self) -> contextlib.AbstractContextManager[None]:
        """Entered around evaluation: the model every worker agrees on (under local steps, the synchronized one)."""
        return contextlib.nullcontext()
