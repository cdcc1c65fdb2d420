"""nbgrader on every chapter at once: ``python -m gradaccum.book.course nbgrader`` writes the course;
``nbgrader validate`` passes every source; ``generate_assignment`` releases them with the instructions and checker
calls kept and no answer left; a right and a wrong submission of each are autograded in the book's kernel (with no
checksum warning: nobody edited a locked cell); the right one gets full marks, the wrong one 0 on every auto-graded
item, and its feedback carries the checker's course-mode explanation of each mistake and no expected value. A third
student (first chapter only) gives wrong answers and rebinds ``exercises`` so that every checker says yes: the test
cells import the checker afresh and still give 0. (tests/test_course_workflow.py runs instructor.md's semester, one
chapter at a time, with release, collect, manual marks and feedback.)

Runs with the book's environment as the grading kernel (a kernelspec named ``gradaccum`` installed into a
temporary prefix, as ``make kernel`` installs it into the environment; the course's config grades with it)."""

from __future__ import annotations

import html
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from layout import CHAPTERS, ROOT

from gradaccum.book import course, exercises, grading, nbgrader_course

pytestmark = pytest.mark.nbgrader
nbgrader = pytest.importorskip("nbgrader")

STEMS = sorted(CHAPTERS)

#: instructor.md's grading steps for every chapter at once (the assignment names are globs), as the fixture runs them
#: in the course folder it writes; autograde and generate_feedback also get --force so that the test can be rerun
#: in place. One nbgrader process per step instead of one per step and chapter: each costs seconds to start.
SESSION = (
    "nbgrader validate source/*/*.ipynb",
    'nbgrader generate_assignment "*"',
    'nbgrader autograde "*" --create',
    'nbgrader generate_feedback "*"',
)
SUCCESS = "Success! Your notebook passes all the tests."


def visible_text(page: str) -> str:
    """What a reader sees of an HTML page: its text, without tags, styles and scripts (their numbers are CSS)."""
    page = re.sub(r"<(style|script)\b.*?</\1>", " ", page, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _wrong(name: str, kwargs: dict) -> object:
    """A typical mistake for the checker (its first listed one), or a wrong set."""
    if name == "grade_batch_coupled":
        return {"BatchNorm2d", "Dropout"}
    expected, digits, mistakes = exercises.grading_plan(getattr(exercises, name), **kwargs)
    return next(w for w, _ in mistakes if not exercises.agrees(w, expected, digits))


#: A student who makes every checker say yes from their own answer cell: the hidden tests must still fail them.
CHEAT = "class _Pass:\n    def __getattr__(self, name):\n        return lambda *a, **k: True\n\n\nexercises = _Pass()\n"


def _submit(release: Path, target: Path, right: bool, cheat: bool = False) -> list[str]:
    """Fill the released notebook's answer cells (right answers or typical mistakes) and argument cells; return
    the explanation the checker gives for each wrong answer."""
    nb = json.loads(release.read_text())
    explanations = []
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if nbgrader_course.CODE_STUB in src:
            ((name, kwargs),) = course.checker_calls(src)
            value = exercises.expected_answer(getattr(exercises, name), **kwargs)[0] if right else _wrong(name, kwargs)
            if not right:
                with grading.course_messages():  # the test cell's wording
                    explanations.append(getattr(exercises, name)(value, **kwargs).message)
            cell["source"] = src.replace(nbgrader_course.CODE_STUB, f"answer = {value!r}")
            if cheat:
                cell["source"] = CHEAT + cell["source"]
        elif cell["cell_type"] == "markdown" and "YOUR ANSWER HERE" in src:
            cell["source"] = src.replace("YOUR ANSWER HERE", "The statistics of a micro-batch are not the batch's.")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(nb))
    return explanations


def _session(root: Path, stems: list[str], env: dict[str, str], cheat_stem: str) -> tuple[dict, dict]:
    """instructor.md's grading session for every chapter in the course folder ``root``: each step once, for all."""
    validate, generate, autograde, feedback = (shlex.split(t) for t in SESSION)
    validated = _run([*validate[:2], *(str(p.relative_to(root)) for p in sorted(root.glob(validate[2])))], root, env)
    # one "Success!" per notebook, in the order given (validate prints no file name): all or the whole log
    ok = validated.count(SUCCESS) == len(stems)
    logs = {(stem, "validate"): SUCCESS if ok else validated for stem in stems}
    _run(generate, root, env)
    explanations = {}
    for stem in stems:
        release = root / "release" / stem / f"{stem}.ipynb"
        _submit(release, root / "submitted" / "right" / stem / f"{stem}.ipynb", right=True)
        explanations[stem] = _submit(release, root / "submitted" / "wrong" / stem / f"{stem}.ipynb", right=False)
        if stem == cheat_stem:
            _submit(release, root / "submitted" / "cheat" / stem / f"{stem}.ipynb", right=False, cheat=True)
    logs["autograde"] = _run([*autograde, "--force"], root, env)
    _run([*feedback, "--force"], root, env)
    return logs, explanations


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One course folder and its gradebook, every chapter graded in one session, as one instructor's."""
    prefix = tmp_path_factory.mktemp("kernel")
    env = dict(
        os.environ,
        JUPYTER_PATH=str(prefix / "share" / "jupyter"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    root = tmp_path_factory.mktemp("course")
    _run(
        [
            sys.executable,
            "-m",
            "ipykernel",
            "install",
            "--prefix",
            str(prefix),
            "--name",
            nbgrader_course.GRADING_KERNEL,
        ],
        root,
        env,
    )
    _run(
        [sys.executable, "-m", "gradaccum.book.course", "nbgrader", "--root", str(ROOT), "--out", str(root)], root, env
    )
    logs, explanations = _session(root, STEMS, env, STEMS[0])
    return {stem: root for stem in STEMS}, logs, explanations


@pytest.mark.parametrize("stem", STEMS)
def test_source_validates_and_release_keeps_instructions_not_answers(graded, stem):
    where, logs, _ = graded
    root = where[stem]
    assert "Success! Your notebook passes all the tests." in logs[stem, "validate"]
    source = json.loads((root / "source" / stem / f"{stem}.ipynb").read_text())
    assert source["metadata"]["kernelspec"]["name"] == "python3"  # every student has it; grading uses the book's
    released = (root / "release" / stem / f"{stem}.ipynb").read_text()
    assert "BEGIN SOLUTION" not in released and "END SOLUTION" not in released
    cells = json.loads(released)["cells"]
    answers = [
        "".join(c["source"]) for c in cells if c["metadata"].get("nbgrader", {}).get("grade_id", "").count("-answer-")
    ]
    assert answers and all(
        nbgrader_course.CODE_STUB in a and "exercises.grade_" in a and a.startswith("# ") for a in answers
    )


def test_no_checksum_warning_when_nobody_edits_a_locked_cell(graded):
    """The released test cells are the cells the gradebook stored (no hidden part removed after the checksum was
    taken), so a checksum warning in autograde's log means a student edited a locked cell."""
    _, logs, _ = graded
    assert "Autograding" in logs["autograde"] and "checksum" not in logs["autograde"], logs["autograde"][-3000:]


@pytest.mark.parametrize("stem", STEMS)
def test_right_submission_full_marks_wrong_submission_zero_with_feedback(graded, stem):
    where, _, explanations = graded
    root = where[stem]
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for student in ("right", "wrong", "cheat") if stem == STEMS[0] else ("right", "wrong"):
            nb = gb.find_submission_notebook(stem, stem, student)
            auto = [g for g in nb.grades if g.auto_score is not None and not g.cell.name.endswith("-argument")]
            assert auto, (stem, student)
            for grade in auto:
                expected = grade.max_score if student == "right" else 0
                assert grade.auto_score == expected, (stem, student, grade.cell.name, grade.auto_score)
            manual = [g for g in nb.grades if g.cell.name.endswith("-argument")]
            assert all(g.auto_score is None and g.needs_manual_grade for g in manual), (stem, student)
    feedback = (root / "feedback" / "wrong" / stem / f"{stem}.html").read_text()
    text = visible_text(feedback)
    for why in explanations[stem]:
        assert why.split(":")[0][:40] in text, (stem, why)
    source = json.loads((root / "source" / stem / f"{stem}.ipynb").read_text())
    for cell in source["cells"]:
        for name, kwargs in course.checker_calls(cell["source"]) if "BEGIN SOLUTION" in cell["source"] else []:
            expected = exercises.expected_answer(getattr(exercises, name), **kwargs)[0]
            for form in course.answer_forms(expected):
                assert not re.search(rf"(?<![\d.]){re.escape(form)}(?!\d)", text), (stem, name, form)
