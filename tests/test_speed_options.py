"""channels_last and compile: same results, same checkpoints; the benchmark's pieces."""

import pytest
import torch
from lightning.pytorch import Trainer

from app.errors import UserError
from app.model import ImageClassifier
from bench.__main__ import flops_per_image


def test_channels_last_gives_the_same_outputs_and_checkpoint_keys():
    torch.manual_seed(0)
    plain = ImageClassifier(arch="resnet_tiny")
    nhwc = ImageClassifier(arch="resnet_tiny", channels_last=True)
    nhwc.load_state_dict(plain.state_dict())
    nhwc.configure_model()
    assert nhwc.net.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert nhwc.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(nhwc.eval()(x), plain.eval()(x), atol=1e-5, rtol=1e-5)


def test_compile_keeps_parameter_names_and_refuses_dp():
    model = ImageClassifier(arch="resnet_tiny", compile=True)
    keys = model.state_dict().keys()
    model.trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    model.configure_model()
    assert model.state_dict().keys() == keys  # nn.Module.compile compiles in place: checkpoints are unchanged
    dp = ImageClassifier(arch="resnet_tiny", compile=True)
    dp.trainer = Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(UserError, match="--model.compile=true does not work with --trainer.strategy=dp"):
        dp.configure_model()


def test_flop_count_of_d2l_resnet18_matches_the_paper_figure():
    """0.91 GFLOP forward per 28x28 image (455.8 M multiply-adds), ~3x that to train."""
    per_image = flops_per_image("resnet18")
    assert 2.6e9 < per_image < 2.8e9, per_image
