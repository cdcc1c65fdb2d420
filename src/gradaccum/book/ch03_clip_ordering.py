"""Chapter 3, "Where to clip": the errata cases, placement tables and training sweeps on the digits, the widget
functions and the figures.

The book layer over :mod:`gradaccum.clipping` (the torch-only tools the chapter derives). The errata cases are in
:mod:`gradaccum.book.ch03_errata`, re-exported here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
import torch
from torch import nn

from gradaccum._validate import require_count, require_k, require_positive
from gradaccum.accumulate import LossFn, train
from gradaccum.book.ch03_errata import ERRATA_CASES as ERRATA_CASES
from gradaccum.book.ch03_errata import errata_cases as errata_cases
from gradaccum.book.ch03_errata import format_errata_cases as format_errata_cases
from gradaccum.book.ch03_errata import torch_clip_ratio as torch_clip_ratio
from gradaccum.book.data import DigitsSplit
from gradaccum.book.models import make_cnn
from gradaccum.book.parallel import run_jobs
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.book.tables import Table
from gradaccum.clipping import (
    LABELS,
    PLACEMENTS,
    _require_placement,
    _require_threshold,
    clipped_accumulation,
    combine,
    cosine,
    mean_pairwise_cosine,
    micro_gradients,
    running_buffer_norms,
)


def synthetic_micro_gradients(
    k: int, alignment: float, norm: float = 1.0, dim: int = 256, seed: int = 0
) -> list[torch.Tensor]:
    r"""K micro-gradients :math:`g_k = \text{norm}\cdot(\sqrt{a}\,u + \sqrt{1-a}\,n_k)/\|\cdot\|` sharing the unit
    direction u with weight a = ``alignment`` (independent random unit vectors n_k); their pairwise cosines are
    about a."""
    require_k(k)
    if isinstance(alignment, bool) or not isinstance(alignment, (int, float)) or not 0.0 <= alignment <= 1.0:
        raise ValueError(f"alignment must lie in [0, 1] (0: unrelated micro-gradients, 1: identical), got {alignment}.")
    require_positive(norm, "norm")
    require_count(dim, "dim")
    require_count(seed, "seed", minimum=0)
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(dim, generator=gen, dtype=torch.float64)
    u /= torch.linalg.vector_norm(u)
    grads = []
    for _ in range(k):
        n = torch.randn(dim, generator=gen, dtype=torch.float64)
        n /= torch.linalg.vector_norm(n)
        g = math.sqrt(alignment) * u + math.sqrt(1 - alignment) * n
        grads.append(norm * g / torch.linalg.vector_norm(g))
    return grads


@dataclass(frozen=True)
class PlacementEffect:
    """Final norm (in units of the threshold c) and cosine to the correct clipped gradient of one placement."""

    placement: str
    norm_over_c: float
    cosine: float


def placement_effects(k: int, c: float, alignment: float, norm: float = 1.0, seed: int = 0) -> list[PlacementEffect]:
    """The widget's pure function: every placement on synthetic micro-gradients of norm ``norm``."""
    _require_threshold(c)
    grads = synthetic_micro_gradients(k, alignment, norm, seed=seed)
    correct = combine(grads, c, "once")
    rows = []
    for placement in PLACEMENTS:
        result = combine(grads, c, placement)
        rows.append(PlacementEffect(placement, float(torch.linalg.vector_norm(result)) / c, cosine(result, correct)))
    return rows


def placement_table(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    ks: Sequence[int],
    c: float,
    mode: Literal["norm", "value"] = "norm",
) -> dict[int, dict[str, tuple[float, float]]]:
    """For each K: micro-gradient agreement, and per placement (final size / c, cosine to the correct step).

    Size is the L2 norm for ``mode="norm"`` and the largest |element| for ``mode="value"``. Each row also holds,
    in units of c and in the first slot, the size of the unclipped accumulated gradient (``"full"``), of the
    shortest and longest micro-gradient (``"smallest"``, ``"largest"``) and, for ``mode="norm"``, the norm of
    placement (b)'s buffer before its last clip (``"buffer"``, :func:`running_buffer_norms`; NaN by value).
    """
    if not ks:
        raise ValueError("ks is empty: pass the numbers of micro-batches to tabulate, e.g. ks=(1, 2, 4, 8).")
    table: dict[int, dict[str, tuple[float, float]]] = {}
    nan = float("nan")
    for k in ks:
        grads = micro_gradients(model, loss_fn, x, y, k)
        correct = combine(grads, c, "once", mode)
        sizes = [float(torch.linalg.vector_norm(g) if mode == "norm" else g.abs().max()) / c for g in grads]
        full = cast(torch.Tensor, sum(grads)) / k  # K >= 1 tensors
        row = {
            "agreement": (mean_pairwise_cosine(grads), nan),
            "full": (float(torch.linalg.vector_norm(full) if mode == "norm" else full.abs().max()) / c, nan),
            "smallest": (min(sizes), nan),
            "largest": (max(sizes), nan),
            "buffer": (running_buffer_norms(grads, c)[-1] / c if mode == "norm" else nan, nan),
        }
        for placement in PLACEMENTS:
            g = combine(grads, c, placement, mode)
            size = torch.linalg.vector_norm(g) if mode == "norm" else g.abs().max()
            row[placement] = (float(size) / c, cosine(g, correct))
        table[k] = row
    return table


def format_placement_table(table: dict[int, dict[str, tuple[float, float]]], size: str = "norm") -> Table:
    """Per K: the micro-gradients' agreement, then each placement's step size over c and cosine to the correct
    step (one column group per placement)."""
    rows = [
        [k, f"{row['agreement'][0]:.3f}"] + [f"{row[p][i]:.3f}" for p in PLACEMENTS for i in (0, 1)]
        for k, row in table.items()
    ]
    return Table(
        ["K", "agreement"] + [f"{size}/c", "cos"] * len(PLACEMENTS),
        rows,
        groups=[("", 2)] + [(LABELS[p].split(" ")[0], 2) for p in PLACEMENTS],
    )  # (c), (a1), (a2), (b)


@dataclass(frozen=True)
class ClipRun:
    placement: str
    k: int
    val_acc: float
    losses: list[float]


def placement_run(
    split: DigitsSplit,
    k: int,
    c: float,
    placement: str,
    epochs: int = 8,
    seed: int = 0,
    norm: Literal["group", "layer"] = "group",
    lr: float = 0.05,
    optimizer: str = "SGD",
) -> ClipRun:
    """One run of :func:`train_placements`: ``placement`` over K micro-batches, or ``"full batch"`` (K = 1, the
    batch clipped once)."""
    kk, p = (1, "once") if placement == "full batch" else (k, placement)
    backward_fn = functools.partial(clipped_accumulation, c=c, placement=_require_placement(p))
    model = make_cnn(norm, seed=seed, device=split.x_train.device)
    r = train(
        model,
        split.x_train,
        split.y_train,
        split.x_val,
        split.y_val,
        batch_size=64,
        k=kk,
        epochs=epochs,
        seed=seed,
        backward_fn=backward_fn,
        lr=lr,
        optimizer=optimizer,
    )
    return ClipRun(placement, kk, r.val_acc, r.train_loss)


def _check_setup(c: float, norm: str, placements: Sequence[str]) -> None:
    _require_threshold(c)
    if norm not in ("group", "layer"):
        raise ValueError(
            f"norm must be 'group' or 'layer' (per-sample statistics), got {norm!r}; with BatchNorm "
            "the micro-batch statistics would change the runs as well (chapter 1)."
        )
    for p in placements:
        _require_placement(p)


def train_placements(
    split: DigitsSplit,
    k: int,
    c: float,
    epochs: int = 8,
    seed: int = 0,
    placements: Sequence[str] = PLACEMENTS,
    norm: Literal["group", "layer"] = "group",
    full_batch: bool = True,
    lr: float = 0.05,
    workers: int = 1,
) -> list[ClipRun]:
    """Train a SmallCNN with a per-sample normalization (``norm="group"`` or ``"layer"``, so that accumulation
    is otherwise exact) with each clip placement, plus (if ``full_batch``) the full batch clipped once
    (``placement="full batch"``, K = 1), on the same batches (SGD with momentum 0.9 at learning rate ``lr``).
    With ``workers > 1`` the runs go to that many spawned processes (:func:`gradaccum.book.parallel.run_jobs`:
    every run seeds itself, the same results to the bit)."""
    _check_setup(c, norm, placements)
    jobs = [
        dict(split=split, k=k, c=c, placement=p, epochs=epochs, seed=seed, norm=norm, lr=lr)
        for p in (("full batch",) if full_batch else ()) + tuple(placements)
    ]
    return run_jobs(placement_run, jobs, workers)


def last_epoch_loss(run: ClipRun, epochs: int) -> float:
    """Mean training loss over the optimizer steps of the last epoch."""
    per_epoch = len(run.losses) // epochs
    return sum(run.losses[-per_epoch:]) / per_epoch


#: Set-ups of the robustness checks: (normalization, threshold c).
SETUPS: tuple[tuple[Literal["group", "layer"], float], ...] = (("group", 0.3), ("layer", 0.3), ("group", 1.0))


def table_sweep(
    split: DigitsSplit,
    setups: Sequence[tuple[Literal["group", "layer"], float]] = SETUPS,
    seeds: Sequence[int] = (0, 1, 2),
    ks: Sequence[int] = (1, 2, 4, 8, 16),
    batch_size: int = 64,
) -> dict[tuple[str, float, int], dict[int, dict[str, tuple[float, float]]]]:
    """:func:`placement_table` for every set-up and seed: seed s takes a fresh SmallCNN initialized with seed s
    and the training batch of ``batch_size`` images number s."""
    for norm, c in setups:
        _check_setup(c, norm, ())
    require_count(batch_size, "batch_size")
    for s in seeds:
        require_count(s, "seed", minimum=0)
        if (s + 1) * batch_size > len(split.x_train):
            raise ValueError(
                f"seed {s} takes training images {s * batch_size} to {(s + 1) * batch_size - 1}, but "
                f"the split has {len(split.x_train)}: use seeds below "
                f"{len(split.x_train) // batch_size}, or a smaller batch_size."
            )
    loss_fn = nn.CrossEntropyLoss()
    out: dict[tuple[str, float, int], dict[int, dict[str, tuple[float, float]]]] = {}
    for norm, c in setups:
        for s in seeds:
            x = split.x_train[s * batch_size : (s + 1) * batch_size]
            y = split.y_train[s * batch_size : (s + 1) * batch_size]
            model = make_cnn(norm, seed=s, device=x.device).train()
            out[(norm, c, s)] = placement_table(model, loss_fn, x, y, ks, c)
    return out


def train_sweep(
    split: DigitsSplit,
    k: int = 8,
    epochs: int = 2,
    setups: Sequence[tuple[Literal["group", "layer"], float]] = SETUPS,
    seeds: Sequence[int] = (0, 1, 2),
    lr: float = 0.05,
    placements: Sequence[str] = PLACEMENTS,
    workers: int = 1,
    optimizer: str = "SGD",
) -> dict[tuple[str, float, int], dict[str, float]]:
    """Last-epoch training loss of every placement, for every set-up and seed (short runs: ``epochs``; SGD with
    momentum 0.9 at learning rate ``lr``, or ``optimizer="AdamW"``); ``workers`` as in :func:`train_placements`."""
    for norm, c in setups:
        _check_setup(c, norm, placements)
    keys = [(norm, c, s, p) for norm, c in setups for s in seeds for p in placements]
    jobs = [
        dict(split=split, k=k, c=c, placement=p, epochs=epochs, seed=s, norm=norm, lr=lr, optimizer=optimizer)
        for norm, c, s, p in keys
    ]
    out: dict[tuple[str, float, int], dict[str, float]] = {}
    for (norm, c, s, p), run in zip(keys, run_jobs(placement_run, jobs, workers)):
        out.setdefault((norm, c, s), {})[p] = last_epoch_loss(run, epochs)
    return out


def format_table_sweep(tables: dict[tuple[str, float, int], dict[int, dict[str, tuple[float, float]]]]) -> Table:
    """One row per (normalization, c, seed): the unclipped ‖g‖/c, (a1) and (a2) as ‖step‖/c and (b)'s cosine to
    the correct step, at the smallest and the largest K > 1 of the tables."""
    if not tables:
        raise ValueError("no tables: pass what table_sweep returns.")
    first = next(iter(tables.values()))
    ks = [k for k in first if k > 1]
    if not ks:
        raise ValueError(
            f"the tables hold K = {sorted(first)} only: the sweep compares placements at K > 1 "
            "(at K = 1 every placement clips once); run table_sweep with ks including some K > 1."
        )
    lo, hi = ks[0], ks[-1]
    rows = [
        [
            norm,
            f"{c:g}",
            s,
            f"{tab[lo]['full'][0]:.2f}",
            f"{tab[lo]['scaled_micro'][0]:.2f}",
            f"{tab[hi]['scaled_micro'][0]:.2f}",
            f"{tab[lo]['raw_micro'][0]:.3f}",
            f"{tab[hi]['raw_micro'][0]:.3f}",
            f"{tab[lo]['running'][1]:.3f}",
            f"{tab[hi]['running'][1]:.3f}",
        ]
        for (norm, c, s), tab in tables.items()
    ]
    return Table(
        ["norm", "c", "seed", "‖g‖/c"] + [f"K={lo}", f"K={hi}"] * 3,
        rows,
        groups=[("", 4), ("(a1) ‖step‖/c", 2), ("(a2) ‖step‖/c", 2), ("(b) cosine", 2)],
    )


def format_train_sweep(losses: dict[tuple[str, float, int], dict[str, float]]) -> Table:
    """One row per (normalization, c, seed): last-epoch training loss of every placement."""
    rows = [[norm, f"{c:g}", s] + [f"{row[p]:.4f}" for p in PLACEMENTS] for (norm, c, s), row in losses.items()]
    return Table(["norm", "c", "seed"] + [LABELS[p].split(" ")[0] for p in PLACEMENTS], rows)


def plot_placement_table(table: dict[int, dict[str, tuple[float, float]]]):
    """Final norm over c and cosine to the correct step, against K, one line per placement."""

    colors = {
        "once": PALETTE["black"],
        "scaled_micro": PALETTE["vermillion"],
        "raw_micro": PALETTE["blue"],
        "running": PALETTE["green"],
    }
    markers = {"once": "o", "scaled_micro": "^", "raw_micro": "v", "running": "s"}
    ks = list(table)
    fig, (ax1, ax2) = figure(2, 9.6, 3.6)
    for p in PLACEMENTS:
        ax1.plot(ks, [table[k][p][0] for k in ks], marker=markers[p], color=colors[p], label=LABELS[p])
        ax2.plot(ks, [table[k][p][1] for k in ks], marker=markers[p], color=colors[p])
    decorate(ax1, "accumulation steps K", "‖step‖ / c", "Size of the clipped step", xscale="log", xticks=ks)
    ax1.legend(frameon=False, fontsize=8)
    decorate(ax2, "accumulation steps K", "cosine to the correct step", "Direction", xscale="log", xticks=ks)
    return fig


def plot_training(runs: list[ClipRun], window: int = 19):
    """Training loss (moving average over one epoch of steps) for every placement."""

    colors = {
        "full batch": PALETTE["sky"],
        "once": PALETTE["black"],
        "scaled_micro": PALETTE["vermillion"],
        "raw_micro": PALETTE["blue"],
        "running": PALETTE["green"],
    }
    styles = {"full batch": "-", "once": "--"}
    fig, (ax,) = figure()
    for r in runs:
        smooth = np.convolve(r.losses, np.ones(window) / window, mode="valid")
        label = "full batch, clipped once (K = 1)" if r.placement == "full batch" else LABELS[r.placement]
        ax.plot(
            np.arange(window, len(r.losses) + 1),
            smooth,
            styles.get(r.placement, "-"),
            color=colors[r.placement],
            label=label,
            linewidth=2.5 if r.placement == "full batch" else 1.5,
        )
    decorate(ax, "optimizer step", "training loss (moving average)", f"Training with K = {runs[-1].k}, same batches")
    ax.legend(frameon=False, fontsize=8)
    return fig


def plot_running_weights(weights: list[float], c: float):

    fig, (ax,) = figure()
    k = len(weights)
    ax.bar(range(1, k + 1), weights, color=PALETTE["green"], label="(b) clip the running buffer")
    decorate(
        ax,
        "micro-batch j (in the order processed)",
        "weight w_j of g_j in the step",
        f"Placement (b), K = {k}, c = {c}: later micro-batches count more",
        xticks=list(range(1, k + 1)),
    )
    return fig


def plot_placement_effects(k: int, c: float, alignment: float):
    """The widget's picture: final norm / c and cosine to the correct step, per placement."""

    rows = placement_effects(k, c, alignment)
    names = [LABELS[r.placement] for r in rows]
    fig, (ax1, ax2) = figure(2, 9.6, 3.4)
    ax1.barh(names, [r.norm_over_c for r in rows], color=PALETTE["vermillion"])
    ax1.axvline(1.0, color="black", linewidth=1)
    decorate(ax1, "‖step‖ / c", "", f"K = {k}, c = {c:g}, micro-gradients of norm 1")
    ax2.barh(names, [r.cosine for r in rows], color=PALETTE["blue"])
    ax2.set_yticks(range(len(names)), [""] * len(names))
    ax2.set_xlim(-0.05, 1.05)
    decorate(ax2, "cosine to the correct step", "", f"alignment of micro-gradients = {alignment:g}")
    return fig


def placement_grid(ks: Sequence[int], alignments: Sequence[float], c: float) -> dict[str, np.ndarray]:
    """‖step‖/c over K (rows) × alignment (columns), per placement, for synthetic micro-gradients of norm 1."""

    out: dict[str, np.ndarray] = {p: np.zeros((len(ks), len(alignments))) for p in PLACEMENTS}
    for i, k in enumerate(ks):
        for j, a in enumerate(alignments):
            for e in placement_effects(k, c, a):
                out[e.placement][i, j] = e.norm_over_c
    return out


def plot_placement_grid(grid: dict[str, np.ndarray], ks: Sequence[int], alignments: Sequence[float]):

    fig, axes = figure(4, 14.0, 3.6)
    vmax = max(float(g.max()) for g in grid.values())
    for ax, p in zip(axes, PLACEMENTS):
        image = heatmap(
            ax,
            grid[p],
            ks,
            [f"{a:g}" for a in alignments],
            vmin=0.0,
            vmax=vmax,
            xlabel="alignment",
            ylabel="K",
            title=LABELS[p].split(") ")[0] + ")",
        )
    fig.colorbar(image, ax=axes, label="‖step‖ / c", shrink=0.9)
    return fig
