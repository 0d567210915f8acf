"""On a CUDA device: the example's fast recipe trains, and a training step never makes the host wait for the GPU.

Skipped where there is no CUDA device (this project's CI machine). On CPU the same property is checked by
counting host reads at the dispatcher (tests/fashion_mnist/test_speed_options.py); here CUDA itself reports every
synchronising call (``torch.cuda.set_sync_debug_mode("error")`` turns each into an exception).
"""

import csv

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from app.callbacks import ProgressBar
from tests.conftest import CPU_TEST_CONFIG
from tests.fashion_mnist.conftest import run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class NoSyncInSteps(Callback):
    """Every CUDA synchronisation from the start of batch 2 to the start of the second-to-last batch raises, but the
    progress bar's one read per redraw (at most every 0.5 s, by design: docs/benchmarks.md). The bar stays on, so
    that its work at every step is checked; its redraws come at times, not steps, and made the test flaky."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        for bar in trainer.callbacks:
            if isinstance(bar, ProgressBar):
                bar.get_metrics = _sync_allowed(bar.get_metrics)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        inside = 2 <= batch_idx < trainer.num_training_batches - 2
        torch.cuda.set_sync_debug_mode("error" if inside else "default")

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode("default")


def _sync_allowed(read):
    def allowed(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return read(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    return allowed


def _fit(data_dir, *args: str) -> list[dict]:
    run_cli(
        "fit", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}", "--trainer.accelerator=gpu",
        "--trainer.precision=bf16-mixed", "--model.channels_last=true", "--data.augment=true",
        "--data.batch_size=64", "--trainer.max_epochs=1", "--trainer.limit_train_batches=12",
        "--trainer.log_every_n_steps=1000", "--trainer.enable_progress_bar=true", *args,
    )  # fmt: skip
    with open("lightning_logs/version_0/metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    ("strategy", "compiled"), [("auto", False), ("dp", False), ("ddp", False), ("auto", True), ("ddp", True)]
)
def test_no_cuda_sync_inside_training_steps(workdir, data_dir, strategy, compiled):
    """Compiled with CUDA graphs too: a graph re-recorded at every step (issue 44) synchronises, and fails here."""
    _fit_without_sync(data_dir, strategy, compiled)


@pytest.mark.parametrize("compiled", [False, True])
def test_no_cuda_sync_inside_training_steps_with_the_training_set_on_the_device(workdir, data_dir, compiled):
    """``--data.on_device=true``: the epoch's order copied once, batches and augmentation's random numbers drawn on
    the GPU."""
    _fit_without_sync(data_dir, "auto", compiled, "--data.on_device=true")


def _fit_without_sync(data_dir, strategy: str, compiled: bool, *args: str) -> None:
    compile_flags = ["--model.compile=true", "--model.compile_mode=reduce-overhead"] if compiled else []
    rows = _fit(
        data_dir,
        f"--trainer.strategy={strategy}",
        "--trainer.devices=1",
        "--trainer.callbacks+=tests.fashion_mnist.test_gpu_recipe.NoSyncInSteps",
        *compile_flags,
        *args,
    )
    assert any(r.get("train/acc") for r in rows)  # the epoch finished and logged


def test_compiled_recipe_trains(workdir, data_dir):
    rows = _fit(data_dir, "--model.compile=true", "--trainer.log_every_n_steps=1", "--trainer.limit_train_batches=40")
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])


class RecordBackend(Callback):
    """Writes the process group's backend to ./backend.txt when training starts."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            with open("backend.txt", "w") as f:
                f.write(torch.distributed.get_backend())


def _pipeline_schedules_missing() -> bool:
    from app.errors import UserError
    from app.strategies.pipeline import check_torch_schedules

    try:
        check_torch_schedules()
    except UserError:
        return True
    return False


needs_pipeline_schedules = pytest.mark.skipif(
    _pipeline_schedules_missing(), reason=f"torch {torch.__version__}'s pipeline schedules take no split microbatches"
)


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("pipeline", marks=needs_pipeline_schedules)])
def test_fsdp_and_a_one_stage_pipeline_train_over_nccl_on_one_gpu(workdir, data_dir, strategy):
    """Both strategies' collectives over NCCL (the CPU suite runs them over gloo): 12 finite steps, a checkpoint
    with the whole model in it."""
    _fit_12_finite_steps(data_dir, strategy, "--trainer.callbacks+=tests.fashion_mnist.test_gpu_recipe.RecordBackend")
    with open("backend.txt") as f:
        assert f.read() == "nccl"
    checkpoint = torch.load("lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    weights = checkpoint["state_dict"]  # the whole network, gathered from its shards or stages
    assert len(weights) == 74 and weights["net.fc.weight"].shape == (10, 128)  # resnet_tiny


@pytest.mark.parametrize("strategy", ["dp", "horovod"])
def test_16_mixed_trains_with_a_gradient_scaler(workdir, data_dir, strategy):
    """16-mixed on CUDA: Lightning's GradScaler scales the loss; with dp and horovod (mpi backend, nccl) the run
    trains and the scaler's state is in the checkpoint."""
    _fit_12_finite_steps(data_dir, strategy, "--trainer.precision=16-mixed")
    checkpoint = torch.load("lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert "MixedPrecision" in checkpoint and checkpoint["MixedPrecision"]["scale"] > 0


def _fit_12_finite_steps(data_dir, strategy: str, *args: str) -> None:
    rows = _fit(
        data_dir, f"--trainer.strategy={strategy}", "--trainer.devices=1", "--trainer.log_every_n_steps=1", *args
    )
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 12 and all(loss == loss for loss in losses)  # finite, not NaN
