"""The course kit: student edition (notebooks and site), nbgrader conversion, instructor page."""

import json
import re

import pytest
from layout import CHAPTERS, ROOT, load, source

from gradaccum.book import course

STEMS = sorted(CHAPTERS)


def plain(text):
    """Letters only, single-spaced: the same normalization for solutions, notebooks and HTML."""
    return " ".join(re.sub(r"[^A-Za-z]+", " ", text).split())


def cells_text(nb):
    return "\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in nb["cells"])


def snippets(nb):
    """Fragments of the solutions that appear nowhere else in the chapter: finding one in the student edition
    means a solution leaked."""
    rest = plain(cells_text(course.student_notebook(nb)))
    out = []
    for text in course.solution_texts(nb):
        words = plain(text).split()
        for start in range(0, max(1, len(words) - 7), 4):
            fragment = " ".join(words[start : start + 8])
            if len(fragment.split()) == 8 and fragment not in rest:
                out.append(fragment)
                break
    return out


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    out = tmp_path_factory.mktemp("student") / "book"
    course.write_student_edition(ROOT, out)
    return out


@pytest.mark.parametrize("stem", STEMS)
def test_student_notebook_has_no_solutions_and_clears_exercises(stem, edition):
    original, student = load(stem), json.loads((edition / "chapters" / f"{stem}.ipynb").read_text())
    assert course.solution_texts(original), "every chapter has solutions to remove"
    text = json.dumps(student)
    assert "{solution}" not in text
    fragments = snippets(original)
    assert fragments, "the solutions' text is found, so its absence below means something"
    for fragment in fragments:
        assert fragment not in plain(cells_text(student)), fragment
    assert all(f in plain(cells_text(original)) for f in fragments)  # the search does find them in the original
    assert text.count("{exercise}") == json.dumps(original).count("{exercise}") > 0
    exercise_cells = [c for c in student["cells"] if course.is_exercise_cell(c)]
    assert exercise_cells and all(not c["outputs"] and c["execution_count"] is None for c in exercise_cells)
    kept = lambda nb: [c["outputs"] for c in nb["cells"] if c["cell_type"] == "code" and not course.is_exercise_cell(c)]  # noqa: E731
    assert kept(student) == kept(original)  # figures and numbers stay for students


@pytest.mark.parametrize("stem", STEMS)
def test_student_notebook_runs_what_nbval_runs(stem, edition):
    """The student edition keeps every code cell of the chapter, in order and unchanged (only the exercise cells'
    outputs are cleared), so the strict nbval run of the chapter in ``make test`` runs the student notebook too:
    no second execution of every chapter."""
    code = lambda nb: [source(c) for c in nb["cells"] if c["cell_type"] == "code"]  # noqa: E731
    student = json.loads((edition / "chapters" / f"{stem}.ipynb").read_text())
    assert code(student) == code(load(stem)) and code(student)


@pytest.mark.site
def test_student_site_has_no_solutions(built_student_site):
    """The student site (conftest's build, shared with the browser crawl: no warnings, no torch needed)."""
    html = built_student_site
    assert not (html / "instructor.html").exists(), "the instructors' page is not part of the student site"
    for stem in STEMS:
        page = (html / "chapters" / f"{stem}.html").read_text()
        exercises = sum(source(c).count("```{exercise}") for c in load(stem)["cells"])
        assert 'class="solution' not in page and page.count('class="caption-number">Exercise') == exercises
        words = plain(re.sub(r"<[^>]+>|&[a-z#0-9]+;", " ", page))
        for fragment in snippets(load(stem)):
            assert fragment not in words, fragment
    intro = (html / "intro.html").read_text()
    assert "student edition" in intro and "folded away" not in intro and "make test" not in intro
    main_repo = "github.com/gradaccum/gradient-accumulation-correctly/"
    for page in [html / "intro.html", *(html / "chapters").glob("*.html")]:
        text = page.read_text()
        assert course.STUDENT_REPOSITORY.split("//")[1] in text, f"{page.name}: no button points at the student repo"
        assert main_repo not in text.replace("gradient-accumulation-correctly-student", ""), page.name


def test_student_edition_runs_on_binder_on_its_own(edition):
    requirements = (edition / "binder" / "requirements.txt").read_text()
    assert "torch==2.13.0" in requirements and "gradaccum[book] @ git+https://" in requirements
    assert (edition / "binder" / "runtime.txt").read_text().startswith("python-3")


def test_nbgrader_conversion_grades_with_the_checkers():
    """Chapter 1 as an nbgrader source: answer cells hold the right answer between solution markers (computed by
    the checker), each is followed by a locked 1-point test, and exercises asking for an argument get a manually
    graded cell holding the book's model solution."""
    nb = course.nbgrader_notebook(load("01_microbatch_statistics"))
    meta = [c["metadata"].get("nbgrader", {}) for c in nb["cells"]]
    answers = [c for c, m in zip(nb["cells"], meta) if m.get("solution") and c["cell_type"] == "code"]
    tests = [c for c, m in zip(nb["cells"], meta) if m.get("grade") and c["cell_type"] == "code"]
    arguments = [c for c, m in zip(nb["cells"], meta) if m.get("grade") and c["cell_type"] == "markdown"]
    assert len(answers) == len(tests) == 4 and len(arguments) == 3
    assert nb["metadata"]["kernelspec"]["name"] == course.KERNEL["name"]
    for answer_cell, test_cell in zip(answers, tests):
        test_meta = test_cell["metadata"]["nbgrader"]
        assert test_meta["locked"] and test_meta["points"] == 1 and "-test-" in test_meta["grade_id"]
        assert answer_cell["metadata"]["nbgrader"]["grade_id"].startswith("ex-ch1-")
        assert re.search(r"### BEGIN SOLUTION\nanswer = .+\n### END SOLUTION\nexercises\.grade_", answer_cell["source"])
    assert all("### BEGIN SOLUTION" in a["source"] and a["metadata"]["nbgrader"]["points"] == 2 for a in arguments)
    assert all(
        "### BEGIN HIDDEN TESTS\nassert " in t["source"] and "exercises" not in t["source"].split("HIDDEN")[1]
        for t in tests
    ), "hidden tests compare with the answer written out"
    from gradaccum.book import exercises

    first_test = tests[0]["source"]
    namespace = {"exercises": exercises, "answer": 1 - 0.95**6}
    exec(first_test, namespace)  # the right answer passes
    namespace["answer"] = 0.3
    with pytest.raises(AssertionError, match="you added the K momenta"):
        exec(first_test, namespace)
    exec(answers[0]["source"].replace("exercises.", "_ = exercises."), namespace)  # the stored solution is right
    exec(first_test, namespace)


def test_nbgrader_layout(tmp_path):
    paths = course.write_nbgrader(ROOT, tmp_path)
    assert [p.parent.name for p in paths] == STEMS and all(p.parent.parent.name == "source" for p in paths)
    config = (tmp_path / "nbgrader_config.py").read_text()
    assert course.CODE_STUB in config and "c.CourseDirectory.course_id" in config


def test_instructor_page_lists_every_exercise_and_its_checker():
    page = (ROOT / "instructor.md").read_text()
    listed = {
        label: re.findall(r"`(\w+)`", checkers)
        for label, checkers in re.findall(r"\{ref\}`(ex-ch\d-[a-z0-9-]+)` \| ((?:`\w+`(?:, )?)+|open)", page)
    }
    for stem in STEMS:
        nb, label = load(stem), None
        for cell in nb["cells"]:
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            found = course.EXERCISE.findall(src) if cell["cell_type"] == "markdown" else []
            if found:
                label = found[-1]
                assert label in listed, f"{label} is missing from instructor.md"
            elif course.is_exercise_cell(cell):
                assert course.CHECK_CALL.search(src).group(1) in listed[label], label
    assert "instructor" in (ROOT / "_toc.yml").read_text()


def _visible_text(nb) -> str:
    """What a student reads in a chapter besides its exercise cells: the text and the stored outputs (figures as
    data URIs left out; code is left out too, where numbers such as format widths are not statements)."""
    parts = []
    for cell in nb["cells"]:
        if course.is_exercise_cell(cell):
            continue
        if cell["cell_type"] == "markdown":
            parts.append(course._source(cell))
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            for key in ("text/plain", "text/html", "text/markdown"):
                parts.append("".join(data.get(key, "")))
            parts.append("".join(out.get("text", "")))
    return re.sub(r"data:image/[a-z]+;base64,[A-Za-z0-9+/=]+", "", "\n".join(parts))


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_no_auto_checked_answer_is_printed_or_stated(stem):
    """No output, text or code the student edition keeps gives away an auto-checked answer: the exercises are
    not look-ups."""
    from gradaccum.book import exercises

    student = course.student_notebook(load(stem))
    text = _visible_text(student)
    calls = [
        c
        for cell in student["cells"]
        if course.is_exercise_cell(cell)
        for c in course.checker_calls(course._source(cell))
    ]
    assert calls
    leaks = []
    for name, kwargs in calls:
        expected, _ = exercises.expected_answer(getattr(exercises, name), **kwargs)
        for form in course.answer_forms(expected):
            for m in re.finditer(rf"(?<![\d.]){re.escape(form)}(?![\d])", text):
                context = text[max(0, m.start() - 60) : m.end() + 20]
                leaks.append(f"{name}{kwargs} = {expected!r} shown as {form!r}: …{context}…")
    assert not leaks, "\n".join(leaks[:10])
