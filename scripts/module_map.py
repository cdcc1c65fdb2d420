"""Print the module map of ARCHITECTURE.md: for the core and then the book layer, a Markdown table with one row per
module of src/gradaccum: its path, its number of lines and the first sentence of its docstring.

Usage: python scripts/module_map.py    (its output is ARCHITECTURE.md's text after the "Module map" paragraph)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "gradaccum"


def modules(book: bool) -> list[Path]:
    """The book layer's modules (``book=True``) or the core's (any other module, subpackages included), sorted."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if (PACKAGE / "book" in p.parents) == book]


def summary(path: Path, width: int = 110) -> str:
    """The first sentence of the module's docstring (its first paragraph, up to the first full stop), cut to
    ``width`` characters; empty when it has none."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<! al)\. (?=[A-Z])", paragraph)[0].rstrip(".")  # "Hoffer et al. 2017" goes on
    return sentence if len(sentence) <= width else sentence[:width].rsplit(" ", 1)[0] + " …"


def rows() -> list[str]:
    """The core's table, then the book layer's, each under its heading: ``| path | lines | first docstring
    sentence |`` for each module."""
    out: list[str] = []
    for heading, book in (("The core", False), ("The book layer", True)):
        out += [f"### {heading}", "", "| module | lines | what it holds |", "|---|---:|---|"]
        for path in modules(book):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            name = path.relative_to(ROOT / "src").as_posix()
            out.append(f"| `{name}` | {lines} | {summary(path).replace('|', '/')} |")
        out.append("")
    return out[:-1]


if __name__ == "__main__":
    print("\n".join(rows()))
