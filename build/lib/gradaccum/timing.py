"""Wall-clock timing that is fair to both CPU and CUDA code: warm-up first, synchronize, take the median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_time(fn: Callable[[], object], device: torch.device | str = "cpu", repeat: int = 20, warmup: int = 3) -> float:
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
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
