"""The test matrix's FSDP2 rows: every per-step method FSDP2 runs, through the configurations users have.

Each method of the DDP matrix (``tests/test_matrix.py``) whose hook state FSDP2's compressed
reduce-scatter runs is crossed, on two gloo workers and a model sharded in four parameter groups
(``fully_shard`` on three layers and the root, a branch in the root's group), with

* precision: fp32, and FSDP2's ``MixedPrecisionPolicy`` with bf16 parameters reduced in fp32 or bf16;
* features: a branch unused on all ranks or on one rank, gradient accumulation
  (``set_requires_gradient_sync(False)`` on all but the last micro-batch), an inf or a NaN in one
  layer's gradient on one rank at one step.

What every case asserts:

* fp32 (except an injected inf/NaN, whose DDP twin poisons a parameter's gradient where this one
  poisons an activation's, and the quantizers, which code each rank's chunk on its own): the weights
  and the compressor state are bitwise those of the DDP hook running the same method on the same
  batches;
* an injected inf/NaN counts one skipped step, changes no compressor state, and the run is bitwise a
  run in which the step never happened;
* a parameter unused on every rank keeps its compressor state;
* ``none`` equals stock FSDP2 with the same precision policy, bit for bit, and a method that is plain
  averaging up to its rounding (fp16, bf16, top-k and random-block at density 1) makes stock FSDP2's
  weight updates to that rounding, in bf16 too; every run stays finite.

The methods FSDP2 refuses (hook states with collectives of their own, communication delay, overlap,
state that cannot be held back) are refused before any worker starts, with a message naming them:
:func:`test_what_fsdp2_refuses_is_refused_naming_it`. The default suite runs a covering sample (every
config with bf16 parameters, an inf or a NaN and an unused parameter); ``pytest -m slow`` the full product.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, NamedTuple

import pytest
import test_matrix as ddp_matrix
import torch
from distributed import run_workers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lgc.compressors import ErrorFeedback
from lgc.compressors.segments import CodesBuckets
from lgc.fsdp import check_sharded, register_sharded
from lgc.fsdp.reduce_scatter import codes_shards

pytestmark = pytest.mark.multiprocess

STEPS = ddp_matrix.STEPS
PRECISIONS = ("fp32", "bf16_fp32", "bf16")
FEATURES = ("plain", "unused_all", "unused_one", "accumulate", "inf", "nan")
#: DGC's weight decay needs every parameter whole (refused under FSDP2): the optimizer's, here none.
_FSDP_OVERRIDES = frozenset({"dgc"})


def _node_and_comm(method: ddp_matrix.Method) -> tuple[dict, dict]:
    node, comm = ddp_matrix._compose(method)
    if method.config in _FSDP_OVERRIDES:
        node["weight_decay"] = 0.0
    return node, comm


def _refusal(method: ddp_matrix.Method) -> str | None:
    """Why ``lgc-train strategy=fsdp`` refuses ``method`` before any worker starts (its message), or None where
    it runs it: :func:`lgc.train.check_strategy`, the check every run takes."""
    from omegaconf import OmegaConf

    from lgc.methods import build_hook_state
    from lgc.train import check_strategy

    node, comm = _node_and_comm(method)
    run = {"strategy": {"name": "fsdp"}, "trainer": {"precision": 32}, "comm": comm, "compressor": node}
    cfg = OmegaConf.create(run)
    try:
        check_strategy(cfg, build_hook_state(OmegaConf.create(node), OmegaConf.create(comm)), 2, 2, False)
    except ValueError as err:
        return str(err)
    return None


FSDP_METHODS = tuple(m for m in ddp_matrix.METHODS if _refusal(m) is None)


def _codes_shards(method: ddp_matrix.Method) -> bool:
    """Whether FSDP2 codes ``method``'s chunks on their own (a quantizer): its run then differs from the DDP hook's
    by design (``tests/fsdp/test_fsdp.py`` holds it to a transcription)."""
    from omegaconf import OmegaConf

    from lgc.methods import build_hook_state

    node, comm = _node_and_comm(method)
    return codes_shards(build_hook_state(OmegaConf.create(node), OmegaConf.create(comm)).compressor)


class Case(NamedTuple):
    method: ddp_matrix.Method
    precision: str
    feature: str

    @property
    def id(self) -> str:
        return f"fsdp-{self.method.name}-{self.precision}-{self.feature}"

    @property
    def injected(self) -> bool:
        return self.feature in ("inf", "nan")


ALL_CASES = [Case(m, p, f) for m, p, f in itertools.product(FSDP_METHODS, PRECISIONS, FEATURES)]


#: What every compressor config FSDP2 runs meets in the default suite: bf16 parameters (either reduce
#: dtype), an injected inf or NaN, and a parameter unused on every rank.
PER_CONFIG = ("bf16", "inject", "unused_all")


def _covered(cases: list[Case], config: str) -> set[str]:
    """Which of :data:`PER_CONFIG` the cases of ``config`` cover."""
    seen = set()
    for case in (c for c in cases if c.method.config == config):
        seen |= {"bf16" if case.precision != "fp32" else "fp32", "inject" if case.injected else case.feature}
    return seen & set(PER_CONFIG)


def _covering_sample(size: int, seed: int = 0) -> list[Case]:
    """Every method once, features in turn and precisions rotated against them; then every config's missing
    :data:`PER_CONFIG` (bf16 paired with an inf or a NaN, or an unused parameter) on its first row; padded at
    random to ``size``."""
    rng = random.Random(seed)
    chosen = [
        Case(m, PRECISIONS[(i + i // len(FEATURES)) % len(PRECISIONS)], FEATURES[i % len(FEATURES)])
        for i, m in enumerate(FSDP_METHODS)
    ]
    for i, config in enumerate(dict.fromkeys(m.config for m in FSDP_METHODS)):
        method = next(m for m in FSDP_METHODS if m.config == config)
        missing = set(PER_CONFIG) - _covered(chosen, config)
        features = [("inf", "nan")[i % 2] if f == "inject" else f for f in ("inject", "unused_all") if f in missing]
        precisions = [("bf16", "bf16_fp32")[i % 2]] if "bf16" in missing else []
        for j in range(max(len(features), len(precisions))):
            precision = precisions[j] if j < len(precisions) else "fp32"
            chosen.append(Case(method, precision, features[j] if j < len(features) else "plain"))
    chosen += rng.sample([c for c in ALL_CASES if c not in chosen], max(0, size - len(chosen)))
    return chosen


SAMPLE = _covering_sample(0)


# -- the worker side --------------------------------------------------------------------------------


def _policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "fp32":
        return MixedPrecisionPolicy()
    reduce = torch.float32 if precision == "bf16_fp32" else torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def _sharded(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    net = ddp_matrix._Net()
    policy = _policy(case.precision)
    for module in (net.body[0], net.body[2], net.head):
        fully_shard(module, mp_policy=policy)
    fully_shard(net, mp_policy=policy)  # the aux branch reduces with the root's group
    if case.feature == "unused_one":
        net.set_reduce_scatter_unused_params(True)  # what FSDP2 needs when ranks use different parameters
    return net


def _poisoning(case: Case, net: torch.nn.Module, step: int, rank: int) -> Any:
    """An inf/NaN in the gradient of body[2]'s output on rank 1 at the injection step (a loss-scale overflow)."""
    if not (case.injected and step == case.method.inject_step and rank == 1):
        return None
    bad = float("inf") if case.feature == "inf" else float("nan")

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = bad
        return grad

    def on_output(_module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        out.register_hook(poison)

    return net.body[2].register_forward_hook(on_output)


def _backward(case: Case, net: torch.nn.Module, step: int, rank: int) -> None:
    """The DDP matrix's batches (``no_sync``'s two micro-batches for accumulation), through the sharded model."""
    handle = _poisoning(case, net, step, rank)
    micro = 2 if case.feature == "accumulate" else 1
    for m in range(micro):
        g = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
        x, target = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        net.set_requires_gradient_sync(m == micro - 1)
        use_aux = ddp_matrix._uses_aux(case.feature if case.feature != "accumulate" else "plain", step, rank)
        loss = (net(x, use_aux) - target).float().square().mean()
        loss.backward()
    if handle is not None:
        handle.remove()


def _train(case: Case, node: dict, comm: dict, rank: int, *, compressed: bool, omit_step: int | None) -> dict:
    """Train the sharded model through the method (``compressed``) or through stock FSDP2."""
    from omegaconf import OmegaConf

    from lgc.methods import build_hook_state

    net = _sharded(case)
    state = None
    if compressed:
        # lgc.compress's own route for an FSDP2 model: its refusals, then its registration.
        state = build_hook_state(OmegaConf.create(node), OmegaConf.create(comm))
        check_sharded(state, case.method.config, hybrid=False)
        if case.method.bucketed is not None:
            assert isinstance(state.compressor, ErrorFeedback | CodesBuckets)
            state.compressor.bucketed = case.method.bucketed
        register_sharded(state, net, None)
    initial = {name: p.full_tensor().detach().clone() for name, p in net.named_parameters()}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    states, nonfinite = {}, []
    for step in range(STEPS):
        if step == omit_step:
            continue
        if state is not None and step in (case.method.guard_step, 4):
            states[f"before{step}"] = ddp_matrix._flat_state(state.state_dict())
        _backward(case, net, step, rank)
        finite = all(p.grad is None or bool(torch.isfinite(p.grad.to_local()).all()) for p in net.parameters())
        nonfinite.append(not finite)
        if finite:  # what GradScaler does
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if state is not None and step in (case.method.guard_step, 4):
            states[f"after{step}"] = ddp_matrix._flat_state(state.state_dict())
    return {
        "initial": initial,
        "params": {name: p.full_tensor().detach().clone() for name, p in net.named_parameters()},
        "nonfinite": nonfinite,
        "states": states,
        "skipped_steps": None if state is None else state.stats.skipped_steps,
    }


def _ddp_twin(case: Case, node: dict, comm: dict, rank: int) -> dict:
    """The DDP hook's run of the same method and batches (the DDP matrix's ``_train``)."""
    feature = "no_sync" if case.feature == "accumulate" else case.feature
    run = ddp_matrix._train(
        ddp_matrix.Case(case.method, "fp32", feature), node, comm, rank, reference=False, omit_step=None
    )
    return {"params": dict(zip(run["names"], run["params"], strict=True)), "states": run["states"]}


def _worker(rank: int, world: int, jobs: list[tuple[Case, dict, dict]]) -> list[dict]:
    results = []
    for case, node, comm in jobs:
        try:
            result: dict[str, Any] = {"run": _train(case, node, comm, rank, compressed=True, omit_step=None)}
            if case.injected:
                result["omitted"] = _train(case, node, comm, rank, compressed=True, omit_step=case.method.inject_step)
            elif case.precision == "fp32" and not _codes_shards(case.method):
                result["ddp"] = _ddp_twin(case, node, comm, rank)
            if case.method.name == "none" or (case.method.exact is not None and not case.injected):
                result["stock"] = _train(case, node, comm, rank, compressed=False, omit_step=None)
        except Exception as err:
            raise RuntimeError(f"{case.id}: {type(err).__name__}: {err}") from err
        results.append(result)
    return results


# -- the launching side ------------------------------------------------------------------------------


def _check(case: Case, result: dict, rank: int) -> None:
    method, run = case.method, result["run"]
    for step, bad in enumerate(run["nonfinite"]):
        expected = case.injected and step == method.inject_step
        assert bad == expected, f"{case.id}: rank {rank} step {step}: non-finite={bad}, expected {expected}"
    assert all(bool(torch.isfinite(p).all()) for p in run["params"].values()), f"{case.id}: weights not finite"
    assert run["skipped_steps"] == int(case.injected), f"{case.id}: skipped_steps={run['skipped_steps']}"
    if case.injected:
        step = method.guard_step
        before, after = run["states"][f"before{step}"], run["states"][f"after{step}"]
        changed = [k for k in before.keys() | after.keys() if not ddp_matrix._same(before.get(k), after.get(k))]
        if method.config in ddp_matrix._STATELESS:
            changed = [k for k in changed if k != "/iteration"]
        assert not changed, f"{case.id}: rank {rank}: a skipped step changed state {changed[:5]}"
        for name, p in run["params"].items():
            assert torch.equal(p, result["omitted"]["params"][name]), f"{case.id}: {name} differs from a run without it"
    if case.feature == "unused_all":
        before, after = run["states"]["before4"], run["states"]["after4"]
        aux = [k for k in before if "aux." in k]
        assert bool(aux) != (method.config in ddp_matrix._STATELESS), f"{case.id}: state keys {list(before)}"
        moved = [k for k in aux if not ddp_matrix._same(before[k], after.get(k))]
        assert not moved, f"{case.id}: rank {rank}: state of unused parameters changed: {moved}"
    if "ddp" in result:
        twin = result["ddp"]
        for name, p in run["params"].items():
            assert torch.equal(p, twin["params"][name]), f"{case.id}: rank {rank}: {name} differs from the DDP hook's"
        mine, theirs = run["states"]["after4"], twin["states"]["after4"]
        differs = [k for k in theirs if not ddp_matrix._same(mine.get(k), theirs[k])]
        assert not differs, f"{case.id}: rank {rank}: state differs from the DDP hook's at {differs[:5]}"
    if "stock" in result and method.name == "none":
        for name, p in run["params"].items():
            assert torch.equal(p, result["stock"]["params"][name]), f"{case.id}: {name} differs from stock FSDP2"
    elif "stock" in result:
        # A method that is plain averaging up to its rounding (fp16, bf16, top-k and random-block at density 1):
        # its weight updates are stock FSDP2's with the same precision policy, to that rounding (of the largest
        # update; in these runs they are equal bit for bit: bf16 gradients halved fit fp16 exactly).
        stock = result["stock"]
        tol = max(method.exact, 1e-6)
        for name, p in run["params"].items():
            ours, theirs = p - run["initial"][name], stock["params"][name] - stock["initial"][name]
            scale = float(theirs.abs().max())
            assert scale > 0, f"{case.id}: {name} never moved"
            torch.testing.assert_close(
                ours.float(), theirs.float(), rtol=0, atol=tol * scale, msg=lambda m, n=name: f"{case.id} {n}: {m}"
            )


def _run_cases(cases: list[Case]) -> None:
    jobs = [(case, *_node_and_comm(case.method)) for case in cases]
    results = run_workers(_worker, 2, jobs)
    for i, case in enumerate(cases):
        for rank in range(2):
            _check(case, results[rank][i], rank)


def test_what_fsdp2_refuses_is_refused_naming_it():
    """Every method of the DDP matrix either runs under FSDP2 or is refused before any worker starts with a message
    that names its setting: overlap, local steps, LGC's family (hybrid sharding only), PyTorch's DDP hooks."""
    refused = {m: _refusal(m) for m in ddp_matrix.METHODS if m not in FSDP_METHODS}
    assert {"none", "topk", "dgc", "sbc", "qsgd", "fp16", "demo", "chunked_topk"} <= {m.name for m in FSDP_METHODS}
    assert {"lgc_rar", "powersgd", "torch_fp16", "delay_sbc", "topk_overlap"} <= {m.name for m in refused}
    for method, why in refused.items():
        _, comm = _node_and_comm(method)
        if comm.get("overlap"):
            assert "overlap=True is a DDP hook setting" in why, method.name
        elif comm.get("delay") is not None:
            assert f"comm.delay={comm['delay']}" in why and "strategy=hsdp" in why, method.name
        elif method.config.startswith(("lgc_", "shared_topk", "leader_scaled")):
            assert "codes the all-reduce across replicas" in why and "strategy=hsdp" in why, method.name
        else:
            assert method.config in ("torch_fp16", "torch_bf16", "powersgd", "batched_powersgd"), method.name
            assert "runs an lgc compressor every step" in why, method.name


def test_sampled_fsdp_matrix():
    methods = {c.method.name for c in SAMPLE}
    assert methods == {m.name for m in FSDP_METHODS}
    assert {c.precision for c in SAMPLE} == set(PRECISIONS) and {c.feature for c in SAMPLE} == set(FEATURES)
    lacking = {c: set(PER_CONFIG) - _covered(SAMPLE, c) for c in {m.config for m in FSDP_METHODS}}
    assert not any(lacking.values()), {c: sorted(v) for c, v in lacking.items() if v}
    _run_cases(SAMPLE)


@pytest.mark.slow
@pytest.mark.parametrize("method", FSDP_METHODS, ids=lambda m: m.name)
def test_full_fsdp_matrix(method):
    _run_cases([case for case in ALL_CASES if case.method == method])
