"""Independent, self-seeded runs in a few worker processes: a chapter's study in about ``1/workers`` of the time.

The book's experiments run on one torch thread (:data:`gradaccum.runtime.DEFAULT_THREADS`) so that their digits
do not depend on the core count; a study of many such runs leaves the other cores idle. :func:`run_jobs` hands the
runs to ``workers`` spawned processes, each on one thread. Every run seeds its own generators and draws nothing
from a process-wide one, so it computes the same arithmetic in any process: the results are the sequential ones,
bit for bit (each chapter's tests compare the two).

Starting a spawned process costs seconds (it imports torch), so the processes are kept for the next study of the
same notebook or script and stopped when it exits, or by :func:`shutdown`. With ``start_method="forkserver"`` they
are forked from the fork server instead, in milliseconds when it has imported torch already
(:func:`gradaccum.book.ddp_workers.start_fork_server`).
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal, TypeVar

import torch

from gradaccum.runtime import DEFAULT_THREADS

_T = TypeVar("_T")

StartMethod = Literal["spawn", "forkserver"]

#: The kept pools, by number of processes and start method.
_POOLS: dict[tuple[int, str], ProcessPoolExecutor] = {}


def _one_thread() -> None:
    torch.set_num_threads(DEFAULT_THREADS)  # as gradaccum.setup() does: results do not depend on the core count


def _call(fn: Callable[..., _T], job: Mapping[str, Any]) -> _T:
    return fn(**job)


def _pool(workers: int, start_method: str) -> ProcessPoolExecutor:
    """The pool of ``workers`` one-thread processes started with ``start_method`` (``"spawn"`` where the platform
    has no fork server), started on first use (each process when first needed) and kept."""
    if start_method not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    key = (workers, start_method)
    if key not in _POOLS:
        _POOLS[key] = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context(start_method), initializer=_one_thread
        )
    return _POOLS[key]


def shutdown() -> None:
    """Stop the kept processes and wait for them (a later :func:`run_jobs` starts new ones)."""
    while _POOLS:
        _POOLS.popitem()[1].shutdown(wait=True)


def run_jobs(
    fn: Callable[..., _T], jobs: Sequence[Mapping[str, Any]], workers: int = 1, start_method: StartMethod = "spawn"
) -> list[_T]:
    """``[fn(**job) for job in jobs]``, in order. With ``workers > 1`` the jobs run in that many processes with one
    torch thread each, spawned or forked from the fork server (``start_method``; spawned where the platform has no
    fork server); ``fn`` must then be importable by name (a module-level function). The jobs are handed out one
    at a time in the order given (put the longest first); the processes are kept for the next call.
    ``fn`` must seed every generator it draws from."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}; use 1 to run the jobs here, in turn.")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}.")
    if workers == 1 or len(jobs) < 2:
        return [fn(**job) for job in jobs]
    pool = _pool(workers, start_method)
    try:
        return list(pool.map(functools.partial(_call, fn), jobs))
    except BrokenProcessPool:
        for key in [key for key, kept in _POOLS.items() if kept is pool]:
            del _POOLS[key]  # a process died: the next call starts a new pool
        raise
