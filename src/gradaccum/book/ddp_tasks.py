"""The tasks each rank of chapter 5's process groups runs (:data:`TASKS`, by name): gradients with and without
``no_sync()`` and their all-reduce counts, each placement of the all-reduce, step timings, buffer broadcasts,
unused parameters, crashes on purpose, training, the frameworks of chapter 7, FSDP2 under accumulation (chapter 4),
subgroups, and chapter 6's token count and dropout seeds.

A task is called as ``TASKS[name](rank, world_size, **kwargs)`` on an initialized process group, by
:func:`gradaccum.book.ddp_workers.launch`'s workers (or under ``torchrun``: :func:`train_ddp`), and returns what the
rank measured. The tasks in :data:`DATA_TASKS` train on the digits and get each rank's share of the training
images from :func:`_shard`. Every worker imports this module, so it holds nothing the workers do not need (no
figures, no matplotlib, no scikit-learn at import).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

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


def _task_fsdp2(rank: int, world_size: int, **kwargs: Any) -> Any:
    """Chapter 4: FSDP2 under accumulation (imported here, not at the top: only this task needs it)."""
    from gradaccum.book.ch04_fsdp import fsdp2_task

    return fsdp2_task(rank, world_size, **kwargs)


def _task_ch6(rank: int, world_size: int, **kwargs: Any) -> Any:
    """Chapter 6: the token count after the window, and each rank's dropout masks (imported here: only this task
    needs Transformers and Accelerate)."""
    from gradaccum.book.ch06_ranks import rank_task

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
    "fsdp2": _task_fsdp2,
    "buffers": _task_buffers,
    "collectives": _task_collectives,
    "subgroups": _task_subgroups,
    "unused": _task_unused,
    "ch6": _task_ch6,
}
