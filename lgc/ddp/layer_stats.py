"""What each parameter cost on the wire: the per-layer table of the hook state's statistics.

The exchange (:mod:`lgc.ddp.exchange`) and LGC's coded step book every parameter's payload here,
once per step; ``summary.json`` and the Weights & Biases table (``lgc.lit.callbacks``) show the
rows of :meth:`LayerLedger.table`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["LayerLedger", "LayerStats"]


@dataclass
class LayerStats:
    """What one parameter cost on the wire (one worker)."""

    numel: int
    #: Whether the compressor handled it (the last step's answer; LGC's warm-up sends everything dense).
    compressed: bool
    #: Steps it was sent in.
    steps: int = 0
    #: Bytes of it this worker sent (a share of a joint code is booked pro rata, see LGC).
    bytes_sent: int = 0


class LayerLedger(dict[str, LayerStats]):
    """Parameter name -> :class:`LayerStats`, in the order the parameters were first sent."""

    def book(self, name: str, numel: int, compressed: bool, nbytes: int) -> None:
        """Count ``nbytes`` of payload (logical bytes) for one parameter in one step."""
        layer = self.get(name)
        if layer is None:
            layer = self[name] = LayerStats(numel, compressed)
        layer.steps += 1
        layer.compressed = compressed
        layer.bytes_sent += nbytes

    def table(self, residuals: Mapping[str, Tensor]) -> list[dict[str, Any]]:
        """One row per parameter: size, steps, bytes sent, compression ratio against fp32, residual norm."""
        rows = []
        for name, layer in self.items():
            dense = 4 * layer.numel * layer.steps
            residual = residuals.get(name)
            rows.append(
                {
                    "layer": name,
                    "numel": layer.numel,
                    "compressed": layer.compressed,
                    "steps": layer.steps,
                    "bytes_sent": layer.bytes_sent,
                    "compression_ratio": dense / layer.bytes_sent if layer.bytes_sent else None,
                    "residual_norm": None if residual is None else float(torch.linalg.vector_norm(residual)),
                }
            )
        return rows

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {name: asdict(layer) for name, layer in self.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the rows in place (LGC's coded step keeps a reference to :meth:`book`)."""
        self.clear()
        self.update({name: LayerStats(**layer) for name, layer in state.items()})
