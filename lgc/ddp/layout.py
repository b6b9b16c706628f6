"""Which parameter each part of a DDP bucket's flat buffer holds, and whether it is compressed.

DDP hands the hook flat buckets; compressor state (residuals, momenta) is keyed by parameter name,
so each bucket is cut into :class:`~lgc.ddp.exchange.Segment` s once and the cut is cached per
bucket index, rebuilt when DDP rebuilds its buckets (after the first iteration).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
from torch import nn

from lgc.ddp.exchange import Segment

__all__ = ["BucketLayouts", "split_segments"]


def split_segments(names_and_numels: list[tuple[str, int]], min_numel: int) -> tuple[Segment, ...]:
    """Consecutive segments of a flat buffer; those with at least ``min_numel`` elements are compressed (an
    empty one never: it has nothing to code)."""
    segments, offset = [], 0
    for name, numel in names_and_numels:
        segments.append(Segment(name, offset, numel, numel >= max(min_numel, 1)))
        offset += numel
    return tuple(segments)


class _Layout(NamedTuple):
    #: Identifies the bucket's content, so a layout is rebuilt when DDP rebuilds its buckets.
    signature: tuple[int, ...]
    segments: tuple[Segment, ...]


class BucketLayouts:
    """The segments of every bucket of one DDP model (per process: parameter identities are not saved).

    Parameters are told apart by identity, not by address: distinct parameters may share storage (two
    ``nn.Parameter`` s over one tensor) and every empty one has address 0.
    """

    __slots__ = ("cached", "names")

    def __init__(self) -> None:
        #: ``id`` of the parameter -> its name, filled by :meth:`attach`.
        self.names: dict[int, str] = {}
        #: Bucket index -> its last layout.
        self.cached: dict[int, _Layout] = {}

    def attach(self, module: nn.Module) -> None:
        """Learn the parameter names of ``module`` (the model inside DDP)."""
        self.names = {id(p): name for name, p in module.named_parameters()}

    def __len__(self) -> int:
        return len(self.cached)

    def segments(self, bucket: dist.GradBucket, min_numel: int) -> tuple[Segment, ...]:
        """The bucket's segments, cached per bucket index and rebuilt when the bucket changes."""
        params = bucket.parameters()
        signature = (bucket.buffer().numel(), *(id(p) for p in params))
        cached = self.cached.get(bucket.index())
        if cached is not None and cached.signature == signature:
            return cached.segments
        names = [self.names.get(id(param)) for param in params]
        if None in names:
            raise RuntimeError(
                "a bucket holds a parameter the hook state does not know: the state was attached to another model "
                "since (one hook state per model: build one for each), or the model's parameters were replaced "
                "after it was registered"
            )
        segments = split_segments([(name, param.numel()) for name, param in zip(names, params, strict=True)], min_numel)
        total = sum(s.numel for s in segments)
        if total != bucket.buffer().numel():
            raise RuntimeError(f"bucket {bucket.index()} has {bucket.buffer().numel()} elements, parameters {total}")
        self.cached[bucket.index()] = _Layout(signature, segments)
        return segments
