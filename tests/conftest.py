"""Shared fixtures: one thread (as in the chapters), float64 digits loaded once, the site and the student site
each built once per test run (shared by the pytest-xdist workers)."""

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock
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
    blocked.mkdir(parents=True, exist_ok=True)
    env = shadow_packages(blocked, ("torch", "gradaccum", "sklearn"), "the site build must not import ")
    jb = Path(sys.executable).with_name("jupyter-book")
    proc = subprocess.run(
        [str(jb), "build", str(source), "--path-output", str(out), "-n", "-W", "--keep-going"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert not re.search(r"\bWARNING\b", log), log[-4000:]
    return out / "_build" / "html"


def _once(tmp_path_factory, name: str, make: Callable[[Path], Path]) -> Path:
    """``make(folder)``, run once per test run in a folder every pytest-xdist worker shares (the parent of the
    workers' own temporary folders): the first worker to ask builds, the others wait on a file lock and reuse what
    it built. A build that fails records nothing, so a worker that asks later builds again and fails with its own
    log."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with FileLock(str(shared / f"{name}.lock")):
        folder, done = shared / name, shared / f"{name}.done"
        if done.exists():
            return Path(done.read_text())
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        result = make(folder)
        done.write_text(str(result))
        return result


def _student_site(folder: Path) -> Path:
    from gradaccum.book import course

    course.write_student_edition(ROOT, folder / "book")
    return _build(folder / "book", folder / "site", folder / "blocked")


@pytest.fixture(scope="session")
def built_student_site(tmp_path_factory):
    """The student edition's site, built the same way."""
    return _once(tmp_path_factory, "student-site", _student_site)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The site built from the stored outputs, as `make book` builds it (no warnings allowed), with torch and the
    book's package made unimportable: `make book` installs neither (requirements-site.txt), so the build must not
    need them."""
    return _once(tmp_path_factory, "site", lambda folder: _build(ROOT, folder / "site", folder / "blocked"))
