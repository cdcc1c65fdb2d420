"""Tables that read as tables: an HTML table on the page, aligned text where there is no HTML.

A chapter's tabular result is a :class:`Table` of *already formatted* cells. Formatting is the caller's job on
purpose: the printed precision is what keeps stored outputs identical on every CPU (strict nbval compares both
the text and the HTML form), so a bare float is refused.
"""

from __future__ import annotations

import html
import numbers
import re
from collections.abc import Sequence

#: A cell that starts like a number ("0.375", "-1.9%", "< 1e-12", "2^16", "97.6% (96.4–98.3)") is numeric; a
#: column of numeric cells (placeholders such as "—" or "n/a" aside) is right-aligned.
_NUMERIC = re.compile(r"^([<>≈~]\s*)?[-+−]?(\d|\.\d)")
_PLACEHOLDERS = {"", "—", "–", "-", "n/a", "nan", "inf", "-inf", "∞"}


class Table:
    """``columns`` (header strings) over ``rows`` (sequences of formatted cells, ``str`` or ``int``).

    ``groups`` optionally adds a header row above the columns: ``(label, span)`` pairs whose spans add up to
    the number of columns (use ``""`` for columns without a group). A column whose every cell reads as a number
    is right-aligned. Displays as HTML in Jupyter and on the site, and as aligned text in ``repr``.
    """

    def __init__(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[object]],
        caption: str = "",
        groups: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.columns = [str(c) for c in columns]
        self.rows: list[list[str]] = []
        for i, row in enumerate(rows):
            if len(row) != len(self.columns):
                raise ValueError(
                    f"row {i} has {len(row)} cells for {len(self.columns)} columns; give one cell per column."
                )
            if isinstance(row, str):
                raise ValueError(f"row {i} is the string {row!r}: give a list of cells.")
            cells = []
            for cell in row:
                if isinstance(cell, bool) or not isinstance(cell, (str, numbers.Integral)):
                    raise ValueError(
                        f"row {i} holds {type(cell).__name__} {cell!r}: give text or an integer; format "
                        "numbers yourself (e.g. f'{x:.3f}') so the printed precision is fixed."
                    )
                cells.append(str(cell))
            self.rows.append(cells)
        groups = list(groups)
        if any(span < 1 for _, span in groups):
            raise ValueError("every column group spans at least one column.")
        if groups and sum(span for _, span in groups) != len(self.columns):
            raise ValueError(
                f"the group spans add up to {sum(s for _, s in groups)}, not to the {len(self.columns)} columns."
            )
        self.groups = list(groups)
        self.caption = caption
        self.numeric = []
        for j in range(len(self.columns)):
            cells = [r[j].strip() for r in self.rows if r[j].strip().lower() not in _PLACEHOLDERS]
            self.numeric.append(bool(cells) and all(_NUMERIC.match(c) for c in cells))

    def __repr__(self) -> str:
        widths = [max([len(c)] + [len(r[j]) for r in self.rows]) for j, c in enumerate(self.columns)]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, self.numeric)
            ).rstrip()

        out = [self.caption] if self.caption else []
        if self.groups:
            parts, j = [], 0
            for label, span in self.groups:
                width = sum(widths[j : j + span]) + 2 * (span - 1)
                parts.append(label.center(width))
                j += span
            out.append("  ".join(parts).rstrip())
        out.append(line(self.columns))
        out.extend(line(r) for r in self.rows)
        return "\n".join(out)

    def _repr_html_(self) -> str:
        def cell(text: str) -> str:  # long identifiers may break after an underscore, nowhere else
            return html.escape(text).replace("_", "_<wbr>")

        def cls(j: int) -> str:
            return ' class="ga-num"' if self.numeric[j] else ""

        head = ""
        if self.groups:
            head += (
                "<tr>"
                + "".join(f'<th colspan="{span}">{html.escape(label)}</th>' for label, span in self.groups)
                + "</tr>"
            )
        head += "<tr>" + "".join(f"<th{cls(j)}>{cell(c)}</th>" for j, c in enumerate(self.columns)) + "</tr>"
        body = "".join(
            "<tr>" + "".join(f"<td{cls(j)}>{cell(c)}</td>" for j, c in enumerate(r)) + "</tr>" for r in self.rows
        )
        caption = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return f'<table class="ga-table">{caption}<thead>{head}</thead><tbody>{body}</tbody></table>'
