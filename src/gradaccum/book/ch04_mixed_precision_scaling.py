"""Chapter 4, "Loss scaling meets accumulation": the loss-scale grid, the figures, and FSDP2's accumulation on two
processes (:mod:`gradaccum.book.ch04_fsdp`).

The book layer over :mod:`gradaccum.precision` (the torch-only tools the chapter derives).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from gradaccum._validate import require_k
from gradaccum.accumulate import agreement
from gradaccum.book.ch04_fsdp import Fsdp2Rank, ScalerRun
from gradaccum.book.data import DigitsSplit
from gradaccum.book.models import make_cnn
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.book.tables import Table
from gradaccum.precision import (
    activation_gradients,
    amp_window,
    cast_report,
    format_info,
    kernel_gradients,
    largest_fitting_log2,
    largest_safe_log2_scale,
    reference_gradient,
)


def loss_grid(
    values: torch.Tensor, log2_scales: Sequence[int], ks: Sequence[int], dtype: torch.dtype = torch.float16
) -> dict[str, np.ndarray]:
    """Fractions below the normal range (underflow + subnormal; the key "lost") and overflowed over S = 2^s (rows)
    × K (columns), for gradients computed with K = 1 (with K micro-batches of the same size, every gradient is
    divided by K). Subnormals are kept, with fewer significant bits."""
    lost = np.zeros((len(log2_scales), len(ks)))
    over = np.zeros_like(lost)
    for i, s in enumerate(log2_scales):
        for j, k in enumerate(ks):
            r = cast_report(values / require_k(k), dtype, 2.0**s)
            lost[i, j], over[i, j] = r.underflow + r.subnormal, r.overflow
    return {"lost": lost, "overflow": over}


def recipe_errors(
    split: DigitsSplit, loss_fn, seeds: Sequence[int], starts: Sequence[int], k: int = 4, batch: int = 64
) -> dict[tuple[int, int], tuple[float, float, float]]:
    """For each seed (of the GroupNorm CNN) and each batch ``split.x_train[start:start + batch]``: the relative
    error against the fp32 full-batch gradient of (the fp16 recipe with K micro-batches, one fp16 window of the
    whole batch (K = 1), the same K micro-batches without a scaler)."""
    out = {}
    for seed in seeds:
        model = make_cnn("group", seed=seed, dtype=torch.float32, device=split.x_train.device)
        for start in starts:
            if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(split.x_train) - batch:
                raise ValueError(
                    f"start {start!r} leaves no full batch of {batch} among the "
                    f"{len(split.x_train)} training images; use 0 to {len(split.x_train) - batch}."
                )
            x, y = split.x_train[start : start + batch].float(), split.y_train[start : start + batch]
            ref = reference_gradient(model, loss_fn, x, y)
            runs = (
                amp_window(model, loss_fn, x, y, k=k),
                amp_window(model, loss_fn, x, y, k=1),
                amp_window(model, loss_fn, x, y, k=k, pattern="no_scaler"),
            )
            errors = tuple(agreement(ref, r.update).rel_error for r in runs)
            out[seed, start] = (errors[0], errors[1], errors[2])
    return out


def edge_prediction_gaps(
    split: DigitsSplit,
    norm: Literal["batch", "group", "layer", "none"],
    seeds: Sequence[int],
    starts: Sequence[int] = (0, 64, 128),
    k: int = 4,
) -> list[int]:
    """On the CPU, for each seed (a fresh float32 digits CNN with ``norm``) and each batch of 64 training images
    from ``starts``: the predicted fp16 edge of S/K (the larger of the kernels' parameter gradients and the
    layer-output gradients, :func:`gradaccum.precision.largest_fitting_log2`) minus the measured one
    (:func:`gradaccum.precision.largest_safe_log2_scale` − log2 K, the loss divided by K). 0 where the prediction
    is exact; 1 where a partial sum overflows before the whole does (an fp16 convolution on the CPU sums its
    weight gradient in fp16)."""
    require_k(k)
    if k & (k - 1):
        raise ValueError(f"K = {k}: the edges move by log2 K only for a power of two; pass one.")
    loss_fn = torch.nn.CrossEntropyLoss()
    gaps = []
    for seed in seeds:
        for start in starts:
            x, y = split.x_train[start : start + 64].float().cpu(), split.y_train[start : start + 64].cpu()
            model = make_cnn(norm, seed=seed, dtype=torch.float32, device=x.device)
            measured = largest_safe_log2_scale(model, loss_fn, x, y, k) - int(math.log2(k))
            w = largest_fitting_log2(kernel_gradients(model, loss_fn, x, y, k))
            a = largest_fitting_log2(
                torch.cat([activation_gradients(model, loss_fn, xb, yb) for xb, yb in zip(x.chunk(k), y.chunk(k))])
            )
            gaps.append(min(w, a) - measured)
    return gaps


def plot_formats(values_by_k: dict[int, torch.Tensor]):
    """Left: the normal and subnormal ranges of fp16, bf16 and fp32 on a log2 axis. Right: histograms of
    log2|layer-output gradient| for several K (micro-batch size fixed) against fp16's range."""

    fig, (ax1, ax2) = figure(2, 11.0, 3.6)
    for i, dtype in enumerate((torch.float16, torch.bfloat16, torch.float32)):
        f = format_info(dtype)
        lo, mid, hi = math.log2(f.smallest_subnormal), math.log2(f.smallest_normal), math.log2(f.max)
        ax1.barh(i, mid - lo, left=lo, color=PALETTE["orange"], label="subnormal" if i == 0 else None)
        ax1.barh(i, hi - mid, left=mid, color=PALETTE["blue"], label="normal" if i == 0 else None)
    ax1.set_yticks(range(3), ["float16", "bfloat16", "float32"])
    decorate(ax1, "log2 |x|", "", "Representable magnitudes")
    colors = [PALETTE["sky"], PALETTE["vermillion"], PALETTE["purple"], PALETTE["green"]]
    f16 = format_info(torch.float16)
    bins = np.arange(-34, 8, 0.5)
    for color, (k, v) in zip(colors, values_by_k.items()):
        logs = v[v != 0].abs().double().log2().cpu().numpy()
        ax2.hist(
            logs,
            bins=bins,  # type: ignore[arg-type]  # stub wants a Sequence; hist takes any array
            histtype="step",
            color=color,
            linewidth=1.5,
            density=True,
            label=f"K = {k}",
        )
    ax2.axvspan(bins[0], math.log2(f16.smallest_subnormal), color="grey", alpha=0.3, label="fp16: zero")
    ax2.axvspan(
        math.log2(f16.smallest_subnormal),
        math.log2(f16.smallest_normal),
        color=PALETTE["orange"],
        alpha=0.2,
        label="fp16: subnormal",
    )
    decorate(ax2, "log2 |layer-output gradient| (loss / K, no scale)", "density", "Real gradients vs fp16")
    ax2.legend(frameon=False, fontsize=9)
    return fig


def plot_loss_grid(grid: dict[str, np.ndarray], log2_scales: Sequence[int], ks: Sequence[int]):
    """Heat maps of the fraction below the normal range (zero or subnormal, with fewer significant bits) and
    overflowed over S and K."""

    fig, axes = figure(2, 9.6, 3.8)
    for ax, (key, title) in zip(axes, (("lost", "below normal (zero or subnormal)"), ("overflow", "overflowed"))):
        image = heatmap(
            ax,
            grid[key],
            [f"2^{s}" for s in log2_scales],
            ks,
            fmt="{:.3f}",
            vmin=0.0,
            vmax=1.0,
            xlabel="K (micro-batch size fixed)",
            ylabel="loss scale S",
            title=f"fp16: fraction {title}",
        )
    fig.colorbar(image, ax=axes, shrink=0.9, label="fraction of the gradients")
    return fig


def plot_cast(values: torch.Tensor, log2_scale: float, k: int, shift: float = 0.0):
    """The widget's picture: log2 of the gradients the backward pass holds, S/K · 2^shift · g, against fp16."""

    require_k(k)
    if not -40 <= log2_scale <= 40:
        raise ValueError(f"log2 of the loss scale must lie in [-40, 40], got {log2_scale}.")
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not -40 <= shift <= 40:
        raise ValueError(f"shift (log2 of the factor on the gradients) must lie in [-40, 40], got {shift!r}.")
    scale = 2.0**log2_scale / k
    shifted = values * 2.0**shift
    report = cast_report(shifted, torch.float16, scale)
    f16 = format_info(torch.float16)
    logs = (shifted[shifted != 0].abs().double() * scale).log2().cpu().numpy()
    fig, (ax,) = figure(1, 7.2, 3.4)
    ax.hist(
        logs,
        bins=np.arange(-45, 40, 0.5),  # type: ignore[arg-type]  # an array works
        histtype="stepfilled",
        color=PALETTE["blue"],
        density=True,
    )
    ax.axvspan(-45, math.log2(f16.smallest_subnormal), color="grey", alpha=0.3, label="→ 0")
    ax.axvspan(
        math.log2(f16.smallest_subnormal),
        math.log2(f16.smallest_normal),
        color=PALETTE["orange"],
        alpha=0.3,
        label="subnormal",
    )
    ax.axvspan(math.log2(f16.max), 40, color=PALETTE["vermillion"], alpha=0.3, label="→ inf")
    decorate(
        ax,
        "log2 |S/K · g| in the backward pass",
        "density",
        f"S/K = 2^{log2_scale:g}/{k}: underflow {report.underflow:.1%}, subnormal {report.subnormal:.1%}, "
        f"overflow {report.overflow:.1%}",
    )
    ax.legend(frameon=False, fontsize=8)
    return fig


def plot_accumulation_error(ks: Sequence[int], errors: dict[str, Sequence[float]]):

    fig, (ax,) = figure()
    for (name, errs), color, marker in zip(errors.items(), (PALETTE["vermillion"], PALETTE["blue"]), ("o", "s")):
        ax.plot(ks, [max(e, 1e-16) for e in errs], marker=marker, color=color, label=f"{name} accumulator")
    # a log axis cannot show 0: an exact sum (K = 1, or fp32 here) is drawn at 1e-16, and says so
    ax.axhline(1e-16, color="grey", linewidth=0.6, linestyle=":")
    ax.annotate(
        "exactly 0 is drawn here", (ks[0], 1e-16), xytext=(0, 4), textcoords="offset points", fontsize=7, color="grey"
    )
    decorate(
        ax,
        "micro-batches K",
        "relative error of the sum",
        "Summing bf16 micro-gradients",
        xscale="log",
        yscale="log",
        xticks=ks,
    )
    return fig


def rounded_error(error: float) -> str:
    """A relative error as the chapter prints it: one significant digit below 1% (there the CPU's own fp16 or bf16
    kernels move the second digit: another summation order rounds differently), two decimals from 1% up (the size
    of a mistake, which no kernel moves)."""
    return f"{error:.0e}" if error < 0.01 else f"{error:.2f}"


# ------------------------------------------------------------------------------------------- FSDP2 (fine print)


def fsdp2_ranks(k: int = 16, timeout: float = 120.0) -> list[Fsdp2Rank]:
    """:func:`gradaccum.book.ch04_fsdp.fsdp2_task` on two gloo processes; both ranks' results, after checking that
    they agree on everything but the one-rank overflow's shard (that one differs by design)."""
    from gradaccum.book.ddp_workers import launch

    ranks: list[Fsdp2Rank] = launch("fsdp2", 2, timeout=timeout, k=k)
    a, b = ranks
    if (a.held, a.errors, a.headroom) != (b.held, b.errors, b.headroom):
        raise RuntimeError(f"the two ranks disagree: {a} vs {b}")
    return ranks


def fsdp2_table(rank: Fsdp2Rank) -> Table:
    """Where FSDP2 keeps the window's gradient between micro-batches, for each gradient sync and mixed-precision
    policy (one rank's view)."""
    rows = [
        [sync, name, held.holder, held.dtype, f"{held.bytes:,}", f"{held.bytes / held.shard_bytes:g}×"]
        for (sync, name), held in rank.held.items()
    ]
    return Table(
        ["gradient sync", "MixedPrecisionPolicy", "held between micro-batches", "dtype", "bytes", "÷ fp32 shard"],
        rows,
    )


def fsdp2_lines(ranks: Sequence[Fsdp2Rank]) -> list[str]:
    """What the two ranks measured beyond the table: the bf16 sum's error, the fp16 sum's overflow, and the grad
    scaler after an overflow in one rank's shard."""
    errors, headroom = ranks[0].errors, ranks[0].headroom

    def outcome(run: ScalerRun) -> str:
        return f"{'stepped' if run.stepped else 'step skipped'}, S = 2^{math.log2(run.scale_after):.0f}"

    one = [r.one_rank_overflow for r in ranks]
    return [
        f"bf16 parameters, K = {ranks[0].k}, against the window reduced every micro-batch: summed in fp32 "
        f"(reduce_dtype=fp32) {rounded_error(errors['param_dtype=bf16, reduce_dtype=fp32'])} off, in bf16 "
        f"(reduce_dtype unset) {rounded_error(errors['param_dtype=bf16, reduce_dtype unset'])} off",
        f"fp16, 20480 in each of K = 4 backward passes: reduce_dtype=fp32 → {outcome(headroom['fp32'])}; "
        f"reduce_dtype unset → the fp16 sum {'fits' if headroom['unset'].shard_finite else 'overflows'}, "
        f"{outcome(headroom['unset'])}",
        "an overflow in rank 1's shard only: shard finite on rank 0, 1: "
        + ", ".join(str(r.shard_finite) for r in one if r)
        + "; each rank's GradScaler: "
        + "; ".join(f"inf found, {outcome(r)}" if r.found_inf else outcome(r) for r in one if r),
    ]
