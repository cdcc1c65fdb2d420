"""Chapter 2, PreciseBN: how the batch size of the recomputing pass changes the running statistics and the
accuracy, and the variance ratio of the first BatchNorm layer's input between two batch sizes. Re-exported by
:mod:`gradaccum.book.ch02_ghost_batchnorm`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.accumulate import accuracy
from gradaccum.precise_bn import precise_bn


@dataclass(frozen=True)
class PreciseBNSizeEffect:
    """How PreciseBN's statistics and accuracy change with the batch size of its pass, per BatchNorm layer
    (in call order): ``var_ratio`` = (min, max) over channels of running_var(batches of ``small``) /
    running_var(one batch of ``large``); ``mean_shift`` = max over channels of |Δ running_mean| / running_std;
    ``acc`` = eval-mode validation accuracy after each pass."""

    small: int
    large: int
    var_ratio: dict[str, tuple[float, float]]
    mean_shift: dict[str, float]
    acc_small: float
    acc_large: float


def _running_stats(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A BatchNorm layer's running mean and variance (every BatchNorm layer of the chapter tracks them)."""
    return cast(torch.Tensor, layer.running_mean), cast(torch.Tensor, layer.running_var)


def precise_bn_size_effect(
    model: nn.Module, x: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor, small: int, large: int
) -> PreciseBNSizeEffect:
    """Run PreciseBN on two copies of ``model``, in batches of ``small`` and of ``large``, and compare.

    ``update_bn`` averages what BatchNorm stores per batch — the mean and the *unbiased* variance — so at the
    first BatchNorm layer both sizes estimate the same population values for independent values (features); for
    feature maps Bessel's factor treats the b·H·W values of a batch as independent and can over-correct
    (:func:`first_layer_variance_ratio`). At later layers the inputs themselves differ, because during the pass
    every earlier layer normalizes each batch with that batch's statistics.
    """

    copies = {}
    for size in (small, large):
        copies[size] = copy.deepcopy(model)
        precise_bn(copies[size], x, size)
    ratios, shifts = {}, {}
    for name, layer in copies[small].named_modules():
        if isinstance(layer, _BatchNorm):
            mean, var = _running_stats(layer)
            ref_mean, ref_var = _running_stats(copies[large].get_submodule(name))
            ratio = var / ref_var
            ratios[name] = (float(ratio.min()), float(ratio.max()))
            shifts[name] = float(((mean - ref_mean).abs() / ref_var.sqrt()).max())
    accs = {size: accuracy(m.eval(), x_val, y_val) for size, m in copies.items()}
    return PreciseBNSizeEffect(small, large, ratios, shifts, accs[small], accs[large])


def first_layer_variance_ratio(model: nn.Module, x: torch.Tensor, small: int, large: int) -> tuple[float, float]:
    r"""The range over channels of the predicted ratio of the first BatchNorm layer's PreciseBN running variance
    with batches of ``small`` images to that with batches of ``large``, for 2-d feature maps.

    A batch of b whole images has :math:`n = bHW` values; its biased variance has expectation
    :math:`\sigma^2 - V_B/b`, with :math:`\sigma^2` the variance of all values and :math:`V_B` that of the
    per-image means (the within-image spread is all there). BatchNorm stores it times :math:`n/(n-1)`, which is
    right only for independent values (a shortfall of :math:`\sigma^2/n`), so the ratio is
    :math:`\frac{n_s/(n_s-1)\,(1 - V_B/(b_s\sigma^2))}{n_l/(n_l-1)\,(1 - V_B/(b_l\sigma^2))}`; above 1 where
    :math:`V_B < \sigma^2/(HW)`. Computed in float64 from the layer's input on ``x`` (the model is not changed)."""
    work = copy.deepcopy(model).eval()  # eval: the forward leaves the running statistics alone
    layer = next((m for m in work.modules() if isinstance(m, nn.BatchNorm2d)), None)
    if layer is None:
        raise ValueError("the model has no BatchNorm2d layer: the prediction is for feature maps.")
    seen: list[torch.Tensor] = []
    layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().double()))
    with torch.no_grad():
        work(x)
    a = seen[0]
    hw = a.shape[2] * a.shape[3]
    v_b = a.mean((2, 3)).var(0, unbiased=False)
    s2 = a.transpose(0, 1).reshape(a.shape[1], -1).var(1, unbiased=False)

    def stored(b: int) -> torch.Tensor:
        n = b * hw
        return n / (n - 1) * (1 - v_b / (b * s2))

    ratio = stored(small) / stored(large)
    return float(ratio.min()), float(ratio.max())
