"""A method's own cost, measured in a group of one worker: overhead, decode per peer, collectives.

What the cost model (:mod:`lgc.bench.cost_model`) takes as input for each method
(:class:`~lgc.bench.cost_model.MethodProfile`): ``lgc-bench model`` profiles ResNet shapes here,
``lgc-bench network`` every worker's method before training.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

from lgc.bench.cost_model import MethodProfile
from lgc.bench.methods import sgd_for

__all__ = ["profile_method"]


def profile_method(
    module: Any,
    method: str,
    batches: Callable[[], tuple[Any, Any]],
    *,
    knobs: dict[str, Any] | None = None,
    steps: int = 8,
    group: Any = None,
    loss: Callable[[Any, Any], Any] | None = None,
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

    A local-step method (communication delay H) is measured over a whole number of its periods
    (``steps`` rounded up to a multiple of H): ``overhead_s`` is then the mean of the differences,
    its exchanges at their share, and the collectives of the last H steps are recorded (every
    fragment's exchange once), with ``period`` H.

    ``loss(output, target)``: the training loss (cross-entropy over the output by default).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lgc
    from lgc.ddp.collectives import record_collectives

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if dist.get_world_size(group) != 1:
        raise ValueError(f"profile_method needs a group of one worker, got {dist.get_world_size(group)}")
    knobs = dict(knobs or {})
    model = DistributedDataParallel(copy.deepcopy(module), process_group=group)
    optimizer = sgd_for(method, model, lr=1e-3)
    loss_fn = loss if loss is not None else torch.nn.CrossEntropyLoss()

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
    period = int(getattr(state, "delay", 1)) if state.takes_local_steps else 1
    steps = -(-steps // period) * period
    for _ in range(state.steady_from() + 2):
        step(model, optimizer)
    for _ in range(2):
        step(plain, plain_optimizer)
    codec = state.codec_times()
    decode_before = dict(codec) if codec is not None else None
    # Pairs of a plain step and the method's step, alternating, so a change of load hits both; the
    # method's collectives recorded over the last period (one step for a per-step method).
    compute, extra = [], []

    def pair() -> None:
        plain_s = step(plain, plain_optimizer)
        compute.append(plain_s)
        extra.append(step(model, optimizer) - plain_s)

    for _ in range(steps - period):
        pair()
    with record_collectives() as trace:
        for _ in range(period):
            pair()
    gathers = state.gathers_payloads()
    decode_per_peer = 0.0
    if gathers and codec is not None and decode_before is not None:
        decode_per_peer = (codec["decode"] - decode_before["decode"]) / steps
    return MethodProfile(
        method=method,
        compute_s=statistics.median(compute),
        overhead_s=max(0.0, statistics.median(extra) if period == 1 else statistics.fmean(extra)),
        decode_per_peer_s=decode_per_peer,
        overlaps_backward=state.overlaps_backward,
        trace=list(trace),
        compute_samples_s=compute,
        # Only a per-step method's last bucket can trail a backward pass (a period's trace is blocking).
        trailing=len(trace) - trace.last_bucket_from if trace.last_bucket_from is not None and period == 1 else 1,
        period=period,
    )
