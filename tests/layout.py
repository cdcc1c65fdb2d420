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
    "06_loss_normalization_and_friends": ("windows", "checker"),
    "07_frameworks": ("frameworks",),
    "08_beyond_batchnorm": ("coupled",),
}


#: Why a cell's output is not compared digit for digit by strict nbval (its cell tag `nbval-ignore-output`).
WIDGET = "a widget: the picture stored for the static site; the pure function behind it is tested in tests/"
TIMING = "timings: they vary with the machine and its load; nothing about them is asserted"
KERNELS = (
    "a measurement whose digits vary with the CPU's float kernels (chaotic training runs, low-precision "
    "arithmetic): the claims the page makes of it are asserted in a later code cell, in a form that holds "
    "on every kernel path `make portability` tries"
)
HARDWARE = "on your hardware: what this machine's own kernels do, shown and not compared; nothing is claimed of it"

#: chapter → cell id → why strict nbval does not compare that cell's output. Every other cell's output is compared
#: exactly on the host's kernels (`make test`) and on two other kernel paths (`make portability`); a test checks
#: that the cells tagged `nbval-ignore-output` are exactly these.
UNCOMPARED: dict[str, dict[str, str]] = {
    "01_microbatch_statistics": {"156cafc1": KERNELS, "c9c13713": WIDGET},
    "02_ghost_batchnorm": {"153e1394": TIMING, "76e69f25": WIDGET},
    "03_clip_ordering": {"f5fe3d90": KERNELS, "16c5fc5d": KERNELS, "a349e56c": WIDGET},
    "04_mixed_precision_scaling": {
        "ch4-own-edge": HARDWARE,
        "5f5706f2": KERNELS,
        "4496f2d5": TIMING,
        "db2c513b": WIDGET,
    },
    "05_no_sync": {"65960cc3": TIMING, "0f8b9737": WIDGET},
    "06_loss_normalization_and_friends": {"ch6-adam-late": KERNELS, "16e951d1": WIDGET},
    "07_frameworks": {"ch7-25": WIDGET},
    "08_beyond_batchnorm": {
        "ch8-08": WIDGET,
        "ch8-11": TIMING,
        "7623eae2785240b9bd12b16a66d81610": KERNELS,
        "acae54e37e7d407bbb7b55eff062a284": WIDGET,
        "8edb47106e1a46a883d545849b8ab81b": WIDGET,
        "938c804e27f84196a10c8828c723f798": WIDGET,
    },
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
