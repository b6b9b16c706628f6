"""Models: CIFAR-style ResNets (and, later, torchvision ResNets and PSPNet)."""

from lgc.models.cifar_resnet import CifarResNet, resnet8, resnet20, resnet32, resnet56, resnet110

__all__ = ["CifarResNet", "resnet8", "resnet20", "resnet32", "resnet56", "resnet110"]
