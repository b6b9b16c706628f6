"""The outer step of the local-step family: how an exchange's averaged pseudo-gradient moves the synchronized weights.

Every exchange of :class:`~lgc.ddp.local_sgd.CommunicationDelayState` ends with the mean over
the workers of their decoded pseudo-gradients ``Delta = W_sync - W_local``. :class:`OuterStep`
applies it to the synchronized weights:

* ``"average"`` (SBC's communication delay, Sattler et al. 2019; SparseLoCo's outer step of lr 1
  without momentum): ``W_sync -= mean(Delta)``, i.e. ``W_sync += mean(dW)``.
* ``"sgd"`` (DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models", 2023): ``mean(Delta)`` is the gradient of an outer ``torch.optim.SGD`` step on
  ``W_sync`` with Nesterov momentum (DiLoCo's defaults: learning rate 0.7, momentum 0.9). With
  ``outer_lr=1`` and ``outer_momentum=0`` it gives the same weights as ``"average"``, bit for bit.

Under Streaming DiLoCo's fragments the outer optimizer steps only the exchanged fragment's weights
(the others have no gradient), as torchft's per-fragment optimizers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lgc.validation import Momentum, PositiveFloat, check

__all__ = ["DILOCO_OUTER_LR", "DILOCO_OUTER_MOMENTUM", "OUTER_OPTIMIZERS", "OuterStep"]

#: ``outer`` choices: SBC's plain average, or DiLoCo's outer SGD on the pseudo-gradient.
OUTER_OPTIMIZERS = ("average", "sgd")
#: DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023, Sec. 3).
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9


class OuterStep:
    """Moves the synchronized weights by an exchange's averaged pseudo-gradient (see the module docstring).

    Args:
        outer: ``"average"`` or ``"sgd"``.
        outer_lr: the outer learning rate (``"sgd"`` only; default 0.7, DiLoCo's).
        outer_momentum: the outer Nesterov momentum in ``[0, 1)`` (``"sgd"`` only; default 0.9,
            DiLoCo's; 0 is plain SGD).
    """

    __slots__ = ("kind", "lr", "momentum", "optimizer")

    def __init__(
        self, outer: str = "average", outer_lr: PositiveFloat | None = None, outer_momentum: Momentum | None = None
    ) -> None:
        if outer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer must be one of {OUTER_OPTIMIZERS}, got {outer!r}")
        if outer == "average" and (outer_lr is not None or outer_momentum is not None):
            raise ValueError(
                f"outer_lr={outer_lr!r} and outer_momentum={outer_momentum!r} are the outer optimizer's knobs: "
                "set outer='sgd' (DiLoCo), or leave them null for outer='average'"
            )
        check("outer_lr", outer_lr, PositiveFloat | None)
        check("outer_momentum", outer_momentum, Momentum | None)
        self.kind = outer
        self.lr = float(DILOCO_OUTER_LR if outer_lr is None else outer_lr)
        self.momentum = float(DILOCO_OUTER_MOMENTUM if outer_momentum is None else outer_momentum)
        #: ``torch.optim.SGD`` over the synchronized weights (``"sgd"``), built by :meth:`build`.
        self.optimizer: torch.optim.SGD | None = None

    def describe(self) -> str:
        """``, outer SGD (lr ..., Nesterov momentum ...)`` for ``"sgd"``; empty for the plain average."""
        if self.kind != "sgd":
            return ""
        return f", outer SGD (lr {self.lr:g}, Nesterov momentum {self.momentum:g})"

    def build(self, synced: Sequence[Tensor]) -> None:
        """Make the outer optimizer over ``synced`` (the synchronized weights, updated in place)."""
        if self.kind != "sgd":
            return
        self.optimizer = torch.optim.SGD(list(synced), lr=self.lr, momentum=self.momentum, nesterov=self.momentum > 0)

    def apply(self, moves: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Move every synchronized tensor by its averaged pseudo-gradient: ``(synced, mean(Delta))`` pairs."""
        if self.optimizer is None:
            for synced, averaged in moves:
                synced -= averaged
            return
        for synced, averaged in moves:
            synced.grad = averaged.clone()  # the outer step's gradient: mean of W_sync - W_local
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any] | None:
        """The outer optimizer's state (its momentum), or None for the plain average."""
        return None if self.optimizer is None else self.optimizer.state_dict()

    def __getstate__(self) -> dict[str, Any]:
        # The optimizer holds this process's synchronized weights: build() makes it again after unpickling.
        return {"kind": self.kind, "lr": self.lr, "momentum": self.momentum, "optimizer": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (after :meth:`build`); a checkpoint of the other kind is refused."""
        if (saved is None) != (self.optimizer is None):
            raise ValueError(
                f"the checkpoint was written with outer={'average' if saved is None else 'sgd'!r}, "
                f"this run has outer={self.kind!r}"
            )
        if self.optimizer is not None:
            self.optimizer.load_state_dict(saved)
