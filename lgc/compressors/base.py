"""The compressor interface: a flat tensor becomes a typed payload and back.

A compressor never calls :mod:`torch.distributed`. It turns one flat gradient tensor into a
:class:`Payload` (exactly what goes on the wire, with its exact size in bytes) and a payload back
into a flat tensor, and it declares through :class:`CombineMode` how the communication layer
(:mod:`lgc.ddp`) must combine the payloads of all workers.

Why one module: the compressor contract is read as one interface by anyone writing a compressor:
the payload, the :class:`Compressor` base with every call the hook makes, and the mixins that
hold a step back, decode into a buffer or forward the hook's calls to a wrapped compressor.
"""

from __future__ import annotations

import abc
import enum
import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_MIN_NUMEL",
    "DEFAULT_START_ITER",
    "CombineMode",
    "Compressor",
    "DecodesInto",
    "ForwardsHookCalls",
    "HoldsSteps",
    "Payload",
    "holds_steps",
    "keyed_seed",
    "method_min_numel",
    "method_start_iter",
    "view_bytes_as",
]

#: The hook's ``min_numel`` for a method that does not define its own (:attr:`Compressor.default_min_numel`):
#: biases and norm layers are a negligible share of the bytes but sensitive to compression, so they go dense.
DEFAULT_MIN_NUMEL = 1024

#: The hook's plain-allreduce iterations before compressing, for a method that does not define its own
#: (:attr:`Compressor.default_start_iter`): one, as PyTorch's PowerSGD hook, so DDP's buckets are
#: rebuilt before the first compressed step.
DEFAULT_START_ITER = 1


class CombineMode(enum.Enum):
    """How the communication layer combines the payloads of all workers."""

    #: Payloads are summed element-wise with one allreduce; decoding the sum gives the sum.
    SUM = "sum"
    #: Payloads are allgathered (their lengths may differ between workers) and decoded one by one.
    GATHER = "gather"
    #: Payloads are gathered at a server (rank 0), which decodes and broadcasts the aggregate.
    SERVER = "server"


def view_bytes_as(buffer: Tensor, dtype: torch.dtype) -> Tensor:
    """Reinterpret a 1-D ``uint8`` tensor as ``dtype``, copying only when it is misaligned."""
    itemsize = dtype.itemsize
    if buffer.numel() % itemsize:
        raise ValueError(f"{buffer.numel()} bytes are not a whole number of {dtype} elements")
    if buffer.storage_offset() % itemsize:
        buffer = buffer.clone()
    return buffer.view(dtype)


def keyed_seed(seed: int, key: str, count: int) -> int:
    """A 64-bit seed for ``key``'s ``count``-th draw under ``seed``: a hash, not a generator's next draw.

    A compressor that draws per tensor from it (DGC's sampled threshold, QSGD's and TernGrad's
    rounding) draws the same numbers for a tensor whatever other tensors a step compressed and in
    whatever order: DDP's bucket order (rebuilt after the first iteration, so a resumed run's first
    step sees another), the overlap path encoding a parameter some rank may not use. Its checkpoint
    is the per-key counts.
    """
    digest = hashlib.blake2b(f"{seed}:{count}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def method_min_numel(compressor: Compressor) -> int:
    """The hook's ``min_numel`` a compressor's method defines: ``default_min_numel``, or :data:`DEFAULT_MIN_NUMEL`.

    Wrappers forward the attribute (:class:`ForwardsHookCalls`), so ``ErrorFeedback(DeMoCompressor())``
    and ``ErrorFeedback(QuantizedValues(ChunkedTopKCompressor()))`` give 1 (every tensor through the
    method, as the references do).
    """
    value = compressor.default_min_numel
    return DEFAULT_MIN_NUMEL if value is None else int(value)


def method_start_iter(compressor: Compressor) -> int:
    """The hook's ``start_iter`` a compressor's method defines: ``default_start_iter``, or :data:`DEFAULT_START_ITER`.

    ``ErrorFeedback(DeMoCompressor())`` gives 0 (the reference compresses from the first step;
    wrappers forward the attribute).
    """
    value = compressor.default_start_iter
    return DEFAULT_START_ITER if value is None else int(value)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A payload dataclass's field names, in declaration order (``dataclasses.fields`` is slow per call)."""
    return tuple(f.name for f in fields(cls))


@dataclass
class Payload:
    """What one worker puts on the wire for one flat tensor.

    Subclasses are dataclasses whose tensor fields are the wire content, in declaration order;
    non-tensor fields (such as the decoded length) are metadata every worker already knows from
    the model's layout and are not sent. ``nbytes`` is the exact wire size.
    """

    #: Length of the flat tensor this payload decodes to; known to every worker, never sent.
    numel: int

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors that go on the wire, in a fixed order."""
        values = (getattr(self, name) for name in _field_names(type(self)))
        return tuple(value for value in values if isinstance(value, Tensor))

    @property
    def nbytes(self) -> int:
        """Exact number of bytes this payload occupies on the wire."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to_wire(self) -> Tensor:
        """All wire tensors as one contiguous ``uint8`` buffer of ``nbytes`` bytes."""
        parts = self.wire_parts()
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def wire_parts(self) -> list[Tensor]:
        """:meth:`to_wire`'s bytes as ``uint8`` pieces, in order, not yet joined.

        The hook packs a bucket's payloads with one ``torch.cat`` of every payload's pieces rather
        than one per payload. A payload that writes its own :meth:`to_wire` is one piece.
        """
        if type(self).to_wire is not Payload.to_wire:
            return [self.to_wire()]
        return [t.contiguous().reshape(-1).view(torch.uint8) for t in self.tensors()]


#: How lgc-train's config names the optimizer's momentum and weight decay (the default ``sources``).
OPTIMIZER_SOURCES = ("optimizer.momentum", "optimizer.weight_decay")


class Compressor(abc.ABC):
    """Turns flat tensors into payloads and back.

    Subclasses set :attr:`combine` and implement :meth:`compress`, :meth:`decompress` and
    :meth:`payload_from_wire`. Stateful compressors keep their state per ``key`` (a name that is
    stable across steps and restarts, the parameter name in the DDP hook) and expose it through
    :meth:`state_dict` / :meth:`load_state_dict`.
    """

    #: How payloads of different workers are combined.
    combine: CombineMode
    #: Whether the compressor keeps no state between steps (no residual, momentum or random
    #: generator): the hook then needs no step-level agreement before compressing (see
    #: :mod:`lgc.ddp.hook`), and non-finite gradients simply pass through its sum.
    stateless: bool = False
    #: Whether :meth:`compress` is a function of its input alone (and of configuration, the shared
    #: seed, the rank and the world size) although the method needs error feedback: top-k, SBC,
    #: EF-signSGD's scaled sign, RedSync without a reused threshold. Error feedback over such a
    #: compressor (or a stateless one) can then encode a step before the ranks agree on it and commit
    #: it after (the hook's ``overlap``).
    pure_encoding: bool = False
    #: Whether payload sizes can differ between workers for the same tensor (sizes are then
    #: exchanged before the payloads).
    variable_size: bool = False
    #: Whether every worker must draw the same random numbers (e.g. shared random offsets): the
    #: hook then broadcasts rank 0's :attr:`shared_seed` once and calls :meth:`set_shared_seed`.
    needs_shared_seed: bool = False
    shared_seed: int = 0
    #: The hook's ``min_numel`` that is part of this method's definition (tensors with fewer
    #: elements are sent dense), used wherever no ``min_numel`` is given (:func:`method_min_numel`);
    #: ``None``: :data:`DEFAULT_MIN_NUMEL`. 1 where the reference sends every tensor (DeMo, SparseLoCo's
    #: chunked top-k, Streaming DiLoCo's fp4).
    default_min_numel: int | None = None
    #: The hook's ``start_iter`` that is part of this method's definition (plain-allreduce iterations
    #: before compressing), used wherever no ``start_iter`` is given (:func:`method_start_iter`);
    #: ``None``: :data:`DEFAULT_START_ITER`. 0 where the reference compresses from its first step (DeMo).
    default_start_iter: int | None = None
    #: Whether what the compressor does not send is lost unless error feedback keeps it
    #: (sparsifiers, EF-signSGD): ``lgc.compress`` refuses it without error feedback unless told.
    needs_error_feedback: bool = False
    #: Whether it keeps what it does not send itself (DGC's accumulator is its error feedback):
    #: :class:`~lgc.compressors.ErrorFeedback` refuses to wrap it, which would feed the error back twice.
    keeps_own_residual: bool = False
    #: Whether it is a quantizer: every entry is sent (rounded, cast or signed), so the payload of a
    #: piece of a tensor decodes to that piece and no selection spans the tensor. FSDP2's compressed
    #: reduce-scatter then codes each rank's chunk of a gradient on its own and sends it only to the
    #: rank that owns it (:mod:`lgc.fsdp.reduce_scatter`); a sparsifier selects on the whole gradient.
    codes_every_entry: bool = False
    #: Whether :meth:`transform_dense` is not the identity (DGC's momentum on the tensors sent dense):
    #: the hook's one-message step then encodes the dense tensors ahead of the ranks' agreement too,
    #: which needs :meth:`HoldsSteps.transform_dense_pending`.
    transforms_dense: bool = False

    def optimizer_settings_needed(self) -> tuple[str, ...]:
        """The optimizer settings this method must know before it runs (``"momentum"``, ``"weight_decay"``).

        None by default; DGC needs the momentum (and the decay when it applies its own), so
        ``lgc.compress`` asks for them when it is given no optimizer.
        """
        return ()

    def check_optimizer(
        self, momentum: float, weight_decay: float | None, *, sources: tuple[str, str] = OPTIMIZER_SOURCES
    ) -> None:
        """Refuse an optimizer that applies what this method applies itself (``weight_decay=None``: unknown).

        ``sources`` name where the two values come from, for the message (lgc-train's
        ``optimizer.momentum``, a torch optimizer's ``param_groups[0]['momentum']``, ...). Nothing by
        default; DGC (momentum, weight decay) and DeMo (momentum) refuse theirs.
        """

    @abc.abstractmethod
    def compress(self, tensor: Tensor, key: str) -> Payload:
        """Encode one flat tensor; ``key`` names it so per-tensor state can be kept."""

    def batches_on(self, device: torch.device) -> bool:
        """Whether :meth:`compress_many` encodes many tensors in a fixed number of passes on ``device``.

        Then the hook hands it a whole step's tensors at once (every bucket); otherwise bucket by
        bucket, each bucket's collectives starting while the next is encoded. False by default.
        """
        return False

    def compress_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """Encode every tensor of one bucket: ``[compress(t, key) for ...]``, in the order given.

        The DDP hook hands a step's compressed parameters of one bucket together, so a compressor
        may encode them in a fixed number of passes instead of a few kernels per tensor (error
        feedback over top-k on a GPU: :meth:`~lgc.compressors.ErrorFeedback.compress_many`). An
        override leaves the state the loop would, bit for bit, and returns payloads that decode to
        the same bits (a sparse payload's (value, index) pairs may come in another order), where
        the selection is unique: entries tied at a top-k's ``k``-th magnitude may be chosen
        differently (each selection exact), after which the states differ.
        """
        return [self.compress(tensor, key) for tensor, key in zip(tensors, keys, strict=True)]

    @abc.abstractmethod
    def decompress(self, payload: Payload) -> Tensor:
        """Decode a payload (or, for :attr:`CombineMode.SUM`, a sum of payloads) to a flat tensor."""

    def decompress_into(self, payload: Payload, out: Tensor) -> None:
        """Write :meth:`decompress`'s result into ``out`` (flat, any floating dtype): what the hook calls.

        The default decodes and copies, and copies nothing where the decoded tensor already is
        ``out`` (``none``'s sum lies in the bucket). A compressor whose decoding is a cast (fp16)
        overrides it with one casting copy, skipping the fp32 temporary.
        """
        decoded = self.decompress(payload).reshape(-1)
        if decoded.data_ptr() != out.data_ptr():
            out.copy_(decoded)

    @abc.abstractmethod
    def payload_from_wire(self, wire: Tensor, numel: int, *, key: str | None = None) -> Payload:
        """Rebuild a payload from the ``uint8`` buffer written by :meth:`Payload.to_wire`.

        ``key`` names the tensor as :meth:`compress`'s did (the hook passes the parameter's name):
        compressors whose payload layout follows the parameter's shape (chunked top-k, DeMo) read
        it from there; the others ignore it.
        """

    def payloads_from_wire_many(
        self, wires: Sequence[Tensor], numels: Sequence[int], keys: Sequence[str]
    ) -> list[Payload]:
        """One rank's payloads of a bucket's tensors rebuilt at once: ``[payload_from_wire(w, n, key=k) for ...]``
        unless a compressor parses them in a fixed number of passes (SBC's Golomb-coded positions)."""
        return [
            self.payload_from_wire(wire, numel, key=key) for wire, numel, key in zip(wires, numels, keys, strict=True)
        ]

    def payload_from_sum(self, summed: Tensor, own: Payload) -> Payload:
        """Rebuild a payload from the allreduced sum of every worker's wire tensor (:attr:`CombineMode.SUM`).

        ``own`` is this worker's payload of the same tensor: the sum has its single wire tensor's
        dtype and shape, and its metadata (which every worker computes alike). The default parses
        the sum's bytes with :meth:`payload_from_wire`; compressors whose wire dtype is not fixed by
        their configuration (``none`` sends the gradient's own dtype) override this.
        """
        return self.payload_from_wire(summed.contiguous().view(torch.uint8), own.numel)

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        """Sum of the decoded payloads of all workers (for gathered payloads).

        Subclasses override this when decoding all payloads at once is cheaper.
        """
        total = self.decompress(payloads[0]).clone()
        for payload in payloads[1:]:
            total += self.decompress(payload)
        return total

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        """Write the sum of the decoded payloads into ``out`` (the tensor's slice of the DDP bucket).

        The hook decodes gathered payloads with this, so a compressor can scatter straight into
        the bucket instead of building a dense sum and copying it. The default copies :meth:`aggregate`.
        """
        out.copy_(self.aggregate(payloads))

    def aggregate_many(self, payloads: Sequence[list[Payload]], outs: Sequence[Tensor]) -> None:
        """:meth:`aggregate_into` for every tensor of one bucket: ``payloads[i]`` (every rank's) into ``outs[i]``.

        The hook decodes a bucket's gathered payloads with this; a compressor may decode them in a
        fixed number of passes (top-k's family on a GPU: :func:`~lgc.compressors.topk.scatter_add_sparse_many`)
        as long as every ``outs[i]`` gets the bits the loop would write.
        """
        for received, out in zip(payloads, outs, strict=True):
            self.aggregate_into(received, out)

    def transform_dense(self, tensor: Tensor, key: str) -> Tensor:
        """What to send for a tensor the hook sends dense (smaller than ``min_numel``).

        The identity by default. Compressors that own part of the optimizer (DGC's momentum
        correction) apply it here too, so small tensors get the same update rule. May return
        ``tensor`` itself; must not modify it in place.
        """
        return tensor

    def attach_parameters(self, parameters: Mapping[str, Tensor]) -> None:
        """Receive the model's parameters by name (the ``key`` of :meth:`compress`); called by the hook.

        A no-op by default. Compressors that own part of the optimizer and need the weights
        themselves (DGC's weight decay, see :meth:`finish_aggregate`) keep the mapping; they must
        not pickle or checkpoint it.
        """

    def finish_aggregate(self, aggregate: Tensor, key: str) -> None:
        """Complete, in place, the averaged update of ``key`` that the optimizer will read.

        The hook calls it on every rank for every parameter of a compressed step, compressed or
        sent dense, right after that parameter's sum is written into its slice of the DDP bucket
        (``aggregate``, in the bucket's dtype and in the units the compressor sees: divided by any
        AMP loss scale); never in the hook's plain-allreduce iterations. A compressor with state
        (``stateless = False``) runs behind the step guard (:mod:`lgc.ddp.step_guard`), and so does every
        exchange of communication delay: then it is not called for a parameter whose gradient is
        zero on every rank (unused), nor in a step the guard passes through (inf/NaN). A stateless
        compressor runs without the guard: it is called for every parameter of every step, unused
        parameters and non-finite steps included, so a stateless compressor's override must keep
        no state. What it adds is never sent, so it must be the same on every rank: a function of
        state every rank shares, such as the synchronized weights. A no-op by default; DGC (which
        keeps state) adds its weight decay's momentum here, as the authors' optimizer does.
        """

    def begin_step(self, step: int) -> None:
        """Called by the hook before the first tensor of every compressed step (``step`` counts from 0)."""

    def set_epoch(self, epoch: int) -> None:
        """Called at the start of every epoch (by :class:`lgc.lit.CompressionCallback`; plain scripts call it)."""

    def residual_store(self) -> dict[str, Tensor]:
        """The memory it keeps of what it did not send, per parameter (error feedback's residuals, DGC's accumulators).

        Empty for a compressor that keeps none; read by the per-layer table (its norms) only.
        """
        return {}

    def residual_norm(self) -> float | None:
        """L2 norm of :meth:`residual_store` (a health signal: it should stay bounded); None without one."""
        return None

    @property
    def own_weight_decay(self) -> float:
        """The weight decay the compressor applies itself (DGC's ``weight_decay``); 0 for the others."""
        return 0.0

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        """The first compressed step from which this compressor sends what it sends for the rest of the run.

        0 for a compressor without a warm-up; DGC's density warm-up lasts its warm-up epochs of
        ``steps_per_epoch`` steps each (its own ``steps_per_epoch`` where it was given one).
        """
        return 0

    def set_shared_seed(self, seed: int) -> None:
        """Receive the seed every worker agrees on (only called when :attr:`needs_shared_seed`)."""
        self.shared_seed = int(seed)

    def set_world_size(self, world_size: int) -> None:
        """Receive the number of workers the hook divides gradients by (the hook calls it before every exchange).

        A no-op by default; compressors that add a term per worker (DGC's weight decay, its
        clipping threshold) take their divisor from here rather than from configuration.
        """

    def set_rank(self, rank: int) -> None:
        """Receive this worker's rank in the group (the hook calls it before every exchange).

        A no-op by default; compressors whose randomness must differ between workers derive it
        from the rank (unshared random blocks), never from state copied from the launching process.
        """

    def state_dict(self) -> dict[str, Any]:
        """State that must survive a restart (empty for stateless compressors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state with keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class DecodesInto:
    """Mixin for dense payloads that ``self._decode(payload, out)`` writes into an fp32 tensor of ``numel`` entries.

    EF-signSGD and the stochastic quantizers (QSGD, TernGrad) put it before :class:`Compressor` in
    their bases. The workers' sum is decoded payload by payload in rank order, the first straight
    into the result and each other one through a scratch tensor; :meth:`aggregate_into` decodes
    into the bucket slice itself when it is fp32 (no dense temporary, no copy), otherwise casts the
    fp32 sum once.
    """

    def _decode(self, payload: Any, out: Tensor) -> Tensor:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> Tensor:
        device = payload.tensors()[0].device
        return self._decode(payload, torch.empty(payload.numel, dtype=torch.float32, device=device))

    def aggregate(self, payloads: list[Payload]) -> Tensor:
        total = self.decompress(payloads[0])
        self._add_decoded(payloads[1:], total)
        return total

    def aggregate_into(self, payloads: list[Payload], out: Tensor) -> None:
        if out.dtype != torch.float32 or not out.is_contiguous():
            out.copy_(self.aggregate(payloads))
            return
        self._decode(payloads[0], out)
        self._add_decoded(payloads[1:], out)

    def _add_decoded(self, payloads: list[Payload], total: Tensor) -> None:
        scratch = torch.empty_like(total) if payloads else None
        for payload in payloads:
            assert scratch is not None
            total += self._decode(payload, scratch)


class HoldsSteps:
    """Mixin for a compressor that can encode a step before the ranks agree on it (the hook's ``overlap``).

    :meth:`compress_pending` returns :meth:`~Compressor.compress`'s payload and holds the state
    the step would move (residuals, momenta, counts of draws, thresholds) aside; once every rank's
    look at the step is in, the hook keeps it for the parameters that were used (:meth:`commit`)
    or drops it whole (:meth:`drop`, a skipped step), so a step encoded ahead trains bitwise as one
    encoded after the agreement. Error feedback, DGC, QSGD and TernGrad, RedSync and random-block
    put it before :class:`Compressor` in their bases; a compressor of your own that keeps state
    subclasses it (and implements the two methods) to take part in ``overlap``.
    """

    #: Whether :meth:`compress_pending` is available (error feedback: only over a wrapped compressor that allows it).
    speculates: bool = True

    def compress_pending(self, tensor: Tensor, key: str) -> Payload:
        """:meth:`~Compressor.compress`'s payload, the state the step moves held aside until :meth:`commit`."""
        raise NotImplementedError

    def compress_pending_many(self, tensors: Sequence[Tensor], keys: Sequence[str]) -> list[Payload]:
        """:meth:`compress_pending` of every tensor of a step: ``[compress_pending(t, key) for ...]`` unless a
        compressor encodes them in a fixed number of passes (DGC's bucket path), with the same payloads."""
        return [self.compress_pending(tensor, key) for tensor, key in zip(tensors, keys, strict=True)]

    def commit(self, keys: frozenset[str] | set[str]) -> None:
        """Adopt the held step for ``keys``; for the others, the state stays as before the step."""
        raise NotImplementedError

    def drop(self) -> None:
        """Drop the held step (the ranks agreed to skip it): ``commit(frozenset())``, unless a compressor says more."""
        self.commit(frozenset())

    def transform_dense_pending(self, tensor: Tensor, key: str) -> Tensor:
        """:meth:`~Compressor.transform_dense`, the state it moves held aside with the step until :meth:`commit`.

        Needed only where ``transforms_dense`` is true (DGC); the identity transform holds nothing.
        """
        raise NotImplementedError(f"{type(self).__name__} transforms dense tensors but cannot hold that step back")


def holds_steps(compressor: Compressor) -> bool:
    """Whether ``compressor`` can encode a step ahead of the ranks' agreement (:class:`HoldsSteps`, ``speculates``)."""
    return isinstance(compressor, HoldsSteps) and compressor.speculates


class ForwardsHookCalls:
    """Mixin for a compressor that wraps another (``self.compressor``): the hook's calls reach the inner one.

    The per-step and per-run calls that configure a compressor rather than encode for it (rank,
    world size, parameters, step, epoch, dense small tensors, the finished aggregate, the optimizer's
    rules) are forwarded, so a wrapper
    (:class:`~lgc.compressors.ErrorFeedback`, :class:`~lgc.compressors.QuantizedValues`) cannot
    forget one. Put it before :class:`Compressor` in the bases.
    """

    compressor: Compressor

    def transform_dense(self, tensor: Tensor, key: str) -> Tensor:
        return self.compressor.transform_dense(tensor, key)

    @property
    def transforms_dense(self) -> bool:  # type: ignore[override]
        return self.compressor.transforms_dense

    def attach_parameters(self, parameters: Mapping[str, Tensor]) -> None:
        self.compressor.attach_parameters(parameters)

    def finish_aggregate(self, aggregate: Tensor, key: str) -> None:
        self.compressor.finish_aggregate(aggregate, key)

    def begin_step(self, step: int) -> None:
        self.compressor.begin_step(step)

    def set_epoch(self, epoch: int) -> None:
        self.compressor.set_epoch(epoch)

    def steady_from(self, steps_per_epoch: int = 1) -> int:
        return self.compressor.steady_from(steps_per_epoch)

    def residual_store(self) -> dict[str, Tensor]:
        return self.compressor.residual_store()

    def residual_norm(self) -> float | None:
        return self.compressor.residual_norm()

    @property
    def own_weight_decay(self) -> float:
        return self.compressor.own_weight_decay

    @property
    def default_min_numel(self) -> int | None:  # type: ignore[override]
        return self.compressor.default_min_numel

    @property
    def default_start_iter(self) -> int | None:  # type: ignore[override]
        return self.compressor.default_start_iter

    def set_world_size(self, world_size: int) -> None:
        self.compressor.set_world_size(world_size)

    def set_rank(self, rank: int) -> None:
        self.compressor.set_rank(rank)

    def optimizer_settings_needed(self) -> tuple[str, ...]:
        return self.compressor.optimizer_settings_needed()

    def check_optimizer(
        self, momentum: float, weight_decay: float | None, *, sources: tuple[str, str] = OPTIMIZER_SOURCES
    ) -> None:
        self.compressor.check_optimizer(momentum, weight_decay, sources=sources)
