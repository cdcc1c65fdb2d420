"""Chapter 7's optimizer steps across one epoch: the weight each step gives its micro-batches, and the partial last
window (its weight, and what it does to training), measured with the frameworks' runners."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradaccum import frameworks as fw
from gradaccum._validate import require_count, require_k
from gradaccum.book import ch07_harness as harness
from gradaccum.book.plotting import PALETTE, decorate, figure

#: Micro-batches per optimizer step in the measurements.
K = 4
COLORS = {
    "accelerate": PALETTE["orange"],
    "lightning": PALETTE["purple"],
    "trainer": PALETTE["blue"],
    "nanogpt": PALETTE["green"],
    "timm": PALETTE["black"],
}


MARKERS = {"accelerate": "o", "lightning": "s", "trainer": "^", "nanogpt": "D", "timm": "x"}


def digits_mlp(bn: bool = False, dropout: bool = False, seed: int = 0) -> nn.Sequential:
    """Flatten → Linear(64, 32) [→ BatchNorm1d] → ReLU [→ Dropout(0.3) → Linear(32, 32) → ReLU → Dropout(0.3)]
    → Linear(32, 10), float32; the weights depend only on ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods: list[nn.Module] = [nn.Flatten(), nn.Linear(64, 32)]
        mods += [nn.BatchNorm1d(32)] if bn else []
        mods.append(nn.ReLU())
        if dropout:
            mods += [nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.3)]
        mods.append(nn.Linear(32, 10))
        return nn.Sequential(*mods)


def _require_slices(x: torch.Tensor, seeds: Sequence[int], n: int) -> None:
    """Seed s trains on the s-th slice of n samples: every slice must exist and be whole."""
    if not seeds:
        raise ValueError("pass at least one seed: there is nothing to measure without one.")
    for seed in seeds:
        require_count(seed, "a seed", 0)
    if (max(seeds) + 1) * n > len(x):
        raise ValueError(
            f"seed {max(seeds)} uses samples {max(seeds) * n} to {(max(seeds) + 1) * n - 1}; only "
            f"{len(x)} given: pass fewer or smaller seeds (or smaller batches)."
        )


def step_weights(
    framework: str, x: torch.Tensor, y: torch.Tensor, micro_batches: int, k: int, b: int = 4
) -> list[float]:
    """Each optimizer step's gradient as a multiple of the mean gradient of the micro-batches it used, for one
    epoch of ``micro_batches`` micro-batches of ``b`` digits (learning rate 0, so every step sees the same
    weights). A framework that never uses the last micro-batches has fewer entries."""
    require_count(micro_batches, "micro_batches")
    require_k(k)
    require_count(b, "b (the micro-batch size)")
    n = micro_batches * b
    if n > len(x):
        raise ValueError(f"{micro_batches} micro-batches of {b} need {n} samples; only {len(x)} given.")
    model = digits_mlp()
    loss = nn.CrossEntropyLoss()
    result = fw.run(framework, model, loss, fw.split(x[:n], y[:n], micro_batches), k, lr=0.0)
    weights = []
    for s, grad in enumerate(result.grads):
        lo, hi = s * k * b, min((s + 1) * k * b, n)
        weights.append(harness.step_factor(grad, harness.full_gradient(model, loss, x[lo:hi], y[lo:hi])))
    return weights


def plot_step_weights(weights: dict[str, list[float]], micro_batches: int, k: int):
    """Each optimizer step's gradient as a multiple of its micro-batches' mean gradient, per framework."""
    fig, (ax,) = figure(1, 6.4, 3.6)
    names = list(weights)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        steps = np.arange(1, len(weights[name]) + 1) + (i - (len(names) - 1) / 2) * width
        ax.bar(steps, weights[name], width, color=COLORS[name], label=fw.LABELS[name])
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    n_steps = max(len(w) for w in weights.values())
    decorate(
        ax,
        "optimizer step of the epoch",
        "weight of the step's gradient",
        f"{micro_batches} micro-batches, K = {k}",
        xticks=range(1, n_steps + 1),
        legend=False,
    )
    ax.set_ylim(0, 1.15)
    ax.legend(frameon=False, fontsize="small", ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return fig


def _no_nanogpt(frameworks: Sequence[str]) -> None:
    if "nanogpt" in frameworks:
        raise ValueError(
            "the nanoGPT-style loop has no epochs and never runs a partial window (micro-batches left "
            "over are not used): leave it out of partial-window measurements."
        )


def partial_weights(
    x: torch.Tensor,
    y: torch.Tensor,
    ks: Sequence[int],
    frameworks: Sequence[str] = ("accelerate", "lightning", "timm"),
) -> dict[str, list[tuple[int, int, float]]]:
    """``(K, r, weight)`` of the last step of an epoch of ``K + r`` micro-batches (of 2 digits), for every
    ``r = 1 … K − 1``: the partial window's gradient as a multiple of the mean gradient of its micro-batches."""
    if not ks or any(require_k(k) < 2 for k in ks):
        raise ValueError(f"pass Ks of 2 or more (K = 1 has no partial window), got {tuple(ks)!r}.")
    _no_nanogpt(frameworks)
    return {
        name: [(k, r, step_weights(name, x, y, k + r, k, b=2)[-1]) for k in ks for r in range(1, k)]
        for name in frameworks
    }


def plot_epoch_weights(x: torch.Tensor, y: torch.Tensor, micro_batches: int, k: int):
    """The widget's picture: the weight of every optimizer step of one epoch of ``micro_batches`` micro-batches
    of 2 digits, per framework (:func:`step_weights`)."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"the epoch needs at least one micro-batch, got {micro_batches!r}.")
    weights = {name: step_weights(name, x, y, micro_batches, k, b=2) for name in fw.FRAMEWORKS}
    return plot_step_weights(weights, micro_batches, k)


@dataclass
class PartialCurves:
    """Training loss after each epoch (on the epoch's samples, one full batch) per framework, seed and schedule."""

    epochs: int
    losses: dict[tuple[str, int, str], list[float]]


def partial_window_curves(
    x: torch.Tensor,
    y: torch.Tensor,
    seeds: Sequence[int] = (0, 1, 2),
    schedules: Sequence[str] = ("constant", "cosine"),
    epochs: int = 30,
    micro_batches: int = 6,
    k: int = K,
    b: int = 8,
    lr: float = 0.2,
    frameworks: Sequence[str] = ("lightning", "timm"),
) -> PartialCurves:
    """Train :func:`digits_mlp` (seed ``s``, on the ``s``-th slice of ``micro_batches · b`` digits) for ``epochs``
    epochs of ``micro_batches`` micro-batches — every epoch ends with a partial window of ``micro_batches mod k`` —
    with each framework, SGD at ``lr``, constant or decayed to 0 by a cosine over the run."""
    _no_nanogpt(frameworks)
    if not schedules:
        raise ValueError("pass at least one schedule ('constant', 'cosine').")
    for schedule in schedules:
        if schedule not in ("constant", "cosine"):
            raise ValueError(f"schedules are 'constant' or 'cosine', got {schedule!r}.")
    require_count(epochs, "epochs")
    require_k(k)
    n = require_count(micro_batches, "micro_batches") * require_count(b, "b (the micro-batch size)")
    _require_slices(x, seeds, n)
    steps = epochs * -(-micro_batches // k)
    ce = nn.CrossEntropyLoss()
    losses: dict[tuple[str, int, str], list[float]] = {}
    for seed in seeds:
        xs, ys = x[seed * n : (seed + 1) * n], y[seed * n : (seed + 1) * n]
        for schedule in schedules:
            for name in frameworks:
                model = digits_mlp(seed=seed)
                result = fw.run(
                    name,
                    model,
                    ce,
                    fw.split(xs, ys, micro_batches),
                    k,
                    lr=lr,
                    epochs=epochs,
                    cosine=steps if schedule == "cosine" else 0,
                )
                per_epoch = len(result.params) // epochs
                curve = []
                probe = digits_mlp(seed=seed)
                for e in range(1, epochs + 1):
                    torch.nn.utils.vector_to_parameters(result.params[e * per_epoch - 1].float(), probe.parameters())
                    with torch.no_grad():
                        curve.append(float(ce(probe(xs), ys)))
                losses[name, seed, schedule] = curve
    return PartialCurves(epochs, losses)


def plot_partial_curves(curves: PartialCurves, seed: int = 0):
    """Training loss per epoch, one panel per schedule, for one seed."""
    schedules = sorted({key[2] for key in curves.losses}, key=["constant", "cosine"].index)
    fig, axes = figure(len(schedules), 6.4, 3.0)
    for ax, schedule in zip(axes, schedules):
        for (name, s, sch), curve in curves.losses.items():
            if s == seed and sch == schedule:
                label = f"{fw.LABELS[name]} (last window {'k′/K' if name in ('accelerate', 'lightning') else '1'})"
                ax.plot(
                    range(1, curves.epochs + 1),
                    curve,
                    marker=MARKERS[name],
                    markersize=3,
                    color=COLORS[name],
                    label=label,
                )
        decorate(ax, "epoch", "training loss" if ax is axes[0] else "", f"{schedule} learning rate", legend=False)
    axes[0].legend(frameon=False, fontsize="small")
    return fig


def plot_partial_weights(weights: dict[str, list[tuple[int, int, float]]]):
    """The last window's weight against the fraction k′/K of the window it holds, one panel per framework."""
    fig, axes = figure(len(weights), 6.4, 2.8)
    for ax, (name, points) in zip(axes, weights.items()):
        for k, marker in zip(sorted({p[0] for p in points}), ("o", "s", "^", "D")):
            mine = [(r / k, w) for kk, r, w in points if kk == k]
            ax.plot(*zip(*mine), marker, color=COLORS[name], label=f"K = {k}", alpha=0.8)
        ax.plot([0, 1], [0, 1], color="black", linewidth=0.8, linestyle=":")
        decorate(ax, "k′ / K", "weight" if ax is axes[0] else "", fw.LABELS[name], legend=ax is axes[0])
        ax.set_ylim(0, 1.1)
    return fig
