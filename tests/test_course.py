"""The course kit: student edition (notebooks and site), nbgrader conversion, instructor page."""

import json
import re

import pytest
from layout import CHAPTERS, ROOT, load, source

from gradaccum.book import course, nbgrader_course

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
    outputs are cleared, and the set-up's Colab install names the student package instead of the book's
    repository), so the strict nbval run of the chapter in ``make test`` runs the student notebook too: no second
    execution of every chapter."""
    code = lambda nb: [source(c) for c in nb["cells"] if c["cell_type"] == "code"]  # noqa: E731
    student, chapter = code(json.loads((edition / "chapters" / f"{stem}.ipynb").read_text())), code(load(stem))
    assert student[1:] == chapter[1:] and student
    assert student[0] == course.install_from(chapter[0], course.student_package()) != chapter[0]


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


#: The book's repository, which holds the solutions: no student material installs from it.
MAIN_REPOSITORY = re.compile(r"github\.com/gradaccum/gradient-accumulation-correctly(?!-student)")


def _installs(edition) -> dict[str, str]:
    """Where the student edition says to install gradaccum from: each notebook's set-up, the binder requirements, the
    introduction and the README."""
    found = {
        path.name: source(next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"))
        for path in sorted((edition / "chapters").glob("*.ipynb"))
    }
    for name in ("binder/requirements.txt", "intro.md", "README.md"):
        found[name] = (edition / name).read_text()
    return found


def test_student_edition_runs_on_binder_on_its_own(edition):
    requirements = (edition / "binder" / "requirements.txt").read_text()
    assert "torch==2.13.0" in requirements and f"\n{course.student_package()}\n" in requirements
    assert (edition / "binder" / "runtime.txt").read_text().startswith("python-3")


def test_student_material_installs_the_package_never_the_book_repository(edition):
    """By default from the student repository (which carries the package's source); with a published package
    name, that name: in every notebook's Colab install, the binder requirements, the introduction and the README."""
    assert course.student_package() == f"gradaccum[book] @ git+{course.STUDENT_REPOSITORY}@{course.STUDENT_BRANCH}"
    for name, text in _installs(edition).items():
        assert course.student_package() in text and not MAIN_REPOSITORY.search(text), name
    assert (edition / "pyproject.toml").exists() and (edition / "src" / "gradaccum" / "book" / "exercises.py").exists()
    assert not list((edition / "src").rglob("__pycache__"))


def test_a_published_package_and_course_mode(tmp_path):
    published = "gradaccum[book]==0.2.0"
    out = tmp_path / "book"
    course.write_student_edition(ROOT, out, package=published, course_mode=True)
    installs = _installs(out)
    for name, text in installs.items():
        assert f'"{published}"' in text or f"\n{published}\n" in text, name
        assert "git+" not in text and not MAIN_REPOSITORY.search(text), name
    for path in sorted((out / "chapters").glob("*.ipynb")):
        code = "\n".join(source(c) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        assert code.count(course.COURSE_MODE_CALL) == 1, path.name
        assert course.IMPORTS_CHECKERS.search(code).start() < code.index(course.COURSE_MODE_CALL)
    for wrong in ("torch", "gradaccum[book] @ git+https://x/y\nimport os", 'gradaccum[book]"; import os'):
        with pytest.raises(ValueError, match="pip requirement for gradaccum"):
            course.student_package(package=wrong)


def test_the_command_says_what_it_used(tmp_path, capsys):
    """Without a student repository it says it used the placeholder, and what the notebooks install."""
    assert course.main(["student", "--root", str(ROOT), "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().out
    assert "the placeholder: set STUDENT_REPO=<url>" in said and course.student_package() in said
    mine = ["--repository", "https://github.com/you/course-student", "--branch", "spring"]
    assert course.main(["student", "--root", str(ROOT), "--out", str(tmp_path / "b"), *mine, "--course-mode"]) == 0
    said = capsys.readouterr().out
    assert "placeholder" not in said and "gradaccum[book] @ git+https://github.com/you/course-student@spring" in said
    assert "course mode (no expected values in feedback): on" in said


@pytest.mark.slow
def test_the_student_edition_is_the_package_it_installs(edition, tmp_path):
    """Published as its own repository, the student edition is what its default requirement installs: pip builds
    the package from it, with the book layer's graders."""
    import subprocess
    import sys
    import zipfile

    build = tmp_path / "edition"
    import shutil

    shutil.copytree(edition, build)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), build],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("gradaccum-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gradaccum/book/exercises.py" in names and "gradaccum/checker/cli.py" in names


def test_nbgrader_conversion_grades_with_the_checkers():
    """Chapter 1 as an nbgrader source: answer cells hold the right answer between solution markers (computed by
    the checker), each is followed by a locked 1-point test that grades with the same checker (verify) and holds no
    hidden part and no value, and exercises asking for an argument get a manually graded cell holding the book's
    model solution. The set-up puts the checkers in course mode and installs the student package on Colab."""
    nb = nbgrader_course.nbgrader_notebook(load("01_microbatch_statistics"))
    meta = [c["metadata"].get("nbgrader", {}) for c in nb["cells"]]
    answers = [c for c, m in zip(nb["cells"], meta) if m.get("solution") and c["cell_type"] == "code"]
    tests = [c for c, m in zip(nb["cells"], meta) if m.get("grade") and c["cell_type"] == "code"]
    arguments = [c for c, m in zip(nb["cells"], meta) if m.get("grade") and c["cell_type"] == "markdown"]
    assert len(answers) == len(tests) == 4 and len(arguments) == 3
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    setup = nb["cells"][1]["source"]
    assert setup.endswith(course.COURSE_MODE_CALL) and f'"{course.student_package()}"' in setup
    for answer_cell, test_cell in zip(answers, tests):
        test_meta = test_cell["metadata"]["nbgrader"]
        assert test_meta["locked"] and test_meta["points"] == 1 and "-test-" in test_meta["grade_id"]
        assert answer_cell["metadata"]["nbgrader"]["grade_id"].startswith("ex-ch1-")
        assert re.search(r"### BEGIN SOLUTION\nanswer = .+\n### END SOLUTION\nexercises\.grade_", answer_cell["source"])
        assert "HIDDEN" not in test_cell["source"] and "verify(" in test_cell["source"]
    assert all("### BEGIN SOLUTION" in a["source"] and a["metadata"]["nbgrader"]["points"] == 2 for a in arguments)
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
    """The course folder: a source notebook per chapter and a config whose exchange is the folder beside it (no
    system path) and whose grading kernel is the book's."""
    from traitlets.config.loader import PyFileConfigLoader

    paths = nbgrader_course.write_nbgrader(ROOT, tmp_path)
    assert [p.parent.name for p in paths] == STEMS and all(p.parent.parent.name == "source" for p in paths)
    config = PyFileConfigLoader("nbgrader_config.py", path=str(tmp_path)).load_config()
    assert config.Exchange.root == str(tmp_path / "exchange")
    assert config.Execute.kernel_name == nbgrader_course.GRADING_KERNEL == "gradaccum"
    assert config.ClearSolutions.code_stub == {"python": nbgrader_course.CODE_STUB}
    assert config.CourseDirectory.course_id == nbgrader_course.COURSE_ID


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
    data URIs left out; code is left out too, where numbers such as format widths are not statements). The outputs
    of measurement cells (tagged ``nbval-ignore-output``: timings that differ on every run) are left out as well: a
    wall-clock reading that happens to equal an answer (chapter 5's 122 ms) states nothing, and would make this check
    fail at random."""
    parts = []
    for cell in nb["cells"]:
        if course.is_exercise_cell(cell):
            continue
        if cell["cell_type"] == "markdown":
            parts.append(course._source(cell))
        if "nbval-ignore-output" in cell.get("metadata", {}).get("tags", []):
            continue
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


def test_instructor_page_describes_only_buttons_that_exist():
    """The student site's launch buttons are the ones _config.yml configures (Binder, Colab; no Live Code/thebe)."""
    page = (ROOT / "instructor.md").read_text()
    config = (ROOT / "_config.yml").read_text()
    assert "binderhub_url" in config and "colab_url" in config and "thebe" not in config
    assert "Binder" in page and "Colab" in page and "Live Code" not in page


def test_marks_refuse_what_they_cannot_write(tmp_path, capsys):
    """The marks file: points must be numbers within the cell's maximum (blank: not marked yet); outside a course
    folder the command says where to run it, with exit status 2."""
    from gradaccum.book import marks

    row = {"cell": "ex-ch1-b-equals-2-argument", "max_points": "2.0"}
    assert marks._points({**row, "points": ""}, 2) is None and marks._points({**row, "points": " 1.5 "}, 2) == 1.5
    for wrong, says in (("3", "outside 0 to 2"), ("-1", "outside 0 to 2"), ("two", "not a number")):
        with pytest.raises(ValueError, match=says):
            marks._points({**row, "points": wrong}, 7)
    assert marks.main(["--course", str(tmp_path), "export", "01_microbatch_statistics", str(tmp_path / "m.csv")]) == 2
    assert "no gradebook.db" in capsys.readouterr().err
    (tmp_path / "m.csv").write_text("student,points\nx,1\n")
    assert marks.main(["--course", str(tmp_path), "import", str(tmp_path / "m.csv")]) == 2
    assert "lacks the columns" in capsys.readouterr().err
