"""LGC's stage machine: warm-up, codec training, compressed; and the refresh that goes back.

Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning" (2021) train in
three stages, driven by the hook's step counter:

1. **Warm-up** (``stages.warmup_steps``): dense allreduce (``stages.warmup="dense"``) or top-k with
   error feedback at DGC's exponentially falling densities (``stages.warmup="dgc"``).
2. **Codec training** (``stages.ae_steps``): top-k communication while rank 0 trains the codec (the
   autoencoder) on the workers' values at the leader's positions. Codecs that learn nothing (the
   shared-index ablations) skip it: ``stages.ae_steps=0``.
3. **Compressed**: the frozen codec carries the values.

Beyond the paper, a **refresh**: when the compressed stage's reconstruction error stays above
``stages.refresh_threshold`` for ``stages.refresh_patience`` steps, every worker re-enters stage 2
for ``stages.refresh_steps`` steps. Every rank sees the same (allreduced or broadcast) error, so every rank
takes the same decision at the same step. The schedule is pure: no tensors, no collectives.
"""

from __future__ import annotations

import enum
from typing import Any

from lgc.ddp.protocol import RunTooShort
from lgc.learned.knobs import Stages

__all__ = ["LGCStage", "StageSchedule"]


class LGCStage(enum.IntEnum):
    """The three stages of LGC (logged as ``lgc/stage``)."""

    WARMUP = 1
    AUTOENCODER_TRAINING = 2
    COMPRESSED = 3


class StageSchedule:
    """Which stage every step is in, refreshes included; checkpointable.

    Args:
        stages: the knobs (:class:`~lgc.learned.knobs.Stages`, checked there).
        density: the compressed stage's top-k density (the floor of the warm-up densities).
        min_ae_steps: the smallest ``ae_steps`` the codec allows (1 for a codec that trains; 0 for
            one that learns nothing or was loaded from an earlier run).
    """

    def __init__(self, stages: Stages, *, density: float, min_ae_steps: int = 1) -> None:
        if stages.ae_steps < min_ae_steps:
            raise ValueError(
                f"stages.ae_steps must be at least {min_ae_steps} for a codec that trains, got {stages.ae_steps!r}"
            )
        if stages.refresh_threshold is not None and stages.ae_steps == 0:
            raise ValueError("stages.refresh_threshold needs a codec that trains: this one has stages.ae_steps=0")
        self.warmup_steps = stages.warmup_steps
        self.ae_steps = stages.ae_steps
        self.refresh_patience = stages.refresh_patience
        self.warmup = stages.warmup
        self.warmup_densities = tuple(float(d) for d in stages.warmup_densities)
        self.density = float(density)
        self.refresh_threshold = None if stages.refresh_threshold is None else float(stages.refresh_threshold)
        self.refresh_steps = stages.ae_steps if stages.refresh_steps is None else stages.refresh_steps
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
                f"LGC stages leave no compressed stage: stages.warmup_steps={self.warmup_steps} + "
                f"stages.ae_steps={self.ae_steps}",
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
