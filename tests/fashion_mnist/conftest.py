"""Fixtures of the example task's tests (a fork replaces this folder with its own task's tests)."""

from pathlib import Path

import pytest

from tests import conftest

# cli.py's default task: what the example's tests run when they name no class
EXAMPLE_TASK = {
    "model": "app.fashion_mnist.model.ImageClassifier",
    "data": "app.fashion_mnist.data.FashionMNISTDataModule",
}


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
