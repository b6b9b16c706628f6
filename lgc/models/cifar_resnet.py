"""ResNets for small images (He et al., "Deep Residual Learning for Image Recognition", 2016, Sec. 4.2).

Depth ``6n + 2``: a 3x3 stem, three stages of ``n`` basic blocks with 16, 32 and 64 channels
(times ``width``), global average pooling and a linear classifier. ResNet-8/20/32/56/110 are
``n = 1/3/5/9/18``. Shortcuts that change shape use the paper's option A (strided identity,
zero-padded channels: no parameters), as in the CIFAR-10 experiments of the paper and of DGC.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CifarResNet", "resnet8", "resnet20", "resnet32", "resnet56", "resnet110"]


class _BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.extra_channels = planes - in_planes

    def _shortcut(self, x: Tensor) -> Tensor:
        if self.stride == 1 and self.extra_channels == 0:
            return x
        x = x[:, :, :: self.stride, :: self.stride]
        half = self.extra_channels // 2
        return F.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._shortcut(x))


class CifarResNet(nn.Module):
    """A ``6n + 2``-layer ResNet for small inputs (CIFAR's 32x32, digits' 8x8).

    Args:
        depth: 8, 20, 32, 44, 56, 110, ... (``(depth - 2) % 6 == 0``).
        num_classes: outputs of the classifier.
        in_channels: 3 for RGB, 1 for grayscale digits.
        width: channel multiplier of the 16/32/64 stages.
    """

    def __init__(self, depth: int = 20, num_classes: int = 10, in_channels: int = 3, width: int = 1) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"CifarResNet depth must be 6n + 2 with n >= 1 (8, 20, 32, 56, 110), got {depth}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        blocks = (depth - 2) // 6
        planes = [16 * width, 32 * width, 64 * width]
        self.conv1 = nn.Conv2d(in_channels, planes[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes[0])
        layers, in_planes = [], planes[0]
        for stage, stage_planes in enumerate(planes):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(_BasicBlock(in_planes, stage_planes, stride))
                in_planes = stage_planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(in_planes, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
        return self.fc(out)


def resnet8(**kwargs) -> CifarResNet:
    return CifarResNet(depth=8, **kwargs)


def resnet20(**kwargs) -> CifarResNet:
    return CifarResNet(depth=20, **kwargs)


def resnet32(**kwargs) -> CifarResNet:
    return CifarResNet(depth=32, **kwargs)


def resnet56(**kwargs) -> CifarResNet:
    return CifarResNet(depth=56, **kwargs)


def resnet110(**kwargs) -> CifarResNet:
    return CifarResNet(depth=110, **kwargs)
