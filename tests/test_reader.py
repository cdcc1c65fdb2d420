"""The reader's page: what a student meets before the exercises is short, plain and checked out of the way.

Main text = the lesson: the markdown before a chapter's "## Exercises" heading, outside folded blocks ({dropdown},
{margin}, {sidebar}, admonitions with ``:class: dropdown``, exercises and solutions), outside code fences and display
math, and outside the two reference sections every chapter ends its main line with ("## In your framework": pointers
to the frameworks' own code and docs; "## Checklist": one line per thing to verify) where they stand in the cell that
opens the exercises. Earlier, in a cell of their own, they are lesson text and count (as the reader's-book hook counts
them).
"""

import re

import pytest
from layout import CHAPTERS, ROOT, load, source, tags

FOLDED = {"dropdown", "margin", "sidebar", "toggle", "exercise", "solution"}
OPEN = re.compile(r"^(`{3,}|:{3,})\s*\{([\w-]+)\}")
#: The reference sections that close the main line, in the cell that opens the exercises.
REFERENCE = re.compile(r"^## (?:In your framework|Checklist)\b.*?(?=^## |\Z)", flags=re.S | re.M)
HIDDEN = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
#: What a student does not need to read in the main line: test names, corrections-page entries, review rounds.
INTERNALS = re.compile(r"\btest_[a-z0-9_]+|\bentr(?:y|ies) \d+|errata entr|\breview round")


def main_text(stem: str) -> str:
    out = []
    for cell in load(stem)["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = source(cell)
        head = re.search(r"^##\s+Exercises", text, flags=re.M)
        if head:
            out.append(REFERENCE.sub(" ", text[: head.start()]))
            break
        out.append(text)
    kept, stack = [], []
    for line in "\n".join(out).splitlines():
        stripped = line.strip()
        m = OPEN.match(stripped)
        if m:
            folded = m.group(2) in FOLDED or any(f for _, f in stack)
            stack.append((m.group(1), folded))
            continue
        if stack and stripped and set(stripped) <= set("`:") and len(stripped) >= len(stack[-1][0]):
            stack.pop()
            continue
        if stripped.startswith(":class:") and "dropdown" in stripped and stack:
            stack[-1] = (stack[-1][0], True)
            continue
        if not any(f for _, f in stack):
            kept.append(line)
    text = "\n".join(kept)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return re.sub(r"\$\$.*?\$\$", " MATH ", text, flags=re.S)


def sentences(text: str) -> list[str]:
    text = re.sub(r"^\s*[#|(].*$", " ", text, flags=re.M)  # headings, tables, labels
    text = re.sub(r"^\s*[-*] ", "\n\n", text, flags=re.M)  # a list item is a sentence of its own
    text = re.sub(r"\$[^$]+\$", "X", text)
    parts = re.split(r"(?<=[.!?:])\s+(?=[A-Z(*`])|\n\s*\n", text)
    return [" ".join(p.split()) for p in parts if len(p.split()) > 2]


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_the_main_text_is_short_and_plain(stem):
    text = main_text(stem)
    words = len(re.findall(r"[A-Za-z0-9']+", text))
    assert words <= 2000, f"{words} words before the exercises, outside folded blocks: fold the fine print"
    long = [s for s in sentences(text) if len(s.split()) > 45]
    assert len(long) <= 3, f"{len(long)} sentences over 45 words, e.g. {long[0][:120]!r}"
    found = INTERNALS.findall(text)
    assert not found, f"test names or corrections bookkeeping in the main text: {found[:3]}"


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_checks_are_folded(stem):
    visible = [
        line
        for c in load(stem)["cells"]
        if c["cell_type"] == "code" and not HIDDEN & set(tags(c))
        for line in source(c).splitlines()
        if line.strip().startswith("assert")
    ]
    assert len(visible) <= 3, f"{len(visible)} visible assert lines: fold the check cells (hide-cell / hide-input)"


def test_the_measure_reads_folded_blocks_as_folded():
    assert ROOT.exists()
    sample = "Main line here.\n\n```{dropdown} Fine print\nhidden words\n```\n\n```{note}\nshown words\n```\n"
    import layout

    original = layout.load
    try:
        layout.load = lambda stem: {"cells": [{"cell_type": "markdown", "source": sample}]}
        globals()["load"] = layout.load
        text = main_text("x")
    finally:
        layout.load = original
        globals()["load"] = original
    assert "hidden" not in text and "shown words" in text and "Main line" in text


@pytest.mark.parametrize("stem", sorted(CHAPTERS))
def test_every_fenced_directive_opens(stem):
    """A backtick fence whose title holds a backtick is no fence in CommonMark: the page then shows the raw
    ```{dropdown} line and leaves its fine print unfolded, without a build warning. Use :::{dropdown} for such
    titles."""
    for cell in load(stem)["cells"]:
        if cell["cell_type"] == "markdown":
            for line in source(cell).splitlines():
                m = re.match(r"^\s*`{3,}(.*)$", line)
                assert not (m and "`" in m.group(1)), f"a fence that will not open: {line[:80]!r}"
