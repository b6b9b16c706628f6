"""A learned *linear* chunk codec: the top principal directions of the collected chunks.

The middle ground between LGC's autoencoder and no learning at all (LGC's ablation): the
GradiVeQ idea (Yu et al., "GradiVeQ: Vector Quantization for Bandwidth-Efficient Gradient
Aggregation in Distributed CNN Training", NeurIPS 2018), that gradient chunks of a network live
near a low-dimensional linear subspace, so a linear encoder ``z = x U`` (``U``: ``chunk x r``,
orthonormal columns) keeps most of them. Linearity makes it exact for ring-allreduce: the sum of
the workers' codes decodes to the projection of the sum of their chunks, ``D(sum z_i) = sum D(z_i)``,
which LGC's non-linear decoder only approximates (its ``mean`` loss term).

``U`` is fitted on the same samples the autoencoder trains on (stage 2: every worker's scaled
chunks at the leader's positions): the top ``r`` right singular vectors of the samples stacked as
rows, no centring (so zero encodes to zero and codes add). The fit is a closed form, recomputed at
every training call from the replay buffer; ``updates`` only says whether to fit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lgc.autoencoder.losses import relative_error

__all__ = ["LinearChunkCodec", "LinearCodecTrainer"]


class LinearChunkCodec(nn.Module):
    """``z = x U`` and ``x_hat = z U^T`` over chunks of ``chunk`` values, ``U`` of ``latent_size`` columns.

    Before any fit ``U`` keeps each chunk's first ``latent_size`` values (the identity's columns).

    Example::

        >>> codec = LinearChunkCodec(chunk=8, latent_size=2)
        >>> codec.encode(torch.ones(3, 8)).shape
        torch.Size([3, 2])
    """

    def __init__(self, chunk: int, latent_size: int) -> None:
        super().__init__()
        if not 1 <= latent_size <= chunk:
            raise ValueError(f"latent_size must be in [1, chunk={chunk}], got {latent_size!r}")
        self.chunk = chunk
        self.latent_size = latent_size
        self.basis = nn.Parameter(torch.eye(chunk)[:, :latent_size].contiguous(), requires_grad=False)

    def encode(self, chunks: Tensor) -> Tensor:
        """``[B, chunk]`` -> ``[B, latent_size]``."""
        return chunks @ self.basis

    def decode(self, latent: Tensor, innovation: Tensor | None = None, decoder: int = 0) -> Tensor:
        """``[B, latent_size]`` -> ``[B, chunk]`` (no innovation channel: the ring-allreduce codec only)."""
        if innovation is not None:
            raise ValueError("the linear codec takes no innovation channel (LGC-RAR only)")
        return latent @ self.basis.T

    def latent_shape(self, rows: int) -> tuple[int, ...]:
        return rows, self.latent_size

    def fit(self, samples: Tensor) -> None:
        """Set ``U`` to the top right singular vectors of ``samples`` (``[M, chunk]``)."""
        samples = samples.reshape(-1, self.chunk).float()
        # Right singular vectors = eigenvectors of the chunk x chunk Gram matrix (small, and cheap for any M).
        gram = samples.T @ samples
        _, vectors = torch.linalg.eigh(gram.double())
        top = vectors[:, -self.latent_size :].flip(1).to(self.basis.dtype)
        # eigh's sign is arbitrary: make each column's largest entry positive, so every rank agrees.
        signs = torch.sign(top.gather(0, top.abs().argmax(0, keepdim=True)))
        self.basis.copy_(top * torch.where(signs == 0, torch.ones_like(signs), signs))

    def __repr__(self) -> str:
        return (
            f"LinearChunkCodec(chunk={self.chunk}, latent={self.latent_size}, ratio={self.chunk / self.latent_size:g})"
        )


class LinearCodecTrainer:
    """The :class:`~lgc.autoencoder.AutoencoderTrainer` interface for :class:`LinearChunkCodec`.

    Keeps the newest ``buffer_size`` samples (``[workers, chunk]`` each) and fits the basis to all
    of them at every :meth:`train` call.
    """

    def __init__(self, codec: LinearChunkCodec, *, buffer_size: int = 4096, **_: Any) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size!r}")
        self.autoencoder = codec
        self.buffer_size = int(buffer_size)
        self.chunks: Tensor | None = None
        self.updates = 0

    @property
    def num_samples(self) -> int:
        return 0 if self.chunks is None else self.chunks.shape[0]

    def add(self, chunks: Tensor, innovations: Tensor | None = None) -> None:
        if innovations is not None:
            raise ValueError("the linear codec takes no innovations (LGC-RAR only)")
        samples = chunks.detach().float()
        self.chunks = (samples if self.chunks is None else torch.cat([self.chunks, samples]))[-self.buffer_size :]

    @torch.no_grad()
    def evaluate(self, chunks: Tensor, innovations: Tensor | None = None) -> dict[str, float]:
        """Relative error of the decoded mean against the workers' mean (what ring-allreduce delivers)."""
        mean = chunks.float().mean(dim=1)
        decoded = self.autoencoder.decode(self.autoencoder.encode(mean))
        error = float(relative_error(decoded, mean))
        return {"total": error, "relative_error": error}

    @torch.no_grad()
    def train(self, updates: int) -> dict[str, float]:
        if self.chunks is None or updates < 1:
            return {}
        self.autoencoder.fit(self.chunks)
        self.updates += 1
        return self.evaluate(self.chunks)

    def to(self, device: torch.device) -> LinearCodecTrainer:
        self.autoencoder.to(device)
        if self.chunks is not None:
            self.chunks = self.chunks.to(device)
        return self

    def clear_buffer(self) -> None:
        self.chunks = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "autoencoder": {k: v.detach().cpu().clone() for k, v in self.autoencoder.state_dict().items()},
            "chunks": None if self.chunks is None else self.chunks.cpu().clone(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.autoencoder.basis.device
        self.autoencoder.load_state_dict(state["autoencoder"])
        self.chunks = None if state["chunks"] is None else state["chunks"].to(device)
        self.updates = int(state["updates"])
