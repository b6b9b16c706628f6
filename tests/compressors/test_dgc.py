"""Deep Gradient Compression: momentum correction, masking, warm-up, sampled threshold, DDP training."""

import copy
import io
import math
import random
from collections.abc import Callable

import pytest
import torch
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lgc import ErrorFeedback, TopKCompressor, register_compression_hook
from lgc.compressors import SparsePayload
from lgc.compressors.base import keyed_seed
from lgc.compressors.dgc import PAPER_WARMUP_DENSITIES, DGCCompressor
from lgc.compressors.selection import ColumnScan, sampled_topk
from lgc.compressors.topk import num_selected
from lgc.ddp.hook import CompressionHookState


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _dyadic(n: int, seed: int) -> torch.Tensor:
    """Multiples of 1/4 in [-8, 8]: with momentum 0.5 every sum below is exact in fp32, so the
    compressor must match the formulas bit for bit whatever order or FMA it computes them with."""
    return torch.randint(-32, 33, (n,), generator=torch.Generator().manual_seed(seed)).float() / 4


def _dense(payload: SparsePayload) -> torch.Tensor:
    return payload.to_dense()


def _assert_threshold_selection(x: torch.Tensor, positions: torch.Tensor) -> None:
    """Distinct positions, and every selected |x| >= every unselected |x|."""
    assert positions.unique().numel() == positions.numel()
    selected = torch.zeros(x.numel(), dtype=torch.bool)
    selected[positions] = True
    if (~selected).any():
        assert x.abs()[selected].min() >= x.abs()[~selected].max()


# -- (1) density 1: DGC sends exactly what heavy-ball SGD steps along --------------------------------
# With density 1 every entry is sent every step and v is emptied, so the sent vector is u_t:
#   masking off: u_t = m u_{t-1} + g_t, heavy-ball SGD's momentum buffer (torch.optim.SGD's
#     update direction), so DGC + SGD(momentum=0) == SGD(momentum=m);
#   Nesterov, masking off: u_t = m (u_{t-1} + g_t) = m b_t with b_t SGD's buffer, and the sent
#     u_t + g_t = g_t + m b_t is exactly SGD(nesterov=True)'s update direction;
#   masking on: u is zeroed everywhere after every step, so u_t = g_t: momentum never builds up
#     and DGC at density 1 is plain SGD without momentum.


def _sgd_directions(grads: list[torch.Tensor], momentum: float, nesterov: bool) -> list[torch.Tensor]:
    """The step directions torch.optim.SGD(lr=1) takes for these gradients."""
    param = torch.zeros_like(grads[0], requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=1.0, momentum=momentum, nesterov=nesterov)
    directions = []
    for g in grads:
        with torch.no_grad():
            param.zero_()  # from 0 with lr 1 the step is exactly -direction
        param.grad = g.clone()
        optimizer.step()
        directions.append(-param.detach().clone())
    return directions


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_without_masking_sends_heavy_ball_sgd_updates_exactly(nesterov):
    grads = [_dyadic(3000, seed) for seed in range(8)]
    dgc = DGCCompressor(1.0, momentum=0.5, nesterov=nesterov, momentum_masking=False, warmup_densities=[])
    sent = [dgc.decompress(dgc.compress(g, "w")) for g in grads]
    for got, expected in zip(sent, _sgd_directions(grads, 0.5, nesterov), strict=True):
        assert torch.equal(got, expected)
    assert torch.count_nonzero(dgc.velocities["w"]) == 0


@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_matches_momentum_sgd_to_rounding_with_momentum_0_9(nesterov):
    grads = [_randn(5000, seed) for seed in range(20)]
    dgc = DGCCompressor(1.0, momentum=0.9, nesterov=nesterov, momentum_masking=False, warmup_densities=[])
    for g, expected in zip(grads, _sgd_directions(grads, 0.9, nesterov), strict=True):
        # The compressor computes g + m*u in one FMA pass, SGD as mul_ then add_: 1 ulp apart per step.
        torch.testing.assert_close(dgc.decompress(dgc.compress(g, "w")), expected, rtol=1e-5, atol=1e-6)


def test_density_one_with_masking_is_plain_sgd_without_momentum():
    dgc = DGCCompressor(1.0, momentum=0.9, warmup_densities=[])
    for seed in range(5):
        g = _randn(2000, seed)
        assert torch.equal(dgc.decompress(dgc.compress(g, "w")), g)
        assert torch.count_nonzero(dgc.momenta["w"]) == 0


# -- (1b) weight decay with a momentum of its own -------------------------------------------------
# torch.optim.SGD(momentum=m, weight_decay=wd) steps along the momentum of g + wd * w. DGC's authors
# keep wd * w in a momentum of its own (DGCSGD), which by linearity is the same update; lgc's DGC adds
# that momentum to the averaged update (finish_aggregate), so in the dense limit (density 1, masking
# off) DGC + SGD(momentum=0, weight_decay=0) is that optimizer, for compressed and dense tensors.
# Decay left in the optimizer instead acts outside the momentum: at equilibrium u = g / (1 - m), so
# it is (1 - m) * wd, 10x weaker at m = 0.9 (the defect this section guards against).
_WD = 0.5
_LR = 0.05


def _regression() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(256, 20, generator=gen)
    target = features @ torch.randn(20, 5, generator=gen) + 0.5 * torch.randn(256, 5, generator=gen)
    return features, target


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(20, 5)  # a 100-entry weight (compressed below) and a 5-entry bias (sent dense)


def _train_regression(
    optimizer_kwargs: dict, dgc: DGCCompressor | None, steps: int, make_optimizer=None
) -> list[list[torch.Tensor]]:
    """Parameters after every step; with ``dgc``, gradients go through it as the hook would send them.

    One process stands in for the hook with world size 1 (:func:`_as_the_hook_averages`).
    """
    features, target = _regression()
    model = _linear()
    if dgc is not None:
        dgc.attach_parameters(dict(model.named_parameters()))
    if make_optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=_LR, **optimizer_kwargs)
    else:
        optimizer = make_optimizer(model.parameters())
    trajectory = []
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * (model(features) - target).square().sum(1).mean()).backward()
        if dgc is not None:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    averaged = _as_the_hook_averages([dgc], [param.grad], name, param.numel() >= 64)
                    param.grad.copy_(averaged.view_as(param))
        optimizer.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


def _as_the_hook_averages(
    workers: list[DGCCompressor], grads: list[torch.Tensor], name: str, compressed: bool
) -> torch.Tensor:
    """One parameter's averaged update as :class:`lgc.ddp.exchange.PayloadExchange` forms it (worker r: ``grads[r]``).

    Each worker's gradient is divided by the world size; a compressed parameter's payloads are
    summed with ``aggregate_into`` (the allgather's decoding), a dense one's ``transform_dense``
    results are summed (the allreduce); then every worker's ``finish_aggregate`` completes its copy
    of the sum, which must come out the same on every worker (nothing of it is sent).
    """
    world = len(workers)
    shares = [grad.reshape(-1) / world for grad in grads]
    if compressed:
        total = torch.empty(shares[0].numel())
        workers[0].aggregate_into(
            [dgc.compress(share, name) for dgc, share in zip(workers, shares, strict=True)], total
        )
    else:
        total = torch.stack([dgc.transform_dense(share, name) for dgc, share in zip(workers, shares, strict=True)]).sum(
            0
        )
    finished = [total.clone() for _ in workers]
    for dgc, mine in zip(workers, finished, strict=True):
        dgc.finish_aggregate(mine, name)
    assert all(torch.equal(mine, finished[0]) for mine in finished)
    return finished[0]


def _dense_limit_dgc(nesterov: bool, weight_decay: float, world_size: int = 1) -> DGCCompressor:
    return DGCCompressor(
        1.0,
        momentum=0.9,
        nesterov=nesterov,
        momentum_masking=False,
        warmup_densities=[],
        weight_decay=weight_decay,
        world_size=world_size,
    )


def _norm(params: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([p.reshape(-1) for p in params])))


@pytest.mark.parametrize("nesterov", [False, True])
def test_dense_limit_with_weight_decay_is_momentum_sgd_with_weight_decay_step_for_step(nesterov):
    steps = 60
    expected = _train_regression(dict(momentum=0.9, weight_decay=_WD, nesterov=nesterov), None, steps)
    dgc = _dense_limit_dgc(nesterov, _WD)
    got = _train_regression(dict(momentum=0.0, weight_decay=0.0), dgc, steps)
    for step, (mine, reference) in enumerate(zip(got, expected, strict=True)):
        for param, ref in zip(mine, reference, strict=True):
            torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")
    assert sorted(dgc.velocities) == ["weight"] and sorted(dgc.dense_momenta) == ["bias"]


# Nesterov's case runs with -m slow: the decay's placement is the same question with either momentum.
@pytest.mark.parametrize("nesterov", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_weight_decay_outside_dgc_is_one_minus_m_weaker_and_inside_it_is_not(nesterov):
    """Equilibrium norms (measured: dense SGD 7.676, DGC with the decay 7.676, decay in the optimizer 11.118).

    Before the decay moved into DGC, the dgc config left it in the optimizer: the weights settled
    where dense momentum SGD with a decay of (1 - m) * wd settles, not with wd.
    """
    steps = 400  # converged by then (the norms agree to 1e-7 with 800 steps)
    dense = _norm(_train_regression(dict(momentum=0.9, weight_decay=_WD, nesterov=nesterov), None, steps)[-1])
    weaker = _norm(_train_regression(dict(momentum=0.9, weight_decay=0.1 * _WD, nesterov=nesterov), None, steps)[-1])
    inside = _norm(_train_regression(dict(momentum=0.0), _dense_limit_dgc(nesterov, _WD), steps)[-1])
    outside = _norm(_train_regression(dict(momentum=0.0, weight_decay=_WD), _dense_limit_dgc(nesterov, 0.0), steps)[-1])
    assert inside == pytest.approx(dense, rel=1e-5)
    assert outside == pytest.approx(weaker, rel=1e-4)
    assert outside > 1.4 * dense


def test_dgc_config_in_the_dense_limit_trains_like_the_dense_config():
    """compressor=dgc (density 1, masking off) against compressor=none with heavy-ball momentum.

    Optimizer and compressor are built from the composed configs, as lgc-train builds them: the
    dgc config must move the weight decay into the compressor, otherwise its weights decay
    (1 - m) times more slowly and drift from the dense run's (5e-4, lr 0.1: ~1e-4 after 60 steps).
    """
    import hydra
    from hydra import compose, initialize_config_module

    from lgc.methods import build_compressor

    dense_limit = ["compressor.density=1.0", "compressor.momentum_masking=false", "compressor.warmup_densities=[]"]
    with initialize_config_module("lgc.conf", version_base="1.3"):
        dgc_cfg = compose("train", overrides=["compressor=dgc", *dense_limit])
        dense_cfg = compose("train", overrides=["compressor=none", "optimizer.nesterov=false"])
    dgc = build_compressor(dgc_cfg.compressor)
    steps = 60
    got = _train_regression({}, dgc, steps, hydra.utils.instantiate(dgc_cfg.optimizer))
    expected = _train_regression({}, None, steps, hydra.utils.instantiate(dense_cfg.optimizer))
    for step, (mine, reference) in enumerate(zip(got, expected, strict=True)):
        for param, ref in zip(mine, reference, strict=True):
            torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")


def test_the_decay_is_never_sent_and_every_worker_adds_the_same_momentum_once():
    """The payloads carry the gradient alone; ``d = m*d + wd*w`` is added once to their sum, alike on every worker.

    Density 1 with masking (the default): every entry is sent and u is zeroed every step, so the
    payloads sum to the mean gradient and the update is ``mean + d``: the gradient steps without
    momentum, the decay with its own.
    """
    world, n, m, wd = 4, 3000, 0.9, 0.01
    weight = _randn(n, 7)
    workers = [DGCCompressor(1.0, momentum=m, warmup_densities=[], weight_decay=wd) for _ in range(world)]
    for dgc in workers:
        dgc.attach_parameters({"w": weight, "b": weight[:10]})
    d, u_dense = torch.zeros(n), torch.zeros(10)
    for step in range(3):
        grads = [_randn(n, 10 * step + rank) for rank in range(world)]
        mean = torch.stack(grads).mean(0)
        payloads = [dgc.compress(g / world, "w") for dgc, g in zip(workers, grads, strict=True)]
        assert all(p.nbytes == 8 * n for p in payloads)
        torch.testing.assert_close(workers[0].aggregate(payloads), mean)  # no decay on the wire
        d = m * d + wd * weight
        finished = []
        for dgc in workers:
            total = workers[0].aggregate(payloads)
            dgc.finish_aggregate(total, "w")
            finished.append(total)
        assert all(torch.equal(total, finished[0]) for total in finished)
        torch.testing.assert_close(finished[0], mean + d, rtol=1e-6, atol=1e-7)
        dense = torch.stack([dgc.transform_dense(g[:10] / world, "b") for dgc, g in zip(workers, grads, strict=True)])
        u_dense = m * u_dense + mean[:10]
        torch.testing.assert_close(dense.sum(0), u_dense)  # a dense tensor's payload: momentum, no decay
    assert all(sorted(dgc.decay_momenta) == ["w"] for dgc in workers)


def test_weight_decay_refuses_to_run_without_the_weights():
    dgc = DGCCompressor(0.01, weight_decay=1e-4, warmup_densities=[])
    dgc.compress(_randn(1000), "w")  # the payload carries no decay: compressing needs no weights
    dgc.transform_dense(_randn(10), "b")
    with pytest.raises(ValueError, match=r"weight_decay=0.0001 needs the model's weights.*attach_parameters"):
        dgc.finish_aggregate(torch.zeros(1000), "w")
    dgc.attach_parameters({"w": torch.zeros(1000)})
    with pytest.raises(ValueError, match="update for 'v' but no parameter of that name"):
        dgc.finish_aggregate(torch.zeros(1000), "v")
    with pytest.raises(ValueError, match="parameter 'w' has 1000 elements but its update 999"):
        dgc.finish_aggregate(torch.zeros(999), "w")
    # Without weight decay nothing needs attaching.
    DGCCompressor(0.01).finish_aggregate(torch.zeros(1000), "w")


def test_attached_weights_are_neither_pickled_nor_checkpointed():
    import pickle

    model = _linear()
    dgc = DGCCompressor(1.0, weight_decay=1e-4, warmup_densities=[])
    state = CompressionHookState(dgc, min_numel=0)
    dgc.attach_parameters(dict(model.named_parameters()))
    dgc.compress(_randn(100), "weight")
    dgc.finish_aggregate(torch.zeros(100), "weight")
    copy = pickle.loads(pickle.dumps(state))  # what a spawned worker receives
    assert copy.compressor._parameters is None and dgc._parameters is not None
    assert copy.compressor.weight_decay == 1e-4 and torch.equal(
        copy.compressor.velocities["weight"], dgc.velocities["weight"]
    )
    assert set(dgc.state_dict()) == {"momenta", "velocities", "dense_momenta", "decay_momenta", "draws", "epoch"}
    # DGC's own buffers, not the model's weights.
    assert sorted(dgc.state_dict()["velocities"]) == sorted(dgc.state_dict()["decay_momenta"]) == ["weight"]


# -- (1c) the authors' code, step for step -------------------------------------------------------------
def _authors_sparsify(tensor: torch.Tensor, compress_ratio: float, draw: int) -> torch.Tensor:
    """The indices DGC's authors send: synxlin/deep-gradient-compression, ``dgc/compression.py``,
    ``DGCCompressor.initialize`` (strided sampling, ``sample_ratio=0.01``) and ``_sparsify``
    (``compress_upper_bound=1.3``, ``compress_lower_bound=0.8``, ``max_adaptation_iters=10``,
    ``resample=True``), transcribed for one tensor; ``draw % sample_stride`` replaces
    ``random.randint(0, sample_stride - 1)``."""
    numel = tensor.numel()
    pct_numel = int(math.ceil(numel * 0.01))
    cpr_numel = int(math.ceil(2 / compress_ratio))
    if numel <= cpr_numel:
        sample_stride = 1
        num_samples = numel
    else:
        sample_stride = int(math.ceil(numel / max(pct_numel, cpr_numel) / 32)) * 32 + 1
        num_samples = numel // sample_stride
        while num_samples < max(pct_numel, cpr_numel):
            sample_stride = sample_stride - 8
            num_samples = numel // sample_stride
    top_k_samples = int(math.ceil(num_samples * compress_ratio))
    num_selects = int(math.ceil(numel * compress_ratio))

    tensor = tensor.view(-1)
    importance = tensor.abs()
    if numel == num_samples:
        samples = importance
    else:
        sample_start = draw % sample_stride
        samples = importance[sample_start::sample_stride]
    threshold = torch.min(torch.topk(samples, top_k_samples, 0, largest=True, sorted=False)[0])
    mask = torch.ge(importance, threshold)
    indices = mask.nonzero().view(-1)
    num_indices = indices.numel()
    if numel > num_samples:
        for _ in range(10):
            if num_indices > num_selects:
                if num_indices > num_selects * 1.3:
                    indices = indices[torch.topk(importance[indices], num_selects, 0, largest=True, sorted=False)[1]]
                    break
                else:
                    break
            elif num_indices < 0.8 * num_selects:
                threshold = threshold * 0.8
            else:
                break
            mask = torch.ge(importance, threshold)
            indices = mask.nonzero().view(-1)
            num_indices = indices.numel()
    return indices[:num_selects]


class _AuthorsDGC:
    """A transcription of one DGC training step as the authors' code takes it, over simulated workers.

    synxlin/deep-gradient-compression:

    * ``dgc/memory.py``, ``DGCSGDMemory.compensate`` / ``update``: per worker and tensor, momentum
      correction of the worker's own gradient (``mmt = m*mmt + g; vec += mmt``; Nesterov
      ``mmt = m*(mmt + g); vec += mmt + g``) and, after selection, momentum factor masking
      (``mmt`` and ``vec`` zeroed at the sent indices);
    * ``dgc/compression.py``, ``DGCCompressor.compress`` / ``decompress``: a tensor is sparsified
      when ``compress_ratio < 1`` and it has more than one dimension (``train.py`` registers only
      those); its sent values are summed into a zero tensor (``index_put_(accumulate=True)``) and
      multiplied by ``1 / world_size`` (horovod's Average). Every other tensor is allreduced with
      Average and gets plain momentum on the average (``compensate(accumulate=False)``);
    * ``dgc/optim/sgd.py``, ``DGCSGD.step``: the weight decay in a momentum buffer of its own
      (``buf = wd*p`` at the first step, then ``buf = m*buf + wd*p``) and
      ``p -= lr * (buf + received)`` (Nesterov: ``p -= lr * (wd*p + m*buf + received)``).

    Horovod's collectives become sums over the simulated workers. ``_sparsify`` is transcribed with
    its sampled threshold (:func:`_authors_sparsify`); its one change is the sample's random start,
    ``random.randint(0, stride - 1)`` in their code, here the draw lgc's DGC takes for the same
    tensor and step (``keyed_seed(0, name, count) % stride``), so both sample the same entries.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        *,
        world: int,
        density: float,
        momentum: float,
        weight_decay: float,
        lr: float,
        nesterov: bool = False,
    ) -> None:
        self.params = {name: p.detach().clone() for name, p in params.items()}
        self.world, self.density, self.momentum, self.nesterov = world, density, momentum, nesterov
        self.weight_decay, self.lr = weight_decay, lr
        self.momentums = [{name: torch.zeros_like(p) for name, p in self.params.items()} for _ in range(world)]
        self.velocities = [{name: torch.zeros_like(p) for name, p in self.params.items()} for _ in range(world)]
        self.buffers: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}  # compressed steps per tensor: the sample start's draw

    def compressed(self, name: str) -> bool:
        return self.density < 1.0 and self.params[name].dim() > 1

    def _compensate(self, rank: int, name: str, grad: torch.Tensor, accumulate: bool) -> torch.Tensor:
        mmt, m = self.momentums[rank][name], self.momentum
        if accumulate:
            vec = self.velocities[rank][name]
            if self.nesterov:
                mmt.add_(grad).mul_(m)
                vec.add_(mmt).add_(grad)
            else:
                mmt.mul_(m).add_(grad)
                vec.add_(mmt)
            return vec
        if self.nesterov:
            mmt.add_(grad).mul_(m)
            return mmt.add(grad)
        mmt.mul_(m).add_(grad)
        return mmt.clone()

    def step(self, grads: list[dict[str, torch.Tensor]]) -> None:
        """One optimizer step; ``grads[rank][name]`` is worker ``rank``'s own gradient."""
        received = {}
        for name, p in self.params.items():
            if self.compressed(name):
                total = torch.zeros(p.numel())
                for rank in range(self.world):
                    vec = self._compensate(rank, name, grads[rank][name], accumulate=True).view(-1)
                    indices = _authors_sparsify(vec, self.density, keyed_seed(0, name, self.counts.get(name, 0)))
                    values = vec[indices]
                    self.momentums[rank][name].view(-1).index_fill_(0, indices, 0)  # momentum_masking=True
                    vec.index_fill_(0, indices, 0)
                    total.index_put_([indices], values, accumulate=True)
                received[name] = total.mul_(1.0 / self.world).view_as(p)
                self.counts[name] = self.counts.get(name, 0) + 1
            else:
                average = torch.stack([grads[rank][name] for rank in range(self.world)]).sum(0) / self.world
                received[name] = self._compensate(0, name, average, accumulate=False)
        for name, p in self.params.items():
            d_p = self.weight_decay * p
            if name not in self.buffers:
                buf = self.buffers[name] = d_p
            else:
                buf = self.buffers[name]
                buf.mul_(self.momentum).add_(d_p)
            d_p = d_p.add(buf, alpha=self.momentum) if self.nesterov else buf
            p.add_(d_p.add(received[name]), alpha=-self.lr)


def _lgc_dgc_run(
    params: dict[str, torch.Tensor],
    grads_of: Callable[[int], list[dict[str, torch.Tensor]]],
    steps: int,
    *,
    world: int,
    lr: float,
    **dgc_kwargs,
) -> dict[str, torch.Tensor]:
    """lgc's DGC on simulated workers (:func:`_as_the_hook_averages`) + ``SGD(momentum=0)``: the final weights.

    A parameter is compressed when it has more than one dimension, as the authors' ``train.py``
    decides (the hook decides by ``min_numel``; here it is told which).
    """
    weights = {name: p.detach().clone() for name, p in params.items()}
    workers = [DGCCompressor(warmup_densities=[], **dgc_kwargs) for _ in range(world)]
    for dgc in workers:
        dgc.attach_parameters(weights)  # synchronized weights: every worker sees the same
    for step in range(steps):
        grads = grads_of(step)
        updates = {
            name: _as_the_hook_averages(workers, [g[name] for g in grads], name, p.dim() > 1)
            for name, p in weights.items()
        }
        for name, p in weights.items():
            p.add_(updates[name].view_as(p), alpha=-lr)  # torch.optim.SGD(momentum=0)'s step
    return weights


def _toy_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """A conv weight, a linear weight (compressed) and two vectors (sent dense)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"conv.weight": (16, 8, 3, 3), "fc.weight": (10, 100), "fc.bias": (10,), "bn.weight": (16,)}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _shrinkage(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    norm = lambda params: float(torch.linalg.vector_norm(torch.cat([p.reshape(-1) for p in params.values()])))  # noqa: E731
    return 1.0 - norm(after) / norm(before)


@pytest.mark.parametrize("density", [1.0, 0.01, 0.001])
def test_zero_gradient_shrinkage_is_the_authors_at_every_density(density):
    """300 steps of zero gradient (2 workers, masking on): the weights shrink exactly as DGCSGD shrinks them.

    All the shrinkage is the weight decay's, so this compares the decay alone. Added to the
    gradient inside the masked accumulator instead, the decay reached 11 %, 76 % and 42 % of the
    authors' shrinkage at densities 1, 1 % and 0.1 % (lr 0.1, wd 5e-4, m 0.9: 13.6 % of the norm).
    Through the real hook, a gradient that is zero on every rank marks a parameter unused and the
    hook leaves it alone; this drives the compressor as the hook does for parameters in use.
    """
    params, world, steps, lr, wd = _toy_params(), 2, 300, 0.1, 5e-4
    zeros = [{name: torch.zeros_like(p) for name, p in params.items()} for _ in range(world)]
    authors = _AuthorsDGC(params, world=world, density=density, momentum=0.9, weight_decay=wd, lr=lr)
    for _ in range(steps):
        authors.step(zeros)
    mine = _lgc_dgc_run(
        params, lambda step: zeros, steps, world=world, lr=lr, density=density, momentum=0.9, weight_decay=wd
    )
    reference = _shrinkage(params, authors.params)
    assert reference == pytest.approx(0.136, abs=0.001)
    assert _shrinkage(params, mine) == pytest.approx(reference, rel=1e-5)
    for name, p in mine.items():
        torch.testing.assert_close(p, authors.params[name], rtol=1e-6, atol=1e-7, msg=name)
        assert bool((p != params[name]).all()), f"{name}: some weights were never decayed"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("density", [0.1, 0.01])
def test_dgc_step_is_the_authors_with_momentum_correction_masking_and_weight_decay(density, nesterov, world):
    """Random gradients, 40 steps: lgc's DGC + SGD(momentum=0) against the transcription of the authors' step."""
    params, steps, lr = _toy_params(1), 40, 0.05
    gradients = [
        [
            {
                name: torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + i))
                for i, (name, p) in enumerate(params.items())
            }
            for rank in range(world)
        ]
        for step in range(steps)
    ]
    authors = _AuthorsDGC(
        params, world=world, density=density, momentum=0.9, nesterov=nesterov, weight_decay=0.01, lr=lr
    )
    for grads in gradients:
        authors.step(grads)
    mine = _lgc_dgc_run(
        params,
        lambda step: gradients[step],
        steps,
        world=world,
        lr=lr,
        density=density,
        momentum=0.9,
        nesterov=nesterov,
        weight_decay=0.01,
    )
    for name, p in mine.items():
        assert not torch.equal(p, params[name])
        torch.testing.assert_close(p, authors.params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_density_one_without_masking_is_the_authors_uncompressed_path():
    """At density 1 the authors' code does not compress (plain momentum on the average, no masking).

    lgc's density 1 masks (see the module docstring); with ``momentum_masking=False`` it is the authors'.
    """
    params, world, steps, lr = _toy_params(2), 2, 30, 0.05
    gradients = [
        [{n: _randn(p.numel(), 100 * s + r).view_as(p) for n, p in params.items()} for r in range(world)]
        for s in range(steps)
    ]
    authors = _AuthorsDGC(params, world=world, density=1.0, momentum=0.9, weight_decay=0.01, lr=lr)
    for grads in gradients:
        authors.step(grads)
    kwargs = dict(world=world, lr=lr, density=1.0, momentum=0.9, weight_decay=0.01)
    unmasked = _lgc_dgc_run(params, lambda step: gradients[step], steps, momentum_masking=False, **kwargs)
    masked = _lgc_dgc_run(params, lambda step: gradients[step], steps, **kwargs)
    for name, p in unmasked.items():
        torch.testing.assert_close(p, authors.params[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(masked["conv.weight"], authors.params["conv.weight"], rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_decay_joins_a_half_precision_bucket_rounded_once(dtype):
    """A model in fp16/bf16: the momentum stays fp32, the term is rounded once into the bucket's dtype."""
    weight = _randn(500, 1).to(dtype)
    dgc = DGCCompressor(0.01, weight_decay=0.01, warmup_densities=[])
    dgc.attach_parameters({"w": weight})
    d = torch.zeros(500)
    for step in range(3):
        bucket = _randn(500, 10 + step).to(dtype)
        expected = bucket.float()
        d = 0.9 * d + 0.01 * weight.float()
        dgc.finish_aggregate(bucket, "w")
        assert bucket.dtype == dtype and dgc.decay_momenta["w"].dtype == torch.float32
        assert torch.equal(bucket, (expected + d).to(dtype))


def test_the_decay_momentum_survives_a_checkpoint():
    params = _toy_params(3)
    original = DGCCompressor(0.01, weight_decay=0.01, nesterov=True, warmup_densities=[])
    original.attach_parameters(params)
    for _ in range(3):
        for name, p in params.items():
            original.finish_aggregate(torch.zeros(p.numel()), name)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)  # as it goes into a checkpoint
    buffer.seek(0)
    restored = DGCCompressor(0.01, weight_decay=0.01, nesterov=True, warmup_densities=[])
    restored.load_state_dict(torch.load(buffer))
    restored.attach_parameters(params)
    fresh = DGCCompressor(0.01, weight_decay=0.01, nesterov=True, warmup_densities=[])
    fresh.attach_parameters(params)
    for name, p in params.items():
        a, b, c = (torch.zeros(p.numel()) for _ in range(3))
        original.finish_aggregate(a, name)
        restored.finish_aggregate(b, name)
        fresh.finish_aggregate(c, name)
        assert torch.equal(a, b)
        assert not torch.allclose(a, c)  # without the saved momentum the decay would restart from zero
    assert all(t.device.type == "cpu" for t in original.state_dict()["decay_momenta"].values())


def _hook_against_the_authors(rank: int, world: int, steps: int, density: float) -> dict:
    """Gloo workers: DDP + lgc's hook + DGC + SGD(momentum=0) against the transcription fed every worker's gradient."""

    def loss(module: nn.Module, worker: int, step: int) -> torch.Tensor:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + worker))
        return module(x).square().mean()

    def hooked(net: nn.Module) -> tuple[DDP, CompressionHookState, torch.optim.Optimizer]:
        model = DDP(net)
        dgc = DGCCompressor(density, momentum=0.9, weight_decay=0.01, warmup_densities=[], world_size=world)
        # min_numel 100: the weights (2048 and 640 entries) are compressed, the biases sent dense, as
        # the authors split by dimension.
        state = register_compression_hook(model, dgc, min_numel=100, start_iter=0)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    authors = _AuthorsDGC(
        dict(net.named_parameters()), world=world, density=density, momentum=0.9, weight_decay=0.01, lr=0.05
    )
    scaled, scaled_state, scaled_optimizer = hooked(copy.deepcopy(net))
    model, state, optimizer = hooked(net)
    # AMP's loss scale, doubled every step: the hook hands DGC unscaled gradients and adds the decay
    # in those units, so the run must not change (the scales are powers of two).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scaled_state.loss_scale = scaler.get_scale
    for step in range(steps):
        optimizer.zero_grad()
        loss(model, rank, step).backward()
        optimizer.step()
        scaled_optimizer.zero_grad()
        scaler.scale(loss(scaled, rank, step)).backward()
        scaler.step(scaled_optimizer)
        scaler.update()
        grads = []
        for worker in range(world):  # every worker's gradient, at the transcription's weights
            with torch.no_grad():
                for name, p in plain.named_parameters():
                    p.copy_(authors.params[name])
            plain.zero_grad()
            loss(plain, worker, step).backward()
            grads.append({name: p.grad.clone() for name, p in plain.named_parameters()})
        authors.step(grads)
    return {
        "lgc": {name: p.detach().clone() for name, p in model.module.named_parameters()},
        "loss_scaled": {name: p.detach().clone() for name, p in scaled.module.named_parameters()},
        "authors": authors.params,
        "decayed": sorted(state.compressor.decay_momenta),
        "scale": scaler.get_scale(),
    }


@pytest.mark.multiprocess
def test_dgc_through_the_hook_is_the_authors_step():
    """Real DDP buckets and collectives, with and without a loss scale: every parameter follows the authors' step."""
    for result in run_workers(_hook_against_the_authors, 2, 12, 0.05):
        assert result["decayed"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert result["scale"] == 2.0 ** (10 + 12)
        for name, p in result["lgc"].items():
            torch.testing.assert_close(p, result["authors"][name], rtol=1e-5, atol=1e-6, msg=name)
            assert torch.equal(result["loss_scaled"][name], p), name


# -- (2) momentum factor masking and (3) the error-feedback invariant -------------------------------
SAMPLED = {"exact_below_numel": 0}  # force the sampled-threshold path on small tensors
EXACT = {}  # tensors below exact_below_numel use torch.topk


@pytest.mark.parametrize("masking", [True, False])
@pytest.mark.parametrize("path", [EXACT, SAMPLED], ids=["exact", "sampled"])
def test_masking_zeroes_u_and_v_at_sent_positions_and_v_keeps_exactly_the_unsent(masking, path):
    m, n = 0.5, 40_000
    dgc = DGCCompressor(0.01, momentum=m, momentum_masking=masking, warmup_densities=[], **path)
    u_prev, v_prev = torch.zeros(n), torch.zeros(n)
    for step in range(6):
        g = _dyadic(n, step)
        u_new = m * u_prev + g  # exact for dyadic inputs
        v_before = v_prev + u_new
        payload = dgc.compress(g, "w")
        sent = payload.indices.long()
        unsent = torch.ones(n, dtype=torch.bool)
        unsent[sent] = False
        u, v = dgc.momenta["w"], dgc.velocities["w"]
        # (3) v_before == decoded + v_after, exactly.
        assert torch.equal(_dense(payload) + v, v_before)
        assert torch.equal(payload.values, v_before[sent])
        # (2) v is zeroed where sent; u too with masking, untouched without.
        assert torch.count_nonzero(v[sent]) == 0
        assert torch.equal(v[unsent], v_before[unsent])
        assert torch.equal(u[unsent], u_new[unsent])
        if masking:
            assert torch.count_nonzero(u[sent]) == 0
        else:
            assert torch.equal(u[sent], u_new[sent])
        u_prev, v_prev = u.clone(), v.clone()


def test_nesterov_accumulates_u_plus_g():
    m, n = 0.5, 20_000
    dgc = DGCCompressor(0.01, momentum=m, nesterov=True, warmup_densities=[])
    u_prev, v_prev = torch.zeros(n), torch.zeros(n)
    for step in range(4):
        g = _dyadic(n, step)
        u_new = m * (u_prev + g)
        v_before = v_prev + u_new + g
        payload = dgc.compress(g, "w")
        assert torch.equal(_dense(payload) + dgc.velocities["w"], v_before)
        u_prev, v_prev = dgc.momenta["w"].clone(), dgc.velocities["w"].clone()


def test_momentum_zero_is_top_k_with_error_feedback():
    # (with an exact top-k in place of the sampled threshold: exact_below_numel above the tensor's size)
    dgc = DGCCompressor(0.01, momentum=0.0, warmup_densities=[], exact_below_numel=1 << 17)
    reference = ErrorFeedback(TopKCompressor(0.01))
    for step in range(5):
        g = _randn(30_000, step)
        assert torch.equal(_dense(dgc.compress(g, "w")), _dense(reference.compress(g, "w")))
    assert not dgc.momenta
    assert torch.equal(dgc.velocities["w"], reference.residuals["w"])
    assert dgc.residual_norm() == pytest.approx(reference.residual_norm())


def test_local_clipping_scales_by_inverse_sqrt_world_size():
    g = _randn(10_000) * 10
    dgc = DGCCompressor(1.0, momentum=0.0, clip_norm=2.0, world_size=4, warmup_densities=[])
    sent = dgc.decompress(dgc.compress(g, "w"))
    assert float(sent.norm()) == pytest.approx(2.0 / math.sqrt(4), rel=1e-5)
    torch.testing.assert_close(sent / sent.norm(), g / g.norm())
    small = g / g.norm() * 0.5  # below the limit: untouched
    assert torch.equal(DGCCompressor(1.0, momentum=0.0, clip_norm=2.0, world_size=4).compress(small, "w").values, small)


def test_a_world_size_given_must_be_the_hooks():
    hooked = DGCCompressor(0.01)
    assert hooked.world_size == 1  # outside a hook
    hooked.set_world_size(2)  # what the hook does at registration
    assert hooked.world_size == 2
    given = DGCCompressor(0.01, world_size=4)
    given.set_world_size(4)
    with pytest.raises(ValueError, match="DGC world_size=4, but the hook's process group has 2 workers"):
        given.set_world_size(2)


# -- (4) the sampled threshold -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("numel", "density"),
    [(300_000, 0.001), (36_864, 0.001), (2_000, 0.001), (640, 0.01), (50_000, 0.1), (147_456, 0.01)],
)
@pytest.mark.parametrize("seed", range(4))
def test_the_sampled_threshold_selects_what_the_authors_code_selects(numel, density, seed):
    """Every tensor size, the small ones included: the same sample start gives the authors' indices."""
    x = _randn(numel, seed) * torch.rand(numel, generator=torch.Generator().manual_seed(100 + seed))
    k = num_selected(numel, density)
    draw = random.Random(seed).getrandbits(64)

    class Draw:
        def randrange(self, stop):
            return draw % stop

    positions, info = sampled_topk(x, k, density=density, rng=Draw())
    expected = _authors_sparsify(x.clone(), density, draw)
    assert torch.equal(positions.sort().values, expected.sort().values), info
    assert positions.numel() <= k


def test_the_authors_sample_layout_at_the_paper_density():
    from lgc.compressors.selection import dgc_sample_layout

    # No larger than 2 / density: taken whole; above, at least 2 / density (or 1 %) entries at a stride 32m + 1 - 8j.
    assert dgc_sample_layout(2_000, 0.001) == (2_000, 1, 2)
    assert dgc_sample_layout(36_864, 0.001) == (36_864 // 17, 17, 3)
    num_samples, stride, hits = dgc_sample_layout(25_557_032 // 10, 0.001)
    assert num_samples >= 25_557_032 // 10 // 100 and stride % 8 == 1 and hits == math.ceil(num_samples * 0.001)


def test_survivors_above_k_are_cut_to_the_first_k_by_position():
    x = _randn(200_000, 3)
    k = 2000
    kth = float(torch.topk(x.abs(), k).values[-1])
    # A threshold that lets about 1.2 k through: all survive the window, the first k by position are sent.
    threshold = float(torch.topk(x.abs(), int(1.2 * k)).values[-1])
    positions, info = sampled_topk(x, k, density=k / 200_000, threshold=threshold)
    assert info.path == "threshold" and k < info.survivors <= 1.3 * k
    assert torch.equal(positions, torch.nonzero(x.abs() >= threshold).view(-1)[:k])
    assert float(x.abs()[positions].min()) < kth  # not the top k: the authors' cut is by position


def test_too_low_a_threshold_takes_an_exact_top_k_of_the_survivors():
    x = _randn(200_000)
    k = 2000
    positions, info = sampled_topk(x, k, density=0.01, threshold=0.5)
    assert info.path == "threshold+topk" and info.rounds == 0 and info.survivors > 1.3 * k
    assert positions.numel() == k
    _assert_threshold_selection(x, positions)
    assert set(positions.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_ties_at_the_threshold_still_give_exactly_k():
    x = torch.ones(200_000)
    x[::2] = -1.0
    positions, info = sampled_topk(x, 500, density=0.0025, rng=random.Random(0))
    assert info.path == "threshold+topk" and positions.numel() == 500


def test_too_high_a_threshold_is_lowered_by_0_8_per_round():
    x = _randn(200_000, 1)
    k = 2000
    kth = float(torch.topk(x.abs(), k).values[-1])
    positions, info = sampled_topk(x, k, density=0.01, threshold=kth * 1.25**3 * 1.01)
    assert info.rounds == 3 and info.path == "threshold"
    assert 0.8 * k <= info.survivors <= 1.3 * k
    assert torch.equal(positions, torch.nonzero(x.abs() >= info.threshold).view(-1)[:k])


def test_after_ten_rounds_what_passes_is_sent():
    x = _randn(200_000, 2)
    k = 2000
    half = float(torch.topk(x.abs(), k // 2).values[-1])
    positions, info = sampled_topk(x, k, density=0.01, threshold=half / 0.8**10 * 1.0001)
    assert info.rounds == 10 and info.path == "threshold"
    assert 0 < positions.numel() < 0.8 * k
    assert torch.equal(positions, torch.nonzero(x.abs() >= info.threshold).view(-1))
    # Nothing passes even after 10 rounds: an exact top-k, never an empty payload.
    positions, info = sampled_topk(x, k, density=0.01, threshold=1e30)
    assert info.path == "exact" and positions.numel() == k
    _assert_threshold_selection(x, positions)


@pytest.mark.parametrize("chunk", [None, 4096, 1 << 20])
@pytest.mark.parametrize("numel", [15, 16, 1000, 65_543, 2 * (1 << 20) + 12_345])
def test_column_scan_finds_exactly_the_entries_above_each_threshold(numel, chunk):
    x = _randn(numel, numel)
    scan = ColumnScan(x, chunk).scan_all()
    for q in (0.5, 0.9, 0.999, 0.99999):
        t = float(torch.quantile(x.abs(), q))
        assert torch.equal(scan(t).sort().values, torch.nonzero(x.abs() >= t).view(-1))


def test_span_by_span_accumulation_equals_one_pass(monkeypatch):
    import lgc.compressors.selection as selection_module

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spans are used on single-threaded CPUs
    try:
        results = []
        for chunk in (4096 + 16 * 7, 1 << 30):
            monkeypatch.setattr(selection_module, "_CPU_CHUNK", chunk)
            dgc = DGCCompressor(0.003, warmup_densities=[], exact_below_numel=0)
            # Distinct magnitudes (no ties for top-k to break differently); spans are multiples of
            # 16 elements, so the vectorized arithmetic is the same, bit for bit.
            payloads = [dgc.compress(_randn(100_003, step), "w") for step in range(4)]
            results.append((payloads, dgc.momenta["w"], dgc.velocities["w"]))
    finally:
        torch.set_num_threads(threads)
    (chunked, u1, v1), (whole, u2, v2) = results
    for p, q in zip(chunked, whole, strict=True):
        assert torch.equal(p.to_dense(), q.to_dense())
    assert torch.equal(u1, u2) and torch.equal(v1, v2)


def test_small_tensors_use_an_exact_top_k():
    dgc = DGCCompressor(0.01, warmup_densities=[], exact_below_numel=10_000)
    g = _randn(5000)
    payload = dgc.compress(g, "w")
    assert dgc.last_selection.path == "exact" and payload.values.numel() == 50
    _assert_threshold_selection(g, payload.indices.long())


def test_payload_is_fp32_values_and_int32_indices_and_round_trips_the_wire():
    dgc = DGCCompressor(0.001, warmup_densities=[], exact_below_numel=0)
    payload = dgc.compress(_randn(500_000), "w")
    count = payload.values.numel()
    assert payload.values.dtype == torch.float32 and payload.indices.dtype == torch.int32
    assert payload.nbytes == 8 * count and payload.to_wire().numel() == 8 * count
    rebuilt = dgc.payload_from_wire(payload.to_wire(), 500_000)
    assert torch.equal(rebuilt.values, payload.values) and torch.equal(rebuilt.indices, payload.indices)
    assert torch.equal(dgc.decompress(rebuilt), payload.to_dense())
    assert torch.equal(dgc.aggregate([rebuilt, payload]), 2 * payload.to_dense())


# -- (5) warm-up -------------------------------------------------------------------------------------
def test_warmup_follows_the_paper_then_the_final_density():
    dgc = DGCCompressor(0.001)
    densities = []
    for epoch in range(6):
        dgc.set_epoch(epoch)
        densities.append(dgc.current_density)
    assert densities == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert list(PAPER_WARMUP_DENSITIES) == densities[:4]
    g = _randn(400_000)
    dgc.set_epoch(0)
    assert 0.8 * 100_000 <= dgc.compress(g, "w").values.numel() <= 1.3 * 100_000
    dgc.set_epoch(4)
    assert 0.8 * 400 <= dgc.compress(g, "w").values.numel() <= 1.3 * 400
    no_warmup = DGCCompressor(0.001, warmup_densities=[])
    assert no_warmup.current_density == 0.001
    custom = DGCCompressor(0.01, warmup_densities=[0.5])
    custom.set_epoch(1)
    assert custom.current_density == 0.01


def test_warmup_follows_the_hook_steps_with_steps_per_epoch():
    """The hook's step counter drives the warm-up; set_epoch (lgc-train's callback) does not move it."""
    dgc = DGCCompressor(0.001, steps_per_epoch=3)
    densities = []
    for step in range(16):
        dgc.begin_step(step)
        densities.append(dgc.current_density)
        dgc.set_epoch(0)
        assert dgc.current_density == densities[-1]
    assert densities == [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + [0.00390625] * 3 + [0.001] * 4
    # Resumed at step 7, it is where the run was (the hook's step counter is checkpointed).
    resumed = DGCCompressor(0.001, steps_per_epoch=3)
    resumed.begin_step(7)
    assert resumed.current_density == densities[7]


def test_a_warmup_nothing_advances_is_refused_at_the_first_compressed_step():
    message = (
        r"warm-up \(0.25, 0.0625, 0.015625, 0.00390625, one per epoch, then density=0.001\) is at epoch 0 and "
        r"nothing advances it.*send 0.25 of every gradient for the whole run.*Pass steps_per_epoch=.*"
        r"state.set_epoch\(epoch\) at the start of every epoch.*warmup_densities=\[\]"
    )
    with pytest.raises(RuntimeError, match=message):
        DGCCompressor(0.001).begin_step(1)
    told = DGCCompressor(0.001)
    told.set_epoch(0)
    told.begin_step(1)
    DGCCompressor(0.001, warmup_densities=[]).begin_step(1)
    DGCCompressor(1.0).begin_step(1)  # at density 1 the warm-up changes nothing
    # A restored epoch is not a program that advances it: a resumed run inside the warm-up must
    # advance it again; past the warm-up nothing is left to advance.
    resumed = DGCCompressor(0.001)
    resumed.load_state_dict(told.state_dict())
    with pytest.raises(RuntimeError, match="nothing advances it"):
        resumed.begin_step(2)
    told.set_epoch(4)
    past = DGCCompressor(0.001)
    past.load_state_dict(told.state_dict())
    past.begin_step(5000)


def _payload_bytes_per_step(state, model: DDP, optimizer: torch.optim.Optimizer, steps: int) -> list[int]:
    sent = []
    for step in range(steps):
        before = state.stats.payload_bytes
        optimizer.zero_grad()
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        sent.append(state.stats.payload_bytes - before)
    return sent


def test_a_plain_ddp_script_warms_up_with_steps_per_epoch_and_is_refused_without(group):
    """lgc.compress(model, "dgc", optimizer=...) in a plain loop that never calls set_epoch (gloo, one worker).

    The 64 x 32 weight is compressed (exact top-k, 8 bytes per entry); the first step is the hook's
    plain allreduce. Two steps per epoch: 50 % (1024 entries), 25 % (512), then 1 % (21).
    """
    import lgc

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))

    model = DDP(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = lgc.compress(
        model, "dgc", optimizer=optimizer, density=0.01, warmup_densities=[0.5, 0.25], steps_per_epoch=2,
        exact_below_numel=1 << 17,  # exactly k entries a step (the sampled threshold sends about k)
    )  # fmt: skip
    assert _payload_bytes_per_step(state, model, optimizer, 7) == [0, 8 * 1024, 8 * 512, 8 * 512] + [8 * 21] * 3
    # The same script without steps_per_epoch would send 50 % for ever: its first compressed step refuses.
    model = DDP(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = lgc.compress(model, "dgc", optimizer=optimizer, density=0.01, warmup_densities=[0.5, 0.25])
    with pytest.raises(RuntimeError, match=r"nothing advances it.*Pass steps_per_epoch="):
        _payload_bytes_per_step(state, model, optimizer, 2)


# -- (6) checkpoints ---------------------------------------------------------------------------------
def test_state_dict_round_trip_continues_identically():
    grads = [_randn(300_000, seed) for seed in range(6)]
    original = DGCCompressor(0.001, warmup_densities=[0.01], exact_below_numel=0)
    for g in grads[:3]:
        original.compress(g, "a")
        original.compress(g[:1000], "b")
    original.set_epoch(1)
    state = original.state_dict()
    assert all(t.device.type == "cpu" for t in state["velocities"].values())
    saved_v = state["velocities"]["a"].clone()
    restored = DGCCompressor(0.001, warmup_densities=[0.01], exact_below_numel=0)
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as it goes into a checkpoint
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    for g in grads[3:]:
        for key, x in (("a", g), ("b", g[:1000])):
            p, q = original.compress(x, key), restored.compress(x, key)
            assert torch.equal(p.values, q.values) and torch.equal(p.indices, q.indices)
    assert torch.equal(state["velocities"]["a"], saved_v)  # the state holds clones
    assert restored.current_density == 0.001
    assert restored.residual_norm() == original.residual_norm() > 0


def test_apply_momentum_is_sgd_momentum_for_dense_tensors():
    grads = [_randn(64, seed) for seed in range(6)]
    for nesterov in (False, True):
        dgc = DGCCompressor(momentum=0.9, nesterov=nesterov)
        expected = _sgd_directions(grads, 0.9, nesterov)
        for g, direction in zip(grads, expected, strict=True):
            assert torch.equal(dgc.apply_momentum(g, "bias"), direction)


# -- (7) configuration checks ------------------------------------------------------------------------
def test_check_optimizer_refuses_weight_decay_in_both_places():
    dgc = DGCCompressor(weight_decay=5e-4)
    with pytest.raises(
        ValueError, match=r"weight decay in the optimizer \(optimizer.weight_decay=0.0005\) and in DGC"
    ) as err:
        dgc.check_optimizer(0.0, 5e-4)
    assert "optimizer.weight_decay=0" in str(err.value) and "compressor.weight_decay" in str(err.value)
    with pytest.raises(ValueError, match="applied twice"):
        CompressionHookState(dgc).check_optimizer(0, 1e-4)
    dgc.check_optimizer(0.0, 0.0)
    dgc.check_optimizer(0.0, None)  # not told: not checked
    DGCCompressor().check_optimizer(0.0, 5e-4)  # decay only in the optimizer
    ErrorFeedback(TopKCompressor(0.01)).check_optimizer(0.9, 5e-4)


def test_check_optimizer_refuses_double_momentum_and_double_error_feedback():
    dgc = DGCCompressor()
    with pytest.raises(ValueError, match=r"applies momentum too \(optimizer.momentum=0.9\).*optimizer.momentum=0\)"):
        dgc.check_optimizer(0.9, None)
    with pytest.raises(ValueError, match="optimizer.momentum=0"):
        CompressionHookState(dgc).check_optimizer(0.5, None)
    # Error feedback around DGC is refused where it is built (DGC declares keeps_own_residual).
    with pytest.raises(ValueError, match=r"DGC keeps its own error feedback .* compressor.error_feedback=false"):
        ErrorFeedback(dgc)
    dgc.check_optimizer(0.0, None)
    CompressionHookState(dgc).check_optimizer(0, None)
    ErrorFeedback(TopKCompressor(0.01)).check_optimizer(0.9, None)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"density": 0.0}, r"density must be a number in \(0, 1\], got 0.0"),
        ({"density": 1.5}, r"density must be a number in \(0, 1\], got 1.5"),
        ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\), got 1.0"),
        ({"clip_norm": -1.0}, r"clip_norm must be a positive finite number or None, got -1.0"),
        ({"world_size": 0}, r"world_size must be a positive integer or None, got 0"),
        ({"weight_decay": -1e-4}, r"weight_decay must be a non-negative finite number, got -0.0001"),
        ({"weight_decay": math.inf}, r"weight_decay must be a non-negative finite number, got inf"),
        (
            {"warmup_densities": [0.25, 2.0]},
            r"warmup_densities must be a list of number in \(0, 1\], got \[0.25, 2.0\]",
        ),
        ({"warmup_densities": "abc"}, r"warmup_densities must be a list of number in \(0, 1\], got 'abc'"),
        ({"sample_fraction": 0.0}, r"sample_fraction must be a number in \(0, 1\], got 0.0"),
        ({"exact_below_numel": -1}, r"exact_below_numel must be a non-negative integer, got -1"),
        ({"steps_per_epoch": 0}, r"steps_per_epoch must be a positive integer .*len\(train_loader\).* got 0"),
        ({"steps_per_epoch": 2.5}, r"steps_per_epoch must be a positive integer .* got 2.5"),
    ],
)
def test_bad_knobs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DGCCompressor(**kwargs)


def test_yaml_holds_the_paper_defaults_without_error_feedback():
    from hydra import compose, initialize_config_module

    from lgc.methods import build_hook_state

    with initialize_config_module("lgc.conf", version_base="1.3"):
        cfg = compose("train", overrides=["compressor=dgc", "optimizer.momentum=0", "optimizer.nesterov=false"])
    assert cfg.compressor.error_feedback is False
    state = build_hook_state(cfg.compressor, cfg.comm)
    dgc = state.compressor
    assert isinstance(dgc, DGCCompressor)  # not wrapped in ErrorFeedback
    assert (dgc.density, dgc.momentum, dgc.nesterov, dgc.momentum_masking, dgc.clip_norm) == (
        0.001,
        0.9,
        False,
        True,
        None,
    )
    assert dgc.warmup_densities == PAPER_WARMUP_DENSITIES and dgc.sample_fraction == 0.01
    # The number of workers is the hook's to tell (set_world_size at registration), not the yaml's.
    assert "world_size" not in cfg.compressor and dgc.world_size == 1
    # The weight decay moves from the optimizer (train.yaml's 5e-4) into the compressor.
    assert dgc.weight_decay == 5e-4 and cfg.optimizer.weight_decay == 0.0
    state.check_optimizer(cfg.optimizer.momentum, cfg.optimizer.weight_decay)


def test_yaml_weight_decay_follows_the_runs_weight_decay_and_refuses_it_twice():
    from hydra import compose, initialize_config_module

    from lgc.methods import build_hook_state

    with initialize_config_module("lgc.conf", version_base="1.3"):
        paper = compose("train", overrides=["experiment=paper/dgc_cifar10_resnet110"])
        twice = compose("train", overrides=["compressor=dgc", "optimizer.weight_decay=5e-4"])
    dgc = build_hook_state(paper.compressor, paper.comm).compressor
    assert dgc.weight_decay == paper.regularization.weight_decay == 1e-4 and paper.optimizer.weight_decay == 0.0
    state = build_hook_state(twice.compressor, twice.comm)
    with pytest.raises(ValueError, match="applied twice"):
        state.check_optimizer(twice.optimizer.momentum, twice.optimizer.weight_decay)


# -- (8) two-process DDP training ---------------------------------------------------------------------
class _CountingDGC(DGCCompressor):
    """Records how many entries every compress() sends (module level, so spawn can pickle it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts: list[int] = []

    def compress(self, tensor, key):
        payload = super().compress(tensor, key)
        self.counts.append(payload.values.numel())
        return payload

    def compress_pending(self, tensor, key):  # the hook's one-message step encodes ahead of the header
        payload = super().compress_pending(tensor, key)
        self.counts.append(payload.values.numel())
        return payload


def _least_squares_losses(rank: int, compressor, momentum: float, steps: int, lr: float) -> tuple[list[float], dict]:
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(512, 64, generator=gen)
    target = features @ torch.randn(64, 64, generator=gen)
    shard = slice(rank * 256, (rank + 1) * 256)  # each worker has its own half of the data
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 64, bias=False))
    stats = {}
    if compressor is not None:
        state = register_compression_hook(model, compressor, min_numel=0, start_iter=0)
        stats = state.stats
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        (model(features[shard]) - target[shard]).square().sum(1).mean().backward()
        optimizer.step()
        with torch.no_grad():
            losses.append(float((model(features) - target).square().sum(1).mean()))
    return losses, stats


def _train_three_ways(rank: int, world: int, steps: int, lr: float, density: float) -> dict:
    dense, _ = _least_squares_losses(rank, None, 0.9, steps, lr)
    dgc = _CountingDGC(density, momentum=0.9, warmup_densities=[], exact_below_numel=0)
    dgc_losses, stats = _least_squares_losses(rank, dgc, 0.0, steps, lr)
    topk_ef = DGCCompressor(density, momentum=0.0, warmup_densities=[], exact_below_numel=0)
    topk_losses, _ = _least_squares_losses(rank, topk_ef, 0.0, steps, lr)
    return {"dense": dense, "dgc": dgc_losses, "topk_ef": topk_losses, "counts": dgc.counts, "stats": stats}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_dgc_with_plain_sgd_trains_like_dense_momentum_sgd():
    """Least squares (512 x 64 features, a 64 x 64 weight), two gloo workers with half the data each.

    Dense DDP with SGD(momentum=0.9) against DGC (density 5 %, no warm-up, momentum 0.9 in the
    compressor) with SGD(momentum=0), same learning rate, 200 steps. Both go from ~4e3 to ~1e-5 or
    below: DGC's final loss must be within 100x of the dense one (measured ~6x). Top-k with error
    feedback alone (DGC with momentum 0) lacks the momentum and must stay >= 1e4x higher.
    """
    steps, lr, density = 200, 0.01, 0.05
    results = run_workers(_train_three_ways, 2, steps, lr, density)
    r0, r1 = results
    assert r0["dgc"] == r1["dgc"]  # every rank applies the same aggregated update
    dense, dgc, topk_ef = r0["dense"], r0["dgc"], r0["topk_ef"]
    assert dense[-1] < 1e-8 * dense[0]
    assert dgc[-1] < 100 * dense[-1], f"DGC {dgc[0]:.3g} -> {dgc[-1]:.3g}, dense momentum SGD -> {dense[-1]:.3g}"
    assert topk_ef[-1] > 1e4 * dgc[-1]
    # The sampled threshold sends different numbers of entries on the two ranks; the hook's
    # size exchange makes the allgather work anyway, and its byte count is 8 bytes per entry.
    k = num_selected(64 * 64, density)
    assert len(r0["counts"]) == len(r1["counts"]) == steps
    assert any(a != b for a, b in zip(r0["counts"], r1["counts"], strict=True))
    for result in results:
        assert all(0.8 * k <= c <= 1.3 * k for c in result["counts"])
        assert result["stats"].payload_bytes == 8 * sum(result["counts"])


def _momentum_sgd_two_ways(
    rank: int, world: int, steps: int, weight_decay: float = 0.0, nesterov: bool = False
) -> dict:
    """Plain DDP + SGD(momentum, weight_decay) against DGC (density 1, no masking) + plain SGD, several buckets."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 5))

    reference = DDP(net(), bucket_cap_mb=0.005)
    hooked = DDP(net(), bucket_cap_mb=0.005)
    dgc = _dense_limit_dgc(nesterov, weight_decay, world)
    # min_numel 1000: the 32x64 and 64x48 weights are compressed, the 48x5 weight and the biases go dense.
    register_compression_hook(hooked, dgc, min_numel=1000, start_iter=0)
    optimizers = [
        torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay),
        torch.optim.SGD(hooked.parameters(), lr=0.05, momentum=0.0),
    ]
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        for model, optimizer in zip((reference, hooked), optimizers, strict=True):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    return {
        "reference": [p.detach().clone() for p in reference.parameters()],
        "hooked": [p.detach().clone() for p in hooked.parameters()],
        "dense_keys": sorted(dgc.dense_momenta),
        "compressed_keys": sorted(dgc.velocities),
    }


@pytest.mark.multiprocess
def test_dgc_momentum_reaches_the_tensors_the_hook_sends_dense():
    """Without sparsity or masking, DGC's momentum correction *is* heavy-ball SGD, for every tensor.

    The hook sends small tensors dense; it must pass them through DGC's momentum too, otherwise the
    biases and the small weight would train without momentum and the parameters would differ.
    """
    for result in run_workers(_momentum_sgd_two_ways, 2, 8):
        assert result["compressed_keys"] == ["0.weight", "2.weight"]
        assert result["dense_keys"] == ["0.bias", "2.bias", "4.bias", "4.weight"]
        for reference, hooked in zip(result["reference"], result["hooked"], strict=True):
            torch.testing.assert_close(hooked, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_dgc_weight_decay_through_the_hook_is_momentum_sgd_weight_decay():
    """The hook attaches the weights and divides by the world size: two workers each add half the decay.

    Nesterov, weight decay 0.05, density 1 without masking: every parameter, compressed or sent
    dense, follows SGD(momentum=0.9, nesterov=True, weight_decay=0.05) on the averaged gradient.
    """
    for result in run_workers(_momentum_sgd_two_ways, 2, 8, 0.05, True):
        assert result["compressed_keys"] == ["0.weight", "2.weight"]
        assert result["dense_keys"] == ["0.bias", "2.bias", "4.bias", "4.weight"]
        for reference, hooked in zip(result["reference"], result["hooked"], strict=True):
            torch.testing.assert_close(hooked, reference, rtol=1e-5, atol=1e-6)
