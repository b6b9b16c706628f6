"""Error feedback (residual accumulation), one wrapper for any compressor.

Each worker keeps, per tensor, the residual ``r`` of what earlier steps did not send. Per step it
compresses ``v = g + r`` and keeps ``r = v - decode(payload)``, so nothing is ever dropped, only
delayed (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019). The invariant
``v == decode(payload) + r`` holds exactly for every compressor and is tested.

With ``decay = beta < 1`` the residual fades: ``v = beta * r + g``. That is the error buffer of
SparseLoCo (Sarfi et al. 2025, ``beta = 0.95`` on the pseudo-gradient, standing in for DiLoCo's
outer momentum) and DeMo's momentum (Peng et al. 2024, ``m = beta * m + g``, then the sent part
is subtracted, ``beta = 0.999``): both are error feedback whose memory decays.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lgc.compressors.base import Compressor, ForwardsHookCalls, Payload
from lgc.compressors.topk import SparsePayload
from lgc.validation import PositiveFraction, check

__all__ = ["ErrorFeedback"]


class ErrorFeedback(ForwardsHookCalls, Compressor):
    """Wraps ``compressor`` and feeds back what it did not send.

    Residuals are kept per ``key`` (the parameter name in the DDP hook), in fp32 whatever the
    gradient's dtype (so the rounding of half-precision payload values is fed back too). They
    differ between workers, so checkpoints must store every rank's residuals (the DDP hook state
    does).

    Args:
        compressor: the compressor whose error is fed back.
        decay: the factor ``beta`` in ``v = beta * r + g``, in (0, 1]. 1 (default) is plain error
            feedback: nothing is lost. Below 1 the unsent part fades geometrically and the residual
            is a momentum of the inputs: SparseLoCo's 0.95, DeMo's 0.999.

    Example::

        >>> ef = ErrorFeedback(TopKCompressor(density=0.5))
        >>> g = torch.tensor([3.0, -1.0, 0.5, 2.0])
        >>> sent = ef.decompress(ef.compress(g, key="w"))
        >>> torch.equal(sent + ef.residuals["w"], g)
        True
    """

    def __init__(self, compressor: Compressor, decay: PositiveFraction = 1.0) -> None:
        if isinstance(compressor, ErrorFeedback):
            raise ValueError("error feedback is already applied; do not wrap ErrorFeedback twice")
        check("decay", decay, PositiveFraction)
        self.compressor = compressor
        self.decay = float(decay)
        self.combine = compressor.combine
        self.variable_size = compressor.variable_size
        self.needs_shared_seed = compressor.needs_shared_seed
        #: Per-key residual: the part of earlier inputs that has not been sent yet.
        self.residuals: dict[str, Tensor] = {}
        #: Residuals of a step encoded by :meth:`compress_pending`, not yet committed.
        self._pending: dict[str, Tensor] = {}
        #: Per-key second buffers that :meth:`compress_pending` writes into (never saved).
        self._spares: dict[str, Tensor] = {}

    def compress(self, tensor: Tensor, key: str) -> Payload:
        # In place: the residual buffer becomes g + beta * r, then what is not sent stays in it.
        payload, self.residuals[key] = self._encode(self._corrected(tensor, key, into=None), key)
        return payload

    def _corrected(self, tensor: Tensor, key: str, into: Tensor | None) -> Tensor:
        """``g + beta * r`` in fp32, written into ``into`` (``None``: into the residual itself)."""
        residual = self.residuals.get(key)
        if residual is None:
            # fp32 whatever the gradient's dtype: a half-precision residual would round away the
            # small entries it exists to accumulate.
            return tensor.to(torch.float32, copy=True)
        residual = residual.to(tensor.device)
        out = residual if into is None else into
        if self.decay != 1.0:
            return torch.mul(residual, self.decay, out=out).add_(tensor)
        return torch.add(residual, tensor, out=out)

    def _encode(self, corrected: Tensor, key: str, held: bool = False) -> tuple[Payload, Tensor]:
        """The payload of ``corrected`` (``g + beta * r``) and the new residual (in place where it can).

        ``held``: a step encoded ahead of the agreement; a compressor that holds steps back itself
        holds its own state too.
        """
        holds = held and self._inner_holds
        encode = self.compressor.compress_pending if holds else self.compressor.compress  # type: ignore[attr-defined]
        payload = encode(corrected, key)
        if isinstance(payload, SparsePayload):
            # Cheaper than a dense decode: subtract what was sent at the sent positions only.
            payload.subtract_from(corrected)
            return payload, corrected
        # Out of place: a dense payload may alias ``corrected``.
        return payload, corrected - self.compressor.decompress(payload).to(corrected.dtype)

    # -- encoding ahead of the step's agreement (the hook's overlap) ------------------------------------
    @property
    def speculates(self) -> bool:
        """Whether :meth:`compress_pending` is available: the wrapped compressor keeps no state, or holds it back.

        The wrapped compressor keeps no state of its own, or holds a step back itself (its own
        ``compress_pending`` and ``commit``: QSGD's and TernGrad's counts of draws). Then a step can
        be encoded into a second buffer before the ranks agree on it (:meth:`commit`).
        """
        return self.compressor.stateless or self.compressor.pure_encoding or self._inner_holds

    @property
    def _inner_holds(self) -> bool:
        """Whether the wrapped compressor holds a step back itself (its state moves with every call)."""
        inner = self.compressor
        return not (inner.stateless or inner.pure_encoding) and getattr(inner, "speculates", False)

    def compress_pending(self, tensor: Tensor, key: str) -> Payload:
        """:meth:`compress` with the same payload, the new residual held aside until :meth:`commit`.

        The residual stays as it is; ``g + beta * r`` is written into a second buffer per key, so
        holding a step back costs memory (one more fp32 copy of the compressed parameters), not a
        pass over it. For sparse payloads (top-k, SBC) that buffer becomes the new residual and the
        two swap at every commit; a dense payload's residual is a new tensor every step, as in
        :meth:`compress`. The arithmetic is :meth:`compress`'s, operation for operation, so
        payloads and residuals are bitwise equal.
        """
        if not self.speculates:
            raise TypeError(f"{self!r} cannot hold a step back: {self.compressor!r} keeps state of its own")
        residual = self.residuals.get(key)
        spare = self._spares.pop(key, None)
        if residual is not None and (spare is None or spare.shape != residual.shape or spare.device != tensor.device):
            spare = torch.empty_like(residual, device=tensor.device)
        payload, self._pending[key] = self._encode(self._corrected(tensor, key, into=spare), key, held=True)
        return payload

    def commit(self, keys: frozenset[str] | set[str]) -> None:
        """Adopt the held residuals of ``keys``; drop the others (their residuals stay as before the step).

        ``commit(frozenset())`` drops the whole step (the ranks agreed to skip it).
        """
        if self._inner_holds:
            self.compressor.commit(keys)
        for key, held in self._pending.items():
            current = self.residuals.get(key)
            if key in keys:
                self.residuals[key] = held
                spare = current
            else:
                spare = held
            if spare is not None and spare is not self.residuals.get(key):
                self._spares[key] = spare
        self._pending = {}

    def drop(self) -> None:
        """Drop the held step (the ranks agreed to skip it): its residuals, and the wrapped compressor's held step."""
        if self._inner_holds:
            self.compressor.drop()  # type: ignore[attr-defined]
        self.commit(frozenset())

    def decompress(self, payload: Payload) -> Tensor:
        return self.compressor.decompress(payload)

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        return self.compressor.aggregate(payloads)

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        self.compressor.aggregate_into(payloads, out)

    def payload_from_sum(self, summed: Tensor, own: Payload) -> Payload:
        return self.compressor.payload_from_sum(summed, own)

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> Payload:
        return self.compressor.payload_from_wire(wire, numel, key=key)

    @property
    def shared_seed(self) -> int:  # type: ignore[override]
        return self.compressor.shared_seed

    def set_shared_seed(self, seed: int) -> None:
        self.compressor.set_shared_seed(seed)

    def residual_norm(self) -> float:
        """L2 norm of all residuals together (a health signal: it should stay bounded)."""
        if not self.residuals:
            return 0.0
        return float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(r) for r in self.residuals.values()]))
        )

    def __getstate__(self) -> dict[str, Any]:
        # Second buffers are scratch and a held step belongs to this process: neither travels.
        return {**self.__dict__, "_pending": {}, "_spares": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_pending": {}, "_spares": {}, **state})

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {key: r.detach().cpu().clone() for key, r in self.residuals.items()},
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {key: r.clone() for key, r in state["residuals"].items()}
        self._pending, self._spares = {}, {}
        self.compressor.load_state_dict(state["compressor"])

    def __repr__(self) -> str:
        decay = "" if self.decay == 1.0 else f", decay={self.decay:g}"
        return f"ErrorFeedback({self.compressor!r}{decay})"
