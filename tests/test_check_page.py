"""Every example on the page "Check your own loop" (check_your_loop.md) runs, and prints what the page shows.

Code blocks are taken in page order: a ```{code-block} python block with a `:caption: NAME.py` is written to a
temporary folder as that file; a python block without caption is executed there and its output compared with the
```{code-block} text block that follows it; a console block is run line by line in bash (`$ ` marks a command,
the lines after it are its output, stdout and stderr together). The page's table of findings must list exactly the
codes the checker can report.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from layout import ROOT

from gradaccum.checker import CODES

PAGE = ROOT / "check_your_loop.md"
BLOCK = re.compile(r"^```\{code-block\}[ \t]*(\S+)\n((?::\w+:[^\n]*\n)*)\n?(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[str, dict[str, str], str]]:
    found = []
    for lang, options, body in BLOCK.findall(PAGE.read_text()):
        opts = dict(re.findall(r"^:(\w+):\s*(.*)$", options, re.M))
        found.append((lang, opts, body))
    return found


def console(body: str) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        else:
            pairs[-1][1].append(line)
    return [(cmd, "\n".join(out)) for cmd, out in pairs]


def run_console(body: str, folder: Path) -> list[tuple[str, str, str]]:
    """Run a console block in one bash session: (command, expected, actual) per command."""
    pairs = console(body)
    script = ["set +e"]
    for cmd, _ in pairs:
        script += [f"{cmd} 2>&1", "__status=$?", "echo @@END@@", "(exit $__status)"]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    ).stdout
    outputs = out.split("@@END@@\n")
    return [(cmd, expected, actual.rstrip("\n")) for (cmd, expected), actual in zip(pairs, outputs)]


def test_the_page_is_in_the_table_of_contents_before_the_references():
    files = re.findall(r"^\s*-\s*file:\s*(\S+)\s*$", (ROOT / "_toc.yml").read_text(), flags=re.M)
    assert "check_your_loop" in files and files.index("check_your_loop") < files.index("references")


@pytest.mark.commands
def test_every_example_runs_and_prints_what_the_page_shows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = blocks()
    kinds = [lang for lang, _, _ in found]
    assert kinds.count("console") >= 3 and kinds.count("python") >= 4
    i, ran = 0, 0
    while i < len(found):
        lang, opts, body = found[i]
        if lang == "python" and opts.get("caption", "").endswith(".py"):
            (tmp_path / opts["caption"]).write_text(body)
        elif lang == "python":
            expected = found[i + 1][2] if i + 1 < len(found) and found[i + 1][0] == "text" else None
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                exec(compile(body, f"check_your_loop.md block {i}", "exec"), {"__name__": "__page__"})
            if expected is not None:
                assert buffer.getvalue().rstrip("\n") == expected.rstrip("\n"), body
                i += 1
            ran += 1
        elif lang == "console":
            for cmd, expected, actual in run_console(body, tmp_path):
                assert actual == expected, f"$ {cmd}\n--- page\n{expected}\n--- actual\n{actual}"
                ran += 1
        else:
            pytest.fail(f"a {lang} block that follows no python block: {body[:80]}")
        i += 1
    assert ran >= 10


def test_the_table_lists_every_finding_the_checker_can_report():
    text = PAGE.read_text()
    table = re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M)
    assert len(table) == len(set(table)) and set(table) == set(CODES)
