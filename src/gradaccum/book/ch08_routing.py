"""Chapter 8's mixture-of-experts section: a small linear router over the digits' pixels, and the Switch
load-balancing loss of its window against the mean of its micro-batches' losses.

Plain accumulation averages per-micro-batch products of routing fractions and mean probabilities, which exceeds
the window's loss by N times their covariance across micro-batches (:func:`aux_covariance`); every micro-batch
given the window's fractions sums to the window's loss (:func:`gradaccum.coupled.window_fractions`).
:mod:`gradaccum.book.ch08_beyond_batchnorm` re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradaccum import coupled
from gradaccum._validate import require_k
from gradaccum.book.data import flat_digits
from gradaccum.book.plotting import PALETTE, decorate, figure


def router(seed: int = 0, experts: int = 4) -> nn.Linear:
    """A linear router from the 64 pixels to ``experts`` experts (float64); the weights depend only on ``seed``
    (drawn in float32 and then cast, whatever torch's default dtype)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(64, experts, dtype=torch.float32).double()


def aux_losses(x: torch.Tensor, ks: Sequence[int], n: int = 64, seed: int = 0) -> dict[str, list[float]]:
    """The Switch load-balancing loss of ``n`` digits: the window's, the mean of per-micro-batch losses, and the
    per-micro-batch losses with the window's fractions (the fix), for each K."""
    r = router(seed)
    xs = flat_digits(x[:n])
    probs = lambda t: r(t).softmax(1)  # noqa: E731
    with torch.no_grad():
        window = float(coupled.switch_aux_loss(probs(xs)))
        out: dict[str, list[float]] = {"window": [], "per micro-batch": [], "window fractions": []}
        for k in ks:
            require_k(k)
            if n % k:  # torch.chunk would cut fewer or unequal micro-batches, which 1/K does not weigh
                raise ValueError(f"K = {k} does not divide the {n} tokens of the window; pick a K that divides {n}.")
            micro = list(xs.chunk(k))
            f = coupled.window_fractions(probs, micro, r.out_features)
            out["window"].append(window)
            out["per micro-batch"].append(float(sum(coupled.switch_aux_loss(probs(m)) for m in micro) / k))
            out["window fractions"].append(float(sum(coupled.switch_aux_loss(probs(m), f) for m in micro) / k))
    return out


def aux_covariance(x: torch.Tensor, k: int, n: int = 64, seed: int = 0) -> float:
    r""":math:`N\sum_i \frac1K\sum_k (f^k_i - f_i)(P^k_i - P_i)`: the covariance, across the K micro-batches of a
    window of ``n`` digits, of each expert's routing fraction and mean probability. Because the micro-batches'
    :math:`f^k` and :math:`P^k` average to the window's, the mean of the per-micro-batch losses exceeds the
    window's loss by exactly this."""
    probs = _window_probs(x, k, n, seed)
    experts = probs.shape[1]
    f = torch.stack([coupled.expert_fractions(p.argmax(1), experts) for p in probs.chunk(k)])
    p_mean = torch.stack([p.mean(0) for p in probs.chunk(k)])
    return float(experts * ((f - f.mean(0)) * (p_mean - p_mean.mean(0))).sum(1).mean())


def _window_probs(x: torch.Tensor, k: int, n: int, seed: int) -> torch.Tensor:
    """The router's probabilities for a window of the first ``n`` digits, which K micro-batches must cut evenly."""
    require_k(k)
    if n % k:
        raise ValueError(f"K = {k} does not divide the {n} tokens of the window; pick a K that divides {n}.")
    with torch.no_grad():
        return router(seed)(flat_digits(x[:n])).softmax(1)


def plot_aux(ks: Sequence[int], losses: dict[str, list[float]]):
    fig, (ax,) = figure(1, 6.4, 3.2)
    styles = {
        "window": ("-", PALETTE["black"]),
        "per micro-batch": ("o-", PALETTE["vermillion"]),
        "window fractions": ("s--", PALETTE["blue"]),
    }
    for name, values in losses.items():
        style, color = styles[name]
        ax.plot(ks, values, style, color=color, label=name)
    decorate(
        ax,
        "K (micro-batches of 64 / K digits)",
        "load-balancing loss",
        "Switch auxiliary loss, 4 experts",
        xscale="log",
        xticks=ks,
    )
    return fig


def plot_aux_window(x: torch.Tensor, k: int, n: int = 64, seed: int = 0):
    """The widget's picture: each micro-batch's load-balancing loss (what plain accumulation averages), the
    window's loss, and the fractions each micro-batch counts, for ``n`` digits cut into K micro-batches."""
    probs = _window_probs(x, k, n, seed)
    micro = [coupled.switch_aux_loss(p) for p in probs.chunk(k)]
    window = float(coupled.switch_aux_loss(probs))
    fig, (ax,) = figure(1, 6.4, 3.2)
    plain = float(sum(micro)) / k
    ax.bar(range(1, k + 1), [float(v) for v in micro], color=PALETTE["vermillion"], label="per micro-batch")
    ax.axhline(plain, color=PALETTE["vermillion"], linestyle="--", label="their mean (plain)")
    ax.axhline(window, color=PALETTE["black"], label="the window's (= window fractions)")
    decorate(
        ax,
        "micro-batch",
        "load-balancing loss",
        f"{n // k} tokens per micro-batch: mean {plain:.4f}, window {window:.4f} (+{plain - window:.4f})",
        legend=False,
    )
    ax.set_ylim(0, 1.45 * max(2.0, max(float(v) for v in micro)))
    ax.legend(frameon=False, fontsize=7, ncol=2, loc="upper left")
    return fig
