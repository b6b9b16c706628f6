"""Compiled models: a ``torch.compile`` d model inside DDP trains through lgc's hook, every method.

``DistributedDataParallel(torch.compile(net))``: inductor compiles the forward and backward graphs;
the gradients still reach DDP's reducer bucket by bucket, and with them the communication hook.
``lgc.compress`` also takes ``torch.compile(DistributedDataParallel(net))`` as the DDP model it
wraps (on this torch, dynamo compiles no graph of a DDP module's forward on the CPU; the test checks
only that the hook runs and training is the eager one's).
"""

import pytest
import torch
from distributed import run_workers
from test_packed import _count_net as _net
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc
from lgc.methods import METHODS

STEPS = 4
#: Local steps, then an exchange of weight updates: every method through it too, one of each outer step.
DELAYED = {"sbc": {"delay": 2}, "none": {"delay": 2, "outer": "sgd"}}


def _knobs(name: str) -> dict:
    if name == "dgc":
        return {"steps_per_epoch": 100}
    if METHODS[name].target.startswith("lgc.learned."):  # short stages, to reach the compressed one
        return {"stages": {"warmup_steps": 1, "ae_steps": min(METHODS[name].cls.STAGES.ae_steps, 1)}}
    return {}


def _train(rank: int, world: int, cases: list[tuple[str, dict]], how: str) -> dict:
    """Every case trained eager and compiled (``how``: ``around`` DDP, or ``inside`` it); weights, hook calls."""
    from torch._inductor.compile_fx import compile_fx

    out = {}
    for name, comm in cases:
        runs = []
        for compiled in (False, True):
            torch._dynamo.reset()
            graphs = []

            def inductor(gm, inputs, graphs=graphs):  # the default backend, counting the graphs it compiles
                graphs.append(gm)
                return compile_fx(gm, inputs)

            net = _net()
            # DDP's optimizer under dynamo needs the first bucket no larger than the others (1 MB).
            inner = torch.compile(net, backend=inductor) if compiled and how == "inside" else net
            model = DDP(inner, bucket_cap_mb=1)
            plain = METHODS[name].run_settings.get("optimizer", {}).get("momentum") == 0
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if plain else 0.9)
            run = torch.compile(model, backend=inductor) if compiled and how == "around" else model
            # lgc.compress takes the compiled model as the DDP model it wraps.
            state = lgc.compress(run, name, optimizer=optimizer, **_knobs(name), **comm)
            start = [p.detach().clone() for p in net.parameters()]
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(10 * step + rank)
                x, y = torch.randn(8, 3, 8, 8, generator=gen), torch.randint(10, (8,), generator=gen)
                nn.functional.cross_entropy(run(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            runs.append(
                {
                    "start": start,
                    "params": [p.detach().clone() for p in net.parameters()],
                    "hook_calls": state.stats.hook_calls,
                    "graphs": len(graphs),
                }
            )
        out[f"{name}{comm or ''}"] = runs
    return out


#: One of each way a method meets the hook, for the default suite (every method with -m slow): a
#: stateless one, a step held and packed, variable sizes, PyTorch's hook, LGC's own stages.
SAMPLE = ["fp16", "topk", "dgc", "powersgd", "lgc_rar"]


def _cases(names: list[str] | None = None) -> list[tuple[str, dict]]:
    chosen = sorted(METHODS) if names is None else names
    return [(name, {}) for name in chosen] + [(name, comm) for name, comm in DELAYED.items()]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "how,names",
    [
        ("inside", SAMPLE),
        pytest.param("inside", None, marks=pytest.mark.slow, id="inside-every-method"),
        pytest.param("around", None, marks=pytest.mark.slow, id="around-every-method"),
    ],
)
def test_a_compiled_model_trains_through_the_hook_for_every_method(how, names):
    """Inside DDP the compiled kernels round otherwise than eager ones (a top-k or a sign then picks
    otherwise), so the run is checked for training: inductor compiled it, the hook ran as often, the
    weights moved, finite, the same on every worker. Around DDP: the eager weights."""
    cases = _cases(names)
    results = run_workers(_train, 2, cases, how)
    for rank, result in enumerate(results):
        assert set(result) == {f"{name}{comm or ''}" for name, comm in cases}
        for case, (eager, compiled) in result.items():
            assert eager["graphs"] == 0 and (compiled["graphs"] >= 1 or how == "around"), case  # inductor compiled
            assert compiled["hook_calls"] == eager["hook_calls"] > 0, case  # the hook ran as often
            moved = [not torch.equal(b, start) for start, b in zip(compiled["start"], compiled["params"], strict=True)]
            assert any(moved) and all(bool(torch.isfinite(b).all()) for b in compiled["params"]), case
            if how == "around":
                for a, b in zip(eager["params"], compiled["params"], strict=True):
                    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"{case}, rank {rank}")
    for case in results[0]:  # the workers agree (communication delay: after its last exchange)
        for a, b in zip(results[0][case][1]["params"], results[1][case][1]["params"], strict=True):
            assert torch.equal(a, b), case
