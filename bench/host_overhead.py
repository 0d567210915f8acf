"""What the template's default callbacks cost the host per training step, on a model that costs next to nothing.

    python -m bench.host_overhead                  # 1,000 timed steps after 100 of warm-up, on CPU
    python -m bench.host_overhead --steps 3000 --repeats 3

A compiled GPU step of the example (ResNet-18, batch 256, CUDA graphs) takes about 3.7 ms of device time, and the
host has to issue the next one within it: whatever Lightning and the callbacks do on the host per step is the
headroom ``cli.py`` loses against a plain loop (issue 44). This runs the same trivial task (one ``Linear`` layer,
batches of one sample) three ways, each in this process:

- ``lightning``: Lightning alone, no callbacks, no logger;
- ``template``: with what ``app.run.defaults.trainer_defaults`` adds (the default callbacks, the loggers), less the
  progress bar (a terminal's cost, not a step's);
- ``template`` again with each default callback's per-step hooks timed: the microseconds each hook body takes per
  step, and the rest of the difference, which is Lightning calling every hook of every callback whether it does
  anything or not.

Figures are host milliseconds per step; they depend on the machine (quote them with it) and are noisy on a busy one:
``--repeats`` alternates the runs and prints each.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import tempfile
import time
import warnings
from collections import Counter

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from app.run.defaults import trainer_defaults

HOOKS = (  # Lightning calls each of these on every callback at every training batch
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class Trivial(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.layer(x) - y).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepClock(Callback):
    """The time from the start of batch ``skip`` to the start of batch ``skip + steps``."""

    def __init__(self, skip: int, steps: int) -> None:
        self.skip, self.steps, self.seconds = skip, steps, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.skip:
            self._start = time.perf_counter()
        elif batch_idx == self.skip + self.steps:
            self.seconds = time.perf_counter() - self._start


def time_hooks(callbacks: list, spent: Counter) -> None:
    """Wrap each callback's own per-step hooks (not the base class's no-ops) to add their time to ``spent``."""
    for callback in callbacks:
        for hook in HOOKS:
            if getattr(type(callback), hook) is getattr(Callback, hook):
                continue
            bound, name = getattr(callback, hook), f"{type(callback).__name__}.{hook}"

            def timed(*args, _bound=bound, _name=name, **kwargs):
                start = time.perf_counter_ns()
                try:
                    return _bound(*args, **kwargs)
                finally:
                    spent[_name] += time.perf_counter_ns() - start

            setattr(callback, hook, timed)


def run(kind: str, steps: int, skip: int = 100, spent: Counter | None = None) -> float:
    """Host milliseconds per step of ``kind`` (``lightning`` or ``template``)."""
    clock = StepClock(skip, steps)
    data = DataLoader(TensorDataset(torch.randn(skip + steps + 1, 4), torch.randn(skip + steps + 1, 1)), batch_size=1)
    if kind == "lightning":
        settings = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False}
        callbacks = []
    else:
        settings = trainer_defaults(Trivial(), tempfile.mkdtemp(prefix="host-overhead-"))
        callbacks = [c for c in settings.pop("callbacks") if type(c).__name__ != "ProgressBar"]
        settings["enable_model_summary"] = False
        callbacks = [c for c in callbacks if "ModelSummary" not in type(c).__name__]
        if spent is not None:
            time_hooks(callbacks, spent)
    trainer = Trainer(
        max_steps=skip + steps + 1, accelerator="cpu", devices=1, limit_val_batches=0, num_sanity_val_steps=0,
        enable_progress_bar=False, callbacks=[*callbacks, clock], **settings,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # the run's own lines (the epoch line, the run report)
        trainer.fit(Trivial(), data)
    return clock.seconds / steps * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per run (after 100 of warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the runs this many times")
    args = parser.parse_args(argv)
    with quiet_and_one_thread():
        measure(args.steps, args.repeats)


@contextlib.contextmanager
def quiet_and_one_thread():
    """Lightning's info lines and warnings off, one torch thread; all as before afterwards (a caller's process, such
    as a test's, keeps its own settings)."""
    loggers = [logging.getLogger(name) for name in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels, threads = [logger.level for logger in loggers], torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for logger in loggers:
                logger.setLevel(logging.ERROR)
            torch.set_num_threads(1)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        torch.set_num_threads(threads)


def measure(steps: int, repeats: int) -> None:
    for repeat in range(repeats):
        alone, template = run("lightning", steps), run("template", steps)
        spent: Counter = Counter()
        timed = run("template", steps, spent=spent)
        bodies = sum(spent.values()) / steps / 1e6
        print(f"repeat {repeat + 1}: host ms per step over {steps} steps (torch {torch.__version__}, CPU)")
        print(f"  Lightning alone        {alone:7.3f}")
        print(f"  with the template's    {template:7.3f}  (+{template - alone:.3f}, x{template / alone:.2f})")
        print(f"  of which hook bodies   {bodies:7.3f}  (the rest: calling every hook of every callback)")
        for name, ns in spent.most_common():
            print(f"    {ns / steps / 1000:7.1f} us  {name}")
        print(f"  (the hook-timed run: {timed:.3f} ms per step)")


if __name__ == "__main__":
    main()
