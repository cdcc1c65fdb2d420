"""The processes behind chapter 5: a launcher for local ``torch.distributed`` process groups and the tasks each
rank runs (equality, placements, timing, crashes, training).

Processes are started with ``torch.multiprocessing`` on the loopback interface with a free port, the gloo
backend on CPU (NCCL when every rank has a GPU), a process-group timeout, and a deadline after which every worker
is killed: a crashed or hung worker surfaces as :class:`WorkerFailed` and leaves no process behind. Workers are
forked from a fork server that imported this module (and torch) once, at the first launch, so later launches
do not import torch again (a launch of chapter 5's first task took about 3.3 s instead of 6–7.5 s on a 2-core
CPU; ``spawn`` where the platform has no fork server). Every worker imports this module, so it holds nothing the
workers do not need (no figures, no matplotlib).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum._validate import require_count, require_k, require_positive
from gradaccum.accumulate import accumulated_gradient, flat_grad
from gradaccum.book.models import make_cnn, mlp
from gradaccum.distributed import (
    PLACEMENTS,
    CommCounter,
    counting_hook,
    ddp_accumulate,
    placed_accumulate,
    register_counter,
)


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


# DDP checks a hook's annotations as objects; `from __future__ import annotations` made them strings.
counting_hook.__annotations__ = {
    "state": CommCounter,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _shard(
    rank: int, world_size: int, per_rank: int, dtype: torch.dtype, data: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's consecutive share of the digits' training images (``data`` as passed by :func:`launch`, so
    that workers need not load scikit-learn; loaded here when absent, e.g. under torchrun)."""
    if data is None:
        from gradaccum.book.data import load_digits_split  # here, not at the top: workers never load sklearn

        d = load_digits_split()
        data = (d.x_train, d.y_train)
    x, y = data
    if (rank + 1) * per_rank > x.shape[0]:
        raise ValueError(
            f"{world_size} ranks × {per_rank} images exceed the {x.shape[0]} training images; each "
            f"rank needs K·b·steps images of its own: lower the micro-batch size b, K or the steps "
            f"(micro_batch_that_fits gives the largest b that fits)."
        )
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[sl].to(dtype), y[sl]


#: DDP options whose per-step all-reduce counts :func:`_task_equality` also records (with ``steps`` > 1): the
#: single first-iteration bucket is a property of the default ``find_unused_parameters=False``; ``static_graph``
#: with ``no_sync()`` in the very first step fails inside DDP on torch 2.13 (pytorch/pytorch#143580) unless that
#: step synchronizes (``"static_graph=True, first step synced"`` runs step 1 without ``no_sync()``).
DDP_VARIANTS: dict[str, dict[str, bool]] = {
    "find_unused_parameters=True": {"find_unused_parameters": True},
    "static_graph=True": {"static_graph": True},
    "static_graph=True, first step synced": {"static_graph": True},
}


def _calls_per_step(
    x: torch.Tensor, y: torch.Tensor, k: int, steps: int, no_sync: bool, first_sync: bool = False, **ddp_kwargs: Any
) -> list[int] | str:
    """All-reduce calls in each of ``steps`` accumulated optimizer steps of a fresh DDP model built with
    ``ddp_kwargs``; step 1 without ``no_sync()`` if ``first_sync``. A RuntimeError inside DDP is returned as its
    first line (every rank raises it alike, so the process group stays usable)."""

    model = DDP(make_cnn("group", seed=0), **ddp_kwargs)
    counter = register_counter(model)
    per_step = []
    try:
        for s in range(steps):
            before = counter.calls
            model.zero_grad(set_to_none=True)
            ddp_accumulate(model, nn.CrossEntropyLoss(), x, y, k, no_sync=no_sync and not (first_sync and s == 0))
            per_step.append(counter.calls - before)
    except RuntimeError as err:
        return f"RuntimeError: {str(err).strip().splitlines()[0]}"
    return per_step


def _task_equality(
    rank: int, world_size: int, k: int, b: int, data: Any = None, steps: int = 1, bucket_cap_mb: float | None = None
) -> dict[str, Any]:
    """Gradients after one accumulated step with and without no_sync, and the all-reduce counts of each; with
    ``steps`` > 1, also the all-reduce calls of each of ``steps`` optimizer steps (buckets of at most
    ``bucket_cap_mb`` MiB), which show the first iteration's single bucket and the rebuilt buckets after it, and
    the same counts under each of :data:`DDP_VARIANTS` (``out[mode]["variants"]``)."""

    x, y = _shard(rank, world_size, k * b, torch.float64, data)
    out: dict[str, Any] = {}
    for mode in ("sync every micro-batch", "no_sync"):
        model = DDP(make_cnn("group", seed=0))
        counter = register_counter(model)
        ddp_accumulate(model, nn.CrossEntropyLoss(), x, y, k, no_sync=mode == "no_sync")
        out[mode] = {"grad": flat_grad(model.module).detach(), "calls": counter.calls, "bytes": counter.bytes}
        if steps > 1:
            cap: dict[str, Any] = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
            out[mode]["calls per step"] = _calls_per_step(x, y, k, steps, mode == "no_sync", **cap)
            out[mode]["variants"] = {
                name: _calls_per_step(
                    x, y, k, steps, mode == "no_sync", first_sync="first step synced" in name, **cap, **options
                )
                for name, options in DDP_VARIANTS.items()
            }
    out["params"] = sum(p.numel() for p in model.module.parameters())
    return out


def _task_collectives(
    rank: int, world_size: int, k: int, b: int, steps: int, data: Any = None, bucket_cap_mb: float = 0.005
) -> dict[str, list[int]]:
    """All-reduces the process group runs in each of ``steps`` accumulated steps, counted by the profiler (every
    ``c10d::allreduce_``, whatever the backend; the comm hook of :func:`_calls_per_step` sees gradient buckets
    only), with and without ``no_sync()`` and with the default or ``find_unused_parameters=True``, whose reducer
    also all-reduces the map of used parameters in every synchronized backward pass."""
    from torch.profiler import ProfilerActivity, profile  # here: only this task needs the profiler

    x, y = _shard(rank, world_size, k * b, torch.float64, data)
    out = {}
    for unused in (False, True):
        for mode in ("sync every micro-batch", "no_sync"):
            model = DDP(make_cnn("group", seed=0), find_unused_parameters=unused, bucket_cap_mb=bucket_cap_mb)
            counts = []
            for _ in range(steps):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    model.zero_grad(set_to_none=True)
                    ddp_accumulate(model, nn.CrossEntropyLoss(), x, y, k, no_sync=mode == "no_sync")
                counts.append(sum(e.name == "c10d::allreduce_" for e in prof.events()))
            out[f"{mode}{', find_unused_parameters=True' if unused else ''}"] = counts
    return out


def _task_placement(rank: int, world_size: int, k: int, b: int, data: Any = None) -> dict[str, Any]:
    """For every entry of :data:`PLACEMENTS`: the all-reduce calls of one accumulated step and the gradient this
    rank holds after it; plus ``"local"``, the gradient of this rank's own shard alone (no averaging)."""

    x, y = _shard(rank, world_size, k * b, torch.float64, data)
    out: dict[str, Any] = {"local": accumulated_gradient(make_cnn("group", seed=0), nn.CrossEntropyLoss(), x, y, k)}
    for placement in PLACEMENTS:
        model = DDP(make_cnn("group", seed=0))
        counter = register_counter(model)
        placed_accumulate(model, nn.CrossEntropyLoss(), x, y, k, placement)
        out[placement] = {"grad": flat_grad(model.module).detach(), "calls": counter.calls}
    return out


def _task_timing(
    rank: int, world_size: int, widths: list[int], ks: list[int], b: int, steps: int, sizes: list[int], data: Any = None
) -> dict[str, Any]:
    """Step times with and without no_sync for each (width, K), and an all-reduce microbenchmark.

    Every configuration is warmed up (2 pairs), then the two modes alternate step by step in the order
    AB BA AB ...: with a fixed order, whichever runs first in a pair pays for what the previous pair left behind
    (the K = 1 rows, which run identical code, differed by 2×). Each step starts after a barrier, so both ranks
    time the same step. ``result["pairs"][width, K]`` holds the ``steps`` (sync, no_sync) pairs in the order they
    ran, ``result["steps"][width, K, no_sync]`` the median of each mode.
    """
    x, y = _shard(rank, world_size, max(ks) * b, torch.float32, data)
    loss_fn = nn.CrossEntropyLoss()
    result: dict[str, Any] = {
        "allreduce": {},
        "copy": {},
        "steps": {},
        "params": {},
        "pairs": {},
        "world_size": world_size,
    }
    for n in sizes:  # all-reduce, and a plain copy, of n float32 values
        t, src = torch.ones(n), torch.ones(n)
        reduces, copies = [], []
        for i in range(2 * steps + 3):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            middle = time.perf_counter()
            t.copy_(src)
            if i >= 3:
                reduces.append(middle - start)
                copies.append(time.perf_counter() - middle)
        result["allreduce"][4 * n] = statistics.median(reduces)
        result["copy"][4 * n] = statistics.median(copies)
    for width in widths:
        model = DDP(mlp(width))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        result["params"][width] = sum(p.numel() for p in model.module.parameters())
        for k in ks:
            xk, yk = x[: k * b], y[: k * b]
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(steps + 2):
                for no_sync in (False, True) if i % 2 == 0 else (True, False):
                    dist.barrier()
                    start = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    ddp_accumulate(model, loss_fn, xk, yk, k, no_sync)
                    opt.step()
                    if i >= 2:
                        times[no_sync].append(time.perf_counter() - start)
            for no_sync, ts in times.items():
                result["steps"][width, k, no_sync] = statistics.median(ts)
            result["pairs"][width, k] = list(zip(times[False], times[True]))
    return result


def _task_buffers(rank: int, world_size: int, k: int, b: int, windows: int = 2, data: Any = None) -> dict[str, Any]:
    """Which forward passes broadcast DDP's buffers (``broadcast_buffers=True``, the default) in ``windows``
    accumulation windows of K micro-batches, the first K − 1 inside ``no_sync()``: one flag per forward, in order;
    and this rank's first BatchNorm running mean after the last window. DDP decides the broadcast before a forward
    from the flag the *previous* forward left (``require_forward_param_sync``)."""
    x, y = _shard(rank, world_size, windows * k * b, torch.float64, data)
    model = DDP(make_cnn("batch", seed=0))
    calls = [0]
    sync_buffers = model._sync_buffers

    def counted() -> None:
        calls[0] += 1
        sync_buffers()

    model._sync_buffers = counted  # type: ignore[method-assign]
    broadcast = []
    for w in range(windows):
        xs, ys = x[w * k * b : (w + 1) * k * b], y[w * k * b : (w + 1) * k * b]
        for i in range(k):
            before = calls[0]
            context = model.no_sync() if i < k - 1 else contextlib.nullcontext()
            with context:
                out = model(xs[i * b : (i + 1) * b])
                (nn.functional.cross_entropy(out, ys[i * b : (i + 1) * b]) / k).backward()
            broadcast.append(calls[0] > before)
    bn = next(m for m in model.module.modules() if isinstance(m, nn.BatchNorm2d))
    return {"broadcast": broadcast, "running_mean": torch.as_tensor(bn.running_mean).clone()}


class _Branch(nn.Module):
    """Two linear maps of the flattened image; the second one only where ``branch`` is true (a path some inputs
    take): its parameters are unused in the other micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(64, 10).double(), nn.Linear(64, 10).double()

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        out = self.a(x.flatten(1))
        return out + self.b(x.flatten(1)) if branch else out


#: :func:`_task_unused`'s runs: name → (DDP options, no_sync()).
UNUSED_RUNS: dict[str, tuple[dict[str, Any], bool]] = {
    "sync every micro-batch": ({}, False),
    "no_sync": ({}, True),
    "no_sync, find_unused_parameters=True": ({"find_unused_parameters": True}, True),
}


def _task_unused(rank: int, world_size: int, k: int, b: int, data: Any = None) -> dict[str, Any]:
    """One accumulated step of :class:`_Branch` whose branch runs in the window's first micro-batch only, for each
    of :data:`UNUSED_RUNS`: the gradient this rank holds and the all-reduce calls, or the first line of the
    RuntimeError DDP raises (in the step, at the next forward)."""
    x, y = _shard(rank, world_size, k * b, torch.float64, data)
    out: dict[str, Any] = {}
    for name, (options, no_sync) in UNUSED_RUNS.items():
        model = DDP(_Branch(), **options)
        counter = register_counter(model)
        try:
            for i in range(k):
                with model.no_sync() if no_sync and i < k - 1 else contextlib.nullcontext():
                    loss = nn.functional.cross_entropy(model(x[i * b : (i + 1) * b], i == 0), y[i * b : (i + 1) * b])
                    (loss / k).backward()
            out[name] = {"grad": flat_grad(model.module).detach(), "calls": counter.calls}
        except RuntimeError as err:
            out[name] = f"RuntimeError: {str(err).strip().splitlines()[0]}"
    return out


def _task_crash(rank: int, world_size: int, crash_rank: int, how: str) -> None:
    """Rank ``crash_rank`` fails (raises, or exits abruptly); the others wait in a collective."""
    if rank == crash_rank:
        if how == "exit":
            os._exit(3)
        if how == "hang":
            time.sleep(3600)
        raise RuntimeError(f"rank {rank} failed on purpose")
    dist.all_reduce(torch.ones(1))


def train_ddp(
    k: int,
    b: int,
    steps: int,
    no_sync: bool,
    device: torch.device | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A few optimizer steps of the digits CNN under DDP, on an initialized process group (launched by
    :func:`launch` or by ``torchrun``). Each rank trains on its own shard; returns the final parameters."""

    device = device or torch.device("cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = _shard(rank, world_size, k * b * steps, torch.float64, data)
    x, y = x.to(device), y.to(device)
    model = DDP(make_cnn("group", seed=0, device=device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        sl = slice(s * k * b, (s + 1) * k * b)
        ddp_accumulate(model, nn.CrossEntropyLoss(), x[sl], y[sl], k, no_sync)
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.module.parameters()]).cpu()


def _task_train(rank: int, world_size: int, k: int, b: int, steps: int, data: Any = None) -> dict[str, Any]:
    """Train with and without no_sync from the same start; returns both final parameter vectors."""
    return {
        "sync": train_ddp(k, b, steps, no_sync=False, data=data),
        "no_sync": train_ddp(k, b, steps, no_sync=True, data=data),
    }


def _task_frameworks(rank: int, world_size: int, **kwargs: Any) -> Any:
    """Chapter 7: the frameworks on two processes (imported here, not at the top: only this task needs them)."""
    from gradaccum.book.ch07_harness import rank_task

    return rank_task(rank, world_size, **kwargs)


def _task_subgroups(rank: int, world_size: int) -> dict[str, Any]:
    """One replica per rank: DDP on a process group of this rank alone, counted with :func:`register_counter`;
    input ``rank + 1``. Averaging inside the model's own group leaves each rank its own gradient."""
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group, in order
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2).double(), process_group=groups[rank])
    counter = register_counter(model)
    model(torch.full((1, 4), float(rank + 1), dtype=torch.float64)).sum().backward()
    return {"grad": float(model.module.weight.grad[0, 0]), "calls": counter.calls}


#: Tasks that train on the digits: launch() hands them the training images.
DATA_TASKS = ("equality", "timing", "train", "placement", "buffers", "collectives", "unused")


TASKS: dict[str, Callable[..., Any]] = {
    "equality": _task_equality,
    "timing": _task_timing,
    "crash": _task_crash,
    "train": _task_train,
    "placement": _task_placement,
    "frameworks": _task_frameworks,
    "buffers": _task_buffers,
    "collectives": _task_collectives,
    "subgroups": _task_subgroups,
    "unused": _task_unused,
}
