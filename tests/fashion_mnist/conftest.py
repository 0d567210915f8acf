"""Fixtures of the example task's tests (a fork replaces this folder with its own task's tests)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """Synthetic Fashion-MNIST IDX files, written once per test session."""
    from app.fashion_mnist.data import FashionMNISTDataModule

    path = tmp_path_factory.mktemp("data")
    FashionMNISTDataModule(data_dir=str(path), source="synthetic").prepare_data()
    return path
