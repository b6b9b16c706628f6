"""A PCA-initialised nonlinear autoencoder: the linear codec plus a learned correction that starts at zero.

LGC's autoencoder (:mod:`lgc.autoencoder.model`) learns a nonlinear code from scratch on the few
hundred samples stage 2 collects, and measured on gradients it has not beaten PCA of the same
latent size (``lgc-bench codecs``; ``lgc/pca_recon_error`` beside ``lgc/recon_error`` in a run).
A linear autoencoder is no better: at its optimum it spans PCA's subspace (Baldi & Hornik, "Neural
networks and principal component analysis", 1989), so the linear member of lgc's codec family is
the closed-form one (:mod:`lgc.autoencoder.linear`). This codec gives nonlinearity its fairest
chance: it *is* PCA before it learns anything, and training can only add what PCA misses::

    z     = x U + g(x)          g: chunk -> hidden -> latent (LeakyReLU)
    x_hat = z U^T + h(z)        h: latent -> hidden -> chunk (LeakyReLU)

``U`` (``chunk x latent``, orthonormal columns) is refitted in closed form at every training call,
as the linear codec's basis; ``g`` and ``h`` are small MLPs whose last layers start at zero,
trained by Adam on LGC-RAR's loss (reconstruction, the workers' latent similarity and the decoded
mean, :func:`~lgc.autoencoder.losses.rar_losses`) with ``U`` held. Decoding a sum of codes is exact
only for the linear part; the ``mean`` loss term trains ``h`` for the mean of the latents, which is
what LGC-RAR decodes.

The corrections learn from a few hundred samples and can overfit them (``lgc-bench codecs`` on
Fashion-MNIST gradients: 1,500 updates left the corrected codec above PCA's error on later
steps). So every training call holds out the newest ``validation`` share of the buffer: ``U`` is
fitted and the corrections trained on the rest, and the corrections stay on (``gate`` 1) only if
the decoded mean of the held-out samples is closer with them than without; otherwise ``gate`` is 0
and ``U`` is refitted on the whole buffer, which is the linear codec exactly. With ``hidden=0``
there is no correction and the codec is the linear one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lgc.autoencoder.linear import LinearChunkCodec
from lgc.autoencoder.trainer import AutoencoderTrainer

__all__ = ["PCAAutoencoder", "PCAAutoencoderConfig", "PCAAutoencoderTrainer"]


@dataclass(frozen=True)
class PCAAutoencoderConfig:
    """Shape of :class:`PCAAutoencoder`."""

    #: Values per chunk.
    chunk: int
    #: Latent floats per chunk (``U``'s columns).
    latent_size: int
    #: Width of the correction MLPs' hidden layer; 0: no correction (the linear codec).
    hidden: int = 64
    #: Seed of the correction's initial weights: every worker builds the same codec.
    seed: int = 0
    #: LGC-RAR only: the decoder takes no innovation channel.
    innovation: bool = False

    @property
    def latent_numel(self) -> int:
        """Floats of one chunk's latent code."""
        return self.latent_size

    def __post_init__(self) -> None:
        if not 1 <= self.latent_size <= self.chunk:
            raise ValueError(f"latent_size must be in [1, chunk={self.chunk}], got {self.latent_size!r}")
        if self.hidden < 0:
            raise ValueError(f"pca_hidden must be >= 0, got {self.hidden!r}")


def _correction(inputs: int, hidden: int, outputs: int) -> nn.Sequential | None:
    if hidden == 0:
        return None
    last = nn.Linear(hidden, outputs)
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.LeakyReLU(0.01), last)


class PCAAutoencoder(nn.Module):
    """``z = x U + g(x)``, ``x_hat = z U^T + h(z)``: PCA until ``g`` and ``h`` learn (module docstring).

    Example::

        >>> codec = PCAAutoencoder(PCAAutoencoderConfig(chunk=8, latent_size=2, hidden=4))
        >>> codec.decode(codec.encode(torch.ones(3, 8))).shape
        torch.Size([3, 8])
    """

    def __init__(self, config: PCAAutoencoderConfig) -> None:
        super().__init__()
        self.config = config
        self.linear = LinearChunkCodec(config.chunk, config.latent_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.encoder_correction = _correction(config.chunk, config.hidden, config.latent_size)
            self.decoder_correction = _correction(config.latent_size, config.hidden, config.chunk)
        #: 1: the corrections apply; 0: the linear codec (a parameter: the workers get it with the weights).
        self.gate = nn.Parameter(torch.ones(()), requires_grad=False)

    def encode(self, chunks: Tensor) -> Tensor:
        """``[B, chunk]`` -> ``[B, latent_size]``."""
        latent = self.linear.encode(chunks)
        if self.encoder_correction is None or not self.gate:
            return latent
        return latent + self.encoder_correction(chunks)

    def decode(self, latent: Tensor, innovation: Tensor | None = None, decoder: int = 0) -> Tensor:
        """``[B, latent_size]`` -> ``[B, chunk]`` (no innovation channel: the ring-allreduce codec only)."""
        if innovation is not None:
            raise ValueError("the PCA-initialised autoencoder takes no innovation channel (LGC-RAR only)")
        chunks = self.linear.decode(latent)
        if self.decoder_correction is None or not self.gate:
            return chunks
        return chunks + self.decoder_correction(latent)

    def latent_shape(self, rows: int) -> tuple[int, ...]:
        return rows, self.config.latent_size

    def __repr__(self) -> str:
        c = self.config
        ratio = c.chunk / c.latent_size
        return f"PCAAutoencoder(chunk={c.chunk}, latent={c.latent_size}, hidden={c.hidden}, ratio={ratio:g})"


class PCAAutoencoderTrainer(AutoencoderTrainer):
    """The trainer of :class:`PCAAutoencoder`: fit U, train the corrections, keep them if they help.

    Every :meth:`train` call fits ``U`` (closed form, as
    :class:`~lgc.autoencoder.linear.LinearCodecTrainer` does) and makes ``updates`` optimizer steps
    on the corrections (``U`` is not trained), both on the buffer but its newest ``validation``
    share, then keeps the corrections only if they lower the decoded mean's error on that share (the
    module docstring). Other knobs as the autoencoder's trainer.
    """

    def __init__(self, autoencoder: PCAAutoencoder, *, validation: float = 0.2, **options: Any) -> None:
        if not 0 < validation < 1:
            raise ValueError(f"validation must be in (0, 1), got {validation!r}")
        super().__init__(autoencoder, **options)  # type: ignore[arg-type]
        self.validation = float(validation)

    def train(self, updates: int) -> dict[str, float]:
        codec: PCAAutoencoder = self.autoencoder  # type: ignore[assignment]
        if self.chunks is None or updates < 1:
            return {}
        held_out = int(self.num_samples * self.validation)
        if codec.encoder_correction is None or held_out < 1:
            # No correction, or too few samples to judge one: the linear codec on every sample.
            with torch.no_grad():
                codec.linear.fit(self.chunks)
                codec.gate.fill_(0.0)
            self.updates += updates
            return self.evaluate(self.chunks)
        everything = self.chunks
        fitted, validation = everything[:-held_out], everything[-held_out:]
        try:
            self.chunks = fitted  # the corrections' minibatches come from the fitted part only
            with torch.no_grad():
                codec.linear.fit(fitted)
                codec.gate.fill_(1.0)
            losses = super().train(updates)
        finally:
            self.chunks = everything
        with torch.no_grad():
            corrected = self.evaluate(validation)["relative_error"]
            codec.gate.fill_(0.0)
            linear = self.evaluate(validation)["relative_error"]
            if corrected < linear:
                codec.gate.fill_(1.0)
            else:
                codec.linear.fit(everything)  # the linear codec, on every sample
        return losses
