"""Re-execute the book's notebooks headlessly, in place, storing widget state; report time and peak memory.

This is the only way the stored outputs are regenerated (``make outputs``). Each notebook runs in a fresh
kernel with its folder as the working directory. Widget state is stored in the notebook's metadata, so the
static site (built with execution off) shows every widget's first picture.

Usage: python scripts/execute_notebooks.py [--check] [NOTEBOOK ...]   (default: chapters/*.ipynb)
  --check   execute and report, but do not write the notebooks back (used to measure budgets).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
#: Run in the kernel after the notebook. A fork server (chapter 5's DDP workers are forked from one) and the kept
#: study processes (:mod:`gradaccum.book.parallel`) are stopped first: their peak memory reaches the kernel's
#: RUSAGE_CHILDREN only once they have been waited for (``_stop`` is the standard library's own way to stop a fork
#: server, used by its tests).
PROBE = ("import resource as _r, sys as _s\n"
         "_pp = _s.modules.get('gradaccum.book.parallel')\n"
         "if _pp is not None: _pp.shutdown()\n"
         "_fs = _s.modules.get('multiprocessing.forkserver')\n"
         "if _fs is not None and hasattr(_fs._forkserver, '_stop'): _fs._forkserver._stop()\n"
         "print('PEAK_RSS_KB', _r.getrusage(_r.RUSAGE_SELF).ru_maxrss, _r.getrusage(_r.RUSAGE_CHILDREN).ru_maxrss)")


WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MODEL_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")


def stable_widget_ids(nb: Any, salt: str) -> Any:
    """Rename every widget model id to one that depends only on the notebook (``salt``) and the model's place in a
    fixed traversal: the views in cell order, then the models each references (``IPY_MODEL_<id>``), depth first,
    then models no view reaches, by content.
    The kernel draws random ids on every run; with these, re-executing a notebook changes only what changed."""
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    if not state:
        return nb
    order: list[str] = []

    def visit(model_id: str) -> None:
        if model_id in order or model_id not in state:
            return
        order.append(model_id)
        for ref in re.findall(r"IPY_MODEL_([0-9a-f]{32})", json.dumps(state[model_id], sort_keys=True)):
            visit(ref)

    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view:
                visit(view["model_id"])
    # models no view reaches, in an order that depends on their content only (not on the kernel's order)
    masked = {m: MODEL_ID.sub("", json.dumps(state[m], sort_keys=True)) for m in state}
    for model_id in sorted(state, key=lambda m: masked[m]):
        visit(model_id)
    new = {old: hashlib.sha256(f"{salt}:{i}".encode()).hexdigest()[:32] for i, old in enumerate(order)}
    text = MODEL_ID.sub(lambda m: new.get(m.group(0), m.group(0)), json.dumps(nb))
    renamed = json.loads(text)
    widgets = renamed["metadata"]["widgets"][WIDGET_STATE]
    widgets["state"] = {new[old]: widgets["state"][new[old]] for old in order}
    return nbformat.from_dict(renamed) if isinstance(nb, nbformat.NotebookNode) else renamed


def execute(path: Path, write: bool = True, timeout: int = 600) -> tuple[float, float]:
    """Execute one notebook; return (seconds, peak resident memory of its kernel, and of its largest child
    process — e.g. a distributed worker — in MB)."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", store_widget_state=True, record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    probe = nb.cells.pop()
    text = "".join(o.get("text", "") for o in probe.outputs)
    kernel_kb, child_kb = (int(v) for v in text.split("PEAK_RSS_KB")[1].split()[:2])
    if write:
        nbformat.write(stable_widget_ids(nb, path.stem), path)
    return seconds, kernel_kb / 1024, child_kb / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="do not write the notebooks back")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb"))
    print(f"{'notebook':<36} {'seconds':>8} {'kernel peak MB':>15} {'largest child process MB':>25}")
    for path in paths:
        seconds, peak, child = execute(path, write=not args.check)
        print(f"{path.name:<36} {seconds:>8.1f} {peak:>15.0f} {child:>25.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
