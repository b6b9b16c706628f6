"""Every method of the matrix in one process on each device: the CPU over gloo, a GPU over NCCL.

The matrix (``tests/test_matrix.py``) proves the methods across ranks on gloo; this runs the same
hooks in a group of one on every device there is (``cuda:0`` over NCCL where a GPU is; CI has
none), with every tensor on that device: each method of the matrix trains ``STEPS`` steps of the
matrix's model (fp32; bf16 too on a GPU), and the test asserts that

* the hook ran every step and every gradient it delivered is finite and on the device;
* an inf injected into one gradient entry is delivered as a non-finite gradient, counted once in
  ``skipped_steps``, and leaves the state as it was;
* a checkpoint taken mid-run (state dict through ``torch.save``/``torch.load`` with
  ``weights_only=True``) resumes exactly into a new DDP model: the same gradients, bitwise, as the
  uninterrupted run, although the new model's first step groups the parameters into other buckets
  (DDP rebuilds its buckets after its first iteration). PowerSGD departs (its state belongs to
  bucket indices: the first step after a restart is a plain allreduce, :mod:`lgc.ddp.powersgd`);
* exact methods equal plain DDP's gradients on the same device.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_matrix import (
    _STATELESS,
    METHODS,
    STEPS,
    Method,
    _compose,
    _flat_state,
    _hook_state,
    _Net,
    _same,
)
from torch.nn.parallel import DistributedDataParallel as DDP

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: The step whose state is checkpointed and resumed from.
RESUME_AFTER = 5
INJECT = 3
#: Methods whose state is keyed by DDP's bucket index: the first step after a restart is a plain
#: allreduce, and the steps after it follow from that one (finite, not the uninterrupted run's).
FIRST_STEP_DENSE_AFTER_RESUME = {"powersgd", "batched_powersgd"}


def _distinct(methods: tuple[Method, ...]) -> list[Method]:
    """The matrix's methods that run differently here: this test injects at its own step and codes a
    bucket as the device does, so rows that differ only in ``inject_step`` or ``bucketed`` are one
    run; the row kept is the one without a forced path, in its last stage."""
    rows: dict[tuple, list[Method]] = {}
    for method in methods:
        rows.setdefault((method.config, method.overrides, method.exact, method.delay), []).append(method)
    kept = {min(same, key=lambda m: (m.bucketed is not None, -m.inject_step)).name for same in rows.values()}
    return [method for method in methods if method.name in kept]


DEVICE_METHODS = _distinct(METHODS)


@pytest.fixture(
    scope="module",
    params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)
def device(request, tmp_path_factory):
    """A process group of one: gloo on the CPU, NCCL on ``cuda:0``."""
    store = tmp_path_factory.mktemp("group") / "store"
    if request.param == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if request.param == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    yield torch.device(request.param, 0) if request.param == "cuda" else torch.device("cpu")
    dist.destroy_process_group()


def _model(dtype: torch.dtype, device: torch.device) -> tuple[_Net, DDP]:
    torch.manual_seed(0)
    net = _Net().to(device=device, dtype=dtype)
    return net, DDP(net, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.002)


def _batch(step: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step)
    return torch.randn(8, 16, generator=g).to(device, dtype), torch.randn(8, 4, generator=g).to(device, dtype)


def _step(
    method: Method, net: _Net, model: DDP, optimizer: torch.optim.Optimizer, state: Any, step: int, inject: bool
) -> list[torch.Tensor]:
    dtype, device = next(net.parameters()).dtype, next(net.parameters()).device
    handle = None
    if inject:

        def poison(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad[0, 0] = float("inf")
            return grad

        handle = net.body[2].weight.register_hook(poison)
    x, target = _batch(step, dtype, device)
    (model(x, True) - target).float().square().mean().backward()
    if handle is not None:
        handle.remove()
    grads = [p.grad.detach().clone() for p in net.parameters()]
    if method.delay or all(bool(torch.isfinite(g).all()) for g in grads):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if method.delay:
        state.after_optimizer_step()
    return grads


def _saved(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("method", DEVICE_METHODS, ids=lambda m: m.name)
def test_method_on_each_device(device, method, dtype):
    if dtype != "fp32" and device.type == "cpu":
        pytest.skip("the matrix covers 16-bit models on the CPU")
    torch_dtype = DTYPES[dtype]
    node, comm = _compose(method)

    def start() -> tuple[_Net, DDP, torch.optim.Optimizer, Any]:
        net, model = _model(torch_dtype, device)
        state = _hook_state(node, comm, net)
        state.register(model)
        return net, model, torch.optim.SGD(model.parameters(), lr=0.05), state

    net, model, optimizer, state = start()
    grads, checkpoint = [], None
    for step in range(STEPS):
        inject = step == INJECT and not method.delay
        before = _flat_state(state.state_dict()) if inject else None
        grads.append(_step(method, net, model, optimizer, state, step, inject))
        finite = all(bool(torch.isfinite(g).all()) for g in grads[-1])
        assert all(g.device == device for g in grads[-1]), f"{method.name}: a gradient left the device"
        if inject:
            assert not finite, f"{method.name}: the injected inf was not delivered"
            after = _flat_state(state.state_dict())
            assert set(after) == set(before), f"{method.name}: a skipped step changed the state's keys"
            changed = [k for k, v in after.items() if not _same(before[k], v)]
            if method.config in _STATELESS:
                changed = [k for k in changed if k != "/iteration"]
            assert not changed, f"{method.name}: a skipped step changed state {changed[:5]}"
        elif not method.delay:
            assert finite, f"{method.name}: step {step}: a gradient is not finite"
        if step == RESUME_AFTER:
            checkpoint = _saved(
                {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "lgc": state.state_dict()}
            )
    assert state.stats.hook_calls >= STEPS, f"{method.name}: the hook ran {state.stats.hook_calls} times"
    assert state.stats.skipped_steps == (0 if method.delay else 1)

    net2, model2, optimizer2, state2 = start()
    net2.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["optimizer"])
    state2.load_state_dict(checkpoint["lgc"])
    for step in range(RESUME_AFTER + 1, STEPS):
        resumed = _step(method, net2, model2, optimizer2, state2, step, inject=False)
        if method.name in FIRST_STEP_DENSE_AFTER_RESUME:
            assert all(bool(torch.isfinite(g).all()) for g in resumed)
            continue
        for i, (a, b) in enumerate(zip(resumed, grads[step], strict=True)):
            assert torch.equal(a, b), f"{method.name}: step {step}: gradient {i} differs after resume"

    if method.exact is not None and not method.delay:
        plain_net, plain = _model(torch_dtype, device)
        hooked_net, hooked = _model(torch_dtype, device)
        hooked_state = _hook_state(node, comm, hooked_net)
        hooked_state.register(hooked)
        for step in range(3):
            x, target = _batch(step, torch_dtype, device)
            for m in (plain, hooked):
                (m(x, True) - target).float().square().mean().backward()
            for a, b in zip(hooked_net.parameters(), plain_net.parameters(), strict=True):
                scale = float(b.grad.abs().max())
                tol = max(method.exact, 1e-2 if dtype == "bf16" else 1e-5)
                torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol * scale + 1e-6)
