"""Shared fixtures: one thread (as in the chapters), float64 digits loaded once, the site built once."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from layout import ROOT

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


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The site built from the stored outputs, as `make book` builds it (no warnings allowed)."""
    out = tmp_path_factory.mktemp("site")
    jb = Path(sys.executable).with_name("jupyter-book")
    proc = subprocess.run([str(jb), "build", str(ROOT), "--path-output", str(out), "-n", "-W", "--keep-going"],
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert not re.search(r"\bWARNING\b", log), log[-4000:]
    return out / "_build" / "html"
