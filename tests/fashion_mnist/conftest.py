"""Fixtures of the example task's tests (a fork replaces this folder with its own task's tests)."""

from pathlib import Path

import pytest

import cli
from tests import conftest

# cli.py's default task and its tools (export): what the example's tests run when they name no class
EXAMPLE_TASK = {"model": cli.MODEL, "data": cli.DATA, "tools": cli.TOOLS}


def run_cli(*args: str) -> None:
    """``cli.py`` in this process with the example as its default task (tests.conftest.run_cli's is the tests' own)."""
    conftest.run_cli(*args, **EXAMPLE_TASK)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """Synthetic Fashion-MNIST IDX files, written once per test session."""
    from app.fashion_mnist.data import FashionMNISTDataModule

    path = tmp_path_factory.mktemp("data")
    FashionMNISTDataModule(data_dir=str(path), source="synthetic").prepare_data()
    return path


# The real Fashion-MNIST as Debian's package dataset-fashion-mnist installs it (app/fashion_mnist/datafiles.py)
SYSTEM_COPY = Path("/usr/share/datasets/fashion-mnist")
REAL_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
needs_system_copy = pytest.mark.skipif(
    not all((SYSTEM_COPY / f"{name}.gz").is_file() for name in REAL_FILES),
    reason=f"the real Fashion-MNIST is not installed: no {SYSTEM_COPY} (apt-get install dataset-fashion-mnist)",
)


@pytest.fixture(autouse=True)
def _own_data_only(monkeypatch, tmp_path):
    """The example's tests make their own data: the system copy of Fashion-MNIST is looked for only by the tests
    about it (``system_copy``), and a synthetic stand-in that goes to the user's cache goes to the test's own."""
    monkeypatch.setenv("FASHION_MNIST_SYSTEM_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def system_copy(monkeypatch) -> Path:
    """The installed system copy, looked for as it is on users' machines (tests using it need ``needs_system_copy``)."""
    monkeypatch.delenv("FASHION_MNIST_SYSTEM_DIR")
    return SYSTEM_COPY
