"""Chapter 1, "Micro-batch statistics": the digits experiments, the BatchNorm fingerprint runs, the effect grid
and the figures.

The book layer over :mod:`gradaccum.bn_statistics` (the torch-only tools the chapter derives).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradaccum._validate import require_count, require_k, require_micro_batch, require_tensor
from gradaccum.accumulate import (
    accumulated_gradient,
    agreement,
    full_batch_gradient,
    train,
)
from gradaccum.bn_statistics import (
    corrected_momentum,
    layer_inputs,
    micro_batch_weights,
    predicted_mean_variance,
)
from gradaccum.book.data import DigitsSplit
from gradaccum.book.models import NormKind, batch_coupled_layers, make_cnn
from gradaccum.book.parallel import run_jobs
from gradaccum.book.plotting import (
    NORM_COLORS,
    NORM_MARKERS,
    PALETTE,
    decorate,
    figure,
    heatmap,
)
from gradaccum.book.tables import Table


def normalized_feature_sizes(b: int, draws: int = 20000, seed: int = 0) -> tuple[float, float, float]:
    """Monte Carlo check of :func:`eval_train_mean_abs_ratio` with ``nn.BatchNorm1d`` itself: standard normal
    features, micro-batches of b in train mode against the population statistics (μ = 0, σ = 1) in eval mode
    (ε = 1e-12, negligible).

    Returns (RMS of training-mode outputs, RMS of eval-mode outputs, mean |eval| / mean |train|).
    """
    require_micro_batch(b)
    require_count(draws, "draws")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, draws, generator=gen, dtype=torch.float64)  # column j: micro-batch j of b samples
    with torch.no_grad():  # fresh running statistics are the population's, (0, 1)
        z_eval = nn.BatchNorm1d(draws, affine=False, eps=1e-12).double().eval()(x)
        z_train = nn.BatchNorm1d(draws, affine=False, eps=1e-12).double().train()(x)  # one channel per micro-batch
    rms = lambda z: float(z.pow(2).mean().sqrt())  # noqa: E731
    return rms(z_train), rms(z_eval), float(z_eval.abs().mean() / z_train.abs().mean())


@dataclass(frozen=True)
class MomentSpread:
    """Empirical behaviour of micro-batch statistics of size b, averaged over channels.

    ``mean_var_ratio`` = measured Var(μ̂_b) / predicted Var(μ̂_b) (1 when the theory holds);
    ``biased_var_ratio`` = measured E[σ̂²_b] / σ² (theory: (b − 1)/b);
    ``rel_mean_std`` = std(μ̂_b)/σ, the spread of the batch mean in units of the channel's own spread.
    The ``*_se`` fields are their Monte Carlo standard errors: the draws are cut into :data:`REPLICATES` equal
    groups, each measured alone, and the standard error is the groups' standard deviation over
    √:data:`REPLICATES` (NaN with fewer than two draws per group).
    """

    b: int
    mean_var_ratio: float
    biased_var_ratio: float
    rel_mean_std: float
    mean_var_se: float
    biased_var_se: float
    rel_mean_std_se: float


#: How many groups :func:`moment_spread` cuts its draws into to estimate its standard errors.
REPLICATES = 20


def moment_spread(features: torch.Tensor, b: int, draws: int = 2000, seed: int = 0) -> MomentSpread:
    """Draw ``draws`` micro-batches of size b (without replacement) from ``features`` (N, C) and measure.

    Channels whose variance is below 1e-12 of the largest channel's (constant up to rounding) are left out; b must
    be below N (a micro-batch of all N samples has no spread). Memory stays bounded for any number of draws (the
    micro-batches are gathered 1,000 at a time).
    """
    require_micro_batch(b)
    require_count(draws, "draws (a spread needs at least two micro-batches)", minimum=2)
    features = require_tensor(features, "features")
    if features.dim() != 2:
        raise ValueError(f"features must have shape (N, C), got {tuple(features.shape)}.")
    n = features.shape[0]
    if b >= n:
        raise ValueError(
            f"micro-batch size {b} must be below the {n} available samples: a micro-batch of all of "
            "them always has the same mean (its spread is 0, and the ratio to it undefined)."
        )
    feats = features.detach().double().cpu()
    if not bool(torch.isfinite(feats).all()):
        raise ValueError("features hold NaN or inf values; pass finite activations.")
    sigma2 = feats.var(0, correction=0)
    keep = sigma2 > 1e-12 * sigma2.max()
    if not bool(keep.any()):
        raise ValueError("every channel of features is constant: there is no spread to measure.")
    feats, sigma2 = feats[:, keep], sigma2[keep]
    feats = feats - feats.mean(0)  # centred: the sums of squares below lose nothing to a large common mean
    gen = torch.Generator().manual_seed(seed)
    mean_parts, biased_parts = [], []
    for start in range(0, draws, 1000):  # the b largest of n uniform keys: a uniform b-subset of the n samples
        rows = min(1000, draws - start)
        picked = torch.rand(rows, n, generator=gen).topk(b).indices
        batch = feats.index_select(0, picked.flatten()).view(rows, b, -1)
        mean = batch.sum(1) / b
        mean_parts.append(mean)
        biased_parts.append((batch * batch).sum(1) / b - mean * mean)
    means, biased = torch.cat(mean_parts), torch.cat(biased_parts)  # (draws, C)
    predicted = predicted_mean_variance(sigma2, b, n)

    def ratios(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [(mu.var(0) / predicted).mean(), (var.mean(0) / sigma2).mean(), (mu.std(0) / sigma2.sqrt()).mean()]
        )

    whole = ratios(means, biased)
    per = draws // REPLICATES
    if per >= 2:
        groups = torch.stack(
            [ratios(means[i * per : (i + 1) * per], biased[i * per : (i + 1) * per]) for i in range(REPLICATES)]
        )
        se = groups.std(0) / REPLICATES**0.5
    else:
        se = torch.full((3,), float("nan"), dtype=torch.float64)
    return MomentSpread(b, *(float(v) for v in whole), *(float(v) for v in se))


def moment_theory(b: int, n: int) -> tuple[float, float]:
    r"""The exact expectations :func:`moment_spread` measures, for micro-batches of b drawn without replacement
    from n samples: :math:`\E[\hat\sigma^2_b]/\sigma^2 = \frac{b-1}{b}\cdot\frac{n}{n-1}` and
    :math:`\operatorname{std}(\hat\mu_b)/\sigma = \sqrt{(n-b)/(b\,(n-1))}` (σ² with divisor n)."""
    require_micro_batch(b)
    require_count(n, "n (the number of samples)", minimum=b + 1)
    return (b - 1) / b * n / (n - 1), float(predicted_mean_variance(1.0, b, n)) ** 0.5


def spread_deviations(s: MomentSpread, n: int) -> tuple[float, float, float]:
    """How many of its Monte Carlo standard errors each measurement of ``s`` lies from :func:`moment_theory`
    (the variance ratio from 1): (variance of the mean, biased variance, spread of the mean). NaN where the
    standard error is (fewer than two draws per group)."""
    biased, spread = moment_theory(s.b, n)
    return (
        (s.mean_var_ratio - 1) / s.mean_var_se,
        (s.biased_var_ratio - biased) / s.biased_var_se,
        (s.rel_mean_std - spread) / s.rel_mean_std_se,
    )


def moment_spread_table(spreads: list[MomentSpread], n: int) -> Table:
    """Each measurement of :func:`moment_spread` ± its standard error, next to :func:`moment_theory`."""
    rows = []
    for s in spreads:
        biased, spread = moment_theory(s.b, n)
        rows.append(
            [
                s.b,
                f"{s.mean_var_ratio:.3f} ± {s.mean_var_se:.3f}",
                f"{s.biased_var_ratio:.4f} ± {s.biased_var_se:.4f}",
                f"{biased:.4f}",
                f"{s.rel_mean_std:.4f} ± {s.rel_mean_std_se:.4f}",
                f"{spread:.4f}",
            ]
        )
    return Table(["b", "Var(mean): measured/theory", "E[biased var]/σ²", "theory", "std(mean)/σ", "theory"], rows)


@dataclass(frozen=True)
class MicrobatchEffect:
    """What accumulating K micro-batches of size b does, on one batch of K·b digit images.

    ``rel_error``/``cosine``: accumulated vs full-batch gradient of the SmallCNN, per normalization;
    ``rel_mean_std``: spread std(μ̂_b)/σ of the micro-batch means that the head's BatchNorm1d computes, over
    micro-batches of size b drawn from all of x (it depends on b, not on K); NaN for b = 1, where there is no
    BatchNorm network to measure (a micro-batch of one is refused with BatchNorm).
    """

    k: int
    b: int
    rel_error: dict[str, float]
    cosine: dict[str, float]
    rel_mean_std: float


def microbatch_effect(
    k: int,
    b: int,
    x: torch.Tensor,
    y: torch.Tensor,
    norms: tuple[NormKind, ...] = ("batch", "group", "layer"),
    seed: int = 0,
) -> MicrobatchEffect:
    """Compare accumulated and full-batch gradients on the first K·b samples of (x, y) for each norm.

    The networks are freshly initialized with ``seed`` (the same weights for every K and b), in float64.
    """
    require_k(k)
    require_micro_batch(b, batch_norm="batch" in norms)
    require_tensor(x, "x")
    require_tensor(y, "y")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(
            f"y holds class labels for the cross-entropy: an integer tensor, got {y.dtype}; convert it with y.long()."
        )
    n = k * b
    if n > x.shape[0]:
        raise ValueError(f"K·b = {k}·{b} = {n} exceeds the {x.shape[0]} images available; lower K or b.")
    xb, yb = x[:n].double(), y[:n]
    loss_fn = nn.CrossEntropyLoss()
    rel: dict[str, float] = {}
    cos: dict[str, float] = {}
    for norm in norms:
        model = make_cnn(norm, seed=seed, device=x.device).train()
        a = agreement(full_batch_gradient(model, loss_fn, xb, yb), accumulated_gradient(model, loss_fn, xb, yb, k))
        rel[norm], cos[norm] = a.rel_error, a.cosine
    bn_model = make_cnn("batch", seed=seed, device=x.device)
    feats = layer_inputs(bn_model, x.double(), batch_coupled_layers(bn_model)[-1])
    spread = moment_spread(feats, b, draws=400, seed=seed) if b >= 2 else None
    return MicrobatchEffect(k, b, rel, cos, spread.rel_mean_std if spread else float("nan"))


@dataclass(frozen=True)
class FingerprintRun:
    """One training run of the digits experiment: normalization, micro-batch size, seed and its result."""

    norm: str
    b: int
    k: int
    seed: int
    steps: int
    val_acc: float
    val_acc_train_mode: float

    @property
    def gap(self) -> float:
        """Validation accuracy with micro-batch statistics (train mode) minus with running statistics."""
        return self.val_acc_train_mode - self.val_acc


def _check_micro_batch(norm: NormKind, b: int, batch_size: int) -> None:
    require_micro_batch(b, batch_norm=norm == "batch")
    if batch_size % b:
        raise ValueError(f"micro-batch size {b} does not divide the batch size {batch_size}.")


def fingerprint_run(
    split: DigitsSplit, norm: NormKind, b: int, seed: int, batch_size: int = 64, epochs: int = 8, lr: float = 0.05
) -> FingerprintRun:
    """One run of :func:`run_fingerprint`: a fresh SmallCNN with ``norm`` layers, micro-batches of ``b``."""
    _check_micro_batch(norm, b, batch_size)
    model = make_cnn(norm, seed=seed, device=split.x_train.device)
    r = train(
        model,
        split.x_train,
        split.y_train,
        split.x_val,
        split.y_val,
        batch_size=batch_size,
        k=batch_size // b,
        epochs=epochs,
        lr=lr,
        seed=seed,
    )
    return FingerprintRun(norm, b, r.k, seed, r.optimizer_steps, r.val_acc, r.val_acc_train_mode)


def run_fingerprint(
    split: DigitsSplit,
    plan: dict[NormKind, tuple[int, ...]],
    seeds: tuple[int, ...] = (0, 1, 2),
    batch_size: int = 64,
    epochs: int = 8,
    lr: float = 0.05,
    workers: int = 1,
) -> list[FingerprintRun]:
    """Train a fresh SmallCNN for every (norm, micro-batch size b, seed) in ``plan`` × ``seeds``.

    Every run sees the same batches of ``batch_size`` images in the same order (for a given seed) and takes
    one optimizer step per batch, with K = batch_size / b micro-batches: only b changes between runs. The runs
    go to ``workers`` processes (:func:`gradaccum.book.parallel.run_jobs`: the same results, bit for bit).
    """
    for norm, sizes in plan.items():  # refuse a bad plan before training anything
        for b in sizes:
            _check_micro_batch(norm, b, batch_size)
    jobs = [
        dict(split=split, norm=norm, b=b, seed=seed, batch_size=batch_size, epochs=epochs, lr=lr)
        for seed in seeds
        for norm, sizes in plan.items()
        for b in sizes
    ]
    return run_jobs(fingerprint_run, jobs, workers)


def summarize_fingerprint(runs: list[FingerprintRun]) -> dict[tuple[str, int], dict[str, float]]:
    """Mean, min and max over seeds of the validation accuracy and of the train/eval gap, per (norm, b)."""
    table: dict[tuple[str, int], dict[str, float]] = {}
    for key in dict.fromkeys((r.norm, r.b) for r in runs):
        acc = np.array([r.val_acc for r in runs if (r.norm, r.b) == key])
        gap = np.array([r.gap for r in runs if (r.norm, r.b) == key])
        table[key] = {
            "acc": acc.mean(),
            "acc_min": acc.min(),
            "acc_max": acc.max(),
            "gap": gap.mean(),
            "gap_min": gap.min(),
            "gap_max": gap.max(),
        }
    return table


def format_fingerprint(table: dict[tuple[str, int], dict[str, float]], batch_size: int = 64) -> Table:
    """The summary as a table, percentages to one decimal."""
    rows = [
        [
            norm,
            b,
            batch_size // b,
            f"{100 * s['acc']:.1f}% ({100 * s['acc_min']:.1f}–{100 * s['acc_max']:.1f})",
            f"{100 * s['gap']:+.1f}%",
        ]
        for (norm, b), s in table.items()
    ]
    return Table(["norm", "b", "K", "val acc (mean, min–max)", "train-mode − eval (mean)"], rows)


def plot_moment_spread(spreads: list[MomentSpread], n: int):
    """Measured vs predicted spread of the micro-batch mean, and E[biased variance]/σ² vs (b − 1)/b."""

    fig, (ax1, ax2) = figure(2, 9.6, 3.6)
    bs = np.array([s.b for s in spreads])
    fine = np.arange(2, bs.max() + 1)
    ax1.plot(
        fine,
        np.sqrt(predicted_mean_variance(1.0, fine, n)),
        color=PALETTE["black"],
        label=r"theory $\sqrt{(n-b)/(b(n-1))}$",
    )
    ax1.plot(bs, [s.rel_mean_std for s in spreads], "o", color=NORM_COLORS["batch"], label="measured")
    decorate(
        ax1,
        "micro-batch size b",
        r"std($\hat\mu_b$) / $\sigma$",
        "Spread of the batch mean",
        xscale="log",
        yscale="log",
        xticks=bs,
    )
    ax2.plot(fine, (fine - 1) / fine, color=PALETTE["black"], label=r"theory $(b-1)/b$")
    ax2.plot(bs, [s.biased_var_ratio for s in spreads], "o", color=NORM_COLORS["batch"], label="measured")
    decorate(
        ax2, "micro-batch size b", r"E[$\hat\sigma^2_b$] / $\sigma^2$", "Biased batch variance", xscale="log", xticks=bs
    )
    return fig


def plot_gradient_agreement(rows: dict[str, dict[int, float]]):
    """Relative error of the accumulated gradient vs micro-batch size, one line per normalization.

    Exact zeros (K = 1) cannot be drawn on a log axis and are left out.
    """

    fig, (ax,) = figure()
    for norm, by_b in rows.items():
        bs = sorted(b for b in by_b if by_b[b] > 0)
        ax.plot(bs, [by_b[b] for b in bs], marker=NORM_MARKERS[norm], color=NORM_COLORS[norm], label=f"{norm} norm")
    decorate(
        ax,
        "micro-batch size b (K = 64 / b)",
        "relative error of the gradient",
        "Accumulated vs full-batch gradient (float64)",
        xscale="log",
        yscale="log",
        xticks=bs,
    )
    return fig


def plot_momentum_weights(m: float, k: int):
    """Weight of each micro-batch's statistic in the running value after one step, three ways."""

    fig, (ax,) = figure()
    j = np.arange(k)
    width = 0.27
    ax.bar(j - width, micro_batch_weights(m, k), width, color=PALETTE["vermillion"], label=f"m = {m} each update")
    ax.bar(
        j,
        micro_batch_weights(corrected_momentum(m, k), k),
        width,
        color=PALETTE["blue"],
        label=f"corrected m' = {corrected_momentum(m, k):.4f}",
    )
    ax.bar(j + width, np.full(k, m / k), width, color=PALETTE["green"], label="one full-batch update (m/K each)")
    decorate(
        ax,
        "micro-batch j in the accumulation window",
        "weight in the running statistic",
        f"Running statistics after one step, K = {k}",
        xticks=list(j),
    )
    return fig


def plot_fingerprint(table: dict[tuple[str, int], dict[str, float]], batch_size: int = 64):
    """Validation accuracy vs micro-batch size (mean and min–max over seeds), per normalization."""

    fig, (ax,) = figure()
    for norm in dict.fromkeys(n for n, _ in table):
        bs = sorted(b for n, b in table if n == norm)
        mean = np.array([100 * table[norm, b]["acc"] for b in bs])
        lo = mean - [100 * table[norm, b]["acc_min"] for b in bs]
        hi = [100 * table[norm, b]["acc_max"] for b in bs] - mean
        ax.errorbar(
            bs, mean, yerr=[lo, hi], marker=NORM_MARKERS[norm], color=NORM_COLORS[norm], capsize=3, label=f"{norm} norm"
        )
    all_b = sorted({b for _, b in table})
    decorate(
        ax,
        f"micro-batch size b (K = {batch_size} / b, one optimizer step per {batch_size} images)",
        "validation accuracy (%)",
        "Digits, same batches and steps, only b changes",
        xscale="log",
        xticks=all_b,
    )
    return fig


def plot_microbatch_effect(k: int, b: int, x: torch.Tensor, y: torch.Tensor):
    """The widget's picture: gradient error per normalization, and the spread of BatchNorm's batch mean."""

    effect = microbatch_effect(k, b, x, y)
    fig, (ax1, ax2) = figure(2, 9.6, 3.4)
    norms = list(effect.rel_error)
    ax1.bar(norms, [max(effect.rel_error[n], 1e-17) for n in norms], color=[NORM_COLORS[n] for n in norms])
    for i, n in enumerate(norms):
        ax1.annotate(
            f"cos {effect.cosine[n]:.3f}", (i, max(effect.rel_error[n], 1e-17)), ha="center", va="bottom", fontsize=8
        )
    decorate(ax1, "normalization", "relative gradient error", f"K = {k}, b = {b} vs one batch of {k * b}", yscale="log")
    ax1.set_ylim(1e-17, 10)
    sizes = np.array([2, 4, 8, 16, 32, 64, 128])
    ax2.plot(sizes, np.sqrt(predicted_mean_variance(1.0, sizes, x.shape[0])), color=PALETTE["black"], label="theory")
    ax2.plot([b], [effect.rel_mean_std], "o", color=NORM_COLORS["batch"], label=f"measured at b = {b}")
    decorate(
        ax2,
        "micro-batch size b",
        r"std($\hat\mu_b$) / $\sigma$",
        "Spread of BatchNorm's batch mean",
        xscale="log",
        yscale="log",
        xticks=sizes,
    )
    return fig


def bn_error_grid(
    ks: tuple[int, ...], bs: tuple[int, ...], x: torch.Tensor, y: torch.Tensor, seed: int = 0
) -> np.ndarray:
    """BatchNorm's relative gradient error for every (K, b) in the grid, on the SmallCNN initialized with
    ``seed``; rows are K, columns b."""
    return np.array(
        [[microbatch_effect(k, b, x, y, norms=("batch",), seed=seed).rel_error["batch"] for b in bs] for k in ks]
    )


def plot_bn_error_grid(grid: np.ndarray, ks: tuple[int, ...], bs: tuple[int, ...]):
    """Heat map of :func:`bn_error_grid`, each cell labelled with its value."""

    fig, (ax,) = figure(1, 6.4, 4.0)
    image = heatmap(
        ax,
        grid,
        ks,
        bs,
        vmin=0.0,
        aspect="equal",
        xlabel="micro-batch size b",
        ylabel="accumulation steps K",
        title="BatchNorm: relative error of the accumulated gradient",
    )
    fig.colorbar(image, ax=ax, label="‖g_acc − g_full‖ / ‖g_full‖")
    return fig
