"""An alpha-beta model of one data-parallel step, to answer "will this method help on my cluster?".

A step of method ``m`` with ``P`` workers on links of latency ``alpha`` and bandwidth ``B``
(bytes per second per direction, what one worker's link carries) costs

    ``compute + overhead(m) + (P - 1) * decode_per_peer(m) + sum over collectives of T(call, P)``

where the collectives are the ones the method's hook really issues in one steady step (recorded by
:func:`lgc.ddp.collectives.record_collectives`, with their per-worker sizes, which do not depend on
``P`` for any lgc method) and ``T`` follows the algorithm the backend runs (:mod:`lgc.ddp.wire`):

===============  =========================================  ==============================================
collective       algorithm                                  T(call, P) for a message of ``L`` bytes
===============  =========================================  ==============================================
allreduce        ring (gloo; NCCL for large messages)       ``2 (P - 1) (alpha + ceil(L / P) / B)``
                 double binary tree (``allreduce="tree"``)  ``2 ceil(log2 P) alpha + 2 L / B`` (pipelined)
allgather        ring                                       ``(P - 1) (alpha + L / B)``
reduce-scatter   ring (FSDP2's gradients)                   ``(P - 1) (alpha + ceil(L / P) / B)``
all-to-all       pairwise (FSDP2's quantized shards)        ``(P - 1) (alpha + ceil(L / P) / B)``
broadcast        gloo's binomial tree                       ``ceil(log2 P) (alpha + L / B)``
gather           flat, to the root                          ``alpha + (P - 1) L / B`` (the root's link)
send / recv      point to point                             ``alpha + L / B`` (counted once, at the sender)
===============  =========================================  ==============================================

* ``compute``: the step on an infinitely fast network: forward, backward, DDP's bucket copies and
  the optimizer, measured as plain DDP in a group of one worker (or a knob).
* ``overhead(m)``: the method's own work (encoding, decoding, the hook's bookkeeping) measured as
  the step time with the method's hook in a group of one worker, where every collective is a
  no-op, minus ``compute`` (:func:`lgc.bench.profile.profile_method`).
* ``decode_per_peer(m)``: methods whose payloads are allgathered decode one payload per worker;
  the decode time measured with one worker is charged again for every other worker.
* Overlap: stateless per-bucket hooks (dense allreduce, the fp16 hooks: nothing held back to the
  step's end) and the hook's ``overlap`` (error feedback over top-k, SBC, EF-signSGD; DGC) communicate
  while the backward pass goes on, except what is issued at the last bucket (its payloads, the
  module buffers, the step guard's agreement: :attr:`MethodProfile.trailing`), which is ready only
  when the backward pass ends: their step is
  ``forward + max(backward, comm of the other buckets) + comm at the last bucket + overhead`` with
  ``backward = backward_share * compute`` (default 2/3). A model in one bucket gains nothing. lgc's
  other stateful compressors, PowerSGD and LGC agree on the whole step at its last bucket
  (:mod:`lgc.ddp.step_guard`) and do not overlap.
* Stragglers: a synchronous step waits for the slowest worker. Where the profile holds compute
  samples (:func:`~lgc.bench.profile.profile_method` keeps them), ``compute`` is the expected maximum of ``P`` draws
  from them (:func:`expected_maximum`); a ``compute_s`` given as a knob has no jitter.

``alpha`` and ``B`` are calibrated by :func:`fit_link` from allreduce and allgather timings on
the shaped network (``lgc-bench network`` does this before its methods), and the model is validated
there against the measured steps. ``lgc-bench model`` (:mod:`lgc.bench.model`) then evaluates it for
ResNet shapes at any number of workers and bandwidth. This module is the model alone: formulas on
recorded collectives, no training and no other benchmark module.

What the model leaves out: congestion beyond one flow per link direction, stragglers, NCCL's
choice of algorithm and protocol per size, LGC-PS's server decoding one payload per worker (its
overhead is measured with one worker), and the leader-to-server message of LGC-PS when the
leader is not the server (a trace recorded with one worker holds no send). The codec overhead is
this machine's CPU time unless ``--codec free`` asks for the communication-only bound.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lgc.ddp.collectives import CollectiveCall

__all__ = [
    "Link",
    "MethodProfile",
    "collective_seconds",
    "comm_seconds",
    "crossover_bandwidth",
    "expected_maximum",
    "fit_link",
    "predict_step",
]

#: Collectives whose time is charged on the sending side only (the receiver's copy is the same message).
_RECEIVE_ONLY = "recv"


@dataclass(frozen=True)
class Link:
    """A worker's network link: ``latency_s`` per message (alpha), ``bytes_per_s`` per direction (1 / beta)."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {self.bytes_per_s!r}")


def _rounds_and_bytes(call: CollectiveCall, world: int, allreduce: str = "ring") -> tuple[int, float]:
    """Sequential message rounds and the bytes on the slowest link of one collective among ``world`` workers."""
    size, rounds_log = call.nbytes, math.ceil(math.log2(world)) if world > 1 else 0
    if world == 1 or call.kind == _RECEIVE_ONLY:
        return 0, 0.0
    if call.kind == "all_reduce":
        if allreduce == "tree":
            return 2 * rounds_log, 2.0 * size
        return 2 * (world - 1), 2 * (world - 1) * math.ceil(size / world)
    if call.kind == "all_gather":
        return world - 1, float((world - 1) * size)
    if call.kind == "reduce_scatter":
        return world - 1, (world - 1) * math.ceil(size / world)
    if call.kind == "all_to_all":  # pairwise: a split to every other rank (balanced splits)
        return world - 1, (world - 1) * math.ceil(size / world)
    if call.kind == "broadcast":
        return rounds_log, float(rounds_log * size)
    if call.kind == "gather":
        return 1, float((world - 1) * size)
    if call.kind == "send":
        return 1, float(size)
    raise ValueError(f"unknown collective kind {call.kind!r}")


def collective_seconds(call: CollectiveCall, world: int, link: Link, allreduce: str = "ring") -> float:
    """Time of one collective among ``world`` workers (table in the module docstring)."""
    if allreduce not in ("ring", "tree"):
        raise ValueError(f"allreduce must be 'ring' or 'tree', got {allreduce!r}")
    rounds, nbytes = _rounds_and_bytes(call, world, allreduce)
    return rounds * link.latency_s + nbytes / link.bytes_per_s


def comm_seconds(trace: Iterable[CollectiveCall], world: int, link: Link, allreduce: str = "ring") -> float:
    """Time of a step's collectives, one after the other (lgc issues them in order on every rank)."""
    return sum(collective_seconds(call, world, link, allreduce) for call in trace)


@dataclass
class MethodProfile:
    """What the model needs to know about one method on one model (:func:`profile_method` measures it)."""

    method: str
    #: Forward + backward + optimizer step without communication, seconds.
    compute_s: float
    #: The method's own work per step with one worker (step with its hook alone - compute), seconds.
    overhead_s: float
    #: Decode time per payload of another worker (methods whose payloads are allgathered), seconds.
    decode_per_peer_s: float
    #: Whether the hook communicates bucket by bucket during the backward pass.
    overlaps_backward: bool
    #: One steady step's collectives, as this worker issued them (``period`` steps' for a local-step method).
    trace: list[CollectiveCall] = field(default_factory=list)
    #: The compute steps measured (for the straggler term); empty when compute is a knob.
    compute_samples_s: list[float] = field(default_factory=list)
    #: How many of the trace's collectives are issued at the step's last bucket (module buffers, the
    #: last bucket's payloads, a step guard's agreement): an overlapping hook cannot hide them.
    trailing: int = 1
    #: How many steps ``trace`` and ``overhead_s`` cover: 1 for a per-step method; a local-step
    #: method's communication delay H (every fragment's exchange once in H steps), so a step costs
    #: compute + (the period's collectives) / H, its exchanges at their share. Streaming DiLoCo's
    #: overlap (``comm.overlap_steps``) is not modelled: its exchanges count as blocking.
    period: int = 1

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "trace": [list(call) for call in self.trace]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MethodProfile:
        return cls(**{**data, "trace": [CollectiveCall(*call) for call in data["trace"]]})


def predict_step(
    profile: MethodProfile,
    world: int,
    link: Link,
    *,
    compute_s: float | None = None,
    codec: bool = True,
    backward_share: float = 2 / 3,
    allreduce: str = "ring",
) -> float:
    """Predicted seconds of one step of ``profile``'s method with ``world`` workers on ``link``.

    Args:
        compute_s: overrides the profile's measured compute (e.g. a GPU's step time).
        codec: include the measured encode/decode overhead (``False``: communication only, the
            bound for an infinitely fast codec).
        backward_share: the backward pass's share of compute, which per-bucket hooks overlap with.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world!r}")
    if not 0 <= backward_share <= 1:
        raise ValueError(f"backward_share must be in [0, 1], got {backward_share!r}")
    if compute_s is not None:
        compute = compute_s
    elif profile.compute_samples_s:
        compute = expected_maximum(profile.compute_samples_s, world)
    else:
        compute = profile.compute_s
    overhead = profile.overhead_s + (world - 1) * profile.decode_per_peer_s if codec else 0.0
    if profile.period < 1:
        raise ValueError(f"a profile's period must be >= 1, got {profile.period!r}")
    if profile.period > 1:
        return compute + comm_seconds(profile.trace, world, link, allreduce) / profile.period + overhead
    if profile.overlaps_backward and profile.trace:
        trailing = min(max(profile.trailing, 1), len(profile.trace))
        before_last = comm_seconds(profile.trace[:-trailing], world, link, allreduce)
        last = comm_seconds(profile.trace[-trailing:], world, link, allreduce)
        backward = backward_share * compute
        return compute - backward + max(backward, before_last) + last + overhead
    return compute + comm_seconds(profile.trace, world, link, allreduce) + overhead


def expected_maximum(samples: Sequence[float], draws: int) -> float:
    """Expected maximum of ``draws`` independent draws from the empirical distribution of ``samples``."""
    ordered = sorted(samples)
    n = len(ordered)
    if n == 0:
        raise ValueError("expected_maximum needs at least one sample")
    return sum(x * (((i + 1) / n) ** draws - (i / n) ** draws) for i, x in enumerate(ordered))


def fit_link(samples: Sequence[tuple[CollectiveCall, int, float]]) -> Link:
    """Alpha and beta from measured collectives: ``(call, world, seconds)`` triples, in two stages.

    Each sample's time is modelled as ``rounds * alpha + bytes / B`` (the formulas above). The
    time per byte comes from the bandwidth-bound half of the samples (those with the most bytes on
    the busiest link; least squares with a latency term), the latency from the other half, as the
    median of ``(seconds - bytes / B) / rounds``. Two stages because a token-bucket shaper (and a
    NIC's burst) passes small messages faster than its rate: one joint fit would let them pull the
    bandwidth up.
    """
    import numpy as np

    points = sorted(
        ((*_rounds_and_bytes(call, world), seconds) for call, world, seconds in samples), key=lambda p: p[1]
    )
    points = [p for p in points if p[0] > 0]
    if len(points) < 2:
        raise ValueError(f"fit_link needs at least 2 samples with communication, got {len(points)}")
    large = points[len(points) // 2 :]
    small = points[: len(points) // 2] or points[:1]
    (_, beta), *_ = np.linalg.lstsq(
        np.array([(rounds, nbytes) for rounds, nbytes, _ in large]), np.array([t for *_, t in large]), rcond=None
    )
    if not beta > 0:
        raise ValueError(f"the samples give a non-positive time per byte ({beta!r}): too few sizes or too noisy")
    alpha = statistics.median((t - nbytes * beta) / rounds for rounds, nbytes, t in small)
    return Link(latency_s=max(float(alpha), 0.0), bytes_per_s=1.0 / float(beta))


def crossover_bandwidth(
    candidate: Callable[[float], float],
    reference: Callable[[float], float],
    low: float = 1e6 / 8,
    high: float = 1e12 / 8,
    points: int = 400,
) -> tuple[str, float | None]:
    """Where on a log grid of bandwidths (bytes/s, ``[low, high]``) ``candidate`` beats ``reference``.

    Returns ``("always", None)``, ``("never", None)``, ``("below", b)`` when it wins up to ``b``
    and loses above (the usual case for a compressor: it pays codec time to save bytes), or
    ``("above", b)`` when it wins from ``b`` up (dense against a codec that costs more than it saves
    on a fast network). Where it wins at both ends but not between, ``("below", b)`` names the end
    of the first winning range.
    """
    grid = [low * (high / low) ** (i / (points - 1)) for i in range(points)]
    wins = [candidate(b) < reference(b) for b in grid]
    if all(wins):
        return "always", None
    if not any(wins):
        return "never", None
    if wins[0]:
        return "below", grid[wins.index(False) - 1]
    return "above", grid[wins.index(True)]
