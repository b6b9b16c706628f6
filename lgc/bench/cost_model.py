"""``lgc-bench model``: an alpha-beta model of one data-parallel step, to answer "will this method help on my cluster?".

A step of method ``m`` with ``P`` workers on links of latency ``alpha`` and bandwidth ``B``
(bytes per second per direction, what one worker's link carries) costs

    ``compute + overhead(m) + (P - 1) * decode_per_peer(m) + sum over collectives of T(call, P)``

where the collectives are the ones the method's hook really issues in one steady step (recorded by
:func:`lgc.ddp.collectives.record_collectives`, with their per-worker sizes, which do not depend on
``P`` for any lgc method) and ``T`` follows the algorithm the backend runs (:mod:`lgc.ddp.wire`):

=============  =========================================  ==============================================
collective     algorithm                                  T(call, P) for a message of ``L`` bytes
=============  =========================================  ==============================================
allreduce      ring (gloo; NCCL for large messages)       ``2 (P - 1) (alpha + ceil(L / P) / B)``
               double binary tree (``allreduce="tree"``)  ``2 ceil(log2 P) alpha + 2 L / B`` (pipelined)
allgather      ring                                       ``(P - 1) (alpha + L / B)``
broadcast      gloo's binomial tree                       ``ceil(log2 P) (alpha + L / B)``
gather         flat, to the root                          ``alpha + (P - 1) L / B`` (the root's link)
send / recv    point to point                             ``alpha + L / B`` (counted once, at the sender)
=============  =========================================  ==============================================

* ``compute``: the step on an infinitely fast network: forward, backward, DDP's bucket copies and
  the optimizer, measured as plain DDP in a group of one worker (or a knob).
* ``overhead(m)``: the method's own work (encoding, decoding, the hook's bookkeeping) measured as
  the step time with the method's hook in a group of one worker, where every collective is a
  no-op, minus ``compute`` (:func:`profile_method`).
* ``decode_per_peer(m)``: methods whose payloads are allgathered decode one payload per worker;
  the decode time measured with one worker is charged again for every other worker.
* Overlap: stateless per-bucket hooks (dense allreduce, the fp16 hooks: nothing held back to the
  step's end) communicate while the backward pass goes on, except the last bucket's, which is
  ready only when the backward pass ends: their step is
  ``forward + max(backward, comm of the other buckets) + comm of the last bucket + overhead`` with
  ``backward = backward_share * compute`` (default 2/3). A model in one bucket gains nothing. lgc's
  stateful compressors, PowerSGD and LGC agree on the whole step at its last bucket
  (:mod:`lgc.ddp.step_guard`) and do not overlap.
* Stragglers: a synchronous step waits for the slowest worker. Where the profile holds compute
  samples (:func:`profile_method` keeps them), ``compute`` is the expected maximum of ``P`` draws
  from them (:func:`expected_maximum`); a ``compute_s`` given as a knob has no jitter.

``alpha`` and ``B`` are calibrated by :func:`fit_link` from allreduce and allgather timings on
the shaped network (``lgc-bench network`` does this before its methods), and the model is validated
there against the measured steps. ``lgc-bench model`` (:func:`run`) then evaluates it for ResNet
shapes at any number of workers and bandwidth, and finds the bandwidths at which a method beats
the fp16 hook and dense fp32 (``< X``: below X; ``> X``: above X; always; never).

What the model leaves out: congestion beyond one flow per link direction, stragglers, NCCL's
choice of algorithm and protocol per size, LGC-PS's server decoding one payload per worker (its
overhead is measured with one worker), and the leader-to-server message of LGC-PS when the
leader is not the server (a trace recorded with one worker holds no send). The codec overhead is
this machine's CPU time unless ``--codec free`` asks for the communication-only bound.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lgc.ddp.collectives import CollectiveCall

__all__ = [
    "Link",
    "MethodProfile",
    "add_arguments",
    "collective_seconds",
    "comm_seconds",
    "crossover_bandwidth",
    "expected_maximum",
    "fit_link",
    "predict_step",
    "profile_knobs",
    "profile_method",
    "run",
    "steady_from",
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
    #: One steady step's collectives, as this worker issued them.
    trace: list[CollectiveCall] = field(default_factory=list)
    #: The compute steps measured (for the straggler term); empty when compute is a knob.
    compute_samples_s: list[float] = field(default_factory=list)

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
    if profile.overlaps_backward and profile.trace:
        before_last = comm_seconds(profile.trace[:-1], world, link, allreduce)
        last = collective_seconds(profile.trace[-1], world, link, allreduce)
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


def steady_from(state: Any, steps_per_epoch: int = 1) -> int:
    """The first step at which ``state``'s method sends what it will send for the rest of the run.

    Counts the stages every method has before its steady state: the hook's plain-allreduce
    iterations (``start_iter``), PowerSGD's dense iterations, LGC's warm-up and autoencoder
    training, and DGC's density warm-up epochs (``steps_per_epoch`` each, unless DGC was given
    its own).
    """
    from lgc.compressors.base import compressor_chain

    first = int(getattr(state, "start_iter", 0) or 0)
    options = getattr(state, "options", None)
    if isinstance(options, dict):
        first = max(first, int(options.get("start_powerSGD_iter", 0)))
    first = max(first, int(getattr(state, "warmup_steps", 0) or 0) + int(getattr(state, "ae_steps", 0) or 0))
    for part in compressor_chain(getattr(state, "compressor", None)):
        warmup = getattr(part, "warmup_densities", None)
        if warmup:
            first = max(first, len(warmup) * (getattr(part, "steps_per_epoch", None) or steps_per_epoch))
    return first


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


# -- measuring a method --------------------------------------------------------------------------
def profile_method(
    module: Any,
    method: str,
    batches: Callable[[], tuple[Any, Any]],
    *,
    knobs: dict[str, Any] | None = None,
    steps: int = 8,
    group: Any = None,
) -> MethodProfile:
    """Measure ``method``'s overhead, decode cost and collectives on ``module`` in a group of one worker.

    ``group`` must hold this process alone (a world of one, or ``dist.new_group([rank])``), so
    every collective is a no-op and the step time is compute + the method's own work. A copy of
    ``module`` is trained (the caller's model is not touched) through the method's stages (LGC's
    warm-up and autoencoder training, DGC's density warm-up: epoch 1000 is announced), then
    ``steps`` of its steps alternate with steps of plain DDP (no hook) on another copy in the same
    group: ``compute_s`` is the plain step's median (forward, backward, DDP's bucket copies and the
    optimizer: everything a step costs on an infinitely fast network), ``overhead_s`` the median of
    the paired differences. The collectives of the last step are recorded.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lgc
    from lgc.bench.network_worker import sgd_for
    from lgc.compressors.base import CombineMode
    from lgc.ddp.collectives import record_collectives

    if dist.get_world_size(group) != 1:
        raise ValueError(f"profile_method needs a group of one worker, got {dist.get_world_size(group)}")
    knobs = dict(knobs or {})
    model = DistributedDataParallel(copy.deepcopy(module), process_group=group)
    optimizer = sgd_for(method, model, lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()

    # Plain DDP on the same group: forward, backward, DDP's bucket copies and the optimizer.
    plain = DistributedDataParallel(copy.deepcopy(module), process_group=group)
    plain_optimizer = sgd_for(method, plain, lr=1e-3)

    def step(ddp: Any, opt: Any) -> float:
        x, y = batches()
        started = time.perf_counter()
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - started

    state = lgc.compress(model, method, optimizer=optimizer, process_group=group, **knobs)
    state.set_epoch(1000)
    for _ in range(steady_from(state) + 2):
        step(model, optimizer)
    for _ in range(2):
        step(plain, plain_optimizer)
    codec = state.codec_times()
    decode_before = dict(codec) if codec is not None else None
    # Pairs of a plain step and the method's step, alternating, so a change of load hits both.
    compute, extra = [], []
    for index in range(steps):
        plain_s = step(plain, plain_optimizer)
        if index == steps - 1:
            with record_collectives() as trace:
                method_s = step(model, optimizer)
        else:
            method_s = step(model, optimizer)
        compute.append(plain_s)
        extra.append(method_s - plain_s)
    gathers = getattr(getattr(state, "compressor", None), "combine", None) is CombineMode.GATHER
    decode_per_peer = 0.0
    if gathers and codec is not None and decode_before is not None:
        decode_per_peer = (codec["decode"] - decode_before["decode"]) / steps
    return MethodProfile(
        method=method,
        compute_s=statistics.median(compute),
        overhead_s=max(0.0, statistics.median(extra)),
        decode_per_peer_s=decode_per_peer,
        overlaps_backward=getattr(state, "guards_steps", True) is False,
        trace=list(trace),
        compute_samples_s=compute,
    )


# -- lgc-bench model ------------------------------------------------------------------------------
#: Compute per step assumed when ``--compute-ms`` is not given: 100 ms for ResNet-50 at batch 32
#: (a V100-class GPU in fp32; set your own), other models scaled by their forward FLOPs
#: (torchvision's model cards: ResNet-50 4.09 GFLOPs, ResNet-101 7.80, ResNet-18 1.81).
DEFAULT_COMPUTE_MS = {"resnet18": 100 * 1.81 / 4.09, "resnet50": 100.0, "resnet101": 100 * 7.80 / 4.09}


def profile_knobs(density: float = 0.001) -> dict[str, dict[str, Any]]:
    """Knobs that reach each method's steady state within a profile's few steps, sparsifiers at ``density``."""
    from lgc.bench.network import short_run_knobs

    knobs = short_run_knobs(density, warmup_steps=1, ae_steps=2)
    return {**knobs, "sbc": {"density": density}, "powersgd": {"start_powerSGD_iter": 2}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lgc.bench.network import DEFAULT_METHODS

    parser.add_argument("--model", default="resnet50", help="comma-separated: resnet18, resnet50, resnet101")
    parser.add_argument("--workers", default="8,64,512", help="comma-separated worker counts (default 8,64,512)")
    parser.add_argument(
        "--bandwidth", default="1gbit,10gbit,100gbit", help="comma-separated link rates in tc syntax (per direction)"
    )
    parser.add_argument("--latency", default="25us", help="alpha: time per message, tc syntax (default 25us)")
    parser.add_argument("--allreduce", default="ring", choices=("ring", "tree"), help="allreduce algorithm")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated lgc.compress methods")
    parser.add_argument(
        "--compute-ms", type=float, default=None, help="compute per step (default: 100 ms for ResNet-50, by FLOPs)"
    )
    parser.add_argument(
        "--codec",
        default="measured",
        choices=("measured", "free"),
        help="measured: this machine's CPU encode/decode time; free: communication only",
    )
    parser.add_argument("--profiles", type=Path, default=None, help="JSON cache of profiles (read, then written)")
    parser.add_argument("--out", type=Path, default=None, help="write model.md, model.json and model.png here")


def _profiles(models: list[str], methods: list[str], cache: Path | None) -> dict[str, dict[str, MethodProfile]]:
    """Every (model, method) profile, from ``cache`` where it has them, else measured here (one process)."""
    import os

    import torch
    import torch.distributed as dist

    from lgc.models.torchvision_resnet import torchvision_resnet

    stored: dict[str, dict[str, Any]] = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    profiles = {m: {k: MethodProfile.from_json(v) for k, v in stored.get(m, {}).items()} for m in models}
    missing = [(m, method) for m in models for method in methods if method not in profiles[m]]
    if missing:
        started_group = not dist.is_initialized()
        scratch = tempfile.TemporaryDirectory(prefix="lgc-bench-model-")
        if started_group:
            store = f"file://{os.path.join(scratch.name, 'store')}"
            dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        try:
            generator = torch.Generator().manual_seed(0)
            for name, method in missing:
                # ImageNet shapes (1,000 classes, the ImageNet stem) on small images: the gradients
                # have the real model's sizes while compute stays cheap (compute is a knob here).
                module = torchvision_resnet(int(name.removeprefix("resnet")), num_classes=1000, stem="imagenet")

                def batches(generator: torch.Generator = generator) -> tuple[torch.Tensor, torch.Tensor]:
                    return torch.randn(4, 3, 32, 32, generator=generator), torch.randint(
                        1000, (4,), generator=generator
                    )

                started = time.perf_counter()
                profiles[name][method] = profile_method(
                    module, method, batches, knobs=profile_knobs().get(method, {}), steps=5
                )
                print(f"profiled {name} {method}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        finally:
            if started_group:
                dist.destroy_process_group()
            scratch.cleanup()
        if cache is not None:
            merged = {m: {k: p.to_json() for k, p in per.items()} for m, per in profiles.items()}
            cache.write_text(json.dumps({**stored, **merged}))
    return profiles


def _format_ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}" if seconds >= 0.0995 else f"{1000 * seconds:.1f}"


def _format_crossing(crossing: tuple[str, float | None] | None) -> str:
    if crossing is None:
        return "-"
    side, bytes_per_s = crossing
    if bytes_per_s is None:
        return side
    bits = 8 * bytes_per_s
    rate = f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"
    return f"{'<' if side == 'below' else '>'} {rate}"


def run(args: argparse.Namespace) -> None:
    from lgc.api import METHODS
    from lgc.bench.netns import parse_delay, parse_rate
    from lgc.bench.network import parse_list

    try:
        models = parse_list(args.model, "model")
        if any(m not in DEFAULT_COMPUTE_MS for m in models):
            raise ValueError(f"--model must name some of {sorted(DEFAULT_COMPUTE_MS)}, got {args.model!r}")
        workers = [int(w) for w in parse_list(args.workers, "workers")]
        if min(workers) < 1:
            raise ValueError(f"--workers must be positive integers, got {args.workers!r}")
        rates = [(text, parse_rate(text) / 8) for text in parse_list(args.bandwidth, "bandwidth")]
        latency = parse_delay(args.latency) / 1e6
        methods = parse_list(args.methods, "methods")
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; known: {sorted(METHODS)}")
        if args.compute_ms is not None and not args.compute_ms > 0:
            raise ValueError(f"--compute-ms must be > 0, got {args.compute_ms!r}")
    except ValueError as error:
        sys.exit(f"lgc-bench model: {error}")
    profiles = _profiles(models, methods, args.profiles)
    codec = args.codec == "measured"
    text = [
        f"# lgc-bench model: step time (ms), alpha {latency * 1e6:g} us, {args.allreduce} allreduce, "
        f"codec {'measured on this CPU' if codec else 'free (communication only)'}\n"
    ]
    results: dict[str, Any] = {}
    for name in models:
        compute = (args.compute_ms if args.compute_ms is not None else DEFAULT_COMPUTE_MS[name]) / 1000
        per_method = profiles[name]

        def predict(
            method: str,
            world: int,
            bytes_per_s: float,
            compute: float = compute,
            per_method: dict[str, MethodProfile] = per_method,
        ) -> float:
            return predict_step(
                per_method[method],
                world,
                Link(latency, bytes_per_s),
                compute_s=compute,
                codec=codec,
                allreduce=args.allreduce,
            )

        columns = [(w, label, rate) for w in workers for label, rate in rates]
        header = "| method | " + " | ".join(f"{w} x {label}" for w, label, _ in columns)
        header += " | " + " | ".join(f"beats fp16 at ({w})" for w in workers)
        header += " | " + " | ".join(f"beats dense at ({w})" for w in workers) + " |"
        lines = [
            f"## {name} (compute {1000 * compute:.0f} ms per step)\n",
            header,
            "|" + "---|" * (header.count("|") - 1),
        ]
        table: dict[str, Any] = {}
        for method in methods:
            steps = {f"{w}x{label}": predict(method, w, rate) for w, label, rate in columns}
            crossings = {}
            for reference in ("torch_fp16", "none"):
                for w in workers:
                    crossings[f"{reference}@{w}"] = (
                        None
                        if reference not in per_method or reference == method
                        else crossover_bandwidth(
                            lambda b, m=method, w=w: predict(m, w, b), lambda b, r=reference, w=w: predict(r, w, b)
                        )
                    )
            table[method] = {"step_s": steps, "crossover_bytes_per_s": crossings}
            cells = [_format_ms(steps[f"{w}x{label}"]) for w, label, _ in columns]
            cells += [_format_crossing(crossings[f"torch_fp16@{w}"]) for w in workers]
            cells += [_format_crossing(crossings[f"none@{w}"]) for w in workers]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        text.append("\n".join(lines) + "\n")
        results[name] = {"compute_s": compute, "methods": table}
    report = "\n".join(text)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "model.md").write_text(report + "\n")
        arguments = {k: str(v) for k, v in vars(args).items()}
        profiles_json = {m: {k: p.to_json() for k, p in per.items()} for m, per in profiles.items()}
        (args.out / "model.json").write_text(
            json.dumps({"arguments": arguments, "results": results, "profiles": profiles_json}, default=str)
        )
        _plot(models, workers, methods, profiles, latency, codec, args, args.out / "model.png")
        print(f"wrote {args.out / 'model.md'}, model.json and model.png")


def _plot(
    models: list[str],
    workers: list[int],
    methods: list[str],
    profiles: dict[str, dict[str, MethodProfile]],
    latency: float,
    codec: bool,
    args: argparse.Namespace,
    path: Path,
) -> None:
    import matplotlib

    from lgc.bench.network import method_color

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(models), len(workers), figsize=(5 * len(workers), 4 * len(models)), squeeze=False)
    grid = [1e8 / 8 * (1e4 ** (i / 99)) for i in range(100)]  # 100 Mbit/s .. 1 Tbit/s
    for row, name in enumerate(models):
        compute = (args.compute_ms if args.compute_ms is not None else DEFAULT_COMPUTE_MS[name]) / 1000
        for column, world in enumerate(workers):
            axis = axes[row][column]
            for index, method in enumerate(methods):
                times = [
                    predict_step(
                        profiles[name][method],
                        world,
                        Link(latency, b),
                        compute_s=compute,
                        codec=codec,
                        allreduce=args.allreduce,
                    )
                    for b in grid
                ]
                style = "--" if method in ("none", "torch_fp16") else "-"
                color = method_color(index)
                axis.plot([8 * b / 1e9 for b in grid], [1000 * t for t in times], style, color=color, label=method)
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.set_title(f"{name}, {world} workers")
            axis.set_xlabel("link bandwidth (Gbit/s)")
            axis.set_ylabel("predicted step (ms)")
            axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
