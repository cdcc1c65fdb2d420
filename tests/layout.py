"""What the tests know about the book's layout: chapters in order, and chapter ↔ module ↔ test."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: chapter notebook stem → the torch-only core modules it derives (src/gradaccum/<name>.py). Each chapter also has
#: its book module src/gradaccum/book/ch<stem>.py and its tests tests/test_ch<stem>.py (see book_module, chapter_tests).
CHAPTERS: dict[str, tuple[str, ...]] = {
    "01_microbatch_statistics": ("bn_statistics",),
    "02_ghost_batchnorm": ("ghost_bn", "fullbatch_bn", "precise_bn"),
    "03_clip_ordering": ("clipping",),
    "04_mixed_precision_scaling": ("precision",),
    "05_no_sync": ("distributed",),
    "06_loss_normalization_and_friends": ("windows", "check"),
    "07_frameworks": ("frameworks",),
    "08_beyond_batchnorm": ("coupled",),
}


def book_module(stem: str) -> Path:
    """The chapter's module in the book layer: its experiments, figures and widget functions."""
    return ROOT / "src" / "gradaccum" / "book" / f"ch{stem}.py"


def chapter_tests(stem: str) -> Path:
    """The chapter's unit tests (core and book parts)."""
    return ROOT / "tests" / f"test_ch{stem}.py"


def toc_files() -> list[str]:
    """The files listed in _toc.yml, in order (a line-based read; the toc is simple)."""
    return re.findall(r"^\s*-\s*file:\s*(\S+)\s*$", (ROOT / "_toc.yml").read_text(), flags=re.M)


def repository_url() -> str:
    match = re.search(r"^repository:\s*\n\s+url:\s*(\S+)", (ROOT / "_config.yml").read_text(), flags=re.M)
    assert match, "_config.yml has no repository url"
    return match.group(1)


def load(stem: str) -> dict:
    return json.loads((ROOT / "chapters" / f"{stem}.ipynb").read_text())


def source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def tags(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def shadow_packages(folder: Path, names: tuple[str, ...], message: str) -> dict[str, str]:
    """Packages in ``folder`` that raise ``ImportError(message + name)`` when imported, and the environment that
    puts them first on the path: a library made unavailable without uninstalling it (``importlib.util.find_spec``
    still finds it, which torch's optional-import probes need)."""
    import os

    for name in names:
        (folder / name).mkdir(exist_ok=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError({message + name!r})\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


#: The source of chapter 5's timing cell, the one cell that holds :func:`heavy_job`, contains this call.
TIMING_CELL = 'ch5.launch(\n    "timing"'


def heavy_job():
    """A lock every process of a test run shares (a file under ``_build/``). Held by chapter 5's timing cell and
    by the shown commands that start eight DDP processes: with pytest-xdist's two workers on two cores, an
    eight-process job beside the timing cell made its cost model's prediction wander from 0.8× to 1.7× the
    measured saving from run to run (and once fail the chapter's 0.5-2× assert); the cell's claim is about a
    machine not running such a job at the same time. Waiting on the lock can cost the other worker both
    eight-process commands, which run one after the other (about a minute); the lock waits without a time limit
    and is not re-entrant (nothing takes it twice in one process)."""
    from filelock import FileLock

    path = ROOT / "_build" / "heavy-jobs.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path))
