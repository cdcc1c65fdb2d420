"""PreciseBN (Wu & Johnson 2021): recompute BatchNorm's running statistics after training with large batches,
a cumulative average over many batches instead of K momentum updates per step. Chapter 2 of the book.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def precise_bn(model: nn.Module, x: torch.Tensor, batch_size: int) -> None:
    """Recompute every BatchNorm layer's running statistics after training ("PreciseBN", Wu & Johnson 2021).

    Uses ``torch.optim.swa_utils.update_bn``: it resets the running statistics, sets ``momentum=None`` so that
    they become the plain average over batches, runs the model over ``x`` in batches of ``batch_size`` (the
    micro-batch size b the model was trained with, so that the statistics match training-time normalization),
    and restores the momenta and the model's mode.
    """
    if batch_size < 2 or batch_size > x.shape[0]:
        raise ValueError(f"batch_size must be between 2 and {x.shape[0]}, got {batch_size}.")
    if not any(isinstance(m, _BatchNorm) for m in model.modules()):
        raise ValueError("the model has no BatchNorm layer; PreciseBN has nothing to recompute.")
    usable = x.shape[0] - x.shape[0] % batch_size
    with torch.no_grad():
        torch.optim.swa_utils.update_bn(list(x[:usable].split(batch_size)), model)
