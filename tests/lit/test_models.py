"""Models (CIFAR ResNets, torchvision ResNets, PSPNet) and the segmentation task module, on CPU, single process."""

import math
from functools import partial
from pathlib import Path

import hydra
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchvision import models

import lgc
from lgc.lit.segmentation import SemanticSegmenter, pixel_cross_entropy, split_logits
from lgc.models import CifarResNet, PSPNet, PSPNetOutput, torchvision_resnet
from lgc.models.pspnet import dilate_stage

MODEL_CONFIGS = Path(lgc.__file__).parent / "conf" / "model"


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def cheap_pspnet(num_classes: int = 5, **kwargs) -> PSPNet:
    return PSPNet(num_classes, backbone="resnet18", head_channels=32, aux_channels=16, **kwargs)


# --- CIFAR ResNets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("depth", "exact", "paper_millions"),
    # He et al. 2016, Table 6 (option A shortcuts, 10 classes); exact counts as in akamaster/pytorch_resnet_cifar10.
    [(20, 269_722, 0.27), (32, 464_154, 0.46), (56, 853_018, 0.85), (110, 1_727_962, 1.7)],
)
def test_cifar_resnet_parameter_counts_match_the_paper(depth, exact, paper_millions):
    model = CifarResNet(depth, num_classes=10)
    assert num_params(model) == exact
    # The paper rounds to two significant digits.
    assert round(num_params(model) / 1e6, 2 if depth < 100 else 1) == paper_millions
    cfg = OmegaConf.load(MODEL_CONFIGS / f"resnet{depth}.yaml")
    assert num_params(hydra.utils.instantiate(cfg, num_classes=10, in_channels=3)) == exact


# --- torchvision ResNets ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("depth", "stem", "num_classes", "expected"),
    [
        (50, "imagenet", 1000, 25_557_032),  # torchvision's documented ResNet-50 size
        pytest.param(101, "imagenet", 1000, 44_549_160, marks=pytest.mark.slow),  # torchvision's ResNet-101 size
        (50, "cifar", 10, 23_520_842),  # 7x7x3x64 stem -> 3x3x3x64, 2048 x 990 fewer classifier weights
        pytest.param(101, "cifar", 10, 42_512_970, marks=pytest.mark.slow),
    ],
)
def test_torchvision_resnet_parameter_counts(depth, stem, num_classes, expected):
    assert num_params(torchvision_resnet(depth, num_classes=num_classes, stem=stem)) == expected


def test_torchvision_resnet_keeps_torchvision_state_dict_keys():
    ours = torchvision_resnet(50, num_classes=10, stem="cifar").state_dict()
    theirs = models.resnet50(weights=None, num_classes=10).state_dict()
    assert list(ours) == list(theirs)


def _stage_sizes(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[int, int]]:
    sizes = {}
    hooks = [
        getattr(model, name).register_forward_hook(lambda m, i, o, name=name: sizes.__setitem__(name, o.shape[-2:]))
        for name in ("layer1", "layer4")
    ]
    model(x)
    for hook in hooks:
        hook.remove()
    return {k: tuple(v) for k, v in sizes.items()}


@torch.no_grad()
def test_resnet50_cifar_stem_keeps_32x32_until_layer1():
    model = torchvision_resnet(50, num_classes=10, stem="cifar").eval()
    x = torch.randn(1, 3, 32, 32)
    assert _stage_sizes(model, x) == {"layer1": (32, 32), "layer4": (4, 4)}
    assert model(x).shape == (1, 10)
    imagenet = torchvision_resnet(50, num_classes=10, stem="imagenet").eval()
    assert _stage_sizes(imagenet, x) == {"layer1": (8, 8), "layer4": (1, 1)}


@pytest.mark.parametrize("stem", ["imagenet", "cifar"])
@torch.no_grad()
def test_torchvision_resnet_in_channels(stem):
    model = torchvision_resnet(50, num_classes=7, in_channels=1, stem=stem).eval()
    assert model.conv1.in_channels == 1
    assert model(torch.randn(1, 1, 32, 32)).shape == (1, 7)


def test_torchvision_resnet_rejects_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        torchvision_resnet(49)
    with pytest.raises(ValueError, match="stem"):
        torchvision_resnet(50, stem="deep")


# --- PSPNet -------------------------------------------------------------------------------------------------


def test_pspnet_returns_main_and_aux_logits_only_in_training():
    model = cheap_pspnet(num_classes=5)
    x = torch.randn(2, 3, 60, 80)  # not a multiple of 8: outputs still match the input size
    out = model.train()(x)
    assert isinstance(out, PSPNetOutput)
    assert out.main.shape == out.aux.shape == (2, 5, 60, 80)
    main, aux = out
    assert not torch.equal(main, aux)
    logits = model.eval()(x[:1])
    assert isinstance(logits, torch.Tensor) and not isinstance(logits, tuple)
    assert logits.shape == (1, 5, 60, 80)


def test_pspnet_every_parameter_gets_a_gradient_in_training():
    # DDP waits for a gradient of every parameter: no unused heads or classifier.
    model = cheap_pspnet(num_classes=3)
    main, aux = model(torch.randn(2, 3, 32, 32))
    (main.sum() + aux.sum()).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []


@pytest.mark.parametrize(("output_stride", "c3_size", "c4_size"), [(8, 8, 8), (16, 4, 4), (32, 4, 2)])
def test_pspnet_output_stride(output_stride, c3_size, c4_size):
    model = cheap_pspnet(output_stride=output_stride).eval()
    c3, c4 = model.features(torch.randn(1, 3, 64, 64))
    assert c3.shape == (1, 256, c3_size, c3_size)
    assert c4.shape == (1, 512, c4_size, c4_size)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5, 64, 64)


def test_pspnet_r50_features_are_at_output_stride_8():
    model = PSPNet(num_classes=3, backbone="resnet50").eval()
    c3, c4 = model.features(torch.randn(1, 3, 64, 64))
    assert c3.shape == (1, 1024, 8, 8) and c4.shape == (1, 2048, 8, 8)


def _plain_features(net: models.ResNet, x: torch.Tensor) -> torch.Tensor:
    x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
    return net.layer4(net.layer3(net.layer2(net.layer1(x))))


@pytest.mark.parametrize("backbone", ["resnet18", "resnet50"])
@torch.no_grad()
def test_dilated_backbone_is_the_plain_backbone_without_subsampling(backbone):
    # Removing layer3's and layer4's strides (x4 in all) and dilating the convolutions after them
    # computes the plain network's features at every position: subsampled by 4 they are equal.
    model = PSPNet(num_classes=3, backbone=backbone).eval()
    plain = getattr(models, backbone)(weights=None).eval()
    missing, unexpected = plain.load_state_dict(model.backbone.state_dict(), strict=False)
    assert set(missing) == {"fc.weight", "fc.bias"} and unexpected == []
    x = torch.randn(1, 3, 64, 64)
    _, dilated = model.features(x)
    expected = _plain_features(plain, x)
    assert expected.shape[-2:] == (2, 2) and dilated.shape[-2:] == (8, 8)
    torch.testing.assert_close(dilated[..., ::4, ::4], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("depth", [50, pytest.param(101, marks=pytest.mark.slow)])
def test_dilate_stage_matches_torchvision_on_bottlenecks(depth):
    builder = getattr(models, f"resnet{depth}")
    theirs = builder(weights=None, replace_stride_with_dilation=[False, True, True])
    ours = builder(weights=None)
    dilate_stage(ours.layer3, 1, 2)
    dilate_stage(ours.layer4, 2, 4)
    convs = [(m.stride, m.dilation, m.padding) for m in ours.modules() if isinstance(m, nn.Conv2d)]
    assert convs == [(m.stride, m.dilation, m.padding) for m in theirs.modules() if isinstance(m, nn.Conv2d)]


def test_dilate_stage_on_basic_blocks():
    net = models.resnet18(weights=None)
    dilate_stage(net.layer3, 1, 2)
    dilate_stage(net.layer4, 2, 4)
    first, second = net.layer4
    # The formerly strided convolution reads the previous (dilation 2) lattice; the rest the new one.
    assert (first.conv1.stride, first.conv1.dilation, first.conv1.padding) == ((1, 1), (2, 2), (2, 2))
    assert (first.conv2.dilation, second.conv1.dilation, second.conv2.dilation) == ((4, 4),) * 3
    assert first.downsample[0].stride == (1, 1)
    assert net.layer3[0].conv1.dilation == (1, 1) and net.layer3[0].conv2.dilation == (2, 2)


def test_pspnet_r50_parameter_count():
    # Backbone without fc + 4 pyramid levels (2048 -> 512) + head (4096 -> 512, 3x3) + aux (1024 -> 256, 3x3).
    c = 11
    ppm = 4 * (2048 * 512 + 2 * 512)
    head = 4096 * 512 * 9 + 2 * 512 + 512 * c + c
    aux = 1024 * 256 * 9 + 2 * 256 + 256 * c + c
    assert num_params(PSPNet(c, backbone="resnet50")) == 23_508_032 + ppm + head + aux == 48_950_102


def test_pspnet_in_channels_and_bad_arguments():
    assert cheap_pspnet(in_channels=1).eval()(torch.randn(1, 1, 32, 32)).shape == (1, 5, 32, 32)
    with pytest.raises(ValueError, match="backbone"):
        PSPNet(backbone="resnet152")
    with pytest.raises(ValueError, match="output_stride"):
        PSPNet(backbone="resnet18", output_stride=4)
    with pytest.raises(ValueError, match="dropout"):
        PSPNet(backbone="resnet18", dropout=1.0)


@pytest.mark.parametrize("name", sorted(p.stem for p in MODEL_CONFIGS.glob("*.yaml")))
@torch.no_grad()
def test_every_model_config_builds_and_runs(name):
    model = hydra.utils.instantiate(OmegaConf.load(MODEL_CONFIGS / f"{name}.yaml"), num_classes=10, in_channels=3)
    out = model.eval()(torch.randn(1, 3, 32, 32))
    assert out.shape == ((1, 10, 32, 32) if isinstance(model, PSPNet) else (1, 10))


# --- SemanticSegmenter --------------------------------------------------------------------------------------


def test_pixel_cross_entropy_ignores_void_and_survives_an_all_void_crop():
    logits = torch.randn(2, 4, 3, 5, requires_grad=True)
    target = torch.randint(0, 4, (2, 3, 5))
    target[0, 0] = 255
    torch.testing.assert_close(pixel_cross_entropy(logits, target), F.cross_entropy(logits, target, ignore_index=255))
    void = torch.full_like(target, 255)
    assert F.cross_entropy(logits, void, ignore_index=255).isnan()
    loss = pixel_cross_entropy(logits, void)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_split_logits():
    main, aux = torch.zeros(1), torch.ones(1)
    assert split_logits(main) == (main, None)
    assert split_logits(PSPNetOutput(main, aux)) == (main, aux)
    assert split_logits({"out": main, "aux": aux}) == (main, aux)
    assert split_logits({"out": main}) == (main, None)


class _FixedOutputs(nn.Module):
    """Returns fixed (main, aux) logits, whatever the input; one parameter so an optimizer can be built."""

    def __init__(self, main: torch.Tensor, aux: torch.Tensor) -> None:
        super().__init__()
        self.main, self.aux = main, aux
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> PSPNetOutput:
        return PSPNetOutput(self.scale * self.main, self.scale * self.aux)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
@pytest.mark.parametrize("aux_weight", [0.4, 0.0])
def test_training_loss_adds_the_weighted_aux_loss(aux_weight):
    main, aux = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    masks = torch.randint(0, 3, (2, 4, 4))
    masks[1, :2] = 255
    module = SemanticSegmenter(
        _FixedOutputs(main, aux), 3, optimizer=partial(torch.optim.SGD, lr=0.1), aux_weight=aux_weight
    )
    loss = module.training_step((torch.zeros(2, 3, 4, 4), masks), 0)
    ce = partial(F.cross_entropy, target=masks, ignore_index=255)
    expected = ce(main) + aux_weight * ce(aux)
    torch.testing.assert_close(loss, expected)


def _one_hot_logits(preds: list[int], num_classes: int) -> torch.Tensor:
    """(1, C, 2, 4) logits whose argmax is ``preds`` (row-major over the 2x4 image)."""
    return (10.0 * F.one_hot(torch.tensor(preds), num_classes).T.float()).reshape(1, num_classes, 2, 4)


@pytest.mark.parametrize("void", [255, 4])  # 4 == num_classes: CamVid's convention (11 classes, void 11)
def test_validation_metrics_on_a_hand_made_prediction(tmp_path, void):
    # Two 2x4 images of 4 classes scored as one set. 255 marks void (written as `void`): its pixels
    # count nowhere, whatever is predicted there. Class 1 is absent from the second image's labels;
    # class 2 is predicted once but never labelled (IoU 0, counted); class 3 appears nowhere (left
    # out of the mean).
    targets = [[0, 0, 1, 255, 1, 1, 0, 255], [0, 0, 0, 0, 255, 255, 0, 0]]
    preds = [[0, 1, 1, 2, 1, 1, 0, 0], [0, 0, 2, 0, 1, 1, 0, 0]]
    # Labelled pixels: 6 + 6, correct: 5 + 5.
    # Class 0: TP 2 + 5, FN 1 + 1 (predicted 1, predicted 2), FP 0        -> IoU 7/9
    # Class 1: TP 3,     FN 0,                FP 1 (a 0 predicted as 1)  -> IoU 3/4
    # Class 2: TP 0,     FN 0,                FP 1 (a 0 predicted as 2)  -> IoU 0
    expected_miou = (7 / 9 + 3 / 4 + 0) / 3
    expected_pixel_acc = 10 / 12
    images = torch.cat([_one_hot_logits(p, 4) for p in preds])
    masks = torch.tensor(targets).reshape(2, 2, 4)
    masks[masks == 255] = void
    module = SemanticSegmenter(
        nn.Identity(), num_classes=4, optimizer=partial(torch.optim.SGD, lr=0.1), ignore_index=void
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    (metrics,) = trainer.validate(module, DataLoader(TensorDataset(images, masks), batch_size=1))

    assert metrics["val/mIoU"] == pytest.approx(expected_miou, abs=1e-6)
    assert metrics["val/pixel_acc"] == pytest.approx(expected_pixel_acc, abs=1e-6)
    # One wrong labelled pixel of six in each image, each costing log(e^10 + 3) nats.
    wrong, right = math.log(math.exp(10) + 3), math.log(math.exp(10) + 3) - 10
    assert metrics["val/loss"] == pytest.approx((wrong + 5 * right) / 6, rel=1e-5)


def test_one_training_step_with_lightning(tmp_path):
    torch.manual_seed(0)
    num_classes = 5
    images = torch.randn(4, 3, 48, 64)
    masks = torch.randint(0, num_classes, (4, 48, 64))
    masks[:, :8] = 255
    loader = DataLoader(TensorDataset(images, masks), batch_size=2)
    model = cheap_pspnet(num_classes)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    module = SemanticSegmenter(model, num_classes, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    trainer = pl.Trainer(
        fast_dev_run=True,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)

    assert trainer.global_step == 1
    metrics = trainer.callback_metrics
    assert math.isfinite(metrics["train/loss"]) and metrics["train/loss"] > 0
    assert math.isfinite(metrics["val/loss"])
    assert 0.0 <= metrics["val/mIoU"] <= 1.0 and 0.0 <= metrics["val/pixel_acc"] <= 1.0
    # The optimizer step reached the backbone, the pyramid head and the auxiliary head.
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    for prefix in ("backbone.conv1", "backbone.layer4", "ppm", "head", "aux_head"):
        assert any(name.startswith(prefix) for name in changed), prefix


@pytest.mark.parametrize("backbone", ["resnet18", "resnet50"])
def test_a_narrow_backbone_at_width_64_has_torchvisions_every_parameter_shape(backbone):
    # The narrow builder is torchvision's ResNet with another stem width: at 64 the same modules.
    from lgc.models.pspnet import _LAYOUTS, _NarrowResNet

    narrow = _NarrowResNet(*_LAYOUTS[backbone], 64)
    theirs = getattr(models, backbone)(weights=None)
    shapes = {name: p.shape for name, p in theirs.state_dict().items() if not name.startswith("fc.")}
    assert {name: p.shape for name, p in narrow.state_dict().items()} == shapes


@pytest.mark.parametrize("backbone", ["resnet18", "resnet50"])
@torch.no_grad()
def test_a_narrow_dilated_backbone_is_its_plain_self_without_subsampling(backbone):
    from lgc.models.pspnet import _LAYOUTS, _NarrowResNet

    model = PSPNet(num_classes=3, backbone=backbone, width=8, head_channels=16, aux_channels=8).eval()
    plain = _NarrowResNet(*_LAYOUTS[backbone], 8).eval()
    plain.load_state_dict(model.backbone.state_dict())
    x = torch.randn(1, 3, 64, 64)
    c3, dilated = model.features(x)
    expansion = 4 if backbone == "resnet50" else 1
    assert c3.shape == (1, 32 * expansion, 8, 8) and dilated.shape == (1, 64 * expansion, 8, 8)
    torch.testing.assert_close(dilated[..., ::4, ::4], _plain_features(plain, x), rtol=1e-4, atol=1e-4)


def test_pspnet_small_is_the_documented_size_and_trains_every_parameter():
    # conf/model/pspnet_small.yaml on the Fashion scenes: 1 channel, 11 labels.
    model = PSPNet(11, in_channels=1, backbone="resnet18", width=16, head_channels=64, aux_channels=32)
    assert num_params(model) == 884_326
    main, aux = model(torch.randn(2, 1, 64, 64))
    (main.sum() + aux.sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with pytest.raises(ValueError, match="width must be a positive number of channels, got 0"):
        PSPNet(3, width=0)
