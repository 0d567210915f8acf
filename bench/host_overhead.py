"""What Lightning and the template's default callbacks cost the host per training step, on a model that costs next to
nothing.

    python -m bench.host_overhead                  # 1,000 timed steps after 100 of warm-up, on CPU
    python -m bench.host_overhead --steps 3000 --repeats 3
    python -m bench.host_overhead --actions        # and where each microsecond goes (Lightning's profiler hooks)

A compiled GPU step of the example (ResNet-18, batch 256, CUDA graphs) takes about 3.7 ms of device time, and the
host has to issue the next one within it: whatever Lightning and the callbacks do on the host per step is the
headroom ``cli.py`` loses against a plain loop (issue 44). This runs the same trivial task (one ``Linear`` layer,
batches of one sample) several ways, each in this process:

- ``plain``: a hand-written loop over the same loader, model and optimizer (the floor);
- ``lightning``: Lightning alone, no callbacks, no logger;
- ``template``: with what ``app.run.defaults.trainer_defaults`` adds (the default callbacks, the loggers), less the
  progress bar (a terminal's cost, not a step's);
- ``template`` again with each default callback's per-step hooks timed: the microseconds each hook body takes per
  step, and the rest of the difference, which is Lightning calling every hook of every callback whether it does
  anything or not.

With ``--actions``, the template's run again under :class:`StepActions`, Lightning's own profiler interface: every
action Lightning names (each hook of each callback and of the module, the strategy's step, backward, the fetch of the
next batch), microseconds per step of its own time (its nested actions' time taken out), and what no action covers
(the loops themselves). ``python -m bench.cudagraphs`` uses the same profiler on the GPU (its ``+actions``).

Figures are host milliseconds per step; they depend on the machine (quote them with it) and are noisy on a busy one:
``--repeats`` alternates the runs and prints each.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import tempfile
import time
import warnings
from collections import Counter

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.profilers import Profiler
from torch.utils.data import DataLoader, TensorDataset

from app.run.defaults import trainer_defaults
from app.task import step_value_read

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
        return (self.layer(x) - y).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if step_value_read(self.trainer, batch_idx):  # as the template's task logs: at the steps where it is read
            self.log("train/loss", outputs["loss"])

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


class StepActions(Profiler):
    """Lightning's profiler interface, timing each action it names with ``perf_counter_ns``: its own time (less its
    nested actions') and calls, over the last training epoch. At the end, ``actions()`` gives microseconds per step
    for each; with ``$BENCH_ACTIONS`` set, ``cli.py fit --trainer.profiler=bench.host_overhead.StepActions`` writes
    them there as JSON. About 0.5 us per action of its own (two clock reads and a few dict updates)."""

    EPOCH_START = re.compile(r"^\[LightningModule\]\w+\.on_train_epoch_start$")

    def __init__(self) -> None:
        super().__init__()
        self._stack: list[list] = []  # [name, start ns, nested ns]
        self._own: Counter = Counter()
        self._calls: Counter = Counter()
        self.steps = 0

    def start(self, action_name: str) -> None:
        if self.EPOCH_START.match(action_name):  # a new epoch: keep only the last one's (compiled and warm)
            self._own, self._calls, self.steps = Counter(), Counter(), 0
        self.steps += action_name == "run_training_batch"
        self._stack.append([action_name, time.perf_counter_ns(), 0])

    def stop(self, action_name: str) -> None:
        now = time.perf_counter_ns()
        for depth in range(len(self._stack) - 1, -1, -1):  # actions close in order; a stray stop is ignored
            if self._stack[depth][0] == action_name:
                break
        else:
            return
        name, begun, nested = self._stack.pop(depth)
        del self._stack[depth:]
        self._own[name] += now - begun - nested
        self._calls[name] += 1
        if self._stack:
            self._stack[-1][2] += now - begun

    def actions(self) -> dict[str, dict]:
        """Each action called at least once per training step: its own microseconds and its calls, per step."""
        steps = max(self.steps, 1)
        per_step = {name: (ns / steps / 1e3, self._calls[name] / steps) for name, ns in self._own.most_common()}
        return {  # (ModelCheckpoint's name holds its settings: left out)
            re.sub(r"\{.*\}", "", name): {"us": round(us, 2), "calls": round(calls, 2)}
            for name, (us, calls) in per_step.items()
            if calls >= 1
        }

    def summary(self) -> str:
        if os.environ.get("BENCH_ACTIONS") and self.local_rank in (0, None):
            with open(os.environ["BENCH_ACTIONS"], "w") as out:
                json.dump({"steps": self.steps, "actions": self.actions()}, out)
        return ""


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


def plain(steps: int, skip: int = 100, phases: Counter | None = None) -> float:
    """Host milliseconds per step of a hand-written loop over the same loader, model and optimizer; with ``phases``,
    the nanoseconds of each part of it (the fetch, the step, zero_grad, backward, the optimizer's step) added up."""
    data = DataLoader(TensorDataset(torch.randn(skip + steps + 1, 4), torch.randn(skip + steps + 1, 1)), batch_size=1)
    model = Trivial()
    optimizer = model.configure_optimizers()
    batches, clock = iter(data), time.perf_counter_ns
    for i in range(skip + steps + 1):
        if i == skip:
            start, phases = time.perf_counter(), phases if phases is not None else Counter()
        elif i == skip + steps:
            return (time.perf_counter() - start) / steps * 1000
        t0 = clock()
        x, y = next(batches)
        t1 = clock()
        loss = model.training_step((x, y), i)
        t2 = clock()
        optimizer.zero_grad()
        t3 = clock()
        loss.backward()
        t4 = clock()
        optimizer.step()
        t5 = clock()
        if i >= skip:
            for name, ns in zip(PLAIN_PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                phases[name] += ns
    raise AssertionError("the loader ran out")


PLAIN_PHASES = ("next(batches)", "training_step", "zero_grad", "backward", "optimizer.step")


def run(
    kind: str, steps: int, skip: int = 100, spent: Counter | None = None, profiler: Profiler | None = None
) -> float:
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
        enable_progress_bar=False, callbacks=[*callbacks, clock], profiler=profiler, **settings,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # the run's own lines (the epoch line, the run report)
        trainer.fit(Trivial(), data)
    return clock.seconds / steps * 1000


def action_table(actions: dict[str, dict], step_us: float, floor: float = 2.0) -> list[str]:
    """Lines: the actions of at least ``floor`` us per step, the smaller ones together, and what no action covers."""
    lines, small = [], 0.0
    for name, figures in sorted(actions.items(), key=lambda item: -item[1]["us"]):
        if figures["us"] >= floor:
            lines.append(f"    {figures['us']:7.1f} us  {name} (x{figures['calls']:g})")
        else:
            small += figures["us"]
    covered = sum(figures["us"] for figures in actions.values())
    calls = sum(figures["calls"] for figures in actions.values())
    lines.append(f"    {small:7.1f} us  the other actions under {floor:g} us each")
    lines.append(f"    {step_us - covered:7.1f} us  in no action (the loops' own code, the clock callback)")
    lines.append(f"  ({calls:.0f} actions per step)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per run (after 100 of warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the runs this many times")
    parser.add_argument("--actions", action="store_true", help="and each Lightning action's microseconds per step")
    args = parser.parse_args(argv)
    with quiet_and_one_thread():
        measure(args.steps, args.repeats, args.actions)


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


def measure(steps: int, repeats: int, actions: bool = False) -> None:
    for repeat in range(repeats):
        phases: Counter = Counter()
        floor, alone, template = plain(steps, phases=phases), run("lightning", steps), run("template", steps)
        spent: Counter = Counter()
        timed = run("template", steps, spent=spent)
        bodies = sum(spent.values()) / steps / 1e6
        print(f"repeat {repeat + 1}: host ms per step over {steps} steps (torch {torch.__version__}, CPU)")
        print(f"  plain loop             {floor:7.3f}")
        if actions:
            for name in PLAIN_PHASES:
                print(f"    {phases[name] / steps / 1000:7.1f} us  {name}")
        print(f"  Lightning alone        {alone:7.3f}  (+{alone - floor:.3f}, x{alone / floor:.2f})")
        print(f"  with the template's    {template:7.3f}  (+{template - alone:.3f}, x{template / alone:.2f})")
        print(f"  of which hook bodies   {bodies:7.3f}  (the rest: calling every hook of every callback)")
        for name, ns in spent.most_common():
            print(f"    {ns / steps / 1000:7.1f} us  {name}")
        print(f"  (the hook-timed run: {timed:.3f} ms per step)")
        if actions:
            for kind in ("lightning", "template"):
                profiler = StepActions()
                ms = run(kind, steps, profiler=profiler)
                print(f"  {kind} under StepActions: {ms:.3f} ms per step; own us per step of each action")
                print("\n".join(action_table(profiler.actions(), ms * 1000)))


if __name__ == "__main__":
    main()
