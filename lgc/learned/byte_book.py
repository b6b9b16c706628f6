"""The bytes of every LGC stage, booked apart: warm-up, codec training, the codec's weights, compressed.

A run's summary tells how much each stage cost (``lgc.stages`` in ``summary.json``, the report's
per-stage table): the compressed stage's ratio is LGC's claim, and the dense warm-up and the
codec-training stage are what it costs to get there. The hook's :class:`~lgc.ddp.collectives.CommStats`
counts everything; the book takes the difference since its last mark and adds it to a named stage.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from lgc.ddp.collectives import CommStats

__all__ = ["StageByteBook"]


class StageByteBook:
    """Communication counters per stage name, filled from a running :class:`CommStats` by differences."""

    __slots__ = ("mark", "stages")

    def __init__(self) -> None:
        #: Stage name -> what was communicated while in it.
        self.stages: dict[str, CommStats] = {}
        #: The running counters when the last booking was made.
        self.mark = CommStats()

    def book(self, name: str, now: CommStats) -> None:
        """Add ``now`` minus the mark to stage ``name``, and mark ``now``."""
        booked = self.stages.setdefault(name, CommStats())
        for key in (f.name for f in fields(CommStats)):
            setattr(booked, key, getattr(booked, key) + getattr(now, key) - getattr(self.mark, key))
        self.mark = CommStats(**asdict(now))

    def summary(self) -> dict[str, dict[str, Any]]:
        """Stage name -> its counters, as plain values."""
        return {name: asdict(stats) for name, stats in self.stages.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"stage_stats": self.summary(), "stats_mark": asdict(self.mark)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stages = {name: CommStats(**stats) for name, stats in state["stage_stats"].items()}
        self.mark = CommStats(**state["stats_mark"])
