import fcntl
import multiprocessing
import os
import resource
import subprocess
import sys
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CPU_TEST_CONFIG = ROOT / "configs" / "cpu_test.yaml"  # the example task's CPU preset
TINY_CONFIG = ROOT / "tests" / "tiny.yaml"  # the tests' own task (tests/tiny.py): what machinery tests train


def pytest_configure(config):
    """One intra-op thread in every process the suite starts (pytest-xdist workers, runs, ranks, launchers): it runs
    several side by side on a few cores, where more threads than cores spin-wait for each other. Measured on the
    2-core machine: 22% less CPU time for the whole suite, 11 min 10 s -> 9 min of tests."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Every checkpoint the suite's runs write (in this process and in every process it starts) is written by the
    # thread that runs training, or the save fails the run (app/checkpoints/io.py, issue 71)
    os.environ["TEMPLATE_SAVE_ON_TRAINING_THREAD"] = "1"
    from tests import budget

    budget.register(config)  # the suite's time budget and expected skips (tests/budget.py)
    # What cli.py's main sets up first, once for the tests that train in this process: importing app sets up nothing.
    from app.launch import startup
    from app.strategies import register

    startup.install()
    register()


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """Run in a fresh folder, so lightning_logs/ of each test is its own."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pytest_runtest_setup(item):
    """The filters ``app.launch.startup.install()`` installed (app/launch/library_noise.py), again for each test (its
    fixtures included): pytest resets the warning filters around every test, and that install() acts once per
    process, so without this in-process runs would show warnings users never see."""
    import app.launch.library_noise

    app.launch.library_noise.install()


FAST_CHILD_CPU = 1.0  # CPU-seconds a test not marked slow may spend in the processes it starts and waits for


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(autouse=True)
def _fast_tests_start_no_interpreter(request, monkeypatch):
    """A test not marked slow spends at most FAST_CHILD_CPU seconds of CPU in the processes it starts (counted by the
    kernel for the children waited for): no new interpreter that imports torch (3 to 7 CPU-s here), no torchrun,
    mpirun or spawned rank. ``make test-fast`` is the inner loop. A test that needs one is marked slow; this fails
    it, with the figure, when it is not. Only a test that started a process is judged: an earlier test's leftover
    child reaped meanwhile (``subprocess`` reaps finished children when it starts one) is not its cost. A fork of the
    warm interpreter (tests/warm.py: a child of its server, not of the test) costs the test nothing here, and little
    anywhere: it has nothing to import."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    started = []
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen(self, *args, **kwargs):
        started.append(args[0] if args else kwargs.get("args"))
        popen_init(self, *args, **kwargs)

    def start(self):
        started.append(self)
        return process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    before = _children_cpu()
    yield
    spent = _children_cpu() - before
    if started and spent > FAST_CHILD_CPU:
        pytest.fail(
            f"not marked slow, but its child processes took {spent:.1f} CPU-s (at most {FAST_CHILD_CPU:g} for a fast "
            "test: a new interpreter importing torch takes 3 to 7); mark it @pytest.mark.slow",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _restore_torch_state():
    threads = torch.get_num_threads()
    env = dict(os.environ)
    yield
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(env)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def shared_dir(tmp_path_factory) -> Path:
    """A folder of this test session that every pytest-xdist worker sees (the workers' own are inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@contextmanager
def made_once(path: Path):
    """``with made_once(folder) as make:``: ``make`` is True in the one process (of all xdist workers) that must
    make ``folder``; the others wait until it is made, then get False and reuse it. A failed make is retried."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = Path(f"{path}.done")
        make = not done.exists()
        yield make
        if make:
            done.touch()


@pytest.fixture(scope="session")
def parity(tmp_path_factory):
    """``parity(name, *args, mpirun=0)``: the saved result of one ``tests/parity_run.py`` run, made once a session
    (once for all xdist workers: tests that share a run may run side by side)."""
    from tests.parity import launch_of, run_parity

    out_dir = shared_dir(tmp_path_factory) / "parity"

    @cache
    def get(name: str, *args: str, mpirun: int = 0) -> dict:
        with made_once(out_dir / (launch_of(name) or name)):
            return run_parity(out_dir, name, *args, mpirun=mpirun)

    return get


# The tests' own task as cli.py's default, as a fork's cli.py names its own (the example's tests name theirs)
TINY_TASK = {"model": "tests.tiny.TinyClassifier", "data": "tests.tiny.TinyData"}


def run_cli(*args: str, **task: str) -> None:
    """Run ``cli.py`` in this process (fast: no new interpreter, no re-import of torch), with the tests' own task
    as its default (``task``: another ``model=``/``data=``): a run that names no class trains it."""
    from app.run.cli import main

    main(list(args), **(task or TINY_TASK))


def python() -> str:
    return sys.executable


# module fixtures whose tests change or read one folder, or share one expensive run (per parameter)
SHARED_RUNS = ("bad_input_dir", "run_dir", "recorded", "fsdp_unbroken")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Fail loudly if ``--dist loadgroup`` did not take the groups (xdist marks a grouped test's id with ``@``):
    the shared runs would silently be made once per worker."""
    if not getattr(session.config.option, "loadgroup", False):  # set in xdist workers under --dist loadgroup
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {lost[0]} (pytest {pytest.__version__}); install the dev extras' pins: "
            "pip install -e '.[dev]'"
        )


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups (it runs first otherwise)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``), the tests of one such fixture go to one worker, so its run is made once."""
    for item in items:
        for name in SHARED_RUNS:
            if name in getattr(item, "fixturenames", ()):
                params = getattr(item, "callspec", None)
                param = params.params.get(name) if params else None
                item.add_marker(pytest.mark.xdist_group(name if param is None else f"{name}-{param}"))
                break
