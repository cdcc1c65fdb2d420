"""Every command the book shows runs in a test, or is a `make` target on the commented allow-list below.

Commands are collected from README.md, intro.md and instructor.md (inline code and ```bash blocks), from the
docstrings and "Usage:" lines of scripts/*.py, scripts/*.sh, benchmarks/*.py and the package's command-line
modules (src/gradaccum/*.py), and from the markdown cells of every chapter. A command counts as shown when it
starts like one: `python -m …`, `python scripts/…`, `python benchmarks/…`, `torchrun …`, `bash scripts/…` or
`make <target>` (optionally after VAR=value).

A shown command is covered when

* a ``Run`` below executes it — as shown, or with the changes its ``note`` states (a free port instead of 29500,
  a temporary folder instead of _build/, a placeholder filled in, a flag the command's own usage line documents
  to keep it cheap) — and checks its output; or
* ``ELSEWHERE`` names the test in another file that runs it; or
* it is a `make` target in ``MAKE_TARGETS``, each with the tests that cover what it runs; or
* it is in ``NOT_RUN``, with the reason no test can run it.

The multi-node torchrun command runs as its single-node equivalent: one node of it (``--nnodes=1``, the same
rendezvous options on 127.0.0.1). Its world of 16 ranks is checked without processes
(``test_two_node_world_fits_the_data``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from layout import ROOT, heavy_job

pytestmark = pytest.mark.commands

BIN = Path(sys.executable).parent

#: How a shown command starts.
COMMAND = re.compile(
    r"^(?:[A-Z_]+=\S+\s+)*(?:python3?\s+(?:-m\s+\w|scripts/|benchmarks/)|torchrun\s|bash\s+scripts/"
    r"|make\s+[a-z])"
)
SHELL_FENCES = {"bash", "sh", "shell", "console"}


def normalize(text: str) -> str:
    """One command: a trailing comment or parenthesis (after two spaces, or `` # ``) cut, blanks collapsed."""
    text = text.strip().removeprefix("$ ")
    text = re.split(r"\s{2,}[#(]|\s+#\s", text)[0]
    return " ".join(text.split())


def _from_markdown(text: str) -> set[str]:
    found = set()
    for lang, body in re.findall(r"^```([^\n`]*)\n(.*?)^```", text, flags=re.M | re.S):
        if lang.strip() in SHELL_FENCES:
            found |= {normalize(line) for line in body.splitlines() if normalize(line)}
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    found |= {normalize(span) for span in re.findall(r"`([^`\n]+)`", prose) if COMMAND.match(normalize(span))}
    return found


def _from_docstring(text: str) -> set[str]:
    found = set()
    for line in text.splitlines():
        line = normalize(re.sub(r"^\s*(#\s*)?(Usage:)?", "", line))
        if COMMAND.match(line):
            found.add(line)
    found |= {normalize(span) for span in re.findall(r"`+([^`\n]+)`+", text) if COMMAND.match(normalize(span))}
    return found


def shown_commands() -> dict[str, set[str]]:
    """Every shown command → the files that show it."""
    where: dict[str, set[str]] = {}

    def add(commands: set[str], place: Path) -> None:
        for command in commands:
            where.setdefault(command, set()).add(str(place.relative_to(ROOT)))

    for name in ("README.md", "intro.md", "instructor.md"):
        add(_from_markdown((ROOT / name).read_text()), ROOT / name)
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        add(_from_markdown(text), path)
    for path in [
        *sorted((ROOT / "scripts").glob("*.py")),
        *sorted((ROOT / "benchmarks").glob("*.py")),
        *sorted((ROOT / "src" / "gradaccum").rglob("*.py")),
    ]:
        add(_from_docstring(ast.get_docstring(ast.parse(path.read_text())) or ""), path)
    for path in sorted((ROOT / "scripts").glob("*.sh")):
        header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        add(_from_docstring(header), path)
    return where


# ------------------------------------------------------------------------------------------ what runs them


@dataclass(frozen=True)
class Run:
    """One command line this file executes, and the shown commands it covers."""

    shown: tuple[str, ...]
    argv: tuple[str, ...]  # {py}, {torchrun}, {port}, {tmp} are filled in when it runs
    expect: str  # a regular expression the output must match
    note: str = ""  # how argv differs from the shown command, and why
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "{root}"


DDP_2 = "torchrun --nproc_per_node=2 scripts/ddp_train.py --k 4"
DDP_2_EXPLICIT = "torchrun --nproc_per_node=2 scripts/ddp_train.py --k 4 --b 8 --steps 5"
DDP_8 = "torchrun --nproc_per_node=8 scripts/ddp_train.py --k 8"
DDP_2_NODES = (
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 scripts/ddp_train.py"
)
DDP_OUT = r"max \|params\(sync\) - params\(no_sync\)\| = (\S+)"

RUNS = {
    "ddp-2-processes": Run(
        (DDP_2, DDP_2_EXPLICIT),
        ("{torchrun}", "--master_port={port}", "--nproc_per_node=2", "scripts/ddp_train.py", "--k", "4"),
        r"world size 2, K=4, b=8 .*5 steps",
        "a free port instead of 29500; the explicit form only spells out the defaults "
        "(test_explicit_defaults_are_the_defaults)",
    ),
    "ddp-8-processes": Run(
        (DDP_8,),
        ("{torchrun}", "--master_port={port}", "--nproc_per_node=8", "scripts/ddp_train.py", "--k", "8"),
        r"world size 8, K=8, b=3 .*5 steps",
        "8 CPU processes with gloo instead of 8 GPUs; a free port",
    ),
    "ddp-one-of-two-nodes": Run(
        (DDP_2_NODES,),
        (
            "{torchrun}",
            "--nnodes=1",
            "--nproc_per_node=8",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=127.0.0.1:{port}",
            "scripts/ddp_train.py",
        ),
        r"world size 8, K=4, b=7 .*5 steps",
        "single-node equivalent: one node (--nnodes=1) on 127.0.0.1 with a free port; 16 ranks: see "
        "test_two_node_world_fits_the_data",
    ),
    "check-your-loop": Run(
        ("python -m gradaccum.checker my_module:make -k 4",),
        ("{py}", "-m", "gradaccum.checker", "my_module:make", "-k", "4"),
        r"OK: accumulation computes the full-batch gradient",
        "run in a folder holding a my_module.py whose make() returns a correct GroupNorm CNN and 32 digits",
        cwd="{tmp}",
    ),
    "ghost-bn-benchmark": Run(
        (
            "python benchmarks/ghost_bn.py",
            "python benchmarks/ghost_bn.py [--device cpu|cuda] [--threads N] [--no-compile] [--quick]",
        ),
        ("{py}", "benchmarks/ghost_bn.py", "--quick", "--threads", "1"),
        r"one optimizer step of SmallCNN on 64 images\n(.*\n){3}",
        "--quick and --threads 1 (both in its usage line): two timed calls per row, no torch.compile",
    ),
    "execute-notebooks": Run(
        ("python scripts/execute_notebooks.py [--check] [NOTEBOOK ...]",),
        ("{py}", "scripts/execute_notebooks.py", "{tmp}/tiny.ipynb"),
        r"tiny\.ipynb\s+[\d.]+",
        "on a one-cell notebook in a temporary folder (make outputs / make budgets run it on every chapter)",
    ),
    "gpu-check": Run(
        ("GRADACCUM_DEVICE=cuda python scripts/gpu_check.py [--show-diffs] [NOTEBOOK ...]",),
        ("{py}", "scripts/gpu_check.py", "--show-diffs", "{tmp}/tiny.ipynb"),
        r"tiny\.ipynb\s+pass\s+[\d.]+\s+1\s+0\s+0",
        "on a one-cell notebook; without CUDA, GRADACCUM_DEVICE=cpu (the script keeps a value that is set)",
        env={"GRADACCUM_DEVICE": "{device}"},
    ),
    "student-edition": Run(
        ("python -m gradaccum.book.course student",),
        ("{py}", "-m", "gradaccum.book.course", "student", "--out", "{tmp}/student"),
        r"wrote \d+ notebooks",
        "--out a temporary folder instead of _build/student/book",
    ),
    "student-edition-elsewhere": Run(
        ("make student STUDENT_REPO=https://github.com/you/course-student STUDENT_BRANCH=main",),
        (
            "{py}",
            "-m",
            "gradaccum.book.course",
            "student",
            "--out",
            "{tmp}/student",
            "--repository",
            "https://github.com/you/course-student",
            "--branch",
            "main",
        ),
        r"wrote \d+ notebooks",
        "the CLI call `make student` makes with those variables (its site build is test_course's), into a "
        "temporary folder",
    ),
    "student-edition-course-mode": Run(
        ("make student COURSE_MODE=1",),
        ("{py}", "-m", "gradaccum.book.course", "student", "--out", "{tmp}/student", "--course-mode"),
        r"wrote \d+ notebooks under .*course mode \(no expected values in feedback\): on",
        "the CLI call `make student COURSE_MODE=1` makes (its site build is test_course's), into a temporary folder",
    ),
    "nbgrader": Run(
        ("python -m gradaccum.book.course nbgrader",),
        ("{py}", "-m", "gradaccum.book.course", "nbgrader", "--out", "{tmp}/nbgrader"),
        r"wrote \d+ notebooks",
        "--out a temporary folder instead of _build/nbgrader",
    ),
}

#: Shown commands that another test file runs exactly: command → "file::test".
ELSEWHERE = {
    "python -m gradaccum.book.check_demo": "tests/test_check.py::test_command_line_demo",
    "python scripts/module_map.py": "tests/test_architecture.py::test_module_map_script_prints_every_module",
    # the bare command (its docstrings name it): a real process, with a target, exit statuses and messages
    "python -m gradaccum.checker": (
        "tests/test_check_cli.py::test_a_usage_error_exits_2_without_a_traceback_in_a_real_process"
    ),
    # the same command line under the function's name (src/gradaccum/check.py); tests/test_release.py runs it on a
    # loop in the installed wheel's environment
    "python -m gradaccum.check": (
        "tests/test_check_module.py::test_python_m_gradaccum_check_is_the_command_line_under_its_own_name"
    ),
    # instructor.md's semester: tests/test_course_workflow.py runs each week's commands, in the page's order, on
    # chapters 1 and 3 in the course folder it writes (and checks that the page shows exactly those)
    **{
        command: "tests/test_course_workflow.py::semester"
        for command in (
            "nbgrader validate source/01_microbatch_statistics/01_microbatch_statistics.ipynb",
            "nbgrader generate_assignment 01_microbatch_statistics",
            "nbgrader release_assignment 01_microbatch_statistics",
            "nbgrader collect 01_microbatch_statistics",
            "nbgrader autograde 01_microbatch_statistics",
            "python -m gradaccum.book.marks export 01_microbatch_statistics marks.csv",
            "python -m gradaccum.book.marks import marks.csv",
            "nbgrader generate_feedback 01_microbatch_statistics",
            "nbgrader release_feedback 01_microbatch_statistics",
        )
    },
}

#: `make` targets: what covers each. A target runs the tools above (or pytest) over the whole book; the tests
#: cover the tools, and strict nbval covers every chapter's execution.
MAKE_TARGETS = {
    "book": "tests/test_site.py builds the site the way `make book` does (jupyter-book build . -n -W --keep-going)",
    "test": "runs this file among all the others: a test cannot run the command that runs it",
    "unit": "the package-test subset of `make test` (every test not marked slow, site, commands, install, nbgrader "
    "or lint)",
    "unit-all": "the package-test subset of `make test` (every test not marked site, commands, install, nbgrader or "
    "lint)",
    "lint": "tests/test_lint.py runs the recipe's commands (ruff, ruff format --check, the size limits, mypy, "
    "lint-imports), read from the Makefile",
    "help": "prints the Makefile's own `##` descriptions; test_make_help_describes_every_target checks them",
    "nbval": "the strict-nbval half of `make test`",
    "nbval-loaded": "strict nbval (part of `make test`) three times over with both cores kept busy: a stress run "
    "of existing tests, not a behaviour of its own",
    "study": "runs the tests marked study (chapter 2's recorded study trained again, and its rules on seeds 3-5); "
    ".ci/run runs it after `make test`",
    "portability": "strict nbval (part of `make test`) again under two other CPU kernel paths; .ci/run runs it "
    "after `make test`, and the kernel paths it chooses are environment variables read at process start",
    "outputs": "scripts/execute_notebooks.py over every chapter: the script runs here (execute-notebooks); every "
    "chapter's execution is what strict nbval checks",
    "budgets": "scripts/execute_notebooks.py --check (execute-notebooks without writing) over every chapter",
    "gpu-check": "scripts/gpu_check.py over every chapter: the script runs here (gpu-check); the chapters' code "
    "on a CPU is strict nbval's; on a GPU only `make gpu-check` itself, by hand",
    "student": "tests/test_course.py writes the student edition and builds its site; the CLI runs here",
    "nbgrader": "tests/test_nbgrader.py and tests/test_course_workflow.py write the course with the same CLI and run "
    "nbgrader on it end to end (validate, generate_assignment, release, collect, autograde, marks, feedback) with the "
    "kernel installed as `make kernel` does",
    "install": "the set-up every other target's recipe starts with: CI's fresh clone runs it inside `make test` "
    "(.ci/run), and tests/test_release.py installs the package's wheel into a fresh environment",
    "dist": "tests/test_release.py runs `make dist` in a copy of the repository, installs the wheel into a fresh "
    "environment holding torch alone and builds the wheel again from the sdist",
    "clean": "test_make_clean_removes_only_build runs it on a copy of the Makefile",
    "kernel": "tests/test_nbgrader.py and tests/test_course_workflow.py install the same kernelspec (ipykernel "
    "install --name gradaccum) into a temporary prefix instead of the environment, and grade with it",
}

#: Shown commands no test runs, and why.
NOT_RUN = {
    "python scripts/vendor_assets.py": "downloads from the npm registry (see the next entry)",
    "python scripts/vendor_assets.py [--check]": (
        "downloads from the npm registry; tests/test_vendor.py checks the committed files against the pinned "
        "manifest it writes, offline"
    ),
    'pip install "gradaccum @ git+https://github.com/gradaccum/gradient-accumulation-correctly"': (
        "needs the network to reach the repository; tests/test_release.py builds the same package from a copy of "
        "this repository (make dist), installs its wheel into a virtual environment holding torch alone, and runs "
        "the checker there"
    ),
    "make binder-check": "creates a fresh virtual environment and downloads torch from PyPI into it (network, "
    "minutes): run by hand before publishing the Binder link",
    "bash scripts/loaded_nbval.sh [RUNS] [NOTEBOOK ...]": "what `make nbval-loaded` runs (see MAKE_TARGETS)",
    "bash scripts/portability.sh [NOTEBOOK ...]": "what `make portability` runs (see MAKE_TARGETS)",
    "python scripts/check_sizes.py [ROOT ...]": "what `make lint` runs (tests/test_lint.py runs the recipe, and "
    "test_the_size_limits_find_a_long_function_and_a_long_module the script itself)",
}


def covered(command: str) -> bool:
    target = re.fullmatch(r"make ([\w-]+)", command)
    return (
        any(command in run.shown for run in RUNS.values())
        or command in ELSEWHERE
        or command in NOT_RUN
        or bool(target and target.group(1) in MAKE_TARGETS)
    )


# --------------------------------------------------------------------------------------------- the tests


def test_every_shown_command_is_covered():
    where = shown_commands()
    assert DDP_8 in where and "make test" in where, "the extraction finds the commands"
    missing = {command: sorted(places) for command, places in where.items() if not covered(command)}
    assert not missing, f"shown but neither run by a test nor allow-listed: {missing}"


def test_coverage_lists_are_not_stale():
    where = shown_commands()
    stale = [c for run in RUNS.values() for c in run.shown if c not in where] + [c for c in ELSEWHERE if c not in where]
    assert not stale, f"listed as covered but no longer shown anywhere: {stale}"
    makefile = (ROOT / "Makefile").read_text()
    targets = [m.group(1) for c in where if (m := re.fullmatch(r"make ([\w-]+)", c))]
    missing = [t for t in targets if not re.search(rf"^{re.escape(t)}:", makefile, flags=re.M)]
    assert not missing, f"shown `make` targets that the Makefile does not have: {missing}"
    for command, test in ELSEWHERE.items():
        path, name = test.split("::")
        source = (ROOT / path).read_text()
        # the test spells the command's words, holds the whole command as a string, or runs it from a template
        # per chapter ("... {stem} ...")
        templates = [
            t.replace("{stem}", stem)
            for t in re.findall(r'"([^"\n]*\{stem\}[^"\n]*)"', source)
            for stem in re.findall(r"\b\d\d_[a-z_]+\b", command)[:1]
        ]
        whole = f'"{command}"' in source or f"'{command}'" in source
        assert f"def {name}(" in source and (
            all(f'"{word}"' in source for word in command.split()[1:]) or whole or command in templates
        ), test


def _tiny_notebook(path: Path, stored: str | None = None) -> None:
    """One code cell, ``x = 6 * 7; x``; with ``stored``, that text is its stored output (as after one run)."""
    outputs = [{"output_type": "execute_result", "execution_count": 1, "metadata": {}, "data": {"text/plain": stored}}]
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": 1 if stored is not None else None,
                "id": "c0",
                "metadata": {},
                "outputs": outputs if stored is not None else [],
                "source": ["x = 6 * 7\n", "x"],
            }
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def _free_port() -> int:
    from gradaccum.book.ddp_workers import free_port

    return free_port()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_shown_command_runs(name, tmp_path):
    run = RUNS[name]
    (tmp_path / "my_module.py").write_text(
        "import torch\nfrom gradaccum.book.data import load_digits_split\n"
        "from gradaccum.book.models import make_cnn\n\n\n"
        "def make():\n    d = load_digits_split()\n"
        "    return make_cnn('group'), torch.nn.CrossEntropyLoss(), d.x_train[:32], d.y_train[:32]\n"
    )
    # gpu_check compares with the stored output: the notebook holds the one a run stores
    _tiny_notebook(tmp_path / "tiny.ipynb", stored="42" if name == "gpu-check" else None)
    import torch

    fill = {
        "py": sys.executable,
        "torchrun": str(BIN / "torchrun"),
        "port": str(_free_port()),
        "tmp": str(tmp_path),
        "root": str(ROOT),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    argv = [part.format(**fill) for part in run.argv]
    env = {**os.environ, **{k: v.format(**fill) for k, v in run.env.items()}}
    many = any(part.startswith("--nproc_per_node=") and int(part.split("=")[1]) > 2 for part in argv)
    with heavy_job() if many else contextlib.nullcontext():  # never beside chapter 5's timing cell
        proc = subprocess.run(argv, cwd=run.cwd.format(**fill), env=env, capture_output=True, text=True, timeout=300)
    log = f"$ {shlex.join(argv)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, log
    assert re.search(run.expect, proc.stdout), log
    if "ddp_train.py" in " ".join(argv):
        assert float(re.search(DDP_OUT, proc.stdout).group(1)) < 1e-12, log  # no_sync changes nothing
    if name == "execute-notebooks":  # make outputs stores the outputs in place
        cell = json.loads((tmp_path / "tiny.ipynb").read_text())["cells"][0]
        text = cell["outputs"][0]["data"]["text/plain"]
        assert ("".join(text) if isinstance(text, list) else text) == "42"


def _ddp_train():
    spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "scripts" / "ddp_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resolved(command: str, n_images: int = 1221) -> tuple[int, int, int, int]:
    """(world size, K, b, steps) that a single-node torchrun command of ddp_train.py runs with."""
    words = shlex.split(command)
    world = int(next(w for w in words if w.startswith("--nproc_per_node=")).split("=")[1])
    script = _ddp_train()
    args = script.parser().parse_args(words[words.index("scripts/ddp_train.py") + 1 :])
    return world, args.k, script.choose_b(args, n_images, world), args.steps


def test_explicit_defaults_are_the_defaults():
    assert _resolved(DDP_2) == _resolved(DDP_2_EXPLICIT) == (2, 4, 8, 5)


def test_two_node_world_fits_the_data(digits):
    from gradaccum.book.ddp_tasks import _shard

    script = _ddp_train()
    args = script.parser().parse_args([])
    n = digits.x_train.shape[0]
    b = script.choose_b(args, n, 16)  # 2 nodes × 8 processes
    assert (n, b) == (1221, 3)
    x, _ = _shard(15, 16, args.k * b * args.steps, digits.x_train.dtype, (digits.x_train, digits.y_train))
    assert x.shape[0] == 4 * 3 * 5  # the last of 16 ranks gets its full share


def test_a_micro_batch_that_does_not_fit_is_refused_with_one_that_does():
    script = _ddp_train()
    with pytest.raises(ValueError, match=r"--b 3\b"):
        script.choose_b(script.parser().parse_args(["--k", "8", "--b", "16"]), 1221, 8)
    with pytest.raises(ValueError, match="use at most"):
        script.choose_b(script.parser().parse_args(["--k", "8", "--steps", "100"]), 1221, 8)
    with pytest.raises(ValueError, match="--b must be >= 1"):
        script.choose_b(script.parser().parse_args(["--b", "0"]), 1221, 2)


def test_extraction_reads_fences_spans_and_usage_lines():
    md = (
        "Run `python -m pkg.tool --x` or `make book`; not `torchrun`.\n```bash\ntorchrun --a b   # note\n```\n"
        "```python\npython -m not.a.command\n```\n"
    )
    assert _from_markdown(md) == {"python -m pkg.tool --x", "make book", "torchrun --a b"}
    doc = "Usage: python scripts/x.py [--y]   (default: z)\n    python -m a.b --c    # comment\n``make nb``"
    assert _from_docstring(doc) == {"python scripts/x.py [--y]", "python -m a.b --c", "make nb"}


def test_make_help_describes_every_target():
    """`make help` lists every target of the Makefile with a description."""
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, flags=re.M).group(1).split()
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    described = dict(re.findall(r"^\s+make (\S+)\s+(.+)$", out, flags=re.M))
    assert sorted(described) == sorted(phony), (sorted(described), sorted(phony))
    assert all(len(text.split()) >= 2 for text in described.values())


def test_make_clean_removes_only_build(tmp_path):
    """`make clean` (README) removes _build and leaves the environment and the sources alone."""
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    (tmp_path / "_build" / "html").mkdir(parents=True)
    (tmp_path / "_build" / "html" / "index.html").write_text("x")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").write_text("")
    (tmp_path / "intro.md").write_text("x")
    subprocess.run(["make", "-s", "clean"], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    assert not (tmp_path / "_build").exists()
    assert (tmp_path / ".venv" / ".installed").exists() and (tmp_path / "intro.md").exists()
