"""LGC's stage machine: warm-up, codec training, compressed; and the refresh that goes back.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021) train in
three stages, driven by the hook's step counter:

1. **Warm-up** (``warmup_steps``): dense allreduce (``warmup="dense"``) or top-k with error
   feedback at DGC's exponentially falling densities (``warmup="dgc"``).
2. **Codec training** (``ae_steps``): top-k communication while rank 0 trains the codec (the
   autoencoder) on the workers' values at the leader's positions. Codecs that learn nothing (the
   shared-index ablations) skip it: ``ae_steps=0``.
3. **Compressed**: the frozen codec carries the values.

Beyond the paper, a **refresh**: when the compressed stage's reconstruction error stays above
``refresh_threshold`` for ``refresh_patience`` steps, every worker re-enters stage 2 for
``refresh_steps`` steps. Every rank sees the same (allreduced or broadcast) error, so every rank
takes the same decision at the same step. The schedule is pure: no tensors, no collectives.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from lgc.compressors.dgc import PAPER_WARMUP_DENSITIES
from lgc.ddp.protocol import RunTooShort
from lgc.validation import NonNegativeInt, PositiveFloat, PositiveInt, check

__all__ = ["WARMUPS", "LGCStage", "StageSchedule"]

WARMUPS = ("dense", "dgc")


class LGCStage(enum.IntEnum):
    """The three stages of LGC (logged as ``lgc/stage``)."""

    WARMUP = 1
    AUTOENCODER_TRAINING = 2
    COMPRESSED = 3


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class StageSchedule:
    """Which stage every step is in, refreshes included; checkpointable.

    Args:
        warmup_steps: stage 1 length in optimizer steps (at least 1: DDP rebuilds its buckets
            during the first step, which is always dense).
        ae_steps: stage 2 length; 0 only for codecs that learn nothing (``min_ae_steps``).
        warmup: ``"dense"`` or ``"dgc"``.
        warmup_densities: the ``"dgc"`` warm-up's densities, spread evenly over its steps (DGC's
            25 %, 6.25 %, 1.5625 %, 0.39 % by default); never below ``density``.
        density: the compressed stage's top-k density (the floor of the warm-up densities).
        refresh_threshold: relative reconstruction error above which a compressed step is a
            strike; ``None`` never refreshes (the paper).
        refresh_patience: consecutive strikes that start a refresh.
        refresh_steps: a refresh's stage 2 length (default ``ae_steps``).
        min_ae_steps: the smallest ``ae_steps`` the codec allows (1 for a codec that trains).
    """

    def __init__(
        self,
        *,
        warmup_steps: PositiveInt,
        ae_steps: NonNegativeInt,
        warmup: str = "dense",
        warmup_densities: Sequence[float] | None = None,
        density: float = 0.001,
        refresh_threshold: PositiveFloat | None = None,
        refresh_patience: PositiveInt = 5,
        refresh_steps: PositiveInt | None = None,
        min_ae_steps: int = 1,
    ) -> None:
        self.warmup_steps = check("warmup_steps", warmup_steps, PositiveInt)
        # The floor depends on the codec (min_ae_steps), so it is spelled out here.
        self.ae_steps = _check_int("ae_steps", ae_steps, min_ae_steps)
        self.refresh_patience = check("refresh_patience", refresh_patience, PositiveInt)
        if warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {warmup!r}")
        densities = tuple(float(d) for d in (PAPER_WARMUP_DENSITIES if warmup_densities is None else warmup_densities))
        if any(not 0.0 < d <= 1.0 for d in densities):
            raise ValueError(f"warmup_densities must lie in (0, 1], got {list(densities)}")
        check("refresh_threshold", refresh_threshold, PositiveFloat | None)
        check("refresh_steps", refresh_steps, PositiveInt | None)
        if refresh_threshold is not None and ae_steps == 0:
            raise ValueError("refresh_threshold needs a codec that trains: this one has ae_steps=0")
        self.warmup = warmup
        self.warmup_densities = densities
        self.density = float(density)
        self.refresh_threshold = None if refresh_threshold is None else float(refresh_threshold)
        self.refresh_steps = ae_steps if refresh_steps is None else refresh_steps
        #: A running refresh's stage 2 lasts until this step (None: no refresh running).
        self.refresh_until: int | None = None
        #: Consecutive compressed steps with too large an error.
        self.refresh_strikes = 0
        #: How many refreshes happened.
        self.refreshes = 0
        #: The current compressed step's error: [sum of relative error * weight, sum of weights].
        self.step_error = [0.0, 0.0]

    def stage_at(self, step: int) -> LGCStage:
        """The scheduled stage of ``step`` (refreshes aside)."""
        if step < self.warmup_steps:
            return LGCStage.WARMUP
        if step < self.warmup_steps + self.ae_steps:
            return LGCStage.AUTOENCODER_TRAINING
        return LGCStage.COMPRESSED

    def next_stage(self, step: int, previous: LGCStage, error: float | None) -> LGCStage:
        """The stage of ``step``, given the previous step's stage and its relative error (or None)."""
        stage = self.stage_at(step)
        if stage is not LGCStage.COMPRESSED:
            return stage
        if self.refresh_until is not None:
            if step < self.refresh_until:
                return LGCStage.AUTOENCODER_TRAINING
            self.refresh_until = None
        if previous is LGCStage.COMPRESSED and self.refresh_threshold is not None and error is not None:
            self.refresh_strikes = self.refresh_strikes + 1 if error > self.refresh_threshold else 0
            if self.refresh_strikes >= self.refresh_patience:
                self.refresh_strikes = 0
                self.refreshes += 1
                self.refresh_until = step + self.refresh_steps
                return LGCStage.AUTOENCODER_TRAINING
        return LGCStage.COMPRESSED

    def record_error(self, relative: float, weight: int) -> None:
        """Add a relative reconstruction error of the current step, weighted by its ``weight`` values."""
        self.step_error[0] += relative * weight
        self.step_error[1] += weight

    def begin(self, step: int, previous: LGCStage) -> LGCStage:
        """The stage of ``step``, judged by the previous step's recorded error, which is then cleared."""
        weight = self.step_error[1]
        stage = self.next_stage(step, previous, self.step_error[0] / weight if weight > 0 else None)
        self.step_error = [0.0, 0.0]
        return stage

    def warmup_density(self, step: int) -> float:
        """The ``"dgc"`` warm-up's density at ``step``."""
        phases = len(self.warmup_densities)
        if not phases:
            return self.density
        phase = min(phases - 1, step * phases // self.warmup_steps)
        return max(self.warmup_densities[phase], self.density)

    def check_total_steps(self, total_steps: int) -> None:
        """Refuse stage lengths that leave no compressed stage in a run of ``total_steps`` steps."""
        if self.warmup_steps + self.ae_steps >= total_steps:
            raise RunTooShort(
                f"LGC stages leave no compressed stage: warmup_steps={self.warmup_steps} + ae_steps={self.ae_steps}",
                total_steps,
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "refresh_until": self.refresh_until,
            "refresh_strikes": self.refresh_strikes,
            "refreshes": self.refreshes,
            "step_error": list(self.step_error),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.refresh_until = state["refresh_until"]
        self.refresh_strikes = int(state["refresh_strikes"])
        self.refreshes = int(state["refreshes"])
        self.step_error = list(state["step_error"])
