"""SyncBatchNorm, LRWarmup, ActivationCheckpointing and RunReport: each proven with numbers (CPU, real processes)."""

import csv
import math
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch import Callback, Trainer
from torch import nn

from app.callbacks import ActivationCheckpointing, LRWarmup, SyncBatchNorm
from app.callbacks.activation_checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from app.callbacks.sync_batchnorm import AllReduceBatchNorm, convert_batchnorm
from app.callbacks.warmup import lr_scale, warmup_factor
from app.errors import UserError
from bench.checkpointing import saved_bytes
from tests import warm
from tests.conftest import ROOT, TINY_CONFIG, run_cli
from tests.parity import BN_WARMUP, REFERENCE, TOLERANCE, VARIANT_CASES, buffer_error, relative_error
from tests.tiny import LR, TinyClassifier, TinyData


# ================================================================================================ SyncBatchNorm
def _sync_bn_worker(rank: int, world: int, port: int, x: torch.Tensor, g: torch.Tensor, sizes, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    bn = AllReduceBatchNorm(3, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    start = sum(sizes[:rank])
    xi = x[start : start + sizes[rank]].clone().requires_grad_()
    for _ in range(2):  # two steps: running statistics compound
        y = bn(xi)
    (y * g[start : start + sizes[rank]]).sum().backward()
    torch.save(
        {
            "y": y.detach(),
            "dx": xi.grad,
            "dw": bn.weight.grad,
            "db": bn.bias.grad,
            "state": bn.state_dict(),
        },
        f"{out}.{rank}",
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_allreduce_batchnorm_equals_one_process_on_the_whole_batch(tmp_path):
    """2 gloo processes with uneven batches (5 and 3): outputs, every gradient and running stats as one process."""
    torch.manual_seed(1)
    x, g = torch.randn(8, 3, 4, 4) * 2 + 1, torch.randn(8, 3, 4, 4)
    sizes = [5, 3]
    # forked from the warm forkserver (tests/warm.py): no launcher is on trial here, and spawn's two fresh
    # interpreters cost 14 CPU-seconds of imports
    args = (2, find_free_network_port(), x, g, sizes, str(tmp_path / "r"))
    mp.start_processes(_sync_bn_worker, args=args, nprocs=2, start_method="forkserver")
    ranks = [torch.load(tmp_path / f"r.{r}", weights_only=True) for r in range(2)]

    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    xr = x.clone().requires_grad_()
    for _ in range(2):
        y = bn(xr)
    (y * g).sum().backward()

    tol = {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), y.detach(), **tol)
    torch.testing.assert_close(torch.cat([r["dx"] for r in ranks]), xr.grad, **tol)
    torch.testing.assert_close(ranks[0]["dw"] + ranks[1]["dw"], bn.weight.grad, **tol)  # local parts sum up
    torch.testing.assert_close(ranks[0]["db"] + ranks[1]["db"], bn.bias.grad, **tol)
    for r in ranks:
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(r["state"][key], bn.state_dict()[key], **tol)


def test_allreduce_batchnorm_without_process_group_is_plain_batchnorm():
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(4)
    converted = TinyClassifier()
    reference = TinyClassifier()
    reference.load_state_dict(converted.state_dict())
    assert convert_batchnorm(converted, AllReduceBatchNorm) == sum(
        isinstance(m, nn.BatchNorm2d) for m in reference.modules()
    )
    assert not any(type(m) is nn.BatchNorm2d for m in converted.modules())
    assert converted.state_dict().keys() == reference.state_dict().keys()  # checkpoints stay interchangeable
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(converted(x), reference(x), atol=0, rtol=0)
    assert isinstance(plain, nn.BatchNorm2d)


BN_REFERENCE = [*REFERENCE, *BN_WARMUP]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "horovod", "fsdp"])
def test_sync_batchnorm_ddp_horovod_and_fsdp_train_like_one_device(parity, name):
    """BatchNorm network, 2 ranks x 8 = one process x 16: weights AND running statistics, only with the callback.

    Activation checkpointing and the LR warmup with the linear scaling rule are on too: none of them may change
    what is computed.
    """
    reference = parity("reference_bn", *BN_REFERENCE)
    synced = parity(f"{name}_bn_sync", *VARIANT_CASES[name], *BN_WARMUP, "--sync-bn", "--checkpointing")
    assert relative_error(synced, reference) < TOLERANCE
    assert buffer_error(synced, reference) < TOLERANCE
    plain = parity(f"{name}_bn_plain", *VARIANT_CASES[name], *BN_WARMUP)
    assert buffer_error(plain, reference) > 1e-3  # each rank's own statistics: not the global batch's


@pytest.mark.slow
def test_sync_batchnorm_with_trainer_sync_batchnorm_too_converts_once(workdir):
    """Lightning's own conversion (torch.nn.SyncBatchNorm) would fail on CPU: the callback's is the only one."""
    result = cli_fit(
        workdir,
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--trainer.sync_batchnorm=true",
        "--trainer.callbacks+=app.callbacks.SyncBatchNorm",
    )
    assert "BatchNorm layers synchronized across 2 processes (AllReduceBatchNorm" in result.stdout + result.stderr


def test_sync_batchnorm_is_a_no_op_on_one_process_and_warns_under_dp(workdir, capsys):
    module = TinyClassifier()
    from lightning.pytorch import Trainer

    for strategy, devices in (("auto", 1), ("dp", 2)):
        trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)
        if strategy == "dp":
            with pytest.warns(UserWarning, match="strategy=dp runs its replicas in one process"):
                SyncBatchNorm().setup(trainer, module, "fit")
        else:
            SyncBatchNorm().setup(trainer, module, "fit")
        assert not any(isinstance(m, AllReduceBatchNorm) for m in module.modules())


# ================================================================================================ LRWarmup
def test_warmup_factor_and_scaling_rule_closed_forms():
    assert [warmup_factor(t, 4, 0.2) for t in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert [warmup_factor(t, 2, 0.25, "exponential") for t in range(3)] == pytest.approx([0.25, 0.5, 1.0])
    assert [warmup_factor(t, 3, 0.5, "constant") for t in range(4)] == [0.5, 0.5, 0.5, 1.0]
    assert warmup_factor(0, 0, 0.1) == 1.0  # no warmup
    assert lr_scale(1024, 256, "linear") == 4.0
    assert lr_scale(1024, 256, "sqrt") == 2.0
    assert lr_scale(1024, 256, "none") == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_epochs": 1, "warmup_steps": 5}, "not both"),
        ({"start_factor": 0.0}, "start_factor must be in"),
        ({"schedule": "cosine"}, "schedule='cosine'"),
        ({"scale_lr": "quadratic"}, "scale_lr='quadratic'"),
        ({"warmup_steps": -1}, "must be >= 0"),
    ],
)
def test_warmup_rejects_bad_settings(kwargs, message):
    with pytest.raises(UserError, match=message):
        LRWarmup(**kwargs)


def logged_lrs(version_dir) -> dict[int, float]:
    with open(version_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/lr"]) for r in csv.DictReader(f) if r.get("train/lr")}


def expected_lr(step: int, *, global_batch: int, warmup: int = 6, main=lambda t: LR) -> float:
    """The task's lr x linear rule (reference 32) x linear warmup from 0.1 over ``warmup`` steps."""
    return main(step) * global_batch / 32 * warmup_factor(step, warmup, 0.1)


WARMUP = [
    "--trainer.callbacks+=app.callbacks.LRWarmup",
    "--trainer.callbacks.warmup_steps=6",
    "--trainer.callbacks.scale_lr=linear",
    "--trainer.callbacks.reference_batch=32",
]


def check_lrs(version_dir, steps: int, **kwargs) -> None:
    lrs = logged_lrs(version_dir)
    assert sorted(lrs) == list(range(steps)), lrs  # one value per optimizer step, none for accumulating batches
    for step, lr in lrs.items():
        assert lr == pytest.approx(expected_lr(step, **kwargs), rel=1e-6), step


def fit_one_epoch(*extra: str) -> None:
    """``cli.py fit`` on the tests' own task, one epoch, in this process."""
    run_cli("fit", "--config", str(TINY_CONFIG), "--trainer.max_epochs=1", *extra)


def cli_fit(workdir, *extra: str) -> None:
    """``python cli.py fit`` on the tests' own task in its own process (multi-process strategies need one)."""
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(TINY_CONFIG), "--trainer.max_epochs=1", *extra]
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = warm.run(cmd, capture_output=True, text=True, timeout=300, cwd=workdir, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_warmup_longer_than_the_run_says_so_in_its_line(workdir, caplog):
    """A trial run of fewer steps than the warmup (8 steps, warmup 20) never reaches the target lr: its line says so."""
    with caplog.at_level("INFO"):
        fit_one_epoch("--trainer.callbacks+=app.callbacks.LRWarmup", "--trainer.callbacks.warmup_steps=20")
    assert "LRWarmup: linear warmup over 20 steps, from 0.1 x lr (longer than this run's 8 steps: " in caplog.text


class _LoseARankInTheStep(Callback):
    """In the backward of the batch after optimizer step 3: a save as the rank watchdog's thread takes it while the
    training thread is inside that step, then the step's collective fails (a lost rank), and the training thread's
    own save after the failure (app/callbacks/elastic/failure.py's two survivor saves)."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == 3:
            trainer.save_checkpoint(self.folder / "in_step.ckpt")
            raise RuntimeError("Connection closed by peer")

    def on_exception(self, trainer, pl_module, exception) -> None:
        trainer.save_checkpoint(self.folder / "after_failure.ckpt")


def test_a_step_that_fails_or_is_saved_midway_leaves_the_lr_unscaled_in_the_optimizer_and_its_checkpoint(tmp_path):
    """The warmup factor is on the optimizer's lr only for the update itself. A checkpoint a survivor wrote while the
    step after step 3 was in flight held lr x factor(3): the resumed run applied the factor twice (its lr 5.5e-06
    instead of 5.2e-04 on the two-node SLURM job of tests/test_slurm_training.py), unlike an unbroken run."""
    fail = _LoseARankInTheStep(tmp_path)
    warmup = LRWarmup(warmup_steps=6, scale_lr="linear", reference_batch=32)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=8, callbacks=[warmup, fail], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="closed by peer"):
        trainer.fit(TinyClassifier(), TinyData())
    assert warmup.factor(3) != 1.0  # (16 / 32 x the warmup's 0.55)
    assert [group["lr"] for group in trainer.optimizers[0].param_groups] == [LR]
    for name in ("in_step.ckpt", "after_failure.ckpt"):
        saved = torch.load(tmp_path / name, map_location="cpu", weights_only=False)
        assert saved["global_step"] == 3
        assert [group["lr"] for group in saved["optimizer_states"][0]["param_groups"]] == [LR], name


@pytest.mark.slow
def test_warmup_composes_with_a_step_scheduler_single_device(workdir, caplog):
    """8 steps, batch 16: the task's StepLR halves every 3 steps underneath, unshifted; warmup and scale multiply it."""
    with caplog.at_level("INFO"):
        fit_one_epoch(*WARMUP, "--model.lr_step=3")
    assert "LRWarmup: linear warmup over 6 steps, from 0.1 x lr; linear scaling rule" in caplog.text  # within the run
    check_lrs(workdir / "lightning_logs" / "version_0", 8, global_batch=16, main=lambda t: LR * 0.5 ** (t // 3))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "extra", "steps", "global_batch"),
    [
        ("ddp", [], 8, 32),  # 16 per device x 2 processes
        ("dp", [], 8, 32),  # 16 per device x 2 devices in one process
        ("ddp", ["--trainer.accumulate_grad_batches=2"], 4, 64),  # x 2 accumulation; 8 batches = 4 steps
    ],
)
def test_warmup_and_scaling_rule_under_strategies(workdir, strategy, extra, steps, global_batch):
    result = cli_fit(workdir, f"--trainer.strategy={strategy}", "--trainer.devices=2", *WARMUP, *extra)
    check_lrs(workdir / "lightning_logs" / "version_0", steps, global_batch=global_batch)
    assert f"global batch {global_batch} = 16 per device x 2 devices" in result.stderr + result.stdout


@pytest.mark.slow
def test_warmup_resumes_mid_warmup(workdir):
    """Stop after 4 of 6 warmup steps, resume from last.ckpt: the LR carries on from step 4, as closed form says."""
    base = ["--config", str(TINY_CONFIG), "--trainer.limit_train_batches=4"]
    run_cli("fit", *base, "--trainer.max_epochs=1", *WARMUP)
    last = workdir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    run_cli("fit", *base, "--trainer.max_epochs=3", *WARMUP, "--ckpt_path", str(last))
    lrs = logged_lrs(workdir / "lightning_logs" / "version_1")
    assert sorted(lrs) == list(range(4, 12))
    for step, lr in lrs.items():
        assert lr == pytest.approx(expected_lr(step, global_batch=16), rel=1e-6), step


# ================================================================================================ checkpointing
class Block(nn.Module):
    """A residual block with dropout: recomputation must replay the same mask."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.bn, self.drop = (
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.Dropout(0.3),
        )

    def forward(self, x):
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool = False):
    model.zero_grad()
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    return (
        loss.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters()},
        {n: b.clone() for n, b in model.named_buffers()},
    )


def _dropout_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), Block(8), Block(8), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize(
    ("build", "targets"),
    [(TinyClassifier, ("Block",)), (_dropout_net, ("1", "2"))],
    ids=["tiny-batchnorm", "dropout-blocks-by-path"],
)
def test_checkpointing_changes_no_loss_gradient_or_buffer(build, targets, autocast):
    torch.manual_seed(0)
    plain = build().train()
    ckpt = build().train()
    ckpt.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(ckpt, targets)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 4, (6,))
    for _ in range(2):  # the second step starts from the buffers the first one left
        loss, grads, buffers = _step(plain, x, y, autocast)
        loss_c, grads_c, buffers_c = _step(ckpt, x, y, autocast)
        torch.testing.assert_close(loss_c, loss, atol=1e-6, rtol=1e-6)
        for name in grads:
            torch.testing.assert_close(grads_c[name], grads[name], atol=1e-6, rtol=1e-6)
        for name in buffers:  # running stats updated once per step, num_batches_tracked == steps
            torch.testing.assert_close(buffers_c[name], buffers[name], atol=1e-6, rtol=1e-6)
    assert all(int(b) == 2 for n, b in buffers_c.items() if n.endswith("num_batches_tracked"))
    remove_activation_checkpointing(ckpt)
    assert not any(type(m).__name__.startswith("Checkpointed") for m in ckpt.modules())


def test_checkpointing_halves_what_a_deep_network_keeps_for_backward():
    torch.manual_seed(0)
    model = TinyClassifier(width=32, blocks=8).train()
    x = torch.randn(32, 1, 8, 8)
    before = saved_bytes(model, x)
    apply_activation_checkpointing(model, ("Block",))
    after = saved_bytes(model, x)
    print(f"8 blocks, batch 32, saved for backward: {before / 2**20:.2f} MiB -> {after / 2**20:.2f} MiB")
    assert after <= before / 2, (before, after)


def test_checkpointing_that_matches_nothing_names_the_flag():
    module = TinyClassifier()
    with pytest.raises(UserError, match=r"--trainer.callbacks.modules=\['Transformer'\] matches no module"):
        ActivationCheckpointing(["Transformer"]).setup(None, module, "fit")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp", "ddp_spawn", "horovod", "fsdp", "pipeline"])
def test_checkpointing_under_strategies_trains_like_one_device(parity, name):
    reference = parity("reference", *REFERENCE)
    result = parity(f"{name}_ckpt", *VARIANT_CASES[name], "--checkpointing")
    assert relative_error(result, reference) < TOLERANCE


@pytest.mark.slow
def test_all_callbacks_together_with_bf16_through_the_cli(workdir, capsys):
    fit_one_epoch(
        "--trainer.precision=bf16-mixed",
        "--trainer.callbacks+=app.callbacks.ActivationCheckpointing",
        "--trainer.callbacks+=app.callbacks.SyncBatchNorm",
        *WARMUP,
    )
    with open(workdir / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    out = capsys.readouterr().out
    assert "Run report: single_device" in out and "peak memory MiB" in out


# ================================================================================================ RunReport
@pytest.mark.slow
def test_run_report_rows_per_device_for_dp_ddp_and_pipeline(workdir):
    """A row per device, whose samples/s add up to the epoch line's (a pipeline's stages all see each sample: each
    row counts its share, not the whole batch again)."""
    for strategy in ("dp", "ddp", "pipeline"):
        result = cli_fit(workdir, f"--trainer.strategy={strategy}", "--trainer.devices=2")
        out = result.stdout
        assert f"Run report: {strategy}, 2 device(s)" in out, out[-2000:]
        table = out[out.index("Run report") :]
        rows = [line for line in table.splitlines() if line.startswith("│")]
        assert len(rows) == 2 and all(" 8 " in row for row in rows), table  # 8 steps on each device
        epoch = re.search(r"epoch 0 \| train loss .* \| ([\d,]+) samples/s", result.stderr + out)
        assert epoch, out[-2000:]
        per_device = sum(float(row.split("│")[5].replace(",", "")) for row in rows)
        assert per_device == pytest.approx(float(epoch[1].replace(",", "")), rel=0.25), (strategy, table)


def epoch_losses(version_dir) -> list[float]:
    """The task's own ``train/loss_epoch`` (its mean per-sample training loss) of each epoch, from metrics.csv."""
    with open(version_dir / "metrics.csv") as f:
        return [float(r["train/loss_epoch"]) for r in csv.DictReader(f) if r.get("train/loss_epoch")]


def report_rows(output: str) -> list[list[str]]:
    """The end-of-training table's rows, cell by cell (rank, device, steps, step ms, samples/s, peak memory)."""
    table = output[output.index("Run report") :]
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]


@pytest.mark.slow
def test_run_report_train_loss_does_not_depend_on_gradient_accumulation(workdir):
    """The epoch line's train loss is the epoch's mean loss per sample, the task's train/loss_epoch, at any
    accumulation. It was the step outputs' loss, which Lightning divides by accumulate_grad_batches (2.12 at 1,
    0.39 at 4), so it also jumped when a resume changed the accumulation. 8 batches at 3: groups of 3, 3 and 2."""
    result = cli_fit(workdir, "--trainer.accumulate_grad_batches=3")
    output = result.stdout + result.stderr
    line = re.search(r"epoch 0 \| train loss ([\d.]+) \|", output)
    assert line, output[-2000:]
    (expected,) = epoch_losses(workdir / "lightning_logs" / "version_0")
    assert float(line[1]) == pytest.approx(expected, abs=2e-4), output[-2000:]


@pytest.mark.slow
def test_run_report_steps_are_optimizer_steps(workdir):
    """The table's steps are optimizer steps (trainer.global_step), its step time per optimizer step: 8 batches at
    accumulate_grad_batches=2 are 4 steps (it counted batches: 8)."""
    result = cli_fit(workdir, "--trainer.accumulate_grad_batches=2")
    rows = report_rows(result.stdout)
    assert len(rows) == 1 and rows[0][2] == "4", result.stdout[-2000:]


@pytest.mark.slow
def test_run_report_counts_samples_of_a_task_without_images(workdir):
    """A task of sequences (examples/sequence.py, dict batches) trains no images: the epoch line and the table say
    samples/s (they said img/s and images/s for every task)."""
    result = cli_fit(
        workdir, "--model=examples.sequence.SequenceRegressor", "--data=examples.sequence.SequenceData",
        "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert re.search(r"epoch 0 \| train loss [\d.]+ \| val mse [\d.]+ \| [\d.]+ s \| [\d,]+ samples/s \|", output), (
        output[-2000:]
    )
    header = output[output.index("Run report") :].splitlines()[2]
    assert "samples/s" in header and "images" not in output and "img/s" not in output, output[-2000:]


# ------------------------------------------------------------------------------------------------ ModelCheckpoint
@pytest.mark.parametrize("stops_before_validation", [True, False])
def test_checkpoint_warns_of_a_missing_monitor_only_once_validation_has_run(stops_before_validation, tmp_path):
    """A run that ends inside its first epoch has no val/acc yet: last.ckpt, no warning. A validation that does
    not log the monitored key stops the run with one line naming what it did log (a misnamed monitor)."""
    import warnings

    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from app.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val/acc", mode="max", save_last=True)
    trainer = Trainer(
        accelerator="cpu", max_epochs=1, max_steps=2 if stops_before_validation else -1, limit_train_batches=4,
        limit_val_batches=1, num_sanity_val_steps=0, callbacks=[callback], logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    if not stops_before_validation:
        with pytest.raises(UserError, match="ranks checkpoints by 'val/acc', which BoringModel did not log"):
            trainer.fit(BoringModel())  # logs no val/acc
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    assert (tmp_path / "last.ckpt").is_file()
    assert not [w for w in caught if "monitored key" in str(w.message)], [str(w.message) for w in caught]


def test_activation_checkpointing_refuses_a_compiled_model_in_one_line():
    """torch.compile needs a checkpoint's context_fn to return TorchDispatchModes (and Dynamo keeps a bound method's
    plain function): the pair failed deep in Dynamo at the first step. Now it is one line naming both (issue 35)."""
    from app.callbacks.activation_checkpointing import COMPILE_REFUSED, apply_activation_checkpointing

    net = TinyClassifier()
    assert apply_activation_checkpointing(net, ("Block",))
    net.compile(backend="aot_eager")  # the mechanism of inductor's, without a C compiler's minutes
    with pytest.raises(UserError) as error:
        net(torch.randn(2, 1, 8, 8)).sum().backward()
    assert str(error.value) == COMPILE_REFUSED


@pytest.mark.parametrize("schedule", ["LambdaLR", "OneCycleLR", "StepLR"])
def test_a_new_lr_on_resume_makes_the_schedulers_base_what_an_unbroken_run_at_that_lr_has(schedule):
    """A fit resumed with lr 0.1 -> 0.2 after 3 scheduler steps: the next lr is what a run at 0.2 from the start has
    at that step, for schedules that read the scheduler's base_lrs (LambdaLR, StepLR) and the param groups'
    initial/max lr (OneCycleLR). A stale base_lrs (the restored 0.1) would give half of it."""
    from types import SimpleNamespace

    from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR

    from app.callbacks.resume_settings import apply_changes, built_settings

    def build(lr: float):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr, momentum=0.9)
        if schedule == "LambdaLR":
            scheduler = LambdaLR(optimizer, lambda epoch: 0.8**epoch)
        elif schedule == "OneCycleLR":
            scheduler = OneCycleLR(optimizer, max_lr=lr, total_steps=10)
        else:
            scheduler = StepLR(optimizer, step_size=2, gamma=0.5)
        trainer = SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
        return optimizer, scheduler, built_settings(trainer)

    def steps(optimizer, scheduler, n: int) -> float:
        for _ in range(n):
            optimizer.step()
            scheduler.step()
        return optimizer.param_groups[0]["lr"]

    old_optimizer, old_scheduler, then = build(0.1)
    steps(old_optimizer, old_scheduler, 3)
    checkpoint = {"optimizer_states": [old_optimizer.state_dict()], "lr_schedulers": [old_scheduler.state_dict()]}
    optimizer, scheduler, now = build(0.2)
    changes = apply_changes(checkpoint, now, then, "last.ckpt")
    assert any(change.startswith("lr ") for change in changes), changes
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
    resumed = steps(optimizer, scheduler, 2)
    unbroken_optimizer, unbroken_scheduler, _ = build(0.2)
    unbroken = steps(unbroken_optimizer, unbroken_scheduler, 5)
    assert resumed == pytest.approx(unbroken, rel=1e-12), (resumed, unbroken, changes)
    assert scheduler.base_lrs == pytest.approx(unbroken_scheduler.base_lrs, rel=1e-12)


def test_the_python_apis_rank_watchdog_waits_as_long_as_cli_pys():
    """``trainer_defaults`` gives "what cli.py gives a run", but its watchdog waited 60 s for a silent rank where
    ``cli.py``'s (``--watchdog.timeout``, the callback's default) waits 15: the same lost node cost a Python-API run
    45 s more. Both take the callback's default now; an explicit timeout is kept."""
    import inspect

    from lightning.pytorch.demos.boring_classes import BoringModel

    from app.callbacks.rank_watchdog import RankWatchdog
    from app.run.defaults import trainer_defaults

    def watchdog(**kwargs) -> RankWatchdog:
        [found] = [c for c in trainer_defaults(BoringModel(), **kwargs)["callbacks"] if isinstance(c, RankWatchdog)]
        return found

    cli_default = inspect.signature(RankWatchdog.__init__).parameters["timeout"].default  # what the CLI's parser offers
    assert watchdog().timeout == cli_default == 15.0
    assert watchdog(watchdog_timeout=42.0).timeout == 42.0


def test_default_callbacks_out_of_order_fail_in_one_line_naming_both_and_the_fix():
    """Elastic must come before Preemption (app/callbacks/stop_plan.py: ORDER); the order was once only a comment, and
    a survivor saved nothing. Any trainer, the default callbacks reordered here, fails at setup in one line; the
    defaults in order train, and a run's own Elastic (docs/elastic.md) is put before the default Preemption."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from app.callbacks import Elastic
    from app.callbacks.stop_plan import in_order, stop_plan
    from app.errors import UserError
    from app.run.defaults import default_callbacks

    settings = {"enable_progress_bar": False, "logger": False, "enable_model_summary": False}

    def trainer(callbacks) -> Trainer:
        return Trainer(
            callbacks=callbacks,
            accelerator="cpu",
            fast_dev_run=True,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    wrong = sorted(default_callbacks(settings, [], []), key=lambda c: type(c).__name__ == "Elastic")  # Elastic last
    with pytest.raises(UserError) as raised:
        trainer(wrong).fit(BoringModel())
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("callbacks out of order: Elastic comes after Preemption"), message
    assert message.endswith("put Elastic before Preemption in the callbacks list"), message

    right = trainer(default_callbacks(settings, [], []))
    right.fit(BoringModel())
    plan = stop_plan(right)
    assert (type(plan.survivor_save).__name__, type(plan.preemption).__name__) == ("Elastic", "Preemption")

    own = [Elastic(keep_global_batch=False)]
    names = [type(c).__name__ for c in in_order(default_callbacks(settings, own, []), own)]
    assert names.index("Elastic") < names.index("Preemption"), names
