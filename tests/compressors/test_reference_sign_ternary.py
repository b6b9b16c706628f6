"""EF-signSGD and TernGrad against transcriptions of their reference code, step by step with state.

* EF-signSGD (Karimireddy et al. 2019): epfml/error-feedback-SGD, ``optimizers/ErrorFeedbackSGD.py``
  (``scaled_sign`` and ``ErrorFeedbackSGD.step``).
* TernGrad (Wen et al. 2017): wenwei202/terngrad, ``terngrad/inception/bingrad_common.py``
  (``gradient_binarizing_scalers`` and ``stochastical_binarize_gradients``, chained per worker as
  ``terngrad/inception/inception_train.py`` chains them).

The transcriptions below restate the reference's per-step arithmetic in PyTorch; nothing of the
reference is imported. Each method is run through the DDP hook on 2 gloo workers (``lgc.compress``
with the method's yaml) and compared, step after step, with the transcription applied to every
worker's own gradient and averaged as lgc's allgather averages. Both references send every tensor
from the first step, so the hook runs with ``min_numel=1, start_iter=0`` (the methods' defaults,
1,024 and 1, send biases dense and the first step uncompressed).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lgc
from lgc.compressors import ErrorFeedback, SignSGDCompressor, TernGradCompressor
from lgc.compressors.base import keyed_seed

WORLD = 2
STEPS = 6


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- a small model run through the hook on gloo workers -----------------------------------------------


def _net() -> nn.Module:
    """Weights of 2048 and 640 entries, biases of 64 and 10. Tanh, not ReLU: no unit is dead for a whole
    batch, so no gradient entry is exactly zero (where the references' ``torch.sign`` / ``tf.sign`` is 0)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))


def _loss(module: nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 10, generator=gen)
    return (module(x) - y).square().mean()


def _hook_worker(rank: int, world: int, method: str, steps: int, lr: float, knobs: dict) -> dict:
    """DDP + ``lgc.compress(model, method)`` + ``SGD(lr)``: per step, this worker's own gradient (computed
    on a plain copy of the module at the same weights, before the hook replaces it), the gradient the
    hook leaves (the workers' average), the weights after the step and the compressor's state."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, plain = DDP(_net()), _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # no momentum, no weight decay: see the tests
    state = lgc.compress(model, method, optimizer=optimizer, min_numel=1, start_iter=0, **knobs)
    records = []
    for step in range(steps):
        plain.load_state_dict(model.module.state_dict())
        plain.zero_grad()
        _loss(plain, rank, step).backward()
        own = {name: p.grad.clone() for name, p in plain.named_parameters()}
        optimizer.zero_grad()
        _loss(model, rank, step).backward()
        averaged = {name: p.grad.clone() for name, p in model.module.named_parameters()}
        optimizer.step()
        compressor = state.compressor
        record = {
            "own": own,
            "averaged": averaged,
            "params": {name: p.detach().clone() for name, p in model.module.named_parameters()},
        }
        if isinstance(compressor, ErrorFeedback):
            record["residuals"] = {key: r.detach().clone() for key, r in compressor.residuals.items()}
        else:
            record["draws"] = dict(compressor.draws)
            record["seed"] = compressor.seed
        records.append(record)
    return {"compressor": repr(state.compressor), "records": records}


def _initial_params() -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in _net().named_parameters()}


# =====================================================================================================
# EF-signSGD
# =====================================================================================================


def _reference_scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """epfml/error-feedback-SGD ``optimizers/ErrorFeedbackSGD.py``, ``scaled_sign``: the L1 norm over the
    element count, times ``torch.sign`` (0 where an entry is 0)."""
    return x.norm(p=1) / x.nelement() * torch.sign(x)


class _ReferenceEFSignSGD:
    """epfml/error-feedback-SGD ``optimizers/ErrorFeedbackSGD.py``: ``ErrorFeedbackSGD.step`` with
    ``comp='scaled_sign'`` and ``memory=True`` (the paper's EF-signSGD, ``'ssgdf'`` in
    ``utils/hyperparameters.py``), ``momentum=0``, ``weight_decay=0``: per parameter

        ``d_p = lr * g;  corrected = memory + d_p;  sent = scaled_sign(corrected);``
        ``memory = memory + d_p - sent;  p -= sent``.

    The reference is one process; here every worker runs its own ``memory`` on its own gradient and
    the workers' ``sent`` are averaged before ``p -= ...`` (what lgc's allgather of the payloads does).
    ``step``'s ``lr`` is the reference's ``group['lr']`` at that step (a scheduler may change it).
    """

    def __init__(self, params: dict[str, torch.Tensor], workers: int) -> None:
        self.params = {name: p.clone() for name, p in params.items()}
        self.memories = [{name: torch.zeros_like(p) for name, p in params.items()} for _ in range(workers)]
        self.corrected: list[dict[str, torch.Tensor]] = [{} for _ in range(workers)]

    def step(self, grads: list[dict[str, torch.Tensor]], lr: float) -> dict[str, torch.Tensor]:
        """One step; ``grads[rank][name]`` is worker ``rank``'s own gradient. Returns the averaged update."""
        updates = {}
        for name, p in self.params.items():
            sent = []
            for rank, memory in enumerate(self.memories):
                d_p = lr * grads[rank][name]
                corrected = memory[name] + d_p
                self.corrected[rank][name] = corrected
                compressed = _reference_scaled_sign(corrected)
                memory[name] = memory[name] + d_p - compressed
                sent.append(compressed)
            updates[name] = torch.stack(sent).sum(0) / len(sent)
            p.sub_(updates[name])
        return updates


def _lgc_ef_signsgd(grads: list[dict[str, torch.Tensor]], workers: list[ErrorFeedback]) -> dict[str, torch.Tensor]:
    """One step of lgc's EF-signSGD as the hook runs it (:func:`_hook_worker` runs the real one): every
    worker compresses its gradient divided by the world size under the parameter's name, the payloads
    go through the wire format and are summed."""
    world, averaged = len(workers), {}
    for name in grads[0]:
        wires = [ef.compress(g[name].reshape(-1) / world, name).to_wire() for ef, g in zip(workers, grads, strict=True)]
        numel = grads[0][name].numel()
        payloads = [workers[0].payload_from_wire(wire, numel, key=name) for wire in wires]
        averaged[name] = workers[0].aggregate(payloads).view_as(grads[0][name])
    return averaged


def _toy_grads(step: int, workers: int) -> list[dict[str, torch.Tensor]]:
    shapes = {"w": (40, 25), "b": (7,)}
    return [
        {name: _randn(*shape, seed=100 * step + 10 * rank + i) for i, (name, shape) in enumerate(shapes.items())}
        for rank in range(workers)
    ]


@pytest.mark.parametrize("lr", [0.25, 0.1])
def test_ef_signsgd_at_a_constant_lr_is_the_reference_step_with_memory_lr_times_world_times_residual(lr):
    """lgc's error feedback compresses ``g / P + r`` (no lr; the hook's division by the world size ``P``)
    and lets ``SGD(lr)`` scale the average; the reference compresses ``lr * g + e``. The scaled sign is
    positively homogeneous (``C(a v) = a C(v)``, ``a > 0``), so at a constant lr the two are the same
    step with ``e = lr * P * r``: the same parameters and memories at every step. With ``lr`` a power of
    two every scaling is exact and so is the agreement (bit for bit); with 0.1 it holds to rounding."""
    steps = 8
    params = {"w": _randn(40, 25, seed=1), "b": _randn(7, seed=2)}
    reference = _ReferenceEFSignSGD(params, WORLD)
    workers = [ErrorFeedback(SignSGDCompressor()) for _ in range(WORLD)]
    mine = {name: p.clone() for name, p in params.items()}
    exact = lr == 0.25
    for step in range(steps):
        grads = _toy_grads(step, WORLD)
        expected = reference.step(grads, lr)
        averaged = _lgc_ef_signsgd(grads, workers)
        for name, p in mine.items():
            p.add_(averaged[name], alpha=-lr)  # torch.optim.SGD(lr)'s step
            assert all(bool((c[name] != 0).all()) for c in reference.corrected)  # torch.sign(0) = 0: see below
            for ef, memory in zip(workers, reference.memories, strict=True):
                rescaled = ef.residuals[name].view_as(p) * (lr * WORLD)
                if exact:
                    assert torch.equal(rescaled, memory[name]), (step, name)
                else:
                    torch.testing.assert_close(rescaled, memory[name], rtol=1e-5, atol=1e-5 * lr)
            if exact:
                assert torch.equal(averaged[name] * lr, expected[name]), (step, name)
                assert torch.equal(p, reference.params[name]), (step, name)
            else:
                torch.testing.assert_close(averaged[name] * lr, expected[name], rtol=1e-5, atol=1e-5 * lr)
                torch.testing.assert_close(p, reference.params[name], rtol=1e-5, atol=1e-5 * lr)


def test_ef_signsgd_after_an_lr_change_is_the_reference_with_its_memory_rescaled_by_the_lr_ratio():
    """Where lgc departs: the reference's memory holds errors already multiplied by the lr they were made
    at, lgc's residual holds them without it and they are applied at the current lr. lgc under a
    schedule is therefore the reference whose memory is multiplied by ``lr_new / lr_old`` when the lr
    changes (bit for bit with powers of two), and differs from the reference left alone."""
    lrs = [0.5] * 4 + [0.125] * 4
    params = {"w": _randn(40, 25, seed=3), "b": _randn(7, seed=4)}
    rescaled_reference, plain_reference = _ReferenceEFSignSGD(params, WORLD), _ReferenceEFSignSGD(params, WORLD)
    workers = [ErrorFeedback(SignSGDCompressor()) for _ in range(WORLD)]
    mine = {name: p.clone() for name, p in params.items()}
    for step, lr in enumerate(lrs):
        if step and lr != lrs[step - 1]:
            for memory in rescaled_reference.memories:
                for m in memory.values():
                    m.mul_(lr / lrs[step - 1])
        grads = _toy_grads(step, WORLD)
        rescaled_reference.step(grads, lr)
        plain_reference.step(grads, lr)
        for name, update in _lgc_ef_signsgd(grads, workers).items():
            mine[name].add_(update, alpha=-lr)
            assert torch.equal(mine[name], rescaled_reference.params[name]), (step, name)
    assert not torch.allclose(mine["w"], plain_reference.params["w"], rtol=1e-4, atol=0)


def test_ef_signsgd_sends_plus_scale_where_the_reference_sends_zero():
    """Where lgc departs: a corrected entry of exactly 0 is ``torch.sign(0) = 0`` in the reference
    (nothing sent, nothing remembered) and ``+scale`` in lgc (one bit has no third symbol), whose
    residual then holds ``-scale`` there and sends it back later. The scale is the same (zeros add
    nothing to the L1 norm) and so is every other entry."""
    g = _randn(1000, seed=5)
    g[::7] = 0.0
    ef = ErrorFeedback(SignSGDCompressor())
    sent = ef.decompress(ef.compress(g, "w"))
    expected = _reference_scaled_sign(g)
    zero = g == 0
    scale = g.abs().sum() / g.numel()
    assert torch.equal(sent[~zero], expected[~zero])
    assert bool((expected[zero] == 0).all())
    torch.testing.assert_close(sent[zero], scale.expand(int(zero.sum())), rtol=1e-6, atol=0)
    assert torch.equal(ef.residuals["w"][zero], -sent[zero])


_SIGN_LR = 0.25  # a power of two: lr * P * residual is exactly the reference's memory


@pytest.mark.multiprocess
def test_ef_signsgd_through_the_hook_is_the_reference_step():
    """``lgc.compress(model, "signsgd")`` (its yaml: error feedback on) on 2 DDP workers, 6 steps, against
    :class:`_ReferenceEFSignSGD` fed each worker's own gradients: the averaged update, every weight and
    every worker's memory (``lr * P * residual``) agree bit for bit at every step (constant lr, a power
    of two; no corrected entry is exactly 0, checked).

    Momentum and weight decay are 0 on both sides: ``ErrorFeedbackSGD.step`` adds them to the gradient
    before it compresses (the paper's runs: ``weight_decay=5e-4``), whereas lgc compresses the gradient
    and the optimizer applies them to the averaged update; the two agree only without them."""
    from distributed import run_workers

    results = run_workers(_hook_worker, WORLD, "signsgd", STEPS, _SIGN_LR, {})
    assert all(r["compressor"] == "ErrorFeedback(SignSGDCompressor())" for r in results)
    reference = _ReferenceEFSignSGD(_initial_params(), WORLD)
    for step in range(STEPS):
        records = [r["records"][step] for r in results]
        for name in reference.params:
            assert torch.equal(records[0]["averaged"][name], records[1]["averaged"][name])
        expected = reference.step([record["own"] for record in records], _SIGN_LR)
        for name, p in reference.params.items():
            assert all(bool((c[name] != 0).all()) for c in reference.corrected), (step, name)
            assert torch.equal(records[0]["averaged"][name] * _SIGN_LR, expected[name]), (step, name)
            for rank, record in enumerate(records):
                assert torch.equal(record["params"][name], p), (step, rank, name)
                memory = record["residuals"][name].view_as(p) * (_SIGN_LR * WORLD)
                assert torch.equal(memory, reference.memories[rank][name]), (step, rank, name)


# =====================================================================================================
# TernGrad
# =====================================================================================================


def _lgc_uniforms(seed: int, key: str, count: int, numel: int) -> torch.Tensor:
    """The ``U[0, 1)`` draws lgc's TernGrad takes for ``key``'s ``count``-th compression (its generator,
    reseeded per tensor and call: ``StochasticQuantizer._generator``), as ``s + u`` with ``s = 1``."""
    gen = torch.Generator().manual_seed(keyed_seed(seed, key, count))
    return torch.empty(numel).uniform_(1.0, 2.0, generator=gen) - 1.0


def _reference_scaler(g: torch.Tensor, clip_factor: float) -> torch.Tensor:
    """wenwei202/terngrad ``terngrad/inception/bingrad_common.py``, ``gradient_binarizing_scalers``:
    with clipping, ``clip_factor`` times the (population) standard deviation, whatever ``max |g|``; without
    (``clip_factor`` 0), ``max |g|``."""
    if clip_factor > 1.0e-5:
        mean = torch.mean(g)
        stddev = torch.sqrt(torch.mean(torch.square(g - mean)))
        return clip_factor * stddev
    return torch.max(torch.abs(g))


def _reference_ternarize(g: torch.Tensor, scaler: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """wenwei202/terngrad ``terngrad/inception/bingrad_common.py``, ``stochastical_binarize_gradients``:
    ``rnd = uniform(0, scaler)``; ``sign(g) * scaler`` where ``rnd < |g|``, else 0. An entry beyond the
    scaler always passes: that is the reference's clipping (``clip_gradients_by_stddev`` is never called).

    ``rnd`` comes from lgc's draw ``u`` (``U[0, 1)``): ``scaler * u`` for a negative entry and
    ``scaler * (1 - u)`` for a positive one. Both are ``U[0, scaler)`` draws; this coupling makes the
    reference's event ``rnd < |g|`` lgc's stochastic rounding ``floor(g / scaler + u) != 0``, so the two
    draw the same Bernoulli outcomes (up to fp32 rounding at the boundary, which no entry here meets)."""
    rnd = scaler * torch.where(g > 0, 1.0 - u, u)
    return torch.where(rnd < torch.abs(g), torch.sign(g) * scaler, torch.zeros_like(g))


def _worker_ternary(g: torch.Tensor, clip_factor: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One worker's ternary gradient, its scale, and whether the reference's scaler is the one lgc uses.

    Where the reference's clipping binds (``clip_factor * sigma <= max |g|``, or no clipping) the scaler is
    the reference's. Where it does not, lgc departs: it scales by ``max |g|`` of the clipped gradient (the
    paper's ``s_t = ||clip(g)||_inf``, ``lgc/compressors/terngrad.py``), the reference by
    ``clip_factor * sigma > max |g|``; both are unbiased. The comparison then takes lgc's scaler."""
    scaler = _reference_scaler(g, clip_factor)
    largest = torch.max(torch.abs(g))
    binds = bool(scaler <= largest)
    if not binds:
        scaler = largest
    return _reference_ternarize(g, scaler, u), scaler, binds


def _ternary_levels(compressor: TernGradCompressor, g: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    payload = compressor.compress(g, key)
    decoded = compressor.decompress(payload)
    return decoded, payload.scales.reshape(())


@pytest.mark.parametrize(
    ("clip_sigma", "values", "binds"),
    [
        (None, "gaussian", True),  # no clipping: scaler max |g|, the reference's clip_factor 0
        (2.5, "gaussian", True),  # 10,000 normal entries: max |g| ~ 4 sigma, the 2.5-sigma clipping binds
        (2.5, "uniform", False),  # uniform entries: max |g| = sqrt(3) sigma < 2.5 sigma, it does not
    ],
)
def test_terngrad_draws_the_reference_ternary_values_over_several_steps(clip_sigma, values, binds):
    """Single process, 5 steps of one tensor (lgc's draws advancing per call): lgc's decoded values are the
    reference's ``sign(g) * scaler`` or 0 entry for entry, with the reference's scaler where its clipping
    binds (to fp32 rounding: the standard deviation's reductions differ) and ``max |g|`` where it does not."""
    compressor = TernGradCompressor(clip_sigma=clip_sigma)
    clip_factor = 0.0 if clip_sigma is None else clip_sigma
    for count in range(5):
        g = (
            _randn(10_000, seed=count)
            if values == "gaussian"
            else torch.rand(10_000, generator=torch.Generator().manual_seed(count)) * 2 - 1
        )
        decoded, scale = _ternary_levels(compressor, g, "w")
        assert compressor.draws["w"] == count + 1
        expected, scaler, reference_binds = _worker_ternary(g, clip_factor, _lgc_uniforms(0, "w", count, g.numel()))
        assert reference_binds == binds
        torch.testing.assert_close(scale, scaler, rtol=1e-6, atol=0)
        assert torch.equal(torch.sign(decoded), torch.sign(expected))  # the same Bernoulli outcome everywhere
        torch.testing.assert_close(decoded, expected, rtol=1e-6, atol=0)
        if not binds:
            assert scale == g.abs().max() < _reference_scaler(g, clip_factor)  # the departure, its direction


_TERN_LR = 0.05


@pytest.mark.multiprocess
@pytest.mark.parametrize("clip_sigma", [2.5, None])
def test_terngrad_through_the_hook_is_the_reference_ternarization_averaged(clip_sigma):
    """``lgc.compress(model, "terngrad")`` on 2 DDP workers, 6 steps, every tensor ternarized from the first
    step (as the reference's ``size_to_binarize=1``, ``quantize_logits=True`` scripts do), against the
    transcription of each worker's ternarization of its own gradient with lgc's draws, averaged
    (``average_gradients``) without the reference's shared ``max_scalers`` (lgc's documented departure:
    each worker its own scale). The averaged gradient agrees entry for entry at every step to the
    rounding of the standard deviation (a wrong Bernoulli outcome would be off by half a scale), and
    the weights follow; the draws are the state (one per tensor and step).

    With 2.5-sigma clipping the weights' gradients (2048 and 640 entries) always have ``max |g|`` beyond
    ``2.5 sigma`` (the reference's scaler is lgc's); the biases (64 and 10 entries) often do not (5 and 11
    of their 12 worker-steps), where lgc scales by ``max |g|`` and the reference by ``2.5 sigma`` (the
    departure docs/methods.md lists, :func:`_worker_ternary`).
    """
    from distributed import run_workers

    clip_factor = 0.0 if clip_sigma is None else clip_sigma
    results = run_workers(_hook_worker, WORLD, "terngrad", STEPS, _TERN_LR, {"clip_sigma": clip_sigma})
    assert all(
        r["compressor"].startswith(f"TernGradCompressor(bucket_size=None, clip_sigma={clip_sigma}") for r in results
    )
    params = _initial_params()
    departed: dict[str, int] = {name: 0 for name in params}
    for step in range(STEPS):
        records = [r["records"][step] for r in results]
        for name, p in params.items():
            assert all(record["draws"][name] == step + 1 for record in records)
            ternaries, scalers = [], []
            for record in records:
                g = record["own"][name].reshape(-1)
                u = _lgc_uniforms(record["seed"], name, step, g.numel())
                ternary, scaler, binds = _worker_ternary(g, clip_factor, u)
                departed[name] += not binds
                ternaries.append(ternary)
                scalers.append(scaler)
            expected = (torch.stack(ternaries).sum(0) / WORLD).view_as(p)
            averaged = records[0]["averaged"][name]
            assert torch.equal(averaged, records[1]["averaged"][name])
            tolerance = 4e-7 * float(max(scalers))  # a few ulps of the scale; a wrong outcome costs >= scale / 2
            torch.testing.assert_close(averaged, expected, rtol=0, atol=tolerance, msg=f"step {step}, {name}")
            p.sub_(expected, alpha=_TERN_LR)
            for record in records:
                torch.testing.assert_close(record["params"][name], p, rtol=1e-6, atol=1e-7)
    if clip_sigma is None:
        assert all(count == 0 for count in departed.values())
    else:
        assert departed["0.weight"] == departed["2.weight"] == 0
        assert departed["0.bias"] > 0 and departed["2.bias"] > 0, departed  # 5 and 11 of 12 when written
