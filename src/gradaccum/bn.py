r"""Chapter 1: BatchNorm's micro-batch statistics under gradient accumulation.

In training mode a BatchNorm layer normalizes channel :math:`c` of a batch :math:`B` of size :math:`b` with

.. math::
    \hat\mu_B = \frac1b\sum_{i\in B} x_i, \qquad
    \hat\sigma^2_B = \frac1b\sum_{i\in B}(x_i-\hat\mu_B)^2 \quad\text{(biased)},

and updates its running statistics with momentum :math:`m` (PyTorch's default 0.1):

.. math::
    \bar\mu \leftarrow (1-m)\,\bar\mu + m\,\hat\mu_B, \qquad
    \bar\sigma^2 \leftarrow (1-m)\,\bar\sigma^2 + m\,\tfrac{b}{b-1}\hat\sigma^2_B \quad\text{(unbiased)}.

Under accumulation :math:`B` is a micro-batch: the statistics come from :math:`b` samples, not :math:`Kb`,
and the running statistics are updated :math:`K` times per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ._validate import require_k, require_micro_batch, require_momentum
from .accumulate import accumulated_gradient, agreement, full_batch_gradient
from .book.data import DigitsSplit
from .book.models import NormKind, batch_coupled_layers, make_cnn

# --------------------------------------------------------------------------- estimates from b samples


def batch_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean, biased variance and unbiased variance, as BatchNorm computes them.

    ``x`` has shape (N, C) or (N, C, *spatial); statistics are over every dimension except C.
    """
    if x.dim() < 2:
        raise ValueError(f"expected a tensor of shape (N, C, ...), got shape {tuple(x.shape)}.")
    dims = [0, *range(2, x.dim())]
    n = x.numel() // x.shape[1]
    if n < 2:
        raise ValueError("need at least 2 values per channel to compute an unbiased variance.")
    mean = x.mean(dims)
    biased = x.var(dims, correction=0)
    return mean, biased, biased * n / (n - 1)


def predicted_mean_variance(sigma2: float | np.ndarray, b: int | np.ndarray, n: int) -> float | np.ndarray:
    r"""Variance of the mean of b samples drawn without replacement from a population of n.

    .. math:: \operatorname{Var}(\hat\mu_b) = \frac{\sigma^2}{b}\cdot\frac{n-b}{n-1},

    where :math:`\sigma^2` is the population variance (divisor n). The second factor, the finite-population
    correction, is 1 − O(b/n); it vanishes at b = n, where every "micro-batch" is the whole population.
    """
    sizes = np.asarray(b)
    if n < 2 or np.any(sizes < 1) or np.any(sizes > n):
        raise ValueError(f"need n >= 2 and 1 <= b <= n, got b={b}, n={n}.")
    return sigma2 / b * (n - b) / (n - 1)


def biased_variance_factor(b: int) -> float:
    r"""Expected biased batch variance over the population variance for b i.i.d. samples: :math:`(b-1)/b`.

    BatchNorm normalizes training batches with this biased estimate but stores the unbiased one in
    ``running_var``; at b = 2 the training-time variance is on average half the population's.
    """
    require_micro_batch(b, batch_norm=False)
    return (b - 1) / b


def eval_train_mean_abs_ratio(b: int) -> float:
    r""":math:`\E|z_\text{eval}| / \E|z_\text{train}|` for Gaussian features, exactly.

    In training :math:`z = (x_i - \hat\mu_b)/\hat\sigma_b` with the biased :math:`\hat\sigma_b`, so every
    micro-batch's normalized values have root-mean-square exactly 1 (ε aside): the numerator shrinks with the
    variance. In evaluation :math:`z = (x - \mu)/\sigma` has RMS 1 too. What differs is the shape:
    :math:`z_\text{train}^2/(b-1)` follows a :math:`\mathrm{Beta}(\tfrac12, \tfrac{b-2}{2})` law, so
    :math:`\E|z_\text{train}| = \sqrt{b-1}\,\Gamma(\tfrac{b-1}{2}) / (\sqrt\pi\,\Gamma(\tfrac b2))`, while
    :math:`\E|z_\text{eval}| = \sqrt{2/\pi}`. The ratio is
    :math:`\sqrt2\,\Gamma(\tfrac b2) / (\sqrt{b-1}\,\Gamma(\tfrac{b-1}{2}))`: 0.80 at b = 2, 0.92 at b = 4, → 1.
    """
    require_micro_batch(b)
    return math.exp(0.5 * math.log(2) + math.lgamma(b / 2) - 0.5 * math.log(b - 1) - math.lgamma((b - 1) / 2))


def normalized_feature_sizes(b: int, draws: int = 20000, seed: int = 0) -> tuple[float, float, float]:
    """Monte Carlo check of :func:`eval_train_mean_abs_ratio` with ``nn.BatchNorm1d`` itself: standard normal
    features, micro-batches of b in train mode against the population statistics (μ = 0, σ = 1) in eval mode
    (ε = 1e-12, negligible).

    Returns (RMS of training-mode outputs, RMS of eval-mode outputs, mean |eval| / mean |train|).
    """
    require_micro_batch(b)
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
    """

    b: int
    mean_var_ratio: float
    biased_var_ratio: float
    rel_mean_std: float


def moment_spread(features: torch.Tensor, b: int, draws: int = 2000, seed: int = 0) -> MomentSpread:
    """Draw ``draws`` micro-batches of size b (without replacement) from ``features`` (N, C) and measure.

    Channels with zero variance are left out.
    """
    require_micro_batch(b)
    if features.dim() != 2:
        raise ValueError(f"features must have shape (N, C), got {tuple(features.shape)}.")
    n = features.shape[0]
    if b > n:
        raise ValueError(f"micro-batch size {b} exceeds the {n} available samples.")
    feats = features.detach().double().cpu()
    sigma2 = feats.var(0, correction=0)
    keep = sigma2 > 1e-12 * sigma2.max()
    feats, sigma2 = feats[:, keep], sigma2[keep]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(n, generator=gen)[:b] for _ in range(draws)])  # (draws, b)
    batches = feats[idx]  # (draws, b, C)
    means = batches.mean(1)
    biased = batches.var(1, correction=0)
    predicted = predicted_mean_variance(sigma2, b, n)
    return MomentSpread(
        b=b,
        mean_var_ratio=float((means.var(0) / predicted).mean()),
        biased_var_ratio=float((biased.mean(0) / sigma2).mean()),
        rel_mean_std=float((means.std(0) / sigma2.sqrt()).mean()),
    )


@torch.no_grad()
def layer_inputs(model: nn.Module, x: torch.Tensor, layer: str) -> torch.Tensor:
    """The input that the submodule named ``layer`` receives when ``model(x)`` runs in eval mode.

    Used to look at the numbers a BatchNorm layer computes its statistics from. The model's mode is restored.
    """
    modules = dict(model.named_modules())
    if layer not in modules:
        raise ValueError(f"model has no submodule {layer!r}; it has {[n for n in modules if n]}.")
    captured: list[torch.Tensor] = []
    handle = modules[layer].register_forward_hook(lambda mod, inp, out: captured.append(inp[0].detach()))
    was_training = model.training
    try:
        model.eval()
        model(x)
    finally:
        handle.remove()
        model.train(was_training)
    return captured[0]


# ------------------------------------------------------------------------------- running statistics


def effective_momentum(m: float, k: int) -> float:
    r"""Momentum of the running statistics per optimizer step when they update once per micro-batch.

    After K updates the old value keeps weight :math:`(1-m)^K`, so per optimizer step the running
    statistics move with momentum :math:`1-(1-m)^K` (0.57 for m = 0.1, K = 8), not m.
    """
    require_momentum(m)
    require_k(k)
    return 1.0 - (1.0 - m) ** k


def corrected_momentum(m: float, k: int) -> float:
    r"""Per-micro-batch momentum :math:`m' = 1-(1-m)^{1/K}` whose K updates decay the old value as one update
    with momentum m does (about m/K for small m)."""
    require_momentum(m)
    require_k(k)
    return 1.0 - (1.0 - m) ** (1.0 / k)


def micro_batch_weights(m: float, k: int) -> np.ndarray:
    r"""Weight of micro-batch j = 0..K−1 in the running statistic after one accumulated step.

    Starting from :math:`\bar\mu_0`, K updates with momentum m give
    :math:`\bar\mu_K = (1-m)^K\bar\mu_0 + \sum_j m(1-m)^{K-1-j}\hat\mu_j`: later micro-batches weigh more.
    """
    require_momentum(m)
    require_k(k)
    return np.array([m * (1.0 - m) ** (k - 1 - j) for j in range(k)])


def set_bn_momentum(model: nn.Module, m: float) -> int:
    """Set the momentum of every BatchNorm layer of ``model`` to m; returns how many layers were changed."""
    require_momentum(m)
    count = 0
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.momentum = m
            count += 1
    return count


# ------------------------------------------------------------------- the widget's pure function


@dataclass(frozen=True)
class MicrobatchEffect:
    """What accumulating K micro-batches of size b does, on one batch of K·b digit images.

    ``rel_error``/``cosine``: accumulated vs full-batch gradient of the SmallCNN, per normalization;
    ``rel_mean_std``: spread std(μ̂_b)/σ of the micro-batch means that the head's BatchNorm1d computes, over
    micro-batches of size b drawn from all of x (it depends on b, not on K).
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
    n = k * b
    if n > x.shape[0]:
        raise ValueError(f"K·b = {k}·{b} = {n} exceeds the {x.shape[0]} images available; lower K or b.")
    xb, yb = x[:n].double(), y[:n]
    loss_fn = nn.CrossEntropyLoss()
    rel, cos = {}, {}
    for norm in norms:
        model = make_cnn(norm, seed=seed, device=x.device).train()
        a = agreement(full_batch_gradient(model, loss_fn, xb, yb), accumulated_gradient(model, loss_fn, xb, yb, k))
        rel[norm], cos[norm] = a.rel_error, a.cosine
    bn_model = make_cnn("batch", seed=seed, device=x.device)
    feats = layer_inputs(bn_model, x.double(), batch_coupled_layers(bn_model)[-1])
    spread = moment_spread(feats, b, draws=400, seed=seed) if b >= 2 else None
    return MicrobatchEffect(k, b, rel, cos, spread.rel_mean_std if spread else float("nan"))


# ------------------------------------------------------------------ the fingerprint on real data


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


def run_fingerprint(
    split: DigitsSplit,
    plan: dict[str, tuple[int, ...]],
    seeds: tuple[int, ...] = (0, 1, 2),
    batch_size: int = 64,
    epochs: int = 8,
    lr: float = 0.05,
) -> list[FingerprintRun]:
    """Train a fresh SmallCNN for every (norm, micro-batch size b, seed) in ``plan`` × ``seeds``.

    Every run sees the same batches of ``batch_size`` images in the same order (for a given seed) and takes
    one optimizer step per batch, with K = batch_size / b micro-batches: only b changes between runs.
    """
    from .accumulate import train

    runs = []
    for seed in seeds:
        for norm, sizes in plan.items():
            for b in sizes:
                require_micro_batch(b, batch_norm=norm == "batch")
                if batch_size % b:
                    raise ValueError(f"micro-batch size {b} does not divide the batch size {batch_size}.")
                model = make_cnn(norm, seed=seed, device=split.x_train.device)  # type: ignore[arg-type]
                r = train(model, split.x_train, split.y_train, split.x_val, split.y_val,
                          batch_size=batch_size, k=batch_size // b, epochs=epochs, lr=lr, seed=seed)
                runs.append(FingerprintRun(norm, b, r.k, seed, r.optimizer_steps, r.val_acc, r.val_acc_train_mode))
    return runs


def summarize_fingerprint(runs: list[FingerprintRun]) -> dict[tuple[str, int], dict[str, float]]:
    """Mean, min and max over seeds of the validation accuracy and of the train/eval gap, per (norm, b)."""
    table: dict[tuple[str, int], dict[str, float]] = {}
    for key in dict.fromkeys((r.norm, r.b) for r in runs):
        acc = np.array([r.val_acc for r in runs if (r.norm, r.b) == key])
        gap = np.array([r.gap for r in runs if (r.norm, r.b) == key])
        table[key] = {"acc": acc.mean(), "acc_min": acc.min(), "acc_max": acc.max(),
                      "gap": gap.mean(), "gap_min": gap.min(), "gap_max": gap.max()}
    return table


def format_fingerprint(table: dict[tuple[str, int], dict[str, float]], batch_size: int = 64) -> str:
    """The summary as a fixed-width text table, percentages to one decimal."""
    lines = [f"{'norm':<6} {'b':>3} {'K':>3}  {'val acc (mean, min–max)':<24} {'train-mode − eval (mean)':>24}"]
    for (norm, b), s in table.items():
        acc = f"{100 * s['acc']:5.1f}% ({100 * s['acc_min']:.1f}–{100 * s['acc_max']:.1f})"
        lines.append(f"{norm:<6} {b:>3} {batch_size // b:>3}  {acc:<24} {100 * s['gap']:>+23.1f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- figures


def plot_moment_spread(spreads: list[MomentSpread], n: int):
    """Measured vs predicted spread of the micro-batch mean, and E[biased variance]/σ² vs (b − 1)/b."""
    from .book.plotting import NORM_COLORS, PALETTE, decorate, figure

    fig, (ax1, ax2) = figure(2, 9.6, 3.6)
    bs = np.array([s.b for s in spreads])
    fine = np.arange(2, bs.max() + 1)
    ax1.plot(fine, np.sqrt(predicted_mean_variance(1.0, fine, n)), color=PALETTE["black"],
             label=r"theory $\sqrt{(n-b)/(b(n-1))}$")
    ax1.plot(bs, [s.rel_mean_std for s in spreads], "o", color=NORM_COLORS["batch"], label="measured")
    decorate(ax1, "micro-batch size b", r"std($\hat\mu_b$) / $\sigma$", "Spread of the batch mean",
             xscale="log", yscale="log", xticks=bs)
    ax2.plot(fine, (fine - 1) / fine, color=PALETTE["black"], label=r"theory $(b-1)/b$")
    ax2.plot(bs, [s.biased_var_ratio for s in spreads], "o", color=NORM_COLORS["batch"], label="measured")
    decorate(ax2, "micro-batch size b", r"E[$\hat\sigma^2_b$] / $\sigma^2$", "Biased batch variance",
             xscale="log", xticks=bs)
    return fig


def plot_gradient_agreement(rows: dict[str, dict[int, float]]):
    """Relative error of the accumulated gradient vs micro-batch size, one line per normalization.

    Exact zeros (K = 1) cannot be drawn on a log axis and are left out.
    """
    from .book.plotting import NORM_COLORS, NORM_MARKERS, decorate, figure

    fig, (ax,) = figure()
    for norm, by_b in rows.items():
        bs = sorted(b for b in by_b if by_b[b] > 0)
        ax.plot(bs, [by_b[b] for b in bs], marker=NORM_MARKERS[norm], color=NORM_COLORS[norm], label=f"{norm} norm")
    decorate(ax, "micro-batch size b (K = 64 / b)", "relative error of the gradient",
             "Accumulated vs full-batch gradient (float64)", xscale="log", yscale="log", xticks=bs)
    return fig


def plot_momentum_weights(m: float, k: int):
    """Weight of each micro-batch's statistic in the running value after one step, three ways."""
    from .book.plotting import PALETTE, decorate, figure

    fig, (ax,) = figure()
    j = np.arange(k)
    width = 0.27
    ax.bar(j - width, micro_batch_weights(m, k), width, color=PALETTE["vermillion"], label=f"m = {m} each update")
    ax.bar(j, micro_batch_weights(corrected_momentum(m, k), k), width, color=PALETTE["blue"],
           label=f"corrected m' = {corrected_momentum(m, k):.4f}")
    ax.bar(j + width, np.full(k, m / k), width, color=PALETTE["green"], label="one full-batch update (m/K each)")
    decorate(ax, "micro-batch j in the accumulation window", "weight in the running statistic",
             f"Running statistics after one step, K = {k}", xticks=list(j))
    return fig


def plot_fingerprint(table: dict[tuple[str, int], dict[str, float]], batch_size: int = 64):
    """Validation accuracy vs micro-batch size (mean and min–max over seeds), per normalization."""
    from .book.plotting import NORM_COLORS, NORM_MARKERS, decorate, figure

    fig, (ax,) = figure()
    for norm in dict.fromkeys(n for n, _ in table):
        bs = sorted(b for n, b in table if n == norm)
        mean = np.array([100 * table[norm, b]["acc"] for b in bs])
        lo = mean - [100 * table[norm, b]["acc_min"] for b in bs]
        hi = [100 * table[norm, b]["acc_max"] for b in bs] - mean
        ax.errorbar(bs, mean, yerr=[lo, hi], marker=NORM_MARKERS[norm], color=NORM_COLORS[norm], capsize=3,
                    label=f"{norm} norm")
    all_b = sorted({b for _, b in table})
    decorate(ax, f"micro-batch size b (K = {batch_size} / b, one optimizer step per {batch_size} images)",
             "validation accuracy (%)", "Digits, same batches and steps, only b changes", xscale="log",
             xticks=all_b)
    return fig


def plot_microbatch_effect(k: int, b: int, x: torch.Tensor, y: torch.Tensor):
    """The widget's picture: gradient error per normalization, and the spread of BatchNorm's batch mean."""
    from .book.plotting import NORM_COLORS, PALETTE, decorate, figure

    effect = microbatch_effect(k, b, x, y)
    fig, (ax1, ax2) = figure(2, 9.6, 3.4)
    norms = list(effect.rel_error)
    ax1.bar(norms, [max(effect.rel_error[n], 1e-17) for n in norms], color=[NORM_COLORS[n] for n in norms])
    for i, n in enumerate(norms):
        ax1.annotate(f"cos {effect.cosine[n]:.3f}", (i, max(effect.rel_error[n], 1e-17)), ha="center",
                     va="bottom", fontsize=8)
    decorate(ax1, "normalization", "relative gradient error", f"K = {k}, b = {b} vs one batch of {k * b}",
             yscale="log")
    ax1.set_ylim(1e-17, 10)
    sizes = np.array([2, 4, 8, 16, 32, 64, 128])
    ax2.plot(sizes, np.sqrt(predicted_mean_variance(1.0, sizes, x.shape[0])), color=PALETTE["black"], label="theory")
    ax2.plot([b], [effect.rel_mean_std], "o", color=NORM_COLORS["batch"], label=f"measured at b = {b}")
    decorate(ax2, "micro-batch size b", r"std($\hat\mu_b$) / $\sigma$", "Spread of BatchNorm's batch mean",
             xscale="log", yscale="log", xticks=sizes)
    return fig


def effect_grid(ks: tuple[int, ...], bs: tuple[int, ...], x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """BatchNorm's relative gradient error for every (K, b) in the grid; rows are K, columns b."""
    return np.array([[microbatch_effect(k, b, x, y, norms=("batch",)).rel_error["batch"] for b in bs] for k in ks])


def plot_effect_grid(grid: np.ndarray, ks: tuple[int, ...], bs: tuple[int, ...]):
    """Heat map of :func:`effect_grid`, each cell labelled with its value."""
    from .book.plotting import figure, heatmap

    fig, (ax,) = figure(1, 6.4, 4.0)
    image = heatmap(ax, grid, ks, bs, vmin=0.0, aspect="equal", xlabel="micro-batch size b",
                    ylabel="accumulation steps K", title="BatchNorm: relative error of the accumulated gradient")
    fig.colorbar(image, ax=ax, label="‖g_acc − g_full‖ / ‖g_full‖")
    return fig
