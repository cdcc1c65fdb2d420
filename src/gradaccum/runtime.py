"""Reproducible set-up shared by every chapter: seeds, thread count, device.

Every chapter's first cell calls :func:`setup`. Stored notebook outputs are compared byte for byte by
``pytest --nbval``, so anything that can change a printed digit between machines is fixed here:

* the thread count (CPU float reductions are summed in a different order with a different number of
  threads, so results would differ between a 2-core and a 16-core machine);
* every random seed (Python, NumPy, torch);
* the default floating-point type of the experiments (float64 where a chapter asks for it, so that a
  last-bit difference between CPU kernels never flips a printed digit).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random

import torch

#: Threads used by torch on the CPU in every chapter. One thread makes reductions run in the same order on
#: any machine; the book's models are small enough that more threads would not make them faster.
DEFAULT_THREADS = 1

#: Environment variable that overrides the device choice (``cpu``, ``cuda``, ``cuda:1``...).
DEVICE_ENV = "GRADACCUM_DEVICE"


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (when NumPy is installed: the core does not need it) and torch's generators (CPU
    and, when present, every CUDA device)."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}; pass e.g. seed=0.")
    random.seed(seed)
    if importlib.util.find_spec("numpy") is not None:
        importlib.import_module("numpy").random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def pick_device(prefer: str | None = None) -> torch.device:
    """The one place where a chapter chooses its device.

    Order: ``prefer`` if given, else the ``GRADACCUM_DEVICE`` environment variable, else CUDA when it is
    available, else the CPU. Nothing in the book requires a GPU.
    """
    choice = prefer if prefer is not None else os.environ.get(DEVICE_ENV)
    if choice is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
    except RuntimeError as err:
        raise ValueError(f"unknown device {choice!r}; use 'cpu', 'cuda' or 'cuda:N'.") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {choice!r} was asked for but CUDA is not available here; use 'cpu' or unset {DEVICE_ENV}."
        )
    return device


def setup(seed: int = 0, threads: int = DEFAULT_THREADS, prefer: str | None = None) -> torch.device:
    """Fix seeds and the CPU thread count, and return the device the chapter runs on.

    Returns:
        The device chosen by :func:`pick_device`.
    """
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}.")
    torch.set_num_threads(threads)
    seed_everything(seed)
    return pick_device(prefer)
