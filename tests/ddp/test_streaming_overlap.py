"""Streaming DiLoCo's overlap (tau) and mixing (alpha): torchft's schedule and merge, a real overlap, exact resume."""

import threading

import pytest
import torch
from distributed import run_workers
from test_local_sgd import _batch, _delayed, _fragment_masks, _net, traced_local_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lgc
from lgc import ErrorFeedback, NoneCompressor, TopKCompressor
from lgc.ddp import delay_checkpoint
from lgc.ddp.fragments import FragmentSchedule

pytestmark = pytest.mark.multiprocess


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class _Watched(NoneCompressor):
    """``none``, noting for every tensor it encodes whether it runs on the training thread, and waiting for
    ``gate`` (if given) first."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.on_main_thread: list[bool] = []
        self.waited: list[bool] = []

    def compress(self, tensor, key):
        self.on_main_thread.append(threading.current_thread() is threading.main_thread())
        if self.gate is not None:
            self.waited.append(self.gate.wait(timeout=60))  # False: the training thread waited for the exchange
        return super().compress(tensor, key)


def _trace(rank: int, world: int, settings: dict, steps: int) -> dict:
    watched = _Watched()
    state = _delayed(watched, min_numel=0, outer="sgd", **settings)
    trace = traced_local_steps(rank, state, steps)
    return {"trace": trace, "on_main_thread": watched.on_main_thread, "bytes": state.stats.wire_bytes_sent}


# (delay H, fragments F, overlap tau, mixing alpha): torchft's regression and integration tests run
# F in {1, 2} x tau in {0, 1} x alpha in {0, 0.5, 1} at H = 4 and 6.
CASES = [
    (4, 2, 1, 0.5),
    pytest.param(4, 2, 1, 0.0, marks=pytest.mark.slow),
    pytest.param(4, 2, 0, 0.5, marks=pytest.mark.slow),
    pytest.param(6, 3, 1, 1.0, marks=pytest.mark.slow),
    pytest.param(4, 1, 3, 0.5, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("delay", "fragments", "tau", "alpha"), CASES)
def test_the_overlapped_exchange_follows_a_transcription_of_torchft(delay, fragments, tau, alpha):
    """lgc against pytorch/torchft ``torchft/local_sgd.py`` (``DiLoCo._step_post_hook``, ``_StreamingDiLoCoFragment``).

    Transcribed: after every inner step the local counter grows; at ``sync_every - fragment_sync_delay``
    (``sync_every = H / F``) ``prepare_sync`` of fragment ``manager_step % F`` takes the pseudo-gradient
    ``original - local`` of every worker (``_save_grads``) and starts its average (``Manager.allreduce``,
    AVG); at ``sync_every`` ``perform_sync`` waits for it, restores the original weights, sets the average
    as their gradient (``_set_grads``), steps the fragment's own outer ``SGD(lr=0.7, momentum=0.9,
    nesterov=True)``, saves the result as the new original (``save_parameters``) and merges
    ``p.lerp_(local, fragment_update_alpha)`` with the local weights of that step (``_merge_parameters``);
    the manager's step grows and the counter restarts. Two workers, 3 rounds of every fragment: after
    every step each worker's weights equal the transcription's, :meth:`global_model` holds its originals,
    the exchange ran on the runner's thread when ``tau > 0`` (on the training thread at ``tau = 0``), and
    the bytes equal the blocking run's.
    """
    world, steps = 2, 3 * delay
    settings = dict(delay=delay, fragments=fragments, overlap_steps=tau, mixing=alpha)
    results = run_workers(_trace, world, settings, steps)
    members = _fragment_masks(_net(), fragments)
    original = torch.cat([p.detach().reshape(-1) for p in _net().parameters()])
    globals_ = [original[mask].clone().requires_grad_(True) for mask in members]
    outer = [torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True) for w in globals_]
    sync_every = delay // fragments
    local_step = manager_step = 0
    pseudo = None
    for step in range(steps):
        local = [r["trace"][step][0] for r in results]
        expected = [w.clone() for w in local]
        local_step += 1
        fragment = manager_step % fragments
        mask, weights = members[fragment], globals_[fragment]
        if local_step == sync_every - tau:  # prepare_sync
            pseudo = sum(weights.detach() - w[mask] for w in local) / world
        if local_step == sync_every:  # perform_sync
            weights.grad = pseudo
            outer[fragment].step()
            outer[fragment].zero_grad()
            for w in expected:
                w[mask] = torch.lerp(weights.detach(), w[mask], alpha)
            manager_step += 1
            local_step = 0
        transcribed = torch.empty_like(original)
        for f, m in enumerate(members):
            transcribed[m] = globals_[f].detach()
        for rank, result in enumerate(results):
            _, after, synced = result["trace"][step]
            torch.testing.assert_close(after, expected[rank], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(synced, transcribed, rtol=1e-6, atol=1e-7)
    for result in results:
        assert len(result["on_main_thread"]) >= 3 * fragments  # a tensor or piece at a time
        assert all(result["on_main_thread"]) == (tau == 0) and any(result["on_main_thread"]) == (tau == 0)
    if tau:
        blocking = run_workers(_trace, world, {**settings, "overlap_steps": 0}, steps)
        assert [r["bytes"] for r in results] == [r["bytes"] for r in blocking]


def _gated(rank: int, world: int) -> dict:
    """An exchange that cannot finish until the training thread has taken the overlapped local step."""
    model = DDP(_net())
    stepped = threading.Event()
    gated = _Watched(stepped)
    state = _delayed(gated, min_numel=0, delay=4, fragments=2, overlap_steps=1)
    state.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    in_flight = []
    for step in range(4):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()
        if state.in_flight is not None:  # the local step taken while the exchange waits
            stepped.set()
        state.after_optimizer_step()
        in_flight.append(state.in_flight is not None)
        if not in_flight[-1]:
            stepped.clear()
    return {"waited": gated.waited, "in_flight": in_flight}


def test_the_exchange_runs_while_the_next_local_step_computes():
    """Each exchange blocks until the training thread has taken the local step after its start: it finishes."""
    for result in run_workers(_gated, 2):
        assert result["in_flight"] == [True, False, True, False]
        assert result["waited"] and all(result["waited"])


#: Open except around the checkpoint of :func:`_resumed`: the exchange started at the last step before it
#: codes only once the checkpoint has begun (a timer opens it), so it is in flight whatever the timing.
_GATE = threading.Event()
_GATE.set()


class _GatedTopK(TopKCompressor):
    """Top-k that codes only while :data:`_GATE` is open."""

    def compress(self, tensor: torch.Tensor, key: str):
        assert _GATE.wait(timeout=30), "the gate never opened"
        return super().compress(tensor, key)


def _resumed(rank: int, world: int, stop: int, steps: int, compressor: str = "none") -> dict:
    """Weights after ``steps`` straight, and after a checkpoint at ``stop`` (an exchange in flight) and a resume."""

    def run(start: int, end: int, saved: dict | None = None) -> tuple[DDP, dict, bool]:
        model = DDP(_net())
        coder = NoneCompressor() if compressor == "none" else ErrorFeedback(_GatedTopK(0.1))
        state = _delayed(coder, min_numel=0, delay=4, fragments=2, overlap_steps=1, outer="sgd", mixing=0.5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if saved is not None:
            state.load_state_dict(saved["delay"])
            optimizer.load_state_dict(saved["optimizer"])
        state.register(model)
        for step in range(start, end):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            (model(x) - y).square().mean().backward()
            optimizer.step()
            if saved is None and end < steps and step == end - 1:
                _GATE.clear()  # the exchange this step starts waits for the checkpoint below
            state.after_optimizer_step()
        held = state.in_flight is not None
        if not _GATE.is_set():
            threading.Timer(0.2, _GATE.set).start()
        return model, {"delay": state.state_dict(), "optimizer": optimizer.state_dict()}, held

    straight, _, _ = run(0, steps)
    _, saved, held = run(0, stop)
    resumed, _, _ = run(stop, steps, saved)
    return {"straight": _flat(straight.module), "resumed": _flat(resumed.module), "held": held, "saved": saved}


@pytest.mark.parametrize("compressor", ["none", "gated_topk"])
def test_a_checkpoint_with_an_exchange_in_flight_resumes_exactly(compressor):
    """Saved one step after an exchange started (its result kept), resumed: bit for bit the straight run. With
    error feedback over a top-k held until the checkpoint has begun, the exchange is still coding when the
    checkpoint is taken: the saved residuals are those after it (the checkpoint waits for it first)."""
    results = run_workers(_resumed, 2, 5, 12, compressor)
    for result in results:
        assert result["held"] and result["saved"]["delay"]["in_flight"]["fragment"] == 0
        assert torch.equal(result["straight"], result["resumed"])
    assert not torch.equal(results[0]["resumed"], results[1]["resumed"])  # local weights, mixed in at 0.5


@pytest.mark.parametrize(
    ("delay", "fragments", "tau", "message"),
    [
        (4, 2, 2, "overlap_steps must be an integer from 0 to 1, below the 2 local steps"),
        (10, 3, 3, "from 0 to 2, below the 3 local steps"),
        (4, 1, 4, "from 0 to 3"),
        (4, 1, -1, "got -1"),
        (4, 1, True, "got True"),
    ],
)
def test_an_overlap_reaching_the_next_exchange_is_refused(delay, fragments, tau, message):
    with pytest.raises(ValueError, match=message):
        FragmentSchedule(delay, fragments, overlap_steps=tau)


def test_the_overlap_starts_each_exchange_tau_steps_before_its_turn():
    schedule = FragmentSchedule(6, 3, overlap_steps=1)
    assert [schedule.due(t) for t in range(1, 7)] == [[], [0], [], [1], [], [2]]
    assert [schedule.starting(t) for t in range(1, 7)] == [[0], [], [1], [], [2], []]


def test_mixing_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="mixing"):
        _delayed(NoneCompressor(), delay=4, mixing=1.5)


def test_a_checkpoint_written_with_another_overlap_is_refused():
    state = _delayed(NoneCompressor(), delay=4, fragments=2, overlap_steps=1)
    saved = {"compressed": delay_checkpoint.COMPRESSED, "exchange": state.exchange_state.state_dict()}
    saved.update(fragments=2, fragment_split="strided", local_steps=3, overlap_steps=0)
    with pytest.raises(ValueError, match="written with overlap_steps=0, this run has overlap_steps=1"):
        state.load_state_dict(saved)


def _through_compress(rank: int, world: int, method: str, steps: int) -> dict:
    """``lgc.compress(..., delay=4, fragments=..., overlap_steps=1)``: the global model after ``steps``."""
    model = DDP(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fragments = 1 if method != "fp4" else 2
    state = lgc.compress(model, method, optimizer=optimizer, delay=4, fragments=fragments, overlap_steps=1, mixing=0.5)
    started = []
    for step in range(steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        (model(x) - y).square().mean().backward()
        optimizer.step()  # its post-hook runs after_optimizer_step
        started.append(state.in_flight is not None)
    state.settle()
    with state.global_model() as module:
        synced = _flat(module)
    return {"synced": synced, "started": started, "sent": state.stats.wire_bytes_sent, "describe": state.describe()}


# With -m slow: the default suite's transcription, gate and resume tests cover the overlap itself.
@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp4", "shared_topk_int8"])
def test_lgc_compress_overlaps_the_exchanges_of_a_compressor_and_of_the_lgc_family(method):
    """Streaming DiLoCo's compressor (fp4, two fragments) and an LGC-family state (whole parameters) exchange
    in flight: every rank ends on the same global model, away from the initial one, bytes counted."""
    results = run_workers(_through_compress, 2, method, 12)
    for result in results:
        assert torch.equal(result["synced"], results[0]["synced"]) and result["sent"] > 0
        assert not torch.equal(result["synced"], _flat(_net()))
        assert "each exchange overlapping 1 local step(s), local weights mixed in at 0.5" in result["describe"]
    expected = [True, False] * 6 if method == "fp4" else [False, False, True, False] * 3
    assert results[0]["started"] == expected
