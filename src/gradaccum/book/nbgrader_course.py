"""The course kit for nbgrader: a chapter's exercises as an nbgrader source notebook, and the course folder.

Each exercise cell of a chapter becomes an nbgrader *solution* cell (the student edits ``answer = ...``; the source
holds the right answer, computed by the checker) followed by a locked, graded *test* cell that grades the answer with
the same checker through :func:`gradaccum.book.exercises.verify`, in course mode; where an exercise asks for more than
its checkers check, a manually graded answer cell follows. ``python -m gradaccum.book.course nbgrader`` writes the
course folder (:func:`write_nbgrader`); :mod:`gradaccum.book.marks` puts the manual marks into its gradebook.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gradaccum.book import exercises
from gradaccum.book.course import (
    COURSE_MODE_CALL,
    EXERCISE,
    _source,
    checker_calls,
    inline_includes,
    install_from,
    is_exercise_cell,
    student_package,
)

#: The kernel the course's notebooks name: ``python3``, which every student's Jupyter has (the set-up cell installs
#: gradaccum on Colab; elsewhere the student installs :func:`student_package` into it).
KERNEL = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}

#: The kernel nbgrader grades in (``c.Execute.kernel_name`` in :data:`NBGRADER_CONFIG`, whatever the notebook names):
#: the book's environment, installed with ``make kernel``. Grading with a kernel that lacks torch and gradaccum fails
#: every cell and gives every student 0.
GRADING_KERNEL = "gradaccum"

#: What a student finds in an answer cell after ``nbgrader generate_assignment`` (ClearSolutions' code stub).
CODE_STUB = "answer = None  # YOUR ANSWER HERE"

#: The course's id in nbgrader (the exchange keeps each course's assignments under it).
COURSE_ID = "gradient-accumulation-correctly"

#: nbgrader_config.py of the course folder ``write_nbgrader`` writes. The exchange (where ``release_assignment`` puts
#: assignments and ``collect`` finds submissions) is the folder ``exchange`` beside this file, not nbgrader's
#: system-wide default /srv/nbgrader/exchange; on a shared JupyterHub, point it and the students' config at a
#: folder every user can reach.
NBGRADER_CONFIG = f"""import os

c = get_config()  # noqa: F821 (nbgrader's config loader defines it)
c.CourseDirectory.course_id = {COURSE_ID!r}
c.Exchange.root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exchange")
c.ClearSolutions.code_stub = {{"python": {CODE_STUB!r}}}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
# validate and autograde run every notebook in the book's environment (`make kernel`), whatever kernel it names
c.Execute.kernel_name = {GRADING_KERNEL!r}
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


def graded_cell_source(name: str, kwargs: dict[str, Any]) -> str:
    """The locked test cell of the answer cell that calls ``exercises.<name>(answer, **kwargs)``: the same checker,
    imported afresh and called through :func:`~gradaccum.book.exercises.verify` (rebinding ``exercises`` in the
    notebook changes nothing here), which fails with the checker's message. No value is written in the cell, and it
    has no hidden part: the release holds the cell exactly as the gradebook does (no checksum warning). The ✓ is
    printed, not returned: nbgrader would read a returned value as a partial score."""
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return (
        f"# Graded: the checker of the cell above, imported afresh\nfrom gradaccum.book.exercises import verify\n\n"
        f"print(verify({name!r}, answer{args}))"
    )


def nbgrader_notebook(
    nb: dict[str, Any], title: str = "", points: int = 1, argument_points: int = 2, package: str | None = None
) -> dict[str, Any]:
    """A chapter's exercises as an nbgrader *source* notebook: the chapter's set-up cell, then per exercise its text,
    for each checker an answer cell (the right answer between ``### BEGIN SOLUTION`` / ``### END SOLUTION``, so that
    ``generate_assignment`` keeps the instruction and the checker call and puts :data:`CODE_STUB` in its place) and a
    locked test cell worth ``points`` that asserts the checker accepts the answer, and — where the exercise asks for
    more than its checkers check (an argument, a prediction, an explanation) — a manually graded answer cell worth
    ``argument_points`` holding the book's model solution. The set-up installs ``package`` on Colab
    (:func:`student_package`) and puts the checkers in course mode; the notebook names :data:`KERNEL`."""
    cells: list[dict[str, Any]] = []
    setup = next(c for c in nb["cells"] if c["cell_type"] == "code")
    install = install_from(_source(setup), package or student_package())
    install = install.split("\nimport matplotlib")[0].split("\nimport gradaccum")[0].rstrip()
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
        cells,
        "code",
        f"{install}\n\nimport gradaccum\nfrom gradaccum.book import exercises\n\n"
        f"gradaccum.setup(seed=0)\n{COURSE_MODE_CALL}",
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
            expected, _ = exercises.expected_answer(getattr(exercises, name), **kwargs)
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
                graded_cell_source(name, kwargs),
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


def write_nbgrader(root: Path, out: Path, package: str | None = None) -> list[Path]:
    """An nbgrader course folder: ``nbgrader_config.py`` and, per chapter, the source notebook of its exercises
    (``source/<chapter>/<chapter>.ipynb``), installing ``package`` on Colab (:func:`student_package`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG)
    written = []
    for path in sorted((Path(root) / "chapters").glob("*.ipynb")):
        target = out / "source" / path.stem / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        notebook = nbgrader_notebook(json.loads(path.read_text()), package=package)
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written
