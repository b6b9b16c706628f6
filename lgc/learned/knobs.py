"""LGC's knobs, grouped by the part they configure: the stages, the leaders, the codec's training.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021). Each group
is a frozen dataclass whose defaults are the ones ``lgc/conf/compressor/lgc_rar.yaml`` gives (a
test ties every yaml to them), and each knob is declared once, here:

* :class:`Stages`: the warm-up, the codec-training stage and the refresh
  (:class:`~lgc.learned.schedule.StageSchedule` runs them);
* :class:`LeaderChoice`: whose top-k positions every worker uses, and how they and the values
  there go on the wire (:class:`~lgc.learned.step.Leaders`,
  :class:`~lgc.learned.leader_code.LeaderIndexCodec`);
* :class:`CodecTrainingKnobs`: the codec and how stage 2 trains it
  (:class:`~lgc.learned.training.CodecTraining`).

The public classes (:class:`~lgc.learned.rar.LGCRingAllreduceState`,
:class:`~lgc.learned.ps.LGCParameterServerState`, :class:`~lgc.learned.shared_index.SharedIndexState`)
are presets: each takes one group per part, defaulting to its preset (LGC-PS's leader is the
server, not a rotating one; the shared-index codecs have no training stage and order values by
position); each class holds its presets (``STAGES``, ``LEADERS``, ``TRAINING``). A group is given
as a mapping of some of its fields (a yaml node, ``compressor.stages.warmup_steps=100``), which
changes those fields of the class's preset and keeps the rest (a mapping inside a group,
``training.autoencoder`` or ``training.loss_weights``, likewise), or as its dataclass, which is
taken whole: start from the preset to change a few fields
(``LGCParameterServerState.LEADERS.changed({"index_coding": "golomb"})``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from lgc.compressors.dgc import PAPER_WARMUP_DENSITIES
from lgc.validation import Density, NonNegativeInt, PositiveFloat, PositiveInt, check

__all__ = ["LGC_AUTOENCODER", "LGC_LOSS_WEIGHTS", "CodecTrainingKnobs", "LeaderChoice", "Stages", "knob_group"]

#: The autoencoder LGC trains by default (:class:`~lgc.autoencoder.AutoencoderConfig` fields, and
#: ``init``: a ``codec.pt`` to start from). About 217,000 parameters at width 1.
LGC_AUTOENCODER: Mapping[str, Any] = {
    "chunk": 64,
    "encoder_channels": (64, 128, 256, 64),
    "latent_channels": 4,
    "decoder_channels": (32, 64, 128, 32),
    "width": 1.0,
    "decoder": "transposed",
    "seed": 0,
    "init": None,
}
#: The codec's loss terms (:class:`~lgc.autoencoder.LossWeights`): the paper's reconstruction and
#: similarity, and decoding the mean latent to the mean values (LGC-RAR's use; LGC-PS ignores it).
LGC_LOSS_WEIGHTS: Mapping[str, float] = {"reconstruction": 0.5, "similarity": 0.5, "mean": 1.0}

_Group = TypeVar("_Group", bound="_KnobGroup")


class _KnobGroup:
    """Checks every field against its annotation (named ``{node}.{field}``) and merges mappings."""

    #: The group's name in a config node (``compressor.{node}.{field}``) and in messages.
    node: ClassVar[str]
    #: Fields that are mappings: a mapping given for one changes the keys it names.
    _merged: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self), include_extras=True)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = _python(getattr(self, f.name))
            if f.name in self._merged:
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else {}  # type: ignore[misc]
                if value is None:
                    value = {}
                elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # an AutoencoderConfig
                    value = _python(dataclasses.asdict(value))
                if not isinstance(value, Mapping):
                    raise TypeError(f"{self.node}.{f.name} must be a mapping, got {value!r}")
                value = {**default, **value}
            elif isinstance(value, list) and typing.get_origin(_unannotated(hints[f.name])) is tuple:
                value = tuple(value)
            object.__setattr__(self, f.name, check(f"{self.node}.{f.name}", value, hints[f.name]))

    def changed(self: _Group, knobs: Mapping[str, Any]) -> _Group:
        """This group with the fields ``knobs`` names changed (a mapping field's keys merged)."""
        names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise TypeError(f"{self.node} has no knob {', '.join(map(repr, unknown))}; its knobs: {', '.join(names)}")
        merged = {
            name: {**getattr(self, name), **value} if name in self._merged and isinstance(value, Mapping) else value
            for name, value in knobs.items()
        }
        return dataclasses.replace(self, **merged)  # type: ignore[type-var]


def _python(value: Any) -> Any:
    """A config value as plain Python (a yaml's mappings and lists, OmegaConf's included, as dicts and lists)."""
    if isinstance(value, Mapping):
        return {key: _python(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | tuple):
        return [_python(item) for item in value]
    return value


def _unannotated(hint: Any) -> Any:
    return typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint


@dataclass(frozen=True)
class Stages(_KnobGroup):
    """LGC's stages (:mod:`lgc.learned.schedule`).

    Args:
        warmup_steps: stage 1 length in optimizer steps (at least 1: DDP rebuilds its buckets
            during the first step, which is always dense). The paper: 5 epochs.
        warmup: ``"dense"`` (allreduce) or ``"dgc"`` (top-k with error feedback at
            ``warmup_densities``, spread evenly over the warm-up, never below the compressed
            stage's density).
        warmup_densities: the ``"dgc"`` warm-up's densities (DGC's 25 %, 6.25 %, 1.5625 %, 0.39 %).
        ae_steps: stage 2 length, the codec's training; 0 only for a codec that learns nothing or
            is loaded from an earlier run (``training.autoencoder.init``). The paper: 300.
        refresh_threshold: relative reconstruction error above which a compressed step is a
            strike; ``None`` never refreshes (the paper).
        refresh_patience: consecutive strikes that start a refresh.
        refresh_steps: a refresh's stage 2 length (``None``: ``ae_steps``).
    """

    node: ClassVar[str] = "stages"

    warmup_steps: PositiveInt = 30
    warmup: Literal["dense", "dgc"] = "dense"
    warmup_densities: tuple[Density, ...] = PAPER_WARMUP_DENSITIES
    ae_steps: NonNegativeInt = 60
    refresh_threshold: PositiveFloat | None = None
    refresh_patience: PositiveInt = 5
    refresh_steps: PositiveInt | None = None


@dataclass(frozen=True)
class LeaderChoice(_KnobGroup):
    """Whose top-k positions every worker uses, and their wire layout.

    Args:
        rotate: the leader of step ``t`` is worker ``t % world_size`` (ScaleCom's cyclic leader:
            spreads the leader's extra upload, and every worker's big coordinates get their
            turn); ``False`` keeps ``rank``. A ``rank`` other than 0 with it is refused.
        rank: the fixed leader (LGC-PS's server).
        index_coding: ``"raw"`` (int32) or ``"golomb"`` (SBC's codec; needs
            ``value_order="position"`` where values follow the positions' order) positions.
        value_order: the order of the values at the leader's positions: by the leader's signed
            ``"value"``, its ``"magnitude"``, or ``"position"`` (no permutation).
    """

    node: ClassVar[str] = "leaders"

    rotate: bool = True
    rank: NonNegativeInt = 0
    index_coding: Literal["raw", "golomb"] = "raw"
    value_order: Literal["value", "magnitude", "position"] = "value"


@dataclass(frozen=True)
class CodecTrainingKnobs(_KnobGroup):
    """The codec and its training in stage 2 (:mod:`lgc.learned.training`).

    Args:
        codec: ``"autoencoder"`` (the paper's), ``"linear"`` (the top principal directions of
            the same samples) or ``"pca_autoencoder"`` (those directions plus a nonlinear
            correction that starts at zero). LGC-PS trains the autoencoder only.
        samples: what stage 2 communicates and learns from: ``"topk"`` (the paper: top-k with
            error feedback) or ``"leader"`` (LGC-RAR: the compressed stage's exchange with the
            exact sum in place of the codec, so the codec learns from the error feedback it will
            serve).
        linear_latent: the linear and PCA-initialised codecs' floats per chunk (``None``: the
            autoencoder's latent size, so all send the same bytes).
        pca_hidden: the PCA-initialised codec's correction width (0: none, the linear codec).
        autoencoder: :class:`~lgc.autoencoder.AutoencoderConfig` fields (the values arrive in
            chunks of ``chunk``, each divided by the leader's chunk RMS; latent floats per chunk
            ``latent_channels * chunk / 2**len(encoder_channels)``; ``width`` multiplies every
            encoder and decoder width) and ``init``: a ``codec.pt`` saved by an earlier run to start
            from (with ``stages.ae_steps=0`` stage 2 is skipped).
        updates_per_step: codec optimizer steps per training step in stage 2.
        optimizer, lr, batch_size, buffer_size: the codec's trainer (the linear codec keeps the
            buffer only).
        loss_weights: :class:`~lgc.autoencoder.LossWeights` fields.
    """

    node: ClassVar[str] = "training"
    _merged: ClassVar[tuple[str, ...]] = ("autoencoder", "loss_weights")

    codec: Literal["autoencoder", "linear", "pca_autoencoder"] = "autoencoder"
    samples: Literal["topk", "leader"] = "topk"
    linear_latent: PositiveInt | None = None
    pca_hidden: NonNegativeInt = 64
    autoencoder: Mapping[str, Any] = field(default_factory=lambda: dict(LGC_AUTOENCODER))
    updates_per_step: NonNegativeInt = 4
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: PositiveFloat = 1e-3
    batch_size: PositiveInt = 64
    buffer_size: PositiveInt = 4096
    loss_weights: Mapping[str, float] = field(default_factory=lambda: dict(LGC_LOSS_WEIGHTS))


def knob_group(given: _Group | Mapping[str, Any] | None, preset: _Group) -> _Group:
    """The group a public class runs with: ``given`` itself, or ``preset`` changed by a mapping's fields.

    Raises:
        TypeError: ``given`` is neither the group nor a mapping, or names a field the group lacks.
        ValueError: a field's value does not fit (named ``{node}.{field}``).
    """
    if given is None:
        return preset
    if isinstance(given, type(preset)):
        return given
    if isinstance(given, Mapping):
        return preset.changed(given)
    raise TypeError(f"{preset.node} must be a {type(preset).__name__} or a mapping of its fields, got {given!r}")
