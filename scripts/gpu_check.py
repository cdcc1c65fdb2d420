"""Run every chapter on a CUDA GPU and report pass/fail, time and the device each one saw.

Needs no Jupyter stack (the GPU machine has none): each chapter's code cells are executed in order as one
Python program, in a fresh process, with ``GRADACCUM_DEVICE`` set (default ``cuda``) so that
``gradaccum.setup()`` picks the GPU. A chapter passes when every cell runs and every ``assert`` holds.
Widget cells are run only if ipywidgets is installed. Outputs are not compared with the stored ones (those
are CPU outputs; strict nbval compares them on the CPU).

Usage: GRADACCUM_DEVICE=cuda python scripts/gpu_check.py [NOTEBOOK ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import matplotlib
matplotlib.use("Agg")
import importlib.util, sys
HAVE_WIDGETS = importlib.util.find_spec("ipywidgets") is not None
"""

EPILOGUE = """
import torch, gradaccum
_d = gradaccum.pick_device()
print("DEVICE", f"{_d} ({torch.cuda.get_device_name(_d)})" if _d.type == "cuda" else _d)
"""


def to_script(path: Path) -> str:
    """The notebook's code cells as one program; widget cells guarded, IPython magics left out."""
    nb = json.loads(path.read_text())
    parts = [PRELUDE]
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
        if "ipywidgets" in src:
            src = "if HAVE_WIDGETS:\n" + "\n".join("    " + line for line in src.splitlines())
        parts.append(src)
    parts.append(EPILOGUE)
    # Under a __main__ guard: chapter 5 spawns workers, which re-import the main module (an `if` block keeps
    # the cells' variables global).
    body = "\n\n".join(parts)
    return (
        "if __name__ == '__main__':\n" + "\n".join("    " + line if line else "" for line in body.splitlines()) + "\n"
    )


def run(path: Path, timeout: int = 600) -> tuple[bool, float, str]:
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
    return proc.returncode == 0, seconds, device


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted((ROOT / "chapters").glob("*.ipynb"))
    print(f"{'chapter':<40} {'result':<6} {'seconds':>8}  device")
    failed = 0
    for path in paths:
        ok, seconds, device = run(path)
        failed += not ok
        print(f"{path.name:<40} {'pass' if ok else 'FAIL':<6} {seconds:>8.1f}  {device}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
