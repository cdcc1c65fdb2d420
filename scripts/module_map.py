"""Print the module map of ARCHITECTURE.md: one Markdown table row per module of src/gradaccum (the core, then the
book layer), with its path, its number of lines and the first sentence of its docstring.

Usage: python scripts/module_map.py    (paste the output over the tables in ARCHITECTURE.md)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "gradaccum"


def modules() -> list[Path]:
    """Every module under src/gradaccum: the core's (any subpackage but the book) first, then the book layer's."""
    paths = sorted(PACKAGE.rglob("*.py"))
    book = PACKAGE / "book"
    return [p for p in paths if book not in p.parents] + [p for p in paths if book in p.parents]


def summary(path: Path, width: int = 110) -> str:
    """The first sentence of the module's docstring (its first paragraph, up to the first full stop), cut to
    ``width`` characters; empty when it has none."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<! al)\. (?=[A-Z])", paragraph)[0].rstrip(".")  # "Hoffer et al. 2017" goes on
    return sentence if len(sentence) <= width else sentence[:width].rsplit(" ", 1)[0] + " …"


def rows() -> list[str]:
    """The table: a header, then ``| path | lines | first docstring sentence |`` for each module."""
    out = ["| module | lines | what it holds |", "|---|---:|---|"]
    for path in modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        out.append(f"| `{path.relative_to(ROOT / 'src').as_posix()}` | {lines} | {summary(path).replace('|', '/')} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
