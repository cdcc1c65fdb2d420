"""The processes behind chapter 5: a launcher for local ``torch.distributed`` process groups, which runs on each
rank one of the tasks of :mod:`gradaccum.book.ddp_tasks` (equality, placements, timing, crashes, training), and
reports what failed.

Processes are started with ``torch.multiprocessing`` on the loopback interface with a free port, the gloo
backend on CPU (NCCL when every rank has a GPU), a process-group timeout, and a deadline after which every worker
is killed: a crashed or hung worker surfaces as :class:`WorkerFailed` and leaves no process behind. Workers are
forked from a fork server that imported this module (and torch) once, at the first launch or earlier, in the
background (:func:`start_fork_server`), so later launches do not import torch again (a launch of chapter 5's
first task took about 3.3 s instead of 6–7.5 s on a 2-core CPU; ``spawn`` where the platform has no fork
server). Every worker imports this module, so it holds nothing the workers do not need (no figures, no
matplotlib).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradaccum._validate import require_count, require_k, require_positive

# the tasks live in gradaccum.book.ddp_tasks; chapter 5 and scripts/ddp_train.py read them from here too
from gradaccum.book.ddp_tasks import DATA_TASKS as DATA_TASKS
from gradaccum.book.ddp_tasks import DDP_VARIANTS as DDP_VARIANTS
from gradaccum.book.ddp_tasks import TASKS as TASKS
from gradaccum.book.ddp_tasks import UNUSED_RUNS as UNUSED_RUNS
from gradaccum.book.ddp_tasks import train_ddp as train_ddp


class WorkerFailed(RuntimeError):
    """A worker process raised, exited, or did not finish before the deadline."""


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, task: str, kwargs: dict[str, Any], out_dir: str) -> None:
    """What every worker runs: join the process group, run the task, save its result, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "nccl" if kwargs.get("backend") == "nccl" else "gloo"
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=kwargs.get("pg_timeout", 30))
    )
    task_kwargs = {k: v for k, v in kwargs.items() if k not in ("backend", "pg_timeout")}
    # No `finally`: a rank that raises keeps its connections open until its error is written and the process
    # exits, so its peers lose the connection only after the root cause is on record (destroying the group first
    # let a peer's "connection reset" arrive, and the launcher stop the failing rank, before its own report).
    result = TASKS[task](rank, world_size, **task_kwargs)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def start_method() -> str:
    """``"forkserver"`` where the platform has it (Linux, macOS), with this module preloaded, else ``"spawn"``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload([__name__])  # used when the fork server starts: the first launch
    return "forkserver"


def start_fork_server(preload: Sequence[str] = ()) -> bool:
    """Start the fork server now and return at once: it imports this module (torch with it) and the modules named
    in ``preload`` in the background, while the caller goes on. Later launches, and the pools of
    :func:`gradaccum.book.parallel.run_jobs` with ``start_method="forkserver"``, fork their workers from it with
    all of that imported, in milliseconds. A server already running is kept as it is. The server starts with
    ``TORCH_CPP_LOG_LEVEL=ERROR`` unless the caller set a level, as :func:`launch` starts it. Returns ``False``
    (and starts nothing) where the platform has no fork server: the workers are spawned then."""
    if start_method() != "forkserver":
        return False
    multiprocessing.set_forkserver_preload([__name__, *preload])
    had = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        if had is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    return True


def launch(task: str, world_size: int = 2, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """Run ``task`` on ``world_size`` local processes and return each rank's result.

    Raises :class:`WorkerFailed` (with the worker's error) if a worker raises or dies, or if the processes are
    not done within ``timeout`` seconds; in every case all workers are stopped before this returns. The process
    group's own timeout is ``pg_timeout`` seconds (30 here; torch's default is 30 minutes). The workers start with
    ``forkserver`` (or ``spawn``), which imports the caller's main module: called from a script, put the call
    under ``if __name__ == "__main__":`` — without it every worker fails as it starts, and the report shows only
    its exit code (Python's explanation goes to the workers' stderr).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}.")
    if "k" in kwargs:  # checked here, before any process starts (a worker's error says less)
        require_k(kwargs["k"])
    for name in ("b", "steps", "windows"):
        if name in kwargs:
            require_count(kwargs[name], name)
    if kwargs.get("bucket_cap_mb") is not None:
        require_positive(kwargs["bucket_cap_mb"], "bucket_cap_mb")
    if task == "crash":
        crash_rank, how = kwargs.get("crash_rank"), kwargs.get("how")
        if isinstance(crash_rank, bool) or not isinstance(crash_rank, int) or not 0 <= crash_rank < world_size:
            raise ValueError(
                f"crash_rank must be a rank in [0, {world_size}), got {crash_rank!r}: otherwise no rank "
                "fails and the task only all-reduces."
            )
        if how not in ("raise", "exit", "hang"):
            raise ValueError(f"how must be 'raise', 'exit' or 'hang', got {how!r}.")
    if task in DATA_TASKS and "data" not in kwargs:
        from gradaccum.book.data import load_digits_split  # here, not at the top: workers never load sklearn

        d = load_digits_split()
        kwargs["data"] = (d.x_train, d.y_train)

    # torch logs a warning (with a timestamp and a PID) for every worker it terminates after a failure; the
    # failure itself is reported by WorkerFailed.
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        return _launch(mp, task, world_size, timeout, kwargs)
    finally:
        spawn_log.setLevel(level)


def _launch(mp: Any, task: str, world_size: int, timeout: float, kwargs: dict[str, Any]) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        # The workers inherit this environment: their C++ warnings (timestamped, one per rank — e.g. DDP's note that
        # find_unused_parameters=True found no unused parameter) stay out of the caller's stderr unless the caller
        # chose a TORCH_CPP_LOG_LEVEL; errors still reach WorkerFailed.
        # A fork server keeps the environment it started with (the first launch's, with this setting).
        had = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        try:
            ctx = mp.start_processes(
                _entry,
                args=(world_size, free_port(), task, kwargs, out_dir),
                nprocs=world_size,
                join=False,
                start_method=start_method(),
            )
        finally:
            if had is None:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"task {task!r} did not finish within {timeout:g} s; all workers were killed.")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            for p in ctx.processes:  # let the other failures land in their error files
                p.join(2)
            exits = [proc.exitcode for proc in ctx.processes]
            causes = _worker_errors(ctx.error_files, exits) or [str(err).strip().splitlines()[-1]]
            raise WorkerFailed(f"a worker of task {task!r} failed:\n" + "\n".join(causes)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


_COMM_ERROR = ("gloo", "NCCL", "Connection reset", "Connection closed", "Broken pipe", "timed out", "Timed out")


def _worker_errors(error_files: list[str], exit_codes: list[int | None] | None = None) -> list[str]:
    """The last line of each worker's traceback — or, for a worker that exited without one (``os._exit``, a
    crash), its exit code — root causes first, then the consequences of another rank's failure.

    Three kinds, in this order (by rank within a kind): (1) a traceback that is not a lost peer, or a non-zero
    exit code without a traceback (the root causes); (2) a traceback that only reports a lost peer (``gloo``,
    ``Connection reset``, a timeout, ...); (3) a worker killed by a signal — a negative exit code, e.g. −15 for
    SIGTERM, which ``torch.multiprocessing`` sends to the survivors once one worker has failed.
    """

    found = []
    for rank, path in enumerate(error_files):
        code = exit_codes[rank] if exit_codes and rank < len(exit_codes) else None
        if path and os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as fh:
                last = pickle.load(fh).strip().splitlines()[-1]
            found.append((1 if any(mark in last for mark in _COMM_ERROR) else 0, f"rank {rank}: {last}"))
        elif code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            found.append((2, f"rank {rank}: killed by {name} (exit code {code})"))
        elif code not in (None, 0):
            found.append((0, f"rank {rank}: process exited with exit code {code}"))
    # a signal follows another rank's failure only where one is reported; otherwise it came from outside
    why = (
        ", a consequence of the failure above"
        if any(kind < 2 for kind, _ in found)
        else ": no rank reported an error, so the signal came from outside the job (the out-of-memory killer, a "
        "time limit, Ctrl-C)"
    )
    return [text + (why if kind == 2 else "") for kind, text in sorted(found, key=lambda item: item[0])]
