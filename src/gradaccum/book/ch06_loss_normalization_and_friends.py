"""Chapter 6, "Loss normalization and friends": the dropout comparison, the partial-window study, the tiny language
model's training and the figures.

The book layer over :mod:`gradaccum.windows` (the torch-only tools the chapter derives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradaccum._tensors import relative_error
from gradaccum._validate import require_k
from gradaccum.book.ch06_ranks import STUDY_LR as STUDY_LR
from gradaccum.book.ch06_ranks import partial_step_run as partial_step_run
from gradaccum.book.data import Vocab, encode_batch, spread_lines
from gradaccum.book.ddp_workers import start_fork_server
from gradaccum.book.parallel import run_jobs
from gradaccum.book.plotting import PALETTE, decorate, figure, heatmap
from gradaccum.windows import (
    OptimizerName,
    dropout_gradient,
    token_mean_gradient,
    window_backward,
    window_gradient,
)


@dataclass(frozen=True)
class DropoutComparison:
    r"""Full-batch vs accumulated gradients of a model with dropout.

    ``same_seed``: relative error between the two when both start from the same seed; ``single_draw``: the same for
    two independent seeds; ``mean_gap``: relative difference between their means over ``draws`` seeds each;
    ``noise``: the size ``mean_gap`` has from sampling alone when both have the same distribution,
    :math:`\sqrt{(\operatorname{tr}\Sigma_{\text{full}} + \operatorname{tr}\Sigma_{\text{acc}})/\text{draws}}\,/\,
    \lVert\text{mean}_{\text{full}}\rVert`.
    """

    same_seed: float
    single_draw: float
    mean_gap: float
    noise: float
    draws: int


def compare_dropout(
    model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, k: int, draws: int = 200, seed: int = 0
) -> DropoutComparison:
    """Compare full-batch and K-micro-batch gradients under dropout: one seed, independent seeds, and the means
    over ``draws`` independent seeds each (full batch: seeds ``seed + 1 …``; accumulated: ``seed + 1 + draws …``)."""
    require_k(k)
    if draws < 2:
        raise ValueError(f"need at least 2 draws to estimate a spread, got {draws}.")
    rel = lambda reference, g: relative_error(g, reference)  # noqa: E731
    full = torch.stack([dropout_gradient(model, loss_fn, x, y, 1, seed + 1 + i) for i in range(draws)])
    acc = torch.stack([dropout_gradient(model, loss_fn, x, y, k, seed + 1 + draws + i) for i in range(draws)])
    same = rel(dropout_gradient(model, loss_fn, x, y, 1, seed), dropout_gradient(model, loss_fn, x, y, k, seed))
    mean_full = full.mean(0)
    noise = float(torch.sqrt((full.var(0).sum() + acc.var(0).sum()) / draws) / torch.linalg.vector_norm(mean_full))
    return DropoutComparison(same, rel(full[0], acc[0]), rel(mean_full, acc.mean(0)), noise, draws)


def partial_step_study(
    x_digits: torch.Tensor,
    y_digits: torch.Tensor,
    lines: Sequence[str],
    vocab: Vocab,
    seeds: Sequence[int] = (0, 1, 2),
    warm: Sequence[int] = (0, 10),
    k: int = 8,
    present: int = 3,
    optimizers: Sequence[OptimizerName] = ("sgd", "momentum", "adam"),
    workers: int = 1,
) -> dict[tuple[str, str, int], list[float]]:
    """:func:`gradaccum.windows.partial_step_ratio` (:func:`partial_step_run`) for two set-ups — the book's GroupNorm
    ``SmallCNN`` on the digits (micro-batches of 8 images) and the character LM on the corpus (micro-batches of 2
    lines, token-mean loss) — with plain SGD, SGD with momentum 0.9 and Adam (learning rates :data:`STUDY_LR`),
    after each number of ``warm`` windows, one value per seed (the seed sets the model's initial weights and the
    batches); ``optimizers`` picks a subset. With ``workers > 1`` the runs go to that many processes forked from the
    fork server (the one :func:`start_helpers` started, if it did; :func:`gradaccum.book.parallel.run_jobs`: every
    run seeds itself, the same results to the bit).
    Returns ``{(set-up, optimizer, warm windows): [ratio per seed]}``."""

    lm_x, lm_y = encode_batch(lines, vocab)
    data = {"CNN, digits": (x_digits, y_digits), "char LM": (lm_x, lm_y)}
    keys = [(name, opt, w) for name in STUDY_LR for opt in optimizers for w in warm]
    jobs = [
        dict(
            setup=name,
            optimizer=opt,
            warm=w,
            seed=sd,
            x=data[name][0],
            y=data[name][1],
            vocab=vocab,
            k=k,
            present=present,
        )
        for name, opt, w in keys
        for sd in seeds
    ]
    ratios = iter(run_jobs(partial_step_run, jobs, workers, start_method="forkserver"))
    return {key: [next(ratios) for _ in seeds] for key in keys}


#: What the helper processes need besides torch: the module they run (:mod:`gradaccum.book.ch06_ranks`),
#: ``torch._dynamo`` (every process imports it at its first ``Optimizer.step()``, about 2 s) and what the ranks seed
#: with (Transformers' ``set_seed``, Accelerate).
HELPER_MODULES = ("gradaccum.book.ch06_ranks", "torch._dynamo", "transformers.trainer_utils", "accelerate")


def start_helpers() -> bool:
    """Start the fork server that the chapter's helper processes (the two processes of :func:`partial_step_study`,
    the two ranks of :func:`gradaccum.book.ch06_practice.rank_demo`) fork from, and return at once: it imports
    torch and :data:`HELPER_MODULES` in the background, on a core the notebook leaves idle, and every helper then
    starts in milliseconds instead of seconds. ``False`` where the platform has no fork server (Windows): the
    helpers are spawned, each importing what it needs."""
    return start_fork_server(HELPER_MODULES)


def train_lm(
    model: nn.Module, lines: Sequence[str], vocab: Vocab, steps: int = 150, k: int = 4, lr: float = 0.01, seed: int = 0
) -> list[float]:
    """Train the tiny LM in place with Adam on random batches of 16 lines (K micro-batches, window-token
    normalization); returns the window losses."""
    x_all, y_all = encode_batch(lines, vocab)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randperm(len(lines), generator=gen)[:16]
        opt.zero_grad(set_to_none=True)
        losses.append(window_backward(model, x_all[idx], y_all[idx], k))
        opt.step()
    return losses


def token_error(
    model: nn.Module,
    lines: Sequence[str],
    vocab: Vocab,
    k: int,
    spread: int,
    sort: bool,
    n: int = 32,
    center: int = 50,
    seed: int = 1,
) -> float:
    """Relative error of the mean-of-means gradient against the token-mean gradient for one batch of n lines."""
    if n % k:
        raise ValueError(f"K = {k} must divide the batch of {n} lines.")
    x, y = encode_batch(spread_lines(lines, n, center, spread, seed=seed, sort=sort), vocab)
    ref = token_mean_gradient(model, x, y)
    g = window_gradient(model, x, y, k, "mean_of_means")
    return relative_error(g, ref)


def token_error_grid(
    model: nn.Module, lines: Sequence[str], vocab: Vocab, ks: Sequence[int], spreads: Sequence[int], sort: bool = True
) -> np.ndarray:
    return np.array([[token_error(model, lines, vocab, k, s, sort) for s in spreads] for k in ks])


def plot_token_error(spreads: Sequence[int], random: Sequence[float], grouped: Sequence[float]):

    fig, (ax,) = figure()
    ax.plot(spreads, grouped, "o-", color=PALETTE["vermillion"], label="length-grouped micro-batches")
    ax.plot(spreads, random, "s-", color=PALETTE["blue"], label="random micro-batches")
    ax.axhline(0, color="black", linewidth=1)
    decorate(
        ax,
        "spread of sequence lengths (± characters around 50)",
        "relative gradient error",
        "Mean of per-micro-batch means vs token mean (K = 4)",
    )
    return fig


def plot_lr(right: Sequence[float], wrong: Sequence[float], k: int, warmup: int):

    fig, (ax,) = figure()
    steps = range(1, len(right) + 1)
    ax.plot(steps, right, "o-", color=PALETTE["blue"], label="scheduler.step() per optimizer step")
    ax.plot(steps, wrong, "s-", color=PALETTE["vermillion"], label="scheduler.step() per micro-batch")
    decorate(ax, "optimizer step", "learning rate (fraction of peak)", f"Linear warmup of {warmup} steps, K = {k}")
    return fig


def plot_token_grid(grid: np.ndarray, ks: Sequence[int], spreads: Sequence[int]):
    """Heat map of :func:`token_error_grid`."""

    fig, (ax,) = figure(1, 6.4, 4.0)
    image = heatmap(
        ax,
        grid,
        ks,
        spreads,
        vmin=0.0,
        aspect="equal",
        xlabel="spread of lengths (±)",
        ylabel="K",
        title="Mean of means vs token mean, length-grouped",
    )
    fig.colorbar(image, ax=ax, label="relative gradient error")
    return fig


def plot_token_widget(model: nn.Module, lines: Sequence[str], vocab: Vocab, k: int, spread: int):
    """The widget's picture: gradient error of mean-of-means for random and length-grouped micro-batches."""

    errors = [token_error(model, lines, vocab, k, spread, sort) for sort in (False, True)]
    fig, (ax,) = figure(1, 6.4, 3.2)
    ax.bar(["random micro-batches", "length-grouped"], errors, color=[PALETTE["blue"], PALETTE["vermillion"]])
    decorate(ax, "", "relative gradient error", f"mean of means vs token mean: K = {k}, lengths 50 ± {spread}")
    return fig
