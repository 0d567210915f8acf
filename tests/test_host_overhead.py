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
