"""ResNets for 28x28 grayscale images, built from torchvision's ResNet.

d2l's multi-GPU chapter adapts ResNet-18 to Fashion-MNIST by replacing the 7x7 stride-2 stem and its max-pool
with one 3x3 stride-1 convolution on a single input channel, so the 28x28 image is not shrunk to 7x7 before
the first residual stage. We do exactly that to torchvision's builders instead of hand-writing the blocks.
"""

from __future__ import annotations

import math
from typing import Literal

from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from app.errors import UserError

Arch = Literal["resnet18", "resnet34", "resnet50", "resnet_tiny", "resnet_mini"]
Norm = Literal["batch", "group"]

ARCHS: tuple[str, ...] = Arch.__args__
_LAYOUTS = {  # torchvision's resnet18/34/50: the block and the blocks per stage
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}
_FLATTEN = nn.Flatten(1)  # ResNet.forward's torch.flatten(x, 1) as a layer: stateless, so one serves every network


class FashionResNet(ResNet):
    """torchvision's ResNet (the same weights, names and forward), which also lists its layers in the order its
    forward runs them: ``--trainer.strategy=pipeline`` deals them to the stages (app/strategies/pipeline.py)."""

    def pipeline_layers(self) -> list[nn.Module]:
        blocks = [block for stage in (self.layer1, self.layer2, self.layer3, self.layer4) for block in stage]
        return [self.conv1, self.bn1, self.relu, self.maxpool, *blocks, self.avgpool, _FLATTEN, self.fc]


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(32, channels), channels)


def build_resnet(arch: Arch = "resnet18", num_classes: int = 10, in_channels: int = 1, norm: Norm = "batch") -> ResNet:
    """Build a torchvision ResNet with d2l's small-image stem (3x3 stride-1 conv, no max-pool).

    ``resnet_tiny`` is a one-block-per-stage ResNet of width 16 (about 1/40 of resnet18's compute), meant for
    CPU tests and smoke runs. ``resnet_mini`` is resnet_tiny with the 2x2 max-pool kept after the stem, so its
    stages see 14x14 to 2x2 images: 2.5x faster to train on a CPU, the quickstart's network (0.91 test accuracy on
    Fashion-MNIST after two epochs). ``norm="group"`` swaps BatchNorm for GroupNorm (no batch-statistics coupling).
    """
    if arch not in ARCHS:
        raise UserError(f"--model.arch={arch!r} is not one of {', '.join(ARCHS)}")
    if norm not in ("batch", "group"):
        raise UserError(f"--model.norm={norm!r} must be 'batch' or 'group'")
    norm_layer = nn.BatchNorm2d if norm == "batch" else _group_norm

    if arch in ("resnet_tiny", "resnet_mini"):
        net = _tiny_resnet(num_classes, norm_layer)
        width = 16
    else:
        net = FashionResNet(*_LAYOUTS[arch], num_classes=num_classes, norm_layer=norm_layer)
        width = 64
    net.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.MaxPool2d(2) if arch == "resnet_mini" else nn.Identity()
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    return net


def _tiny_resnet(num_classes: int, norm_layer) -> ResNet:
    """torchvision's ResNet with BasicBlocks, one per stage, at widths 16-32-64-128."""
    net = FashionResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes, norm_layer=norm_layer)
    widths = (16, 32, 64, 128)
    net.inplanes = widths[0]
    net.bn1 = norm_layer(widths[0])
    for i, width in enumerate(widths):
        setattr(net, f"layer{i + 1}", net._make_layer(BasicBlock, width, 1, stride=1 if i == 0 else 2))
    net.fc = nn.Linear(widths[-1], num_classes)
    for m in net.modules():  # the same initialisation torchvision's ResNet.__init__ applies
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    return net
