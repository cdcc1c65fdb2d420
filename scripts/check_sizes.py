"""Sizes that match what they do: no function over 60 lines and no module over 500 lines in the package.

Usage: python scripts/check_sizes.py [ROOT ...]   (default: src/gradaccum)
Prints every function and module over its limit and exits 1 if there is any; `make lint` runs it. A function's
size counts from its ``def`` (decorators excluded) to its last line, docstring included; a module's, every line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FUNCTION_LINES = 60
MODULE_LINES = 500


def oversized(root: Path) -> list[str]:
    """Every function over FUNCTION_LINES and module over MODULE_LINES under ``root``, as report lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            found.append(f"{path}: module of {lines} lines (limit {MODULE_LINES}): split it by what it does")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno}: {node.name}() is {size} lines (limit {FUNCTION_LINES})")
    return found


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path("src/gradaccum")]
    found = [line for root in roots for line in oversized(root)]
    print("\n".join(found) if found else f"sizes: every function ≤ {FUNCTION_LINES} lines, module ≤ {MODULE_LINES}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
