"""Chapter 2, "Ghost BatchNorm and full-batch statistics": the method comparisons and seed study, step costs,
PreciseBN size effects and the figures.

The book layer over :mod:`gradaccum.ghost_bn`, :mod:`gradaccum.fullbatch_bn` and :mod:`gradaccum.precise_bn` (the
torch-only tools the chapter derives). Here: what each method does to one batch (:func:`method_effects`) and the
figures; the training runs and the seed study are in :mod:`gradaccum.book.ch02_training`, the recorded study on
two networks and its claims in :mod:`gradaccum.book.ch02_study`, the step costs in
:mod:`gradaccum.book.ch02_costs`, PreciseBN's size effects in :mod:`gradaccum.book.ch02_precise_bn`, all re-exported
here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from gradaccum._validate import require_k, require_micro_batch
from gradaccum.accumulate import accumulated_gradient, agreement, full_batch_gradient
from gradaccum.bn_statistics import layer_inputs
from gradaccum.book.ch02_costs import STEP_METHODS as STEP_METHODS
from gradaccum.book.ch02_costs import StepCost as StepCost
from gradaccum.book.ch02_costs import benchmark_ratios as benchmark_ratios
from gradaccum.book.ch02_costs import benchmark_table as benchmark_table
from gradaccum.book.ch02_costs import load_benchmark as load_benchmark
from gradaccum.book.ch02_costs import precise_bn_cost as precise_bn_cost
from gradaccum.book.ch02_costs import step_costs as step_costs
from gradaccum.book.ch02_costs import step_functions as step_functions
from gradaccum.book.ch02_precise_bn import PreciseBNSizeEffect as PreciseBNSizeEffect
from gradaccum.book.ch02_precise_bn import first_layer_variance_ratio as first_layer_variance_ratio
from gradaccum.book.ch02_precise_bn import precise_bn_size_effect as precise_bn_size_effect
from gradaccum.book.ch02_study import Claim as Claim
from gradaccum.book.ch02_study import format_seed_study as format_seed_study
from gradaccum.book.ch02_study import format_side_by_side as format_side_by_side
from gradaccum.book.ch02_study import load_study as load_study
from gradaccum.book.ch02_study import run_study as run_study
from gradaccum.book.ch02_study import side_by_side as side_by_side
from gradaccum.book.ch02_study import study_claims as study_claims
from gradaccum.book.ch02_study import study_plan as study_plan
from gradaccum.book.ch02_training import ARCHS as ARCHS
from gradaccum.book.ch02_training import METHODS as METHODS
from gradaccum.book.ch02_training import SHOWN
from gradaccum.book.ch02_training import MethodRun as MethodRun
from gradaccum.book.ch02_training import ShadowRunningStats as ShadowRunningStats
from gradaccum.book.ch02_training import format_methods as format_methods
from gradaccum.book.ch02_training import format_study as format_study
from gradaccum.book.ch02_training import pre_bn_layers as pre_bn_layers
from gradaccum.book.ch02_training import seed_study as seed_study
from gradaccum.book.ch02_training import study_jobs as study_jobs
from gradaccum.book.ch02_training import study_table as study_table
from gradaccum.book.ch02_training import train_many as train_many
from gradaccum.book.ch02_training import train_method as train_method
from gradaccum.book.ch02_training import train_methods as train_methods
from gradaccum.book.models import NormKind, make_cnn
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.fullbatch_bn import full_batch_statistics, full_batch_stats_gradient, normalized_with
from gradaccum.ghost_bn import ghostify


@dataclass(frozen=True)
class MethodEffect:
    """One method's normalization-statistics error and gradient agreement on one batch of K·b images.

    ``stat_error``: RMS over normalization groups and channels of (μ_group − μ_full)/σ_full at the head's
    BatchNorm1d input (0 when the method normalizes with the full batch; NaN for per-sample norms);
    ``rel_error``/``cosine``: its gradient against the full-batch BatchNorm gradient (for GroupNorm and
    LayerNorm, against their own full-batch gradient).
    """

    method: str
    stat_error: float
    rel_error: float
    cosine: float


def _stat_error(feats: torch.Tensor, group: int) -> float:
    full_mean, full_std = feats.mean(0), feats.std(0, correction=0)
    keep = full_std > 1e-12
    means = torch.stack([c.mean(0) for c in feats.split(group)])
    return float((((means - full_mean) / torch.where(keep, full_std, 1.0))[:, keep] ** 2).mean().sqrt())


def method_effects(k: int, b: int, v: int, x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> list[MethodEffect]:
    """Compare, on the first K·b images, how each method normalizes and what gradient it produces.

    ``v`` is Ghost BatchNorm's virtual batch size for a single pass over the K·b images (v = b reproduces
    plain accumulation exactly).
    """

    require_k(k)
    require_micro_batch(b)
    n = k * b
    if n > x.shape[0]:
        raise ValueError(f"K·b = {k}·{b} = {n} exceeds the {x.shape[0]} images available; lower K or b.")
    if isinstance(v, bool) or not isinstance(v, int) or v < 2 or n % v:
        raise ValueError(f"the virtual batch size v = {v} must be >= 2 and divide K·b = {n}.")
    xb, yb = x[:n].double(), y[:n]
    loss_fn = nn.CrossEntropyLoss()
    model = make_cnn("batch", seed=seed, device=x.device).train()
    g_full = full_batch_gradient(model, loss_fn, xb, yb)
    stats = full_batch_statistics(model, list(xb.split(b)))
    with normalized_with(stats):  # every BatchNorm normalizes with the full batch: the full-batch forward
        feats = layer_inputs(model, xb, "head.1")
    rows = []
    for method, grad, group in (
        ("plain accumulation", accumulated_gradient(model, loss_fn, xb, yb, k), b),
        ("ghost BN, 1 update/step", full_batch_gradient(ghostify(model, v), loss_fn, xb, yb), v),
        ("full-batch stats", full_batch_stats_gradient(model, loss_fn, xb, yb, k, exact=False), n),
        ("exact full-batch stats", full_batch_stats_gradient(model, loss_fn, xb, yb, k), n),
    ):
        a = agreement(g_full, grad)
        rows.append(MethodEffect(method, _stat_error(feats, group), a.rel_error, a.cosine))
    others: tuple[tuple[NormKind, str], ...] = (("group", "GroupNorm"), ("layer", "LayerNorm"))
    for norm, label in others:
        other = make_cnn(norm, seed=seed, device=x.device).train()
        a = agreement(full_batch_gradient(other, loss_fn, xb, yb), accumulated_gradient(other, loss_fn, xb, yb, k))
        rows.append(MethodEffect(label, float("nan"), a.rel_error, a.cosine))
    return rows


def plot_methods(runs: Sequence[MethodRun]):
    """Validation accuracy of every method, with its running statistics and after PreciseBN: one panel per network
    (``runs`` holds one run per network and method)."""

    archs = [a for a in ARCHS if any(r.arch == a for r in runs)]
    fig, axes = plt.subplots(len(archs), 1, figsize=(9.6, 2.6 + 2.2 * len(archs)), sharex=True, layout="constrained")
    axes = np.atleast_1d(axes)
    no_bn = ("GroupNorm", "LayerNorm")
    for ax, arch in zip(axes, archs):
        mine = sorted((r for r in runs if r.arch == arch), key=lambda r: METHODS.index(r.method))
        pos = np.arange(len(mine))
        ax.bar(pos - 0.2, [100 * r.val_acc for r in mine], 0.4, color=PALETTE["sky"], label="running statistics")
        precise = [100 * r.val_acc_precise for r in mine]
        ax.bar(
            pos + 0.2, precise, 0.4, color=PALETTE["vermillion"], hatch="//", edgecolor="white", label="after PreciseBN"
        )
        title = f"{ARCHS[arch]}: seed {mine[0].seed}, {mine[0].schedule} LR, {mine[0].steps} optimizer steps"
        decorate(ax, "", "validation accuracy (%)", title)
        ax.set_ylim(0, 118)
        ax.set_yticks(range(0, 101, 20))
        ax.legend(loc="upper center", ncol=2, frameon=False)
    # how many samples each BatchNorm normalizes over; GroupNorm and LayerNorm have no batch statistics
    ticks = [
        f"{SHOWN.get(r.method, r.method)}\n(K={r.k}, "
        + ("no BatchNorm)" if r.method in no_bn else f"BN over {r.b} samples)")
        for r in mine
    ]
    axes[-1].set_xticks(pos, ticks, rotation=25, ha="right", fontsize=8)
    return fig


def plot_study(runs: Sequence[MethodRun]):
    """Each claim's runs, seed by seed, one panel per network and schedule: PreciseBN and momentum correction
    against plain accumulation at K (before PreciseBN, and the correction after it), and plain accumulation at the
    small K against the full batch after PreciseBN."""

    table = study_table(runs)
    archs = [a for a in ARCHS if any(key[0] == a for key in table)]
    schedules = list(dict.fromkeys(key[3] for key in table))
    seeds = sorted({key[4] for key in table if key[1] == "momentum-corrected"})
    k = max(key[2] for key in table if key[1] == "momentum-corrected")
    k_small = min(key[2] for key in table if key[1] == "plain accumulation")
    fig, grid = plt.subplots(len(archs), len(schedules), figsize=(9.6, 3.2 * len(archs)), sharey=True, squeeze=False)
    fig.set_layout_engine("constrained")
    labels = [
        "PreciseBN gain\n(plain)",
        "momentum corr.\nvs plain",
        "momentum corr.\nvs plain,\nafter PreciseBN",
        f"b={64 // k_small} vs full,\nafter PreciseBN",
    ]
    colors = [PALETTE[c] for c in ("vermillion", "blue", "sky", "green")]
    for row, arch in zip(grid, archs):
        for ax, schedule in zip(row, schedules):
            for i, seed in enumerate(seeds):
                plain, mom = (table[arch, m, k, schedule, seed] for m in ("plain accumulation", "momentum-corrected"))
                small, full = (
                    table[arch, "plain accumulation", k_small, schedule, seed],
                    table[arch, "full batch", 1, schedule, seed],
                )
                diffs = [
                    plain.val_acc_precise - plain.val_acc,
                    mom.val_acc - plain.val_acc,
                    mom.val_acc_precise - plain.val_acc_precise,
                    small.val_acc_precise - full.val_acc_precise,
                ]
                offset = (i - (len(seeds) - 1) / 2) * 0.12
                for x, (diff, color) in enumerate(zip(diffs, colors)):
                    ax.scatter(x + offset, 100 * diff, color=color, s=28)
            ax.axhline(0, color="0.4", lw=0.8)
            ax.set_xticks(range(len(labels)), labels, fontsize=7)
            decorate(ax, "", "difference (points)", f"{ARCHS[arch]}, {schedule} LR (K={k})", legend=False)
    return fig


def method_cosine_grid(ks: Sequence[int], bs: Sequence[int], x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    """Gradient cosine to the full batch over a grid of K (rows) and b (columns), per method (v = b)."""

    grids: dict[str, list[list[float]]] = {}
    for k in ks:
        rows: dict[str, list[float]] = {}
        for b in bs:
            for e in method_effects(k, b, b, x, y):
                rows.setdefault(e.method, []).append(e.cosine)
        for method, values in rows.items():
            grids.setdefault(method, []).append(values)
    return {m: np.array(v) for m, v in grids.items()}


def plot_method_cosine_grid(
    grids: dict[str, np.ndarray],
    ks: Sequence[int],
    bs: Sequence[int],
    methods: Sequence[str] = ("plain accumulation", "full-batch stats", "exact full-batch stats"),
):
    """Heat maps of the gradient cosine to the full-batch gradient, one panel per method."""

    fig, axes = figure(len(methods), 3.6 * len(methods), 3.6)
    for ax, method in zip(axes, methods):
        image = heatmap(
            ax,
            grids[method],
            ks,
            bs,
            vmin=0.0,
            vmax=1.0,
            aspect="equal",
            xlabel="micro-batch size b",
            ylabel="K",
            title=SHOWN.get(method, method),
        )
    fig.colorbar(image, ax=axes, label="cosine to the full-batch gradient", shrink=0.9)
    return fig


def plot_method_effects(k: int, b: int, v: int, x: torch.Tensor, y: torch.Tensor):
    """The widget's picture: statistics error and gradient cosine of each method for one (K, b, v)."""

    rows = method_effects(k, b, v, x, y)
    names = [SHOWN.get(r.method, r.method).replace(", 1 update/step", f" (v={v})") for r in rows]
    fig, (ax1, ax2) = figure(2, 9.6, 3.6)
    ax1.barh(names, [0 if np.isnan(r.stat_error) else r.stat_error for r in rows], color=PALETTE["vermillion"])
    for i, r in enumerate(rows):
        if np.isnan(r.stat_error):
            ax1.text(0.01, i, "per-sample statistics: n/a", va="center", fontsize=8)
        elif r.stat_error == 0:
            ax1.text(0.01, i, "0: full-batch statistics", va="center", fontsize=8)
    decorate(ax1, "RMS (μ_group − μ_full) / σ", "", f"Statistics error (K = {k}, b = {b})")
    ax2.barh(names, [r.cosine for r in rows], color=PALETTE["blue"])
    ax2.set_xlim(-0.05, 1.05)
    ax2.set_yticks(range(len(names)), [""] * len(names))
    decorate(ax2, "cosine to the full-batch gradient", "", "Gradient agreement")
    return fig
