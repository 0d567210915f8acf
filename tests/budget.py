"""The suite's time budget and its expected skips, checked at the end of every whole run (a pytest plugin, loaded
by tests/conftest.py).

- Time. ``make test`` (the whole suite) has :data:`SUITE_MINUTES`; ``make test-fast`` (``-m "not slow"``) has
  :data:`FAST_MINUTES`, on the project's 2-core machine. A whole run that takes longer fails, with one line naming
  the files over their own budget (:data:`FILE_SECONDS`: seconds of test time, setup and teardown included, summed
  over the workers). A run of some files, ``-k`` or another selection is not held to a budget.
- Skips. Under CI (``CI=true``) a whole run fails on a skip whose reason is not expected on this machine: no CUDA
  device, no horovod build (:data:`EXPECTED_SKIPS`), and what ``.ci/run`` could not install, which it names in
  ``TEMPLATE_EXPECTED_SKIPS`` (a regular expression). Everything else this machine can run, so it must run: the
  two-node tests and the real-data tests skipping because a probe failed would otherwise pass unseen.
- Runs. Under CI a whole ``make test`` also fails when fewer tests ran (passed or failed, not skipped) in the files
  that need the tools ``.ci/run`` installs than :data:`REQUIRED_RUNS` says: the SLURM cluster, the container, the two
  nodes. A group may be missing only when named in ``TEMPLATE_ALLOWED_GROUPS`` (comma-separated), which ``.ci/run``
  sets where it cannot install (not root, or no apt-get), or when its files are gone from the tree (a fork without
  the example). A skip is one way to lose them; a test no longer collected, a fixture that returns early or a
  ``-p no:...`` are others. A ``--collect-only`` run is not held to it.

``.ci/run`` exports ``CI=true`` itself: the rules above hold on CI whoever calls it.

The per-file budgets are about 1.5 times each file's time in a fresh-clone run of 2026-11-27 with other work beside
it (eed8333, 17:35 UTC; docs/testing.md, "Time budget"), raised to 1.5 times the evening's run alone where that was
more (087c0e9, 21:21 UTC, slowed by a nearly full disk), and more where a file's tests
grew since; a new file gets :data:`NEW_FILE_SECONDS` until it is listed.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SUITE_MINUTES = 40
FAST_MINUTES = 2
NEW_FILE_SECONDS = 60
SLOWEST_SHOWN = 12  # files named at the end of a whole run, with their time
FILE_SECONDS = {  # tests/ file -> seconds of test time in a whole `make test` (2 workers)
    "tests/test_elastic.py": 750,
    "tests/test_as_users_run_it.py": 750,
    "tests/test_reliability.py": 600,  # + 5 stopped evaluations: 66 s alone (2026-11-29)
    "tests/test_two_nodes.py": 630,
    "tests/test_slurm_docs.py": 450,  # 5 SLURM jobs: 178 s alone, ~300 s beside other work (2026-11-28), x1.5
    "tests/test_slurm_training.py": 850,  # 16 SLURM jobs: 390 s beside other work (2026-11-28), the silent node +132 s
    "tests/test_slurm.py": 90,  # the cluster up and down: 29 s alone
    "tests/test_slurm_job.py": 90,  # one slow test of two cli.py runs: 39 s beside other work
    "tests/test_fork.py": 400,
    "tests/test_fork_resume.py": 120,  # 4 x 3 cli.py runs of a fork's ViT: 57 s alone (2026-11-28), x2
    "tests/test_trackers.py": 180,  # an MLflow server, 9 cli.py runs (ddp among them): 70 s under -n 2 (2026-11-28)
    "tests/test_chaos.py": 300,
    "tests/test_model_parallel.py": 400,  # + the sharded checkpoint's 5 runs: 43 s, the background saves' 2: 43 s
    "tests/fashion_mnist/test_data.py": 270,
    "tests/fashion_mnist/test_tools.py": 210,
    "tests/test_callbacks.py": 170,
    "tests/test_strategies.py": 160,
    "tests/fashion_mnist/test_example_task.py": 100,
    "tests/test_reductions.py": 120,
    "tests/test_cli.py": 90,
    "tests/fashion_mnist/test_speed_options.py": 80,
    "tests/test_launcher.py": 40,
    "tests/test_formation.py": 160,  # seven runs of two processes: 29 s + 61 s alone, 8 s in-process (2026-11-29)
    "tests/test_divergence.py": 40,
    "tests/test_lightning_internals.py": 30,
    "tests/test_warm.py": 20,
    "tests/fashion_mnist/test_example_cli.py": 20,
    "tests/fashion_mnist/test_networks.py": 10,
    "tests/test_host_overhead.py": 10,
    "tests/test_atomic.py": 10,
    "tests/test_interpreters.py": 10,
    "tests/test_docker.py": 10,
    # 4 min of runs beside other work, x1.5, and a cold build of 4-6 min (docs/docker.md)
    "tests/fashion_mnist/test_container.py": 750,
    "tests/test_budget.py": 40,
    "tests/fashion_mnist/test_gpu_recipe.py": 10,
    "tests/test_gpu.py": 10,
    "tests/test_imports.py": 20,
    "tests/test_layers.py": 10,
    "tests/test_pods.py": 60,  # two cli.py processes as two pods: 29 s alone (2026-11-29)
    "tests/test_streams.py": 100,  # 6 cli.py runs of a streamed tiny task: 53 s alone (2026-11-29)
    "tests/test_kubernetes.py": 360,  # the image's pods on two namespace nodes: 160 s alone (2026-11-29)
    "tests/fashion_mnist/test_shards.py": 90,  # cli.py shards and 3 ddp runs on the shards: 45 s alone (2026-11-29)
    "tests/test_connections.py": 90,  # three pairs of gloo processes, one waiting 12 s: 43 s under load (2026-11-29)
    "tests/test_storage.py": 90,  # memory:// in-process, 3 cli.py runs on an sftp server: 38 s beside other work
}
REQUIRED_RUNS = {  # group -> (its files, the fewest of their tests a whole run under CI must run)
    "slurm": (("tests/test_slurm.py", "tests/test_slurm_training.py", "tests/test_slurm_docs.py"), 20),  # of 22
    "container": (("tests/fashion_mnist/test_container.py", "tests/test_kubernetes.py"), 14),  # of 15
    "two-node": (("tests/test_two_nodes.py",), 14),  # of 16
}
EXPECTED_SKIPS = (
    r"no CUDA device",
    r"needs two CUDA devices",
    r"horovod is not importable",
)


def whole_run(config) -> str | None:
    """``"make test"``, ``"make test-fast"``, or None for a run of a selection."""
    testpaths = [str(p) for p in config.getini("testpaths")]
    selected = [a for a in config.args if a not in testpaths and a.rstrip("/") not in testpaths]
    if selected or config.option.keyword or getattr(config.option, "lf", False) or config.option.deselect:
        return None
    markers = (config.option.markexpr or "").strip()
    return {"": "make test", "not slow": "make test-fast"}.get(markers)


class Budget:
    def __init__(self, kind: str | None, extra_skips: str = "", allowed_groups: str = "") -> None:
        """``kind``: what :func:`whole_run` says; ``extra_skips``: a regular expression of more expected skips;
        ``allowed_groups``: the groups of :data:`REQUIRED_RUNS` that may run fewer tests (comma-separated)."""
        self.kind = kind
        self.started = time.monotonic()
        self.spent: Counter[str] = Counter()
        self.ran: Counter[str] = Counter()  # tests that ran their body, by file
        self.allowed = {group.strip() for group in allowed_groups.split(",") if group.strip()}
        self.skips: list[tuple[str, str]] = []
        self.lines: list[str] = []
        self.expected = re.compile("|".join([*EXPECTED_SKIPS, *([extra_skips] if extra_skips else [])]))

    def pytest_runtest_logreport(self, report) -> None:
        self.spent[report.nodeid.split("::")[0]] += report.duration
        if report.when == "call" and not report.skipped:
            self.ran[report.nodeid.split("::")[0]] += 1
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips.append((report.nodeid, reason.removeprefix("Skipped: ")))

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.kind is None:
            return
        wall = time.monotonic() - self.started
        budget = (SUITE_MINUTES if self.kind == "make test" else FAST_MINUTES) * 60
        self.lines.append(f"time budget ({self.kind}): {_clock(wall)} of {_clock(budget)}")
        if self.kind == "make test":  # where the time goes, for whoever makes the suite faster
            files = ", ".join(f"{f.removeprefix('tests/')} {s:.0f}" for f, s in self.spent.most_common(SLOWEST_SHOWN))
            self.lines.append(f"slowest files (s of test time, both workers): {files}")
        if wall > budget:
            if self.kind == "make test":
                over = sorted(
                    ((s, f) for f, s in self.spent.items() if s > FILE_SECONDS.get(f, NEW_FILE_SECONDS)), reverse=True
                )
                named = [f"{f} {s:.0f} s (budget {FILE_SECONDS.get(f, NEW_FILE_SECONDS)} s)" for s, f in over]
            else:
                named = [f"{f} {s:.0f} s" for f, s in self.spent.most_common(5)]
            self.lines.append(
                f"error: {self.kind} took {_clock(wall)}, over its budget of {_clock(budget)}; "
                + ("files over their budget: " if self.kind == "make test" else "the slowest files: ")
                + ("; ".join(named) or "none (the machine was slow: rerun, and compare docs/testing.md's table)")
            )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if os.environ.get("CI") == "true":
            unexpected = [(nodeid, reason) for nodeid, reason in self.skips if not self.expected.search(reason)]
            for nodeid, reason in unexpected:
                self.lines.append(f"error: skipped on CI, where it can run: {nodeid}: {reason}")
            if unexpected:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
            self._check_runs(session)

    def _check_runs(self, session) -> None:
        if self.kind != "make test" or session.config.option.collectonly:
            return
        for group, (files, fewest) in REQUIRED_RUNS.items():
            # a fork that deleted a group's files (the example's container test) has nothing to run there: a
            # visible change, unlike a skip or a file no longer collected
            if not all((ROOT / file).is_file() for file in files):
                continue
            ran = sum(self.ran[file] for file in files)
            if group not in self.allowed and ran < fewest:
                self.lines.append(
                    f"error: only {ran} {group} test(s) ran on CI, at least {fewest} must ({', '.join(files)}); "
                    f"where the tools cannot be installed, TEMPLATE_ALLOWED_GROUPS={group} says so"
                )
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line in self.lines:
            terminalreporter.write_line(line, red=line.startswith("error"), bold=line.startswith("error"))


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def register(config) -> None:
    """From pytest_configure: in the process that reports (not in a pytest-xdist worker)."""
    if not hasattr(config, "workerinput"):
        environ = os.environ
        plugin = Budget(
            whole_run(config), environ.get("TEMPLATE_EXPECTED_SKIPS", ""), environ.get("TEMPLATE_ALLOWED_GROUPS", "")
        )
        config.pluginmanager.register(plugin, "template-budget")
