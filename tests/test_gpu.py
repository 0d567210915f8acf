"""On a CUDA device: the fast recipe trains, and a training step never makes the host wait for the GPU.

Skipped where there is no CUDA device (this project's CI machine). On CPU the same property is checked by
counting host reads at the dispatcher (tests/test_speed_options.py); here CUDA itself reports every synchronising
call (``torch.cuda.set_sync_debug_mode("error")`` turns each into an exception).
"""

import csv

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.conftest import CPU_TEST_CONFIG, run_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class NoSyncInSteps(Callback):
    """Every CUDA synchronisation from the start of batch 2 to the start of the second-to-last batch raises."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        inside = 2 <= batch_idx < trainer.num_training_batches - 2
        torch.cuda.set_sync_debug_mode("error" if inside else "default")

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.set_sync_debug_mode("default")


def _fit(data_dir, *args: str) -> list[dict]:
    run_cli(
        "fit", "--config", str(CPU_TEST_CONFIG), f"--data.data_dir={data_dir}", "--trainer.accelerator=gpu",
        "--trainer.precision=bf16-mixed", "--model.channels_last=true", "--data.augment=true",
        "--data.batch_size=64", "--trainer.max_epochs=1", "--trainer.limit_train_batches=12",
        "--trainer.log_every_n_steps=1000", "--trainer.enable_progress_bar=true", *args,
    )  # fmt: skip
    with open("lightning_logs/version_0/metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("strategy", ["auto", "dp", "ddp"])
def test_no_cuda_sync_inside_training_steps(workdir, data_dir, strategy):
    rows = _fit(
        data_dir,
        f"--trainer.strategy={strategy}",
        "--trainer.devices=1",
        "--trainer.callbacks+=tests.test_gpu.NoSyncInSteps",
    )
    assert any(r.get("train/acc") for r in rows)  # the epoch finished and logged


def test_compiled_recipe_trains(workdir, data_dir):
    rows = _fit(data_dir, "--model.compile=true", "--trainer.log_every_n_steps=1", "--trainer.limit_train_batches=40")
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])


def test_dp_replicas_compute_in_the_precision_dtype():
    """Two replicas on the one GPU, run as the dp strategy runs them: under bf16-mixed both compute in bfloat16.
    torch's own parallel_apply re-enters autocast with CUDA's default dtype (float16): app/strategies/dp.py's
    ``in_context`` is why the replicas get bfloat16."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.nn.parallel import parallel_apply, replicate

    from app.strategies.dp import in_context

    plugin = MixedPrecision("bf16-mixed", device="cuda")
    replicas = replicate(torch.nn.Linear(8, 8).cuda(), [0, 0])
    inputs = [(torch.randn(4, 8, device="cuda"),)] * 2
    with plugin.train_step_context():
        ours = parallel_apply([in_context(r, plugin.train_step_context) for r in replicas], inputs, devices=[0, 0])
        torchs = parallel_apply(replicas, inputs, devices=[0, 0])
    assert [out.dtype for out in ours] == [torch.bfloat16] * 2
    assert [out.dtype for out in torchs] == [torch.float16] * 2  # if torch keeps the dtype one day, say so here


@pytest.mark.parametrize("strategy", ["dp", "horovod"])
def test_16_mixed_trains_with_a_gradient_scaler(workdir, data_dir, strategy):
    """16-mixed on CUDA: Lightning's GradScaler scales the loss; with dp and horovod (mpi backend, nccl) the run
    trains and the scaler's state is in the checkpoint."""
    rows = _fit(
        data_dir,
        f"--trainer.strategy={strategy}",
        "--trainer.devices=1",
        "--trainer.precision=16-mixed",
        "--trainer.log_every_n_steps=1",
    )
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 12 and all(loss == loss for loss in losses)  # finite, not NaN
    checkpoint = torch.load("lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert "MixedPrecision" in checkpoint and checkpoint["MixedPrecision"]["scale"] > 0


def test_adasum_on_cuda_is_the_same_every_time_and_for_both_partners():
    """index_add_ adds with atomics on CUDA (an order that changes from call to call): the per-tensor sums of an
    Adasum exchange now reduce each tensor in a fixed order, so partners (who compute Adasum(lower, higher) each on
    their own) round alike and replicas do not drift (issue 35, item 14)."""
    from app.reductions import adasum, segment_index

    torch.manual_seed(0)
    sizes = [64 * 3 * 3 * 3, 64, 512 * 512 * 9, 10]  # a large tensor: many blocks, where atomics reorder
    a, b = (torch.randn(sum(sizes), device="cuda") for _ in range(2))
    segment = segment_index(sizes, a.device)
    first = adasum(a, b, sizes, segment)
    assert all(torch.equal(adasum(a, b, sizes, segment), first) for _ in range(20))
