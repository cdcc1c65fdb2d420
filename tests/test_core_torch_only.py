"""The core needs torch only: with the book's libraries blocked (and in a fresh environment holding torch alone) every
core module imports and the diagnostic runs on a loop it has never seen."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from layout import ROOT, shadow_packages

CORE = sorted(
    [p.stem for p in (ROOT / "src" / "gradaccum").glob("*.py") if p.stem != "__init__" and not p.stem.startswith("_")]
    + [p.parent.name for p in (ROOT / "src" / "gradaccum").glob("*/__init__.py") if p.parent.name != "book"]
)
BLOCKED = ("sklearn", "matplotlib", "ipywidgets")

#: Imports every core module, then checks a correct loop and a loop that forgets 1/K on a model of its own.
SCRIPT = textwrap.dedent(
    """
    import importlib, sys
    for name in {core!r}:
        importlib.import_module("gradaccum." + name)
    import torch
    from torch import nn
    from gradaccum.checker import check
    from gradaccum.accumulate import split_batch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))

    def forgets_one_over_k(model, loss_fn, xs, ys, k):
        for xb, yb in split_batch(xs, ys, k):
            loss_fn(model(xb), yb).backward()

    good = check(model, nn.CrossEntropyLoss(), x, y, 3)
    bad = check(model, nn.CrossEntropyLoss(), x, y, 3, step=forgets_one_over_k)
    assert good.ok and not bad.ok and "missing_1_over_k" in bad.codes, (good, bad)
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("sklearn", "matplotlib", "ipywidgets"))
    assert not leaked and "gradaccum.book" not in sys.modules, leaked
    print("core OK:", len({core!r}), "modules; verdicts", good.ok, bad.codes)
    """
).format(core=CORE)

#: The book layer itself is blocked by a finder (nothing in torch looks for it).
BLOCK_BOOK = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "gradaccum.book" or name.startswith("gradaccum.book."):
                raise ImportError("blocked for this test: " + name)
    sys.meta_path.insert(0, Block())
    """
)


def _blocked_run(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` where scikit-learn, matplotlib and ipywidgets are shadowed by packages that refuse to import
    (torch asks ``importlib.util.find_spec`` about optional libraries, so a finder that raises would break torch,
    not test the core)."""
    env = shadow_packages(tmp_path, BLOCKED, "blocked for this test: ")
    return subprocess.run(
        [sys.executable, "-c", BLOCK_BOOK + code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )


@pytest.mark.slow
def test_core_imports_and_checks_with_the_book_libraries_blocked(tmp_path: Path):
    result = _blocked_run(tmp_path, SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "core OK" in result.stdout


@pytest.mark.parametrize(
    "module",
    ["sklearn", "matplotlib.pyplot", "ipywidgets", pytest.param("gradaccum.book.data", marks=pytest.mark.slow)],
)
def test_the_blocker_really_blocks(tmp_path: Path, module: str):
    result = _blocked_run(tmp_path, f"import {module}")
    assert result.returncode != 0 and "blocked for this test" in result.stderr, result.stderr[-2000:]


@pytest.mark.install
def test_fresh_environment_with_only_torch(tmp_path: Path):
    """``pip install gradaccum`` into a new virtual environment that holds torch alone (the version this
    environment runs, from the wheel pip already has): no numpy, scikit-learn or matplotlib arrive, and the core
    works. ~40 s; needs the package registry or pip's cache."""
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    version = torch.__version__.split("+")[0]
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", f"torch=={version}", "setuptools>=77"], check=True, timeout=900, env=env
    )
    repo = tmp_path / "repo"  # a copy: building in place would leave build/ and egg-info behind
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(
            ".venv", "_build", ".git", "*.egg-info", "__pycache__", "chapters", ".hypothesis"
        ),
    )
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-build-isolation", str(repo)], check=True, timeout=600, env=env
    )
    listed = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True, env=env
    ).stdout.lower()
    for absent in ("numpy", "scikit-learn", "matplotlib", "ipywidgets"):
        assert f"\n{absent}==" not in "\n" + listed, f"{absent} was installed with the core:\n{listed}"
    result = subprocess.run([str(py), "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "core OK" in result.stdout
    cli = subprocess.run(
        [str(py), "-m", "gradaccum.checker", "--demo"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    # the demo is the book layer's: the core's --demo names its command and the extra it needs
    assert cli.returncode == 2 and "gradaccum[book]" in cli.stderr, (cli.returncode, cli.stderr)
    assert "python -m gradaccum.book.check_demo" in cli.stderr, cli.stderr


def test_every_core_module_is_reachable_as_a_module():
    """No name exported by the package hides a module of the same name (``gradaccum.check`` is the function, the
    checker's package is ``gradaccum.checker``)."""
    import importlib
    import types

    import gradaccum

    for name in CORE:
        importlib.import_module(f"gradaccum.{name}")
        assert isinstance(getattr(gradaccum, name), types.ModuleType), name
    assert callable(gradaccum.check) and gradaccum.check is importlib.import_module("gradaccum.checker").check
    assert set(gradaccum.__all__) <= set(dir(gradaccum))
