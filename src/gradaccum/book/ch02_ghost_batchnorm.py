"""Chapter 2, "Ghost BatchNorm and full-batch statistics": the method comparisons and seed study, step costs,
PreciseBN size effects and the figures.

The book layer over :mod:`gradaccum.ghost_bn`, :mod:`gradaccum.fullbatch_bn` and :mod:`gradaccum.precise_bn` (the
torch-only tools the chapter derives).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._validate import require_k, require_micro_batch
from gradaccum.accumulate import accumulated_gradient, accuracy, agreement, full_batch_gradient, train
from gradaccum.bn_statistics import corrected_momentum, layer_inputs, set_bn_momentum
from gradaccum.book.ch02_costs import STEP_METHODS as STEP_METHODS
from gradaccum.book.ch02_costs import StepCost as StepCost
from gradaccum.book.ch02_costs import benchmark_ratios as benchmark_ratios
from gradaccum.book.ch02_costs import benchmark_table as benchmark_table
from gradaccum.book.ch02_costs import load_benchmark as load_benchmark
from gradaccum.book.ch02_costs import precise_bn_cost as precise_bn_cost
from gradaccum.book.ch02_costs import step_costs as step_costs
from gradaccum.book.ch02_costs import step_functions as step_functions
from gradaccum.book.ch02_precise_bn import PreciseBNSizeEffect as PreciseBNSizeEffect
from gradaccum.book.ch02_precise_bn import _running_stats
from gradaccum.book.ch02_precise_bn import first_layer_variance_ratio as first_layer_variance_ratio
from gradaccum.book.ch02_precise_bn import precise_bn_size_effect as precise_bn_size_effect
from gradaccum.book.data import DigitsSplit
from gradaccum.book.models import NormKind, make_cnn
from gradaccum.book.parallel import run_jobs
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.book.tables import Table
from gradaccum.fullbatch_bn import (
    full_batch_statistics,
    full_batch_stats_as_constants_backward,
    full_batch_stats_backward,
    full_batch_stats_gradient,
    normalized_with,
)
from gradaccum.ghost_bn import ghostify
from gradaccum.precise_bn import precise_bn

#: The methods chapter 2 compares, in the order of its table. "ghost BN, 1 update/step" is this book's
#: one-pass GhostBatchNorm, which updates the running statistics once per step; Hoffer et al.'s reference code
#: runs backward per chunk and updates them once per chunk, which *is* the "plain accumulation" row.
METHODS: tuple[str, ...] = (
    "full batch",
    "plain accumulation",
    "ghost BN, 1 update/step",
    "full-batch stats",
    "exact full-batch stats",
    "momentum-corrected",
    "GroupNorm",
    "LayerNorm",
)


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


@dataclass(frozen=True)
class MethodRun:
    """One training run of the side-by-side experiment.

    ``k``: forward/backward passes per optimizer step (1 for the full batch and the one-pass Ghost BatchNorm);
    ``b``: how many samples each BatchNorm statistic was computed from in training (the micro-batch, the ghost
    batch, or the whole batch of 64 for the full batch and both full-batch-statistics schemes).
    ``val_acc``: eval-mode validation accuracy with the running statistics training left behind;
    ``val_acc_precise``: the same model after PreciseBN (:func:`precise_bn` over the training set in batches
    of the size the method normalized with; NaN for GroupNorm/LayerNorm, which keep no statistics);
    ``weight_growth``: for each layer whose output feeds a BatchNorm, ‖W_end‖/‖W_start‖ (empty without
    BatchNorm) — the drift Ioffe and Szegedy predicted for gradients that ignore the statistics.
    """

    method: str
    k: int
    b: int
    seed: int
    schedule: str
    val_acc: float
    val_acc_precise: float
    weight_growth: tuple[float, ...]
    steps: int


def pre_bn_layers(model: nn.Module) -> list[str]:
    """Names of the layers whose output is the input of a BatchNorm layer (the module just before a
    ``_BatchNorm`` in an ``nn.Sequential``)."""
    names = []
    for parent, module in model.named_modules():
        if isinstance(module, nn.Sequential):
            children = list(module.named_children())
            for (name, before), (_, after) in zip(children, children[1:]):
                if isinstance(after, _BatchNorm) and getattr(before, "weight", None) is not None:
                    names.append(f"{parent}.{name}" if parent else name)
    return names


def _normalization_size(method: str, k: int, batch_size: int) -> int:
    """The number of samples each BatchNorm statistic was computed from while ``method`` trained."""
    return batch_size if method in ("full batch", "full-batch stats", "exact full-batch stats") else batch_size // k


class ShadowRunningStats:
    r"""The running statistics every BatchNorm layer of ``model`` *would* keep with another ``momentum``,
    tracked beside the real ones during training.

    A training-mode forward normalizes with the batch statistics and never reads the running ones, so the
    momentum changes nothing in training — not the gradients, not the weights — only the running statistics.
    One run can therefore serve two momenta: a forward pre-hook applies BatchNorm's own update,
    :math:`\bar\mu \leftarrow (1-m)\bar\mu + m\,\hat\mu_B` and the same for the unbiased variance, with the
    other momentum.
    """

    def __init__(self, model: nn.Module, momentum: float):
        self.momentum = momentum
        self.stats = {
            name: tuple(t.clone() for t in _running_stats(layer))
            for name, layer in model.named_modules()
            if isinstance(layer, _BatchNorm)
        }
        self._hooks = [
            layer.register_forward_pre_hook(functools.partial(self._update, name))
            for name, layer in model.named_modules()
            if isinstance(layer, _BatchNorm)
        ]

    def _update(self, name: str, layer: _BatchNorm, inputs: tuple[torch.Tensor, ...]) -> None:
        if not layer.training:
            return
        x = inputs[0].detach()
        dims = [0, *range(2, x.dim())]
        mean, var = self.stats[name]
        mean.mul_(1 - self.momentum).add_(x.mean(dims), alpha=self.momentum)
        var.mul_(1 - self.momentum).add_(x.var(dims, correction=1), alpha=self.momentum)

    def apply_to(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` (hooks removed from the original) with the shadow running statistics."""
        for h in self._hooks:
            h.remove()
        twin = copy.deepcopy(model)
        for name, (mean, var) in self.stats.items():
            running_mean, running_var = _running_stats(twin.get_submodule(name))
            running_mean.copy_(mean)
            running_var.copy_(var)
        return twin


def train_method(
    split: DigitsSplit,
    method: str,
    k: int,
    batch_size: int = 64,
    epochs: int = 8,
    seed: int = 0,
    schedule: str = "constant",
    shadow: list[MethodRun] | None = None,
) -> tuple[MethodRun, nn.Module]:
    """Train a fresh SmallCNN with one method on 64-image batches (K micro-batches of b = 64/K): SGD with
    momentum 0.9, learning rate 0.05 (``schedule`` "constant" or "cosine"), cross-entropy, float64.

    "full batch" and "ghost BN, 1 update/step" take one forward/backward per batch (K = 1); every other method
    accumulates K micro-batches. Returns the run and the trained model (in eval mode).

    With ``shadow`` (a list, for "plain accumulation" only), the momentum-corrected run is read off the same
    training run with :class:`ShadowRunningStats` and appended to it: it has the same weights, so only its
    running statistics differ.
    """

    require_k(k)
    if batch_size % k or batch_size // k < 2:
        raise ValueError(f"K = {k} must divide the batch size {batch_size} into micro-batches of at least 2.")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}.")
    b = batch_size // k
    norms: dict[str, NormKind] = {"GroupNorm": "group", "LayerNorm": "layer"}
    norm = norms.get(method, "batch")
    model: nn.Module = make_cnn(norm, seed=seed, device=split.x_train.device)
    steps_k, backward_fn = k, None
    if method == "full batch":
        steps_k = 1
    elif method == "ghost BN, 1 update/step":
        model, steps_k = ghostify(model, b), 1
    elif method == "full-batch stats":
        backward_fn = full_batch_stats_as_constants_backward
    elif method == "exact full-batch stats":  # with its cache: the same gradient, a third of the time
        backward_fn = functools.partial(full_batch_stats_backward, cache=True)
    elif method == "momentum-corrected":
        set_bn_momentum(model, corrected_momentum(0.1, k))
    if shadow is not None and method != "plain accumulation":
        raise ValueError("shadow running statistics are read off a plain-accumulation run only.")
    tracker = ShadowRunningStats(model, corrected_momentum(0.1, k)) if shadow is not None else None
    watched = {
        name: m.weight.detach().norm().item() for name, m in model.named_modules() if name in pre_bn_layers(model)
    }
    result = train(
        model,
        split.x_train,
        split.y_train,
        split.x_val,
        split.y_val,
        batch_size=batch_size,
        k=steps_k,
        epochs=epochs,
        seed=seed,
        backward_fn=backward_fn,
        schedule=schedule,
    )
    growth = tuple(
        cast(torch.Tensor, model.get_submodule(name).weight).detach().norm().item() / start
        for name, start in watched.items()
    )
    precise = float("nan")
    if norm == "batch":
        recomputed = copy.deepcopy(model)
        precise_bn(recomputed, split.x_train, _normalization_size(method, k, batch_size))  # the size it trained with
        precise = accuracy(recomputed.eval(), split.x_val, split.y_val)
    group = _normalization_size(method, k, batch_size)
    run = MethodRun(method, steps_k, group, seed, schedule, result.val_acc, precise, growth, result.optimizer_steps)
    if tracker is not None and shadow is not None:
        twin = tracker.apply_to(model).eval()
        shadow.append(
            MethodRun(
                "momentum-corrected",
                steps_k,
                group,
                seed,
                schedule,
                accuracy(twin, split.x_val, split.y_val),
                precise,
                growth,
                result.optimizer_steps,
            )
        )
    return run, model.eval()


def train_methods(
    split: DigitsSplit,
    k: int,
    batch_size: int = 64,
    epochs: int = 8,
    seed: int = 0,
    methods: Sequence[str] = METHODS,
    schedule: str = "constant",
) -> list[MethodRun]:
    """:func:`train_method` for each of ``methods`` (in the order of :data:`METHODS`), on the same batches.

    When both "plain accumulation" and "momentum-corrected" are asked for, one training run serves both
    (:class:`ShadowRunningStats`; a test checks it against a separate momentum-corrected run).
    """
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}.")
    runs: dict[str, MethodRun] = {}
    for m in METHODS:
        if m not in methods or m in runs:
            continue
        if m == "plain accumulation" and "momentum-corrected" in methods:  # one run, two momenta
            shadow: list[MethodRun] = []
            runs[m] = train_method(split, m, k, batch_size, epochs, seed, schedule, shadow=shadow)[0]
            runs["momentum-corrected"] = shadow[0]
        else:
            runs[m] = train_method(split, m, k, batch_size, epochs, seed, schedule)[0]
    return [runs[m] for m in METHODS if m in methods]


def train_many(split: DigitsSplit, jobs: Sequence[dict], workers: int = 1) -> list[list[MethodRun]]:
    """:func:`train_methods` ``(split, **job)`` for every job, in order; with ``workers > 1`` in that many
    spawned processes (:func:`gradaccum.book.parallel.run_jobs`): every run seeds itself, so the results are the
    ones the jobs give one after the other (a test checks it), in about ``1/workers`` of the time on as many
    cores."""
    return run_jobs(train_methods, [dict(split=split, **job) for job in jobs], workers)


def study_jobs(
    seeds: Sequence[int] = (0, 1, 2),
    schedules: Sequence[str] = ("constant", "cosine"),
    k: int = 16,
    k_small: int = 4,
    batch_size: int = 64,
    epochs: int = 8,
) -> list[dict]:
    """The :func:`train_methods` jobs of :func:`seed_study`."""
    jobs = []
    for schedule in schedules:
        for seed in seeds:
            common = dict(batch_size=batch_size, epochs=epochs, seed=seed, schedule=schedule)
            jobs.append(dict(k=k, methods=("full batch", "plain accumulation", "momentum-corrected"), **common))
            jobs.append(dict(k=k_small, methods=("plain accumulation",), **common))
    return jobs


def seed_study(
    split: DigitsSplit,
    seeds: Sequence[int] = (0, 1, 2),
    schedules: Sequence[str] = ("constant", "cosine"),
    k: int = 16,
    k_small: int = 4,
    batch_size: int = 64,
    epochs: int = 8,
    workers: int = 1,
) -> list[MethodRun]:
    """The runs behind chapter 2's comparative claims, for every seed and learning-rate schedule: the full
    batch, plain accumulation at ``k_small`` and at ``k``, and momentum-corrected accumulation at ``k``
    (each with its PreciseBN accuracy); ``workers`` as in :func:`train_many`."""
    parts = train_many(split, study_jobs(seeds, schedules, k, k_small, batch_size, epochs), workers)
    return [run for part in parts for run in part]


def study_table(runs: Sequence[MethodRun]) -> dict[tuple[str, int, str, int], MethodRun]:
    """Index runs by (method, K, schedule, seed); refuses duplicates."""
    table: dict[tuple[str, int, str, int], MethodRun] = {}
    for r in runs:
        key = (r.method, r.k, r.schedule, r.seed)
        if key in table:
            raise ValueError(f"two runs for {key}; pass each run once.")
        table[key] = r
    return table


def format_study(runs: Sequence[MethodRun]) -> Table:
    """Validation accuracy per seed and schedule: each column as "running stats → after PreciseBN"."""
    table = study_table(runs)
    columns = list(dict.fromkeys((m, k) for m, k, _, _ in table))
    heads = {("full batch", 1): "full batch"}
    names = [
        heads.get(c, c[0].replace("accumulation", "accum.").replace("momentum-", "mom.-") + f" K={c[1]}")
        for c in columns
    ]
    rows = [
        [schedule, seed]
        + [
            f"{100 * table[m, k, schedule, seed].val_acc:.1f} → "
            f"{100 * table[m, k, schedule, seed].val_acc_precise:.1f}%"
            for m, k in columns
        ]
        for schedule in dict.fromkeys(s for _, _, s, _ in table)
        for seed in dict.fromkeys(s for _, _, _, s in table)
    ]
    return Table(["schedule", "seed", *names], rows)


def format_methods(runs: list[MethodRun]) -> Table:
    """The side-by-side table: validation accuracy per method with its running statistics and after
    PreciseBN, and the growth of the weights that feed BatchNorm layers."""
    rows = []
    for r in runs:
        precise = "—" if r.val_acc_precise != r.val_acc_precise else f"{100 * r.val_acc_precise:.1f}%"
        growth = "—" if not r.weight_growth else f"{min(r.weight_growth):.1f}–{max(r.weight_growth):.1f}×"
        group = f"{r.b}" if r.weight_growth else "—"  # GroupNorm/LayerNorm: per-sample statistics
        rows.append([r.method, r.k, group, f"{100 * r.val_acc:.1f}%", precise, growth])
    return Table(["method", "K", "BN n", "val acc", "after PreciseBN", "pre-BN weight growth"], rows)


def plot_methods(runs: list[MethodRun]):
    """Validation accuracy of every method, with its running statistics and after PreciseBN."""

    fig, (ax,) = figure(1, 9.6, 3.8)
    pos = np.arange(len(runs))
    ax.bar(pos - 0.2, [100 * r.val_acc for r in runs], 0.4, color=PALETTE["sky"], label="running statistics")
    ax.bar(
        pos + 0.2,
        [100 * r.val_acc_precise for r in runs],
        0.4,
        color=PALETTE["vermillion"],
        hatch="//",
        edgecolor="white",
        label="after PreciseBN",
    )
    # n: the samples a BatchNorm normalizes over; GroupNorm and LayerNorm have none
    no_bn = ("GroupNorm", "LayerNorm")
    ticks = [f"{r.method}\n(K={r.k}, " + ("no BatchNorm)" if r.method in no_bn else f"BN over n={r.b})") for r in runs]
    ax.set_xticks(pos, ticks, rotation=25, ha="right", fontsize=8)
    title = f"Digits, seed {runs[0].seed}, {runs[0].schedule} LR, {runs[0].steps} optimizer steps"
    decorate(ax, "", "validation accuracy (%)", title)
    ax.set_ylim(0, 118)
    ax.set_yticks(range(0, 101, 20))
    ax.legend(loc="upper center", ncol=2, frameon=False)
    return fig


def plot_study(runs: Sequence[MethodRun]):
    """Each claim's runs, seed by seed: PreciseBN and momentum correction against plain accumulation at K,
    and plain accumulation at the small K against the full batch, for each schedule."""

    table = study_table(runs)
    schedules = list(dict.fromkeys(s for _, _, s, _ in table))
    seeds = sorted({s for _, _, _, s in table})
    k = max(kk for m, kk, _, _ in table if m == "momentum-corrected")
    k_small = min(kk for m, kk, _, _ in table if m == "plain accumulation")
    fig, axes = figure(len(schedules), 4.8 * len(schedules), 3.6)
    for ax, schedule in zip(axes, schedules):
        b_small = table["plain accumulation", k_small, schedule, seeds[0]].b
        for i, seed in enumerate(seeds):
            plain = table["plain accumulation", k, schedule, seed]
            full = table["full batch", 1, schedule, seed]
            small = table["plain accumulation", k_small, schedule, seed]
            mom = table["momentum-corrected", k, schedule, seed]
            pairs = [
                (0, plain.val_acc_precise - plain.val_acc, PALETTE["vermillion"], f"PreciseBN − plain (K={k})"),
                (1, mom.val_acc - plain.val_acc, PALETTE["blue"], f"momentum-corrected − plain (K={k})"),
                (2, small.val_acc - full.val_acc, PALETTE["orange"], f"b={b_small} − full batch"),
                (
                    3,
                    small.val_acc_precise - full.val_acc_precise,
                    PALETTE["green"],
                    f"b={b_small} − full batch, both PreciseBN",
                ),
            ]
            for x, diff, color, label in pairs:
                ax.scatter(x + (i - 1) * 0.12, 100 * diff, color=color, s=28, label=label if i == 0 else None)
        ax.axhline(0, color="0.4", lw=0.8)
        ax.set_xticks(
            range(4),
            ["PreciseBN", "momentum\ncorrection", f"b={b_small}\nvs full", f"b={b_small} vs full\n(PreciseBN)"],
            fontsize=8,
        )
        decorate(ax, "", "difference (points)", f"{schedule} learning rate, seeds {seeds[0]}–{seeds[-1]}")
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
            title=method,
        )
    fig.colorbar(image, ax=axes, label="cosine to the full-batch gradient", shrink=0.9)
    return fig


def plot_method_effects(k: int, b: int, v: int, x: torch.Tensor, y: torch.Tensor):
    """The widget's picture: statistics error and gradient cosine of each method for one (K, b, v)."""

    rows = method_effects(k, b, v, x, y)
    names = [r.method.replace(", 1 update/step", f" (v={v})") for r in rows]
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
