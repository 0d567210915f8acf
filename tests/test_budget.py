"""tests/budget.py on trial with made-up figures (the real ones are in docs/testing.md): a whole run over its time
budget fails and names the files over theirs; under CI, a skip this machine should not make fails the run."""

import time
from types import SimpleNamespace

import pytest

from tests.budget import FILE_SECONDS, Budget


def finish(plugin: Budget, seconds: float) -> int:
    plugin.started = time.monotonic() - seconds
    session = SimpleNamespace(exitstatus=0)
    plugin.pytest_sessionfinish(session, 0)
    return session.exitstatus


def report(nodeid: str, seconds: float, skipped: str = "") -> SimpleNamespace:
    longrepr = (nodeid, 1, f"Skipped: {skipped}") if skipped else None
    return SimpleNamespace(nodeid=nodeid, duration=seconds, skipped=bool(skipped), longrepr=longrepr)


def test_a_whole_run_over_its_budget_fails_naming_the_files_over_theirs(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    plugin = Budget("make test")
    plugin.pytest_runtest_logreport(report("tests/test_elastic.py::test_a", FILE_SECONDS["tests/test_elastic.py"] + 90))
    plugin.pytest_runtest_logreport(report("tests/test_cli.py::test_b", 1.0))
    plugin.pytest_runtest_logreport(report("tests/test_new.py::test_c", 61.0))  # no budget listed: 60 s
    assert finish(plugin, 41 * 60) == pytest.ExitCode.TESTS_FAILED
    error = plugin.lines[-1]
    assert error.startswith("error: make test took 41 min 0 s, over its budget of 40 min 0 s")
    assert "tests/test_elastic.py" in error and "tests/test_new.py 61 s (budget 60 s)" in error
    assert "test_cli.py" not in error


def test_within_budget_it_says_the_time_and_passes(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    plugin = Budget("make test-fast")
    assert finish(plugin, 50) == 0
    assert plugin.lines == ["time budget (make test-fast): 0 min 50 s of 2 min 0 s"]
    assert finish(Budget("make test-fast"), 121) == pytest.ExitCode.TESTS_FAILED


def test_a_run_of_a_selection_has_no_budget(monkeypatch):
    plugin = Budget(None)
    assert finish(plugin, 10_000) == 0 and plugin.lines == []


@pytest.mark.parametrize("ci", [True, False])
def test_under_ci_a_skip_this_machine_should_not_make_fails_the_run(ci, monkeypatch):
    monkeypatch.setenv("CI", "true" if ci else "false")
    plugin = Budget("make test", extra_skips="the real Fashion-MNIST is not installed")
    plugin.pytest_runtest_logreport(report("tests/test_gpu.py::test_a", 0, skipped="no CUDA device"))
    plugin.pytest_runtest_logreport(report("tests/x.py::test_b", 0, skipped="the real Fashion-MNIST is not installed"))
    plugin.pytest_runtest_logreport(report("tests/test_two_nodes.py::test_c", 0, skipped="no `ip` command"))
    assert finish(plugin, 60) == (pytest.ExitCode.TESTS_FAILED if ci else 0)
    errors = [line for line in plugin.lines if line.startswith("error")]
    assert errors == (["error: skipped on CI, where it can run: tests/test_two_nodes.py::test_c: no `ip` command"] * ci)


def test_what_counts_as_a_whole_run():
    from tests.budget import whole_run

    def config(args=("tests",), keyword="", markexpr="", deselect=()):
        option = SimpleNamespace(keyword=keyword, markexpr=markexpr, deselect=list(deselect), lf=False)
        return SimpleNamespace(args=list(args), option=option, getini=lambda name: ["tests"])

    assert whole_run(config()) == "make test"
    assert whole_run(config(markexpr="not slow")) == "make test-fast"
    assert whole_run(config(args=["tests/test_cli.py"])) is None
    assert whole_run(config(keyword="budget")) is None
    assert whole_run(config(markexpr="slow")) is None
