"""The uncached full-batch-statistics scheme: after the statistics pass, up to L backward sweeps (``exact=True``,
last BatchNorm layer first) gather the full-batch means of a = ∂L/∂x̂ and a·x̂, then one forward/backward per
micro-batch with the full batch's statistics gives loss / K's gradient. Chapter 2 of the book.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.accumulate import LossFn
from gradaccum.fullbatch_norm import ORDER_MESSAGE, Moments, _no_grad_message, _Patch, _patched, _Sweep
from gradaccum.fullbatch_stats import _Rng, _statistics_pass, update_running_stats


def _collect_corrections(
    model: nn.Module,
    loss_fn: LossFn,
    micro: list,
    k: int,
    stats: dict[_BatchNorm, Moments],
    names: dict[_BatchNorm, str],
    rng: _Rng,
) -> dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]]:
    """Backward sweeps from the last BatchNorm layer to the first: sweep ℓ gathers Σa and Σa·x̂ of layer ℓ over
    all micro-batches, with the corrections of the layers after it already applied. A layer whose input needs
    no gradient (BatchNorm on the raw input, everything before it frozen) needs no correction: one forward
    shows it, and its sweep stops there."""
    corrections: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in reversed(list(stats)):
        sweep = _Sweep(corrections, collect=layer)
        with _patched(_Patch(names, stats, sweep), list(names)) as patch:
            for i, (xb, yb) in enumerate(micro):
                rng.at(i)
                patch.new_forward()
                loss = loss_fn(model(xb), yb) / k
                sweep.check_inputs()
                if layer not in sweep.inputs:
                    raise ValueError(ORDER_MESSAGE)
                x = sweep.inputs[layer][0]
                if not (x.requires_grad and loss.requires_grad):
                    break
                torch.autograd.grad(loss, x, allow_unused=True)
        if sweep.sums is not None:
            corrections[layer] = (sweep.sums[0] / stats[layer].count, sweep.sums[1] / stats[layer].count)
    return corrections


def _uncached_step(
    model: nn.Module, loss_fn: LossFn, micro: list, k: int, exact: bool, names: dict[_BatchNorm, str], rng: _Rng
) -> float:
    """Statistics pass, the exact scheme's sweeps (``exact=True``), then the last forward/backward per micro-batch
    with the full batch's statistics; running statistics updated once. Returns the batch loss."""
    stats = _statistics_pass(model, [xb for xb, _ in micro], names, rng)
    sweep = _Sweep(_collect_corrections(model, loss_fn, micro, k, stats, names, rng)) if exact else None
    total = 0.0
    with _patched(_Patch(names, stats, sweep), list(names)) as patch:
        for i, (xb, yb) in enumerate(micro):
            rng.at(i)
            patch.new_forward()
            loss = loss_fn(model(xb), yb) / k
            if patch.called != set(stats):
                raise ValueError(ORDER_MESSAGE)
            if sweep is not None:
                sweep.check_inputs()
            if not loss.requires_grad:
                raise ValueError(_no_grad_message())
            loss.backward()
            total += float(loss.detach())
    update_running_stats(stats)
    return total
