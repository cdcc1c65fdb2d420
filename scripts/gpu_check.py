"""Run every chapter on a CUDA GPU, compare what it prints with the stored outputs, and report per chapter.

Needs no Jupyter stack (the GPU machine has none): each chapter's code cells are executed in order as one
Python program, in a fresh process, with ``GRADACCUM_DEVICE`` set (default ``cuda``) so that
``gradaccum.setup()`` picks the GPU. A cell's text output is what it prints plus, as in a notebook, the value of
its last expression (``repr``); figures and widgets are not compared. Each cell's text is compared with the
stored one after the same sanitizing nbval applies (``tests/nbval_sanitize.cfg``).

A chapter passes when every cell runs, every ``assert`` holds, and every cell whose output differs is one the page
allows to differ: a cell listed in ``tests/layout.py`` ``UNCOMPARED`` (a measurement whose digits vary with the
kernels, a timing, a widget, an "on your hardware" cell). Any other difference is reported with the cell and the
first differing line: on a GPU, a number the page states as exact that is not.

Usage: GRADACCUM_DEVICE=cuda python scripts/gpu_check.py [--show-diffs] [NOTEBOOK ...]
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "\x1egpu-check cell "

PRELUDE = """
import matplotlib
matplotlib.use("Agg")
import importlib.util, sys
HAVE_WIDGETS = importlib.util.find_spec("ipywidgets") is not None


def display(*objs):
    # a notebook's display(): the text a Jupyter front end stores as text/plain
    for obj in objs:
        if obj is not None:
            print(repr(obj))
"""

EPILOGUE = """
import torch, gradaccum
_d = gradaccum.pick_device()
print("DEVICE", f"{_d} ({torch.cuda.get_device_name(_d)})" if _d.type == "cuda" else _d)
"""


def cell_program(src: str) -> str:
    """A cell as plain Python: IPython magics left out, the last expression displayed as a notebook would."""
    src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
    tree = ast.parse(src)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        call = ast.Call(func=ast.Name("display", ast.Load()), args=[last.value], keywords=[])
        tree.body[-1] = ast.Expr(call)
        src = ast.unparse(tree)
    return src


def code_cells(path: Path) -> list[dict]:
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for c in cells:
        c["source"] = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
    return cells


def to_script(path: Path) -> str:
    """The notebook's code cells as one program; each cell announces itself on stdout; widget cells guarded."""
    parts = [PRELUDE]
    for i, cell in enumerate(code_cells(path)):
        src = cell_program(cell["source"])
        if "ipywidgets" in src:
            src = "if HAVE_WIDGETS:\n" + "\n".join("    " + line for line in src.splitlines())
        parts.append(f"print({MARK + str(i)!r}, flush=True)\n{src}")
    parts.append(f"print({MARK + 'end'!r}, flush=True)\n{EPILOGUE}")
    # Under a __main__ guard: chapter 5 spawns workers, which re-import the main module (an `if` block keeps
    # the cells' variables global).
    body = "\n\n".join(parts)
    return (
        "if __name__ == '__main__':\n" + "\n".join("    " + line if line else "" for line in body.splitlines()) + "\n"
    )


def sanitizers() -> list[tuple[re.Pattern[str], str]]:
    """The regex/replace pairs of nbval's sanitize file, applied to stored and fresh text alike."""
    lines = (ROOT / "tests" / "nbval_sanitize.cfg").read_text().splitlines()
    pairs = []
    for a, b in zip(lines, lines[1:]):
        if a.startswith("regex:") and b.startswith("replace:"):
            pairs.append((re.compile(a[len("regex:"):].strip()), b[len("replace:"):].strip()))
    return pairs


def stored_text(cell: dict) -> str:
    """A stored cell's text as this script prints it: streams and text/plain, without figures and widgets."""
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream" and o["name"] == "stdout":
            out.append("".join(o["text"]))
        elif o["output_type"] in ("execute_result", "display_data"):
            text = "".join(o.get("data", {}).get("text/plain", ""))
            if text and not text.startswith("<Figure") and "application/vnd.jupyter.widget-view+json" not in o["data"]:
                out.append(text + "\n")
    return "".join(out)


def clean(text: str, pairs: list[tuple[re.Pattern[str], str]]) -> str:
    lines = [line for line in text.splitlines() if not line.startswith("<Figure")]
    text = "\n".join(line.rstrip() for line in lines if line.strip())
    for pattern, replace in pairs:
        text = pattern.sub(replace, text)
    return text


def allowed_to_differ(path: Path) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from layout import UNCOMPARED  # the page's own list of cells whose digits may differ
    finally:
        sys.path.pop(0)
    return UNCOMPARED.get(path.stem, {})


@dataclass
class Report:
    ok: bool
    seconds: float
    device: str
    compared: int = 0
    allowed: list[str] = field(default_factory=list)  # differing cells the page allows
    wrong: list[str] = field(default_factory=list)  # differing cells the page states exactly


def run(path: Path, timeout: int = 600) -> Report:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(to_script(path))
    env = {
        **os.environ,
        "GRADACCUM_DEVICE": os.environ.get("GRADACCUM_DEVICE", "cuda"),
        "MPLBACKEND": "Agg",
        # the package from this checkout, installed or not (the GPU machine has no virtual environment)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, f.name], cwd=path.parent, env=env, capture_output=True, text=True, timeout=timeout
    )
    seconds = time.perf_counter() - start
    device = next((line[7:] for line in proc.stdout.splitlines() if line.startswith("DEVICE ")), "?")
    if proc.returncode:
        sys.stderr.write(f"--- {path.name} failed:\n{proc.stderr[-3000:]}\n")
    report = Report(proc.returncode == 0, seconds, device)
    fresh: dict[str, str] = {}
    for chunk in proc.stdout.split(MARK)[1:]:
        index, _, text = chunk.partition("\n")
        fresh[index.strip()] = text
    pairs, allowed = sanitizers(), allowed_to_differ(path)
    for i, cell in enumerate(code_cells(path)):
        if str(i) not in fresh:
            continue  # not reached: the chapter failed before it
        report.compared += 1
        old, new = clean(stored_text(cell), pairs), clean(fresh[str(i)], pairs)
        if old == new:
            continue
        name = f"cell {i + 1}"
        if cell.get("id") in allowed:
            report.allowed.append(name)
        else:
            first = next(
                ((a, b) for a, b in zip(old.splitlines() + [""] * 99, new.splitlines() + [""] * 99) if a != b),
                ("", ""),
            )
            report.wrong.append(f"{name}: stored {first[0][:100]!r}, here {first[1][:100]!r}")
    return report


def main(argv: list[str]) -> int:
    show = "--show-diffs" in argv
    argv = [a for a in argv if a != "--show-diffs"]
    paths = [Path(p) for p in argv] or sorted((ROOT / "chapters").glob("*.ipynb"))
    print(f"{'chapter':<40} {'result':<6} {'seconds':>8}  {'cells':>5}  {'allowed':>7}  {'differ':>6}  device")
    failed = 0
    details = []
    for path in paths:
        r = run(path)
        passed = r.ok and not r.wrong
        failed += not passed
        print(
            f"{path.name:<40} {'pass' if passed else 'FAIL':<6} {r.seconds:>8.1f}  {r.compared:>5}  "
            f"{len(r.allowed):>7}  {len(r.wrong):>6}  {r.device}",
            flush=True,
        )
        details += [f"{path.name} {w}" for w in r.wrong]
        if show and r.allowed:
            details.append(f"{path.name}: differ as the page allows: {', '.join(r.allowed)}")
    if details:
        print("\n".join(["", "cells whose printed output differs from the stored one:"] + details))
    print(
        "cells: code cells compared; allowed: cells whose digits differ where the page allows it (tests/layout.py "
        "UNCOMPARED); differ: any other difference"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
