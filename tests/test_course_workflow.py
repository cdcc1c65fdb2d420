"""A semester with the nbgrader course, as instructor.md walks it, on chapters 1 and 3 (one a week):
``make nbgrader``'s command writes the course folder; then, per chapter, the page's commands in its order —
validate, generate_assignment, release_assignment (into the exchange folder the generated config names), students
fetch and submit, collect, autograde, manual marks (exported, filled in, imported), generate_feedback,
release_feedback — and the students fetch their feedback.

Three generated students, and a fourth in week 1: *untouched* submits the release as fetched, *right* answers
everything right, *slips* makes realistic slips (some answers the checker accepts: "nn.BatchNorm2d", chapter 3's
shrink computed with ``clip_grad_norm_``), *tamper* (week 1) answers wrong and rewrites a locked test cell to print
a ✓. Every score is asserted: each automatic score is the checker's verdict on that answer (full points where it
accepts, 0 where it does not), each manual score the mark given. autograde's log shows a checksum warning for the
tampered cell only (none for the untouched submission), and nbgrader restores the cell. No feedback file of a
student states an expected value the student did not give.

The students' side (fetch, submit, fetch feedback) runs in this process with nbgrader's own exchange classes (what
the Assignment List and ``nbgrader fetch_assignment``/``submit`` run), each student in a home folder of their own;
the instructor's side runs the page's commands as processes. Each step's time is printed (the page quotes them)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from layout import ROOT
from test_nbgrader import visible_text

from gradaccum.book import course, exercises, grading, nbgrader_course

pytestmark = [pytest.mark.nbgrader, pytest.mark.slow]
nbgrader = pytest.importorskip("nbgrader")

WEEKS = ("01_microbatch_statistics", "03_clip_ordering")

#: instructor.md's commands for one chapter, in its order ({stem}: the chapter): the instructor's whole week.
#: test_the_page_shows_the_commands_the_test_runs checks that the page shows exactly these.
STEPS = (
    "nbgrader validate source/{stem}/{stem}.ipynb",
    "nbgrader generate_assignment {stem}",
    "nbgrader release_assignment {stem}",
    "nbgrader collect {stem}",
    "nbgrader autograde {stem}",
    "python -m gradaccum.book.marks export {stem} marks.csv",
    "python -m gradaccum.book.marks import marks.csv",
    "nbgrader generate_feedback {stem}",
    "nbgrader release_feedback {stem}",
)
STUDENTS_SUBMIT_AFTER = "nbgrader release_assignment {stem}"
MARK_AFTER = "python -m gradaccum.book.marks export {stem} marks.csv"

#: chapter 3's shrink exercise as a student computes it: clip_grad_norm_ leaves about 3e-7, not 0.
CLIPPED = (
    "import torch\n\ngrads = []\nfor g in ([3.0, 0.0], [-1.0, 0.0]):\n    p = torch.nn.Parameter(torch.zeros(2))\n"
    "    p.grad = torch.tensor(g)\n    torch.nn.utils.clip_grad_norm_([p], max_norm=1.0)\n    grads.append(p.grad)\n"
    "answer = float(((grads[0] + grads[1]) / 2).norm())"
)

#: The slips student: the code of each answer, and whether the checker accepts it.
SLIPS = {
    "grade_effective_momentum": ("answer = 0.05 * 6", False),  # added the K momenta
    "grade_corrected_momentum": ("answer = 0.00851", False),  # three digits where five are asked
    "grade_biased_variance_ratio": ("answer = (4 - 1) / 4", True),
    "grade_batch_coupled": ('answer = {"nn.BatchNorm2d"}', True),
    "grade_clip_scaled_micro": ("answer = 4.0", False),  # the raw micro-gradients, not g_k/K
    "grade_clip_raw_micro": (CLIPPED, True),
    "grade_scaler_clip_order": ("answer = 1.53e-5", True),  # rounded to three digits
}

#: The marks the instructor gives the written answers: (points, of the cell's maximum): untouched is left as the
#: export prefills it (0).
MARKS = {"right": 1.0, "slips": 0.5, "tamper": 0.0}


def _answer(student: str, name: str, kwargs: dict) -> str | None:
    """The code a student puts in an answer cell (None: the cell is left as released)."""
    if student == "right":
        return f"answer = {exercises.expected_answer(getattr(exercises, name), **kwargs)[0]!r}"
    if student == "slips":
        return SLIPS[name][0]
    if student == "tamper":
        return "answer = -1.0"
    return None


def _accepted(student: str, name: str, kwargs: dict) -> bool:
    """The checker's verdict on what the student answers (run here, as the answer cell runs it)."""
    code = _answer(student, name, kwargs)
    if code is None:
        return False
    namespace: dict = {}
    exec(code, namespace)
    return bool(getattr(exercises, name)(namespace["answer"], **kwargs))


def _work(notebook: Path, student: str) -> None:
    """The student's work on the fetched notebook, saved in place."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        meta = cell["metadata"].get("nbgrader", {})
        if nbgrader_course.CODE_STUB in src:
            ((name, kwargs),) = course.checker_calls(src)
            code = _answer(student, name, kwargs)
            cell["source"] = src if code is None else src.replace(nbgrader_course.CODE_STUB, code)
        elif cell["cell_type"] == "markdown" and "YOUR ANSWER HERE" in src and student != "untouched":
            argument = "A micro-batch's statistics are not the batch's, so the step differs."
            cell["source"] = src.replace("YOUR ANSWER HERE", argument)
        elif student == "tamper" and meta.get("locked") and meta.get("grade"):
            cell["source"] = 'print("✓ correct.")'
    notebook.write_text(json.dumps(nb))


def _exchange(kind: str, course_root: Path, home: Path, student: str, stem: str) -> None:
    """What a student's Assignment List does (fetch, submit, fetch feedback), with nbgrader's exchange classes."""
    from nbgrader.auth import Authenticator
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.exchange.default import ExchangeFetchAssignment, ExchangeFetchFeedback, ExchangeSubmit
    from traitlets.config import Config

    config = Config()
    config.Exchange.root = str(course_root / "exchange")
    config.Exchange.cache = str(home / ".nbgrader_cache")
    config.Exchange.assignment_dir = str(home)
    config.CourseDirectory.course_id = nbgrader_course.COURSE_ID
    config.CourseDirectory.assignment_id = stem
    config.CourseDirectory.student_id = student
    kinds = {"fetch": ExchangeFetchAssignment, "submit": ExchangeSubmit, "feedback": ExchangeFetchFeedback}
    coursedir = CourseDirectory(config=config)
    kinds[kind](coursedir=coursedir, authenticator=Authenticator(config=config), config=config).start()


def _run(command: str, cwd: Path, env: dict[str, str]) -> tuple[str, float]:
    argv = command.split()
    argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - start
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr, took


def _mark(marks_file: Path) -> None:
    """The instructor fills in the marks file: the mark of MARKS, of each cell's maximum, where a row is blank."""
    with open(marks_file, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        if row["points"] == "":
            row["points"] = str(MARKS[row["student"]] * float(row["max_points"]))
    with open(marks_file, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _week(root: Path, homes: Path, stem: str, env: dict[str, str]) -> dict:
    """One chapter's week: the instructor's commands (STEPS), the students in between."""
    students = ["untouched", "right", "slips"] + (["tamper"] if stem == WEEKS[0] else [])
    logs, times, exported = {}, {}, []
    for template in STEPS:
        command = template.format(stem=stem)
        logs[template], times[command] = _run(command, root, env)
        if template == STUDENTS_SUBMIT_AFTER:
            for student in students:
                home = homes / student
                home.mkdir(exist_ok=True)
                _exchange("fetch", root, home, student, stem)
                _work(home / stem / f"{stem}.ipynb", student)
                _exchange("submit", root, home, student, stem)
        if template == MARK_AFTER:
            with open(root / "marks.csv", newline="", encoding="utf-8") as f:
                exported = list(csv.DictReader(f))
            _mark(root / "marks.csv")
    for student in students:
        _exchange("feedback", root, homes / student, student, stem)
    return {"students": students, "logs": logs, "times": times, "exported": exported}


@pytest.fixture(scope="module")
def semester(tmp_path_factory):
    """The course folder after both weeks, with what each week logged and took."""
    prefix = tmp_path_factory.mktemp("kernel")
    env = dict(
        os.environ,
        JUPYTER_PATH=str(prefix / "share" / "jupyter"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    root, homes = tmp_path_factory.mktemp("course"), tmp_path_factory.mktemp("homes")
    _run(f"python -m ipykernel install --prefix {prefix} --name {nbgrader_course.GRADING_KERNEL}", root, env)
    _, took = _run(f"python -m gradaccum.book.course nbgrader --root {ROOT} --out {root}", root, env)
    weeks = {stem: _week(root, homes, stem, env) for stem in WEEKS}
    print(f"\nwrite the course: {took:.1f} s")
    for week in weeks.values():
        for command, seconds in week["times"].items():
            print(f"{seconds:6.1f} s  {command}")
    (root / "timings.json").write_text(json.dumps({stem: w["times"] for stem, w in weeks.items()}, indent=1))
    return root, homes, weeks


def _sections(log: str) -> dict[str, str]:
    """autograde's log, cut into one part per submission (each starts with 'Sanitizing .../submitted/<student>/')."""
    parts = re.split(r"(?=\[AutogradeApp \| INFO\] Sanitizing \S*/submitted/)", log)
    return {re.search(r"/submitted/([^/]+)/", p).group(1): p for p in parts if "/submitted/" in p.split("\n")[0]}


@pytest.mark.parametrize("stem", WEEKS)
def test_only_a_tampered_cell_raises_a_checksum_warning(semester, stem):
    _, _, weeks = semester
    week = weeks[stem]
    sections = _sections(week["logs"]["nbgrader autograde {stem}"])
    assert sorted(sections) == sorted(week["students"])
    for student, log in sections.items():
        warned = re.findall(r"Attribute 'checksum' for cell (\S+) has changed", log)
        if student == "tamper":
            assert warned and all("-test-" in cell for cell in warned), log
        else:
            assert not warned, (student, log)


@pytest.mark.parametrize("stem", WEEKS)
def test_every_score(semester, stem):
    """Automatic points where the checker accepts the answer and none where it does not; manual points as
    marked; the right student gets full automatic points, and after the marks, the whole assignment."""
    root, _, weeks = semester
    from nbgrader.api import Gradebook

    source = json.loads((root / "source" / stem / f"{stem}.ipynb").read_text())
    checks = {}
    for answer_cell, test_cell in zip(source["cells"], source["cells"][1:]):
        if "verify(" in test_cell["source"]:
            checks[test_cell["metadata"]["nbgrader"]["grade_id"]] = course.checker_calls(answer_cell["source"])[0]
    assert checks
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for student in weeks[stem]["students"]:
            nb = gb.find_submission_notebook(stem, stem, student)
            auto = [g for g in nb.grades if g.cell.name in checks]
            manual = [g for g in nb.grades if g.cell.name.endswith("-argument")]
            assert len(auto) == len(checks) and manual and len(auto) + len(manual) == len(nb.grades)
            for grade in auto:
                accepted = _accepted(student, *checks[grade.cell.name])
                assert grade.auto_score == (grade.max_score if accepted else 0), (student, grade.cell.name)
                if student == "slips":
                    assert accepted == SLIPS[checks[grade.cell.name][0]][1], grade.cell.name
            for grade in manual:  # autograde scores an unchanged written answer 0; the others wait for a mark
                assert not grade.needs_manual_grade and grade.auto_score == (0 if student == "untouched" else None)
                assert grade.score == MARKS.get(student, 0.0) * grade.max_score, (student, grade.cell.name)
            auto_points = sum(g.auto_score for g in auto)
            if student == "right":
                assert auto_points == sum(g.max_score for g in auto) and nb.score == nb.max_score
            if student in ("untouched", "tamper"):
                assert nb.score == 0
    assert any(ok for _, ok in SLIPS.values()) and not all(ok for _, ok in SLIPS.values())


@pytest.mark.parametrize("stem", WEEKS)
def test_marks_export_prefills_untouched_answers_only(semester, stem):
    _, _, weeks = semester
    rows = weeks[stem]["exported"]
    assert {r["student"] for r in rows} == set(weeks[stem]["students"])
    for row in rows:
        assert (row["points"] == "0") == (row["student"] == "untouched"), row
        assert row["points"] in ("0", "") and row["cell"].endswith("-argument")


@pytest.mark.parametrize("stem", WEEKS)
def test_feedback_reaches_students_and_states_no_expected_value(semester, stem):
    """Each student fetches a feedback file showing their score and, for each wrong answer, the checker's message;
    none states an expected value the student did not give (the test cells call the checker, in course mode)."""
    root, homes, weeks = semester
    source = json.loads((root / "source" / stem / f"{stem}.ipynb").read_text())
    calls = [
        c
        for cell in source["cells"]
        if "BEGIN SOLUTION" in cell["source"]
        for c in course.checker_calls(cell["source"])
    ]
    for student in weeks[stem]["students"]:
        (fetched,) = (homes / student / stem / "feedback").glob(f"*/{stem}.html")
        text = visible_text(fetched.read_text())
        assert "Score:" in text and "BEGIN HIDDEN" not in text and "BEGIN SOLUTION" not in text
        for name, kwargs in calls:
            if student == "right" or _accepted(student, name, kwargs):
                continue
            expected = exercises.expected_answer(getattr(exercises, name), **kwargs)[0]
            own = _answer(student, name, kwargs) or ""  # what the student wrote may be the answer rounded
            for form in (f for f in course.answer_forms(expected) if f not in own):
                assert not re.search(rf"(?<![\d.]){re.escape(form)}(?!\d)", text), (student, name, form)
            if student == "slips":
                namespace: dict = {}
                exec(SLIPS[name][0], namespace)
                with grading.course_messages():
                    said = getattr(exercises, name)(namespace["answer"], **kwargs).message
                assert " ".join(said.split())[:60] in " ".join(text.split()), (name, said)


def test_the_page_shows_the_commands_the_test_runs():
    """instructor.md's semester shows exactly STEPS, in order, for its example chapter; the exchange is the
    course's own folder, and the page quotes the time of each step."""
    page = (ROOT / "instructor.md").read_text()
    section = page.split("## A semester with nbgrader")[1].split("\n## ")[0]
    shown = [
        line.strip()
        for block in re.findall(r"^```bash\n(.*?)^```", section, flags=re.M | re.S)
        for line in block.splitlines()
        if line.strip()
    ]
    assert shown == [step.format(stem=WEEKS[0]) for step in STEPS]
    assert "exchange" in section and "/srv/nbgrader" in page and "formgrader" in section.lower()
    for step in ("validate", "generate_assignment", "release_assignment", "collect", "autograde", "generate_feedback"):
        assert re.search(rf"`{step}`[^|\n]*\|[^|\n]*\d+ s", section), f"no measured time for {step}"
