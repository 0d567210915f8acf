"""Model parallelism: ``fsdp`` (sharded data parallel) as users run it, through cli.py from another folder.

Its parity with one device is in tests/test_strategies.py (with the other strategies' cases); here its checkpoints:
one full state dict that every other strategy loads and that resumes exactly, also at another world size, after a
preemption, and from another strategy's checkpoint. The runs train in float64 with a batch-independent norm, so an
exact resume means equal weights up to summation order (relative error < 1e-10, tests/parity.py).
"""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from app.callbacks import DDPCommHook
from app.errors import UserError
from app.strategies import FSDPStrategy, PipelineStrategy
from app.strategies.pipeline_stages import PipelineStages, balanced, layers_of, network_of
from app.task import match_modules
from tests import warm
from tests.conftest import ROOT, TINY_CONFIG
from tests.parity import LAUNCHES, REFERENCE, TOLERANCE, relative_error

EXACT = ("--trainer.precision=64-true", "--model.norm=group", "--trainer.max_epochs=2")
EXACT += ("--data.train_size=64", "--data.batch_size=4")  # 8 steps an epoch on 2 devices


def fit(root: Path, cwd: Path, *args: str, subcommand: str = "fit") -> str:
    """cli.py run in ``cwd`` (not the run's root); returns its output. Fails on a non-zero exit unless 143."""
    result = warm.run(
        [sys.executable, str(ROOT / "cli.py"), subcommand, "--config", str(TINY_CONFIG), *EXACT]
        + [f"--trainer.default_root_dir={root}", "--trainer.limit_train_batches=null", *args],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode in (0, 143), output[-4000:]
    return output


def last(root: Path, version: int) -> dict:
    return torch.load(root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.fixture(scope="module")
def fsdp_unbroken(tmp_path_factory) -> dict:
    """Two epochs of fsdp on 2 processes, unbroken: the run every other one here must end equal to."""
    root, cwd = tmp_path_factory.mktemp("fsdp_unbroken"), tmp_path_factory.mktemp("cwd")
    output = fit(root, cwd, "--trainer.strategy=fsdp", "--trainer.devices=2")
    assert "2 x cpu (fsdp)" in output
    return {"root": root, "checkpoint": last(root, 0)}


@pytest.mark.slow
def test_an_fsdp_checkpoint_is_one_full_state_dict_that_other_strategies_load(fsdp_unbroken, tmp_path):
    checkpoint = fsdp_unbroken["checkpoint"]  # torch.load(weights_only=True) took it: plain tensors, no DTensor
    weights = checkpoint["state_dict"]
    assert all(type(t) is torch.Tensor and t.dtype == torch.float64 for t in weights.values())
    from tests.tiny import TinyClassifier

    expected = TinyClassifier(norm="group").state_dict()
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in expected.items()}  # full, not shards
    # the optimizer's state as optimizer.state_dict() numbers it: a momentum buffer for every parameter
    [optimizer] = checkpoint["optimizer_states"]
    parameters = [p for p in expected if not p.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert [i for g in optimizer["param_groups"] for i in g["params"]] == list(range(len(parameters)))
    assert sorted(optimizer["state"]) == list(range(len(parameters)))
    assert all(optimizer["state"][i]["momentum_buffer"].shape == expected[p].shape for i, p in enumerate(parameters))

    ckpt = str(fsdp_unbroken["root"] / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    metrics = {}
    for strategy in ("ddp", "fsdp", "pipeline"):  # evaluated by another strategy, by fsdp itself, by the stages
        output = fit(tmp_path / strategy, tmp_path, f"--trainer.strategy={strategy}", "--trainer.devices=2",
                     f"--ckpt_path={ckpt}", subcommand="test")  # fmt: skip
        metrics[strategy] = re.search(r"test/acc\s*│\s*([\d.]+)", output)[1]  # Lightning's results table
    assert metrics["ddp"] == metrics["fsdp"] == metrics["pipeline"], metrics


@pytest.mark.slow
def test_an_fsdp_run_stopped_mid_epoch_resumes_exactly_on_one_device(fsdp_unbroken, tmp_path):
    """SIGTERM on rank 1 after step 3 of 8 in epoch 0 (the ranks stop together a step or two later): every rank
    takes part in gathering the state, rank 0 writes it; resumed on one device (accumulate 2 keeps the global
    batch) the run ends at the unbroken run's weights."""
    root = tmp_path / "runs"
    stop = {"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": 3, "rank": 1}}
    output = fit(root, tmp_path, "--trainer.strategy=fsdp", "--trainer.devices=2",
                 "--trainer.callbacks+=" + json.dumps(stop))  # fmt: skip
    stopped = re.search(r"SIGTERM: stopped after step (\d+) \(epoch 0\)", output)  # when the ranks agree on it
    assert stopped and 3 <= int(stopped[1]) < 8, output[-3000:]
    assert last(root, 0)["global_step"] == int(stopped[1])
    output = fit(root, tmp_path, "--trainer.devices=1", "--ckpt_path=last")
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch" in output, output[-3000:]
    resumed = last(root, 1)
    assert resumed["global_step"] == fsdp_unbroken["checkpoint"]["global_step"]
    assert relative_error(resumed, fsdp_unbroken["checkpoint"]) < TOLERANCE


def consolidated(root: Path, version: int, cwd: Path) -> dict:
    """``cli.py consolidate`` of a run's sharded last.ckpt: the file it writes, loaded."""
    folder = root / "lightning_logs" / f"version_{version}" / "checkpoints"
    result = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "consolidate", str(folder / "last.ckpt")],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(folder / "last.full.ckpt", weights_only=True)


@pytest.mark.slow
def test_an_fsdp_sharded_checkpoint_is_each_ranks_pieces_resumes_at_2_and_1_ranks_and_consolidates(
    fsdp_unbroken, tmp_path
):
    """``--trainer.strategy.checkpoint=sharded``: last.ckpt is a folder that both ranks wrote their pieces into
    (torch.distributed.checkpoint), with no file holding every parameter; stopped by SIGTERM mid-epoch, it resumes
    at 2 ranks to the unbroken run's weights bitwise and at 1 rank within the float64 tolerance, and the file
    ``cli.py consolidate`` makes of it predicts under ddp as the folder does under fsdp."""
    from torch.distributed.checkpoint import FileSystemReader

    root, sharded = tmp_path / "runs", ("--trainer.strategy=fsdp", "--trainer.strategy.checkpoint=sharded")
    stop = {"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": 3, "rank": 1}}
    output = fit(root, tmp_path, *sharded, "--trainer.devices=2", "--trainer.callbacks+=" + json.dumps(stop))
    held = int(re.search(r"SIGTERM: stopped after step (\d+) \(epoch 0\)", output)[1])
    stopped = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert stopped.is_dir() and {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {p.name for p in stopped.iterdir()}
    index = FileSystemReader(str(stopped)).read_metadata()
    parameters = [key for key in index.state_dict_metadata if key.startswith("state_dict.") and "norm" not in key]
    chunks = [where for where in index.storage_data if where.fqn in parameters]
    files = {index.storage_data[chunk].relative_path for chunk in chunks}
    assert len(files) == 2  # one per rank
    for file in files:  # and each misses the other rank's pieces: no file holds every parameter
        assert any(index.storage_data[chunk].relative_path != file for chunk in chunks), file

    output = fit(root, tmp_path, *sharded, "--trainer.devices=2", "--ckpt_path=last")
    assert f"resuming from {stopped} (step {held})" in output, output[-3000:]
    unbroken = fsdp_unbroken["checkpoint"]
    again = consolidated(root, 1, tmp_path)
    assert again["global_step"] == unbroken["global_step"]
    differ = [k for k in unbroken["state_dict"] if not torch.equal(again["state_dict"][k], unbroken["state_dict"][k])]
    assert not differ, differ

    output = fit(root, tmp_path, *sharded, "--trainer.devices=1", f"--ckpt_path={stopped}")
    assert "2 -> 1 devices: accumulate_grad_batches 1 -> 2 keeps the global batch" in output, output[-3000:]
    on_one = consolidated(root, 2, tmp_path)
    assert on_one["global_step"] == unbroken["global_step"]
    assert relative_error(on_one, unbroken) < TOLERANCE

    full = root / "lightning_logs" / "version_1" / "checkpoints" / "last.full.ckpt"
    fit(tmp_path / "1", tmp_path, *sharded, "--trainer.devices=2", f"--ckpt_path={full.with_name('last.ckpt')}",
        subcommand="predict")  # fmt: skip
    fit(tmp_path / "2", tmp_path, "--trainer.strategy=ddp", "--trainer.devices=2", f"--ckpt_path={full}",
        subcommand="predict")  # fmt: skip
    predictions = [(tmp_path / p / "lightning_logs" / "version_0" / "predictions.csv").read_text() for p in "12"]
    assert predictions[0] == predictions[1] and predictions[0].count("\n") > 1


@pytest.mark.slow
def test_fsdp_background_saves_stop_and_resume_to_the_unbroken_weights(fsdp_unbroken, tmp_path, monkeypatch):
    """``--trainer.strategy.async_save=true``: every rank's saves are written by its background thread while
    training goes on; a SIGTERM's save is in place when the process exits 143, the resume from it ends bitwise on
    the unbroken run's weights, and the resumed run's own saves (each epoch's best and last.ckpt) are in place at its
    end, nothing half-written beside them."""
    from app.checkpoints.sharded import read_sharded

    root, threads = tmp_path / "runs", tmp_path / "threads"
    threads.mkdir()
    monkeypatch.setenv("DCP_THREADS", str(threads))
    sharded = ("--trainer.strategy=fsdp", "--trainer.strategy.checkpoint=sharded", "--trainer.strategy.async_save=true")
    sharded += ("--trainer.callbacks+=tests.dcp_threads.DCPThreads",)
    stop = {"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": 3, "rank": 1}}
    output = fit(root, tmp_path, *sharded, "--trainer.devices=2", "--trainer.callbacks+=" + json.dumps(stop))
    held = int(re.search(r"SIGTERM: stopped after step (\d+) \(epoch 0\)", output)[1])
    stopped = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert read_sharded(stopped)["global_step"] == held

    output = fit(root, tmp_path, *sharded, "--trainer.devices=2", "--ckpt_path=last")
    assert f"resuming from {stopped} (step {held})" in output, output[-3000:]
    folder = root / "lightning_logs" / "version_1" / "checkpoints"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no .partial, no .old
    assert len([p for p in folder.iterdir() if p.name.startswith("epoch=")]) == 1  # the best, the other removed
    unbroken = fsdp_unbroken["checkpoint"]
    again = consolidated(root, 1, tmp_path)
    assert again["global_step"] == unbroken["global_step"]
    differ = [k for k in unbroken["state_dict"] if not torch.equal(again["state_dict"][k], unbroken["state_dict"][k])]
    assert not differ, differ
    for rank in (0, 1):  # the stop's save, each epoch's last.ckpt and any new best: all on the writer's thread
        saves = (threads / f"rank{rank}.txt").read_text().split()
        assert len(saves) >= 3 and set(saves) == {"sharded-save_0"}, saves


def test_async_save_without_sharded_checkpoints_is_one_line():
    with pytest.raises(UserError, match=r"async_save=true writes sharded .*add --trainer.strategy.checkpoint=sharded"):
        FSDPStrategy(async_save=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_a_ddp_checkpoint_resumes_under_model_parallelism_exactly(fsdp_unbroken, tmp_path, strategy):
    """One epoch under ddp, the second under fsdp (the optimizer's momentum goes into the shards) or pipeline (each
    stage takes its layers' part, at the same global batch of 2 x 4): the run ends at the unbroken run's weights."""
    root = tmp_path / "runs"
    fit(root, tmp_path, "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_epochs=1")
    fit(root, tmp_path, f"--trainer.strategy={strategy}", "--trainer.devices=2", "--ckpt_path=last")
    resumed = last(root, 1)
    assert resumed["global_step"] == fsdp_unbroken["checkpoint"]["global_step"]
    assert relative_error(resumed, fsdp_unbroken["checkpoint"]) < TOLERANCE


@pytest.mark.slow
def test_a_new_lr_on_resume_under_model_parallelism_trains_what_ddp_trains_at_it(tmp_path):
    """One epoch under ddp at lr 0.05 with a StepLR (halving every 4 steps), the second resumed at ``--model.lr=0.1``
    under ddp, fsdp and pipeline: each ends at the ddp resume's weights, with the scheduler's base lr the new one
    and the optimizer's lr the new one times the schedule's factor (four halvings: 0.1 / 16). A stale base_lrs, or
    an optimizer state that a strategy's own loading put back over the change, trains at another lr."""
    root, schedule = tmp_path / "runs", "--model.lr_step=4"
    fit(root, tmp_path, "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_epochs=1", schedule)
    ckpt = f"--ckpt_path={root / 'lightning_logs' / 'version_0' / 'checkpoints' / 'last.ckpt'}"
    resumed = {}
    for version, strategy in enumerate(("ddp", "fsdp", "pipeline"), start=1):
        output = fit(root, tmp_path, f"--trainer.strategy={strategy}", "--trainer.devices=2", ckpt, schedule,
                     "--model.lr=0.1")  # fmt: skip
        assert "Resumed with the settings given over the restored state: lr 0.0125 -> 0.025\n" in output, output[-3000:]
        resumed[strategy] = last(root, version)
    for strategy, checkpoint in resumed.items():
        assert checkpoint["global_step"] == 16
        [scheduler] = checkpoint["lr_schedulers"]
        assert scheduler["base_lrs"] == [0.1], (strategy, scheduler)
        assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.1 / 16), strategy
        assert relative_error(checkpoint, resumed["ddp"]) < TOLERANCE, strategy


@pytest.mark.slow
def test_a_pipeline_run_stopped_mid_epoch_resumes_exactly_under_ddp(fsdp_unbroken, tmp_path):
    """2 stages sharing batches of 2 x 4 (the global batch of the fsdp run), SIGTERM after step 3: the checkpoint holds
    both stages' layers and their optimizer state, plain tensors; ddp on 2 processes resumes it to the unbroken
    run's weights."""
    root = tmp_path / "runs"
    stop = {"class_path": "tests.signal_at_step.SignalAtStep", "init_args": {"step": 3, "rank": 1}}
    output = fit(root, tmp_path, "--trainer.strategy=pipeline", "--trainer.devices=2",
                 "--trainer.enable_model_summary=true",  # Lightning's default: it cannot run the cut network
                 "--trainer.callbacks+=" + json.dumps(stop))  # fmt: skip
    stopped = re.search(r"SIGTERM: stopped after step (\d+) \(epoch 0\)", output)
    assert stopped and 3 <= int(stopped[1]) < 8, output[-3000:]
    assert "Total params" in output  # the summary, its sizes left out
    checkpoint = last(root, 0)
    expected = fsdp_unbroken["checkpoint"]
    assert {k: v.shape for k, v in checkpoint["state_dict"].items()} == {
        k: v.shape for k, v in expected["state_dict"].items()
    }
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == sorted(expected["optimizer_states"][0]["state"])
    fit(root, tmp_path, "--trainer.strategy=ddp", "--trainer.devices=2", "--ckpt_path=last")
    resumed = last(root, 1)
    assert resumed["global_step"] == expected["global_step"]
    assert relative_error(resumed, expected) < TOLERANCE


@pytest.mark.slow
def test_fsdp_trains_batchnorm_in_bf16_mixed_precision(tmp_path):
    """bf16 units, with BatchNorm's weights kept in float32 beside its float32 running statistics (batch_norm takes
    no bfloat16 weights with them: every step failed before)."""
    output = fit(tmp_path / "runs", tmp_path, "--trainer.strategy=fsdp", "--trainer.devices=2",
                 "--trainer.precision=bf16-mixed", "--model.norm=batch", "--trainer.max_epochs=1")  # fmt: skip
    assert "epoch 0 | train loss" in output, output[-3000:]
    weights = last(tmp_path / "runs", 0)["state_dict"]
    assert weights["net.norm1.weight"].dtype == weights["net.conv1.weight"].dtype == torch.float32
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


# ------------------------------------------------------------------------------------------------ fsdp: bad input
def test_fsdp_is_ours_under_its_lightning_name_and_takes_a_cpu():
    assert StrategyRegistry["fsdp"]["strategy"] is FSDPStrategy
    trainer = Trainer(strategy="fsdp", accelerator="cpu", devices=2, logger=False)  # Lightning's FSDP1 refuses this
    assert isinstance(trainer.strategy, FSDPStrategy)


def test_fsdp_refuses_float16_mixed_precision_before_any_process_starts():
    """(On a GPU: Lightning turns 16-mixed on CPU into bf16-mixed.) Lightning sets up the launcher as the Trainer is
    made, before anything starts: the refusal comes there."""
    strategy = FSDPStrategy(precision_plugin=MixedPrecision("16-mixed", "cuda", scaler=object()))
    with pytest.raises(UserError, match="--trainer.strategy=fsdp with --trainer.precision=16-mixed: .* use bf16-mixed"):
        strategy._configure_launcher()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_16_mixed_on_cpu_trains_as_bf16_mixed_under_fsdp_and_pipeline_alike(tmp_path, strategy):
    """On CPU Lightning turns 16-mixed into bf16-mixed, with its own warning, for every strategy; the refusal is for
    GPUs, where it would be float16 (the next test). docs/model-parallel.md listed 16-mixed among the pipeline's
    refusals without saying so, while the run trained."""
    output = fit(tmp_path / "runs", tmp_path, f"--trainer.strategy={strategy}", "--trainer.devices=2",
                 "--trainer.precision=16-mixed", "--trainer.max_epochs=1")  # fmt: skip
    assert "AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'` instead" in output, output[-3000:]
    assert "epoch 0 | train loss" in output and "error" not in output.lower(), output[-3000:]
    weights = last(tmp_path / "runs", 0)["state_dict"]
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


def test_pipeline_refuses_float16_mixed_precision_on_a_gpu_before_any_process_starts():
    strategy = PipelineStrategy(stages=1, precision_plugin=MixedPrecision("16-mixed", "cuda", scaler=object()))
    with pytest.raises(UserError, match="--trainer.strategy=pipeline with --trainer.precision=16-mixed: .* bf16-mixed"):
        strategy._configure_launcher()


def test_the_docs_list_16_mixed_among_the_pipelines_refusals_on_a_gpu_only():
    """What the pipeline refuses, as docs/model-parallel.md says it, is what it refuses."""
    pipeline = (ROOT / "docs" / "model-parallel.md").read_text().split("## pipeline", 1)[1]
    refusals = " ".join(pipeline.split("- **Refused in one line**", 1)[1].split("\n- ")[0].split())  # one line
    assert "`16-mixed` on a GPU" in refusals and "on CPU, Lightning itself runs `16-mixed` as `bf16-mixed`" in refusals


def test_fsdp_dtypes_are_checked():
    with pytest.raises(UserError, match=r"--trainer.strategy.reduce_dtype=int8: use one of float32, bfloat16"):
        FSDPStrategy(reduce_dtype="int8")


def test_a_ddp_communication_hook_is_refused_under_fsdp():
    trainer = type("T", (), {"strategy": FSDPStrategy(), "world_size": 2, "num_devices": 1})()
    with pytest.raises(UserError, match="not FSDPStrategy; fsdp reduce-scatters its own gradients"):
        DDPCommHook().setup(trainer, None, "fit")


def test_blocks_are_found_by_class_name_or_path_outermost_first():
    from tests.tiny import TinyClassifier

    model = TinyClassifier(blocks=3)
    assert [path for path, _ in match_modules(model, ("Block",))] == ["net.block0", "net.block1", "net.block2"]
    assert [path for path, _ in match_modules(model, ("net", "Block"))] == ["net"]  # not its blocks again
    assert [path for path, _ in match_modules(model, ("net.block[02]",))] == ["net.block0", "net.block2"]


def refused(tmp_path: Path, *args: str) -> list[str]:
    """The error lines of a cli.py fit on 2 devices that must stop with exit 2, writing no run folder."""
    result = warm.run(
        [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG), "--trainer.devices=2", *args]
        + [f"--trainer.default_root_dir={tmp_path}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert not (tmp_path / "lightning_logs").exists()
    return [line for line in result.stderr.splitlines() if "error" in line.lower()]


@pytest.mark.slow
def test_blocks_that_match_nothing_are_one_line_and_leave_no_run_folder(tmp_path):
    assert refused(tmp_path, "--trainer.strategy=fsdp", "--trainer.strategy.blocks=[Transformer]") == [
        "error: --trainer.strategy.blocks=['Transformer'] matches no module of TinyClassifier; give class names "
        "(e.g. BasicBlock) or paths as in named_modules() (e.g. net.layer1)"
    ]


# ------------------------------------------------------------------------------------------------ pipeline
@pytest.mark.slow
@pytest.mark.parametrize("name", ["pipeline_gpipe"])
def test_the_gpipe_schedule_trains_like_one_device(parity, name):
    """(1F1B, the default, and the 2 x 2 mesh are in tests/test_strategies.py's parity cases.)"""
    result, reference = parity(name, *LAUNCHES["pipeline_variants"][1][name]), parity("reference", *REFERENCE)
    assert result["global_step"] == reference["global_step"] == 4
    assert relative_error(result, reference) < TOLERANCE


def test_stages_get_contiguous_layers_balanced_by_parameters():
    sizes = [nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 100)]
    assert balanced(sizes, 2) == [4, 1]  # 330 parameters, then 1100
    assert balanced(sizes, 5) == [1, 1, 1, 1, 1]
    assert sum(balanced([nn.ReLU()] * 7, 3)) == 7


@pytest.mark.parametrize(
    ("options", "devices", "message"),
    [
        ({"stages": 2}, 3, "3 devices cannot hold pipelines of 2 stages; use a multiple of 2 devices"),
        ({"stages": 2, "microbatches": 1}, 2, r"microbatches=1: the 1f1b schedule needs at least as many"),
        ({"stages": 0}, 2, r"--trainer.strategy.stages=0: use a whole number >= 1"),
        ({"schedule": "zb"}, 2, r"--trainer.strategy.schedule=zb: use one of gpipe, 1f1b"),
        ({"balance": [3, 0]}, 2, r"--trainer.strategy.balance=\[3, 0\]: give the layers of each stage"),
        ({"balance": [3, 4], "stages": 3}, 2, r"=\[3, 4\] gives the layers of 2 stages, but --trainer.strategy.stag"),
        ({"balance": [2, 2, 1]}, 2, r"balance=\[2, 2, 1\] gives the layers of 3 stages, one device each, but --trai"),
        ({"balance": [2, 2, 1]}, 4, r"--trainer.devices=4 cannot hold them .*; give 1, 2 or 4 numbers, or use a mul"),
    ],
)
def test_pipeline_layouts_that_cannot_work_are_one_line_before_anything_starts(options, devices, message):
    with pytest.raises(UserError, match=message):
        Trainer(strategy=PipelineStrategy(**options), accelerator="cpu", devices=devices, logger=False)


def test_a_torch_whose_schedules_take_no_split_microbatches_is_one_line(monkeypatch):
    """torch 2.11's ScheduleGPipe.eval(*args, target=None, losses=None, **kwargs) split our list of microbatches as
    if it were a keyword input: every stage failed at its first evaluation (seen on the GPU machine)."""
    from torch.distributed.pipelining import ScheduleGPipe

    def eval_of_torch_2_11(self, *args, target=None, losses=None, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(ScheduleGPipe, "eval", eval_of_torch_2_11)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(UserError, match=r"^--trainer.strategy=pipeline needs a torch .*; torch 2.11.0\+cu130 has"):
        PipelineStrategy()


def test_a_network_the_pipeline_cannot_cut_is_one_line():
    from tests.tiny import TinyClassifier

    class TwoNetworks(TinyClassifier):
        def __init__(self):
            super().__init__()
            self.other = nn.Linear(2, 2)

    with pytest.raises(UserError, match="holds parameters in net, other; name the network with TaskSpec"):
        network_of(TwoNetworks())
    with pytest.raises(UserError, match="GRU is not an nn.Sequential, so its layers are unknown; give it a pipeline_"):
        layers_of(nn.GRU(2, 2))
    strategy = type("S", (), {"stages": 8, "balance": None})()
    with pytest.raises(UserError, match="8 stages, but the network has 7 layers to deal out"):
        PipelineStages(strategy, TinyClassifier())


def test_clipping_by_norm_is_refused_under_a_pipeline():
    from tests.tiny import TinyClassifier

    strategy = PipelineStrategy()
    strategy._lightning_module = TinyClassifier()
    for algorithm in ("norm", None):  # (None: Lightning's default, by norm)
        trainer = type("T", (), {"gradient_clip_val": 1.0, "gradient_clip_algorithm": algorithm})()
        with pytest.raises(UserError, match="clips by the gradients' norm, which under --trainer.strategy=pipeline"):
            strategy.setup(trainer)


def test_callbacks_that_cannot_work_under_a_pipeline_are_one_line():
    from app.callbacks import SyncBatchNorm

    trainer = type("T", (), {"strategy": PipelineStrategy(), "world_size": 2, "num_devices": 2})()
    with pytest.raises(UserError, match="SyncBatchNorm does not work with --trainer.strategy=pipeline"):
        SyncBatchNorm().setup(trainer, None, "fit")
    with pytest.raises(UserError, match="not PipelineStrategy; a pipeline's stages send activations"):
        DDPCommHook().setup(trainer, None, "fit")


@pytest.mark.slow
def test_micro_batches_that_do_not_divide_the_batch_are_one_line(tmp_path):
    assert refused(tmp_path, "--trainer.strategy=pipeline", "--trainer.strategy.microbatches=3") == [
        "error: --trainer.strategy.microbatches=3 does not divide a pipeline's batch of 32 samples "
        "(--data.batch_size=16 per device x 2 stages); give microbatches that divide 32, or a batch size that makes "
        "it a multiple of 3"
    ]


# ------------------------------------------------------------------------------------------------ a fork's own task
FORK_SCRIPT = """
import sys

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch import nn

from app.run.defaults import last_checkpoint, trainer_defaults
from app.loader import make_loader
from app.task import TaskSpec


class Points(torch.utils.data.Dataset):  # dict samples: {"features": ..., "target": ...}
    def __init__(self, count, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(count, 6, generator=g)
        self.y = self.x @ torch.arange(6.0) / 6

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "target": self.y[i]}


class PointData(LightningDataModule):
    def __init__(self):
        super().__init__()
        self.train_set, self.val_set = Points(96, 1), Points(32, 2)

    def train_dataloader(self):
        return make_loader(self.trainer, self.train_set, train=True, batch_size=8)

    def val_dataloader(self):
        return make_loader(self.trainer, self.val_set, train=False, batch_size=8)


class Regressor(LightningModule):  # the network in "body": the pipeline's stages, fsdp's units
    spec = TaskSpec(monitor="val_mse", mode="min", layers="body")

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self(batch["features"]), batch["target"])
        self.log("train_mse", loss, batch_size=len(batch["target"]))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", nn.functional.mse_loss(self(batch["features"]), batch["target"]),
                 batch_size=len(batch["target"]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


if __name__ == "__main__":
    root, strategy, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = Regressor()
    trainer = Trainer(**trainer_defaults(model, root), strategy=strategy, devices=2, accelerator="cpu",
                      max_epochs=epochs)
    trainer.fit(model, PointData(), ckpt_path=last_checkpoint(root))
"""


@pytest.mark.slow
def test_a_forks_own_task_from_its_own_script_trains_under_fsdp_and_resumes_under_pipeline(tmp_path):
    """A model, data module and dict batches of a user's own, defined in the script that calls Trainer (the Python
    API, as a fork's entry point would): one epoch under fsdp, the second resumed from its last.ckpt under pipeline
    (its network named by spec.layers), the checkpoints ranked by the task's own metric."""
    script = tmp_path / "train.py"
    script.write_text(FORK_SCRIPT)
    for strategy, epochs in (("fsdp", 1), ("pipeline", 2)):
        launch = subprocess.run if strategy == "fsdp" else warm.run  # the second run: forked warm (tests/warm.py)
        result = launch(
            [sys.executable, str(script), str(tmp_path / "runs"), strategy, str(epochs)], cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"epoch {epochs - 1} | train loss" in result.stdout and f"2 x cpu ({strategy})" in result.stdout
    runs = tmp_path / "runs" / "lightning_logs"
    last = torch.load(runs / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 2 * 96 // 16  # two epochs at the global batch of 2 x 8
    assert any(p.name.startswith("epoch=1-val_mse=") for p in (runs / "version_1" / "checkpoints").iterdir())


# ------------------------------------------------------------------------------------------------ a lost rank
def fault(**init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": "tests.faults.Fault", "init_args": init_args})


def lose_a_rank(tmp_path: Path, *args: str, torchrun: bool = False) -> tuple[int, str]:
    """cli.py fit on 2 processes in a fresh interpreter (a rank killed is a real process), to the end of the last
    rank: under Lightning's launcher rank 0 is the process started here, and rank 1 may outlive it."""
    command = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG), "--trainer.devices=2"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    if torchrun:  # as docs/elastic.md runs it, on one node
        from lightning.fabric.plugins.environments.lightning import find_free_network_port

        command[1:1] = ["-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--max-restarts=1"]
        command[6:6] = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{find_free_network_port()}"]
        environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    result = subprocess.run(
        [*command, "--watchdog.timeout=10", f"--trainer.default_root_dir={tmp_path}", *args],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_a_rank_lost_after_a_sigterm_does_not_leave_the_checkpoint_promised(tmp_path):
    """torchrun's agent sends the other workers SIGTERM when one dies, often before the watchdog's verdict: the
    survivor said "received SIGTERM: stopping after this step with a checkpoint", then stopped without one. Here
    rank 0 gets a SIGTERM after step 9 and rank 1 is killed after step 10, before the ranks agreed on the stop."""
    code, output = lose_a_rank(
        tmp_path, "--trainer.strategy=fsdp", fault(at="step", step=9, action="sigterm", rank=0),
        fault(at="step", step=10, action="kill", rank=1),
    )  # fmt: skip
    assert code == 1, output[-3000:]
    assert "[rank 0] received SIGTERM: stopping after this step, with a checkpoint if every rank finishes it" in output
    assert "stopping after this step with a checkpoint" not in output  # the promise, as it was
    lost = re.search(r"error: \[rank 0\] lost rank 1: .*", output)
    assert lost and "Stopping this rank (exit 1) without the checkpoint SIGTERM asked for: it needs" in lost[0], output
    assert "last.ckpt is intact: restart with the same command plus --ckpt_path last" in lost[0], output[-3000:]
    assert "stopped after step" not in output  # no checkpoint of the stop
    assert last(tmp_path, 0)["global_step"] == 8  # the epoch's


@pytest.mark.slow
def test_rank_0_lost_under_fsdp_is_one_line_without_torchs_cpp_frames(tmp_path):
    """rank 0 hosts the rendezvous store: the watchdog's next call to it failed, and torch printed a C++ warning of
    16 lines (TCPStore.cpp ... recvValue failed, then native frames) before the one line that says what happened."""
    code, output = lose_a_rank(tmp_path, "--trainer.strategy=fsdp", fault(at="step", step=10, action="kill", rank=0))
    assert code == -9, output[-3000:]  # rank 0 itself; rank 1 ran to its end first (the pipes stayed open)
    assert re.search(r"error: \[rank 1\] lost rank 0: the rendezvous store on rank 0 stopped answering", output), (
        output[-3000:]
    )
    assert "TCPStore.cpp" not in output and "frame #" not in output, output[-3000:]


@pytest.mark.slow
def test_a_pipeline_stage_lost_under_torchrun_restarts_says_once_that_no_state_is_saved(tmp_path):
    """Under a restarting launcher a survivor saves its state when its next collective fails; a pipeline's survivor
    cannot (the lost stage's layers are gone), and the watchdog said "Saving this rank's state first" before the
    Elastic callback said "none is saved here". Rank 0 computes 3 s more after rank 1 dies, so the watchdog's verdict
    comes first; torchrun's restart then goes on from the epoch's last.ckpt."""
    code, output = lose_a_rank(
        tmp_path, "--trainer.strategy=pipeline", fault(at="step", step=10, action="kill", rank=1),
        fault(at="next_batch", step=10, action="pause", seconds=3, rank=0), torchrun=True,
    )  # fmt: skip
    assert code == 0, output[-4000:]
    assert re.search(r"error: \[rank 0\] lost rank 1: .*\. Stopping this rank when its next collective fails", output)
    assert "so none is saved here; a restart goes on from the last checkpoint written" in output, output[-4000:]
    assert "Saving this rank's state" not in output and "Saved the state" not in output
    assert "stopping after this step with a checkpoint" not in output  # torchrun's SIGTERM to the survivor
    assert "torchrun restart 1 of at most 1" in output and last(tmp_path, 0)["global_step"] == 16


@pytest.mark.slow
def test_a_pipeline_run_says_which_layers_each_stage_holds_and_its_first_stage_runs_each_step_twice(
    tmp_path, monkeypatch
):
    """One line, from rank 0, names each stage's layers as the network names them (the pipeline's cut was
    unstated). The first stage runs training_step once to find the network's input and once more with the output
    given, for each of the 4 micro-batches of each of the 8 steps; the last stage once (docs/model-parallel.md)."""
    monkeypatch.setenv("STEP_CALLS_DIR", str(tmp_path))
    output = fit(tmp_path / "runs", tmp_path, "--trainer.strategy=pipeline", "--trainer.devices=2",
                 "--trainer.strategy.balance=[4,3]", "--model=tests.step_calls.CountingClassifier",
                 "--trainer.max_epochs=1")  # fmt: skip
    line = "pipeline: stage 0: conv1, norm1, relu, block0 (348 parameters) | stage 1: block1, flatten, head (1,332 "
    assert output.count(line + "parameters)") == 1, output[-3000:]
    calls = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text())["training_step"] for rank in (0, 1)}
    assert calls == {0: 2 * 4 * 8, 1: 4 * 8}


def test_a_sharded_checkpoint_is_read_for_the_runs_checks_refused_where_it_cannot_load_and_consolidated(tmp_path):
    """A sharded checkpoint made in this process (DCP without a process group, as one rank writes it): the run's
    checks read its weights' shapes and settings without loading a tensor; a strategy that cannot load it says so in
    one line naming the flags and ``cli.py consolidate``, which makes the whole file of it and refuses a file."""
    import torch.distributed.checkpoint as dcp

    from app.checkpoints.io import check_weights_fit, load_checkpoint, safe_torch_load
    from app.checkpoints.sharded import META, main
    from tests.tiny import TinyClassifier

    model = TinyClassifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, *model.example_input_array.shape[1:])).sum().backward()
    optimizer.step()
    folder = tmp_path / "last.ckpt"
    names = [name for name, _ in model.named_parameters()]
    by_name = {"state": {names[i]: s for i, s in optimizer.state_dict()["state"].items()}, "param_groups": [
        {**g, "params": [names[i] for i in g["params"]]} for g in optimizer.state_dict()["param_groups"]]}  # fmt: skip
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": model.state_dict(), "optimizer_states": {"0": by_name}}, checkpoint_id=folder)
    torch.save({"global_step": 7, "hyper_parameters": {}, "optimizer_count": 1}, folder / META)

    read = load_checkpoint(folder, shapes=True)
    assert read["global_step"] == 7 and all(t.is_meta for t in read["state_dict"].values())
    check_weights_fit(read["state_dict"], model.state_dict(), folder)  # the shapes fit this network
    for loads in (safe_torch_load, load_checkpoint):  # a strategy's load, export's, load_network's
        with pytest.raises(UserError, match=r"an fsdp sharded checkpoint .*strategy.checkpoint=sharded.*consolidate"):
            loads(folder)

    main([str(folder)])
    full = torch.load(tmp_path / "last.full.ckpt", weights_only=True)
    assert all(torch.equal(full["state_dict"][k], v) for k, v in model.state_dict().items())
    assert full["optimizer_states"][0]["param_groups"] == optimizer.state_dict()["param_groups"]
    for i, state in optimizer.state_dict()["state"].items():
        assert torch.equal(full["optimizer_states"][0]["state"][i]["momentum_buffer"], state["momentum_buffer"])
    with pytest.raises(UserError, match="not a sharded checkpoint"):
        main([str(tmp_path / "last.full.ckpt")])
    with pytest.raises(UserError, match="already exists"):
        main([str(folder)])


class _OneRank:
    """What save_sharded asks of a strategy, for one process (DCP saves without a process group)."""

    is_global_zero = True

    def barrier(self, name: str = "") -> None:
        pass


def _sharded_save(checkpoint: dict, path: Path, background=None) -> None:
    from app.checkpoints.sharded import save_sharded

    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        save_sharded(_OneRank(), checkpoint, path, background)


def test_a_background_save_writes_what_the_weights_were_moves_it_into_place_on_settle_and_says_a_failure(
    tmp_path, monkeypatch
):
    """``async_save``: the save holds the weights as they were when it was asked for, though its worker writes only
    after training changed them in place; the folder is moved onto last.ckpt only by ``settle`` (on the training
    thread); a save that fails is one line where the ranks wait for their saves, the checkpoint before it stays, and
    the saves after it are put in place."""
    import threading

    import torch.distributed.checkpoint as dcp

    from app.checkpoints.sharded import BackgroundSaves, read_sharded

    path, weights, background = tmp_path / "last.ckpt", torch.zeros(4), BackgroundSaves()
    stepped, writers, real_save = threading.Event(), [], dcp.save

    def quiet_save(*args, **kwargs):  # (DCP's "assuming ... a single process": it is)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return real_save(*args, **kwargs)

    def save_after_the_step(*args, **kwargs):
        writers.append(threading.current_thread())
        assert stepped.wait(30)
        return quiet_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save_after_the_step)
    _sharded_save({"global_step": 1, "state_dict": {"w": weights}, "optimizer_states": []}, path, background)
    weights.add_(1.0)  # the next step, in place, while the save waits to be written
    stepped.set()
    background._pending[-1][0].result(timeout=30)
    assert not path.exists() and background.writing(path)  # written, not yet in place
    background.settle()
    assert read_sharded(path)["global_step"] == 1 and not background.writing(path)
    assert writers and writers[0] is not threading.main_thread()
    loaded = {"w": torch.empty(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"state_dict": loaded}, checkpoint_id=path)
    assert torch.equal(loaded["w"], torch.zeros(4))  # the weights at the save, not after the step

    def full_disk(*args, **kwargs):  # as DCP raises a rank's error: wrapped, with every rank's trace
        from torch.distributed.checkpoint.api import CheckpointException

        raise CheckpointException("save", {0: (OSError(28, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", full_disk)
    _sharded_save({"global_step": 2, "state_dict": {"w": weights}, "optimizer_states": []}, path, background)
    monkeypatch.setattr(dcp, "save", quiet_save)
    later = tmp_path / "epoch=1.ckpt"  # a save after the failed one is still put in place
    _sharded_save({"global_step": 3, "state_dict": {"w": weights}, "optimizer_states": []}, later, background)
    background._pending[-1][0].result(timeout=30)
    background.settle()  # not here (a batch: the ranks may be at different ones), at the next wait
    assert read_sharded(later)["global_step"] == 3
    with pytest.raises(UserError) as failed:
        background.settle(wait=True)
    assert str(failed.value) == (
        f"{path}: its background save failed (OSError: [Errno 28] No space left on device); the checkpoint before "
        "it stays"
    )
    assert read_sharded(path)["global_step"] == 1  # the checkpoint before it
    background.close()


def test_a_sharded_save_replaces_a_full_file_and_is_found_by_a_restart_and_by_best(tmp_path, monkeypatch):
    """A sharded checkpoint is a folder where a full one was a file: it replaces a full last.ckpt (nothing left
    beside it), a torchrun restart continues from it, ``best`` finds it, and a URL is refused in one line."""
    from app.checkpoints.run_folders import MARKER, continue_run_folder
    from app.checkpoints.sharded import META
    from app.launch.launcher import TorchrunJob
    from app.run.resume import best_checkpoint_of

    folder = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"global_step": 1}, folder / "last.ckpt")  # a full checkpoint of the same run, a file
    best = str(folder / "epoch=0-val_acc=0.5.ckpt")
    state = {"callbacks": {"ModelCheckpoint{'monitor': 'val/acc'}": {"best_model_path": best}}, "global_step": 4}
    for path in (folder / "last.ckpt", Path(best)):
        _sharded_save({**state, "state_dict": {"w": torch.ones(3)}, "optimizer_states": []}, path)
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-val_acc=0.5.ckpt", "last.ckpt"]
    assert (folder / "last.ckpt" / META).is_file()
    assert best_checkpoint_of(folder / "last.ckpt") == Path(best)

    job = TorchrunJob(run_id="job-1", world_size=2, local_world_size=2, nodes=1, restart_count=1, max_restarts=3)
    (folder.parent / MARKER).write_text(json.dumps({"rdzv_id": "job-1", "finished": False, "agents": []}))
    logger = type("Logger", (), {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": None})()
    logger.init_args = Namespace(save_dir=str(tmp_path), name="lightning_logs", version=None)
    monkeypatch.setattr("app.checkpoints.run_folders.is_first_process", lambda: False)
    continued, ckpt, _ = continue_run_folder([logger], job)
    assert ckpt == str(folder / "last.ckpt") and list(continued.values()) == [0]

    with pytest.raises(UserError, match="sharded checkpoints are folders renamed into place"):
        _sharded_save({"state_dict": {}, "optimizer_states": []}, "memory://runs/last.ckpt")
