r"""Chapter 3: where to clip under gradient accumulation.

``torch.nn.utils.clip_grad_norm_`` treats all gradients as one vector :math:`v`, computes :math:`\|v\|` and
multiplies every gradient by :math:`\min\big(1, c/(\|v\|+10^{-6})\big)`. Write :math:`\operatorname{clip}_c` for
that map, :math:`g_k` for the gradient of micro-batch :math:`k`'s mean loss and :math:`g=\frac1K\sum_k g_k` for
the accumulated (= full-batch) gradient. The four placements:

* ``"once"`` (c): :math:`\operatorname{clip}_c(g)` — clip once after the last micro-batch; equals clipping the
  full-batch gradient;
* ``"scaled_micro"`` (a1): :math:`\sum_k \operatorname{clip}_c(g_k/K)` — each 1/K-scaled contribution is
  clipped; acts like a threshold of :math:`Kc` and can inflate the result up to K-fold;
* ``"raw_micro"`` (a2): :math:`\frac1K\sum_k \operatorname{clip}_c(g_k)` — each raw micro-gradient is
  clipped, then averaged; never longer than :math:`c`, and shorter when micro-gradients disagree;
* ``"running"`` (b): ``clip_grad_norm_`` on the running ``.grad`` buffer after every backward:
  :math:`r_k = \operatorname{clip}_c(r_{k-1} + g_k/K)`; earlier micro-batches are shrunk again by every later
  clip, so the direction leans towards the last ones, and the result depends on their order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .accumulate import LossFn, check_k, flat_grad, split_batch
from .data import DigitsSplit

Placement = Literal["once", "scaled_micro", "raw_micro", "running"]
PLACEMENTS: tuple[str, ...] = ("once", "scaled_micro", "raw_micro", "running")
LABELS: dict[str, str] = {
    "once": "(c) clip once, after accumulation",
    "scaled_micro": "(a1) clip each g_k/K, then sum",
    "raw_micro": "(a2) clip each g_k, then average",
    "running": "(b) clip the running .grad buffer",
}
EPS = 1e-6  # clip_grad_norm_'s constant


def check_threshold(c: float) -> float:
    """A clipping threshold must be a positive finite number."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
        raise ValueError(f"the clipping threshold must be a positive finite number, got {c!r}.")
    return float(c)


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}.")
    return placement


def clip_vector(v: torch.Tensor, c: float, mode: Literal["norm", "value"] = "norm") -> torch.Tensor:
    """``clip_grad_norm_`` (or ``clip_grad_value_``) applied to one flat vector, out of place."""
    if mode == "value":
        return v.clamp(-c, c)
    if mode != "norm":
        raise ValueError(f"mode must be 'norm' or 'value', got {mode!r}.")
    coef = c / (torch.linalg.vector_norm(v) + EPS)
    return v * coef.clamp(max=1.0)


def combine(micro_grads: Sequence[torch.Tensor], c: float, placement: Placement,
            mode: Literal["norm", "value"] = "norm") -> torch.Tensor:
    """The step's gradient from the raw micro-batch gradients ``g_k`` under each clip placement (the math of
    :func:`clipped_accumulation` on plain vectors, used by the widget and the exercises)."""
    check_threshold(c)
    check_placement(placement)
    k = len(micro_grads)
    check_k(k)
    if placement == "once":
        return clip_vector(sum(micro_grads) / k, c, mode)  # type: ignore[arg-type]
    if placement == "scaled_micro":
        return sum(clip_vector(g / k, c, mode) for g in micro_grads)  # type: ignore[return-value]
    if placement == "raw_micro":
        return sum(clip_vector(g, c, mode) for g in micro_grads) / k  # type: ignore[return-value]
    running = torch.zeros_like(micro_grads[0])
    for g in micro_grads:
        running = clip_vector(running + g / k, c, mode)
    return running


def check_finite_grads(model: nn.Module) -> None:
    """Raise a ``ValueError`` naming the first parameter whose gradient holds inf or NaN."""
    for name, p in model.named_parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            bad = "NaN" if torch.isnan(p.grad).any() else "inf"
            raise ValueError(
                f"the gradient of parameter {name!r} contains {bad}; clipping cannot repair it. Find where it "
                "comes from (a loss of inf/NaN, an overflow in low precision — chapter 4) or skip the step."
            )


def _clip_grads(params: list[nn.Parameter], c: float, mode: str) -> None:
    if mode == "norm":
        torch.nn.utils.clip_grad_norm_(params, c)
    elif mode == "value":
        torch.nn.utils.clip_grad_value_(params, c)
    else:
        raise ValueError(f"mode must be 'norm' or 'value', got {mode!r}.")


def clipped_accumulation(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int, c: float,
                         placement: Placement = "once", mode: Literal["norm", "value"] = "norm") -> float:
    """One accumulation loop with the clip placement as a parameter; gradients end in ``.grad``.

    Uses ``torch.nn.utils.clip_grad_norm_`` (``clip_grad_value_`` with ``mode="value"``) on the parameters'
    ``.grad``, as a training script would. For the per-micro-batch placements the micro-batch's gradient is
    isolated (the running sum is set aside during its backward pass) so that only it is clipped. The caller
    zeroes gradients before and steps after. Returns the batch loss.
    """
    check_threshold(c)
    check_placement(placement)
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    for xb, yb in split_batch(x, y, k):
        loss = loss_fn(model(xb), yb)
        total += float(loss.detach()) / k
        if placement in ("once", "running"):
            (loss / k).backward()
            if placement == "running":
                check_finite_grads(model)
                _clip_grads(params, c, mode)
            continue
        stash = [p.grad for p in params]
        for p in params:
            p.grad = None
        (loss / k if placement == "scaled_micro" else loss).backward()
        check_finite_grads(model)
        _clip_grads(params, c, mode)
        for p, old in zip(params, stash):
            if p.grad is not None and placement == "raw_micro":
                p.grad.div_(k)
            if old is not None:
                p.grad = old + p.grad if p.grad is not None else old
    if placement == "once":
        check_finite_grads(model)
        _clip_grads(params, c, mode)
    return total


def micro_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The raw gradients g_k of each micro-batch's mean loss, as flat vectors (the model is left unchanged)."""
    grads = []
    for xb, yb in split_batch(x, y, k):
        model.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        grads.append(flat_grad(model).detach().clone())
    model.zero_grad(set_to_none=True)
    return grads


def mean_pairwise_cosine(vectors: Sequence[torch.Tensor]) -> float:
    """Average cosine between distinct pairs: 1 for aligned micro-gradients, near 0 or below for disagreeing ones."""
    if len(vectors) < 2:
        return 1.0
    unit = torch.stack([v / torch.linalg.vector_norm(v) for v in vectors])
    gram = unit @ unit.T
    n = len(vectors)
    return float((gram.sum() - gram.diagonal().sum()) / (n * (n - 1)))


# --------------------------------------------------------------------------- synthetic micro-gradients


def synthetic_micro_gradients(k: int, alignment: float, norm: float = 1.0, dim: int = 256, seed: int = 0) -> list[torch.Tensor]:
    r"""K micro-gradients :math:`g_k = \text{norm}\cdot(\sqrt{a}\,u + \sqrt{1-a}\,n_k)/\|\cdot\|` sharing the unit
    direction u with weight a = ``alignment`` (independent random unit vectors n_k); their pairwise cosines are
    about a."""
    check_k(k)
    if not 0.0 <= alignment <= 1.0:
        raise ValueError(f"alignment must lie in [0, 1] (0: unrelated micro-gradients, 1: identical), got {alignment}.")
    if norm <= 0:
        raise ValueError(f"norm must be positive, got {norm}.")
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
    check_threshold(c)
    grads = synthetic_micro_gradients(k, alignment, norm, seed=seed)
    correct = combine(grads, c, "once")
    rows = []
    for placement in PLACEMENTS:
        result = combine(grads, c, placement)  # type: ignore[arg-type]
        cos = torch.nn.functional.cosine_similarity(result, correct, dim=0)
        rows.append(PlacementEffect(placement, float(torch.linalg.vector_norm(result)) / c, float(cos)))
    return rows


def running_clip_weights(micro_grads: Sequence[torch.Tensor], c: float) -> list[float]:
    r"""Placement (b) returns :math:`\sum_j w_j g_j` with :math:`w_j = \frac1K\prod_{i\ge j}\kappa_i`, where
    :math:`\kappa_i\le 1` is the coefficient of the clip after micro-batch i. The correct step has
    :math:`w_j = \kappa/K` for all j: equal weights."""
    check_threshold(c)
    k = len(micro_grads)
    check_k(k)
    running = torch.zeros_like(micro_grads[0])
    coefs = []
    for g in micro_grads:
        running = running + g / k
        coef = min(1.0, c / (float(torch.linalg.vector_norm(running)) + EPS))
        running = running * coef
        coefs.append(coef)
    return [math.prod(coefs[j:]) / k for j in range(k)]


def clip_with_scaler(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int, c: float,
                     unscale_first: bool = True, init_scale: float = 2.0**16) -> torch.Tensor:
    """The gradient an optimizer would receive from the torch.amp recipe with accumulation and clipping:
    ``scaler.scale(loss / K).backward()`` per micro-batch, then either ``unscale_`` → clip (right) or clip →
    ``unscale_`` (wrong; ``scaler.step`` would unscale after the clip). Runs on a copy of ``model``."""
    import copy

    check_threshold(c)
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    device_type = next(work.parameters()).device.type
    opt = torch.optim.SGD(work.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
    for xb, yb in split_batch(x, y, k):
        scaler.scale(loss_fn(work(xb), yb) / k).backward()
    params = list(work.parameters())
    if unscale_first:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, c)
    else:
        torch.nn.utils.clip_grad_norm_(params, c)
        scaler.unscale_(opt)
    return flat_grad(work).detach()


def placement_table(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, ks: Sequence[int],
                    c: float, mode: Literal["norm", "value"] = "norm") -> dict[int, dict[str, tuple[float, float]]]:
    """For each K: micro-gradient agreement, and per placement (final size / c, cosine to the correct step).

    Size is the L2 norm for ``mode="norm"`` and the largest |element| for ``mode="value"``.
    """
    table: dict[int, dict[str, tuple[float, float]]] = {}
    for k in ks:
        grads = micro_gradients(model, loss_fn, x, y, k)
        correct = combine(grads, c, "once", mode)
        row = {"agreement": (mean_pairwise_cosine(grads), float("nan"))}
        for placement in PLACEMENTS:
            g = combine(grads, c, placement, mode)  # type: ignore[arg-type]
            size = torch.linalg.vector_norm(g) if mode == "norm" else g.abs().max()
            row[placement] = (float(size) / c, float(torch.nn.functional.cosine_similarity(g, correct, dim=0)))
        table[k] = row
    return table


def format_placement_table(table: dict[int, dict[str, tuple[float, float]]], size: str = "norm") -> str:
    head = f"{'K':>3} {'agreement':>10}  " + "".join(f"{p:>22}" for p in PLACEMENTS)
    lines = [f"{'':>16}" + "".join(f"{f'{size}/c   cos':>22}" for _ in PLACEMENTS), head]
    for k, row in table.items():
        lines.append(f"{k:>3} {row['agreement'][0]:>10.3f}  " +
                     "".join(f"{row[p][0]:>14.3f} {row[p][1]:>6.3f} " for p in PLACEMENTS))
    return "\n".join(lines)


@dataclass(frozen=True)
class ClipRun:
    placement: str
    k: int
    val_acc: float
    losses: list[float]


def train_placements(split: DigitsSplit, k: int, c: float, epochs: int = 8, seed: int = 0,
                     placements: Sequence[str] = PLACEMENTS) -> list[ClipRun]:
    """Train a GroupNorm SmallCNN (so that accumulation is otherwise exact) with each clip placement, plus the
    full batch clipped once (``placement="full batch"``, K = 1), on the same batches."""
    import functools

    from .accumulate import train
    from .models import make_cnn

    check_threshold(c)
    runs = []
    for placement in ("full batch", *placements):
        kk, p = (1, "once") if placement == "full batch" else (k, placement)
        backward_fn = functools.partial(clipped_accumulation, c=c, placement=check_placement(p))
        model = make_cnn("group", seed=seed, device=split.x_train.device)
        r = train(model, split.x_train, split.y_train, split.x_val, split.y_val, batch_size=64, k=kk,
                  epochs=epochs, seed=seed, backward_fn=backward_fn)
        runs.append(ClipRun(placement, kk, r.val_acc, r.train_loss))
    return runs


# ---------------------------------------------------------------------------------------------- figures


def plot_placement_table(table: dict[int, dict[str, tuple[float, float]]]):
    """Final norm over c and cosine to the correct step, against K, one line per placement."""
    from .plotting import PALETTE, decorate, figure

    colors = {"once": PALETTE["black"], "scaled_micro": PALETTE["vermillion"], "raw_micro": PALETTE["blue"],
              "running": PALETTE["green"]}
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
    import numpy as np

    from .plotting import PALETTE, decorate, figure

    colors = {"full batch": PALETTE["sky"], "once": PALETTE["black"], "scaled_micro": PALETTE["vermillion"],
              "raw_micro": PALETTE["blue"], "running": PALETTE["green"]}
    styles = {"full batch": "-", "once": "--"}
    fig, (ax,) = figure()
    for r in runs:
        smooth = np.convolve(r.losses, np.ones(window) / window, mode="valid")
        label = "full batch, clipped once (K = 1)" if r.placement == "full batch" else LABELS[r.placement]
        ax.plot(np.arange(window, len(r.losses) + 1), smooth, styles.get(r.placement, "-"),
                color=colors[r.placement], label=label, linewidth=2.5 if r.placement == "full batch" else 1.5)
    decorate(ax, "optimizer step", "training loss (moving average)", f"Training with K = {runs[-1].k}, same batches")
    ax.legend(frameon=False, fontsize=8)
    return fig


def plot_running_weights(weights: list[float], c: float):
    from .plotting import PALETTE, decorate, figure

    fig, (ax,) = figure()
    k = len(weights)
    ax.bar(range(1, k + 1), weights, color=PALETTE["green"], label="(b) clip the running buffer")
    decorate(ax, "micro-batch j (in the order processed)", "weight w_j of g_j in the step",
             f"Placement (b), K = {k}, c = {c}: later micro-batches count more", xticks=list(range(1, k + 1)))
    return fig


def plot_placement_effects(k: int, c: float, alignment: float):
    """The widget's picture: final norm / c and cosine to the correct step, per placement."""
    from .plotting import PALETTE, decorate, figure

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


def placement_grid(ks: Sequence[int], alignments: Sequence[float], c: float) -> dict[str, "np.ndarray"]:
    """‖step‖/c over K (rows) × alignment (columns), per placement, for synthetic micro-gradients of norm 1."""
    import numpy as np

    out = {p: np.zeros((len(ks), len(alignments))) for p in PLACEMENTS}
    for i, k in enumerate(ks):
        for j, a in enumerate(alignments):
            for e in placement_effects(k, c, a):
                out[e.placement][i, j] = e.norm_over_c
    return out


def plot_placement_grid(grid: dict[str, "np.ndarray"], ks: Sequence[int], alignments: Sequence[float]):
    from .plotting import figure, heatmap

    fig, axes = figure(4, 14.0, 3.6)
    vmax = max(float(g.max()) for g in grid.values())
    for ax, p in zip(axes, PLACEMENTS):
        image = heatmap(ax, grid[p], ks, [f"{a:g}" for a in alignments], vmin=0.0, vmax=vmax, xlabel="alignment",
                        ylabel="K", title=LABELS[p].split(") ")[0] + ")")
    fig.colorbar(image, ax=axes, label="‖step‖ / c", shrink=0.9)
    return fig
