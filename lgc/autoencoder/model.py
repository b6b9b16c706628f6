"""LGC's gradient autoencoder: 1-D convolutions over fixed-length chunks of top-k values.

Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep
Learning" (IEEE TNNLS 2021, arXiv:2103.08870). The encoder maps a chunk of ``L`` gradient values
(one channel) through strided ``Conv1d`` layers (kernel 3, stride 2, LeakyReLU) and a final
``1x1`` convolution to ``latent_channels`` channels of length ``L / 2**depth``; with the reference
widths ``1 -> 64 -> 128 -> 256 -> 64 -> 4`` the latent holds ``L / 4`` floats. A decoder mirrors
it with ``ConvTranspose1d`` layers (``4 -> 32 -> 64 -> 128 -> 32``), interpolates to ``L``, and a
``1x1`` convolution maps back to one channel; the parameter-server variant concatenates an
*innovation* channel (a worker's own sparse values) before that last convolution. With
``decoder="upsample"`` each transposed convolution is a nearest-neighbour upsampling by 2 followed
by a kernel-3 convolution instead (the usual remedy for checkerboard artifacts; twice the
multiply-adds, measured by ``lgc-bench step`` and ``lgc-bench autoencoder``).

The reference widths cost about 1.4 M multiply-adds per chunk of 64 to encode and 0.84 M to decode
(twice both per chunk of 128); LGC-RAR encodes each chunk once and decodes it twice (its own latent
and the mean), so at density 1 % on ResNet-50 (4,000 chunks of 64) that is about 12 G multiply-adds
per step: more than the model's whole step at 8 images of 64x64, a few percent of it at 32 images of
224x224. ``lgc-bench step`` counts it beside each step's time; ``lgc-bench autoencoder`` compares
narrower widths.

Unlike the reference, whose input length is the model's whole top-k vector, this autoencoder works
on chunks of ``chunk`` values (:mod:`lgc.autoencoder.chunks`), so one autoencoder serves every
bucket of every model. As in CompressAI, the training path (:mod:`lgc.autoencoder.losses`) is kept
apart from the runtime path (:meth:`GradientAutoencoder.encode` / :meth:`GradientAutoencoder.decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lgc.validation import FiniteFloat, PositiveInt, Seed, check

__all__ = ["AutoencoderConfig", "GradientAutoencoder"]

_DECODERS = ("transposed", "upsample")


#: Every :class:`AutoencoderConfig` field's type and bounds, checked (by name) when one is built.
_FIELD_CHECKS: dict[str, object] = {
    "chunk": PositiveInt,
    "encoder_channels": tuple[PositiveInt, ...],
    "latent_channels": PositiveInt,
    "decoder_channels": tuple[PositiveInt, ...],
    "decoder": str,
    "negative_slope": FiniteFloat,
    "num_decoders": PositiveInt,
    "innovation": bool,
    "seed": Seed,
}


@dataclass(frozen=True)
class AutoencoderConfig:
    """Shape of :class:`GradientAutoencoder` (the reference's values by default)."""

    #: Values per chunk ``L``: the encoder's input length. A multiple of ``2 ** len(encoder_channels)``
    #: and at least the encoder's receptive field. Longer chunks see more context per code; the
    #: last chunk of a bucket is zero-padded, so very long chunks waste bytes on small buckets.
    chunk: int = 128
    #: Output channels of the strided (kernel 3, stride 2) encoder convolutions; each halves the length.
    encoder_channels: tuple[int, ...] = (64, 128, 256, 64)
    #: Channels of the latent code (a ``1x1`` convolution). Latent floats per chunk:
    #: ``latent_channels * chunk / 2 ** len(encoder_channels)`` (``chunk / 4`` by default).
    latent_channels: int = 4
    #: Output channels of the decoder's upsampling layers (each doubles the length).
    decoder_channels: tuple[int, ...] = (32, 64, 128, 32)
    #: How the decoder doubles the length: ``"transposed"`` (the reference's ``ConvTranspose1d``,
    #: kernel 3, stride 2) or ``"upsample"`` (nearest-neighbour upsampling, then a kernel-3 ``Conv1d``).
    decoder: str = "transposed"
    #: Slope of the LeakyReLU activations.
    negative_slope: float = 0.01
    #: Decoders: 1 for ring-allreduce (one decoder of the mean latent), one per worker for the
    #: parameter server (decoder ``i`` reconstructs worker ``i``'s values).
    num_decoders: int = 1
    #: Whether decoders take an innovation channel (the parameter-server variant).
    innovation: bool = False
    #: Seed of the weight initialization: every worker builds the same autoencoder.
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("encoder_channels", "decoder_channels"):  # a list given in Python is the same layers
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name, annotation in _FIELD_CHECKS.items():
            check(f"autoencoder {name}", getattr(self, name), annotation)
        depth = len(self.encoder_channels)
        if depth < 1 or not self.decoder_channels:
            raise ValueError("encoder_channels and decoder_channels must each name at least one layer")
        if self.decoder not in _DECODERS:
            raise ValueError(f"autoencoder decoder must be one of {_DECODERS}, got {self.decoder!r}")
        stride = 2**depth
        if self.chunk < self.receptive_field:
            raise ValueError(
                f"autoencoder chunk={self.chunk} is shorter than the encoder's receptive field "
                f"({self.receptive_field} values for {depth} stride-2 convolutions of kernel 3)"
            )
        if self.chunk % stride:
            raise ValueError(f"autoencoder chunk={self.chunk} must be a multiple of 2**{depth} = {stride}")

    @property
    def receptive_field(self) -> int:
        """Input values that one latent position sees: ``1 + 2 * (2**depth - 1)`` for kernel 3, stride 2."""
        return 1 + 2 * (2 ** len(self.encoder_channels) - 1)

    @property
    def latent_length(self) -> int:
        return self.chunk // 2 ** len(self.encoder_channels)

    @property
    def latent_numel(self) -> int:
        """Floats of one chunk's latent code."""
        return self.latent_channels * self.latent_length

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> AutoencoderConfig:
        """Build from config values (lists become tuples).

        ``width`` (a positive number, default 1) multiplies every encoder and decoder width (each
        rounded, at least 1): ``width=0.25`` is the reference architecture at a sixteenth of its
        parameters, for codecs that must stay small beside the model or learn from few samples.
        """
        width = kwargs.pop("width", 1.0)
        if isinstance(width, bool) or not isinstance(width, int | float) or not 0 < width <= 16:
            raise ValueError(f"autoencoder width must be a number in (0, 16], got {width!r}")
        for name in ("encoder_channels", "decoder_channels"):
            # Checked as given, before the width scales them (which keeps each at least 1).
            channels = check(f"autoencoder {name}", kwargs.get(name, getattr(cls, name)), Sequence[PositiveInt])
            kwargs[name] = tuple(max(1, round(c * width)) for c in channels)
        return cls(**kwargs)  # type: ignore[arg-type]


def _encoder(config: AutoencoderConfig) -> nn.Sequential:
    layers: list[nn.Module] = []
    in_channels = 1
    for width in config.encoder_channels:
        layers += [nn.Conv1d(in_channels, width, 3, stride=2, padding=1), nn.LeakyReLU(config.negative_slope)]
        in_channels = width
    layers.append(nn.Conv1d(in_channels, config.latent_channels, 1))
    return nn.Sequential(*layers)


class _Decoder(nn.Module):
    def __init__(self, config: AutoencoderConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = config.latent_channels
        for width in config.decoder_channels:
            if config.decoder == "upsample":
                layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv1d(in_channels, width, 3, padding=1)]
            else:
                layers.append(nn.ConvTranspose1d(in_channels, width, 3, stride=2, padding=1, output_padding=1))
            layers.append(nn.LeakyReLU(config.negative_slope))
            in_channels = width
        self.body = nn.Sequential(*layers)
        self.chunk = config.chunk
        self.head = nn.Conv1d(in_channels + int(config.innovation), 1, 1)

    def forward(self, latent: Tensor, innovation: Tensor | None) -> Tensor:
        features = self.body(latent)
        if features.shape[-1] != self.chunk:
            features = F.interpolate(features, size=self.chunk, mode="linear", align_corners=False)
        if innovation is not None:
            features = torch.cat([features, innovation.unsqueeze(1)], dim=1)
        return self.head(features).squeeze(1)


class GradientAutoencoder(nn.Module):
    """Encoder and decoder(s) of LGC, over chunks of ``config.chunk`` values.

    Args:
        config: the architecture (:class:`AutoencoderConfig`).

    Example::

        >>> ae = GradientAutoencoder(AutoencoderConfig(chunk=64))
        >>> chunks = torch.randn(5, 64)
        >>> ae.encode(chunks).shape, ae.decode(ae.encode(chunks)).shape
        (torch.Size([5, 4, 4]), torch.Size([5, 64]))
    """

    def __init__(self, config: AutoencoderConfig) -> None:
        super().__init__()
        self.config = config
        # Built under a fixed seed, without touching the global generator: every worker gets the
        # same weights, and the model's own initialization is not shifted by building this.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.encoder = _encoder(config)
            self.decoders = nn.ModuleList(_Decoder(config) for _ in range(config.num_decoders))

    def encode(self, chunks: Tensor) -> Tensor:
        """``[B, chunk]`` values -> ``[B, latent_channels, latent_length]`` codes."""
        return self.encoder(chunks.unsqueeze(1))

    def decode(self, latent: Tensor, innovation: Tensor | None = None, decoder: int = 0) -> Tensor:
        """``[B, latent_channels, latent_length]`` codes (and ``[B, chunk]`` innovations) -> ``[B, chunk]``."""
        if self.config.innovation != (innovation is not None):
            raise ValueError(
                "this autoencoder's decoders "
                + ("need an innovation channel" if self.config.innovation else "take no innovation channel")
            )
        return self.decoders[decoder](latent, innovation)

    def latent_shape(self, rows: int) -> tuple[int, ...]:
        """Shape of the latent code of ``rows`` chunks: ``(rows, latent_channels, latent_length)``."""
        return rows, self.config.latent_channels, self.config.latent_length

    def encoder_numel(self) -> int:
        return sum(p.numel() for p in self.encoder.parameters())

    def __repr__(self) -> str:
        c = self.config
        return (
            f"GradientAutoencoder(chunk={c.chunk}, latent={c.latent_channels}x{c.latent_length}, "
            f"decoders={c.num_decoders} ({c.decoder}), innovation={c.innovation}, "
            f"params={sum(p.numel() for p in self.parameters()):,}, ratio={c.chunk / c.latent_numel:g})"
        )
