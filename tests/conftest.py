import os
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CPU_TEST_CONFIG = ROOT / "configs" / "cpu_test.yaml"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """Synthetic Fashion-MNIST IDX files, written once per test session."""
    from app.data import FashionMNISTDataModule

    path = tmp_path_factory.mktemp("data")
    FashionMNISTDataModule(data_dir=str(path), source="synthetic").prepare_data()
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """Run in a fresh folder, so lightning_logs/ of each test is its own."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


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


@pytest.fixture(scope="session")
def parity(tmp_path_factory, data_dir):
    """``parity(name, *args, mpirun=0)``: the saved result of one ``tests/parity_run.py`` run, made once a session."""
    from tests.parity import run_parity

    out_dir = tmp_path_factory.mktemp("parity")

    @cache
    def get(name: str, *args: str, mpirun: int = 0) -> dict:
        return run_parity(out_dir, data_dir, name, *args, mpirun=mpirun)

    return get


def run_cli(*args: str) -> None:
    """Run ``cli.py`` in this process (fast: no new interpreter, no re-import of torch)."""
    from app.cli import main

    main(list(args))


def python() -> str:
    return sys.executable


SHARED_RUNS = ("parity", "reference", "bad_input_dir", "run_dir")  # fixtures that cache training runs


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``), the tests that share cached runs go to one worker each, so a run is made once."""
    for item in items:
        for name in SHARED_RUNS:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(name))
                break
