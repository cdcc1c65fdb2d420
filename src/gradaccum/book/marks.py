"""Manual marks for the nbgrader course from the command line, the alternative to formgrader's Manual Grading page.

``python -m gradaccum.book.marks export 01_microbatch_statistics marks.csv`` (in the course folder, after
``nbgrader autograde``; the assignment is a chapter) writes one row per manually graded answer of every autograded
submission: the student's text beside a
``points`` column, already 0 where the answer is still the stub or empty and the mark already given where there is
one. Fill in the other rows (any spreadsheet), then ``python -m gradaccum.book.marks import marks.csv`` writes the
points into the gradebook as formgrader does (the manual score, and the cell no longer waiting for a grade), so that
``nbgrader generate_feedback`` and ``nbgrader export`` count them.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

#: The columns of the marks file, in order.
FIELDS = ("assignment", "notebook", "student", "cell", "max_points", "points", "answer")

#: What an untouched written answer holds after ``generate_assignment`` (ClearSolutions' text stub).
TEXT_STUB = "YOUR ANSWER HERE"


def _gradebook(course: Path) -> Any:
    from nbgrader.api import Gradebook  # nbgrader is the course kit's dependency (gradaccum[course]), not the book's

    db = Path(course) / "gradebook.db"
    if not db.exists():
        raise ValueError(f"{course} has no gradebook.db: run this in the course folder, after nbgrader autograde.")
    return Gradebook(f"sqlite:///{db}")


def _answers(course: Path, assignment: str, student: str, notebook: str) -> dict[str, str]:
    """The text of each nbgrader cell of the autograded notebook, by its grade id."""
    path = Path(course) / "autograded" / student / assignment / f"{notebook}.ipynb"
    if not path.exists():
        return {}
    cells = json.loads(path.read_text())["cells"]
    return {
        c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in cells
        if "grade_id" in c["metadata"].get("nbgrader", {})
    }


def _mark_row(grade: Any, assignment: str, notebook: str, student: str, text: str) -> dict[str, object]:
    """One row of the marks file: the mark already given, or 0 for an answer left as the stub, or blank."""
    untouched = text.strip() in ("", TEXT_STUB) or text.strip().endswith(TEXT_STUB)
    points: object = grade.manual_score if grade.manual_score is not None else (0 if untouched else "")
    return {
        "assignment": assignment,
        "notebook": notebook,
        "student": student,
        "cell": grade.cell.name,
        "max_points": grade.max_score,
        "points": points,
        "answer": text,
    }


def export_marks(course: Path, assignment: str, target: Path) -> int:
    """Write ``target``: one row (:data:`FIELDS`) per manually graded cell of each submission of ``assignment`` in
    the course folder ``course``; return the number of rows still to be marked."""
    from nbgrader.api import MissingEntry

    rows = []
    with _gradebook(course) as gb:
        try:
            submissions = gb.find_assignment(assignment).submissions
        except MissingEntry:
            raise ValueError(
                f"the gradebook has no assignment {assignment!r}: run nbgrader autograde {assignment} "
                "first (or check the name)."
            ) from None
        for submission in submissions:
            for nb in submission.notebooks:
                texts = _answers(course, assignment, submission.student.id, nb.name)
                # a written answer is a graded cell the student writes in (autograde scores an unchanged one 0)
                written = {cell.name for cell in nb.notebook.solution_cells}
                rows += [
                    _mark_row(g, assignment, nb.name, submission.student.id, texts.get(g.cell.name, ""))
                    for g in nb.grades
                    if g.cell.name in written
                ]
    rows.sort(key=lambda r: (str(r["student"]), str(r["notebook"]), str(r["cell"])))
    with open(target, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return sum(r["points"] == "" for r in rows)


def _points(row: dict[str, str], line: int) -> float | None:
    """The points of a marks-file row (None where left blank), checked against its maximum."""
    text = (row.get("points") or "").strip()
    if not text:
        return None
    try:
        points, most = float(text), float(row["max_points"])
    except (KeyError, ValueError):
        raise ValueError(
            f"line {line}: points {text!r} is not a number; write a number from 0 to the "
            f"cell's max_points, or leave it blank."
        ) from None
    if not 0 <= points <= most:
        raise ValueError(
            f"line {line}: {points:g} points is outside 0 to {most:g} for {row['cell']}; give at most max_points."
        )
    return points


def import_marks(course: Path, source: Path) -> int:
    """Write the points filled in ``source`` (a file :func:`export_marks` wrote) into the gradebook of the course
    folder ``course``, as formgrader does; rows left blank are skipped. Return the number of marks written."""
    with open(source, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and set(FIELDS) - set(rows[0]):
        raise ValueError(
            f"{source} lacks the columns {sorted(set(FIELDS) - set(rows[0]))}: import a file that "
            "`python -m gradaccum.book.marks export` wrote."
        )
    from nbgrader.api import MissingEntry

    marks = [
        (line, row, points) for line, row in enumerate(rows, start=2) if (points := _points(row, line)) is not None
    ]
    with _gradebook(course) as gb:
        for line, row, points in marks:
            try:
                grade = gb.find_grade(row["cell"], row["notebook"], row["assignment"], row["student"])
            except MissingEntry:
                raise ValueError(
                    f"line {line}: the gradebook has no cell {row['cell']!r} of {row['student']}'s "
                    f"{row['assignment']}; keep the first five columns as export wrote them."
                ) from None
            grade.manual_score = points
            grade.needs_manual_grade = False
        gb.db.commit()
    return len(marks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradaccum.book.marks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--course", type=Path, default=Path("."), help="the course folder (default: .)")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write the answers to mark to a CSV file")
    export.add_argument("assignment")
    export.add_argument("file", type=Path)
    load = commands.add_parser("import", help="write the points of a CSV file into the gradebook")
    load.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            left = export_marks(args.course, args.assignment, args.file)
            print(f"wrote {args.file}: {left} answer(s) to mark (fill in their points, then import the file)")
        else:
            print(f"wrote {import_marks(args.course, args.file)} mark(s) into the gradebook")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
