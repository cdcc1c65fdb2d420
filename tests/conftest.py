"""Shared fixtures: one thread (as in the chapters), float64 digits loaded once."""

import pytest
import torch

from gradaccum.book.data import load_digits_split
from gradaccum.runtime import setup


@pytest.fixture(scope="session", autouse=True)
def _fixed_threads():
    setup(seed=0, prefer="cpu")


@pytest.fixture(scope="session")
def digits():
    return load_digits_split()


@pytest.fixture
def loss_fn():
    return torch.nn.CrossEntropyLoss()
