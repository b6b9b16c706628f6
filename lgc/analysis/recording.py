"""A recording of every worker's gradients, as :class:`lgc.analysis.GradientRecorder` writes it (pure torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["RECORDING_FORMAT", "GradientRecording", "load_recording", "rank_file"]

#: Version of the per-rank file layout written by :class:`lgc.analysis.GradientRecorder`.
RECORDING_FORMAT = 1


def rank_file(folder: str | Path, rank: int) -> Path:
    """The file one rank's recording goes to."""
    return Path(folder) / f"rank{rank}.pt"


@dataclass
class GradientRecording:
    """Every worker's recorded gradients, read back by :func:`load_recording`.

    Attributes:
        steps: the recorded optimizer steps, ``[T]``.
        gradients: per parameter name, ``[W, T, *shape]`` (worker, step, parameter shape).
        world_size: number of workers ``W``.
        metadata: what the recorder was given (e.g. the data partition).
    """

    steps: Tensor
    gradients: dict[str, Tensor]
    world_size: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """The recorded parameter names, in model order."""
        return list(self.gradients)

    def flat(self, name: str) -> Tensor:
        """``[W, T, numel]`` float32 gradients of one parameter."""
        grads = self.gradients[name]
        return grads.reshape(grads.shape[0], grads.shape[1], -1).float()


def load_recording(folder: str | Path) -> GradientRecording:
    """Read the ``rank{r}.pt`` files of one run (see :class:`GradientRecorder`) into one recording."""
    path = Path(folder)
    files = sorted(path.glob("rank*.pt"), key=lambda p: int(p.stem.removeprefix("rank")))
    if not files:
        raise FileNotFoundError(f"no rank*.pt gradient recording in {str(path)!r}")
    records = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    world_size = records[0]["world_size"]
    if [r["rank"] for r in records] != list(range(world_size)) or any(r["format"] != RECORDING_FORMAT for r in records):
        raise ValueError(
            f"{str(path)!r} holds the files of ranks {[r['rank'] for r in records]}, expected 0-{world_size - 1}"
        )
    for record in records[1:]:
        if not torch.equal(record["steps"], records[0]["steps"]):
            raise ValueError(f"the ranks in {str(path)!r} recorded different steps")
    gradients = {name: torch.stack([r["gradients"][name] for r in records]) for name in records[0]["gradients"]}
    return GradientRecording(records[0]["steps"], gradients, world_size, dict(records[0]["metadata"]))
