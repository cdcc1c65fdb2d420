"""`make lint`, inside the test run: ruff, ruff format --check and mypy, exactly as the Makefile's ``lint`` recipe
says (its lines are read from the Makefile, so the two cannot drift apart). `make test` runs it here, beside the
other tests on whichever worker takes it, instead of before them: mypy alone takes about 1.5 minutes without a cache."""

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
    assert [Path(cmd[0]).name for cmd in recipe] == ["ruff", "ruff", "mypy"]
    assert all(Path(cmd[0]).exists() for cmd in recipe)


@pytest.mark.lint
@pytest.mark.parametrize(
    "command", lint_recipe((ROOT / "Makefile").read_text()), ids=lambda cmd: " ".join([Path(cmd[0]).name, *cmd[1:3]])
)
def test_lint(command):
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{shlex.join(command)} failed:\n{proc.stdout}\n{proc.stderr}"
