"""Tensors of a bucket laid end to end, each padded to a whole number of blocks, and back.

The bucket-level codecs (EF-signSGD's scaled sign, fp4) encode every tensor of a DDP bucket in a
fixed number of passes by laying the tensors end to end with each one zero-padded to whole bytes
or whole scaling buckets (:func:`pad_segments`), dropping the padding again when they decode
(:func:`unpad_segments`), and copying the decoded sums into the tensors' slices of the bucket at
once (:func:`copy_segments_into`). A codec with per-key state keeps a bucket's state as slices of
one flat per store (:class:`BucketFlats`: error feedback's residuals, DGC's accumulators and
momenta), so a step acts on the bucket at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "BucketFlats",
    "CodesBuckets",
    "FlatGroup",
    "DecodesSegments",
    "FeedsBackSegments",
    "copy_segments_into",
    "feeds_back_segments",
    "one_bucket",
    "pad_segments",
    "unpad_segments",
]


@runtime_checkable
class FeedsBackSegments(Protocol):
    """A compressor whose error feedback can encode a whole bucket at once
    (:meth:`~lgc.compressors.ErrorFeedback.compress_many` with ``bucketed``): top-k, SBC, RedSync, EF-signSGD's
    scaled sign, chunked top-k, SparseLoCo's quantized values, DeMo, QSGD and TernGrad
    (:func:`feeds_back_segments` asks)."""

    def feed_back_segments(self, flat: Tensor, numels: Sequence[int], keys: Sequence[str]) -> list[Any]:
        """Every segment's payload (``numels[i]`` entries of ``flat`` for ``keys[i]``), and what they send
        subtracted from ``flat`` in place, which is left holding the new residuals.

        ``flat`` is fp32, the segments end to end. Each payload and residual is :meth:`compress`'s of
        its segment followed by error feedback's subtraction, bit for bit (a sparse payload's pairs
        may come in another order; entries tied at a top-k's cut may be chosen differently).
        """
        ...


def feeds_back_segments(compressor: object) -> bool:
    """Whether ``compressor``'s bucket path (:class:`FeedsBackSegments`) encodes what its ``compress`` does.

    A subclass that overrides ``compress`` but inherits ``feed_back_segments`` would encode a bucket
    by its parent's rule: it is taken tensor by tensor. The method must come from the class that
    defines ``compress`` or from a subclass of it.
    """
    if not isinstance(compressor, FeedsBackSegments):
        return False
    mro = type(compressor).__mro__
    owner_of = {name: next(k for k in mro if name in vars(k)) for name in ("compress", "feed_back_segments")}
    return issubclass(owner_of["feed_back_segments"], owner_of["compress"])


class CodesBuckets:
    """Mixin for a compressor whose ``compress_many`` encodes a bucket at once where :meth:`batches_on` says
    so, tensor by tensor (the base's loop) elsewhere: DGC, and through :class:`DecodesSegments` fp4,
    QSGD, TernGrad and DeMo (whose encoding error feedback's ``bucketed`` chooses).

    ``bucketed`` chooses where: None (default) on a GPU, where a few kernels per tensor cost more
    than the arithmetic, and tensor by tensor on the CPU, whose loop is the faster one
    (``lgc-bench compressors`` measures both); True everywhere (the test matrix runs it on the CPU
    through the hook), False nowhere. Both paths give the same payloads and state, bit for bit (DeMo's
    transform on one thread: see :meth:`~lgc.compressors.dct.TiledDCT.tiles`).
    """

    #: Where a bucket is coded at once: None (a GPU), True (everywhere) or False (nowhere).
    bucketed: bool | None = None

    def segments_supported(self) -> bool:
        """Whether this configuration has a bucket-level path at all (every one, unless a compressor says)."""
        return True

    def batches_on(self, device: Any) -> bool:
        """Whether :meth:`compress_many` (and :meth:`aggregate_many`, where the codec decodes a bucket at once)
        takes a bucket at once on ``device``."""
        if not self.segments_supported():
            return False
        return self.bucketed if self.bucketed is not None else device.type != "cpu"


class DecodesSegments(CodesBuckets):
    """:class:`CodesBuckets` for a codec that also sums a bucket's gathered payloads at once
    (``decode_segments``, from :meth:`aggregate_many`) where :meth:`batches_on` says so. fp4, QSGD and
    TernGrad put it before :class:`~lgc.compressors.base.Compressor` in their bases.
    """

    def decode_segments(self, payloads: Sequence[Sequence[Any]], outs: Sequence[Tensor]) -> None:
        """Every rank's payloads of a bucket's tensors (``payloads[i]``: tensor ``i``'s) summed into ``outs``."""
        raise NotImplementedError

    def aggregate_many(self, payloads: Sequence[list[Any]], outs: Sequence[Tensor]) -> None:
        if len(outs) < 2 or not self.batches_on(outs[0].device):  # type: ignore[attr-defined]
            super().aggregate_many(payloads, outs)  # type: ignore[misc]
            return
        self.decode_segments(payloads, outs)


def one_bucket(tensors: Sequence[Tensor], keys: Sequence[str], batches_on: Callable[[Any], bool]) -> bool:
    """Whether ``tensors`` (named ``keys``) go as one flat: two or more, none empty, all on one device on
    which ``batches_on`` says so, and no key twice (the per-tensor loop applies a repeated key in turn)."""
    if len(tensors) < 2 or len(set(keys)) != len(keys) or not batches_on(tensors[0].device):
        return False
    device = tensors[0].device
    return all(t.device == device and t.numel() > 0 for t in tensors)


def pad_segments(pieces: Sequence[Tensor], lengths: Sequence[int]) -> Tensor:
    """``pieces`` end to end, each zero-padded to its entry of ``lengths`` (at least its size), in one ``cat``."""
    parts: list[Tensor] = []
    for piece, length in zip(pieces, lengths, strict=True):
        parts.append(piece)
        if length > piece.numel():
            parts.append(piece.new_zeros(length - piece.numel()))
    return torch.cat(parts)


def unpad_segments(padded: Tensor, lengths: Sequence[int], numels: Sequence[int]) -> Tensor:
    """:func:`pad_segments` undone: the first ``numels[i]`` entries of every padded segment, in one ``cat``."""
    return torch.cat([piece[:n] for piece, n in zip(padded.split(list(lengths)), numels, strict=True)])


def copy_segments_into(flat: Tensor, outs: Sequence[Tensor]) -> None:
    """``flat``'s consecutive slices into ``outs`` (cast to their dtype), one multi-tensor copy."""
    pieces = flat.split([out.numel() for out in outs])
    torch._foreach_copy_(list(outs), [piece.view_as(out) for piece, out in zip(pieces, outs, strict=True)])


class FlatGroup(NamedTuple):
    """One bucket's state laid end to end, one fp32 flat per store: ``views[s][i]`` is store ``s``'s entry of
    the bucket's ``i``-th key, a slice of ``flats[s]``."""

    flats: tuple[Tensor, ...]
    views: tuple[tuple[Tensor, ...], ...]
    numels: tuple[int, ...]


#: A bucket: its keys in order.
Signature = tuple[str, ...]


class BucketFlats:
    """The per-key state of buckets coded at once, as slices of one flat per store, and the second flats their
    held steps write into (never saved: each store keeps one tensor per key, so checkpoints survive any
    bucketing). Error feedback keeps one store (its residuals), DGC two (accumulators and momenta).

    :meth:`group` gives a bucket's flats, built anew when a store's entry is no longer its view (a
    checkpoint loaded, a held step committed tensor by tensor, DDP's buckets rebuilt); :meth:`spare`
    the second flats a held step writes into; :meth:`commit` adopts a held step's flats as the
    bucket's state when every key of the bucket was used, its old flats becoming the next spare.
    """

    def __init__(self) -> None:
        #: Bucket -> its state's flats.
        self.flats: dict[Signature, FlatGroup] = {}
        #: Bucket -> the second flats its held steps write into.
        self.spares: dict[Signature, FlatGroup] = {}
        #: The held step's buckets: keys -> (the flats it wrote, the bucket's state flats), until :meth:`commit`
        #: (the hook's overlap holds one per DDP bucket, the one-message step one for all).
        self.held: dict[Signature, tuple[FlatGroup, FlatGroup]] = {}

    def group(
        self, stores: Sequence[dict[str, Tensor]], tensors: Sequence[Tensor], keys: Sequence[str], *, held: bool
    ) -> tuple[FlatGroup, list[int]]:
        """The bucket's flats (built when needed) and the tensors whose keys had no state in the first store.

        A new group copies every store's entries in and makes them its views, and lets go of any
        other bucket that shares a key with it (its keys outside this bucket get state of their
        own, so the old flats are freed rather than held by their views); a key without state
        starts from zeros. ``held``: such a key's zeros are not stored (a held step stores nothing
        until it commits), so the flats are not the bucket's state until that key commits.
        """
        signature = tuple(keys)
        numels = tuple(t.numel() for t in tensors)
        device = tensors[0].device
        group = self.flats.get(signature)
        if (
            group is not None
            and group.numels == numels
            and group.flats[0].device == device
            and len(group.views) == len(stores)
            and all(
                store.get(key) is view
                for store, views in zip(stores, group.views, strict=True)
                for key, view in zip(keys, views, strict=True)
            )
        ):
            return group, []
        for other in [o for o in self.spares if o != signature and not set(o).isdisjoint(signature)]:
            del self.spares[other]  # another bucketing's second flats: never used again
        for other in [o for o in self.flats if not set(o).isdisjoint(signature)]:
            for store, views in zip(stores, self.flats.pop(other).views, strict=False):
                for key, view in zip(other, views, strict=True):
                    if key not in signature and store.get(key) is view:
                        store[key] = view.clone()
        fresh = [i for i, key in enumerate(keys) if stores[0].get(key) is None]
        flats, all_views = [], []
        for store in stores:
            flat = torch.zeros(sum(numels), dtype=torch.float32, device=device)
            views = tuple(flat.split(numels))
            for key, view in zip(keys, views, strict=True):
                state = store.get(key)
                if state is not None:
                    if state.numel() != view.numel():
                        raise ValueError(f"the state of {key!r} has {state.numel()} entries, its tensor {view.numel()}")
                    view.copy_(state.reshape(-1))
                if state is not None or not held:
                    store[key] = view
            flats.append(flat)
            all_views.append(views)
        group = self.flats[signature] = FlatGroup(tuple(flats), tuple(all_views), numels)
        return group, fresh

    def spare(self, group: FlatGroup, keys: Sequence[str]) -> FlatGroup:
        """The second flats a held step of the bucket writes into (its last held step's, or new), held until
        :meth:`commit` beside the bucket's state ``group``."""
        signature = tuple(keys)
        spare = self.spares.pop(signature, None)
        if (
            spare is None
            or spare.numels != group.numels
            or len(spare.flats) != len(group.flats)
            or spare.flats[0].device != group.flats[0].device
        ):
            flats = tuple(torch.empty_like(flat) for flat in group.flats)
            spare = FlatGroup(flats, tuple(tuple(flat.split(group.numels)) for flat in flats), group.numels)
        self.held[signature] = (spare, group)
        return spare

    def commit(self, keys: frozenset[str] | set[str]) -> list[Signature]:
        """End the held step: a bucket whose every key was used takes its written flats as its state (the flats
        they replace serve its next held step); any other is rebuilt by its next step. Returns the held
        buckets (their keys' per-tensor spares are slices of these flats: the caller lets them go)."""
        held, self.held = self.held, {}
        for signature, (written, before) in held.items():
            if set(signature) <= set(keys):
                self.flats[signature] = written
                self.spares[signature] = before
        return list(held)
