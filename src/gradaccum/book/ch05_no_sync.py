"""Chapter 5, "no_sync()": the timing analysis (the α–β fit of the microbenchmarks), the savings grid and the
figures.

The book layer over :mod:`gradaccum.distributed` (the torch-only tools the chapter derives).

The processes (launcher and tasks) live in :mod:`gradaccum.book.ddp_workers`, which every spawned worker imports;
the names a chapter cell uses (``launch``, ``train_ddp``, ``WorkerFailed``, …) are imported here.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradaccum._validate import require_count, require_k, require_nonnegative, require_positive

# re-exported: the chapter calls ch5.launch, ch5.train_ddp, ...; the workers import ddp_workers alone
from gradaccum.book.ddp_workers import DATA_TASKS, DDP_VARIANTS, TASKS, WorkerFailed, free_port, launch, train_ddp  # noqa: F401
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.book.tables import Table
from gradaccum.distributed import (
    PRESETS,
    Interconnect,
    predict_step,
)


def fit_alpha_beta(sizes_bytes: list[int], seconds: list[float], p: int) -> Interconnect:
    """Least-squares fit of the ring model's latency and bandwidth to measured all-reduce times; where the best
    fit has a negative latency, the bandwidth is fitted again with latency 0. Refused (``ValueError``) where the
    times do not grow with the message size: no positive bandwidth fits them."""

    for n in sizes_bytes:
        require_positive(n, "each message size (bytes)")
    for t in seconds:
        require_positive(t, "each measured time (seconds)")
    if (
        len(set(sizes_bytes)) < 2
        or len(sizes_bytes) != len(seconds)
        or isinstance(p, bool)
        or not isinstance(p, int)
        or p < 2
    ):
        raise ValueError(
            "need one time per message size, at least two different sizes, and an int p >= 2 to fit "
            "latency and bandwidth."
        )
    volume = 2.0 * (p - 1) / p * np.array(sizes_bytes, float)
    a = np.column_stack([np.full(len(sizes_bytes), 2.0 * (p - 1)), volume])
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.array(seconds, float), rcond=None)
    if alpha < 0:  # latency 0, bandwidth refitted through the origin
        alpha, inv_beta = 0.0, float(volume @ np.array(seconds, float) / (volume @ volume))
    if not inv_beta > 0:
        raise ValueError(
            "the measured times do not grow with the message size, so no positive bandwidth fits "
            "them: time larger messages, or rerun on a quieter machine."
        )
    return Interconnect("measured", 1.0 / float(inv_beta), float(alpha), "fit")


def savings_grid(params: int, ks: list[int], ps: list[int], link: Interconnect, micro_compute: float) -> Any:
    r"""Fraction of step time saved by no_sync over K (rows) × number of GPUs p (columns).

    With A the time of one synchronization and c of one micro-batch's compute, the model gives
    :math:`\frac{(K-1)A}{K(c+A)}`: by construction it grows with K and with A (slower links, more bytes), and it
    is 0 at K = 1. Raises ValueError where a step would take no time at all (p = 1 with ``micro_compute`` = 0).
    """

    if len(ks) == 0 or len(ps) == 0:  # len: a NumPy array has no truth value
        raise ValueError(f"pass at least one K and one p, got ks={list(ks)!r} and ps={list(ps)!r}.")
    if 1 in ps and micro_compute == 0:
        raise ValueError(
            "with p = 1 and micro_compute = 0 a step takes no time, so the share saved is undefined: "
            "give micro_compute > 0 (seconds per micro-batch) or use p >= 2."
        )
    preds = [[predict_step(params, k, p, link, micro_compute) for p in ps] for k in ks]
    return np.array([[pred.saving / pred.with_sync for pred in row] for row in preds])


def format_seconds(s: float) -> str:
    """Seconds in s (from 1 s on), ms (from 1 ms on, also for negative differences, and for what rounds to 1 ms)
    or µs, three significant digits."""
    if not math.isfinite(s):
        raise ValueError(f"a time must be finite, got {s!r}.")
    if abs(float(f"{s * 1e3:.3g}")) >= 1000:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms" if abs(float(f"{s * 1e6:.3g}")) >= 1000 else f"{s * 1e6:.3g} µs"


def bytes_human(n: float) -> str:
    """Bytes in B, KB, MB or GB (powers of 1000), three significant digits; a count that rounds to 1000 of a unit
    is given in the next one."""
    if not (math.isfinite(n) and n >= 0):
        raise ValueError(f"a byte count must be finite and >= 0, got {n!r}.")
    for unit in ("B", "KB", "MB", "GB"):
        if float(f"{n:.3g}") < 1000 or unit == "GB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} GB"  # pragma: no cover


def log2_or_zero(x: float) -> float:
    return math.log2(x) if x > 0 else 0.0


@dataclass(frozen=True)
class TimingFit:
    """The α–β fit of the all-reduce microbenchmark, the copy bandwidth, and predicted vs measured savings.

    A row's measured saving is the median of the paired differences sync − no_sync (steps that ran back to back),
    which cancels load that changes more slowly than a pair; at K = 1 both modes run the same code, so that row's
    "saving" measures the noise.
    """

    link: Interconnect
    copy_bandwidth: float
    rows: list[tuple[int, int, int, float, float, float, float]]  # width, params, K, sync, no_sync, measured, predicted


def analyse_timing(result: dict[str, Any], p: int) -> TimingFit:
    """Fit the cost model to the microbenchmarks of :func:`_task_timing` and predict each saving from it. ``p`` must
    be the number of processes that measured them (the result records it): the fit's bandwidth scales with
    2(p − 1)/p."""
    require_count(p, "p (the number of processes)", minimum=2)
    measured = result.get("world_size")
    if measured is not None and measured != p:
        raise ValueError(f"these timings were measured by {measured} processes, not p = {p}: pass p={measured}.")
    sizes = sorted(result["allreduce"])
    link = fit_alpha_beta(sizes, [result["allreduce"][s] for s in sizes], p)
    slope = float(np.polyfit(sizes, [result["copy"][s] for s in sizes], 1)[0])
    copy_bw = 1.0 / slope if slope > 0 else float("inf")
    rows = []
    for (width, k, no_sync), _ in sorted(result["steps"].items()):
        if no_sync:
            continue
        params = result["params"][width]
        sync, nosync = result["steps"][width, k, False], result["steps"][width, k, True]
        pairs = result.get("pairs", {}).get((width, k))
        saved = statistics.median(a - b for a, b in pairs) if pairs else sync - nosync
        # a copy slope <= 0 (copies too fast to time): the copies count as free
        pred = predict_step(params, k, p, link, 0.0, copy_bandwidth=None if copy_bw == float("inf") else copy_bw).saving
        rows.append((width, params, k, sync, nosync, saved, pred))
    return TimingFit(link, copy_bw, rows)


def format_timing(fit: TimingFit) -> Table:
    caption = (
        f"gloo on loopback: latency α ≈ {format_seconds(fit.link.latency)}, bandwidth β ≈ "
        f"{fit.link.bandwidth / 1e9:.2f} GB/s; copy ≈ {fit.copy_bandwidth / 1e9:.1f} GB/s"
    )
    rows = [
        [
            f"{params:,}",
            k,
            format_seconds(sync),
            format_seconds(nosync),
            format_seconds(meas),
            format_seconds(pred) if k > 1 else "0",
            f"{pred / meas:.2f}" if k > 1 and meas > 0 else "",
        ]
        for _, params, k, sync, nosync, meas, pred in fit.rows
    ]
    return Table(["params", "K", "sync", "no_sync", "saved", "predicted", "ratio"], rows, caption=caption)


def plot_timing(fit: TimingFit):
    """Measured against predicted saving per optimizer step, for every model size and K > 1."""

    fig, (ax,) = figure(1, 6.0, 4.2)
    rows = [r for r in fit.rows if r[2] > 1]
    colors = [PALETTE["sky"], PALETTE["vermillion"], PALETTE["blue"], PALETTE["green"]]
    for color, params in zip(colors, sorted({r[1] for r in rows})):
        sel = [r for r in rows if r[1] == params]
        ax.plot([1e3 * r[6] for r in sel], [1e3 * r[5] for r in sel], "o", color=color, label=f"{params:,} params")
        for r in sel:
            ax.annotate(f"K={r[2]}", (1e3 * r[6], 1e3 * r[5]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    top = 1.2e3 * max(max(r[5], r[6]) for r in rows)
    line = np.array([0.1, top])
    ax.plot(line, line, color="black", linewidth=1, label="measured = predicted")
    ax.fill_between(line, 0.75 * line, 1.25 * line, color="grey", alpha=0.2, label="±25%")
    decorate(
        ax,
        "predicted saving per step (ms)",
        "measured saving per step (ms)",
        "no_sync on gloo, 2 processes",
        xscale="log",
        yscale="log",
    )
    ax.legend(frameon=False, fontsize=8)
    return fig


def plot_prediction(params_millions: float, k: int, p: int, preset: str, micro_compute_ms: float):
    """The widget's picture: predicted step time with and without no_sync, split into compute and communication."""

    if not isinstance(preset, str) or preset not in PRESETS:
        raise ValueError(f"unknown interconnect {preset!r}; choose one of {list(PRESETS)}.")
    require_positive(params_millions, "params_millions (the model's parameters, in millions)")
    require_k(k)
    require_count(p, "p (the number of GPUs)")
    require_nonnegative(micro_compute_ms, "micro_compute_ms")
    if p == 1 and micro_compute_ms == 0:
        raise ValueError(
            "with p = 1 and no compute a step takes no time, so the share saved is undefined: give "
            "micro_compute_ms > 0 or use p >= 2."
        )
    if preset.startswith("NVLink") and p > 8:
        raise ValueError(
            f"NVLink connects the GPUs of one node (up to 8 here); {p} GPUs span several nodes and "
            "talk over the network: pick p ≤ 8, or InfiniBand or Ethernet."
        )
    pred = predict_step(int(params_millions * 1e6), k, p, PRESETS[preset], micro_compute_ms / 1e3, bytes_per_param=4)
    fig, (ax,) = figure(1, 7.2, 3.2)
    names = ["all-reduce every micro-batch", "no_sync (one all-reduce)"]
    comm = [pred.with_sync - pred.compute, pred.with_no_sync - pred.compute]
    ax.barh(names, [1e3 * pred.compute] * 2, color=PALETTE["sky"], label="compute")
    ax.barh(
        names,
        [1e3 * c for c in comm],
        left=[1e3 * pred.compute] * 2,
        color=PALETTE["vermillion"],
        label="communication",
    )
    # the title on two lines (one did not fit the figure), the legend below the axes (it covered the bars)
    decorate(
        ax,
        "predicted time per optimizer step (ms)",
        "",
        f"{params_millions:g}M fp32 gradients, {p} GPUs, {preset}\n"
        f"no_sync saves {pred.saving / pred.with_sync:.0%} of the step",
        legend=False,
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    return fig


def plot_savings_grid(
    params: int, ks: list[int], ps: list[int] | dict[str, list[int]], micro_compute: float, presets: list[str]
):
    """Predicted fraction of step time saved by no_sync over K × p, one panel per interconnect; ``ps`` is one list
    of GPU counts for every panel, or a dict giving each interconnect its own (NVLink: one 8-GPU node)."""

    fig, axes = figure(len(presets), 4.8 * len(presets), 3.6)
    for ax, name in zip(axes, presets):
        cols = ps[name] if isinstance(ps, dict) else ps
        image = heatmap(
            ax,
            savings_grid(params, ks, cols, PRESETS[name], micro_compute),
            ks,
            cols,
            fmt="{:.0%}",
            vmin=0.0,
            vmax=1.0,
            xlabel="GPUs p",
            ylabel="K",
            title=name,
        )
    fig.colorbar(image, ax=axes, label="share of step time saved", shrink=0.9)
    return fig
