"""A hook state in a distributed checkpoint (``torch.distributed.checkpoint``, DCP), each rank's under its own key.

A compressor's state differs from rank to rank (error feedback's residuals, DGC's momenta: each
rank's own gradients), where DCP takes a tensor that every rank saves under one key as replicated
and keeps one copy. :class:`PerRankState` hands DCP this rank's whole state under ``rank<r>``, as one
serialized object (a leaf DCP saves as bytes), so every rank's survives, and on load it takes back
its own. One object rather than tensor by tensor: DCP loads only the keys the live state already
has, and a state resumed before its first step has no residuals yet.

Under hybrid sharding with local steps (:mod:`lgc.fsdp.local_steps`) the replicas' weights and
inner optimizer states differ between exchanges, where DCP keeps one replica's copy of each shard:
save ``PerRankState(optimizer)`` too, and load both after the model and the optimizer, whose
values they then replace with this rank's own (``tests/fsdp/test_local_steps.py``).

Example::

    >>> state = lgc.compress(model, "topk", optimizer=opt)  # model: fully_shard(...)
    >>> dcp.save({"model": model.state_dict(), "lgc": PerRankState(state)}, checkpoint_id=path)
    >>> dcp.load({"model": model.state_dict(), "lgc": PerRankState(state)}, checkpoint_id=path)
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PerRankState"]


class PerRankState:
    """DCP's ``Stateful`` view of a hook state (anything with ``state_dict`` / ``load_state_dict``), per rank.

    Args:
        state: the hook state :func:`lgc.compress` returned (or any object with ``state_dict`` and
            ``load_state_dict`` whose state is the rank's own: an optimizer under local steps).
        group: the group whose ranks name the entries (default: the world).
    """

    def __init__(self, state: Any, group: dist.ProcessGroup | None = None) -> None:
        self.state = state
        self.group = group

    @property
    def key(self) -> str:
        return f"rank{dist.get_rank(self.group)}"

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.state.state_dict(), buffer)
        return {self.key: buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blob = state_dict.get(self.key)
        if not isinstance(blob, bytes):
            raise ValueError(
                f"the checkpoint holds no lgc state for {self.key} (it has {sorted(state_dict)}): "
                "resume on as many ranks as saved it"
            )
        self.state.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
