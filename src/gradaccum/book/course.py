"""The course kit: a student edition of the book, and a conversion of its exercises for nbgrader.

Student edition (``make student``, or ``python -m gradaccum.book.course student``): every chapter with its
``solution`` directives removed and the outputs of its exercise cells (the cells that call a checker from
:mod:`gradaccum.book.exercises`) cleared; everything else — text, code, stored figures — is kept, so the notebooks run
top to bottom. Jupyter Book's ``hide_solutions`` cannot do this: it crashes on gated solutions, and it would only
hide them in HTML, not remove them from the notebooks students download.

nbgrader (``python -m gradaccum.book.course nbgrader``): each exercise cell becomes an nbgrader *solution* cell (the
student edits ``answer = ...``) followed by a locked, graded *test* cell that asserts the checker accepts the
answer; the checker's message says what is wrong when it does not.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from gradaccum.book import exercises

SOLUTION = re.compile(r"```\{solution\}.*?\n```[ \t]*\n?", re.S)
EXERCISE = re.compile(r"```\{exercise\}[^\n]*\n:label:\s*(\S+)")
CHECK_CALL = re.compile(r"^exercises\.(grade_\w+)\((.*)\)\s*$", re.M)

BOOK_FILES = ("_config.yml", "_toc.yml", "intro.md", "references.md", "references.bib")

#: Pages of the book that would give away exercise answers, replaced by a short note in the student edition
#: (every other page in the table of contents is copied as it is).
STUDENT_STUBS: dict[str, str] = {
    "errata": "# Corrections\n\nThe book's corrections are listed in the full edition: several of them concern "
    "exercise solutions, so they are published together with the solutions.\n",
}


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def checker_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Each ``exercises.grade_x(answer, k=v, ...)`` call in ``text``: the checker's name and its (literal) keyword
    arguments."""
    calls = []
    for name, args in CHECK_CALL.findall(text):
        call = ast.parse(f"f({args})", mode="eval").body
        assert isinstance(call, ast.Call)
        calls.append((name, {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}))
    return calls


def answer_forms(value: object) -> list[str]:
    """How a page could print an auto-checked answer: integers of two or more digits as written (with and without
    thousands separators), other numbers to 2–5 significant digits in plain and exponent notation. Sets and
    one-digit integers return no form (too common to police)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    if float(value).is_integer():
        return [] if abs(value) < 10 else sorted({f"{int(value)}", f"{int(value):,}"})
    forms = set()
    for digits in range(2, 6):
        forms |= {f"{value:.{digits}g}", f"{value:.{digits - 1}e}"}
    return sorted(forms)


def is_exercise_cell(cell: dict[str, Any]) -> bool:
    """A code cell that calls a checker from gradaccum.book.exercises."""
    return cell.get("cell_type") == "code" and bool(CHECK_CALL.search(_source(cell)))


def solution_texts(nb: dict[str, Any]) -> list[str]:
    """The solutions' lines of substance (at least 25 characters), to check that none leaks."""
    texts = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for block in SOLUTION.findall(_source(cell)):
                body = block.split("\n", 2)[-1]
                texts += [
                    line.strip()
                    for line in body.splitlines()
                    if len(line.strip()) >= 25 and not line.strip().startswith((":", "```"))
                ]
    return texts


#: ```{literalinclude} ../src/gradaccum/<module>.py + :pyobject: <name>: the chapters show the package's own code.
INCLUDE = re.compile(r"```\{literalinclude\} \.\./src/gradaccum/(\w+)\.py\n:pyobject: ([\w.]+)\n(?::[^\n]*\n)*```")


def package_source(module: str, pyobject: str) -> str:
    """The source of ``pyobject`` (``name`` or ``Class.method``) in ``gradaccum.<module>``, read from the installed
    package, as Sphinx's ``literalinclude :pyobject:`` selects it (decorators included)."""
    path = Path(__file__).resolve().parents[1] / f"{module}.py"
    if not path.exists():
        raise ValueError(f"gradaccum has no module {module!r}: the include names a file that is not in the package.")
    text = path.read_text(encoding="utf-8")
    node: Any = ast.parse(text)
    for part in pyobject.split("."):
        found = [n for n in node.body if getattr(n, "name", None) == part]
        if not found:
            raise ValueError(f"gradaccum.{module} defines no {pyobject!r}: fix the chapter's literalinclude.")
        node = found[0]
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    lines = text.splitlines()[start - 1 : node.end_lineno]
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


def inline_includes(text: str) -> str:
    """Replace each ``literalinclude`` of the package's source by a fenced copy of the code: the student edition and
    nbgrader's notebooks carry no package source to include from."""
    return INCLUDE.sub(lambda m: "```python\n" + package_source(m.group(1), m.group(2)) + "\n```", text)


def student_notebook(nb: dict[str, Any]) -> dict[str, Any]:
    """The student version of a chapter: solutions removed, exercise outputs cleared, included package code
    inlined, the rest kept."""
    out = copy.deepcopy(nb)
    cells = []
    for cell in out["cells"]:
        if cell["cell_type"] == "markdown":
            text = inline_includes(SOLUTION.sub("", _source(cell))).strip()
            if not text:
                continue  # the cell held only a solution
            cell["source"] = text
        elif is_exercise_cell(cell):
            cell["outputs"], cell["execution_count"] = [], None
        cells.append(cell)
    out["cells"] = cells
    return out


#: Where the student edition is published (its own repository or branch, without solutions). Its launch buttons
#: (Binder, Colab, Live Code) and repository button point here, never at the book's repository with the
#: solutions. Set it with ``make student STUDENT_REPO=<url> STUDENT_BRANCH=<branch>`` (or ``--repository``/
#: ``--branch``); instructor.md documents it.
STUDENT_REPOSITORY = "https://github.com/gradaccum/gradient-accumulation-correctly-student"
STUDENT_BRANCH = "main"

#: What the student edition's introduction says about itself, in place of the full edition's sentence on solutions.
STUDENT_INTRO_NOTE = (
    "- **Exercises** close every chapter. This is the **student edition**: the solutions are not in it (your\n"
    "  instructor has them), and most exercises with a numeric answer come with a checker that explains what a\n"
    "  wrong answer got wrong.\n"
)


def _student_config(text: str, repository: str = STUDENT_REPOSITORY, branch: str = STUDENT_BRANCH) -> str:
    """The student site's configuration: its title says what it is, and every button points at ``repository``."""
    if not re.fullmatch(r"https://\S+", repository) or not re.fullmatch(r"[\w./-]+", branch):
        raise ValueError(
            f"the student repository must be an https URL and the branch a plain name, got "
            f"{repository!r} and {branch!r}."
        )
    text = re.sub(
        r'^title:\s*"?([^"\n]*)"?', lambda m: f'title: "{m.group(1)} (student edition)"', text, count=1, flags=re.M
    )
    text, n = re.subn(
        r"^(repository:\s*\n\s+url:\s*)\S+(\s*\n\s+branch:\s*)\S+",
        rf"\g<1>{repository}\g<2>{branch}",
        text,
        count=1,
        flags=re.M,
    )
    if n != 1:
        raise ValueError("_config.yml has no repository url and branch to point at the student repository.")
    return text


def _student_intro(text: str, package_url: str = "") -> str:
    """The introduction with its sentence on solutions replaced by what the student edition is, and its line on
    running the book's Makefile (which the student edition does not carry) by how to install the package."""
    run_locally = (
        "- **Run a chapter locally**: install the book's package with\n"
        f'  `pip install "gradaccum[book] @ git+{package_url}"` and open the chapter in Jupyter.\n'
    )
    text, n = re.subn(
        r"^- \*\*Run everything locally\*\*.*?(?=^- |^\S|\Z)", run_locally, text, count=1, flags=re.M | re.S
    )
    if n != 1:
        raise ValueError("intro.md has no '- **Run everything locally**' item to replace.")
    new, n = re.subn(
        r"^- \*\*Exercises\*\* close every chapter;.*?(?=^- |^\S|\Z)",
        STUDENT_INTRO_NOTE,
        text,
        count=1,
        flags=re.M | re.S,
    )
    if n != 1:
        raise ValueError("intro.md has no '- **Exercises** close every chapter; ...' item to replace.")
    return new


def _student_toc(text: str) -> str:
    """The table of contents without the instructors' part."""
    parts = re.split(r"(?m)^(?=  - caption:)", text)
    return "".join(p for p in parts if "caption: For instructors" not in p)


def write_student_edition(
    root: Path, out: Path, repository: str = STUDENT_REPOSITORY, branch: str = STUDENT_BRANCH
) -> list[Path]:
    """Write the student edition of the book in ``root`` to ``out`` (chapters and the files the site needs), its
    buttons pointing at ``repository`` on ``branch``."""
    root, out = Path(root), Path(out)
    if out.exists():
        shutil.rmtree(out)
    (out / "chapters").mkdir(parents=True)
    for name in BOOK_FILES:
        text = (root / name).read_text()
        if name == "_config.yml":
            text = _student_config(text, repository, branch)
        elif name == "intro.md":
            text = _student_intro(text, _book_repository(root))
        elif name == "_toc.yml":
            text = _student_toc(text)
        (out / name).write_text(text)
    pages = re.findall(r"^\s*-\s*file:\s*(\S+)\s*$", _student_toc((root / "_toc.yml").read_text()), flags=re.M)
    for page in pages:
        if page.startswith("chapters/") or f"{page}.md" in BOOK_FILES:
            continue
        target = out / f"{page}.md"
        target.parent.mkdir(parents=True, exist_ok=True)
        if page in STUDENT_STUBS:
            target.write_text(STUDENT_STUBS[page])
        else:
            shutil.copy(root / f"{page}.md", target)
    for folder in ("_vendor", "_ext"):  # the site's own assets and extension (the config names them)
        shutil.copytree(root / folder, out / folder, ignore=shutil.ignore_patterns("__pycache__"))
    _write_binder(root, out)
    written = []
    for path in sorted((root / "chapters").glob("*.ipynb")):
        target = out / "chapters" / path.name
        notebook = student_notebook(json.loads(path.read_text()))
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written


def _book_repository(root: Path) -> str:
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", (root / "_config.yml").read_text(), flags=re.M)
    if match is None:
        raise ValueError("_config.yml has no repository url to install gradaccum from.")
    return match.group(1)


def _write_binder(root: Path, out: Path) -> None:
    """Binder files for the student edition published on its own: the book's runtime requirements plus the
    ``gradaccum`` package installed from the book's repository (the student edition carries no package source)."""
    requirements = (root / "binder" / "requirements.txt").read_text().rstrip("\n")
    (out / "binder").mkdir(exist_ok=True)
    (out / "binder" / "requirements.txt").write_text(
        f"{requirements}\n"
        "# The student edition has no package source: install the book's package from its repository.\n"
        f"gradaccum[book] @ git+{_book_repository(root)}\n"
    )
    shutil.copy(root / "binder" / "runtime.txt", out / "binder" / "runtime.txt")


# ------------------------------------------------------------------------------------------------ nbgrader


#: The kernel the course's notebooks name: the book's environment, installed with ``make kernel``. Grading with a
#: kernel that lacks torch and gradaccum fails every cell and gives every student 0 — so the notebooks name this one.
KERNEL = {"name": "gradaccum", "display_name": "Python 3 (Gradient Accumulation, Correctly)", "language": "python"}

#: What a student finds in an answer cell after ``nbgrader generate_assignment`` (ClearSolutions' code stub).
CODE_STUB = "answer = None  # YOUR ANSWER HERE"

#: nbgrader_config.py of the course folder ``write_nbgrader`` writes.
NBGRADER_CONFIG = f"""c = get_config()  # noqa: F821 (nbgrader's config loader defines it)
c.CourseDirectory.course_id = "gradient-accumulation-correctly"
c.ClearSolutions.code_stub = {{"python": {CODE_STUB!r}}}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
c.Execute.timeout = 600
"""

SOLUTION_FOR = re.compile(r"```\{solution\}\s*(\S+)[^\n]*\n(?::[^\n]*\n)*(.*?)\n```", re.S)
ROLE = re.compile(r"\{(?:ref|numref|doc|cite|cite:p|cite:t|eq)\}`([^`]*)`")


#: The book's MathJax macros (_config.yml), spelled out for Jupyter's renderer.
MACROS = {"\\E": "\\mathbb{E}", "\\Var": "\\operatorname{Var}"}


def _plain_markdown(text: str) -> str:
    """MyST roles as plain text and the book's TeX macros spelled out, for Jupyter's renderer."""
    text = ROLE.sub(lambda m: m.group(1).split("<")[0].strip(), text)
    for macro, expansion in MACROS.items():
        text = re.sub(re.escape(macro) + r"(?![A-Za-z])", expansion.replace("\\", "\\\\"), text)
    return text


def _answer_hint(cell_source: str) -> str:
    """The chapter's instruction on the ``answer = None  # ...`` line, as a comment line."""
    match = re.search(r"^answer\s*=\s*None\s*(#.*)$", cell_source, flags=re.M)
    return match.group(1) if match else "# your answer"


def _hidden_test(expected: object, digits: int | None) -> str:
    """nbgrader hidden tests (stripped from the release) that compare ``answer`` with the expected value written
    out, with no call into the package: a student who rebinds ``exercises`` or patches the checkers in the
    kernel still fails them."""
    if digits is None:
        check = f"assert set(answer) == {expected!r}"
    else:
        value = float(expected)  # type: ignore[arg-type]
        check = f"assert abs(float(answer) - {value!r}) <= {exercises.tolerance(value, digits)!r}"
    return f"### BEGIN HIDDEN TESTS\n{check}\n### END HIDDEN TESTS"


def nbgrader_notebook(nb: dict[str, Any], title: str = "", points: int = 1, argument_points: int = 2) -> dict[str, Any]:
    """A chapter's exercises as an nbgrader *source* notebook: the chapter's set-up cell, then per exercise its text,
    for each checker an answer cell (the right answer between ``### BEGIN SOLUTION`` / ``### END SOLUTION``, so that
    ``generate_assignment`` keeps the instruction and the checker call and puts :data:`CODE_STUB` in its place) and a
    locked test cell worth ``points`` that asserts the checker accepts the answer, and — where the exercise asks for
    more than its checkers check (an argument, a prediction, an explanation) — a manually graded answer cell worth
    ``argument_points`` holding the book's model solution. The notebook names the book's kernel (:data:`KERNEL`)."""
    cells: list[dict[str, Any]] = []
    setup = next(c for c in nb["cells"] if c["cell_type"] == "code")
    install = _source(setup).split("\nimport matplotlib")[0].split("\nimport gradaccum")[0].rstrip()
    heading = title or next(
        (
            _source(c).splitlines()[0].lstrip("# ")
            for c in nb["cells"]
            if c["cell_type"] == "markdown" and _source(c).startswith("# ")
        ),
        "Exercises",
    )
    _add(
        cells,
        "markdown",
        f"# Exercises: {heading}\n\nWork with the chapter open beside this notebook: where an "
        "exercise says *above*, it means the chapter. Run the set-up cell first. Put your answer "
        "where a cell says `YOUR ANSWER HERE` and run that cell: the checker call in it says "
        "whether the answer is right and, if not, what is wrong. The locked cells grade your "
        "answers.",
    )
    # the chapter's set-up without its data and models: the exercises need the checkers only (fast to grade)
    _add(
        cells, "code", f"{install}\n\nimport gradaccum\nfrom gradaccum.book import exercises\n\ngradaccum.setup(seed=0)"
    )
    solutions = {
        label: body.strip()
        for cell in nb["cells"]
        if cell["cell_type"] == "markdown"
        for label, body in SOLUTION_FOR.findall(_source(cell))
    }
    number = 0
    for i, cell in enumerate(nb["cells"]):
        found = EXERCISE.search(_source(cell)) if cell["cell_type"] == "markdown" else None
        if found:
            number += 1
            _exercise_cells(
                cells, nb, i, found.group(1), number, solutions.get(found.group(1)), points, argument_points
            )
    return {
        "cells": cells,
        "metadata": {"kernelspec": dict(KERNEL), "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _add(cells: list[dict[str, Any]], cell_type: str, text: str, meta: dict[str, Any] | None = None) -> None:
    """Append a cell (nbgrader metadata ``meta``, if given) to ``cells``."""
    cell: dict[str, Any] = {"cell_type": cell_type, "id": f"cell-{len(cells)}", "metadata": {}, "source": text}
    if meta is not None:
        cell["metadata"]["nbgrader"] = {"schema_version": 3, **meta}
    if cell_type == "code":
        cell.update(execution_count=None, outputs=[])
    cells.append(cell)


def _exercise_cells(
    cells: list[dict[str, Any]],
    nb: dict[str, Any],
    i: int,
    label: str,
    number: int,
    solution: str | None,
    points: int,
    argument_points: int,
) -> None:
    """Exercise ``label`` (cell ``i`` of the chapter): its text, an answer and a locked test cell per checker call in
    the checker cells after it, and the manually graded argument cell where it asks for more than they check."""
    body = re.sub(r"^```\{exercise\}[^\n]*\n(?::[^\n]*\n)*", "", _source(nb["cells"][i]).strip()).removesuffix("```")
    _add(cells, "markdown", f"## Exercise {number} ({label})\n\n{_plain_markdown(inline_includes(body.strip()))}")
    checks = []
    for following in nb["cells"][i + 1 :]:
        if not is_exercise_cell(following):
            break
        checks.append(following)
    n_calls = 0
    for check in checks:
        for name, kwargs in checker_calls(_source(check)):
            n_calls += 1
            expected, digits = exercises.expected_answer(getattr(exercises, name), **kwargs)
            args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
            _add(
                cells,
                "code",
                f"{_answer_hint(_source(check))}\n### BEGIN SOLUTION\nanswer = {expected!r}\n"
                f"### END SOLUTION\nexercises.{name}(answer{args})",
                {"grade": False, "solution": True, "locked": False, "grade_id": f"{label}-answer-{n_calls}"},
            )
            _add(
                cells,
                "code",
                f"feedback = exercises.{name}(answer{args})\nassert feedback, str(feedback)\n"
                f"{_hidden_test(expected, digits)}",
                {
                    "grade": True,
                    "solution": False,
                    "locked": True,
                    "points": points,
                    "grade_id": f"{label}-test-{n_calls}",
                },
            )
    if n_calls == 0 or body.count("?") > n_calls:
        model = _plain_markdown(inline_includes(solution if solution is not None else "(see the book's solution)"))
        part = "the parts the checker does not check" if n_calls else "graded by your instructor"
        _add(
            cells,
            "markdown",
            f"**Your argument** ({part}):\n\n### BEGIN SOLUTION\n{model}\n### END SOLUTION",
            {
                "grade": True,
                "solution": True,
                "locked": False,
                "points": argument_points,
                "grade_id": f"{label}-argument",
            },
        )


def write_nbgrader(root: Path, out: Path) -> list[Path]:
    """An nbgrader course folder: ``nbgrader_config.py`` and, per chapter, the source notebook of its exercises
    (``source/<chapter>/<chapter>.ipynb``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG)
    written = []
    for path in sorted((Path(root) / "chapters").glob("*.ipynb")):
        target = out / "source" / path.stem / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        notebook = nbgrader_notebook(json.loads(path.read_text()))
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradaccum.book.course",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("what", choices=["student", "nbgrader"])
    parser.add_argument("--root", type=Path, default=Path("."), help="the book's repository (default: .)")
    parser.add_argument("--out", type=Path, help="output folder (default _build/student or _build/nbgrader)")
    parser.add_argument("--repository", default=STUDENT_REPOSITORY, help="where the student edition is published")
    parser.add_argument("--branch", default=STUDENT_BRANCH, help="its branch")
    args = parser.parse_args(argv)
    if not (args.root / "chapters").is_dir():
        parser.error(f"{args.root} has no chapters/ folder; run from the book's repository or pass --root.")
    if args.what == "student":
        paths = write_student_edition(
            args.root, args.out or args.root / "_build" / "student" / "book", args.repository, args.branch
        )
    else:
        paths = write_nbgrader(args.root, args.out or args.root / "_build" / "nbgrader")
    print(f"wrote {len(paths)} notebooks under {paths[0].parents[1] if paths else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
