"""Which modules of a model ``fully_shard`` gets, each its own parameter group, before the model itself."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import fully_shard

__all__ = ["shard_blocks", "shard_model"]


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` gets before the model itself, in the model's order: every block of an
    ``nn.Sequential`` child (a ResNet stage's residual blocks), every child with parameters of its own (a
    convolution, a norm layer, a linear head), and the same within every other child. A container's own
    ``forward`` need not run (PSPNet calls its backbone's stages one by one), so it is never a unit itself."""
    blocks = []
    for child in model.children():
        if isinstance(child, nn.Sequential):
            blocks += [part for part in child.children() if any(True for _ in part.parameters())]
        elif any(True for _ in child.parameters(recurse=False)):
            blocks.append(child)
        else:
            blocks += shard_blocks(child)
    return blocks


def shard_model(model: nn.Module, **fully_shard_kwargs: object) -> nn.Module:
    """``fully_shard`` every block of ``model`` (:func:`shard_blocks`), then ``model``; returns ``model``.

    ``fully_shard_kwargs`` go to every call (``mesh``, ``mp_policy``, ...)."""
    for block in shard_blocks(model):
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model
