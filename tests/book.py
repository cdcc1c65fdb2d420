"""What the tests know about the book's layout: chapters in order, and chapter ↔ module ↔ test."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: chapter notebook stem → (module in src/gradaccum, unit-test file in tests/)
CHAPTERS: dict[str, tuple[str, str]] = {
    "01_microbatch_statistics": ("bn", "test_bn"),
    "02_ghost_batchnorm": ("ghost", "test_ghost"),
    "03_clip_ordering": ("clipping", "test_clipping"),
    "04_mixed_precision_scaling": ("precision", "test_precision"),
    "05_no_sync": ("distributed", "test_distributed"),
    "06_loss_normalization_and_friends": ("silent", "test_silent"),
}


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
