"""PyTorch's own hooks, wrapped with lgc statistics, on two gloo workers with several buckets."""

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from test_hook import _count_collective_bytes, _net
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc.ddp.powersgd import PowerSGDHookState, _orthogonalize_with_epsilon
from lgc.ddp.torch_hooks import TorchHookState

CONF = Path(__file__).resolve().parents[2] / "lgc" / "conf" / "compressor"


def _run_wrapped(rank: int, world: int, state, steps: int, make=_net) -> dict:
    reference = DDP(make(), bucket_cap_mb=0.01)
    hooked = DDP(make(), bucket_cap_mb=0.01)
    state.register(hooked)
    log: list[tuple[str, int]] = []
    _count_collective_bytes(log)
    grads = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        for model in (reference, hooked):
            model.zero_grad()
            model(x).square().mean().backward()
        grads.append(([p.grad.clone() for p in reference.parameters()], [p.grad.clone() for p in hooked.parameters()]))
    return {
        "grads": grads,
        "stats": state.stats.as_dict(),
        "numel": sum(p.numel() for p in hooked.parameters()),
        "counted_sent": sum(n for kind, n in log if kind == "sent"),
        "state": state.state_dict(),
    }


@pytest.mark.multiprocess
def test_torch_fp16_hook_is_wrapped_with_exact_byte_counts():
    steps = 3
    for result in run_workers(_run_wrapped, 2, TorchHookState("fp16"), steps):
        for reference, hooked in result["grads"]:
            for a, b in zip(reference, hooked, strict=True):
                torch.testing.assert_close(b, a, rtol=2e-3, atol=1e-4)
        stats = result["stats"]
        assert stats["bytes_sent"] == result["counted_sent"] == steps * 2 * result["numel"]
        assert stats["dense_equivalent_bytes"] == steps * 4 * result["numel"]
        assert stats["compression_ratio"] == pytest.approx(2.0)


def _fp16_against_torch(rank: int, world: int, steps: int) -> list[dict]:
    """PyTorch's ``fp16_compress_hook`` and lgc's ``fp16`` (every tensor, from the first step) from the same
    weights at every step of a training run (the reference's): both averages, and every worker's local
    fp32 gradient of that step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lgc import FP16Compressor, register_compression_hook

    theirs, ours, local = DDP(_net(), bucket_cap_mb=0.01), DDP(_net(), bucket_cap_mb=0.01), _net()
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    register_compression_hook(ours, FP16Compressor(), min_numel=1, start_iter=0)
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    records = []
    for step in range(steps):
        with torch.no_grad():
            for model in (ours.module, local):
                for p, q in zip(model.parameters(), theirs.module.parameters(), strict=True):
                    p.copy_(q)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        grads = {}
        for name, model in (("theirs", theirs), ("ours", ours), ("local", local)):
            model.zero_grad()
            model(x).square().mean().backward()
            grads[name] = [p.grad.clone() for p in model.parameters()]
        gathered = []
        for g in grads["local"]:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            gathered.append(torch.stack(parts))
        grads["every_worker"] = gathered
        records.append(grads)
        optimizer.step()
    return records


@pytest.mark.multiprocess
def test_fp16_is_pytorchs_hook_bit_for_bit_where_every_quotient_is_normal():
    """lgc's fp16 divides by the world size in fp32 and casts (one rounding); PyTorch's hook casts, then
    divides in fp16 (two). With a power-of-two world the two agree bit for bit wherever every worker's
    quotient is 0 or a normal fp16 number; where one is subnormal, each worker's half-precision value
    differs by at most one subnormal step (lgc's is the correctly rounded one), and the sum by that or by
    one fp16 step of the sum."""
    world, smallest_normal, subnormal_step = 2, 2.0**-14, 2.0**-24
    subnormal_entries = 0
    for records in run_workers(_fp16_against_torch, world, 4):
        for step, grads in enumerate(records):
            for theirs, ours, every in zip(grads["theirs"], grads["ours"], grads["every_worker"], strict=True):
                quotients = (every / world).abs()
                normal = ((quotients >= smallest_normal) | (quotients == 0)).all(dim=0)
                assert torch.equal(ours[normal], theirs[normal]), f"step {step}"
                # One subnormal step per worker, or one fp16 step of the sum where the sum rounds it.
                bound = torch.clamp(theirs.abs() * 2.0**-10, min=world * subnormal_step)
                assert ((ours - theirs).abs() <= bound).all(), f"step {step}"
                subnormal_entries += int((~normal).sum())
    assert subnormal_entries > 0  # the test sees both cases


@pytest.mark.multiprocess
@pytest.mark.parametrize("batched", [pytest.param(False, marks=pytest.mark.slow), True])
def test_powersgd_runs_on_gloo_with_several_buckets_and_counts_its_bytes(batched):
    steps = 5
    state = PowerSGDHookState(
        matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.1, batched=batched
    )
    results = run_workers(_run_wrapped, 2, state, steps)
    for result in results:
        stats = result["stats"]
        assert stats["hook_calls"] >= steps
        assert stats["bytes_sent"] == result["counted_sent"]
        # Dense for the first two steps, then strictly fewer bytes than dense.
        assert stats["bytes_sent"] < stats["dense_equivalent_bytes"]
        assert result["state"]["powersgd"]["iter"] == steps
    # Both ranks end with the same averaged (compressed) gradients.
    for (_, g0), (_, g1) in zip(results[0]["grads"], results[1]["grads"], strict=True):
        for a, b in zip(g0, g1, strict=True):
            torch.testing.assert_close(a, b)


def _run_against_torch(rank: int, world: int, options: dict, batched: bool, steps: int) -> list[dict]:
    """Train twice from the same weights, PyTorch's PowerSGD hook registered as PyTorch documents it and lgc's
    wrapper (each model stepping on its own), with plain DDP's average at the hook's weights beside them:
    every step's averaged gradients of the three."""
    models, optimizers = [], []
    for _ in range(3):  # PyTorch's hook, lgc's wrapper, plain DDP
        model = DDP(_net(), bucket_cap_mb=0.01)
        models.append(model)
        optimizers.append(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    hook = powerSGD_hook.batched_powerSGD_hook if batched else powerSGD_hook.powerSGD_hook

    def serialized(state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # PyTorch's hook, each bucket finished before the next starts: its second allreduce, issued from
        # a Future.then callback, would otherwise meet another bucket's first in a different order per
        # rank over gloo. The values are the hook's own.
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        with _batch_of_one() if batched else contextlib.nullcontext():
            done.set_result(hook(state, bucket).wait())
        return done

    models[0].register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, **options), serialized)
    wrapped = PowerSGDHookState(batched=batched, **options)
    wrapped.register(models[1])
    grads = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        step_grads = []
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            step_grads.append({name: p.grad.clone() for name, p in model.module.named_parameters()})
            optimizer.step()
        with torch.no_grad():  # plain DDP's average at the hooks' weights, not its own trajectory
            for p, q in zip(models[2].parameters(), models[0].parameters(), strict=True):
                p.copy_(q)
        grads.append(step_grads)
    return grads


@contextlib.contextmanager
def _batch_of_one():
    """torch 2.14's ``batched_powerSGD_hook`` hands ``_orthogonalize`` a 2-D Q, which it refuses (a bare
    AssertionError): viewed as a batch of one, nothing else changed, as lgc's wrapper does."""
    original = powerSGD_hook._orthogonalize
    powerSGD_hook._orthogonalize = lambda m, epsilon=0: original(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    try:
        yield
    finally:
        powerSGD_hook._orthogonalize = original


@pytest.mark.multiprocess
@pytest.mark.parametrize("batched", [False, True], ids=["per_tensor", "batched"])
def test_powersgd_is_pytorchs_own_hook_step_for_step(batched):
    """Where none of the wrapper's fixes applies (no all-zero matrix, fp32; the batched hook without the
    epsilon it ignores), lgc's PowerSGD is PyTorch's hook bit for bit over several buckets and 8 training
    steps: the dense start, then the compressed steps with error feedback and warm-started Q."""
    options = dict(
        matrix_approximation_rank=2,
        start_powerSGD_iter=3,
        min_compression_rate=1.1,
        random_seed=7,
        orthogonalization_epsilon=0.0 if batched else 1e-8,
    )
    for grads in run_workers(_run_against_torch, 2, options, batched, 8):
        for step, (theirs, ours, _) in enumerate(grads):
            for name, grad in theirs.items():
                assert torch.equal(ours[name], grad), f"step {step}: {name} differs from PyTorch's hook"
        # From start_powerSGD_iter on, the steps are PowerSGD's, not the dense average a plain DDP takes.
        for step, (theirs, _, dense) in enumerate(grads):
            assert torch.equal(theirs["0.weight"], dense["0.weight"]) == (step < options["start_powerSGD_iter"])


class _NetWithAuxiliaryBranch(nn.Module):
    """A trunk and head used at every step, and an auxiliary branch used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU())
        self.head = nn.Linear(48, 5)
        # Large enough that, with bucket_cap_mb=0.01, the branch's last parameters fill a bucket of
        # their own: the batched hook then sees a bucket that is all zero when the branch is unused.
        self.aux = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.trunk(x)
        return self.head(h) + self.aux(h) if use_aux else self.head(h)


def _run_with_auxiliary_branch(rank: int, world: int, state: PowerSGDHookState, steps: int) -> list[dict]:
    model = DDP(_NetWithAuxiliaryBranch(), bucket_cap_mb=0.01, find_unused_parameters=True)
    state.register(model)
    grads = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        model.zero_grad()
        # The branch is unused at step 2, the first compressed one, and used at every odd step.
        model(x, use_aux=step % 2 == 1).square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.module.named_parameters() if p.grad is not None})
    return grads


@pytest.mark.multiprocess
@pytest.mark.parametrize("batched", [pytest.param(False, marks=pytest.mark.slow), True], ids=["per_tensor", "batched"])
def test_powersgd_stays_finite_when_a_layer_is_unused_at_the_first_compressed_step(batched):
    # The branch's matrices are zero on both ranks at step 2, so Gram-Schmidt divided
    # 0 by 0; error feedback carried the NaN into step 3 (the batched hook ignored PyTorch's epsilon).
    steps = 8
    state = PowerSGDHookState(start_powerSGD_iter=2, min_compression_rate=1.1, batched=batched)
    for grads in run_workers(_run_with_auxiliary_branch, 2, state, steps):
        for step, step_grads in enumerate(grads):
            for name, grad in step_grads.items():
                assert torch.isfinite(grad).all(), f"step {step}: non-finite gradient in {name}"
            assert ("aux.0.weight" in step_grads) == (step % 2 == 1)  # DDP leaves unused gradients None
        # The branch is still trained once it is used again: its Q, zeroed by the all-zero step, is
        # re-drawn (under warm start it would otherwise stay zero, and so would these gradients).
        for step in range(3, steps, 2):
            for name in ("aux.0.weight", "aux.0.bias", "aux.2.weight", "aux.2.bias"):
                assert grads[step][name].norm() > 1e-3, f"step {step}: {name} gets no gradient"


class _NetWithScalars(nn.Module):
    """A learnable scalar (a temperature) and an empty parameter beside ordinary layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 4)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.temperature + self.empty.sum()


@pytest.mark.multiprocess
def test_per_tensor_powersgd_takes_a_learnable_scalar_and_an_empty_parameter():
    # PyTorch's per-tensor hook views each gradient as (shape[0], -1): IndexError on the scalar, a reshape
    # error on the empty one, at the first compressed step. The scalar goes uncompressed: plain DDP's average.
    names = [name for name, _ in _NetWithScalars().named_parameters()]
    temperature = names.index("temperature")
    state = PowerSGDHookState(start_powerSGD_iter=2, min_compression_rate=1.1)
    for result in run_workers(_run_wrapped, 2, state, 5, _NetWithScalars):
        for step, (theirs, ours) in enumerate(result["grads"]):
            torch.testing.assert_close(ours[temperature], theirs[temperature], rtol=1e-6, atol=0, msg=f"step {step}")
            assert all(bool(torch.isfinite(g).all()) for g in ours)
        theirs, ours = result["grads"][-1]
        assert not torch.allclose(ours[names.index("a.weight")], theirs[names.index("a.weight")])  # compressed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthogonalization_of_a_zero_matrix_is_zero_not_nan(dtype, rank):
    zeros = torch.zeros(1, 12, rank, dtype=dtype)
    with _orthogonalize_with_epsilon(1e-8):
        powerSGD_hook._orthogonalize(zeros, 1e-8)  # the per-tensor hook passes the state's epsilon
        matrix = torch.zeros(12, rank, dtype=dtype)
        powerSGD_hook._orthogonalize(matrix)  # the batched hook passes a 2-D Q and no epsilon
    # (QR, used for rank > 2 in float32, turns a zero matrix into orthonormal columns.)
    assert torch.isfinite(zeros).all() and torch.isfinite(matrix).all()
    if rank <= 2 or dtype != torch.float32:
        assert not zeros.any() and not matrix.any()


def test_orthogonalization_epsilon_is_negligible_against_real_columns():
    # Columns of norm about 1e-3, a small gradient: the result moves by about 1e-8 / 1e-3 relative.
    columns = torch.randn(1, 100, 2, generator=torch.Generator().manual_seed(0)) * 1e-4
    exact, with_epsilon = columns.clone(), columns.clone()
    powerSGD_hook._orthogonalize(exact, 0)
    with _orthogonalize_with_epsilon(1e-8):
        powerSGD_hook._orthogonalize(with_epsilon, 0)
    assert (with_epsilon - exact).norm() < 1e-4 * exact.norm()
    assert powerSGD_hook._orthogonalize.__name__ == "_orthogonalize"  # restored on exit


def _checkpoint_and_resume(rank: int, world: int, batched: bool, find_unused: bool, folder: str) -> dict:
    steps, cut = 7, 4  # compressed from step 2: error feedback, warm-start Q and the RNG all matter

    def make(load: dict | None = None, load_before_register: bool = True) -> tuple[PowerSGDHookState, DDP]:
        state = PowerSGDHookState(start_powerSGD_iter=2, min_compression_rate=1.1, batched=batched)
        model = DDP(_net(), bucket_cap_mb=0.01, find_unused_parameters=find_unused)
        if load is not None and load_before_register:
            state.load_state_dict(load)
        state.register(model)
        if load is not None and not load_before_register:
            state.load_state_dict(load)
        return state, model

    def step(model: DDP, i: int) -> list[torch.Tensor]:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * i + rank))
        model.zero_grad()
        model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    _, model = make()
    uninterrupted = [step(model, i) for i in range(steps)]
    dense = DDP(_net(), bucket_cap_mb=0.01)
    plain_ddp = [step(dense, i) for i in range(steps)]

    state, model = make()
    for i in range(cut):
        step(model, i)
    path = Path(folder) / f"powersgd_rank{rank}.pt"
    torch.save(state.state_dict(), path)
    # The default weights_only=True: tensors and plain Python values only.
    saved = torch.load(path, weights_only=True)

    resumed = {}
    for load_before_register in (True, False):
        state, model = make(saved, load_before_register)
        resumed[load_before_register] = [step(model, i) for i in range(cut, steps)]
        assert state.powersgd.iter == steps
        assert state.powersgd.process_group is None  # the wrapper's group, not reset by loading
    return {
        "uninterrupted": uninterrupted[cut:],
        "plain_ddp": plain_ddp[cut:],
        "resumed": resumed,
        "saved_iter": saved["powersgd"]["iter"],
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("batched", [pytest.param(False, marks=pytest.mark.slow), True], ids=["per_tensor", "batched"])
def test_powersgd_checkpoint_loads_with_weights_only_and_resumes_bit_identically(batched, tmp_path):
    # find_unused_parameters=True: DDP never rebuilds its buckets, so the restarted model's buckets
    # are those of the checkpoint from its first step on.
    for result in run_workers(_checkpoint_and_resume, 2, batched, True, str(tmp_path)):
        assert result["saved_iter"] == 4
        for resumed in result["resumed"].values():
            for expected, got in zip(result["uninterrupted"], resumed, strict=True):
                for a, b in zip(expected, got, strict=True):
                    assert torch.equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("batched", [pytest.param(False, marks=pytest.mark.slow), True], ids=["per_tensor", "batched"])
def test_powersgd_resumes_when_ddp_rebuilds_its_buckets_after_the_restart(batched, tmp_path):
    # By default DDP holds every parameter in one bucket until its first iteration is done; the restored
    # state belongs to the rebuilt buckets (bucket 0's error did not fit: RuntimeError). That first step
    # is a plain allreduce, as at the start of training; PowerSGD, with the restored state, follows.
    for result in run_workers(_checkpoint_and_resume, 2, batched, False, str(tmp_path)):
        for resumed in result["resumed"].values():
            for a, b in zip(result["plain_ddp"][0], resumed[0], strict=True):
                torch.testing.assert_close(b, a)
            for later, dense in zip(resumed[1:], result["plain_ddp"][1:], strict=True):
                assert all(torch.isfinite(g).all() for g in later)
                assert any(not torch.allclose(g, d) for g, d in zip(later, dense, strict=True))  # compressed


def _resume_with_other_buckets(rank: int, world: int, folder: str) -> dict:
    """Four steps with 10 kB buckets, saved; resumed with DDP's default 25 MB (one bucket): each resumed
    step's outcome (None, or the error)."""

    def step(model: DDP, i: int) -> str | None:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * i + rank))
        model.zero_grad()
        try:
            model(x).square().mean().backward()
        except Exception as err:  # noqa: BLE001 - the hook's refusal, as DDP hands it on
            return str(err)
        return None

    state = PowerSGDHookState(start_powerSGD_iter=2, min_compression_rate=1.1)
    model = DDP(_net(), bucket_cap_mb=0.01)
    state.register(model)
    for i in range(4):
        assert step(model, i) is None
    saved = state.state_dict()
    resumed = PowerSGDHookState(start_powerSGD_iter=2, min_compression_rate=1.1)
    resumed.load_state_dict(saved)
    other = DDP(_net(), bucket_cap_mb=25)
    resumed.register(other)
    first = step(other, 4)
    return {"first": first, "second": step(other, 5)}


@pytest.mark.multiprocess
def test_powersgd_resumed_with_other_buckets_is_refused_at_its_second_step_not_left_dense(tmp_path):
    # The first step after a restart is dense in any case (DDP's first buckets); from the second on, a
    # bucket whose gradients are not those its state holds would have stayed dense for the rest of the run.
    for result in run_workers(_resume_with_other_buckets, 2, str(tmp_path)):
        assert result["first"] is None
        assert result["second"] is not None and "resume with the DDP settings (ddp.bucket_cap_mb)" in result["second"]


def test_state_dict_restores_the_rng_and_refuses_a_checkpoint_of_another_layout():
    state = PowerSGDHookState(start_powerSGD_iter=2)
    state.powersgd = powerSGD_hook.PowerSGDState(process_group=None, **state.options)
    state.powersgd.rng.randint(1_000_000_000)
    state.powersgd.rng.randn()  # leaves a cached Gaussian in the state
    saved = state.state_dict()
    expected = [state.powersgd.rng.randint(1_000_000_000) for _ in range(3)] + [state.powersgd.rng.randn()]

    fresh = PowerSGDHookState(start_powerSGD_iter=2, orthogonalization_epsilon=1e-6)
    fresh.powersgd = powerSGD_hook.PowerSGDState(process_group=None, **fresh.options)
    fresh.load_state_dict(saved)
    assert [fresh.powersgd.rng.randint(1_000_000_000) for _ in range(3)] + [fresh.powersgd.rng.randn()] == expected
    # Hyperparameters come from the constructor, not from the checkpoint.
    assert fresh.powersgd.orthogonalization_epsilon == 1e-6

    with pytest.raises(ValueError, match="matrix_approximation_rank=1"):
        PowerSGDHookState(matrix_approximation_rank=2).load_state_dict(saved)
    with pytest.raises(ValueError, match="batched"):
        PowerSGDHookState(batched=True).load_state_dict(saved)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"matrix_approximation_rank": 0}, "matrix_approximation_rank"),
        ({"matrix_approximation_rank": True}, "matrix_approximation_rank"),
        ({"matrix_approximation_rank": 1.5}, "matrix_approximation_rank"),
        ({"start_powerSGD_iter": 1}, "start_powerSGD_iter"),
        ({"start_powerSGD_iter": "10"}, "start_powerSGD_iter"),
        ({"min_compression_rate": -1}, "min_compression_rate"),
        ({"min_compression_rate": float("nan")}, "min_compression_rate"),
        ({"min_compression_rate": True}, "min_compression_rate"),
        ({"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon"),
        ({"orthogonalization_epsilon": float("inf")}, "orthogonalization_epsilon"),
        ({"orthogonalization_epsilon": "1e-8"}, "orthogonalization_epsilon"),
        ({"use_error_feedback": 1}, "use_error_feedback"),
        ({"warm_start": "yes"}, "warm_start"),
        ({"batched": None}, "batched"),
        ({"random_seed": -1}, "random_seed"),
        ({"random_seed": 2**32}, "random_seed"),
        ({"random_seed": False}, "random_seed"),
    ],
)
def test_powersgd_constructor_rejects_bad_values_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PowerSGDHookState(**kwargs)


@pytest.mark.parametrize("config", ["powersgd", "batched_powersgd"])
def test_powersgd_configs_build_the_wrapper_with_an_epsilon(config):
    from lgc.methods import METHODS, build_hook_state

    state = build_hook_state(METHODS[config].resolve())
    assert isinstance(state, PowerSGDHookState)
    assert state.batched == (config == "batched_powersgd")
    assert state.options["orthogonalization_epsilon"] == 1e-8
