"""Every method through the configurations users have, on two gloo workers, against references.

The matrix crosses every compressor config in ``conf/compressor/`` (plus LGC in each of its
stages, exact variants and the communication-delay mode) with

* gradient dtypes: fp32, a model in fp16, a model in bf16, and fp32 parameters under CPU autocast;
* DDP features: a branch unused on all ranks or on one rank (``find_unused_parameters=True``),
  ``gradient_as_bucket_view=True``, ``static_graph=True``, ``no_sync()`` accumulation;
* an inf or a NaN injected into one gradient entry on one rank at one step.

What every case asserts (see :func:`_check`):

* every rank receives bitwise the same averaged gradient at every step (communication-delay mode:
  the same weights after every exchange), and it is finite whenever the inputs were;
* an injected inf/NaN reaches every rank as a non-finite gradient (so the optimizer, or a
  GradScaler, skips the step everywhere), counts one ``skipped_steps``, changes no compressor
  state, and training afterwards is bitwise that of a run where the step never happened;
* a parameter unused on every rank keeps its compressor state (residual, momentum) as it was;
* exact methods (``none``, top-k and random-block at density 1) equal plain DDP's gradients, the
  16-bit ones within their rounding.

The default suite runs a fixed sample (:data:`SAMPLE`, in one spawn of two workers) that holds every
method once, every dtype with every feature, and every compressor config with a model in fp16 and in
bf16, an injected inf or NaN, and a parameter unused on every rank; ``pytest -m slow`` runs the full product.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc.compressors import ErrorFeedback
from lgc.compressors.segments import CodesBuckets

pytestmark = pytest.mark.multiprocess

CONF = Path(__file__).resolve().parents[1] / "lgc" / "conf" / "compressor"
STEPS = 8
MIN_NUMEL = 64
DTYPES = ("fp32", "fp16", "bf16", "autocast")
FEATURES = ("plain", "unused_all", "unused_one", "bucket_view", "static_graph", "no_sync", "inf", "nan")

#: Small stages and knobs so that every method compresses within STEPS steps of a tiny model.
_LGC = [
    "compressor.density=0.05",
    "compressor.stages.warmup_steps=2",
    "compressor.stages.ae_steps=2",
    "compressor.training.updates_per_step=1",
    "compressor.training.batch_size=8",
    "compressor.training.autoencoder.chunk=16",
    "compressor.training.autoencoder.encoder_channels=[4,4]",
    "compressor.training.autoencoder.decoder_channels=[4,4]",
    "compressor.training.autoencoder.latent_channels=2",
]
_PS = ["compressor.innovation_density=0.01"]
_GOLOMB = "compressor.leaders.index_coding=golomb"
_SHARED = ("compressor.density=0.05", "compressor.stages.warmup_steps=2", "compressor.chunk=16")
_SPARSELOCO = ("compressor.sparsifier.chunk=64", "compressor.sparsifier.k=4")


class Method(NamedTuple):
    """One row of the matrix: a compressor config, its overrides, and what to expect of it."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    #: The step an inf/NaN is injected at (LGC: one per stage).
    inject_step: int = 3
    #: Equal to plain DDP: 0.0 bitwise-ish (fp32 tolerance), else the relative tolerance of its rounding.
    exact: float | None = None
    #: Communication delay: weights are exchanged every this many steps, gradients stay local.
    delay: int | None = None
    #: A bucket coded at once, as on a GPU: error feedback over top-k, SBC, RedSync, the scaled sign,
    #: chunked top-k or DeMo as one flat (ErrorFeedback.bucketed, which DeMo's and the quantizers' decode
    #: follow), DGC's and the quantizers' bucket paths (CodesBuckets.bucketed).
    bucketed: bool | None = None

    @property
    def guard_step(self) -> int:
        """The step whose exchange the injected inf/NaN makes skipped (delay: the next exchange's)."""
        if not self.delay:
            return self.inject_step
        return next(s for s in range(self.inject_step, STEPS) if (s + 1) % self.delay == 0)


METHODS = (
    Method("none", "none", exact=0.0),
    Method("fp16", "fp16", exact=2e-3),
    Method("fp16_bf16", "fp16", ("compressor.dtype=bfloat16",), exact=2e-2),
    Method("topk", "topk"),
    Method("topk_exact", "topk", ("compressor.density=1.0",), exact=0.0),
    Method("topk_fp16_values", "topk", ("compressor.value_dtype=float16",)),
    # A GPU's default path (a step's parameters as one flat), forced on the CPU.
    Method("topk_bucketed", "topk", bucketed=True),
    Method("topk_fp16_values_bucketed", "topk", ("compressor.value_dtype=float16",), bucketed=True),
    Method("signsgd_bucketed", "signsgd", bucketed=True),
    Method("qsgd_bucketed", "qsgd", bucketed=True),
    Method("terngrad_bucketed", "terngrad", bucketed=True),
    Method("terngrad_ef_bucketed", "terngrad", ("compressor.error_feedback=true",), bucketed=True),
    Method("fp4_bucketed", "fp4", bucketed=True),
    # The matrix is a plain training loop (no set_epoch): DGC's warm-up follows its steps.
    Method("dgc", "dgc", ("compressor.density=0.05", "compressor.steps_per_epoch=2")),
    Method("dgc_bucketed", "dgc", ("compressor.density=0.05", "compressor.steps_per_epoch=2"), bucketed=True),
    Method("sbc", "sbc", ("compressor.density=0.05",)),
    Method("sbc_bucketed", "sbc", ("compressor.density=0.05",), bucketed=True),
    # Every bucket encoded and sent as it arrives, the step committed after the agreement.
    Method("topk_overlap", "topk", ("comm.overlap=true",)),
    Method("sbc_overlap", "sbc", ("compressor.density=0.05", "comm.overlap=true")),
    Method("signsgd_overlap", "signsgd", ("comm.overlap=true",)),
    Method("dgc_overlap", "dgc", ("compressor.density=0.05", "compressor.steps_per_epoch=2", "comm.overlap=true")),
    Method("qsgd_overlap", "qsgd", ("comm.overlap=true",)),
    Method("terngrad_overlap", "terngrad", ("comm.overlap=true", "compressor.error_feedback=true")),
    Method(
        "random_block_unshared_overlap",
        "random_block",
        ("compressor.density=0.1", "compressor.shared=false", "comm.overlap=true"),
    ),
    Method(
        "redsync_overlap",
        "redsync",
        ("compressor.density=0.05", "compressor.reuse_threshold=true", "comm.overlap=true"),
    ),
    Method("redsync", "redsync", ("compressor.density=0.05",)),
    Method("redsync_bucketed", "redsync", ("compressor.density=0.05",), bucketed=True),
    Method("redsync_search", "redsync", ("compressor.density=0.05", "compressor.method=threshold_binary_search")),
    Method("random_block", "random_block", ("compressor.density=0.1",)),
    Method("random_block_exact", "random_block", ("compressor.density=1.0",), exact=0.0),
    Method("random_block_unshared", "random_block", ("compressor.density=0.1", "compressor.shared=false")),
    Method("qsgd", "qsgd"),
    Method("fp4", "fp4"),
    Method("terngrad", "terngrad"),
    Method("signsgd", "signsgd"),
    Method("torch_fp16", "torch_fp16", exact=2e-3),
    Method("torch_bf16", "torch_bf16", exact=2e-2),
    Method("powersgd", "powersgd", ("compressor.start_powerSGD_iter=2", "compressor.min_compression_rate=1.1")),
    Method(
        "batched_powersgd",
        "batched_powersgd",
        ("compressor.start_powerSGD_iter=2", "compressor.min_compression_rate=1.1"),
    ),
    Method("lgc_rar_warmup", "lgc_rar", (*_LGC,), inject_step=1),
    Method("lgc_rar_ae", "lgc_rar", (*_LGC,), inject_step=3),
    Method("lgc_rar", "lgc_rar", (*_LGC,), inject_step=5),
    Method("lgc_rar_dgc_warmup", "lgc_rar", (*_LGC, "compressor.stages.warmup=dgc"), inject_step=1),
    Method("lgc_ps_ae", "lgc_ps", (*_LGC, *_PS), inject_step=3),
    Method("lgc_ps", "lgc_ps", (*_LGC, *_PS), inject_step=5),
    Method("lgc_rar_linear", "lgc_rar_linear", (*_LGC,), inject_step=5),
    Method("shared_topk", "shared_topk", _SHARED, inject_step=4),
    Method("shared_topk_fp16", "shared_topk", (*_SHARED, "compressor.values=float16"), inject_step=4),
    Method("shared_topk_int8", "shared_topk_int8", _SHARED, inject_step=4),
    Method("shared_topk_int4", "shared_topk", (*_SHARED, "compressor.values=int4", _GOLOMB)),
    Method("leader_scaled", "leader_scaled", _SHARED, inject_step=4),
    Method("chunked_topk", "chunked_topk", ("compressor.chunk=64", "compressor.k=4")),
    Method("chunked_topk_bucketed", "chunked_topk", ("compressor.chunk=8", "compressor.k=4"), bucketed=True),
    Method("sparseloco", "sparseloco", _SPARSELOCO),
    Method("sparseloco_bucketed", "sparseloco", _SPARSELOCO, bucketed=True),
    Method(
        "sparseloco_topk",
        "sparseloco",
        (
            "compressor.sparsifier._target_=lgc.compressors.TopKCompressor",
            "~compressor.sparsifier.chunk",
            "~compressor.sparsifier.k",
            "~compressor.sparsifier.tiling",
            "~compressor.sparsifier.aggregate",
            "+compressor.sparsifier.density=0.05",
        ),
    ),
    Method("delay_sparseloco", "sparseloco", (*_SPARSELOCO, "comm=local_sgd", "comm.delay=2"), inject_step=3, delay=2),
    Method("demo", "demo", ("compressor.chunk=4", "compressor.k=2")),
    Method("demo_bucketed", "demo", ("compressor.chunk=4", "compressor.k=2"), bucketed=True),
    Method("delay_sbc", "sbc", ("compressor.density=0.05", "comm=local_sgd", "comm.delay=2"), inject_step=3, delay=2),
    Method("delay_none", "none", ("comm=local_sgd", "comm.delay=2"), inject_step=2, delay=2),
    Method("delay_fp4", "fp4", ("comm=local_sgd", "comm.delay=2"), inject_step=3, delay=2),
    Method("lgc_rar_pca", "lgc_rar_pca", (*_LGC, "compressor.training.pca_hidden=4"), inject_step=5),
)

#: Configs without state between steps (no step guard: an inf/NaN passes through their sum).
_STATELESS = {"none", "fp16", "fp4", "torch_fp16", "torch_bf16"}
#: Methods whose state is keyed by DDP bucket, not by parameter (PyTorch's PowerSGD hooks).
_STATE_BY_BUCKET = {"powersgd", "batched_powersgd"}

#: Configs that are variants of another one (``defaults:``), covered through it.
_VARIANTS = {"lgc_rar_paper", "lgc_ps_paper"}


class Case(NamedTuple):
    method: Method
    dtype: str
    feature: str

    @property
    def id(self) -> str:
        return f"{self.method.name}-{self.dtype}-{self.feature}"


def _applicable(method: Method, feature: str) -> bool:
    # Communication delay keeps gradients local: DDP features about gradient averaging do not apply.
    return not (method.delay and feature in ("no_sync", "static_graph"))


ALL_CASES = [Case(m, d, f) for m, d, f in itertools.product(METHODS, DTYPES, FEATURES) if _applicable(m, f)]

#: Combinations refused with a clear error instead of supported, and why.
REFUSED: dict[tuple[str, str], str] = {}


def _injection_rows() -> set[str]:
    """Rows that differ from another row only in the step an inf/NaN is injected at (LGC's stages)."""
    steps: dict[tuple[str, tuple[str, ...]], set[int]] = {}
    for method in METHODS:
        steps.setdefault((method.config, method.overrides), set()).add(method.inject_step)
    return {m.name for m in METHODS if len(steps[(m.config, m.overrides)]) > 1}


#: Their cases in the sample inject an inf or a NaN: without one they would repeat another row.
INJECTION_ROWS = _injection_rows()


#: What every compressor config meets in the default suite: a model in fp16 and in bf16, an injected
#: inf or NaN, and a parameter unused on every rank.
PER_CONFIG = ("fp16", "bf16", "inject", "unused_all")


def _covered(cases: list[Case], config: str) -> set[str]:
    """Which of :data:`PER_CONFIG` the cases of ``config`` cover."""
    seen = set()
    for case in (c for c in cases if c.method.config == config):
        seen |= {case.dtype, "inject" if case.feature in ("inf", "nan") else case.feature}
    return seen & set(PER_CONFIG)


def _per_config(chosen: list[Case]) -> list[Case]:
    """Cases that give every config what :data:`PER_CONFIG` asks and ``chosen`` lacks, paired two by two
    (an fp16 model with an inf, a bf16 model with an unused parameter), on its first row without delay."""
    added: list[Case] = []
    configs = dict.fromkeys(m.config for m in METHODS)
    for i, config in enumerate(configs):
        method = next(m for m in METHODS if m.config == config and not m.delay)
        missing = set(PER_CONFIG) - _covered(chosen, config)
        dtypes = [d for d in ("fp16", "bf16") if d in missing]
        features = [("inf", "nan")[i % 2] if f == "inject" else f for f in ("inject", "unused_all") if f in missing]
        for j in range(max(len(dtypes), len(features))):
            dtype = dtypes[j] if j < len(dtypes) else "fp32"
            feature = features[j] if j < len(features) else "plain"
            added.append(Case(method, dtype, feature))
    return added


def _covering_sample(size: int, seed: int = 0) -> list[Case]:
    """A fixed sample in which every method, dtype and feature occurs, every config meets each of
    :data:`PER_CONFIG`, padded at random to ``size``."""
    rng = random.Random(seed)
    chosen: list[Case] = []
    for i, method in enumerate(METHODS):
        # Rotate through dtypes and features so that each appears with several methods.
        dtype = DTYPES[i % len(DTYPES)]
        if method.name in INJECTION_ROWS:
            features = ["inf", "nan"]
        else:
            features = [f for f in FEATURES if _applicable(method, f)]
        feature = features[(i + i // len(DTYPES)) % len(features)]
        chosen.append(Case(method, dtype, feature))
    chosen += _per_config(chosen)
    rest = [case for case in ALL_CASES if case not in chosen]
    chosen += rng.sample(rest, max(0, size - len(chosen)))
    return chosen


SAMPLE = _covering_sample(0)  # every method once (the rotation covers every dtype with every feature), then per config


# -- the worker side --------------------------------------------------------------------------------


class _Net(nn.Module):
    """Several compressed weights in several buckets, small biases sent dense, and an optional branch."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        hidden = self.body(x)
        out = self.head(hidden)
        return out + self.aux(hidden) if use_aux else out


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "autocast": torch.float32}


def _hook_state(node: dict[str, Any], comm: dict[str, Any], net: nn.Module) -> Any:
    from omegaconf import OmegaConf

    from lgc.methods import build_hook_state

    state = build_hook_state(OmegaConf.create(node), OmegaConf.create(comm))
    # What lgc-train does before the workers train (LGC learns its world size here).
    state.check_run(net, dist.get_world_size(), None)
    return state


def _uses_aux(feature: str, step: int, rank: int) -> bool:
    if feature == "unused_all":
        return step % 2 == 1
    if feature == "unused_one":
        return rank == 0 or step % 2 == 1
    return True


def _flat_state(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state dict by path, leaving out statistics (they count skipped steps)."""
    # Statistics count the skipped step; a delay's local weights and step count move every step.
    ignored = {"stats", "layers", "stage_stats", "stats_mark", "last_metrics", "local_weights", "local_steps"}
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for key, value in state.items():
            if key in ignored:
                continue
            out.update(_flat_state(value, f"{prefix}/{key}"))
        return out
    if isinstance(state, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in state):
        out = {}
        for i, value in enumerate(state):
            out.update(_flat_state(value, f"{prefix}/{i}"))
        return out
    return {prefix: state.detach().clone() if isinstance(state, torch.Tensor) else state}


def _same(a: Any, b: Any) -> bool:
    """Bitwise the same value, a NaN equal to a NaN in the same place (and to nothing else)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not a.is_floating_point():
            return torch.equal(a, b)
        nan_a, nan_b = a.isnan(), b.isnan()
        return torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0))
    return a == b


def _ddp(case: Case) -> tuple[nn.Module, DDP]:
    torch.manual_seed(0)
    net = _Net().to(_TORCH_DTYPES[case.dtype])
    model = DDP(
        net,
        bucket_cap_mb=0.002,
        find_unused_parameters=case.feature in ("unused_all", "unused_one"),
        gradient_as_bucket_view=case.feature == "bucket_view",
        static_graph=case.feature == "static_graph",
    )
    return net, model


def _backward(case: Case, net: nn.Module, model: DDP, step: int, rank: int) -> list[torch.Tensor | None]:
    """One step's forward and backward (two micro-batches with no_sync), an inf/NaN injected where due."""
    method, feature = case.method, case.feature
    dtype = _TORCH_DTYPES[case.dtype]
    handle = None
    if feature in ("inf", "nan") and step == method.inject_step and rank == 1:
        bad = float("inf") if feature == "inf" else float("nan")

        # One entry of one compressed weight, on one rank: what a loss-scale overflow looks like.
        def poison(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad[0, 0] = bad
            return grad

        handle = net.body[2].weight.register_hook(poison)
    micro = 2 if feature == "no_sync" else 1
    for m in range(micro):
        g = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
        x = torch.randn(8, 16, generator=g).to(dtype)
        target = torch.randn(8, 4, generator=g).to(dtype)
        sync = contextlib.nullcontext() if m == micro - 1 else model.no_sync()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if case.dtype == "autocast" else contextlib.nullcontext()
        with sync:
            with autocast:
                loss = (model(x, _uses_aux(feature, step, rank)) - target).float().square().mean()
            loss.backward()
    if handle is not None:
        handle.remove()
    return [None if p.grad is None else p.grad.detach().clone() for p in net.parameters()]


def _train(case: Case, node: dict, comm: dict, rank: int, *, reference: bool, omit_step: int | None) -> dict:
    """Train with the method; with ``reference``, plain DDP computes each step's gradients at the same weights."""
    method = case.method
    net, model = _ddp(case)
    plain = _ddp(case) if reference else None
    state = _hook_state(node, comm, net)
    if method.bucketed is not None:
        assert isinstance(state.compressor, ErrorFeedback | CodesBuckets)
        state.compressor.bucketed = method.bucketed
        assert state.compressor.batches_on(torch.device("cpu")) == method.bucketed, f"{method.name}: no bucket path"
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    grads, plain_grads, states, nonfinite = [], [], {}, []
    for step in range(STEPS):
        if step == omit_step:
            continue
        if step in (method.guard_step, 4):
            states[f"before{step}"] = _flat_state(state.state_dict())
        if plain is not None:
            with torch.no_grad():
                for p, q in zip(plain[0].parameters(), net.parameters(), strict=True):
                    p.copy_(q)
            plain_grads.append(_backward(case, *plain, step, rank))
            plain[1].zero_grad(set_to_none=True)
        step_grads = _backward(case, net, model, step, rank)
        grads.append(step_grads)
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in step_grads)
        nonfinite.append(not finite)
        # What GradScaler does: skip a step whose gradients are not finite. Communication delay
        # trains its local steps without one, so that its exchange guard is exercised.
        if finite or method.delay:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if method.delay:
            state.after_optimizer_step()
        if step in (method.guard_step, 4):
            states[f"after{step}"] = _flat_state(state.state_dict())
    return {
        "grads": grads,
        "plain_grads": plain_grads,
        "params": [p.detach().clone() for p in net.parameters()],
        "names": [name for name, _ in net.named_parameters()],
        "nonfinite": nonfinite,
        "states": states,
        "skipped_steps": state.stats.skipped_steps,
    }


def _matrix_worker(rank: int, world: int, jobs: list[tuple[Case, dict, dict]]) -> list[dict]:
    results = []
    for case, node, comm in jobs:
        result: dict[str, Any] = {"id": case.id}
        try:
            exact = case.method.exact is not None and not case.method.delay
            result["hooked"] = _train(case, node, comm, rank, reference=exact, omit_step=None)
            if case.feature in ("inf", "nan") and not case.method.delay:
                result["omitted"] = _train(case, node, comm, rank, reference=False, omit_step=case.method.inject_step)
        except Exception as err:  # noqa: BLE001 - reported with the case's id, then the run stops
            result["error"] = f"{type(err).__name__}: {err}"
            results.append(result)
            # A failure on one rank leaves the other in a collective: stop the spawn here.
            raise RuntimeError(f"{case.id}: {result['error']}") from err
        results.append(result)
    return results


# -- the launching side ------------------------------------------------------------------------------


def _compose(method: Method) -> tuple[dict, dict]:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from lgc.ddp.torch_hooks import TorchHookState
    from lgc.methods import METHODS

    # PyTorch's hooks compress every parameter: a min_numel is refused for them.
    min_numel = [] if issubclass(METHODS[method.config].cls, TorchHookState) else [f"comm.min_numel={MIN_NUMEL}"]
    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"compressor={method.config}", "logger=none", *min_numel, *method.overrides])
    node = OmegaConf.to_container(cfg.compressor, resolve=True)
    comm = OmegaConf.to_container(cfg.comm, resolve=True)
    return node, comm  # type: ignore[return-value]


def _check(case: Case, per_rank: list[dict]) -> None:
    method, feature = case.method, case.feature
    runs = [r["hooked"] for r in per_rank]
    names = runs[0]["names"]
    injected = feature in ("inf", "nan")
    if method.delay:
        # Weights agree after every exchange (checked at the end: STEPS is a multiple of the delay).
        for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True):
            assert torch.equal(a, b), f"{case.id}: ranks hold different weights after the last exchange"
        for params in (r["params"] for r in runs):
            assert all(bool(torch.isfinite(p).all()) for p in params), f"{case.id}: weights not finite"
    else:
        for step, (g0, g1) in enumerate(zip(runs[0]["grads"], runs[1]["grads"], strict=True)):
            for name, a, b in zip(names, g0, g1, strict=True):
                assert _same(a, b), f"{case.id}: step {step}: ranks got different gradients for {name}"
    for rank, run in enumerate(runs):
        for step, bad in enumerate(run["nonfinite"]):
            if method.delay:
                # Without a GradScaler the bad rank's weights stay non-finite until the next exchange.
                expected = injected and method.inject_step <= step <= method.guard_step and rank == 1
            else:
                expected = injected and step == method.inject_step
            assert bad == expected, f"{case.id}: rank {rank} step {step}: non-finite={bad}, expected {expected}"
        assert run["skipped_steps"] == (1 if injected else 0), f"{case.id}: skipped_steps={run['skipped_steps']}"
        if injected:
            # Delay: the exchange after the bad step is skipped, and the state stands as before it.
            step = method.guard_step
            before, after = run["states"][f"before{step}"], run["states"][f"after{step}"]
            changed = [k for k in before.keys() | after.keys() if not _same(before.get(k), after.get(k))]
            if method.config in _STATELESS:
                # Stateless methods run bucket by bucket without a guard; their step counter only
                # drives the dense start (start_iter) and counts the step.
                changed = [k for k in changed if k != "/iteration"]
            assert not changed, f"{case.id}: rank {rank}: a skipped step changed state {changed[:5]}"
            if not method.delay:
                omitted = per_rank[rank]["omitted"]
                for name, a, b in zip(names, run["params"], omitted["params"], strict=True):
                    assert torch.equal(a, b), f"{case.id}: rank {rank}: {name} differs from a run without the step"
        if feature == "unused_all" and not method.delay:
            before, after = run["states"]["before4"], run["states"]["after4"]
            aux = [k for k in before if "aux." in k]
            # PyTorch's PowerSGD keeps its state per bucket, not per parameter: nothing of its own to check.
            assert bool(aux) != (method.config in _STATELESS | _STATE_BY_BUCKET), (
                f"{case.id}: state keys {list(before)}"
            )
            moved = [k for k in aux if not _same(before[k], after.get(k))]
            assert not moved, f"{case.id}: rank {rank}: state of unused parameters changed: {moved}"
    if method.exact is not None and not method.delay:
        for result in per_rank:
            run = result["hooked"]
            for step, (hooked, plain) in enumerate(zip(run["grads"], run["plain_grads"], strict=True)):
                for name, a, b in zip(names, hooked, plain, strict=True):
                    if b is None:
                        assert a is None or not bool(a.any()), f"{case.id}: {name} got a gradient plain DDP did not"
                        continue
                    assert a is not None, f"{case.id}: step {step}: {name} lost its gradient"
                    finite = b[torch.isfinite(b)].float()
                    scale = float(finite.abs().max()) if finite.numel() else 0.0
                    tol = method.exact
                    atol = 1e-6 if tol == 0.0 else tol * scale
                    rtol = 1e-5 if tol == 0.0 else tol
                    if case.dtype in ("fp16", "bf16"):
                        rtol, atol = max(rtol, 1e-2), max(atol, 1e-2 * scale)
                    # A skipped step is plain DDP's sum, inf/NaN included.
                    torch.testing.assert_close(
                        a, b, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m, name=name: f"{case.id} {name}: {m}"
                    )


def _run_cases(cases: list[Case]) -> None:
    runnable = [c for c in cases if (c.method.name, c.dtype) not in REFUSED]
    jobs = [(case, *_compose(case.method)) for case in runnable]
    results = run_workers(_matrix_worker, 2, jobs)
    for i, case in enumerate(runnable):
        _check(case, [results[0][i], results[1][i]])


def test_the_matrix_covers_every_compressor_config():
    configs = {path.stem for path in CONF.glob("*.yaml")} - _VARIANTS
    assert configs <= {m.config for m in METHODS}, (
        f"configs missing from the matrix: {configs - {m.config for m in METHODS}}"
    )
    sampled = {(c.method.name, c.dtype, c.feature) for c in SAMPLE}
    assert {m for m, _, _ in sampled} == {m.name for m in METHODS}
    # Every dtype meets every feature (an inf under autocast, a NaN in bf16, ...).
    assert {(d, f) for _, d, f in sampled} == set(itertools.product(DTYPES, FEATURES))
    # Each of LGC's stages takes an inf or a NaN in the default suite.
    assert INJECTION_ROWS >= {"lgc_rar_warmup", "lgc_rar_ae", "lgc_rar", "lgc_ps_ae", "lgc_ps"}
    assert {m for m, _, f in sampled if f in ("inf", "nan")} >= INJECTION_ROWS
    # Every config meets a model in fp16 and in bf16, an inf or a NaN, and a parameter unused everywhere.
    lacking = {c: set(PER_CONFIG) - _covered(SAMPLE, c) for c in {m.config for m in METHODS}}
    assert not any(lacking.values()), {c: sorted(v) for c, v in lacking.items() if v}


def test_sampled_matrix():
    _run_cases(SAMPLE)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_full_matrix(method):
    _run_cases([case for case in ALL_CASES if case.method == method])
