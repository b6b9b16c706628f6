"""torchvision's ImageNet ResNets (He et al., "Deep Residual Learning for Image Recognition", 2016, Table 1).

ResNet-50/101 are the bottleneck networks of the paper's Table 1 as torchvision builds them (stride
on the 3x3 convolution, "ResNet v1.5"), randomly initialized (``weights=None``: nothing is ever
downloaded). Two stems:

* ``imagenet``: the paper's 7x7 stride-2 convolution and 3x3 stride-2 max pooling (input /4 before
  ``layer1``; 224x224 images end at 7x7).
* ``cifar``: a 3x3 stride-1 convolution and no max pooling, the usual adaptation to 32x32 images
  (as in kuangliu/pytorch-cifar, and in the CIFAR-10 ResNet-50/101 runs of the LGC paper,
  Abrahamyan et al., "Learned Gradient Compression for Distributed Deep Learning", 2021): 32x32
  images end at 4x4 instead of 1x1.

The model returned is a plain :class:`torchvision.models.ResNet`, so its state-dict keys are
torchvision's.
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torchvision import models
from torchvision.models import ResNet

__all__ = ["Stem", "resnet50", "resnet101", "torchvision_resnet"]

Stem = Literal["imagenet", "cifar"]

# Depth -> torchvision builder (BasicBlock for 18/34, Bottleneck for 50 and deeper).
_BUILDERS = {
    18: models.resnet18,
    34: models.resnet34,
    50: models.resnet50,
    101: models.resnet101,
    152: models.resnet152,
}


def torchvision_resnet(
    depth: int = 50, num_classes: int = 1000, in_channels: int = 3, stem: Stem = "imagenet"
) -> ResNet:
    """A randomly initialized torchvision ResNet with a chosen input stem.

    Args:
        depth: 18, 34, 50, 101 or 152 (torchvision's builders).
        num_classes: outputs of the classifier (passed by ``lgc-train`` from the data module).
        in_channels: input channels (3 for RGB, 1 for grayscale); other than 3 replaces the first
            convolution (same shape otherwise, freshly initialized).
        stem: ``"imagenet"`` (7x7 stride-2 convolution + max pooling, for ImageNet-size images) or
            ``"cifar"`` (3x3 stride-1 convolution, no max pooling, for 32x32 images; 16x more
            activations in every stage, so about 16x the compute at the same input size).

    Returns:
        A :class:`torchvision.models.ResNet` (ResNet-50: 25,557,032 parameters with the ImageNet
        stem and 1,000 classes; 23,520,842 with the CIFAR stem and 10 classes).

    Example::

        >>> import torch
        >>> model = torchvision_resnet(50, num_classes=10, stem="cifar")
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    if depth not in _BUILDERS:
        raise ValueError(f"torchvision ResNet depth must be one of {sorted(_BUILDERS)}, got {depth!r}")
    if stem not in ("imagenet", "cifar"):
        raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels!r}")
    model = _BUILDERS[depth](weights=None, num_classes=num_classes)
    width = model.conv1.out_channels
    if stem == "cifar":
        model.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
    else:
        return model
    # The same initialization torchvision gives every other convolution.
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def resnet50(**kwargs) -> ResNet:
    """ResNet-50 (:func:`torchvision_resnet` with ``depth=50``)."""
    return torchvision_resnet(depth=50, **kwargs)


def resnet101(**kwargs) -> ResNet:
    """ResNet-101 (:func:`torchvision_resnet` with ``depth=101``)."""
    return torchvision_resnet(depth=101, **kwargs)
