"""PSPNet (Zhao et al., "Pyramid Scene Parsing Network", CVPR 2017).

A dilated ResNet backbone (torchvision's, randomly initialized) keeps ``layer3`` and ``layer4`` at
1/8 of the input size (output stride 8) by replacing their stride-2 with dilated convolutions. The
pyramid pooling module average-pools ``layer4``'s features to 1x1, 2x2, 3x3 and 6x6 bins, reduces
each to 1/4 of the channels with a 1x1 convolution + BN + ReLU, upsamples them back and concatenates
them with the features; a 3x3 convolution + BN + ReLU, dropout and a 1x1 classifier give the logits,
bilinearly upsampled to the input size. The auxiliary head on ``layer3`` (the paper's deep
supervision, Sec. 4; loss weight 0.4 in Sec. 5) has the same shape with 256 channels. Layer choices follow
the authors' PyTorch code (hszhao/semseg): bias-free convolutions before BN, ``Dropout2d(0.1)``.

``forward`` returns :class:`PSPNetOutput` ``(main, aux)`` in training mode and the main logits
only in eval mode, so evaluation and inference never pay for the auxiliary head.

Backbones: ``resnet50`` and ``resnet101`` (the paper's; bottleneck blocks, dilated by torchvision's
``replace_stride_with_dilation``) and ``resnet18`` / ``resnet34`` (basic blocks, which torchvision
refuses to dilate; dilated here with the same convention, see :func:`dilate_stage`). ``resnet18``
with ``head_channels=128, aux_channels=64`` (mmsegmentation's PSPNet-R18 sizes,
``conf/model/pspnet_r18.yaml``) is the cheap configuration for CPU smoke runs, and the same
ResNet-18 at a quarter of the width (``width=16``, ``conf/model/pspnet_small.yaml``) trains on the
CPU in minutes.

Not here: the ImageNet-pretrained backbone every result in the paper starts from (nothing is
downloaded; load a state dict into ``model.backbone`` yourself), the deep 3-convolution stem and
synchronized BN across workers (Lightning's ``sync_batchnorm``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision import models
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

__all__ = ["Backbone", "PSPNet", "PSPNetOutput", "dilate_stage"]

Backbone = Literal["resnet18", "resnet34", "resnet50", "resnet101"]

_BUILDERS = {
    "resnet18": models.resnet18,
    "resnet34": models.resnet34,
    "resnet50": models.resnet50,
    "resnet101": models.resnet101,
}
# output stride -> which of layer2/3/4 trade their stride 2 for dilation (torchvision's flags).
_DILATE = {8: (False, True, True), 16: (False, False, True), 32: (False, False, False)}


class PSPNetOutput(NamedTuple):
    """What :class:`PSPNet` returns in training mode (a tuple: ``main, aux = model(x)`` works)."""

    # (N, num_classes, H, W) logits of the pyramid pooling head, at the input size.
    main: Tensor
    # (N, num_classes, H, W) logits of the auxiliary head on layer3, at the input size.
    aux: Tensor


def dilate_stage(stage: nn.Sequential, previous: int, dilation: int) -> None:
    """Replace a ResNet stage's stride 2 with dilation, in place (any torchvision block type).

    The same convention as torchvision's ``replace_stride_with_dilation``: the 3x3 convolution that
    carried the stride still reads its input at the previous resolution, so it keeps the previous
    dilation; every 3x3 convolution after it reads a map twice as dense as before and gets
    ``dilation``. The shortcut's 1x1 convolution loses its stride. With this convention the dilated
    network's output, subsampled by the removed strides, equals the original network's output
    exactly (zero padding included), which the tests check for basic and bottleneck blocks alike.

    Args:
        stage: ``layer2``, ``layer3`` or ``layer4`` of a torchvision ResNet (its first block strided).
        previous: the dilation in effect before this stage (1, or 2 after a dilated stage).
        dilation: the dilation after this stage (``2 * previous``).
    """
    stride_seen = False
    for block in stage:
        for conv in (m for m in block.modules() if isinstance(m, nn.Conv2d)):
            strided = conv.stride != (1, 1)
            conv.stride = (1, 1)
            if conv.kernel_size == (3, 3):
                d = dilation if stride_seen else previous
                conv.dilation, conv.padding = (d, d), (d, d)
            # torchvision registers a block's convolutions in forward order (conv1, conv2, ...,
            # downsample), so "after" in this loop is "after" in the forward pass.
            stride_seen = stride_seen or (strided and conv.kernel_size == (3, 3))


class _NarrowResNet(ResNet):
    """torchvision's ResNet with ``width`` channels in its stem and first stage instead of 64
    (the stages then have ``width x (1, 2, 4, 8)`` times the block's expansion); the same modules,
    names and initialisation, so dilation and :meth:`PSPNet.features` treat it as torchvision's."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: Sequence[int], width: int) -> None:
        nn.Module.__init__(self)
        self._norm_layer, self.dilation, self.groups, self.base_width = nn.BatchNorm2d, 1, 1, 64
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool, self.fc = nn.Identity(), nn.Identity()
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


_LAYOUTS: dict[str, tuple[type[BasicBlock | Bottleneck], tuple[int, ...]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
}


def _dilated_resnet(backbone: Backbone, in_channels: int, output_stride: int, width: int = 64) -> ResNet:
    flags = _DILATE[output_stride]
    # torchvision dilates its own bottleneck blocks; its BasicBlock raises for dilation > 1, and a
    # narrow ResNet is built here: both are dilated by dilate_stage, with torchvision's convention.
    by_torchvision = width == 64 and backbone in ("resnet50", "resnet101")
    if width == 64:
        net = _BUILDERS[backbone](weights=None, replace_stride_with_dilation=list(flags) if by_torchvision else None)
    else:
        net = _NarrowResNet(*_LAYOUTS[backbone], width)
    if not by_torchvision:
        dilation = 1
        for flag, stage in zip(flags, (net.layer2, net.layer3, net.layer4), strict=True):
            if flag:
                dilate_stage(stage, dilation, 2 * dilation)
                dilation *= 2
    if in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, net.conv1.out_channels, 7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    # Unused parameters would make DDP wait for gradients that never come.
    net.avgpool, net.fc = nn.Identity(), nn.Identity()
    return net


def _conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int) -> list[nn.Module]:
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return [conv, nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True)]


def _classifier(in_channels: int, mid_channels: int, num_classes: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        *_conv_bn_relu(in_channels, mid_channels, 3), nn.Dropout2d(dropout), nn.Conv2d(mid_channels, num_classes, 1)
    )


class _PyramidPooling(nn.Module):
    """Features concatenated with their pooled, reduced (1/len(bins) channels), upsampled versions."""

    def __init__(self, in_channels: int, bins: Sequence[int]) -> None:
        super().__init__()
        reduced = in_channels // len(bins)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(b), *_conv_bn_relu(in_channels, reduced, 1)) for b in bins
        )
        self.out_channels = in_channels + reduced * len(bins)

    def forward(self, x: Tensor) -> Tensor:
        size = x.shape[-2:]
        pooled = [F.interpolate(stage(x), size, mode="bilinear", align_corners=False) for stage in self.stages]
        return torch.cat([x, *pooled], dim=1)


class PSPNet(nn.Module):
    """Pyramid Scene Parsing Network with a dilated torchvision ResNet backbone.

    Args:
        num_classes: classes to segment (passed by ``lgc-train`` from the data module).
        in_channels: input channels (3 for RGB); other than 3 replaces the backbone's first convolution.
        backbone: ``resnet50`` (the paper's ablations) or ``resnet101`` (its benchmark results);
            ``resnet18`` / ``resnet34`` have basic blocks and 512 output channels instead of 2048
            (with ``head_channels=128, aux_channels=64``, ResNet-18 needs 3.5x fewer FLOPs and 4x
            fewer parameters than ResNet-50: for smoke runs and small budgets).
        output_stride: 8 (the paper: ``layer3`` dilated 2, ``layer4`` dilated 4), 16 (only
            ``layer4`` dilated: about a quarter of the head's and ``layer4``'s compute) or 32 (no
            dilation: a plain ResNet, coarse masks).
        bins: output sizes of the pyramid's average poolings; each level gets
            ``backbone channels / len(bins)`` channels.
        head_channels: channels of the 3x3 convolution after the pyramid (512 in the paper; its
            ``(2 * backbone channels) x head_channels x 9`` weights are PSPNet-R50's largest layer).
        aux_channels: channels of the auxiliary head's 3x3 convolution (256 in the paper's code).
        dropout: ``Dropout2d`` probability before both classifiers (0.1 in the paper's code).
        width: channels of the backbone's stem and first stage (torchvision's 64; the stages have
            ``width x (1, 2, 4, 8)`` times the block's expansion). A narrower backbone, same depth,
            dilation and head: 16 cuts the backbone's compute about 16x (``conf/model/pspnet_small.yaml``).

    In training mode ``forward`` returns :class:`PSPNetOutput` ``(main, aux)``, both
    ``(N, num_classes, H, W)`` logits; train on ``loss(main) + 0.4 * loss(aux)``
    (:class:`lgc.lit.segmentation.SemanticSegmenter` does). In eval mode it returns the main logits.
    Every worker needs at least 2 images per batch in training: the 1x1 bin's BatchNorm sees one
    value per channel and image.

    Example::

        >>> model = PSPNet(num_classes=11, backbone="resnet18", head_channels=128, aux_channels=64)
        >>> main, aux = model(torch.randn(2, 3, 64, 64))
        >>> main.shape, aux.shape
        (torch.Size([2, 11, 64, 64]), torch.Size([2, 11, 64, 64]))
        >>> model.eval()(torch.randn(1, 3, 64, 64)).shape
        torch.Size([1, 11, 64, 64])
    """

    def __init__(
        self,
        num_classes: int = 21,
        in_channels: int = 3,
        backbone: Backbone = "resnet50",
        output_stride: int = 8,
        bins: Sequence[int] = (1, 2, 3, 6),
        head_channels: int = 512,
        aux_channels: int = 256,
        dropout: float = 0.1,
        width: int = 64,
    ) -> None:
        super().__init__()
        if backbone not in _BUILDERS:
            raise ValueError(f"backbone must be one of {sorted(_BUILDERS)}, got {backbone!r}")
        if output_stride not in _DILATE:
            raise ValueError(f"output_stride must be one of {sorted(_DILATE)}, got {output_stride!r}")
        if num_classes < 1 or in_channels < 1 or head_channels < 1 or aux_channels < 1:
            raise ValueError(
                "num_classes, in_channels, head_channels and aux_channels must be >= 1, got "
                f"{num_classes}, {in_channels}, {head_channels}, {aux_channels}"
            )
        if not bins or any(b < 1 for b in bins):
            raise ValueError(f"bins must be a non-empty list of positive sizes, got {bins!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive number of channels, got {width!r}")
        self.output_stride = output_stride
        self.backbone = _dilated_resnet(backbone, in_channels, output_stride, width)
        expansion = type(self.backbone.layer4[0]).expansion  # 1 for basic blocks, 4 for bottlenecks
        self.ppm = _PyramidPooling(8 * width * expansion, bins)
        self.head = _classifier(self.ppm.out_channels, head_channels, num_classes, dropout)
        self.aux_head = _classifier(4 * width * expansion, aux_channels, num_classes, dropout)

    def features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The backbone's ``layer3`` and ``layer4`` features, both at ``1 / output_stride`` of the input
        (``output_stride=8``; ``layer3`` is at 1/16 with 16 or 32, and ``layer4`` at 1/32 with 32)."""
        net = self.backbone
        x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        c3 = net.layer3(net.layer2(net.layer1(x)))
        return c3, net.layer4(c3)

    def forward(self, x: Tensor) -> Tensor | PSPNetOutput:
        size = x.shape[-2:]
        c3, c4 = self.features(x)
        main = F.interpolate(self.head(self.ppm(c4)), size, mode="bilinear", align_corners=False)
        if not self.training:
            return main
        aux = F.interpolate(self.aux_head(c3), size, mode="bilinear", align_corners=False)
        return PSPNetOutput(main, aux)
