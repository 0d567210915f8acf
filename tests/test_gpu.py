"""On a CUDA device: the machinery's CUDA paths (dp's replicas under autocast, Adasum's fixed summation order, horovod
ranks each bound to a GPU of their own, a dropout model's exact resume with CUDA's generators).

Skipped where there is no CUDA device (this project's CI machine). The example task's fast recipe on a GPU:
tests/fashion_mnist/test_gpu_recipe.py.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY_CONFIG
from tests.parity import MPI_ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


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


def test_adasum_on_cuda_is_the_same_every_time_and_for_both_partners():
    """index_add_ adds with atomics on CUDA (an order that changes from call to call): the per-tensor sums of an
    Adasum exchange now reduce each tensor in a fixed order, so partners (who compute Adasum(lower, higher) each on
    their own) round alike and replicas do not drift (issue 35, item 14)."""
    from app.strategies.reductions import adasum, segment_index

    torch.manual_seed(0)
    sizes = [64 * 3 * 3 * 3, 64, 512 * 512 * 9, 10]  # a large tensor: many blocks, where atomics reorder
    a, b = (torch.randn(sum(sizes), device="cuda") for _ in range(2))
    segment = segment_index(sizes, a.device)
    first = adasum(a, b, sizes, segment)
    assert all(torch.equal(adasum(a, b, sizes, segment), first) for _ in range(20))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one for each rank)")
def test_horovod_ranks_each_given_a_gpu_of_their_own_train_on_it(tmp_path):
    """mpirun with each rank's CUDA_VISIBLE_DEVICES set to one GPU, as SLURM's --gpus-per-task=1 sets it: every
    rank sees one GPU and trains on it (no setting ran before: issue 35, item 7). cli.py from another folder."""
    bind = f"CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec {sys.executable} {ROOT / 'cli.py'} fit"
    flags = (
        f"--config {TINY_CONFIG} --trainer.accelerator=gpu --trainer.strategy=horovod --trainer.max_epochs=1 "
        f"--trainer.default_root_dir={tmp_path / 'runs'}"
    )
    mpirun = Path(sys.executable).parent / "mpirun"
    result = subprocess.run(
        [str(mpirun), "-np", "2", "--oversubscribe", "sh", "-c", f"{bind} {flags}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, **MPI_ENV},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"horovod strategy: 2 ranks", result.stdout + result.stderr)
    assert (tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_a_dropout_model_stopped_mid_epoch_on_the_gpu_resumes_bitwise_an_unbroken_run(tmp_path):
    """The CUDA generators are seeded at every batch too (app/checkpoints/generators.py): dropout on the GPU draws
    from them, so a run stopped after step 5 and resumed ends with the weights of an unbroken run, bit for bit
    (deterministic kernels). Without the RandomState callback the same stop and resume ends elsewhere: the comparison
    can fail."""
    from tests.test_reliability import DROPOUT, assert_same_weights, fit, last_ckpt, stop_and_resume, versions

    run = (*DROPOUT, "--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.deterministic=true")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs (restored after)
    (tmp_path / "unbroken").mkdir()
    unbroken = fit(tmp_path / "unbroken", *run)
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    [expected] = versions(tmp_path / "unbroken")
    resumed = stop_and_resume(tmp_path / "stopped", run, run)
    assert_same_weights(last_ckpt(resumed), last_ckpt(expected))
    without = stop_and_resume(tmp_path / "without", (*run, "--drop_callbacks=[RandomState]"), run)
    weights = last_ckpt(without)["state_dict"]["net.head.weight"]
    assert not torch.equal(weights, last_ckpt(expected)["state_dict"]["net.head.weight"])
