"""A compressed step's inputs and the collectives every topology's stage shares.

The hook state (:class:`~lgc.learned.state.LGCHookState`) builds one :class:`StepContext` per
compressed step and hands it to its topology's stage (:mod:`lgc.learned.rar`,
:mod:`lgc.learned.ps`, :mod:`lgc.learned.shared_index`). The context carries the step's plan,
leader and books, and the operations the stages share: the leader's broadcast of its positions
(and scales, and values), the allreduce of the small parameters sent dense, the payload booking
and the diagnostic error against the exact sum. Also here: the latent's wire dtypes and rank 0's
weights sent to the workers (:func:`send_parameters`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lgc.autoencoder import num_chunks
from lgc.compressors.topk import to_wire_float
from lgc.ddp import collectives as counted
from lgc.ddp.collectives import CommStats
from lgc.learned.leader_code import LeaderIndexCodec
from lgc.learned.plan import StepPlan
from lgc.learned.samples import mean_pairwise_correlation
from lgc.learned.schedule import StageSchedule
from lgc.validation import NonNegativeInt, check

__all__ = [
    "LATENT_DTYPES",
    "CompressedStage",
    "DeliveredError",
    "Leaders",
    "StepContext",
    "latent_bytes",
    "latent_wire_dtype",
    "send_parameters",
]

#: Latent formats on the wire.
LATENT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Leaders:
    """Whose top-k positions everyone uses: ``rank`` always, or worker ``step % world_size`` (``rotate``)."""

    rank: NonNegativeInt = 0
    rotate: bool = False

    def __post_init__(self) -> None:
        check("leaders.rank", self.rank, NonNegativeInt)
        if self.rotate and self.rank != 0:
            raise ValueError(
                f"leaders.rank={self.rank} fixes the leader, but leaders.rotate=true lets worker "
                "step % world_size lead each step: set leaders.rotate=false to keep that leader"
            )

    def check_world(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size!r}")
        if not 0 <= self.rank < world_size:
            raise ValueError(f"leaders.rank={self.rank} is outside the world of {world_size} worker(s)")

    def at(self, step: int, world_size: int) -> int:
        """The leader of ``step``."""
        return step % world_size if self.rotate else self.rank


class DeliveredError:
    """Diagnostics (``measure_error``): the delivered sum's error against the exact one, and LGC's premise.

    Every measured step gathers the workers' exact values at the leader's positions with one more
    fp32 allgather (``K + 1`` values a worker) that is deliberately **not** counted in the bytes, and
    logs:

    * ``lgc/true_error``: the relative error of the delivered sum against the exact sum there;
    * ``lgc/premise_r``: Pearson's r between two workers' values there, the mean over the pairs
      (:func:`lgc.learned.samples.mean_pairwise_correlation`): LGC's premise that they agree;
    * ``lgc/premise_share``: the share of a non-leader's squared error-corrected gradient lying at
      the leader's positions, the mean over the non-leaders (chance is the density).

    The values are the error-corrected gradients the codec is given (not the raw gradients
    :func:`lgc.analysis.correlation.leader_position_statistics` reads from a recording). The run's
    values (the error over all measured steps, the premise's means over them) go to the summary.
    """

    __slots__ = ("enabled", "premise", "sums")

    def __init__(self, enabled: bool) -> None:
        self.enabled = check("measure_error", enabled, bool)
        #: [sum of squared errors, sum of squared exact sums] over the measured steps.
        self.sums = [0.0, 0.0]
        #: [sum of r, sum of the energy share, steps] over the measured steps with 2 workers or more.
        self.premise = [0.0, 0.0, 0.0]

    def measure(
        self,
        own: Tensor,
        delivered: Tensor,
        group: Any,
        metrics: dict[str, float],
        leader: int = 0,
        energy: float | None = None,
    ) -> None:
        """``own``: this worker's values at the leader's positions; ``delivered``: the sum delivered there;
        ``energy``: this worker's squared error-corrected gradient over every position (None: no share)."""
        if not self.enabled:
            return
        values = own.detach().to(torch.float32).reshape(-1)
        share = float(values.square().sum()) / energy if energy else float("nan")
        packed = torch.cat([values, values.new_tensor([share])])
        workers = torch.stack(counted.measure_all_gather(packed, group))  # [W, K + 1], the same on every rank
        exact = workers[:, :-1].sum(dim=0)
        error, norm = float((delivered.float().reshape(-1) - exact).square().sum()), float(exact.square().sum())
        self.sums[0] += error
        self.sums[1] += norm
        metrics["lgc/true_error"] = error / norm if norm > 0 else 0.0
        if workers.shape[0] < 2 or values.numel() < 2:
            return
        correlation = float(mean_pairwise_correlation(workers[:, :-1]))
        shares = workers[:, -1].double()
        others = float((shares.sum() - shares[leader]) / (workers.shape[0] - 1))
        self.premise = [self.premise[0] + correlation, self.premise[1] + others, self.premise[2] + 1]
        metrics["lgc/premise_r"], metrics["lgc/premise_share"] = correlation, others

    @property
    def run_error(self) -> float | None:
        """The run's relative error (None before any measured step)."""
        return self.sums[0] / self.sums[1] if self.sums[1] > 0 else None

    @property
    def run_premise(self) -> dict[str, float] | None:
        """The premise's means over the measured steps (None before any)."""
        correlation, share, steps = self.premise
        if not steps:
            return None
        return {"correlation": correlation / steps, "energy_share": share / steps, "steps": steps}


@dataclass
class StepContext:
    """One compressed step: its plan, leader, books and the collectives the stages share."""

    plan: StepPlan
    step: int
    leader: int
    rank: int
    world_size: int
    code: LeaderIndexCodec
    #: Error feedback's residuals per parameter (read through :meth:`corrected`, written by :meth:`keep`).
    residuals: dict[str, Tensor]
    stats: CommStats
    group: Any
    #: ``layer_stats.book(name, numel, compressed, nbytes)`` of the hook state (per-parameter bytes).
    book_layer: Callable[[str, int, bool, int], None]
    schedule: StageSchedule
    errors: DeliveredError
    metrics: dict[str, float]
    #: The codec (learned stages), None for the shared-index codecs.
    codec: Any = None
    sent_before: int = field(default=0, init=False)
    #: This worker's squared ``v`` over every position (set by :meth:`corrected` when measuring).
    corrected_energy: float | None = field(default=None, init=False)

    def corrected(self) -> Tensor:
        """Error feedback's ``v = residual + g`` of every compressed parameter, in cat space (fp32)."""
        v = self.plan.corrected(self.residuals)
        if self.errors.enabled:  # the premise's energy share is read against it
            self.corrected_energy = float(v.double().square().sum())
        return v

    def keep(self, v: Tensor) -> None:
        """Store ``v`` as the residuals."""
        self.plan.keep_residuals(self.residuals, v)

    def mark_sent(self) -> None:
        """Start counting this worker's payload here (:meth:`count_payload`)."""
        self.sent_before = self.stats.bytes_sent

    def count_payload(self, extra: int = 0) -> None:
        """Book what this worker sent since :meth:`mark_sent` (plus ``extra`` bytes still to send).

        The parameters share one code, so each is booked the share of its selected values.
        """
        plan = self.plan
        sent = self.stats.bytes_sent - self.sent_before + extra
        self.stats.payload_bytes += sent
        self.stats.payload_dense_equivalent_bytes += plan.numel * plan.compressed[0].grad.element_size()
        for part, k in zip(plan.compressed, plan.ks, strict=True):
            self.book_layer(part.name, part.grad.numel(), True, round(sent * k / plan.k))

    def allreduce_dense(self, extra: list[Tensor]) -> Tensor | None:
        """Sum the dense parameters (and ``extra`` tensors appended to them) in one allreduce.

        Writes the dense parameters' sums into their gradients; returns the summed ``extra`` part.
        """
        plan = self.plan
        for part in plan.dense:
            self.book_layer(part.name, part.grad.numel(), False, part.grad.numel() * part.grad.element_size())
        pieces = [part.grad for part in plan.dense] + extra
        if not pieces:
            return None
        flat = torch.cat([piece.reshape(-1).float() for piece in pieces])
        counted.all_reduce(self.stats, flat, self.group).wait()
        sizes = [piece.numel() for piece in pieces]
        for part, summed in zip(plan.dense, flat.split(sizes), strict=False):
            part.grad.copy_(summed)
        return flat[sum(sizes[: len(plan.dense)]) :]

    def measure_error(self, own: Tensor, delivered: Tensor) -> None:
        """:class:`DeliveredError` of ``delivered`` against the workers' exact sum of ``own``, and the premise."""
        self.errors.measure(own, delivered, self.group, self.metrics, self.leader, self.corrected_energy)

    def apply(self, positions: Tensor, values: Tensor, like: Tensor) -> None:
        """The step's update: ``values`` at ``positions`` (cat space), zero elsewhere, into the gradients.

        ``like``: the cat-space vector whose dtype and device the update takes.
        """
        self.plan.put(positions, values.to(like.dtype))

    def leader_message(
        self, v: Tensor, *, scales: bool = True, values: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Broadcast the leader's positions (wire order), chunk scales and values there; returns them everywhere.

        The message is the leader's chunk scales (fp32, one per chunk; ``scales``), its values at
        the positions in dtype ``values`` (``None``: not sent) and the positions' code. With raw
        positions its length is known to every rank; Golomb-coded, it is sent first.
        """
        plan, code = self.plan, self.code
        rows = num_chunks(plan.k, code.chunk)
        scale_bytes = 4 * rows if scales else 0
        value_bytes = 0 if values is None else plan.k * values.itemsize
        wire = None
        if self.rank == self.leader:
            positions = code.in_wire_order(plan.top_positions(v), v)
            pieces = [code.chunk_scales(v[positions]).view(torch.uint8)] if scales else []
            if values is not None:
                pieces.append(to_wire_float(v[positions], values).view(torch.uint8))
            wire = torch.cat([*pieces, code.encode_positions(positions, plan.numel)])
        if code.index_coding == "golomb":
            wire = counted.broadcast_bytes(self.stats, wire, self.leader, self.group)
        else:
            if wire is None:
                wire = torch.empty(scale_bytes + value_bytes + 4 * plan.k, dtype=torch.uint8, device=v.device)
            counted.broadcast(self.stats, wire, self.leader, self.group)
        positions = code.decode_positions(wire[scale_bytes + value_bytes :], plan.k)
        leader_scales = wire[:scale_bytes].clone().view(torch.float32) if scales else None
        leader_values = None if values is None else wire[scale_bytes : scale_bytes + value_bytes].clone().view(values)
        return positions, leader_scales, leader_values


def latent_wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``latent_dtype`` name, refusing names that are not :data:`LATENT_DTYPES`."""
    if name not in LATENT_DTYPES:
        raise ValueError(f"latent_dtype must be one of {sorted(LATENT_DTYPES)}, got {name!r}")
    return LATENT_DTYPES[name]


def latent_bytes(codec: Any, rows: int, dtype: torch.dtype) -> int:
    """Wire size of ``codec``'s latent code of ``rows`` chunks in ``dtype``."""
    return math.prod(codec.latent_shape(rows)) * dtype.itemsize


def send_parameters(
    stats: CommStats, params: list[nn.Parameter], dst: int | None, group: Any, *, as_server: bool = False
) -> None:
    """Rank 0's ``params`` to rank ``dst`` (``None``: every rank), counted; server traffic with ``as_server``."""
    rank = dist.get_rank(group)
    flat = torch.nn.utils.parameters_to_vector(params).detach()
    if dst is None:
        counted.broadcast(stats, flat, 0, group, as_server=as_server)
    elif rank == 0:
        counted.send(stats, flat, dst, group, as_server=as_server)
    elif rank == dst:
        counted.recv(stats, flat, 0, group)
    if dst is None or rank == dst:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat, params)


class CompressedStage(Protocol):
    """A topology's compressed stage: LGC-RAR, LGC-PS, or a shared-index codec."""

    def check_world(self, world_size: int) -> None:
        """Refuse a world this stage cannot serve (before any worker starts)."""

    def distribute_weights(self, codec: nn.Module, leaders: Leaders, stats: CommStats, group: Any) -> None:
        """Send rank 0's trained codec to the workers that need it (a collective; no-op without a codec)."""

    def run(self, ctx: StepContext) -> None:
        """Average the step's gradients in place (every bucket of the step at once), blocking."""
