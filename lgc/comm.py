"""How a method communicates: every step, or after local steps (local SGD, DiLoCo, Streaming DiLoCo).

``lgc-train``'s ``comm`` config group has one option per way, each a dataclass below (the one
source of its fields and defaults; ``lgc/conf`` registers them with Hydra), so a setting that does
not apply to the chosen way cannot be set: ``comm=every_step comm.delay=4`` is refused by Hydra, as
is a value of the wrong type (``comm.delay=abc``).

=====================  ====================================================================================
``comm=``               what is sent, and when
=====================  ====================================================================================
``every_step``          every step's gradients, compressed (:class:`~lgc.ddp.CompressionHookState`)
``local_sgd``           every ``delay`` local steps, the weight update, averaged and added (SBC, SparseLoCo)
``diloco``              every ``delay`` local steps, the pseudo-gradient, applied by an outer Nesterov SGD
``streaming_diloco``    DiLoCo with the parameters cut into ``fragments`` exchanged on staggered steps
=====================  ====================================================================================

Local steps are :mod:`lgc.ddp.local_sgd`'s :class:`~lgc.ddp.local_sgd.CommunicationDelayState`,
whose docstring explains the outer step and the fragments. :class:`Comm` is the general record the
builder (:func:`lgc.methods.build_hook_state`) reads; ``lgc.compress`` fills it from its keyword
arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from lgc.ddp.fragments import FRAGMENT_SPLITS
from lgc.validation import NonNegativeInt, PositiveInt, check

__all__ = ["COMM_OPTIONS", "Comm", "DiLoCo", "EveryStep", "LocalSGD", "StreamingDiLoCo"]


@dataclasses.dataclass(frozen=True)
class Comm:
    """Every communication setting at once: what the builder reads, whichever way they were given.

    ``None`` for a field that has a default means the default. ``lgc.compress`` builds one from its
    keyword arguments; ``lgc-train`` from its ``comm`` option (:meth:`EveryStep.to_comm` ...).
    """

    #: Parameters with fewer elements go dense; None: the method's own (``Compressor.default_min_numel``).
    min_numel: int | None = None
    #: Plain-allreduce iterations before compressing; None: the method's own (``Compressor.default_start_iter``).
    start_iter: int | None = None
    #: Every step: encode and send each bucket as it arrives (:class:`~lgc.ddp.CompressionHookState`'s ``overlap``).
    overlap: bool | None = False
    #: Every step: put a compressed step on the wire in two collectives (:class:`~lgc.ddp.CompressionHookState`'s
    #: ``pack``); None: wherever the method allows it.
    pack: bool | None = None
    #: Every step: module buffers from rank 0 (``broadcast``) or averaged over the workers (``average``).
    buffers: str | None = "broadcast"
    #: Local optimizer steps per exchange of weight updates (SBC's communication delay); None: every step.
    delay: int | None = None
    #: With ``delay``: ``average`` (SBC) or ``sgd`` (DiLoCo's outer Nesterov SGD).
    outer: str | None = "average"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    #: With ``delay``: Streaming DiLoCo's fragments and how the parameters are dealt into them.
    fragments: int | None = 1
    fragment_split: str | None = FRAGMENT_SPLITS[0]
    #: With ``delay``: Streaming DiLoCo's overlap ``tau`` and the local weights' share ``alpha`` when applied.
    overlap_steps: int | None = 0
    mixing: float | None = 0.0
    #: How messages name a field: ``comm.`` for a config node, empty for keyword arguments.
    prefix: str = "comm."

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> Comm:
        """From a plain mapping of these fields (absent keys take their defaults)."""
        names = [field.name for field in dataclasses.fields(cls) if field.name != "prefix"]
        unknown = sorted(set(node) - set(names))
        if unknown:
            raise ValueError(f"comm.{unknown[0]} is not a communication setting; they are {', '.join(names)}")
        return cls(**node)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.name != "prefix" and getattr(self, field.name) is None and field.default is not None:
                object.__setattr__(self, field.name, field.default)
        for name in ("min_numel", "start_iter"):  # None: the method's own
            check(f"{self.prefix}{name}", getattr(self, name), NonNegativeInt | None)
        check(f"{self.prefix}delay", self.delay, PositiveInt | None)

    def changed(self, *names: str) -> dict[str, Any]:
        """The fields among ``names`` that differ from their defaults."""
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        return {name: getattr(self, name) for name in names if getattr(self, name) != defaults[name]}

    def field(self, name: str) -> str:
        """``name=value`` as the caller spells it."""
        return f"{self.prefix}{name}={getattr(self, name)!r}"


class _Option:
    """What every ``comm`` option shares: its fields are :class:`Comm`'s, by the same names."""

    def to_comm(self) -> Comm:
        """The general record: every field of the option, and its fixed ``outer`` (local-step options)."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}  # type: ignore[arg-type]
        if (outer := getattr(self, "outer", None)) is not None:
            fields["outer"] = outer
        return Comm(**fields)


@dataclasses.dataclass
class EveryStep(_Option):
    """``comm=every_step``: every step's gradients compressed and summed by the DDP hook (the default)."""

    #: Parameters with fewer elements are allreduced dense. None: the method's own (a compressor's
    #: ``default_min_numel``: 1, every parameter, where its reference sends every tensor; else 1024,
    #: biases and norm layers dense).
    min_numel: int | None = None
    #: Plain-allreduce iterations before compressing. None: the method's own (a compressor's
    #: ``default_start_iter``: 0 for DeMo, whose reference compresses from its first step; else 1,
    #: so DDP rebuilds its buckets after the first step before any is compressed).
    start_iter: int | None = None
    #: Encode and send each bucket as soon as DDP hands it over, overlapping communication with the
    #: rest of the backward pass, instead of holding every bucket until the step's last one.
    #: Bitwise the same results; costs a second fp32 residual per compressed parameter (DGC: a
    #: second momentum and accumulator). For error feedback over a compressor without state of its
    #: own whose payloads are gathered (top-k, SBC, EF-signSGD, chunked top-k, DeMo), and for DGC,
    #: QSGD, TernGrad, RedSync and unshared random-block, which hold their own state back too
    #: (:class:`~lgc.ddp.CompressionHookState`).
    overlap: bool = False
    #: Put each compressed step on the wire in two collectives, whatever the number of buckets: the
    #: step guard's flags, the payloads' sizes, the tensors sent dense and the module buffers in one
    #: allreduce, every bucket's payloads in one more (:mod:`lgc.ddp.packed`). ``null`` (default):
    #: wherever the method allows it (every lgc compressor with state; not with ``overlap``, which
    #: sends each bucket as it arrives); ``true``: required; ``false``: bucket by bucket.
    pack: bool | None = None
    #: Module buffers (BatchNorm's running statistics) every step: ``broadcast`` (rank 0's on every
    #: rank, as DDP keeps them) or ``average`` (the floating-point ones averaged over the workers:
    #: on shards that differ in distribution, rank 0's statistics describe rank 0's data only).
    #: Counted either way (:mod:`lgc.ddp.buffers`).
    buffers: str = "broadcast"


@dataclasses.dataclass
class LocalSGD(_Option):
    """``comm=local_sgd``: ``delay`` local optimizer steps, then the weight update, compressed, averaged and added.

    SBC's communication delay (Sattler et al. 2019) and SparseLoCo's outer step (lr 1, no momentum).
    """

    #: Local optimizer steps per exchange (required: ``comm.delay=4``).
    delay: int
    #: As :attr:`EveryStep.min_numel`.
    min_numel: int | None = None

    #: How the averaged update moves the synchronized weights.
    outer: ClassVar[str] = "average"


@dataclasses.dataclass
class DiLoCo(_Option):
    """``comm=diloco``: ``delay`` local steps, then an outer SGD step with Nesterov momentum (Douillard et al. 2023).

    The outer gradient is the pseudo-gradient ``mean(W_sync - W_local)`` over the workers, each
    worker's compressed by the method.
    """

    #: Local optimizer steps per exchange (H; the paper's 500; required).
    delay: int
    #: As :attr:`EveryStep.min_numel`.
    min_numel: int | None = None
    #: The outer step's learning rate and Nesterov momentum (None: DiLoCo's 0.7 and 0.9).
    outer_lr: float | None = None
    outer_momentum: float | None = None

    outer: ClassVar[str] = "sgd"


@dataclasses.dataclass
class StreamingDiLoCo(DiLoCo):
    """``comm=streaming_diloco``: DiLoCo with the parameters cut into fragments (Douillard et al. 2025).

    Each fragment is still exchanged every ``delay`` steps, the fragments on staggered steps; a
    tensor is cut only where balance needs it, between rows.
    """

    #: Fragments of about equal size (at most ``delay``).
    fragments: int = 2
    #: ``strided`` (the paper's: tensors dealt out largest first to the emptiest fragment, so equal
    #: layers go round-robin) or ``contiguous`` (consecutive ranges).
    fragment_split: str = FRAGMENT_SPLITS[0]
    #: The paper's overlap ``tau`` (torchft's ``fragment_sync_delay``): a fragment's exchange starts this
    #: many local steps before its turn and runs while they compute; below ``delay / fragments``. 0: it
    #: blocks at its turn.
    overlap_steps: int = 0
    #: The local weights' share ``alpha`` when a fragment's exchange is applied (torchft's
    #: ``fragment_update_alpha``): ``lerp(synchronized, local, alpha)``; 0 (torchft's default) takes the
    #: synchronized weights.
    mixing: float = 0.0


#: The ``comm`` config group's options by name.
COMM_OPTIONS: dict[str, type] = {
    "every_step": EveryStep,
    "local_sgd": LocalSGD,
    "diloco": DiLoCo,
    "streaming_diloco": StreamingDiLoCo,
}
