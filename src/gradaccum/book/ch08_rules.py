r"""Chapter 8, "when the effective batch grows": what a weight EMA, weight decay and the batch size itself need
when the batch grows κ-fold and an epoch has κ times fewer optimizer steps.

- A model EMA with momentum :math:`\rho` per step keeps :math:`\rho^S` of its start after S steps; with S/κ steps
  per epoch, :math:`\hat\rho = \rho^\kappa` keeps the same per epoch (Busbridge et al. 2023's EMA scaling rule).
- AdamW multiplies each parameter by :math:`1 - \eta\lambda` per step (decoupled decay), about
  :math:`e^{-\eta\lambda S}` per epoch. Under the square-root rule (:math:`\eta \to \sqrt\kappa\,\eta`, S → S/κ) that
  becomes :math:`e^{-\eta\lambda S/\sqrt\kappa}`: :math:`\lambda \to \sqrt\kappa\,\lambda` restores it. SGD's
  coupled decay under the linear rule (:math:`\eta \to \kappa\eta`) keeps :math:`\eta\lambda S` by itself.
- McCandlish et al. 2018's simple noise scale :math:`B_{\text{simple}} = \operatorname{tr}\Sigma/|G|^2` marks the
  batch beyond which a larger one buys little progress per step (:func:`noise_scale`).

Each function measures its number with PyTorch's own classes where there is one, so the check is not the formula
checking itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from gradaccum._validate import require_count


def ema_start_weight(rho: float, steps: int) -> float:
    """The weight a model EMA (``AveragedModel`` with ``get_ema_multi_avg_fn(rho)``) still gives the parameters it
    started from after ``steps`` updates towards parameters that stay at 0: measured, :math:`\\rho^{steps}`."""
    require_count(steps, "steps")
    if not 0 < rho < 1:
        raise ValueError(f"rho must be in (0, 1), got {rho!r}.")
    model = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(rho))
    ema.update_parameters(model)  # the first update copies the model: the EMA starts at 1
    with torch.no_grad():
        model.weight.zero_()
    for _ in range(steps):
        ema.update_parameters(model)
    averaged = ema.module
    assert isinstance(averaged, nn.Linear)
    return float(averaged.weight.detach())


def decay_per_epoch(optimizer: str, lr: float, weight_decay: float, steps: int) -> float:
    """The factor by which ``steps`` steps of ``torch.optim.AdamW`` (``"AdamW"``) or ``torch.optim.SGD`` with
    ``weight_decay`` (``"SGD"``) shrink a parameter whose loss gradient is 0: the weight decay alone, measured."""
    require_count(steps, "steps")
    weight = torch.ones(1, dtype=torch.float64, requires_grad=True)
    if optimizer == "AdamW":
        opt: torch.optim.Optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=weight_decay)
    elif optimizer == "SGD":
        opt = torch.optim.SGD([weight], lr=lr, weight_decay=weight_decay)
    else:
        raise ValueError(f"optimizer must be 'AdamW' or 'SGD', got {optimizer!r}.")
    weight.grad = torch.zeros_like(weight)
    for _ in range(steps):
        opt.step()
    return float(weight.detach())


def noise_scale(x: torch.Tensor, y: torch.Tensor, steps: Sequence[int] = (0, 300), lr: float = 0.5) -> list[float]:
    r"""McCandlish et al.'s simple noise scale :math:`B_{\text{simple}} = \operatorname{tr}\Sigma / |G|^2` of a
    softmax regression on ``x`` (flattened, float64, zero weights) with labels ``y`` (10 classes), after each
    number of full-batch gradient steps in ``steps``: :math:`\Sigma` is the covariance of the per-sample
    gradients over the samples, :math:`G` their mean."""
    feats = torch.cat([x.reshape(len(x), -1).double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    onehot = torch.nn.functional.one_hot(y, 10).double()
    weights = torch.zeros(feats.shape[1], 10, dtype=torch.float64)
    out, done = [], 0
    for target in sorted(steps):
        for _ in range(target - done):
            weights -= lr * feats.T @ ((feats @ weights).softmax(1) - onehot) / len(x)
        done = target
        per_sample = ((feats @ weights).softmax(1) - onehot)[:, None, :] * feats[:, :, None]
        mean = per_sample.mean(0)
        out.append(float((per_sample - mean).pow(2).sum() / len(x) / mean.pow(2).sum()))
    return out


def step_progress(batch: float, b_noise: float) -> float:
    r"""McCandlish et al.'s share of the best possible progress per step that a batch of ``batch`` makes, with the
    learning rate tuned for it: :math:`1 / (1 + B_{\text{noise}}/B)`."""
    if not batch > 0 or not b_noise > 0:
        raise ValueError(f"batch and b_noise must be positive, got {batch!r} and {b_noise!r}.")
    return 1.0 / (1.0 + b_noise / batch)
