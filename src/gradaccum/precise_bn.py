"""PreciseBN (Wu & Johnson 2021): recompute BatchNorm's running statistics after training with large batches,
a cumulative average over many batches instead of K momentum updates per step. Chapter 2 of the book.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._validate import _numpy_hint, require_tensor


def precise_bn(model: nn.Module, x: torch.Tensor, batch_size: int) -> None:
    """Recompute every BatchNorm layer's running statistics after training ("PreciseBN", Wu & Johnson 2021).

    Uses ``torch.optim.swa_utils.update_bn``: it resets the running statistics, sets ``momentum=None`` so that
    they become the plain average over batches, runs the model over ``x`` in batches of ``batch_size`` (the
    micro-batch size b the model was trained with, so that the statistics match training-time normalization),
    and restores the momenta. Like ``update_bn`` it runs the whole model in training
    mode, dropout included; afterwards every module's own mode is restored (``update_bn`` restores only the
    top-level module's). Refuses a BatchNorm layer left in eval mode inside a model in training mode (frozen
    statistics: recomputing them would silently undo the freeze) and one without running statistics; a model handed
    over in eval mode as a whole cannot show which layers were frozen, and every layer is recomputed. The last
    ``x.shape[0] mod batch_size`` samples are left out, so that every batch has the size training normalized with.
    If the pass fails (an input the model refuses), every layer's statistics and momentum are put back as they were;
    a NaN in ``x`` is not a failure (BatchNorm accepts it) and leaves NaN statistics.
    """
    require_tensor(x)
    if x.shape[0] < 2:
        raise ValueError(f"x holds {x.shape[0]} sample(s): PreciseBN needs at least one batch of 2 or more.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 2 <= batch_size <= x.shape[0]:
        raise ValueError(f"batch_size must be an int between 2 and {x.shape[0]}, got {batch_size!r}"
                         f"{_numpy_hint(batch_size)}.")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if not layers:
        raise ValueError("the model has no BatchNorm layer; PreciseBN has nothing to recompute.")
    _check_layers(model, layers, batch_size)
    modes = {m: m.training for m in model.modules()}
    saved = {layer: (layer.momentum, {k: b.detach().clone() for k, b in layer.named_buffers(recurse=False)})
             for _, layer in layers}
    usable = x.shape[0] - x.shape[0] % batch_size
    done = False
    try:
        with torch.no_grad():
            torch.optim.swa_utils.update_bn(list(x[:usable].split(batch_size)), model)
        done = True
    finally:
        for module, training in modes.items():
            module.train(training)
        if not done:  # update_bn had already reset the statistics and set momentum None: put them back
            with torch.no_grad():
                for layer, (momentum, buffers) in saved.items():
                    layer.momentum = momentum
                    for k, b in layer.named_buffers(recurse=False):
                        b.copy_(buffers[k])


def _check_layers(model: nn.Module, layers: list[tuple[str, _BatchNorm]], batch_size: int) -> None:
    """Refuse, naming the layer, what :func:`precise_bn` cannot recompute: no running statistics, frozen
    statistics (an eval-mode layer in a training model), ghost batches that ``batch_size`` does not tile."""
    for name, layer in layers:
        if not layer.track_running_stats:
            raise ValueError(f"BatchNorm layer {name or '(the model)'!r} keeps no running statistics "
                             "(track_running_stats=False): there is nothing to recompute; remove it from the model "
                             "passed to precise_bn or construct it with track_running_stats=True.")
        if not layer.training and model.training:
            raise ValueError(f"BatchNorm layer {name or '(the model)'!r} is in eval mode while the model trains "
                             "(frozen statistics): PreciseBN would overwrite them. Recompute on a sub-module "
                             "without it, or unfreeze it first.")
    for name, layer in layers:
        v = getattr(layer, "virtual_batch_size", None)
        if v is not None and batch_size != v and batch_size % v:
            raise ValueError(f"layer {name or '(the model)'!r} is a GhostBatchNorm with ghost batches of {v}: "
                             f"batch_size {batch_size} must be {v} or a multiple of it.")
