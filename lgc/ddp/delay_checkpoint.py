"""The checkpoint of the local-step state: every rank's weights, buffers, residuals and outer momentum.

Between exchanges every rank of :class:`~lgc.ddp.local_sgd.CommunicationDelayState` has weights
and buffers of its own, so every rank's state goes into the checkpoint (the model checkpoint holds
rank 0's): the synchronized weights of every fragment piece and the buffers' last average (the
same on every rank), this rank's local weights and buffers, the exchange's compressor state (its
residuals), the outer optimizer's momentum, the local-step count and an exchange in flight (Streaming
DiLoCo's overlap: waited for, its averaged pseudo-gradient kept until its turn). A checkpoint whose
fragments are cut otherwise, whose outer step is of the other kind, whose residuals hold the other
sign (``compressed``) or that was written with another overlap is refused by name: resuming it
would change the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lgc.ddp.streaming import InFlight

if TYPE_CHECKING:
    from lgc.ddp.local_sgd import CommunicationDelayState

__all__ = ["COMPRESSED", "load", "restore", "save"]

#: What goes through the compressor at an exchange (recorded in checkpoints: it fixes the residuals' sign).
COMPRESSED = "the pseudo-gradient W_sync - W_local"


def save(delayed: CommunicationDelayState) -> dict[str, Any]:
    """This rank's state: compressor state, counters, synchronized and local weights and buffers.

    Inside ``global_model()`` the local weights and buffers are the ones held aside, not the module's
    (which then holds the synchronized model).
    """
    # An exchange in flight (Streaming DiLoCo's overlap) runs the compressor on another thread: waited for
    # first, so that the compressor state read below holds its step and no write races the read.
    delayed.settle()
    module = delayed.module
    if delayed.view.held_local is not None:
        weights, buffers = delayed.view.held_local
    elif module is not None:
        weights, buffers = dict(delayed._named_parameters()), dict(module.named_buffers())
    else:
        weights, buffers = {}, {}
    return {
        "exchange": delayed.exchange_state.state_dict(),
        "local_steps": delayed.local_steps,
        "fragments": delayed.fragments,
        "fragment_split": delayed.fragment_split,
        # What the compressor's residuals hold (their sign): see load().
        "compressed": COMPRESSED,
        "synced": {key: t.detach().cpu().clone() for key, t in delayed.synced.items()},
        "synced_buffers": {name: t.detach().cpu().clone() for name, t in delayed.buffers.synced.items()},
        # Between exchanges every rank has its own weights and buffers; the model checkpoint holds rank 0's.
        "local_weights": {name: t.detach().cpu().clone() for name, t in weights.items()},
        "local_buffers": {name: t.detach().cpu().clone() for name, t in buffers.items()},
        "outer_optimizer": delayed.outer_step.state_dict(),
        "overlap_steps": delayed.overlap_steps,
        # Waited for above (settle), so the compressor state holds its step.
        "in_flight": None if delayed.in_flight is None else delayed.in_flight.state_dict(),
    }


def load(delayed: CommunicationDelayState, state: dict[str, Any]) -> None:
    """Restore :func:`save`'s result: now if the model is registered, else at registration."""
    delayed.view.refuse_inside("load_state_dict()")
    compressed = state.get("compressed", "the weight update W_local - W_sync")
    if compressed != COMPRESSED:
        raise ValueError(
            f"the checkpoint's compressor state was built on {compressed}, this run compresses {COMPRESSED}: its "
            "error-feedback residuals have the opposite sign; resume it with the lgc version that wrote it"
        )
    delayed.exchange_state.load_state_dict(state["exchange"])
    saved_fragments = int(state["fragments"])
    if saved_fragments != delayed.fragments:
        raise ValueError(
            f"the checkpoint was written with fragments={saved_fragments}, this run has "
            f"fragments={delayed.fragments}: the fragments' schedule would change mid-run"
        )
    # One fragment is never cut, whatever the rule; more are cut by the recorded rule only.
    saved_split = state.get("fragment_split")
    if delayed.fragments > 1 and saved_split != delayed.fragment_split:
        recorded = (
            f"fragment_split={saved_split!r}"
            if saved_split is not None
            else "no fragment_split (its fragments held whole parameters, cut where their first entry fell)"
        )
        raise ValueError(
            f"the checkpoint was written with {recorded}, this run has fragment_split={delayed.fragment_split!r}: "
            "its synchronized weights, outer momentum and residuals belong to other fragments"
        )
    saved_overlap = int(state.get("overlap_steps", 0))
    if saved_overlap != delayed.overlap_steps:
        raise ValueError(
            f"the checkpoint was written with overlap_steps={saved_overlap}, this run has "
            f"overlap_steps={delayed.overlap_steps}: its exchanges would start and be applied on other steps"
        )
    delayed.local_steps = int(state["local_steps"])
    if delayed.module is None:
        delayed.pending = state
    else:
        with torch.no_grad():
            restore(delayed, state)


def restore(delayed: CommunicationDelayState, state: dict[str, Any]) -> None:
    """Put a loaded state's weights, buffers and outer momentum into the registered model."""
    assert delayed.module is not None
    params = dict(delayed._named_parameters())
    keys = [s.key for s in delayed.slices]
    if sorted(state["synced"]) != sorted(keys):
        missing = sorted(set(keys) - set(state["synced"]))
        extra = sorted(set(state["synced"]) - set(keys))
        raise ValueError(
            f"the checkpoint's synchronized weights are cut otherwise than this run's fragments "
            f"(missing: {missing[:3]}, not in this run: {extra[:3]})"
        )
    for s in delayed.slices:
        saved = tuple(state["synced"][s.key].shape)
        if saved != s.shape:
            raise ValueError(
                f"the checkpoint's synchronized weights of {s.key!r} have shape {saved}, this run's piece has "
                f"{s.shape}: they are cut otherwise"
            )
    delayed.synced = {s.key: state["synced"][s.key].to(params[s.name].device).clone() for s in delayed.slices}
    for name, weights in state["local_weights"].items():
        params[name].copy_(weights)
    # Absent from checkpoints written while DDP broadcast rank 0's buffers before every forward:
    # every rank then held the buffers the model checkpoint restored, the best value for both.
    buffers = dict(delayed.module.named_buffers())
    for name, value in state.get("local_buffers", {}).items():
        buffers[name].copy_(value)
    saved = state.get("synced_buffers")
    source = buffers if saved is None else saved
    delayed.buffers.synced = {name: source[name].to(b.device).clone() for name, b in buffers.items()}
    delayed.outer_step.build(list(delayed.synced.values()))
    delayed.outer_step.load_state_dict(state["outer_optimizer"])
    flight = state.get("in_flight")
    delayed.in_flight = None
    if flight is not None:
        pieces = [s for s in delayed.slices if s.fragment == int(flight["fragment"])]
        segments = delayed.segments_of(pieces)
        device = next(iter(params.values())).device
        delayed.in_flight = InFlight.from_state(flight, segments, device)
