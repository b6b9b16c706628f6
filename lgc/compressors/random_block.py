"""Random-block sparsification (Eghlidi & Jaggi, "Sparse Communication for Training Deep Networks", 2020).

Each worker sends one contiguous block of ``k = ceil(density * n)`` entries at a random offset,
with error feedback (``m += g; send m[block]; m[block] = 0``): selection is O(k), with no sort
and no pass over the tensor, and the block is contiguous memory. Two modes:

* **shared** (default): every worker uses the same offset, derived from a seed that rank 0
  broadcasts once (the DDP hook does this through :attr:`Compressor.needs_shared_seed`) and the
  step number, so the ``k`` values of all workers are summed by a plain **allreduce** and no
  position is ever sent: exactly ``4 k`` bytes per tensor.
* **unshared**: every worker draws its own offset, independent of the other workers' (derived
  from the same broadcast seed, its rank and the tensor's name), and sends it with the values
  (``8 + 4 k`` bytes); payloads are allgathered and each block is added at its offset.

Wrap-around: a block that starts less than ``k`` entries before the end continues at entry 0.
Offsets are uniform over all ``n`` positions, so every entry is sent with the same probability
``k / n``; clamping the offset to ``n - k`` instead would send the first and last entries
``k`` times less often than the middle ones and let their residuals grow.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lgc.compressors.base import CombineMode, Compressor, HoldsSteps, Payload, view_bytes_as
from lgc.compressors.topk import SparsePayload, num_selected, scatter_add_sparse_into
from lgc.validation import Density, Seed, check

__all__ = ["BlockPayload", "OffsetBlockPayload", "RandomBlockCompressor", "block_offset"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a fast, well-mixed 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_offset(seed: int, step: int, numel: int, *stream: int) -> int:
    """The block offset for a tensor of ``numel`` entries at ``step``, uniform in ``[0, numel)``.

    A pure function of its arguments (no Python ``hash``, no global RNG), so every worker, and a
    resumed run, computes the same offset. ``stream`` words select an independent sequence (the
    unshared mode passes the worker's rank and the tensor's name). The modulo bias is below
    ``numel / 2**64``.
    """
    h = 0
    for word in (seed, step, numel, *stream):
        h = _splitmix64(h ^ (word & _MASK64))
    return h % numel if numel else 0


def _name_word(key: str) -> int:
    """A stable 32-bit word for a tensor's name (CRC-32: the same in every process, unlike ``hash``)."""
    return zlib.crc32(key.encode())


def _block_positions(offset: int, k: int, numel: int, device: torch.device) -> Tensor:
    """``(offset + arange(k)) % numel`` in O(k), as int64."""
    positions = torch.arange(offset, offset + k, device=device)
    wrapped = numel - offset  # positions from here on wrap to the start
    if wrapped < k:
        positions[wrapped:] -= numel
    return positions


@dataclass
class BlockPayload(SparsePayload):
    """``values`` belong at the ``k`` consecutive positions from ``offset`` (wrapping at the end).

    Shared mode: only ``values`` goes on the wire (``4 k`` bytes); ``offset`` is metadata every
    worker computes itself, and ``indices`` (the implied positions, int64) are never sent. They
    make the payload a :class:`SparsePayload` to every consumer, so the error-feedback wrapper
    updates its residual in O(k) instead of decoding a dense tensor.
    """

    #: First position of the block; known to every worker, not sent.
    offset: int

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.values,)

    def _pieces(self) -> tuple[tuple[slice, slice], ...]:
        """(destination, source) slice pairs: one, or two when the block wraps around."""
        k, head = self.values.numel(), self.numel - self.offset
        if head >= k:
            return ((slice(self.offset, self.offset + k), slice(0, k)),)
        return ((slice(self.offset, self.numel), slice(0, head)), (slice(0, k - head), slice(head, k)))

    def add_to(self, dense: Tensor) -> Tensor:
        """Add the block into ``dense`` in place (contiguous slices, no indexing)."""
        for destination, source in self._pieces():
            dense[destination] += self.values[source]
        return dense

    def subtract_from(self, dense: Tensor) -> Tensor:
        """``dense -= decode(self)`` in place, by contiguous slices."""
        for destination, source in self._pieces():
            dense[destination] -= self.values[source]
        return dense

    def to_dense(self) -> Tensor:
        dense = self.values.new_zeros(self.numel, dtype=torch.float32)
        for destination, source in self._pieces():
            dense[destination] = self.values[source]
        return dense


@dataclass
class OffsetBlockPayload(BlockPayload):
    """Unshared mode: the block's offset travels with it, as one int64 before the values (``8 + 4 k`` bytes)."""

    #: ``[offset]`` as int64, the wire form of :attr:`offset`.
    offset_wire: Tensor

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.offset_wire, self.values)


class RandomBlockCompressor(HoldsSteps, Compressor):
    """Sends a contiguous block of ``k = ceil(density * n)`` entries at a random offset.

    Use it with error feedback (yaml ``error_feedback: true``, or wrap it in
    :class:`lgc.compressors.ErrorFeedback`): without it, everything outside the block is lost.

    Args:
        density: fraction of entries sent, in (0, 1]. The block is not chosen by magnitude, so it
            needs more density than top-k for the same accuracy; 0.01 is a reasonable start.
            With error feedback an entry waits ``1 / density`` steps on average and then arrives
            as the sum of that many gradients, which acts like a stale, large step: lower the
            learning rate as the density drops. Measured on a least-squares problem with SGD
            (lr 0.1): density 0.25 converges like dense, 0.1 diverges unless lr drops to ~0.02,
            while top-k at 0.1 converges at lr 0.1.
        shared: all workers use the same offset (``combine = SUM``: one allreduce of ``4 k``
            bytes, no positions), derived from ``(seed, step, n)``. Otherwise each worker
            draws its own offset (``combine = GATHER``: an allgather of ``8 + 4 k`` bytes per
            worker) from ``(seed, step, n, rank, name)``, independent of the other workers', which
            covers ``P`` blocks per step instead of one, at ``P`` times the bytes. Shared is the
            efficient mode and the right default.
        seed: the run's seed. In both modes rank 0's value is broadcast once and used by every
            worker (the other ranks' values are ignored), so a run is reproducible and the
            workers' offsets are independent in unshared mode whatever the seed; ``None`` draws
            rank 0's seed from OS entropy.

    Shared offsets depend on the tensor's length, not on its name: the hook rebuilds summed
    payloads with :meth:`payload_from_wire` (wire bytes and length only), which must find the
    offset again. Two same-sized tensors therefore share their offset within a step; each still
    gets a uniformly random offset every step, independent across steps, with its own residual.

    The step is set by :meth:`begin_step` (the DDP hook calls it every step). Outside the hook,
    compressing a key a second time without :meth:`begin_step` advances the step by one, so the
    block keeps moving in a plain loop instead of sending the same block forever.

    Example::

        >>> compressor = RandomBlockCompressor(density=0.01)
        >>> payload = compressor.compress(torch.randn(10_000), key="w")
        >>> payload.nbytes  # 100 fp32 values, no positions
        400
    """

    needs_error_feedback = True

    def __init__(self, density: Density = 0.01, shared: bool = True, seed: Seed | None = 0) -> None:
        check("density", density, Density)
        check("seed", seed, Seed | None)
        self.density = float(density)
        self.shared = check("shared", shared, bool)
        self.seed = seed
        self.combine = CombineMode.SUM if self.shared else CombineMode.GATHER
        # Both modes: rank 0's seed is everyone's (unshared offsets then differ by rank, not by a
        # generator state that spawned workers would all inherit from the launching process).
        self.needs_shared_seed = True
        # Without a seed, rank 0's entropy becomes everyone's seed via the broadcast.
        self.shared_seed = int(seed) if seed is not None else torch.Generator().seed() & ((1 << 63) - 1)
        #: This worker's rank (set by the hook; 0 in a single process).
        self.rank = 0
        #: Current step (from begin_step, or advanced when a key repeats outside the hook).
        self.step = 0
        self._keys_this_step: set[str] = set()
        #: A step encoded ahead of the ranks' agreement (:meth:`compress_pending`): its keys, and
        #: the step and keys before :meth:`begin_step` moved them, until :meth:`commit` or :meth:`drop`.
        self._pending: set[str] = set()
        self._before_step: tuple[int, set[str]] | None = None

    # ----------------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self._before_step = (self.step, set(self._keys_this_step))
        self.step = int(step)
        self._keys_this_step.clear()

    # -- encoding ahead of the step's agreement (the hook's overlap: HoldsSteps) -------------------------
    # Only where payloads are gathered (shared=False); shared offsets sum their payloads, which
    # overlap cannot (the hook refuses it by the combine mode).

    def compress_pending(self, tensor: Tensor, key: str) -> BlockPayload:
        """:meth:`compress`'s payload; the key counts as compressed this step only once :meth:`commit` keeps it."""
        payload = self.compress(tensor, key)
        self._pending.add(key)
        return payload

    def commit(self, keys: frozenset[str] | set[str]) -> None:
        """Keep the held step for ``keys``; the others count as not compressed this step.

        ``commit(frozenset())``: no parameter was used (the step stands); a step the ranks agreed to
        skip is dropped by :meth:`drop`.
        """
        pending, self._pending = self._pending, set()
        self._keys_this_step -= pending - set(keys)
        self._before_step = None

    def drop(self) -> None:
        """Drop the held step: the step and keys return to what they were before :meth:`begin_step`."""
        before = self._before_step
        self.commit(frozenset())
        if before is not None:
            self.step, self._keys_this_step = before[0], set(before[1])

    def set_rank(self, rank: int) -> None:
        self.rank = int(rank)

    def _offset(self, numel: int, key: str) -> int:
        if self.shared:
            return block_offset(self.shared_seed, self.step, numel)
        return block_offset(self.shared_seed, self.step, numel, self.rank + 1, _name_word(key))

    def compress(self, tensor: Tensor, key: str) -> BlockPayload:
        if key in self._keys_this_step:  # a plain loop without begin_step(): move on
            self.begin_step(self.step + 1)
        self._keys_this_step.add(key)
        tensor = tensor.reshape(-1)  # a view for the hook's flat slices
        numel = tensor.numel()
        k = num_selected(numel, self.density)
        offset = self._offset(numel, key) if k < numel else 0
        end = offset + k
        # A copy in fp32: error feedback then updates ``tensor`` in place, which must not change the values.
        if end <= numel:
            values = tensor[offset:end].to(torch.float32, copy=True)
        else:
            values = torch.cat((tensor[offset:], tensor[: end - numel])).to(torch.float32)
        positions = _block_positions(offset, k, numel, tensor.device)
        if self.shared:
            return BlockPayload(numel=numel, values=values, indices=positions, offset=offset)
        offset_wire = torch.tensor([offset], dtype=torch.int64, device=tensor.device)
        return OffsetBlockPayload(numel=numel, values=values, indices=positions, offset=offset, offset_wire=offset_wire)

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, BlockPayload)
        return payload.to_dense()

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        total = payloads[0].values.new_zeros(payloads[0].numel, dtype=torch.float32)  # type: ignore[attr-defined]
        for payload in payloads:
            assert isinstance(payload, BlockPayload)
            payload.add_to(total)
        return total

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        """Zero ``out`` (the tensor's slice of the bucket) and add each block at its offset: no dense temporary."""
        scatter_add_sparse_into(payloads, out)  # type: ignore[arg-type]

    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> BlockPayload:
        if self.shared:
            # The wire holds only values (possibly summed over workers): the offset is this step's.
            values = view_bytes_as(wire, torch.float32)
            k = values.numel()
            offset = block_offset(self.shared_seed, self.step, numel) if k < numel else 0
            positions = _block_positions(offset, k, numel, wire.device)
            return BlockPayload(numel=numel, values=values, indices=positions, offset=offset)
        offset_wire = view_bytes_as(wire[:8], torch.int64)
        values = view_bytes_as(wire[8:], torch.float32)
        offset = int(offset_wire)
        positions = _block_positions(offset, values.numel(), numel, wire.device)
        return OffsetBlockPayload(numel=numel, values=values, indices=positions, offset=offset, offset_wire=offset_wire)

    # ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "keys_this_step": sorted(self._keys_this_step), "shared_seed": self.shared_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"step", "keys_this_step", "shared_seed"}
        if unknown:
            raise ValueError(f"RandomBlockCompressor got unknown state keys {sorted(unknown)}")
        self.step = int(state["step"])
        self._keys_this_step = set(state["keys_this_step"])
        self.shared_seed = int(state["shared_seed"])
        self._pending, self._before_step = set(), None

    def __repr__(self) -> str:
        return f"RandomBlockCompressor(density={self.density}, shared={self.shared}, seed={self.seed})"
