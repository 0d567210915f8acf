"""bench/host_overhead.py: the host time per step that the template's default callbacks add to Lightning's."""

import logging
import warnings

import torch

from bench.host_overhead import main


def test_the_bench_prints_both_runs_and_every_default_callbacks_per_step_hooks(capsys):
    loggers = {name: logging.getLogger(name).level for name in ("lightning", "lightning.pytorch")}
    filters, threads = list(warnings.filters), torch.get_num_threads()
    main(["--steps", "30"])
    out = capsys.readouterr().out
    # and this process's settings are as they were: later tests in this worker read Lightning's info lines
    assert {name: logging.getLogger(name).level for name in loggers} == loggers
    assert warnings.filters == filters and torch.get_num_threads() == threads
    alone = float(out.split("Lightning alone")[1].split()[0])
    template = float(out.split("with the template's")[1].split()[0])
    assert alone > 0 and template > 0, out
    # the callbacks that do work at every batch are all timed, by name
    for hook in ("RunReport.on_train_batch_end", "StopOnNonFinite.on_train_batch_end", "Preemption.on_train_batch_end"):
        assert f"us  {hook}" in out, out
    assert "ProgressBar" not in out  # a terminal's cost, left out


def test_the_plain_loop_and_each_lightning_action_per_step(capsys):
    """``--actions``: the plain loop's parts, and each action Lightning names in the template's run; among them only
    the per-step hooks that a callback's class defines (the ones it inherits are not called: RunReport.setup)."""
    from lightning.pytorch import Callback

    from app.callbacks.run_report import PER_STEP_HOOKS
    from bench.host_overhead import StepActions, quiet_and_one_thread, run

    main(["--steps", "30", "--actions"])
    out = capsys.readouterr().out
    assert float(out.split("plain loop")[1].split()[0]) > 0, out
    assert "us  backward" in out and "template under StepActions" in out and "in no action" in out, out
    profiler = StepActions()
    with quiet_and_one_thread():
        run("template", 30, profiler=profiler)
    assert profiler.steps == 30 + 100 + 1
    called = [name.removeprefix("[Callback]") for name in profiler.actions() if name.startswith("[Callback]")]
    per_step = [name for name in called if name.split(".")[-1] in PER_STEP_HOOKS]
    assert "RunReport.on_train_batch_end" in per_step and "RandomState.on_train_batch_start" in per_step, per_step
    import app.callbacks as callbacks

    for name in per_step:
        owner, hook = name.rsplit(".", 1)
        kind = getattr(callbacks, owner, None) or next(c for c in Callback.__subclasses__() if c.__name__ == owner)
        assert getattr(kind, hook) is not getattr(Callback, hook), f"{name}: inherited, yet called every step"
