"""channels_last and compile: same results, same checkpoints; the progress bar's cost; the benchmark's pieces."""

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from app.callbacks import ProgressBar
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


class _CountingBar(ProgressBar):
    """Counts the reads of the progress-bar metrics (each one waits for the GPU when a logged tensor is shown)."""

    reads = 0

    def get_metrics(self, trainer, pl_module):
        self.reads += 1
        return super().get_metrics(trainer, pl_module)


def _fit_with_bar(bar: ProgressBar, root) -> None:
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=8,
        limit_val_batches=0,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(BoringModel())


def test_progress_bar_reads_metrics_at_most_every_refresh_seconds_and_ends_full(tmp_path):
    every, throttled = _CountingBar(refresh_seconds=0), _CountingBar(refresh_seconds=3600)
    _fit_with_bar(every, tmp_path)
    _fit_with_bar(throttled, tmp_path)
    assert every.reads - throttled.reads == 6  # Lightning's behaviour: all 8 batches; throttled: the first and last
    assert throttled.progress.tasks[throttled.train_progress_bar_id].completed == 8
    with pytest.raises(ValueError, match="refresh_seconds must be >= 0"):
        ProgressBar(refresh_seconds=-1)
