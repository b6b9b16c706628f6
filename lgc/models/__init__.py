"""Models: CIFAR-style ResNets, torchvision's ImageNet ResNets and PSPNet."""

from lgc.models.cifar_resnet import CifarResNet, resnet8, resnet20, resnet32, resnet56, resnet110
from lgc.models.pspnet import PSPNet, PSPNetOutput
from lgc.models.torchvision_resnet import resnet50, resnet101, torchvision_resnet

__all__ = [
    "CifarResNet",
    "PSPNet",
    "PSPNetOutput",
    "resnet8",
    "resnet20",
    "resnet32",
    "resnet50",
    "resnet56",
    "resnet101",
    "resnet110",
    "torchvision_resnet",
]
