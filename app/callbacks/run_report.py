"""What a run did, per epoch and per device: seconds, samples/s, step time and peak memory.

Each epoch prints one line, like d2l's::

    epoch 3 | train loss 0.4120 | val loss 0.3871 | 12.3 s | 4,567 samples/s | 3.7 ms/step | 2 x cuda (ddp)

(the train loss is the epoch's mean loss per sample, whatever ``accumulate_grad_batches``, over the batches this run
trained: an epoch taken up part-way by a resume says ``train loss 0.4120 (since the resume)``; the validation figure
is the metric the task's ``spec.monitor`` names; samples are what ``spec.samples`` counts: images, sequences, ...;
a data module's ``epoch_note`` ends every line, e.g. ``| SYNTHETIC data``: see app/task.py)

``ms/step`` is the epoch's median time from one optimizer step's first batch to the next's (between validations): on a
GPU between CUDA events, read at the epoch's end, so nothing waits inside the epoch. A regression in the step
itself (a graph that stopped replaying, a new synchronisation) shows there, while the seconds also count start-up,
compilation and validation.

The end of training prints a table with one row per device: optimizer steps, the median time per optimizer step over
the run (the epoch lines' ``ms/step``, over all of them), samples/s and peak memory
(``torch.cuda.max_memory_allocated`` on GPUs, the process's peak resident memory on CPU).
Under ``dp`` device 0 holds the master weights and gathers every output, so its peak memory stands above the
others'; under ``ddp`` the rows are even. Where ``torch.compile`` ran during training, a line follows with what it
did in the fit (its sanity check included): graphs compiled, recompiles, graph breaks and CUDA graphs skipped
(a network compiled with fixed shapes compiles one graph per batch shape and grad mode; more recompiles or any
graph break is worth a look).
"""

from __future__ import annotations

import math
import resource
import time
from statistics import median

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from app.callbacks.progress import console_print
from app.parallelism import parallelism
from app.task import count_samples, epoch_note, spec_of

_FIELDS = ("samples", "seconds", "steps", "peak_bytes")
_MAX_MARKS = 4096  # step starts timed per epoch (the median of the first 4,096 steps stands for the epoch)


PER_STEP_HOOKS = (  # the callback hooks of every training and validation batch
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end",
)  # fmt: skip


def skip_inherited_hooks(callbacks) -> int:
    """Set to None, on each callback, the per-step hooks that its class inherits from ``Callback`` (no-ops); returns
    how many. Lightning calls each per-step hook of every callback whether its class defines it or not, with its
    profiler's context and the callback's ``state_key`` (``trainer/call.py``: ``_call_callback_hooks``), and passes
    an attribute that is not callable by (``if callable(fn)``; tests/test_lightning_internals.py checks that it still
    does). For the template's default callbacks that is most calls: 90 actions a step to 28 in
    ``python -m bench.host_overhead``, whose template run costs 0.12 ms over Lightning alone instead of 0.27 (medians
    of three rounds, 2-core CPU)."""
    skipped = 0
    for callback in callbacks:
        for hook in PER_STEP_HOOKS:
            if hook not in vars(callback) and getattr(type(callback), hook, None) is getattr(Callback, hook):
                try:
                    setattr(callback, hook, None)
                except (AttributeError, TypeError):  # (a frozen dataclass, __slots__: called as before)
                    continue
                skipped += 1
    return skipped


class RunReport(Callback):
    """Per-epoch summary line and an end-of-training table per device (on by default in ``cli.py``)."""

    def __init__(self) -> None:
        self._train_seconds = 0.0
        self._started: float | None = None
        self._samples = 0
        self._loss_sum = 0.0
        self._run = dict.fromkeys(_FIELDS, 0.0)
        self._global_step = 0  # trainer.global_step when the last training batch ended
        self._marks: list = []  # each training batch's start (perf_counter, or a CUDA event); None: a pause
        self._step_ms: list[float] = []  # the run's step times so far (each epoch's, up to _MAX_MARKS of them)
        self._compiled_before: dict[str, int] = {}
        self._count = count_samples  # the task's way to count a batch's samples (spec.samples)

    # ---------------------------------------------------------------- timing the training batches
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Host time per step: the hooks no callback of the run defines are not called (app/lightning_internals.py)
        skip_inherited_hooks(trainer.callbacks)
        if stage == "fit":  # the sanity check's validation compiles too: its graphs count
            self._compiled_before = compile_counts()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._run = dict.fromkeys(_FIELDS, 0.0)
        self._step_ms = []
        self._global_step = trainer.global_step  # a resumed run's steps count from here
        self._count = spec_of(pl_module).samples or count_samples  # looked up once: it runs every batch
        for device in _devices(trainer):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        self.on_train_epoch_start(trainer, pl_module)  # a run resumed mid-epoch gets no on_train_epoch_start

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = self._started = time.perf_counter()
        self._train_seconds, self._samples, self._loss_sum = 0.0, 0, 0.0
        self._marks = []
        self._first_batch: int | None = None  # > 0: this run took the epoch up part-way (a resume)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if self._first_batch is None:
            self._first_batch = batch_idx
        # an optimizer step's first batch (with accumulate_grad_batches=k a step is k batches)
        if len(self._marks) < _MAX_MARKS and batch_idx % trainer.accumulate_grad_batches == 0:
            if pl_module.device.type == "cuda":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self._marks.append(event)
            else:
                self._marks.append(time.perf_counter())

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        n = int(self._count(batch))
        self._samples += n
        loss, scale = _batch_loss(trainer, pl_module, outputs)
        if not isinstance(self._loss_sum, torch.Tensor):
            self._loss_sum = torch.zeros((), dtype=torch.float64, device=loss.device)
        self._loss_sum.add_(loss if loss.dim() == 0 else loss.reshape(()), alpha=n * scale)  # one op, no sync
        # optimizer steps, not batches: with accumulate_grad_batches=k only every k-th batch steps
        self._run["steps"] += trainer.global_step - self._global_step
        self._global_step = trainer.global_step

    def _pause(self, pl_module: LightningModule) -> None:
        if self._marks and self._marks[-1] is not None:
            self._marks.append(None)  # no step spans a validation
        if self._started is not None:
            if pl_module.device.type == "cuda":  # count the kernels still queued, not just their launch
                torch.cuda.synchronize(pl_module.device)
            self._train_seconds += time.perf_counter() - self._started
            self._started = None

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._pause(pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and trainer.training:
            self._started = time.perf_counter()

    # ---------------------------------------------------------------- the epoch line
    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause(pl_module)
        self._run["samples"] += self._samples
        self._run["seconds"] += self._train_seconds
        # Every rank reaches this hook, so the reduction is safe; it makes the numbers global.
        loss_sum = torch.as_tensor(self._loss_sum, dtype=torch.float64, device=pl_module.device).reshape(1)
        totals = torch.cat([torch.tensor([self._samples], dtype=torch.float64, device=pl_module.device), loss_sum])
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
        stages = parallelism(trainer.strategy).stages  # a pipeline's stages all see each of its samples
        samples, loss_sum = (total / stages for total in totals.tolist())
        seconds = time.perf_counter() - self._epoch_start
        parts = [f"epoch {trainer.current_epoch}"]
        if samples:  # resumed mid-epoch: the loss of the batches this run trained, which the line says
            resumed = " (since the resume)" if self._first_batch else ""
            parts.append(f"train loss {loss_sum / samples:.4f}{resumed}")
        monitor = spec_of(pl_module).monitor  # the task's headline metric (val/loss -> "val loss 0.3871")
        value = trainer.callback_metrics.get(monitor) if monitor else None
        if value is not None:
            parts.append(f"{monitor.replace('/', ' ').replace('_', ' ')} {float(value):.4f}")
        devices = (
            f"{max(trainer.num_devices * trainer.num_nodes, trainer.world_size)} x {trainer.strategy.root_device.type}"
        )
        note = [n] if (n := epoch_note(pl_module, trainer.datamodule)) else []  # what the data module says of its data
        if not samples:  # resumed (a restart, a stop in validation) after the epoch's last training batch
            console_print(
                trainer,
                " | ".join([*parts, "resumed after its training", f"{devices} ({strategy_name(trainer)})", *note]),
            )
            return
        intervals = _intervals_ms(self._marks)
        self._step_ms += intervals
        step_ms = median(intervals) if intervals else None
        parts += [
            f"{seconds:.1f} s",
            f"{samples / max(self._train_seconds, 1e-9):,.0f} samples/s",
            *([f"{step_ms:.1f} ms/step"] if step_ms is not None else []),
            f"{devices} ({strategy_name(trainer)})",
            *note,
        ]
        console_print(trainer, " | ".join(parts))
        # (the metric keeps its name, which metrics.csv readers and cli.py plot know: it counts samples too)
        pl_module.log(
            "perf/images_per_s", samples / max(self._train_seconds, 1e-9), on_epoch=True, batch_size=1, sync_dist=True
        )
        pl_module.log("perf/epoch_seconds", seconds, on_epoch=True, batch_size=1, sync_dist=True)

    # ---------------------------------------------------------------- the table per device
    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows = self.device_rows(trainer, pl_module)
        if trainer.is_global_zero and rows:
            console_print(trainer, device_table(rows, f"Run report: {strategy_name(trainer)}, {len(rows)} device(s)"))
        compiled = {k: v - self._compiled_before.get(k, 0) for k, v in compile_counts().items()}
        if trainer.is_global_zero and compiled.get("graphs"):
            console_print(trainer, compile_line(compiled))

    def device_rows(self, trainer: Trainer, pl_module: LightningModule) -> list[dict]:
        """One dict per device (all ranks' numbers, gathered; call on every rank)."""
        devices = _devices(trainer)
        peaks = [_peak_bytes(d) for d in devices]
        local = torch.tensor(
            [
                [
                    # its share: a pipeline's stages all see each sample, so the column adds up to the epoch line's
                    self._run["samples"] / len(devices) / parallelism(trainer.strategy).stages,
                    self._run["seconds"],
                    self._run["steps"],
                    peak,
                    median(self._step_ms) if self._step_ms else math.nan,  # as the epoch lines' ms/step
                    _index(d, i, devices),
                ]
                for i, (d, peak) in enumerate(zip(devices, peaks, strict=True))
            ],
            dtype=torch.float64,
            device=pl_module.device,
        )
        gathered = _gather(local).reshape(-1, len(devices), len(_FIELDS) + 2)
        rows = []
        for rank, per_rank in enumerate(gathered.tolist()):
            for samples, seconds, steps, peak, step_ms, index in per_rank:
                rows.append(
                    {
                        "rank": rank,
                        "device": devices[0].type if index < 0 else f"{devices[0].type}:{int(index)}",
                        "steps": int(steps),
                        # the median step, as the epoch lines' ms/step (the mean over the run counts its first steps
                        # and loading too: 878 ms against the lines' 389 on one screen); one step: its time
                        "step_ms": step_ms if math.isfinite(step_ms) else 1000 * seconds / max(steps, 1),
                        "samples_per_s": samples / max(seconds, 1e-9),
                        "peak_mib": peak / 2**20,
                    }
                )
        return rows


def device_table(rows: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title)
    for name in ("rank", "device", "steps", "step ms", "samples/s", "peak memory MiB"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            str(r["rank"]),
            r["device"],
            str(r["steps"]),
            f"{r['step_ms']:.1f}",
            f"{r['samples_per_s']:,.0f}",
            f"{r['peak_mib']:,.0f}",
        )
    return table


def compile_counts() -> dict[str, int]:
    """What ``torch.compile`` has done in this process so far (Dynamo's counters: no public API has them)."""
    try:
        from torch._dynamo.utils import counters, guard_failures
    except ImportError:  # pragma: no cover - a torch without Dynamo
        return {}
    return {
        "graphs": counters["stats"]["unique_graphs"],
        # each recompile of a function lists a failed guard per graph it had ("0/1: ..."): its graphs before it
        "recompiles": sum(len({reason.partition(":")[0] for reason in reasons}) for reasons in guard_failures.values()),
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


def compile_line(counts: dict[str, int]) -> str:
    """``torch.compile: 4 graphs, 2 recompiles, 0 graph breaks, 0 CUDA graphs skipped``"""

    def n(count: int, what: str) -> str:
        return f"{count} {what}" + ("" if count == 1 else "s")

    return "torch.compile: " + ", ".join(
        [
            n(counts["graphs"], "graph"),
            n(counts["recompiles"], "recompile"),
            n(counts["graph_breaks"], "graph break"),
            f"{counts['cudagraph_skips']} CUDA graphs skipped",
        ]
    )


def _intervals_ms(marks: list) -> list[float]:
    """The times between consecutive step starts (``None`` marks a pause), in milliseconds."""
    events = [mark for mark in marks if isinstance(mark, torch.cuda.Event)]
    if events:
        events[-1].synchronize()  # done already where the epoch's end waited for the device; cheap if so
    intervals = []
    for a, b in zip(marks, marks[1:], strict=False):
        if a is None or b is None:
            continue
        intervals.append(a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1000)
    return intervals


def _batch_loss(trainer: Trainer, pl_module: LightningModule, outputs) -> tuple[torch.Tensor, int]:
    """The batch's own mean loss is the returned tensor (detached) times the returned factor: the step output's
    ``batch_loss`` when the task returns one, else its ``loss`` as the task computed it. Under automatic optimization
    Lightning hands the hooks that loss divided by ``accumulate_grad_batches`` (what backward gets, so that k
    batches add up to one step's gradient); read as it is, the epoch's loss was 1/k of the task's, and jumped when a
    resume changed k. (A factor, not a product: the caller folds it into its one operation per batch.)"""
    if isinstance(outputs, dict) and "batch_loss" in outputs:
        return outputs["batch_loss"].detach(), 1
    loss = (outputs["loss"] if isinstance(outputs, dict) else outputs).detach()
    return loss, trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1


def _gather(local: torch.Tensor) -> torch.Tensor:
    """All processes' rows, rank by rank (torch.distributed's own all_gather: Lightning's strategies go through a
    deprecated autograd variant that warns)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.cat(gathered)


def _devices(trainer: Trainer) -> list[torch.device]:
    """The devices this process drives: all of dp's, else the strategy's root device."""
    strategy = trainer.strategy
    if parallelism(strategy).devices_per_process > 1:
        return list(strategy.parallel_devices)
    return [strategy.root_device]


def _index(device: torch.device, position: int, devices: list[torch.device]) -> int:
    """The device's index; a process's CPU devices (dp on CPU emulates several) are told apart by position."""
    if device.index is not None:
        return device.index
    return position if len(devices) > 1 else -1


def _peak_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB


def strategy_name(trainer: Trainer) -> str:
    return parallelism(trainer.strategy).label
