import pytest
import torch
import torchvision

from app.errors import UserError
from app.fashion_mnist.networks import ARCHS, build_resnet


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_takes_28x28_grayscale(arch):
    net = build_resnet(arch, num_classes=10).eval()
    assert net.conv1.in_channels == 1 and net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    if arch == "resnet_mini":  # the quickstart's: its stages start at 14x14
        assert isinstance(net.maxpool, torch.nn.MaxPool2d) and net.maxpool.kernel_size == 2
    else:  # d2l's stem: the stages start at 28x28
        assert isinstance(net.maxpool, torch.nn.Identity)
    with torch.no_grad():
        assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_resnet18_matches_d2l_cost():
    """d2l's ResNet-18 at 28x28x1: about 0.46 G multiply-adds (0.91 GFLOP) per image forward."""
    from torch.utils.flop_counter import FlopCounterMode

    net = build_resnet("resnet18").eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(torch.zeros(1, 1, 28, 28))
    assert 0.85e9 < counter.get_total_flops() < 0.95e9


def test_tiny_is_small_and_group_norm_has_no_batchnorm():
    tiny = build_resnet("resnet_tiny", norm="group")
    assert sum(p.numel() for p in tiny.parameters()) < 400_000
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in tiny.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in tiny.modules())


def test_mini_is_tiny_at_a_quarter_of_the_pixels():
    """resnet_mini has resnet_tiny's weights, at about 1/4 of its compute: a quickstart that sees more images."""
    from torch.utils.flop_counter import FlopCounterMode

    flops = {}
    for arch in ("resnet_tiny", "resnet_mini"):
        net = build_resnet(arch).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            net(torch.zeros(1, 1, 28, 28))
        flops[arch] = counter.get_total_flops()
        shapes = {name: tuple(t.shape) for name, t in net.state_dict().items()}
        if arch == "resnet_tiny":
            tiny_shapes = shapes
    assert shapes == tiny_shapes
    assert 0.2 < flops["resnet_mini"] / flops["resnet_tiny"] < 0.35


@pytest.mark.parametrize("arch", ["resnet18", "resnet50", "resnet_mini"])
def test_the_pipeline_layers_compose_to_the_forward(arch):
    """What --trainer.strategy=pipeline deals to its stages (app/strategies/pipeline.py's layers_of reads them)."""
    from torch import nn

    from app.strategies.pipeline_stages import layers_of

    net = build_resnet(arch).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(nn.Sequential(*layers_of(net))(x), net(x), rtol=0, atol=0)
    assert layers_of(net)[-1] is net.fc and layers_of(net) == layers_of(net)  # the same modules every time
    assert isinstance(net, torchvision.models.ResNet)  # torchvision's, with the same names and weights


def test_unknown_arch_names_the_flag():
    with pytest.raises(UserError, match="--model.arch='resnet9'"):
        build_resnet("resnet9")
