"""The core needs torch only: with the book's libraries blocked every core module imports and the diagnostic runs on
a loop it has never seen. tests/test_release.py runs the same script in a fresh environment holding torch and the
built wheel alone."""

from __future__ import annotations

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


def test_every_core_module_is_reachable_as_a_module():
    """No name exported by the package hides a module of the same name (``gradaccum.check`` is the function, the
    checker's package is ``gradaccum.checker``). The one module named like a function, ``gradaccum/check.py``
    (``python -m gradaccum.check``), is that function once imported: tests/test_check_module.py."""
    import importlib
    import types

    import gradaccum

    for name in CORE:
        imported = importlib.import_module(f"gradaccum.{name}")
        if name == "check":
            assert imported is gradaccum.check, "gradaccum/check.py imports as the function"
            continue
        assert isinstance(getattr(gradaccum, name), types.ModuleType), name
    assert callable(gradaccum.check) and gradaccum.check is importlib.import_module("gradaccum.checker").check
    assert set(gradaccum.__all__) <= set(dir(gradaccum))
