"""Timing that is fair to both CPU and CUDA code: warm-up first, synchronize, interleave, take the median (or
the fastest round).

Two clocks: ``"wall"`` (``time.perf_counter``), the default and the only one that counts an accelerator's work,
and ``"process"`` (``time.process_time``), the CPU seconds of this process, summed over all its threads (idle
threads spinning between parallel regions included) and blind to work done in child processes. It is a fair
clock for single-threaded CPU code, as the book's is (``gradaccum.setup`` sets one thread); ``"auto"`` picks it
on the CPU with one torch thread, and the wall clock otherwise. On a shared machine the
process clock does not count the time this process waited while another one ran, so a ratio of two CPU
timings stays put when the machine gets busy; the wall clock does not (measured for chapter 2's cost table
with two busy-looping processes on a 2-core machine: the wall-clock ratio ranged over 2.9-9.6, the
process-clock minimum over 5.4-6.2).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Literal

import torch

Clock = Literal["wall", "process", "auto"]
Statistic = Literal["median", "min"]
_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "process": time.process_time}
_STATISTICS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


def _timed(fn: Callable[[], object], cuda: bool, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call of ``fn``, with the device synchronized before and after on CUDA."""
    if cuda:
        torch.cuda.synchronize()
    start = clock()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return clock() - start


def median_time(
    fn: Callable[[], object], device: torch.device | str = "cpu", repeat: int = 20, warmup: int = 3
) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` calls after ``warmup`` untimed calls.

    On CUDA the device is synchronized before and after each call, so queued kernels are counted.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}.")
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        times.append(_timed(fn, cuda))
    return statistics.median(times)


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    device: torch.device | str = "cpu",
    repeat: int = 7,
    warmup: int = 1,
    clock: Clock = "wall",
    statistic: Statistic = "median",
    rotate: bool = False,
) -> dict[str, float]:
    """Seconds of each function, measured *interleaved*: every round calls each function once, in turn, so
    that a machine getting busier or quieter during the measurement affects all of them alike (one function
    timed after another would carry that drift into the comparison). Each function's ``repeat`` timed
    rounds (after ``warmup`` untimed ones) are summarized by ``statistic``.

    ``clock="process"`` with ``statistic="min"`` is the robust choice for a *ratio* of CPU timings on a
    shared machine, for single-threaded code: waiting for the CPU is not counted, and the noise left (caches
    disturbed by other processes) only adds time, so the fastest round is the least disturbed one. With several
    threads it sums their CPU seconds (effort, not elapsed time); ``"auto"`` then takes the wall clock. It cannot
    time a GPU's work, which runs outside the process's CPU time, and is refused for any device but the CPU.
    """
    if repeat < 1 or warmup < 0 or not fns:
        raise ValueError(
            f"need at least one function, repeat >= 1 and warmup >= 0; got {len(fns)} functions, "
            f"repeat={repeat}, warmup={warmup}."
        )
    if clock not in (*_CLOCKS, "auto") or statistic not in _STATISTICS:
        raise ValueError(
            f"clock must be one of {[*_CLOCKS, 'auto']} and statistic one of {list(_STATISTICS)}, "
            f"got {clock!r} and {statistic!r}."
        )
    kind = torch.device(device).type
    cuda = kind == "cuda"
    if clock == "auto":
        clock = "process" if kind == "cpu" and torch.get_num_threads() == 1 else "wall"
    if kind != "cpu" and clock == "process":
        raise ValueError(
            f"the process clock counts CPU seconds and misses the work of a {kind!r} device; time it with clock='wall'."
        )
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for round_ in range(warmup + repeat):
        start = round_ % len(items) if rotate else 0
        for name, fn in items[start:] + items[:start]:
            seconds = _timed(fn, cuda, _CLOCKS[clock])
            if round_ >= warmup:
                times[name].append(seconds)
    return {name: _STATISTICS[statistic](t) for name, t in times.items()}


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    device: torch.device | str = "cpu",
    repeat: int = 7,
    warmup: int = 1,
    rotate: bool = False,
) -> dict[str, float]:
    """Median wall seconds of each function, measured interleaved (:func:`interleaved_times`)."""
    return interleaved_times(fns, device, repeat, warmup, rotate=rotate)
