"""What a release ships, checked as its users get it: `make dist` (what .github/workflows/release.yml publishes)
builds the wheel and the sdist from a copy of the repository, and the wheel alone is installed into a fresh
virtual environment that holds torch and nothing else (no book extras). There, the public API and the command line
work: ``from gradaccum import check`` is the function, ``full_batch_stats_backward`` is exact by default, and
``python -m gradaccum.check`` / ``python -m gradaccum.checker`` judge a loop, with ``--allow`` for an expected
finding. The wheel carries ``py.typed``, and the sdist builds the same wheel.

One environment for the whole file (a module fixture: under ``make test`` each file runs whole on one worker).
About 3.5 min on the loaded 2-core machine (1.5 min of CPU), most of it installing torch; needs the package
registry or pip's cache (the build's isolated environment, the torch wheel).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from layout import ROOT
from test_core_torch_only import SCRIPT as CORE_SCRIPT

pytestmark = [pytest.mark.install, pytest.mark.slow]

ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
ENV.pop("PYTHONPATH", None)  # the fresh environment imports the installed wheel, never this checkout's src/

#: Not in the wheel's dependencies: the book layer's libraries.
BOOK_ONLY = ("numpy", "scikit-learn", "matplotlib", "ipywidgets", "accelerate", "pytorch-lightning", "transformers")


def _run(argv: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV)


def _checkout_copy(dest: Path) -> Path:
    """The repository's files, copied without what a build or a run leaves behind (building in place would leave
    dist/, build/ and egg-info here). No git: a CI container may hold a checkout that git refuses to read."""
    ignored = (".venv", ".git", "_build", "dist", "build", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache")
    shutil.copytree(ROOT, dest / "repo", ignore=shutil.ignore_patterns(*ignored))
    return dest / "repo"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/ after `make dist` in a copy of the repository, with this interpreter as the Makefile's Python."""
    repo = _checkout_copy(tmp_path_factory.mktemp("repo"))
    made = _run(["make", "dist", f"PY={sys.executable}"], cwd=repo)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return repo / "dist"


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"{pattern} in {folder}: {found}"
    return found[0]


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with torch (this environment's version, from the wheel pip has) and the built
    wheel alone, installed with its dependencies as pip resolves them: its Python."""
    import torch

    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root / "env")], check=True, timeout=300)
    py = root / "env" / "bin" / "python"
    version = torch.__version__.split("+")[0]
    for what in ([f"torch=={version}"], [str(_one(dist, "*.whl"))]):
        installed = _run([str(py), "-m", "pip", "install", "-q", *what], cwd=root, timeout=900)
        assert installed.returncode == 0, installed.stderr[-3000:]
    return py


def _python(py: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run([str(py), "-c", textwrap.dedent(code)], cwd=cwd, timeout=300)


# ------------------------------------------------------------------------------------------- the artifacts


def test_the_wheel_carries_py_typed_the_data_and_only_torch_as_a_dependency(dist: Path):
    with zipfile.ZipFile(_one(dist, "gradaccum-*.whl")) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    shipped_data = ("book/corpus.txt", "book/ghost_bn_cpu.json", "book/ch02_study.json")
    for shipped in ("py.typed", "check.py", "checker/__main__.py", *shipped_data):
        assert f"gradaccum/{shipped}" in names, shipped
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "extra ==" not in r] == ["torch>=2.4"], requires


def test_the_sdist_builds_the_same_wheel(dist: Path, tmp_path: Path):
    """The sdist holds what a build needs: unpacked on its own, it builds a wheel with the released wheel's files."""
    with tarfile.open(_one(dist, "gradaccum-*.tar.gz")) as sdist:
        sdist.extractall(tmp_path, filter="data")
    source = _one(tmp_path, "gradaccum-*")
    for needed in ("pyproject.toml", "README.md", "LICENSE", "src/gradaccum/py.typed", "src/gradaccum/__init__.py"):
        assert (source / needed).is_file(), needed
    built = _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "out"), str(source)], tmp_path)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    names = [zipfile.ZipFile(path).namelist() for path in (_one(tmp_path / "out", "*.whl"), _one(dist, "*.whl"))]
    assert sorted(names[0]) == sorted(names[1])


# ----------------------------------------------------------------------------- the fresh environment, torch alone


def test_installing_the_wheel_brings_torch_and_no_book_library(venv: Path, tmp_path: Path):
    listed = _run([str(venv), "-m", "pip", "list", "--format=freeze"], tmp_path).stdout.lower()
    names = {line.split("==")[0] for line in listed.split()}
    assert {"gradaccum", "torch"} <= names, listed
    assert not names & set(BOOK_ONLY), f"installed with the core: {sorted(names & set(BOOK_ONLY))}"


def test_every_core_module_imports_and_the_checker_judges_two_loops(venv: Path, tmp_path: Path):
    result = _python(venv, CORE_SCRIPT, tmp_path)
    assert result.returncode == 0 and "core OK" in result.stdout, result.stderr[-3000:]


def test_check_from_the_package_is_the_function_and_judges_a_tiny_loop(venv: Path, tmp_path: Path):
    result = _python(
        venv,
        """
        import importlib, inspect, sys
        import torch
        from torch import nn
        from gradaccum import check
        import gradaccum.check as by_module_path

        assert inspect.isfunction(check) and by_module_path is check, (check, by_module_path)
        assert importlib.import_module("gradaccum.checker").check is check

        def divides_by_k(model, loss_fn, x, y, k):
            for xb, yb in zip(x.chunk(k), y.chunk(k)):
                (loss_fn(model(xb), yb) / k).backward()

        def forgets_one_over_k(model, loss_fn, x, y, k):
            for xb, yb in zip(x.chunk(k), y.chunk(k)):
                loss_fn(model(xb), yb).backward()

        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
        x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        good = check(model, nn.MSELoss(), x, y, 2, step=divides_by_k)
        bad = check(model, nn.MSELoss(), x, y, 2, step=forgets_one_over_k)
        assert good.ok and good.codes == [], good
        assert not bad.ok and "missing_1_over_k" in bad.codes, bad
        print("check OK")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and "check OK" in result.stdout, result.stderr[-3000:]


#: A conv net with four BatchNorm layers (2-d and 1-d), written for this test, in float64.
BN_NET = """
    import torch
    from torch import nn

    def bn_net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
            nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6, momentum=0.3), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3),
        ).double()

    def data():
        torch.manual_seed(1)
        return torch.randn(16, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
"""


def test_full_batch_stats_backward_is_the_full_batch_gradient_by_default(venv: Path, tmp_path: Path):
    """The default call: every gradient within 1e-10 (relative) of one full-batch backward, running statistics as
    after one full-batch forward; plain accumulation on the same net is far from it (BatchNorm couples the
    samples here)."""
    result = _python(
        venv,
        BN_NET
        + """
    import copy
    from gradaccum import full_batch_stats_backward

    def grads(model):
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    full, exact, plain = bn_net(), bn_net(), bn_net()
    full_loss = loss_fn(full(x), y)
    full_loss.backward()
    loss = full_batch_stats_backward(exact, loss_fn, x, y, 4)
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        (loss_fn(plain(xb), yb) / 4).backward()
    error, plain_error = rel(grads(exact), grads(full)), rel(grads(plain), grads(full))
    pairs = list(zip(exact.buffers(), full.buffers()))
    statistics = [rel(a, b) for a, b in pairs if b.is_floating_point()]
    assert error < 1e-10 and plain_error > 1e-2, (error, plain_error)
    assert max(statistics) < 1e-12, statistics
    assert all(torch.equal(a, b) for a, b in pairs if not b.is_floating_point()), "num_batches_tracked"
    assert abs(loss - full_loss.item()) < 1e-12, (loss, full_loss.item())
    print("exact", error, plain_error)
    """,
        tmp_path,
    )
    assert result.returncode == 0 and "exact" in result.stdout, result.stderr[-3000:]


#: A correct accumulation loop (1/K per micro-batch) on a BatchNorm MLP: its one finding is the BatchNorm layer's.
BN_LOOP = """
import torch
from torch import nn


def step(model, loss_fn, x, y, k):
    for xb, yb in zip(x.chunk(k), y.chunk(k)):
        (loss_fn(model(xb), yb) / k).backward()


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    return model, nn.CrossEntropyLoss(), x, y, step
"""


def test_the_command_line_accepts_the_batchnorm_finding_only_when_allowed(venv: Path, tmp_path: Path):
    """`python -m gradaccum.checker bn_loop:make --allow batch_coupled_layer` exits 0 and reports the finding as
    allowed, and so does `python -m gradaccum.check ...`; without --allow the same loop exits 1 with that finding."""
    (tmp_path / "bn_loop.py").write_text(BN_LOOP)
    for module in ("gradaccum.checker", "gradaccum.check"):
        allowed = _run([str(venv), "-m", module, "bn_loop:make", "--allow", "batch_coupled_layer"], tmp_path)
        assert allowed.returncode == 0, module + allowed.stdout[-3000:] + allowed.stderr[-3000:]
        assert "(allowed)" in allowed.stdout, allowed.stdout
    judged = _run([str(venv), "-m", "gradaccum.checker", "bn_loop:make", "--json"], tmp_path)
    assert judged.returncode == 1, judged.stdout[-3000:] + judged.stderr[-3000:]
    assert '"batch_coupled_layer"' in judged.stdout, judged.stdout[-3000:]


def test_the_demo_names_the_book_extra_it_needs(venv: Path, tmp_path: Path):
    """The demo is the book layer's: in an environment without it, --demo says which command and which extra."""
    cli = _run([str(venv), "-m", "gradaccum.checker", "--demo"], tmp_path, timeout=120)
    assert cli.returncode == 2 and "gradaccum[book]" in cli.stderr, (cli.returncode, cli.stderr)
    assert "python -m gradaccum.book.check_demo" in cli.stderr, cli.stderr
