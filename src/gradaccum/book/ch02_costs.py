"""Chapter 2, what the methods cost: forward calls and interleaved timings of one optimizer step per method, the
cost of a PreciseBN pass, and the recorded run of ``benchmarks/ghost_bn.py`` the chapter reads. Re-exported by
:mod:`gradaccum.book.ch02_ghost_batchnorm`.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn

from gradaccum._validate import require_k
from gradaccum.accumulate import accumulate_backward
from gradaccum.book.data import DigitsSplit
from gradaccum.book.models import make_cnn
from gradaccum.book.tables import Table
from gradaccum.fullbatch_bn import full_batch_stats_as_constants_backward, full_batch_stats_backward
from gradaccum.ghost_bn import ghostify
from gradaccum.precise_bn import precise_bn
from gradaccum.timing import interleaved_times


@dataclass(frozen=True)
class StepCost:
    """What one optimizer step of a method costs on a batch of K·b images: the model's forward calls (each
    micro-batch forward counts one, a forward stopped early by the statistics pass too) and time relative to
    plain accumulation (:func:`step_costs` says how it is measured)."""

    method: str
    forward_calls: int
    time_ratio: float


#: The methods :func:`step_functions` can time, in the order of the cost table.
STEP_METHODS = (
    "full batch",
    "plain accumulation",
    "ghost BN, 1 update/step",
    "full-batch stats",
    "exact full-batch stats",
    "exact, cached",
)


def step_functions(
    x: torch.Tensor, y: torch.Tensor, k: int, methods: Sequence[str] = STEP_METHODS, dtype: torch.dtype = torch.float64
) -> tuple[dict[str, Callable[[], object]], dict[str, list[int]]]:
    """One optimizer step's gradient of each method on the batch ``x, y`` (a fresh SmallCNN each, seed 0), as a
    function of no arguments, and a counter of the model's forward calls per method (a forward pre-hook)."""
    require_k(k)
    batch_size = x.shape[0]
    loss_fn = nn.CrossEntropyLoss()
    counts: dict[str, list[int]] = {}
    steps: dict[str, Callable[[], object]] = {}
    for method in methods:
        model: nn.Module = make_cnn("batch", seed=0, dtype=dtype, device=x.device).train()
        steps_k, backward = k, accumulate_backward
        if method == "full batch":
            steps_k = 1
        elif method == "ghost BN, 1 update/step":
            model, steps_k = ghostify(model, batch_size // k), 1
        elif method == "full-batch stats":
            backward = full_batch_stats_as_constants_backward
        elif method == "exact full-batch stats":
            backward = functools.partial(full_batch_stats_backward, cache=False)
        elif method == "exact, cached":
            backward = functools.partial(full_batch_stats_backward, cache=True)
        elif method != "plain accumulation":
            raise ValueError(f"no step cost for {method!r}; choose among {list(STEP_METHODS)}.")
        counter = counts.setdefault(method, [0])
        model.register_forward_pre_hook(lambda *_, c=counter: c.__setitem__(0, c[0] + 1))

        def step(m: nn.Module = model, kk: int = steps_k, fn=backward) -> None:
            m.zero_grad(set_to_none=True)
            fn(m, loss_fn, x, y, kk)

        steps[method] = step
    return steps, counts


def step_costs(
    split: DigitsSplit, k: int = 16, batch_size: int = 64, repeat: int = 7, methods: Sequence[str] = STEP_METHODS
) -> list[StepCost]:
    """Count the passes and time one optimizer step of each method on the same batch (SmallCNN, float64).
    "exact, cached" is the exact scheme with ``cache=True``: its stages call the layers, not the model, which it
    calls once (to learn whether the forward draws random numbers).

    Timing is interleaved: each round runs every method once, in turn, so a machine that slows down or speeds
    up during the measurement affects every method alike. Each method's time is its fastest of ``repeat``
    rounds (after one untimed round), in CPU seconds of this process on the CPU (time spent waiting while
    another process ran is not counted; :func:`gradaccum.timing.interleaved_times`) and wall seconds on CUDA.
    """
    steps, counts = step_functions(split.x_train[:batch_size], split.y_train[:batch_size], k, methods)
    for method, step_fn in steps.items():  # one counted step per method
        counts[method][0] = 0
        step_fn()
    calls = {m: c[0] for m, c in counts.items()}
    device = split.x_train.device
    times = interleaved_times(steps, device, repeat=repeat, warmup=1, clock="auto", statistic="min")
    base = times.get("plain accumulation") or next(iter(times.values()))
    return [StepCost(m, calls[m], times[m] / base) for m in methods]


def precise_bn_cost(split: DigitsSplit, b: int = 4, k: int = 16, repeat: int = 5) -> float:
    """Seconds of one PreciseBN pass (over the training set in batches of b) divided by the seconds of one
    plain-accumulation step (K micro-batches of b), timed as :func:`step_costs` times."""

    model = make_cnn("batch", seed=0, device=split.x_train.device).train()
    x, y = split.x_train[: k * b], split.y_train[: k * b]
    loss_fn = nn.CrossEntropyLoss()
    recompute = copy.deepcopy(model)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        accumulate_backward(model, loss_fn, x, y, k)

    times = interleaved_times(
        {"plain step": plain, "PreciseBN pass": lambda: precise_bn(recompute, split.x_train, b)},
        x.device,
        repeat=repeat,
        warmup=1,
        clock="auto",
        statistic="min",
    )
    return times["PreciseBN pass"] / times["plain step"]


# ------------------------------------------------------------------------------------ the recorded benchmark


def load_benchmark() -> dict[str, Any]:
    """The run of ``benchmarks/ghost_bn.py --threads 1 --json ...`` recorded on the book's 2-core CPU (shipped
    with the package as ``gradaccum/book/ghost_bn_cpu.json``, so that the chapter reads it anywhere)."""
    text = resources.files("gradaccum.book").joinpath("ghost_bn_cpu.json").read_text(encoding="utf-8")
    bench = json.loads(text)
    if bench.get("quick"):
        raise ValueError("the recorded benchmark is a --quick smoke run; record a full run for the chapter.")
    return bench


def benchmark_ratios(bench: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Ratio to each table's baseline, keyed by (table, row): tables named by their shape and v ("256×64×16×16,
    v=32") or "step"; rows by the benchmark's names with the resolved implementation and K left out
    ("GhostBatchNorm default", "exact, cached")."""
    out = {}
    for table in bench["tables"]:
        key = "step" if "shape" not in table else "×".join(map(str, table["shape"])) + f", v={table['v']}"
        for row in table["rows"]:
            name = re.sub(r" \((auto: \w+|K=\d+)\)$", "", row["name"])
            out[key, name] = float(row["ratio"])
    return out


def benchmark_table(bench: dict[str, Any]) -> Table:
    """The layer tables side by side: one row per variant, one column per shape (ratio to one BatchNorm call)."""
    ratios = benchmark_ratios(bench)
    auto = {"×".join(map(str, t["shape"])) + f", v={t['v']}": t["auto_impl"] for t in bench["tables"] if "shape" in t}
    shapes = list(dict.fromkeys(t for t, _ in ratios if t != "step"))
    names = list(dict.fromkeys(n.replace("BatchNorm1d", "BatchNorm2d") for t, n in ratios if t != "step"))

    def cell(shape: str, name: str) -> str:
        ratio = ratios.get((shape, name), ratios.get((shape, name.replace("BatchNorm2d", "BatchNorm1d"))))
        if ratio is None:
            return "—"
        return f"{ratio:.2f}× ({auto[shape]})" if name == "GhostBatchNorm default" else f"{ratio:.2f}×"

    return Table(
        ["forward + backward", *shapes],
        [[n.replace("BatchNorm2d", "BatchNorm"), *(cell(s, n) for s in shapes)] for n in names],
    )
