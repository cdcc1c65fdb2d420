"""Shared fixtures: one thread (as in the chapters), float64 digits loaded once, the site built once."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from layout import ROOT, shadow_packages

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


def _build(source: Path, out: Path, blocked: Path) -> Path:
    env = shadow_packages(blocked, ("torch", "gradaccum", "sklearn"), "the site build must not import ")
    jb = Path(sys.executable).with_name("jupyter-book")
    proc = subprocess.run([str(jb), "build", str(source), "--path-output", str(out), "-n", "-W", "--keep-going"],
                          capture_output=True, text=True, timeout=300, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert not re.search(r"\bWARNING\b", log), log[-4000:]
    return out / "_build" / "html"


@pytest.fixture(scope="session")
def built_student_site(tmp_path_factory):
    """The student edition's site, built the same way."""
    from gradaccum.book import course

    book = tmp_path_factory.mktemp("student") / "book"
    course.write_student_edition(ROOT, book)
    return _build(book, tmp_path_factory.mktemp("student-site"), tmp_path_factory.mktemp("blocked"))


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The site built from the stored outputs, as `make book` builds it (no warnings allowed), with torch and the
    book's package made unimportable: `make book` installs neither (requirements-site.txt), so the build must not
    need them."""
    return _build(ROOT, tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("blocked"))
