"""`make lint`, inside the test run: ruff, ruff format --check, the size limits, mypy, the layering contract
(import-linter: the core never imports gradaccum.book) and actionlint on the GitHub workflows, exactly as the
Makefile's ``lint`` recipe says (its lines are read from the Makefile, so the two cannot drift apart). `make test`
runs it here, beside the other tests on whichever worker takes it, instead of before them: mypy alone takes about
1.5 minutes without a cache."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from layout import ROOT


def lint_recipe(makefile: str) -> list[list[str]]:
    """The commands of the Makefile's ``lint`` target, with ``$(VENV)/bin/`` pointing at this interpreter's bin."""
    lines = makefile.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("lint:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(shlex.split(line.strip().replace("$(VENV)/bin/", f"{Path(sys.executable).parent}/")))
    return recipe


def test_lint_recipe_is_read():
    recipe = lint_recipe((ROOT / "Makefile").read_text())
    assert [Path(cmd[0]).name for cmd in recipe] == ["ruff", "ruff", "python", "mypy", "lint-imports", "actionlint"]
    assert all(Path(cmd[0]).exists() for cmd in recipe)


@pytest.mark.lint
@pytest.mark.parametrize(
    "command", lint_recipe((ROOT / "Makefile").read_text()), ids=lambda cmd: " ".join([Path(cmd[0]).name, *cmd[1:3]])
)
def test_lint(command):
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{shlex.join(command)} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.lint
def test_the_layering_contract_fails_on_a_core_module_importing_the_book(tmp_path):
    """The contract is not vacuous: a copy of the package whose core imports the book layer (from a module, and
    from the package root) breaks it."""
    import shutil

    shutil.copytree(ROOT / "src" / "gradaccum", tmp_path / "gradaccum", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    lint_imports = Path(sys.executable).parent / "lint-imports"
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(tmp_path)}
    kept = subprocess.run([str(lint_imports), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    for module in ("accumulate.py", "__init__.py"):
        path = tmp_path / "gradaccum" / module
        text = path.read_text()
        path.write_text(text + "\nfrom gradaccum.book import models as _models  # noqa: E402\n")
        broken = subprocess.run(
            [str(lint_imports), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, env=env
        )
        path.write_text(text)
        assert broken.returncode == 1 and "gradaccum.book.models" in broken.stdout, broken.stdout + broken.stderr


def test_the_size_limits_find_a_long_function_and_a_long_module(tmp_path):
    """scripts/check_sizes.py is not vacuous: a 61-line function and a 501-line module are reported."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_sizes
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    body = "".join(f"    x{i} = {i}\n" for i in range(58))
    (tmp_path / "short.py").write_text("def f():\n" + body + "    return 0\n")
    assert check_sizes.oversized(tmp_path) == []
    (tmp_path / "long.py").write_text("def g():\n" + body + "    y = 1\n    return y\n" + "# filler\n" * 440)
    found = check_sizes.oversized(tmp_path)
    assert any("g() is 61 lines" in line for line in found), found
    assert any("module of 501 lines" in line for line in found), found


@pytest.mark.lint
def test_actionlint_finds_a_broken_workflow(tmp_path):
    """actionlint is not vacuous: in a repository like this one (its workflows copied), it passes them, and it fails
    a workflow that misspells an action's input and asks for a permission that does not exist."""
    import shutil

    actionlint = Path(sys.executable).parent / "actionlint"
    shutil.copytree(ROOT / ".github", tmp_path / ".github")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)  # actionlint looks for the repository's root
    kept = subprocess.run([str(actionlint), "-oneline"], cwd=tmp_path, capture_output=True, text=True)
    workflows = {p.name for p in (tmp_path / ".github" / "workflows").glob("*.yml")}
    assert {"ci.yml", "pages.yml", "release.yml"} <= workflows and kept.returncode == 0, kept.stdout + kept.stderr
    release = tmp_path / ".github" / "workflows" / "release.yml"
    text = release.read_text()
    assert "if-no-files-found: error" in text and "id-token: write" in text
    release.write_text(text.replace("if-no-files-found:", "if-no-file-found:").replace("id-token:", "id-tokens:"))
    broken = subprocess.run([str(actionlint), "-oneline"], cwd=tmp_path, capture_output=True, text=True)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert '"if-no-file-found" is not defined' in broken.stdout and "id-tokens" in broken.stdout, broken.stdout
