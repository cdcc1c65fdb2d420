"""Wall-clock timing that is fair to both CPU and CUDA code: warm-up first, synchronize, take the median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _timed(fn: Callable[[], object], cuda: bool) -> float:
    """Seconds of one call of ``fn``, with the device synchronized before and after on CUDA."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], device: torch.device | str = "cpu", repeat: int = 20,
                warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls after ``warmup`` untimed calls.

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


def interleaved_medians(fns: dict[str, Callable[[], object]], device: torch.device | str = "cpu", repeat: int = 7,
                        warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, measured *interleaved*: every round calls each function once, in
    turn, so that a machine getting busier or quieter during the measurement affects all of them alike (one
    function timed after another would carry that drift into the comparison)."""
    if repeat < 1 or warmup < 0 or not fns:
        raise ValueError(f"need functions, repeat >= 1 and warmup >= 0, got {len(fns)}, {repeat}, {warmup}.")
    cuda = torch.device(device).type == "cuda"
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(warmup + repeat):
        for name, fn in fns.items():
            seconds = _timed(fn, cuda)
            if round_ >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}
