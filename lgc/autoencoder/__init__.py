"""LGC's autoencoder: networks, chunking, losses and the trainer (pure PyTorch)."""

from lgc.autoencoder.chunks import chunk_scales, divide_by_scales, from_chunks, num_chunks, to_chunks
from lgc.autoencoder.losses import AutoencoderLosses, LossWeights, ps_losses, rar_losses, relative_error
from lgc.autoencoder.model import AutoencoderConfig, GradientAutoencoder
from lgc.autoencoder.trainer import AutoencoderTrainer

__all__ = [
    "AutoencoderConfig",
    "AutoencoderLosses",
    "AutoencoderTrainer",
    "GradientAutoencoder",
    "LossWeights",
    "chunk_scales",
    "divide_by_scales",
    "from_chunks",
    "num_chunks",
    "ps_losses",
    "rar_losses",
    "relative_error",
    "to_chunks",
]
