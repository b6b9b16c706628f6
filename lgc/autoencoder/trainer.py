"""Trains LGC's autoencoder on the aligned gradient chunks collected during stage 2.

The trainer owns the autoencoder, its optimizer, a replay buffer of the most recent samples (a
sample is one chunk position of all workers: ``[workers, chunk]``, plus the innovations for
LGC-PS) and the generator that draws minibatches, so a resumed run draws the same ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lgc.autoencoder.losses import DEFAULT_WEIGHTS, AutoencoderLosses, LossWeights, ps_losses, rar_losses
from lgc.autoencoder.model import GradientAutoencoder

__all__ = ["AutoencoderTrainer"]

_OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


class AutoencoderTrainer:
    """Replay buffer + optimizer for :class:`GradientAutoencoder`.

    Args:
        autoencoder: the model to train (decoders with an innovation channel train LGC-PS's loss,
            otherwise LGC-RAR's).
        optimizer: ``"adam"`` (default: converges in the few hundred updates stage 2 allows) or
            ``"sgd"`` (the reference code's, lr 1e-3, which needs far more updates).
        lr: learning rate.
        batch_size: samples (chunk positions of all workers) per update.
        buffer_size: samples kept; older ones are dropped first. Recent gradients resemble the
            ones the frozen autoencoder will see next, so a short memory is a feature.
        weights: loss weights (:class:`LossWeights`).
        seed: seed of the minibatch draws (and of the stand-in leader of LGC-PS samples).
    """

    def __init__(
        self,
        autoencoder: GradientAutoencoder,
        *,
        optimizer: str = "adam",
        lr: float = 1e-3,
        batch_size: int = 64,
        buffer_size: int = 4096,
        weights: LossWeights = DEFAULT_WEIGHTS,
        seed: int = 0,
    ) -> None:
        if optimizer not in _OPTIMIZERS:
            raise ValueError(f"autoencoder optimizer must be one of {sorted(_OPTIMIZERS)}, got {optimizer!r}")
        if not lr > 0:
            raise ValueError(f"autoencoder lr must be > 0, got {lr!r}")
        if batch_size < 1 or buffer_size < 1:
            raise ValueError(f"batch_size and buffer_size must be >= 1, got {batch_size!r} and {buffer_size!r}")
        self.autoencoder = autoencoder
        self.optimizer_name = optimizer
        self.lr = float(lr)
        self.optimizer = _OPTIMIZERS[optimizer](autoencoder.parameters(), lr=self.lr)
        self.batch_size = int(batch_size)
        self.buffer_size = int(buffer_size)
        self.weights = LossWeights(*weights)
        self.generator = torch.Generator().manual_seed(seed)
        #: ``[M, workers, chunk]`` normalized aligned chunks (None until the first add).
        self.chunks: Tensor | None = None
        #: ``[M, workers, chunk]`` innovations (LGC-PS only).
        self.innovations: Tensor | None = None
        #: Updates made so far.
        self.updates = 0

    @property
    def num_samples(self) -> int:
        return 0 if self.chunks is None else self.chunks.shape[0]

    def add(self, chunks: Tensor, innovations: Tensor | None = None) -> None:
        """Append samples ``[B, workers, chunk]`` (and their innovations), dropping the oldest beyond capacity."""
        if self.autoencoder.config.innovation != (innovations is not None):
            raise ValueError("innovations must be given exactly when the decoders take an innovation channel")
        self.chunks = _append(self.chunks, chunks, self.buffer_size)
        if innovations is not None:
            self.innovations = _append(self.innovations, innovations, self.buffer_size)

    def losses(self, chunks: Tensor, innovations: Tensor | None = None) -> AutoencoderLosses:
        """The losses on ``chunks`` (with gradients; the stand-in leaders are drawn from the generator)."""
        if self.autoencoder.config.innovation:
            assert innovations is not None
            leaders = torch.randint(chunks.shape[1], (chunks.shape[0],), generator=self.generator)
            return ps_losses(self.autoencoder, chunks, innovations, leaders.to(chunks.device), self.weights)
        return rar_losses(self.autoencoder, chunks, self.weights)

    @torch.no_grad()
    def evaluate(self, chunks: Tensor, innovations: Tensor | None = None) -> dict[str, float]:
        """Losses on samples not trained on yet (a held-out estimate), as floats."""
        return _as_floats(self.losses(chunks.float(), None if innovations is None else innovations.float()))

    @torch.enable_grad()  # LGC trains inside a DDP communication hook, i.e. inside a backward pass
    def train(self, updates: int) -> dict[str, float]:
        """``updates`` optimizer steps on minibatches from the buffer; mean losses over them."""
        if self.chunks is None or updates < 1:
            return {}
        sums: dict[str, float] = {}
        for _ in range(updates):
            rows = torch.randint(self.num_samples, (min(self.batch_size, self.num_samples),), generator=self.generator)
            rows = rows.to(self.chunks.device)
            innovations = None if self.innovations is None else self.innovations[rows]
            losses = self.losses(self.chunks[rows], innovations)
            self.optimizer.zero_grad(set_to_none=True)
            losses.total.backward()
            self.optimizer.step()
            self.updates += 1
            for name, value in _as_floats(losses).items():
                sums[name] = sums.get(name, 0.0) + value
        return {name: total / updates for name, total in sums.items()}

    def to(self, device: torch.device) -> AutoencoderTrainer:
        """Move the autoencoder, the optimizer state and the buffer to ``device``."""
        self.autoencoder.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = value.to(device)
        if self.chunks is not None:
            self.chunks = self.chunks.to(device)
        if self.innovations is not None:
            self.innovations = self.innovations.to(device)
        return self

    def clear_buffer(self) -> None:
        self.chunks = self.innovations = None

    # A torch.Generator does not pickle: spawned workers get its state and rebuild it. As bytes: the
    # state tensor's storage cannot be rebuilt from torch.multiprocessing's shared memory.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "generator": self.generator.get_state().numpy().tobytes()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        generator = torch.Generator()
        generator.set_state(torch.frombuffer(bytearray(state["generator"]), dtype=torch.uint8))
        self.__dict__.update({**state, "generator": generator})

    def state_dict(self) -> dict[str, Any]:
        def cpu(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().cpu().clone()

        return {
            "autoencoder": {k: v.detach().cpu().clone() for k, v in self.autoencoder.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "chunks": cpu(self.chunks),
            "innovations": cpu(self.innovations),
            "generator": self.generator.get_state(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = next(self.autoencoder.parameters()).device
        self.autoencoder.load_state_dict(state["autoencoder"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.chunks = None if state["chunks"] is None else state["chunks"].to(device)
        self.innovations = None if state["innovations"] is None else state["innovations"].to(device)
        self.generator.set_state(state["generator"])
        self.updates = int(state["updates"])


def _append(buffer: Tensor | None, samples: Tensor, capacity: int) -> Tensor:
    """``buffer`` followed by ``samples``, keeping the newest ``capacity`` rows."""
    samples = samples.detach().float()
    return (samples if buffer is None else torch.cat([buffer, samples]))[-capacity:]


def _as_floats(losses: AutoencoderLosses) -> dict[str, float]:
    return {name: float(value.detach()) for name, value in losses._asdict().items()}
