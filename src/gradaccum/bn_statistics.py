r"""BatchNorm's micro-batch statistics and running-statistics momentum under gradient accumulation (chapter 1).

In training mode a BatchNorm layer normalizes channel :math:`c` of a batch :math:`B` of size :math:`b` with

.. math::
    \hat\mu_B = \frac1b\sum_{i\in B} x_i, \qquad
    \hat\sigma^2_B = \frac1b\sum_{i\in B}(x_i-\hat\mu_B)^2 \quad\text{(biased)},

and updates its running statistics with momentum :math:`m` (PyTorch's default 0.1):

.. math::
    \bar\mu \leftarrow (1-m)\,\bar\mu + m\,\hat\mu_B, \qquad
    \bar\sigma^2 \leftarrow (1-m)\,\bar\sigma^2 + m\,\tfrac{N}{N-1}\hat\sigma^2_B \quad\text{(unbiased)},

with :math:`N` the number of values each channel's statistics average over: :math:`N = b` for a ``BatchNorm1d``
on (b, C) features, :math:`N = b\cdot H\cdot W` for a ``BatchNorm2d`` (the formulas above are then over all
:math:`N` values of the channel).

Under accumulation :math:`B` is a micro-batch: the statistics come from :math:`b` samples, not :math:`Kb`,
and the running statistics are updated :math:`K` times per optimizer step.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

import torch
from torch import nn

from gradaccum._validate import _numpy_hint, require_k, require_micro_batch, require_momentum


def batch_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean, biased variance and unbiased variance, as BatchNorm computes them.

    ``x`` has shape (N, C) or (N, C, *spatial); statistics are over every dimension except C.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(
            f"x must be a floating-point tensor, got {x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}."
        )
    if x.dim() < 2 or x.shape[1] == 0:
        raise ValueError(f"expected a tensor of shape (N, C, ...) with C >= 1 channels, got shape {tuple(x.shape)}.")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x contains inf or NaN: its moments would be NaN; find where the activations overflowed.")
    dims = [0, *range(2, x.dim())]
    n = x.numel() // x.shape[1]
    if n < 2:
        raise ValueError("need at least 2 values per channel to compute an unbiased variance.")
    mean = x.mean(dims)
    biased = x.var(dims, correction=0)
    return mean, biased, biased * n / (n - 1)


def predicted_mean_variance(sigma2: Any, b: Any, n: int) -> Any:
    r"""Variance of the mean of b samples drawn without replacement from a population of n.

    .. math:: \operatorname{Var}(\hat\mu_b) = \frac{\sigma^2}{b}\cdot\frac{n-b}{n-1},

    where :math:`\sigma^2` is the population variance (divisor n). The second factor, the finite-population
    correction, is 1 − O(b/n); it vanishes at b = n, where every "micro-batch" is the whole population.
    """
    if isinstance(b, (list, tuple)):  # torch, not NumPy: the package's core needs only torch
        b = torch.tensor(b, dtype=torch.float64)
    if isinstance(sigma2, (list, tuple)):
        sigma2 = torch.tensor(sigma2, dtype=torch.float64)
    try:
        sizes, variances = torch.as_tensor(b), torch.as_tensor(sigma2)
        torch.broadcast_shapes(sizes.shape, variances.shape)
        if variances.dtype == torch.bool or variances.is_complex() or sizes.is_complex():
            raise TypeError("booleans and complex numbers are not sizes or variances")
    except (TypeError, RuntimeError) as err:
        raise ValueError(
            f"sigma2 and b must be numbers or arrays of numbers that broadcast together, got "
            f"{sigma2!r} and {b!r} ({err})."
        ) from err
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 2:
        raise ValueError(f"n (the population size) must be an int >= 2, got {n!r}.")
    n = int(n)
    if sizes.dtype == torch.bool or bool((sizes != sizes.round()).any()):
        raise ValueError(f"b counts samples: whole numbers only, got b={b}.")
    sizes = sizes.to(torch.float64)  # small integer types (NumPy int8, uint8) would wrap in the comparisons
    if isinstance(b, numbers.Integral):
        b = int(b)  # and in the formula below
    elif isinstance(b, torch.Tensor):
        b = b.to(torch.float64)  # a uint8 tensor wraps n - b (300 - 2 = 42)
    elif hasattr(b, "astype") and getattr(getattr(b, "dtype", None), "kind", "f") in "iub":
        b = b.astype("float64")  # NumPy integer arrays: int8 cannot even hold n
    if bool((sizes < 1).any()) or bool((sizes > n).any()):
        raise ValueError(f"need 1 <= b <= n, got b={b}, n={n}.")
    if not bool(torch.isfinite(variances).all()) or bool((variances < 0).any()):
        raise ValueError(f"sigma2 is a variance: finite and >= 0, got {sigma2}.")
    return sigma2 / b * (n - b) / (n - 1)


def biased_variance_factor(b: int) -> float:
    r"""Expected biased batch variance over the population variance for b i.i.d. samples: :math:`(b-1)/b`.

    BatchNorm normalizes training batches with this biased estimate but stores the unbiased one in
    ``running_var``; at b = 2 the training-time variance is on average half the population's.
    """
    if isinstance(b, bool) or not isinstance(b, int) or b < 2:
        raise ValueError(
            f"b must be an int >= 2 (the biased variance of one sample is 0: the ratio is undefined "
            f"for b = 1), got {b!r}{_numpy_hint(b)}."
        )
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


@torch.no_grad()
def layer_inputs(model: nn.Module, x: torch.Tensor, layer: str) -> torch.Tensor:
    """The input that the submodule named ``layer`` receives when ``model(x)`` runs in eval mode.

    Used to look at the numbers a BatchNorm layer computes its statistics from. Every module's mode is restored
    (a frozen BatchNorm inside a training model stays frozen). A module called more than once per forward pass is
    refused: which call's input to return would be a guess.
    """
    modules = dict(model.named_modules())
    if layer not in modules:
        raise ValueError(f"model has no submodule {layer!r}; it has {[n for n in modules if n]}.")
    captured: list[torch.Tensor] = []

    def hook(mod: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        try:  # the arguments in the order of forward's parameters, however they were passed
            values = list(inspect.signature(mod.forward).bind(*args, **kwargs).arguments.values())
        except TypeError:
            values = [*args, *kwargs.values()]
        tensors = [t for t in values if isinstance(t, torch.Tensor)]
        if not tensors:
            raise ValueError(
                f"submodule {layer!r} was called without a tensor argument; layer_inputs returns the "
                "tensor a layer receives."
            )
        captured.append(tensors[0].detach())

    handle = modules[layer].register_forward_hook(hook, with_kwargs=True)
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
        for m, training in modes:
            m.training = training
    if len(captured) != 1:
        raise ValueError(
            f"submodule {layer!r} ran {len(captured)} times in one forward pass; layer_inputs needs a "
            "module that runs once."
        )
    return captured[0]


def effective_momentum(m: float, k: int) -> float:
    r"""Momentum of the running statistics per optimizer step when they update once per micro-batch.

    After K updates the old value keeps weight :math:`(1-m)^K`, so per optimizer step the running
    statistics move with momentum :math:`1-(1-m)^K` (0.57 for m = 0.1, K = 8), not m.
    """
    m = require_momentum(m, allow_zero=True)
    require_k(k)
    return -math.expm1(k * math.log1p(-m)) if m < 1 else 1.0  # 1 − (1 − m)^K without cancellation


def corrected_momentum(m: float, k: int) -> float:
    """Per-micro-batch momentum m' = 1 − (1 − m)^(1/K), whose K updates decay the old value as one update with
    momentum m does (about m/K for small m)."""
    m = require_momentum(m, allow_zero=True)
    require_k(k)
    return -math.expm1(math.log1p(-m) / k) if m < 1 else 1.0  # 1 − (1 − m)^(1/K) without cancellation


def micro_batch_weights(m: float, k: int) -> list[float]:
    r"""Weight of micro-batch j = 0..K−1 in the running statistic after one accumulated step.

    Starting from :math:`\bar\mu_0`, K updates with momentum m give
    :math:`\bar\mu_K = (1-m)^K\bar\mu_0 + \sum_j m(1-m)^{K-1-j}\hat\mu_j`: later micro-batches weigh more.
    """
    m = require_momentum(m, allow_zero=True)  # a Python float, also for NumPy scalars
    require_k(k)
    return [m * (1.0 - m) ** (k - 1 - j) for j in range(k)]


def set_bn_momentum(model: nn.Module, m: float) -> int:
    """Set the momentum of every BatchNorm layer of ``model`` that keeps an exponential running average to m —
    and of every InstanceNorm layer with ``track_running_stats=True``, whose running averages also move once per
    forward call — returns how many layers were changed.

    Layers without running statistics (``track_running_stats=False``) have no momentum to set and are left alone.
    A layer with ``momentum=None`` keeps a cumulative average (weight 1/t for the t-th update) instead, which K
    equal micro-batches do not speed up: its running mean after accumulation is the full batch's (its running
    variance is not: the full batch's variance also counts how far the micro-batch means lie apart). It is refused,
    so that a correction meant for an exponential average does not silently turn it into one.
    """
    m = require_momentum(m, allow_zero=True)  # stored as a Python float, also for NumPy scalars
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module (its normalization layers are set), got {type(model).__name__}.")
    layers = [
        mod for mod in model.modules() if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats
    ]
    cumulative = [
        name for name, mod in model.named_modules() if any(mod is layer for layer in layers) and mod.momentum is None
    ]
    if cumulative:
        raise ValueError(
            f"normalization layer(s) {cumulative} use momentum=None (a cumulative average), which "
            "accumulation does not speed up; leave them as they are, or set their momentum yourself "
            "if you mean to switch them to an exponential average."
        )
    for mod in layers:
        mod.momentum = m
    return len(layers)
