"""The synchronized model, seen in place of a worker's local one: what the local-step family evaluates.

Between exchanges every worker of :class:`~lgc.ddp.local_sgd.CommunicationDelayState` holds its
own weights; DiLoCo, Streaming DiLoCo, SparseLoCo and DeMo report the model all workers agree on,
the synchronized one. :class:`GlobalModelView` puts it into the wrapped module for a ``with``
block and puts the local weights and buffers back, bit for bit, on leaving it (even by an
exception); the optimizer's state and the random generators are never touched, so training goes
on as if nothing had been evaluated.

Inside, every parameter holds its fragments' last synchronized weights and every averaged buffer
(:class:`~lgc.ddp.buffers.ExchangedBuffers`) the value of the last buffer average (the initial
ones before any exchange). The other buffers stay the worker's own: integer ones (BatchNorm's
``num_batches_tracked``) count its forward passes, and with ``broadcast_buffers=False`` (or
buffers DDP ignores) there is no agreed value to take. Inside, the state's ``state_dict()`` saves
the local weights held aside, and a second ``global_model()``, ``after_optimizer_step()`` and
``load_state_dict()`` raise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from lgc.ddp.fragments import FragmentSlice, write_piece

__all__ = ["GlobalModelView"]


class GlobalModelView:
    """Holds a worker's local weights and buffers aside while its module holds the synchronized model."""

    __slots__ = ("held_local",)

    def __init__(self) -> None:
        #: Inside :meth:`enter`: this worker's (weights, buffers), put back on leaving it.
        self.held_local: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None

    def refuse_inside(self, what: str) -> None:
        """Raise if ``what`` is called inside the ``with`` block (the module holds the synchronized weights)."""
        if self.held_local is not None:
            raise RuntimeError(
                f"{what} inside global_model(): the module holds the synchronized weights until the with block ends "
                "(leave it first)"
            )

    @contextlib.contextmanager
    def enter(
        self,
        module: nn.Module,
        params: Mapping[str, nn.Parameter],
        synced: Sequence[tuple[FragmentSlice, Tensor]],
        synced_buffers: Mapping[str, Tensor],
    ) -> Iterator[nn.Module]:
        """``module`` with every piece of ``params`` at its ``synced`` value and ``synced_buffers`` copied in.

        ``params`` are the trainable parameters by name; ``synced_buffers`` the averaged buffers'
        values by name (the other buffers stay this worker's own).
        """
        self.refuse_inside("global_model()")
        named_buffers = dict(module.named_buffers())
        local = {name: p.detach().clone() for name, p in params.items()}
        local_buffers = {name: b.detach().clone() for name, b in named_buffers.items()}
        self.held_local = (local, local_buffers)
        try:
            with torch.no_grad():
                for piece, value in synced:
                    write_piece(params[piece.name], piece, value)
                for name, value in synced_buffers.items():
                    named_buffers[name].copy_(value)
            yield module
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(local[name])
                for name, buffer in named_buffers.items():
                    buffer.copy_(local_buffers[name])
            self.held_local = None
