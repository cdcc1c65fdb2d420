r"""Chapter 8's checkpointing section: a small block with a BatchNorm under ``torch.utils.checkpoint``, whose rerun
in backward updates the running statistics a second time.

One window through the block four ways (:data:`CHECKPOINT_METHODS`: no checkpointing, plain checkpointing, the
momentum corrected to :math:`1-\sqrt{1-m}`, and :func:`gradaccum.coupled.checkpoint_keeping_bn_stats`), the
weight one optimizer step gives the new statistics, measured, and its figure.
:mod:`gradaccum.book.ch08_beyond_batchnorm` re-exports the public names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradaccum import coupled
from gradaccum._tensors import relative_error
from gradaccum._validate import require_k
from gradaccum.accumulate import flat_grad
from gradaccum.book.data import flat_digits
from gradaccum.book.plotting import PALETTE, decorate, figure


def bn_block(seed: int = 0, momentum: float = 0.1) -> nn.Sequential:
    """Linear(64, 16) → BatchNorm1d(16) → ReLU → Linear(16, 10), float64; the weights depend only on ``seed``
    (drawn in float32 and then cast, whatever torch's default dtype)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        f32 = torch.float32
        return nn.Sequential(
            nn.Linear(64, 16, dtype=f32),
            nn.BatchNorm1d(16, momentum=momentum, dtype=f32),
            nn.ReLU(),
            nn.Linear(16, 10, dtype=f32),
        ).double()


class Checkpointed(nn.Module):
    """``module`` under ``torch.utils.checkpoint`` (with ``keep``:
    :func:`gradaccum.coupled.checkpoint_keeping_bn_stats`), a model to hand to :func:`gradaccum.checker.check`."""

    def __init__(self, module: nn.Module, keep: bool = False):
        super().__init__()
        self.module, self.keep = module, keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep:
            return coupled.checkpoint_keeping_bn_stats(self.module, x)
        return checkpoint(self.module, x, use_reentrant=False)


@dataclass
class CheckpointRun:
    tracked: dict[str, int]  # num_batches_tracked after one window
    mean_error: dict[str, float]  # running mean against the run without checkpointing (relative)
    grad_error: dict[str, float]


def checkpoint_window(x: torch.Tensor, y: torch.Tensor, k: int, b: int, momentum: float = 0.1) -> CheckpointRun:
    """One window of ``k`` micro-batches through :func:`bn_block` without checkpointing, with
    ``torch.utils.checkpoint``, with the momentum corrected to :math:`1-\\sqrt{1-m}`, and with
    :func:`gradaccum.coupled.checkpoint_keeping_bn_stats`."""
    require_k(k)
    xs, ys = flat_digits(x[: k * b]), y[: k * b]
    corrected = 1 - math.sqrt(1 - momentum)
    nets = {
        "no checkpointing": bn_block(0, momentum),
        "checkpoint": bn_block(0, momentum),
        "checkpoint, momentum 1 − √(1 − m)": bn_block(0, corrected),
        "checkpoint, statistics kept": bn_block(0, momentum),
    }
    ce = nn.CrossEntropyLoss()
    for xb, yb in zip(xs.chunk(k), ys.chunk(k)):
        for name, net in nets.items():
            (ce(_run_block(net, xb, name), yb) / k).backward()
    ref = nets["no checkpointing"]
    means = {n: cast(torch.Tensor, net[1].running_mean) for n, net in nets.items()}
    return CheckpointRun(
        tracked={n: int(net[1].num_batches_tracked) for n, net in nets.items()},  # type: ignore[arg-type]
        mean_error={n: relative_error(mean, means["no checkpointing"]) for n, mean in means.items()},
        grad_error={n: relative_error(flat_grad(net), flat_grad(ref)) for n, net in nets.items()},
    )


def _run_block(net: nn.Module, xb: torch.Tensor, method: str) -> torch.Tensor:
    """``net(xb)`` as ``method`` runs it: plainly, under ``torch.utils.checkpoint``, or with the statistics kept."""
    if method == "no checkpointing":
        return net(xb)
    if method == "checkpoint, statistics kept":
        return coupled.checkpoint_keeping_bn_stats(net, xb)
    return checkpoint(net, xb, use_reentrant=False)


def _forward_keep_graph(net: nn.Module, xb: torch.Tensor, method: str) -> None:
    _run_block(net, xb.clone().requires_grad_(), method).sum().backward()  # the rerun happens in backward


#: The four ways of the checkpointing section.
CHECKPOINT_METHODS = (
    "no checkpointing",
    "checkpoint",
    "checkpoint, momentum 1 − √(1 − m)",
    "checkpoint, statistics kept",
)


def measured_momentum(x: torch.Tensor, k: int, m: float, method: str) -> float:
    r"""The weight one optimizer step of K micro-batches gives the new statistics in a BatchNorm's running mean,
    *measured*: the same micro-batch (mean :math:`\mu`) is fed K times to a BatchNorm1d whose running mean starts
    at 0, so afterwards it holds :math:`w\mu`; returns :math:`w` (averaged over the channels)."""
    require_k(k)
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"method must be one of {CHECKPOINT_METHODS}, got {method!r}.")
    if not 0 < m <= 1:
        raise ValueError(f"the momentum must lie in (0, 1], got {m}.")
    momentum = 1 - math.sqrt(1 - m) if method == CHECKPOINT_METHODS[2] else m
    net = bn_block(0, momentum)
    linear, bn = net[0], net[1]
    assert isinstance(bn, nn.BatchNorm1d)
    bn.running_mean.zero_()  # type: ignore[union-attr]
    xb = flat_digits(x[:8])
    for _ in range(k):
        _forward_keep_graph(net, xb, method)
    with torch.no_grad():
        mu = linear(xb).mean(0)
    return float((bn.running_mean / mu).mean())


def plot_checkpoint_momentum(x: torch.Tensor, m: float, k: int, ks: Sequence[int] = (1, 2, 4, 8, 16, 32)):
    """Effective momentum per optimizer step against K: the formulas as lines (chapter 1's
    :math:`1-(1-m)^K`; checkpointing's :math:`1-(1-m)^{2K}`), each method measured at the chosen K as a marker."""
    fig, (ax,) = figure(1, 6.4, 3.4)
    grid = sorted(set(ks) | {k})
    ax.plot(
        grid,
        [coupled.recompute_momentum(m, kk, reruns=0) for kk in grid],
        "-",
        color=PALETTE["black"],
        label="$1-(1-m)^K$: no checkpointing",
    )
    ax.plot(
        grid,
        [coupled.recompute_momentum(m, kk) for kk in grid],
        "--",
        color=PALETTE["vermillion"],
        label="$1-(1-m)^{2K}$: checkpointing",
    )
    for method, marker, color in zip(
        CHECKPOINT_METHODS, "o^sD", [PALETTE["black"], PALETTE["vermillion"], PALETTE["blue"], PALETTE["green"]]
    ):
        ax.plot(
            [k],
            [measured_momentum(x, k, m, method)],
            marker,
            color=color,
            fillstyle="none",
            markersize=9,
            label=f"measured: {method}",
        )
    decorate(
        ax,
        "K (micro-batches per optimizer step)",
        "weight of the new statistics",
        f"BatchNorm momentum m = {m:g}",
        xscale="log",
        xticks=grid,
        legend=False,
    )
    ax.set_ylim(0, 1.05)
    ax.legend(frameon=False, fontsize=7, loc="lower right")
    return fig
