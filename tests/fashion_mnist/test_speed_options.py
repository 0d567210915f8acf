"""channels_last and compile: same results, same checkpoints; the progress bar's cost; the benchmark's pieces."""

import collections
import copy
import csv
import json
import logging
import re
import sys
import time
from pathlib import Path
from statistics import median

import pytest
import torch
import yaml
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from app.callbacks import ProgressBar, RichModelSummary, RunReport
from app.callbacks.run_report import _intervals_ms
from app.fashion_mnist.data import FashionMNISTDataModule
from app.fashion_mnist.model import ImageClassifier
from app.run.defaults import DEFAULT_CALLBACKS
from bench.__main__ import bench_runs, flops_per_image
from tests.conftest import CPU_TEST_CONFIG
from tests.fashion_mnist.conftest import run_cli


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


def test_compile_keeps_parameter_names_and_dp_refuses_it(workdir, data_dir, capsys):
    model = ImageClassifier(arch="resnet_tiny", compile=True)
    keys = model.state_dict().keys()
    model.trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    model.configure_model()
    assert model.state_dict().keys() == keys  # nn.Module.compile compiles in place: checkpoints are unchanged
    flags = ["--model.compile=true", "--trainer.strategy=dp", "--trainer.devices=2", "--data.data_dir", str(data_dir)]
    with pytest.raises(SystemExit) as exit_info:  # dp's own refusal (app/strategies/dp.py), before any step
        run_cli("fit", "--config", str(CPU_TEST_CONFIG), *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --trainer.strategy=dp cannot run a compiled module (net: torch.compile, or the ")
    assert not list(workdir.rglob("*.ckpt"))


def compile_with(monkeypatch, backend) -> None:
    """Every torch.compile of the task (``Module.compile`` and ``torch.compile``) with this backend, not inductor
    (which would need a C compiler and minutes)."""
    module_compile, compile_ = torch.nn.Module.compile, torch.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: module_compile(self, **{**kw, "backend": backend})
    )
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": backend}))
    torch._dynamo.reset()


def test_fsdp_trains_a_channels_last_model_with_its_weights_made_contiguous(tmp_path):
    """FSDP2 refuses non-contiguous parameters ("does not support non-contiguous parameters yet"); the strategy puts
    a channels_last model's weights back in NCHW before sharding, and the activations stay NHWC (the GPU preset
    configs/gpu_fast.yaml with --trainer.strategy=fsdp crashed before)."""
    from app.strategies import FSDPStrategy

    model = ImageClassifier(arch="resnet_tiny", channels_last=True)
    trainer = fit_tiny(model, tmp_path, max_epochs=1, strategy=FSDPStrategy(), devices=1)
    assert trainer.state.finished and trainer.global_step == 3
    assert all(p.to_local().is_contiguous() for p in model.parameters())


def fit_tiny(model, tmp_path, *, train: int = 40, val: int = 24, max_epochs: int = 2, **options) -> Trainer:
    """Fit ``model`` on random 28x28 images, in batches of 16 (``train=40``: 16, 16, 8; ``val=24``: 16, 8), without
    logger, checkpoints, progress bar or sanity check unless ``options`` say otherwise; Dynamo is reset after."""
    images = torch.randn(train + val, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (train + val,), generator=torch.Generator().manual_seed(1))
    train_loader = DataLoader(TensorDataset(images[:train], labels[:train]), batch_size=16)
    val_loader = DataLoader(TensorDataset(images[train:], labels[train:]), batch_size=16)
    settings = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, **options}
    trainer = Trainer(
        accelerator="cpu", max_epochs=max_epochs, num_sanity_val_steps=0, default_root_dir=tmp_path, **settings
    )
    try:
        trainer.fit(model, train_loader, val_loader)
    finally:
        torch._dynamo.reset()
    return trainer


def _symbolic(graph: torch.fx.GraphModule) -> bool:
    """Whether Dynamo compiled this graph for symbolic sizes (a SymInt input, or a tensor of a symbolic shape)."""
    for node in graph.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or (
            isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape)
        ):
            return True
    return False


def test_compiled_shapes_stay_fixed_when_an_epoch_ends_on_a_smaller_batch(tmp_path, monkeypatch):
    """--model.compile=true: an epoch's last, smaller batch (55000 % 256 = 216 on the real data) made Dynamo compile
    the network again for a symbolic batch size, and that graph then ran every later step. Now each batch size has
    a graph of fixed shapes, compiled once: two epochs of batches 16, 16, 8 and validation's 16, 8 compile four
    graphs (training and evaluation at each size), none symbolic (issue 35, item 12). Dynamo hands its graphs to a
    recorder here (inductor would need a C compiler and minutes)."""
    graphs: list[torch.fx.GraphModule] = []

    def recorder(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compile_with(monkeypatch, recorder)
    model = ImageClassifier(arch="resnet_tiny", compile=True)
    trainer = fit_tiny(model, tmp_path, enable_model_summary=False)  # batches 16, 16, 8; validation's 16, 8
    assert trainer.global_step == 6
    assert [_symbolic(graph) for graph in graphs] == [False] * 4


def test_the_model_summary_leaves_the_network_to_compile_at_the_first_step(tmp_path, monkeypatch):
    """The default model summary runs the network on its example input (2 images) under a FLOP counter. With torch
    2.11 that call made Dynamo skip the compiled network for good: ``cli.py fit --model.compile=true`` then trained
    eagerly with no graph at all (issue 44, seen on an H200). The template's summary runs that call eagerly: the
    graphs are those of the batches trained and validated (16 and 8), none for the summary's 2 images."""
    sizes: list[int] = []

    def recorder(graph, example_inputs):
        images = [t for t in example_inputs if isinstance(t, torch.Tensor) and t.shape[1:] == (1, 28, 28)]
        sizes.extend(t.shape[0] for t in images)
        return graph.forward

    compile_with(monkeypatch, recorder)
    model = ImageClassifier(arch="resnet_tiny", compile=True)
    fit_tiny(model, tmp_path, max_epochs=1, callbacks=[RichModelSummary(max_depth=2)])  # 16, 16, 8; 16, 8
    assert model.example_input_array.shape[0] == 2  # the summary did run the network on its example
    assert sorted(set(sizes)) == [8, 16], sizes


def test_loss_and_argmax_compile_with_the_network_and_none_of_their_outputs_outlives_its_step(tmp_path, monkeypatch):
    """--model.compile=true compiles the network, the loss and the argmax as one region (issue 44: fewer eager
    kernels per step than the plain loop, which computes its loss eagerly), and no output of that region is alive
    when the next batch starts: with CUDA graphs (``compile_mode=reduce-overhead``) the next replay overwrites
    those outputs, and a graph whose outputs are still alive is recorded again instead of replayed. The logged and
    displayed loss is a copy; this fails when it is a view of the region's output."""
    graphs: list[torch.fx.GraphModule] = []
    outputs: list[StorageWeakRef] = []  # the storages of the compiled calls' outputs since the last batch started

    def backend(graph, example_inputs):
        graphs.append(graph)

        def run(*args):
            result = graph.forward(*args)
            outputs.extend(StorageWeakRef(t.untyped_storage()) for t in result if isinstance(t, torch.Tensor))
            return result

        return run

    class Alive(Callback):
        counts: list[int] = []

        def _count(self) -> None:
            self.counts.append(sum(not ref.expired() for ref in outputs))
            outputs.clear()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._count()

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            self._count()

    compile_with(monkeypatch, backend)
    model = ImageClassifier(arch="resnet_tiny", compile=True)
    alive = Alive()
    fit_tiny(model, tmp_path, train=32, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[alive])
    assert len(alive.counts) == 8 and alive.counts[1:] == [0] * 7  # 2 x (2 training and 2 validation batches)
    assert len(graphs) == 3  # training at 16, evaluation at 16 and 8
    for graph in graphs:
        called = {str(node.target) for node in graph.graph.nodes if node.op in ("call_function", "call_method")}
        assert "argmax" in called and any("cross_entropy" in name for name in called), called


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_the_run_report_shows_the_step_time_and_what_torch_compile_did(compiled, tmp_path, monkeypatch, caplog):
    """Issue 44: a run says its median step time in every epoch line and, when compiled, how many graphs Dynamo
    compiled, its recompiles, graph breaks and skipped CUDA graphs, so a step that stopped replaying or a graph
    compiled at every step shows without a profiler. Two epochs of batches 16, 16, 8 and validation's 16, 8: four
    graphs (training and evaluation at each size), three recompiles (each a guard that failed: a size, the grad
    mode), no graph break."""
    compile_with(monkeypatch, lambda graph, example_inputs: graph.forward)
    model = ImageClassifier(arch="resnet_tiny", compile=compiled)
    with caplog.at_level(logging.INFO):  # the report's lines go through Lightning's rank-zero logger
        fit_tiny(model, tmp_path, enable_model_summary=False, callbacks=[RunReport()])
    out = "\n".join(record.getMessage() for record in caplog.records)
    epochs = re.findall(r"^epoch \d .*? \| [\d,]+ samples/s \| ([\d.]+) ms/step \| 1 x cpu", out, re.MULTILINE)
    assert len(epochs) == 2 and all(float(ms) > 0 for ms in epochs), out
    compile_lines = [line for line in out.splitlines() if line.startswith("torch.compile:")]
    if compiled:
        assert compile_lines == ["torch.compile: 4 graphs, 3 recompiles, 0 graph breaks, 0 CUDA graphs skipped"], out
    else:
        assert compile_lines == [], out


def test_the_step_time_is_the_median_between_step_starts_and_skips_the_pauses():
    """Marks are step starts (seconds on CPU), ``None`` a validation between them: no interval spans it."""
    assert median(_intervals_ms([0.0, 0.010, 0.022, 0.052, None, 9.0, 9.012])) == pytest.approx(12.0)
    assert _intervals_ms([0.0, None, 1.0]) == [] and _intervals_ms([]) == []


def test_the_run_reports_step_time_is_the_epoch_lines_median_not_a_mean_with_the_first_steps(tmp_path, monkeypatch):
    """One screen said ``step ms 878.3`` in the run report and ``389.4 ms/step`` in the epoch lines: the report's
    was the run's mean, first steps and loading included. Both are the median now: a first step 3 s slower moves
    the mean by 3000 / steps ms and the median not at all."""
    from lightning.pytorch import Callback

    class SlowFirstStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 0 and batch_idx == 0:
                time.sleep(3.0)

    report = RunReport()
    rows = []
    monkeypatch.setattr(
        RunReport, "on_train_end", lambda self, trainer, module: rows.extend(self.device_rows(trainer, module))
    )
    fit_tiny(
        ImageClassifier(arch="resnet_tiny"), tmp_path, enable_model_summary=False, callbacks=[SlowFirstStep(), report]
    )
    [row] = rows
    assert row["step_ms"] == pytest.approx(median(report._step_ms)), row
    assert row["step_ms"] < 3000 / row["steps"] / 2, row  # the mean was at least 3000 / steps


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


# ================================================================================================ host reads
# Ops that need a tensor's value on the host: item()/bool()/float() (all _local_scalar_dense), and ops whose
# output size depends on the data. On a GPU each one waits until the device has computed its input, so the host
# cannot queue the next step while the GPU works. Counted at the dispatcher, they are the same on CPU.
HOST_READS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in HOST_READS:
            self.count[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_training_step_never_waits_for_the_device(workdir, data_dir):
    """The default run (progress bar, checkpointing, run report, preemption, metrics, augmentation) as on a GPU:
    8 more training steps cost no more host reads. Only the bar's redraws read (one per redraw; here it redraws
    at the first and last batch), and the loggers every log_every_n_steps.

    Before this was checked, a step read the device 4 times: torchmetrics' input checks (torch.unique of preds and
    labels, "any NaN?" in MeanMetric) and Lightning's float() of every prog_bar=True value after each batch."""
    callbacks = copy.deepcopy(DEFAULT_CALLBACKS)
    bar = next(c for c in callbacks if c["class_path"] == "app.callbacks.ProgressBar")
    bar["init_args"] = {"refresh_seconds": 3600}
    (workdir / "callbacks.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))

    def host_reads(steps: int) -> collections.Counter[str]:
        with HostReads() as reads:
            run_cli(
                "fit", "--config", str(CPU_TEST_CONFIG), "--config", "callbacks.yaml", f"--data.data_dir={data_dir}",
                "--data.augment=true", "--data.batch_size=8", "--trainer.max_epochs=1", "--trainer.limit_val_batches=2",
                f"--trainer.limit_train_batches={steps}", "--trainer.log_every_n_steps=1000",
                "--trainer.enable_progress_bar=true",
            )  # fmt: skip
        return reads.count

    few, more = host_reads(4), host_reads(12)
    assert few["_local_scalar_dense"] > 0  # the counter sees reads (loading and checking the data, epoch end)
    assert more == few, f"host reads per training step: {dict(more - few)} over 8 more steps"


# ================================================================================================ lazy train/loss
class _CountingLogs(ImageClassifier):
    """The module as it is, counting its train/loss logs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_logs = 0

    def log(self, name, *args, **kwargs) -> None:
        self.step_logs += name == "train/loss"
        super().log(name, *args, **kwargs)


class _EveryStep(_CountingLogs):
    """The module as it was: train/loss logged at every training step."""

    @staticmethod
    def _step_value_read(trainer, batch_idx: int) -> bool:
        return True


class _Reads(Callback):
    """What callbacks read where the loop leaves training (validation, epoch end), and what the bar would show."""

    def __init__(self) -> None:
        self.seen: list = []
        self.bar = ProgressBar()

    def _read(self, trainer, where: str) -> None:
        self.seen.append((where, trainer.global_step, float(trainer.callback_metrics["train/loss"])))

    def on_validation_end(self, trainer, pl_module) -> None:
        self._read(trainer, "validation")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._read(trainer, "epoch end")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if pl_module.step_values:  # the bar shows the latest step's loss, logged or not
            shown = self.bar.get_metrics(trainer, pl_module)["train/loss"]
            self.seen.append(("bar", trainer.global_step, shown == float(pl_module.step_values["train/loss"])))


def _fit_and_read(module_cls, root: Path, data_dir: Path, **trainer_kwargs) -> tuple[list, list, int]:
    seed_everything(0)
    model = module_cls(arch="resnet_tiny")
    data = FashionMNISTDataModule(data_dir=str(data_dir), source="synthetic", batch_size=4, val_size=64)
    reads = _Reads()
    trainer = Trainer(
        accelerator="cpu",
        limit_train_batches=10,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(root),
        callbacks=[reads],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model, data)
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return rows, reads.seen, model.step_logs


@pytest.mark.parametrize(
    "settings",
    [
        {"max_epochs": 2, "log_every_n_steps": 3, "val_check_interval": 4},
        {"max_epochs": 2, "log_every_n_steps": 2, "accumulate_grad_batches": 3},
        {"max_steps": 13, "log_every_n_steps": 4, "check_val_every_n_epoch": None, "val_check_interval": 7},
    ],
    ids=["val-every-4", "accumulate-3", "max-steps-val-by-total-batches"],
)
def test_train_loss_logged_only_where_read_gives_what_logging_every_step_gave(tmp_path, data_dir, settings):
    """train/loss is logged at the steps whose values reach the loggers or callbacks, not at every step (a
    self.log costs Lightning about 0.3 ms of host time): metrics.csv, callback_metrics where the loop leaves
    training, and the progress bar are the same as with a log at every step."""
    rows, seen, logs = _fit_and_read(_CountingLogs, tmp_path / "lazy", data_dir, **settings)
    every_rows, every_seen, every_logs = _fit_and_read(_EveryStep, tmp_path / "every", data_dir, **settings)
    assert rows == every_rows
    assert any(r["train/loss"] for r in rows)
    assert seen == every_seen
    assert all(ok for where, _, ok in seen if where == "bar")
    assert logs < every_logs


def test_the_benchmark_leaves_dp_out_under_compile(capsys):
    """``python -m bench --compile`` (the GPU benchmark) ran dp, which the model refuses with compile, and died."""
    assert [s for _, s, _ in bench_runs("auto,dp,ddp", compile=True, cuda=True)] == ["auto", "ddp"]
    assert "dp left out" in capsys.readouterr().out
    assert [s for _, s, _ in bench_runs("auto,dp,ddp", compile=False, cuda=True)] == ["auto", "dp", "ddp"]
    assert bench_runs("ddp", compile=False, cuda=False)[-1] == ("cli.py fit ddp x2 (processes)", "ddp", 2)


def test_peak_flops_tells_the_h100_pcie_from_the_sxm(monkeypatch):
    from bench.__main__ import peak_flops

    cuda = torch.device("cuda", 0)
    for name, bf16, fp32 in (("NVIDIA H100 PCIe", 756e12, 378e12), ("NVIDIA H100 80GB HBM3", 989e12, 494e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(cuda, "bf16-mixed", None) == bf16 and peak_flops(cuda, "32-true", None) == fp32


def test_a_cpu_benchmark_on_a_gpu_host_is_tagged_cpu(monkeypatch, tmp_path):
    """bench.reductions runs on gloo/CPU: its results are not 'cuda' figures because a GPU is visible."""
    import bench.report

    monkeypatch.setattr(bench.report, "RESULTS", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    path = bench.report.record("reductions", "bench.reductions", [{"a": 1.0}], ["a"], device="cpu")
    assert path.name == "reductions-cpu.md" and "H100" not in path.read_text()


def test_the_cudagraph_probe_counts_what_torchs_logs_say():
    """bench.cudagraphs reads the mechanisms off TORCH_LOGS lines (issue 44): each counted, re-record reasons kept."""
    from bench.cudagraphs import summarize

    log = "\n".join(
        [
            "I1126 [0/0] [__cudagraphs] [0] Recording function=0, mode=FORWARD, cuda_graph_id=0, inputs: 75",
            "D1126 [0/0] [__cudagraphs] [0] Re-recording function=0, mode=FORWARD, reason=static input data pointer "
            "changed",
            "D1126 [0/0] [__cudagraphs] [0] Re-recording function=0, mode=FORWARD, reason=static input data pointer "
            "changed",
            "D1126 [0/0] [__cudagraphs] [0] Running warmup function=1, mode=BACKWARD",
            "W1126 [__perf_hints] skipping cudagraphs due to mutated inputs (2 instances)",
            "V1126 [0/1] [__recompiles] Recompiling function forward in resnet.py:285",
        ]
    )
    steps = {"host_ms": [3.0, 1.0, 2.0, 10.0], "device_ms": [], "dynamo": {"unique_graphs": 2}}
    row = summarize("cli", steps, log)
    assert row["host ms median/p90/max"] == "2.50/10.00/10.00" and "device ms median/p90/max" not in row
    assert (row["recorded"], row["re-recorded"], row["warm-up runs"], row["skipped graphs"]) == (1, 2, 1, 1)
    assert (row["recompiles"], row["perf hints"], row["dynamo unique_graphs"]) == (1, 1, 2)
    assert row["re-record reasons"] == "2x static input data pointer changed"
    assert row["ms per step"] == 4.0  # the mean step-to-step time (on CPU, the host's): what an epoch takes


def test_the_cudagraph_probe_gives_each_variant_its_spread_and_ratio_to_the_plain_loop_of_its_repeat():
    from bench.cudagraphs import spread

    rows = [
        {"repeat": 1, "variant": "plain", "ms per step": 4.0},
        {"repeat": 1, "variant": "cli", "ms per step": 5.0},
        {"repeat": 2, "variant": "plain", "ms per step": 2.0},
        {"repeat": 2, "variant": "cli", "ms per step": 2.0},
        {"repeat": 3, "variant": "plain", "ms per step": 4.0},
        {"repeat": 3, "variant": "cli", "ms per step": 8.0},
    ]
    rows += [  # a +device variant against the plain loop on the device, in the same repeat; a failed run is left out
        {"repeat": 1, "variant": "plain+device", "ms per step": 3.0},
        {"repeat": 1, "variant": "cli+device", "ms per step": 4.0},
        {"repeat": 2, "variant": "plain+device", "ms per step": None, "failed": 1},
        {"repeat": 2, "variant": "cli+device", "ms per step": 6.0},
    ]
    table = spread(rows).splitlines()
    assert table[2] == "| plain | 3 | 4.000 (2.000-4.000) | 1.000 (1.000-1.000) |"
    assert table[3] == "| cli | 3 | 5.000 (2.000-8.000) | 0.800 (0.500-1.000) |"
    assert table[4] == "| plain+device | 1 | 3.000 (3.000-3.000) | 1.000 (1.000-1.000) |"
    assert table[5] == "| cli+device | 2 | 5.000 (4.000-6.000) | 0.750 (0.750-0.750) |"


def test_a_failed_variant_of_the_probe_is_said_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """One GPU call measures every variant: a variant that fails is reported with the end of its log, not raised."""
    import argparse

    import bench.cudagraphs as probe

    monkeypatch.setattr(probe, "command", lambda *a: [sys.executable, "-c", "print('no such strategy'); exit(3)"])
    args = argparse.Namespace(repeats=2, timeout=60)
    row = probe.run_variant("cli@nosuch", args, tmp_path, tmp_path, repeat=1)
    assert row == {"repeat": 2, "variant": "cli@nosuch", "ms per step": None, "failed": 3}
    err = capsys.readouterr().err
    assert "cli@nosuch failed (exit 3)" in err and "no such strategy" in err


@pytest.mark.slow
def test_the_cudagraph_probe_runs_its_variants(tmp_path):
    """The probe a GPU session runs in one command, on CPU and eager: the plain loop, and Lightning alone with step
    marks and the training set on the device, each timed step by step in a fresh process."""
    from bench.cudagraphs import main

    rows = main(
        ["--device=cpu", "--no-compile", "--arch=resnet_tiny", "--batch-size=8", "--steps=3"]
        + ["--variants=plain,lightning+mark+device", "--no-record", f"--data-dir={tmp_path}"]
    )
    assert [(row["repeat"], row["variant"]) for row in rows] == [(1, "plain"), (1, "lightning+mark+device")]
    assert all(row["ms per step"] > 0 for row in rows)
    assert [row["steps"] for row in rows] == [2, 2]  # the timed steps' intervals (the last epoch's, after warm-up)
    assert all(float(row["host ms median/p90/max"].split("/")[0]) > 0 for row in rows)


def test_the_kernel_profile_counts_its_steps_and_writes_its_tables(tmp_path):
    """``+kernels`` (bench.cudagraphs.KernelProfile): per-step figures over the steps between start and stop, and the
    tables beside them; on CPU there are no kernels and no waits, and a second stop changes nothing."""
    from bench.cudagraphs import KernelProfile

    net = torch.nn.Linear(8, 2)
    profile = KernelProfile(tmp_path / "k.json")
    net(torch.randn(4, 8)).sum().backward()  # before start: not counted
    profile.step()
    profile.start()
    for _ in range(3):
        net(torch.randn(4, 8)).sum().backward()
        profile.step()
    profile.stop()
    profile.stop()
    summary = json.loads((tmp_path / "k.json").read_text())
    assert summary["steps"] == 3 and summary["kernels per step"] == 0 and summary["waits per step"] == {}
    assert "host calls by own time" in (tmp_path / "k.txt").read_text()


def test_the_probe_gives_the_fused_optimizer_to_the_plain_loop_and_to_cli_py_alike(tmp_path):
    """``+fused``: the same optimizer change on both sides of the comparison (SGD's ``fused=True``)."""
    import argparse

    from bench.cudagraphs import command

    args = argparse.Namespace(
        arch="resnet_tiny", batch_size=8, steps=3, precision="32", source="synthetic", device="cpu",
        channels_last=False, compile=False, compile_mode="default", baseline=None,
    )  # fmt: skip
    assert "--fused-optimizer" in command("plain+device+fused", args, tmp_path)
    assert "--model.optimizer.init_args.fused=true" in command("cli@ddp+fused", args, tmp_path)
    assert not any(part.endswith(("fused=true", "--fused-optimizer")) for part in command("cli+device", args, tmp_path))
