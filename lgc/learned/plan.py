"""The compressed stage's step plan: every compressed parameter of the model as one vector.

LGC and its shared-index ablations select and encode the whole model's values at once, so a step
is planned in "cat space": the concatenation of the compressed parameters' gradients, in the
model's parameter order (not DDP's bucket order, which differs between a run's first step and the
rest, and between a run and its resumption, while every result must not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from typing import NamedTuple

import torch
from torch import Tensor

from lgc.compressors.segment_topk import segment_topk
from lgc.compressors.selection import topk_indices
from lgc.compressors.topk import num_selected
from lgc.ddp.step_guard import PendingBucket

__all__ = ["Part", "StepPlan", "plan_step"]


class Part(NamedTuple):
    """One parameter's gradient: a view into its DDP bucket's flat buffer."""

    name: str
    grad: Tensor


class StepPlan(NamedTuple):
    """Every compressed parameter of the model as one vector (their concatenation, "cat space")."""

    #: The compressed parameters, in the model's order.
    compressed: tuple[Part, ...]
    #: The parameters sent dense (fewer than ``min_numel`` elements).
    dense: tuple[Part, ...]
    #: Start of every compressed parameter in cat space.
    cat_offsets: tuple[int, ...]
    #: Top-k size of every compressed parameter.
    ks: tuple[int, ...]
    #: Length of the cat-space vector.
    numel: int
    #: Values the leader selects: ``sum(ks)``.
    k: int

    def scatter(self, values: Tensor) -> None:
        """Write a cat-space vector into the parameters' gradients."""
        for part, offset in zip(self.compressed, self.cat_offsets, strict=True):
            part.grad.copy_(values[offset : offset + part.grad.numel()])

    def put(self, positions: Tensor, values: Tensor) -> None:
        """Set the gradients to ``values`` at the cat-space ``positions`` and to zero elsewhere.

        What :meth:`scatter` of a zero vector holding ``values`` at ``positions`` writes, without
        building that vector: each gradient is zeroed in place and gets its share of the values.
        On a GPU the vector is built (:meth:`put_flat`): a few kernels instead of two per parameter.
        """
        if positions.device.type != "cpu":
            self.put_flat(positions, values)
            return
        for part in self.compressed:
            part.grad.zero_()
        if not positions.numel():
            return
        order = torch.argsort(positions)
        positions, values = positions[order], values[order]
        offsets = torch.tensor(self.cat_offsets, dtype=positions.dtype, device=positions.device)
        counts = torch.bincount(torch.searchsorted(offsets, positions, right=True) - 1, minlength=len(offsets))
        start = 0
        for part, offset, count in zip(self.compressed, self.cat_offsets, counts.tolist(), strict=True):
            if count:
                end = start + count
                grad = part.grad.view(-1)
                grad.index_put_((positions[start:end] - offset,), values[start:end].to(grad.dtype))
                start = end

    def put_flat(self, positions: Tensor, values: Tensor) -> None:
        """:meth:`put` through a zeroed cat-space vector: one ``index_put_``, one multi-tensor copy out.

        The same bits as :meth:`put`'s loop: each value is cast once into its gradient's dtype
        (through fp32, which holds every half-precision value exactly).
        """
        flat = torch.zeros(self.numel, dtype=torch.float32, device=values.device)
        flat.index_put_((positions,), values.float())
        grads = [part.grad for part in self.compressed]
        torch._foreach_copy_(grads, [piece.view_as(g) for piece, g in zip(flat.split(self.sizes), grads, strict=True)])

    @property
    def sizes(self) -> list[int]:
        """Every compressed parameter's length."""
        return [part.grad.numel() for part in self.compressed]

    def corrected(self, residuals: Mapping[str, Tensor]) -> Tensor:
        """Error feedback's ``v = residual + g`` of every compressed parameter, in cat space (fp32).

        The residuals are updated in place. When they are consecutive views of one vector, as
        :meth:`keep_residuals` leaves them for the same plan, that vector is ``v`` and no copy is made.
        """
        parts = []
        for part in self.compressed:
            residual = residuals.get(part.name)
            # fp32 whatever the gradients' dtype, like lgc.compressors.ErrorFeedback's residuals.
            if residual is None:
                parts.append(part.grad.to(torch.float32, copy=True))
            else:
                parts.append(residual.to(part.grad.device).add_(part.grad))
        whole = self._one_vector(parts)
        return torch.cat(parts) if whole is None else whole

    def _one_vector(self, parts: list[Tensor]) -> Tensor | None:
        """The cat-space vector ``parts`` are consecutive views of (in the plan's offsets), if any."""
        if not parts:
            return None
        first = parts[0]
        storage, start = first.untyped_storage(), first.storage_offset()
        if first.dtype != torch.float32 or storage.nbytes() < (start + self.numel) * first.element_size():
            return None
        for part, offset in zip(parts, self.cat_offsets, strict=True):
            if not (
                part.is_contiguous()
                and part.dtype == torch.float32
                and part.untyped_storage().data_ptr() == storage.data_ptr()
                and part.storage_offset() == start + offset
            ):
                return None
        return first.as_strided((self.numel,), (1,), start)

    def energy(self, residuals: Mapping[str, Tensor]) -> float:
        """The squared norm of ``v = residual + g`` over the compressed parameters (residuals left as they are)."""
        total = 0.0
        for part in self.compressed:
            residual = residuals.get(part.name)
            v = part.grad.float() if residual is None else torch.add(residual, part.grad)
            total += float(v.square().sum())
        return total

    def keep_residuals(self, residuals: MutableMapping[str, Tensor], v: Tensor) -> None:
        """Store the cat-space residual ``v`` back per parameter (views of ``v``)."""
        for part, offset in zip(self.compressed, self.cat_offsets, strict=True):
            residuals[part.name] = v[offset : offset + part.grad.numel()]

    def top_positions(self, v: Tensor, density: float | None = None) -> Tensor:
        """Every compressed parameter's top-k positions of ``v`` (cat space).

        ``density`` None: the plan's ``ks``; otherwise ``ceil(density * n)`` per parameter. On the
        CPU parameter by parameter (:func:`~lgc.compressors.selection.topk_indices`); on a GPU all
        at once (:func:`~lgc.compressors.segment_topk.segment_topk`, a fixed number of passes
        however many parameters). The same positions (a tie at a parameter's k-th magnitude
        aside), in another order: callers order them themselves.
        """
        numels = self.sizes
        ks = list(self.ks) if density is None else [num_selected(n, density) for n in numels]
        if v.device.type != "cpu":
            return segment_topk(v, numels, ks)
        pieces = []
        for offset, n, k in zip(self.cat_offsets, numels, ks, strict=True):
            pieces.append(topk_indices(v[offset : offset + n], k))
            pieces[-1] += offset
        return torch.cat(pieces)


def plan_step(
    pending: Iterable[PendingBucket], used: frozenset[str], param_order: Mapping[str, int], density: float
) -> StepPlan:
    """The plan of a step's buckets: parameters with a zero gradient on every rank (unused) take no part."""
    parts = [
        (param_order[s.name], s.compressed, Part(s.name, buffer[s.offset : s.offset + s.numel]))
        for buffer, segments, _ in pending
        for s in segments
        if s.name in used
    ]
    compressed = tuple(part for _, _, part in sorted((p for p in parts if p[1]), key=lambda p: p[0]))
    dense = tuple(part for _, is_compressed, part in parts if not is_compressed)
    offsets, ks, total = [], [], 0
    for part in compressed:
        offsets.append(total)
        ks.append(num_selected(part.grad.numel(), density))
        total += part.grad.numel()
    return StepPlan(compressed, dense, tuple(offsets), tuple(ks), total, sum(ks))
