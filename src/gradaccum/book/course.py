"""The course kit: a student edition of the book, and (with :mod:`gradaccum.book.nbgrader_course`) an nbgrader
course of its exercises.

Student edition (``make student``, or ``python -m gradaccum.book.course student``): every chapter with its
``solution`` directives removed and the outputs of its exercise cells (the cells that call a checker from
:mod:`gradaccum.book.exercises`) cleared; everything else — text, code, stored figures — is kept, so the notebooks run
top to bottom (``--course-mode``: the checkers in course mode, their feedback without expected values). Jupyter
Book's ``hide_solutions`` cannot do this: it crashes on gated solutions, and it would only hide them in HTML, not
remove them from the notebooks students download.

nbgrader (``python -m gradaccum.book.course nbgrader``): each exercise cell becomes an nbgrader *solution* cell (the
student edits ``answer = ...``) followed by a locked, graded *test* cell that grades the answer with the same checker
(:func:`gradaccum.book.exercises.verify`); the checker's message, in course mode, says what is wrong when it does not.

Both install ``gradaccum[book]`` from where the instructor says (:func:`student_package`), never from the book's
repository, which holds the solutions."""

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


#: The chapters' Colab install: the requirement ``"gradaccum[book] @ " "git+<the book's repository>"``.
INSTALL = re.compile(r'"gradaccum\[book\] @ "\s*"git\+[^"\n]*"')

#: A line that imports the checkers (``from gradaccum.book import check_demo, exercises``).
IMPORTS_CHECKERS = re.compile(r"^from gradaccum\.book import [\w, ]*\bexercises\b", re.M)

#: What course mode adds after the set-up's import of the checkers.
COURSE_MODE_CALL = "exercises.course_mode()  # course mode: feedback never states the expected value"


def install_from(source: str, package: str) -> str:
    """A set-up cell's Colab install pointed at ``package`` (a pip requirement) instead of the book's repository."""
    new, n = INSTALL.subn(lambda _: '"' + package + '"', source)
    if n != 1:
        raise ValueError(
            "the set-up cell has no install of gradaccum[book] from the book's repository to replace; "
            "keep the chapter's first cell's Colab install as the other chapters write it."
        )
    return new


def _with_course_mode(cells: list[dict[str, Any]]) -> None:
    """Call :data:`COURSE_MODE_CALL` at the end of the first cell that imports the checkers."""
    for cell in cells:
        if cell["cell_type"] == "code" and IMPORTS_CHECKERS.search(_source(cell)):
            cell["source"] = _source(cell).rstrip("\n") + "\n" + COURSE_MODE_CALL
            return
    raise ValueError("no cell imports gradaccum.book.exercises: the chapter has no checkers to put in course mode.")


def student_notebook(nb: dict[str, Any], package: str | None = None, course_mode: bool = False) -> dict[str, Any]:
    """The student version of a chapter: solutions removed, exercise outputs cleared, included package code
    inlined, the set-up's install pointed at ``package`` (when given), the checkers in course mode (when asked),
    the rest kept."""
    out = copy.deepcopy(nb)
    if package is not None:
        setup = next(c for c in out["cells"] if c["cell_type"] == "code")
        setup["source"] = install_from(_source(setup), package)
    if course_mode:
        _with_course_mode(out["cells"])
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


#: Where the student edition is published (its own repository or branch, without solutions): a placeholder until the
#: instructor names theirs. Its launch buttons (Binder, Colab) and repository button point here, never at the book's
#: repository with the solutions. Set it with ``make student STUDENT_REPO=<url> STUDENT_BRANCH=<branch>`` (or
#: ``--repository``/``--branch``); instructor.md documents it.
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


def student_package(
    repository: str = STUDENT_REPOSITORY, branch: str = STUDENT_BRANCH, package: str | None = None
) -> str:
    """The pip requirement the student material installs ``gradaccum[book]`` with: ``package`` when given (a
    published name, ``gradaccum[book]==0.2.0``, or ``gradaccum[book] @ <URL of a wheel>``), else the package source
    the student edition carries, from the student repository: ``gradaccum[book] @ git+<repository>@<branch>``."""
    requirement = package if package is not None else f"gradaccum[book] @ git+{repository}@{branch}"
    if not re.fullmatch(r"gradaccum\[book\][^\s\"'\\]*(?: @ [^\s\"'\\]+)?", requirement):
        raise ValueError(
            f"the student package must be a pip requirement for gradaccum[book] (e.g. 'gradaccum[book]"
            f"==0.2.0' or 'gradaccum[book] @ https://host/gradaccum-0.2.0-py3-none-any.whl'), got "
            f"{requirement!r}."
        )
    return requirement


def _student_intro(text: str, package: str) -> str:
    """The introduction with its sentence on solutions replaced by what the student edition is, and its line on
    running the book's Makefile (which the student edition does not carry) by how to install the package."""
    run_locally = (
        "- **Run a chapter locally**: install the book's package with\n"
        f'  `pip install "{package}"` and open the chapter in Jupyter.\n'
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
    root: Path,
    out: Path,
    repository: str = STUDENT_REPOSITORY,
    branch: str = STUDENT_BRANCH,
    package: str | None = None,
    course_mode: bool = False,
) -> list[Path]:
    """Write the student edition of the book in ``root`` to ``out`` (chapters, the files the site needs and the
    package's source), its buttons pointing at ``repository`` on ``branch``, its notebooks, introduction and binder
    installing :func:`student_package`, its checkers in course mode if ``course_mode``."""
    root, out = Path(root), Path(out)
    package = student_package(repository, branch, package)
    if out.exists():
        shutil.rmtree(out)
    (out / "chapters").mkdir(parents=True)
    for name in BOOK_FILES:
        text = (root / name).read_text()
        if name == "_config.yml":
            text = _student_config(text, repository, branch)
        elif name == "intro.md":
            text = _student_intro(text, package)
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
    _write_binder(root, out, package)
    _write_package(root, out, package)
    written = []
    for path in sorted((root / "chapters").glob("*.ipynb")):
        target = out / "chapters" / path.name
        notebook = student_notebook(json.loads(path.read_text()), package, course_mode)
        target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written


def _write_binder(root: Path, out: Path, package: str) -> None:
    """Binder files for the student edition published on its own: the book's runtime requirements plus the
    ``gradaccum`` package as :func:`student_package` names it."""
    requirements = (root / "binder" / "requirements.txt").read_text().rstrip("\n")
    (out / "binder").mkdir(exist_ok=True)
    (out / "binder" / "requirements.txt").write_text(
        f"{requirements}\n# The book's package, from where the instructor publishes it (never the book's own "
        f"repository, which holds the solutions).\n{package}\n"
    )
    shutil.copy(root / "binder" / "runtime.txt", out / "binder" / "runtime.txt")


def _write_package(root: Path, out: Path, package: str) -> None:
    """The package's source (``src/gradaccum``, ``pyproject.toml``, the licences) and a README saying how to install
    it: published with the student edition, its repository is what the default :func:`student_package` installs."""
    shutil.copytree(
        root / "src" / "gradaccum", out / "src" / "gradaccum", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for name in ("pyproject.toml", "LICENSE", "LICENSE-TEXT.md"):
        shutil.copy(root / name, out / name)
    (out / "README.md").write_text(
        "# Gradient Accumulation, Correctly: student edition\n\nThe book's chapters without the solutions of their "
        "exercises, and the book's package, `gradaccum`, which the chapters use. Install it with\n\n"
        f'```bash\npip install "{package}"\n```\n'
    )


def _used(args: argparse.Namespace, package: str) -> str:
    """What ``main`` used, in words: where the buttons point, what the material installs, and whether it is the
    placeholder repository."""
    placeholder = (
        " — the placeholder: set STUDENT_REPO=<url> (make) or --repository to the repository you publish "
        "the student edition in"
        if args.repository == STUDENT_REPOSITORY
        else ""
    )
    where = (
        f"buttons point at {args.repository} (branch {args.branch}){placeholder}; " if args.what == "student" else ""
    )
    mode = "on" if args.what == "nbgrader" or args.course_mode else "off"
    return f'{where}the notebooks install "{package}"; course mode (no expected values in feedback): {mode}.'


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
    parser.add_argument(
        "--package",
        help="the pip requirement students install gradaccum[book] with (default: from "
        "the student repository, which carries the package's source)",
    )
    parser.add_argument(
        "--course-mode",
        action="store_true",
        help="student edition: the checkers in course mode (feedback without the expected values)",
    )
    args = parser.parse_args(argv)
    if not (args.root / "chapters").is_dir():
        parser.error(f"{args.root} has no chapters/ folder; run from the book's repository or pass --root.")
    try:
        package = student_package(args.repository, args.branch, args.package)
    except ValueError as error:
        parser.error(str(error))
    if args.what == "student":
        paths = write_student_edition(
            args.root,
            args.out or args.root / "_build" / "student" / "book",
            args.repository,
            args.branch,
            package,
            args.course_mode,
        )
    else:
        from gradaccum.book.nbgrader_course import write_nbgrader  # it imports this module

        paths = write_nbgrader(args.root, args.out or args.root / "_build" / "nbgrader", package)
    print(f"wrote {len(paths)} notebooks under {paths[0].parents[1] if paths else args.out}: {_used(args, package)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
