"""Streaming DiLoCo's overlap: a fragment's exchange runs while the next local steps compute.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch" (2025): with an overlap of ``tau`` local steps, a fragment's pseudo-gradient
``Delta = W_sync - W_local`` is taken ``tau`` steps before the fragment's turn and its exchange
runs while the workers take those ``tau`` steps; at the turn the outer step moves the synchronized
weights by the averaged ``Delta`` and the fragment's weights become

    ``W = (1 - alpha) * W_sync + alpha * W_local``    (``torch.lerp(W_sync, W_local, alpha)``)

with ``W_local`` the weights at the turn, the ``tau`` overlapped steps included: ``alpha = 0``
(torchft's default) discards them, ``alpha = 1`` keeps the local weights and moves only the
synchronized copy. This is torchft's ``DiLoCo`` with ``fragment_sync_delay = tau`` and
``fragment_update_alpha = alpha`` (pytorch/torchft ``torchft/local_sgd.py``: ``prepare_sync``
takes ``Delta`` and starts its allreduce, ``perform_sync`` waits for it, restores the global
weights, steps the fragment's outer optimizer and ``lerp``\\ s the local weights in), step for step
(``tests/ddp/test_streaming_overlap.py``).

How it overlaps: :class:`ExchangeRunner` runs the exchange (the step guard's agreement and the
compressor's collectives, blocking as they are) on a thread of its own, over a process group of
its own, so nothing the training thread sends meanwhile (DDP's bucket rebuild, its unused-parameter
map, Lightning's metric reductions) can meet it out of order on another rank. On a GPU the thread
issues its kernels on the training thread's current stream, so they are ordered after the
pseudo-gradient and before anything the training thread queues after applying the result; only
the transfers run beside the local steps. The thread writes the exchange's statistics (bytes sent,
collectives) and the compressor's state, which the training thread does not touch until it waits
for the result at the fragment's turn; the training thread's local-step hook books only the
dense-equivalent figures and hook calls, counters the exchange does not write.

Where lgc departs from torchft, and why:

* A non-finite ``Delta`` on some rank skips the exchange: at the turn the fragment returns to its
  synchronized weights (torchft's restore without a commit), its residuals unchanged.
* The module buffers (BatchNorm's statistics, absent from torchft's transformers) are averaged at
  the last fragment's turn, blocking, as without overlap.
* A checkpoint taken while an exchange is in flight waits for it and saves its result, so resume is
  exact; torchft leaves the in-flight exchange out of its state.
* At the end of training an exchange still in flight is left unapplied, as torchft leaves it (the
  synchronized weights lgc-train validates do not hold it); lgc-train waits for it so that its
  bytes are counted. :meth:`~lgc.ddp.local_sgd.CommunicationDelayState.flush` applies it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lgc.ddp.exchange import Segment

__all__ = ["ExchangeRunner", "InFlight", "finished", "new_side_group"]


@dataclass
class InFlight:
    """A fragment's exchange started ``overlap_steps`` before its turn, applied at the turn."""

    #: The fragment exchanged, and the exchange's number (the compressor's step counter).
    fragment: int
    number: int
    #: Whether the module buffers are averaged when it is applied (the last fragment's turn).
    with_buffers: bool
    #: ``Delta / world`` of every piece of the fragment, end to end; the workers' mean once the exchange is done.
    update: Tensor
    segments: tuple[Segment, ...]
    #: Whether some rank's ``Delta`` was not finite (the exchange skipped), once known.
    outcome: concurrent.futures.Future[bool]

    def skipped(self) -> bool:
        """Wait for the exchange; whether it was skipped (an error on the exchange's thread is raised here)."""
        return self.outcome.result()

    def state_dict(self) -> dict[str, Any]:
        """The finished exchange (waited for) as a checkpoint holds it."""
        skipped = self.skipped()
        return {
            "fragment": self.fragment,
            "number": self.number,
            "with_buffers": self.with_buffers,
            "skipped": skipped,
            "update": self.update.detach().cpu().clone(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], segments: tuple[Segment, ...], device: torch.device) -> InFlight:
        """A finished exchange from :meth:`state_dict`'s result."""
        return cls(
            int(state["fragment"]),
            int(state["number"]),
            bool(state["with_buffers"]),
            state["update"].to(device),
            segments,
            finished(bool(state["skipped"])),
        )


def finished(skipped: bool) -> concurrent.futures.Future[bool]:
    """A future that already holds ``skipped`` (an exchange run on the training thread)."""
    outcome: concurrent.futures.Future[bool] = concurrent.futures.Future()
    outcome.set_result(skipped)
    return outcome


def new_side_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group of ``group``'s ranks (None: every rank), made by those ranks only
    (``use_local_synchronization``), so a subgroup's ranks make theirs without the others."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, use_local_synchronization=True)


class ExchangeRunner:
    """One exchange at a time on a thread of its own, over a process group of its own (see the module docstring)."""

    __slots__ = ("executor", "group")

    def __init__(self) -> None:
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.group: dist.ProcessGroup | None = None

    def side_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
        """A new process group of ``group``'s ranks (None: every rank) for the exchanges; made once
        (:func:`new_side_group`)."""
        if self.group is None:
            self.group = new_side_group(group)
        return self.group

    def submit(self, job: Callable[[], bool], device: torch.device) -> concurrent.futures.Future[bool]:
        """Run ``job`` (the exchange) on the runner's thread, without autograd, on ``device``'s current stream."""
        if self.executor is None:
            self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lgc-exchange")
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

        def run() -> bool:
            with torch.no_grad(), _on_stream(stream):
                return job()

        return self.executor.submit(run)


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """``stream`` (and its device) current on this thread; nothing on the CPU."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield
