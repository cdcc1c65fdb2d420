"""Independent, self-seeded runs in a few spawned processes: a chapter's study in about ``1/workers`` of the time.

The book's experiments run on one torch thread (:data:`gradaccum.runtime.DEFAULT_THREADS`) so that their digits
do not depend on the core count; a study of many such runs leaves the other cores idle. :func:`run_jobs` hands the
runs to ``workers`` spawned processes, each on one thread. Every run seeds its own generators and draws nothing
from a process-wide one, so it computes the same arithmetic in any process: the results are the sequential ones,
bit for bit (each chapter's tests compare the two).

Starting a spawned process costs seconds (it imports torch), so the processes are kept for the next study of the
same notebook or script and stopped when it exits, or by :func:`shutdown`.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import torch

from gradaccum.runtime import DEFAULT_THREADS

_T = TypeVar("_T")

#: The kept pools, by number of processes.
_POOLS: dict[int, ProcessPoolExecutor] = {}


def _one_thread() -> None:
    torch.set_num_threads(DEFAULT_THREADS)  # as gradaccum.setup() does: results do not depend on the core count


def _call(fn: Callable[..., _T], job: Mapping[str, Any]) -> _T:
    return fn(**job)


def _pool(workers: int) -> ProcessPoolExecutor:
    """The pool of ``workers`` spawned one-thread processes, started on first use (each process when first
    needed) and kept."""
    if workers not in _POOLS:
        _POOLS[workers] = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread
        )
    return _POOLS[workers]


def shutdown() -> None:
    """Stop the kept processes and wait for them (a later :func:`run_jobs` starts new ones)."""
    while _POOLS:
        _POOLS.popitem()[1].shutdown(wait=True)


def run_jobs(fn: Callable[..., _T], jobs: Sequence[Mapping[str, Any]], workers: int = 1) -> list[_T]:
    """``[fn(**job) for job in jobs]``, in order. With ``workers > 1`` the jobs run in that many spawned processes
    with one torch thread each (``fn`` must then be importable by name: a module-level function), handed out one
    at a time in the order given (put the longest first); the processes are kept for the next call.
    ``fn`` must seed every generator it draws from."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}; use 1 to run the jobs here, in turn.")
    if workers == 1 or len(jobs) < 2:
        return [fn(**job) for job in jobs]
    try:
        return list(_pool(workers).map(functools.partial(_call, fn), jobs))
    except BrokenProcessPool:
        _POOLS.pop(workers, None)  # a process died: the next call starts a new pool
        raise
