"""ARCHITECTURE.md stays true: its module map lists every module under src/gradaccum (names only: the line counts
are regenerated with scripts/module_map.py), and lists no module that is gone."""

import re

from layout import ROOT


def test_architecture_lists_every_module():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    package = ROOT / "src" / "gradaccum"
    modules = {p.relative_to(ROOT / "src").as_posix() for p in package.rglob("*.py")}
    listed = set(re.findall(r"`(gradaccum/[\w/]+\.py)`", text))
    assert modules - listed == set(), f"ARCHITECTURE.md misses {sorted(modules - listed)}: run scripts/module_map.py"
    assert listed - modules == set(), f"ARCHITECTURE.md lists modules that are gone: {sorted(listed - modules)}"


def test_module_map_script_prints_every_module():
    """`python scripts/module_map.py` prints a row per module, each with its line count, core before book."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "scripts/module_map.py"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    rows = re.findall(r"^\| `(gradaccum/[\w/]+\.py)` \| (\d+) \|", out, flags=re.M)
    package = ROOT / "src" / "gradaccum"
    assert sorted(path for path, _ in rows) == sorted(
        p.relative_to(ROOT / "src").as_posix() for p in package.rglob("*.py")
    )
    for path, lines in rows:
        assert int(lines) == len((ROOT / "src" / path).read_text(encoding="utf-8").splitlines()), path
    book = [i for i, (path, _) in enumerate(rows) if path.startswith("gradaccum/book/")]
    assert book == list(range(len(rows) - len(book), len(rows))), "the core's modules come first"
