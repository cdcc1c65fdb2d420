"""PreciseBN (Wu & Johnson 2021): recompute BatchNorm's running statistics after training with large batches,
a cumulative average over many batches instead of K momentum updates per step. Chapter 2 of the book.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._validate import _numpy_hint, require_tensor


def precise_bn(model: nn.Module, x: torch.Tensor | Iterable[Any], batch_size: int | None = None) -> None:
    """Recompute every BatchNorm layer's running statistics after training ("PreciseBN", Wu & Johnson 2021).

    ``x``: a tensor of samples, cut into batches of ``batch_size``; or a ``DataLoader`` (any iterable of batches),
    each batch a tensor, a tuple or list whose first element is the input (``(x, y)``), or a dict of the model's
    keyword arguments (``model(**batch)``, as Hugging Face batches are). For an iterable, ``batch_size`` may be left
    out (the first batch's size is used); every batch must have that size, except a smaller last one, which is left
    out as the tensor path leaves out the remainder. The same batches give the same statistics either way.

    Uses ``torch.optim.swa_utils.update_bn``: it resets the running statistics, sets ``momentum=None`` so that
    they become the plain average over batches, runs the model over the batches (of the micro-batch size b the
    model was trained with, so that the statistics match training-time normalization), and restores the momenta.
    Like ``update_bn`` it runs the whole model in training
    mode, dropout included; afterwards every module's own mode is restored (``update_bn`` restores only the
    top-level module's). Refuses a BatchNorm layer left in eval mode inside a model in training mode (frozen
    statistics: recomputing them would silently undo the freeze) and one without running statistics; a model handed
    over in eval mode as a whole cannot show which layers were frozen, and every layer is recomputed. The last
    ``x.shape[0] mod batch_size`` samples are left out, so that every batch has the size training normalized with.
    If the pass fails (an input the model refuses, a batch of another size), every layer's statistics and momentum
    are put back as they were; a NaN in ``x`` is not a failure (BatchNorm accepts it) and leaves NaN statistics.
    """
    if _is_batches(x):
        batches, batch_size = _batches(x, batch_size)
    else:
        x = require_tensor(x)
        if x.shape[0] < 2:
            raise ValueError(f"x holds {x.shape[0]} sample(s): PreciseBN needs at least one batch of 2 or more.")
        _require_batch_size(batch_size, x.shape[0])
        assert batch_size is not None
        batches = iter(list(x[: x.shape[0] - x.shape[0] % batch_size].split(batch_size)))
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if not layers:
        raise ValueError("the model has no BatchNorm layer; PreciseBN has nothing to recompute.")
    _check_layers(model, layers, batch_size)
    modes = {m: m.training for m in model.modules()}
    saved = {
        layer: (layer.momentum, {k: b.detach().clone() for k, b in layer.named_buffers(recurse=False)})
        for _, layer in layers
    }
    done = False
    try:
        with torch.no_grad():
            torch.optim.swa_utils.update_bn(batches, _Inputs(model))
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


class _Inputs(nn.Module):
    """``model`` called on one batch's input: a tensor, or a dict of keyword arguments."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> Any:
        return self.model(**batch) if isinstance(batch, dict) else self.model(batch)


def _require_batch_size(batch_size: object, most: int | None) -> None:
    top = "" if most is None else f" and {most}"
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 2
        or (most is not None and batch_size > most)
    ):
        raise ValueError(f"batch_size must be an int between 2{top}, got {batch_size!r}{_numpy_hint(batch_size)}.")


def _is_batches(x: object) -> bool:
    """Whether ``x`` is an iterable of batches (a DataLoader, a list), rather than one tensor or array of samples."""
    return (
        isinstance(x, Iterable) and not isinstance(x, (torch.Tensor, str, bytes, dict)) and not hasattr(x, "__array__")
    )


def _input_of(batch: object, j: int) -> tuple[torch.Tensor | dict[str, Any], int]:
    """One batch's input and its number of samples: a tensor, the first element of a tuple or list, or a dict."""
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if isinstance(batch, dict):
        sizes = [v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if sizes:
            return batch, sizes[0]
    elif isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return batch, batch.shape[0]
    raise ValueError(
        f"batch {j} is a {type(batch).__name__}: each batch must be a tensor of inputs, a tuple or list "
        "whose first element is that tensor (x, y), or a dict of the model's keyword arguments holding "
        "tensors (model(**batch))."
    )


def _batches(data: Iterable[Any], batch_size: int | None) -> tuple[Iterator[Any], int]:
    """The inputs of ``data``'s batches, lazily, and their common size (``batch_size``, or the first batch's)."""
    if batch_size is not None:
        _require_batch_size(batch_size, None)
    it = iter(data)
    first = next(it, None)
    if first is None:
        raise ValueError("the iterable of batches is empty: PreciseBN needs at least one batch of 2 or more.")
    inp, size = _input_of(first, 0)
    b = size if batch_size is None else batch_size
    if b < 2:
        raise ValueError(f"the first batch holds {size} sample(s): PreciseBN needs batches of 2 or more.")

    def inputs() -> Iterator[Any]:
        held: tuple[int, int] | None = None  # a smaller batch, left out if it is the last one
        for j, batch in enumerate(itertools.chain([first], it)):
            inp, size = _input_of(batch, j)
            if held is not None or size > b:
                bad = held if held is not None else (j, size)
                raise ValueError(
                    f"batch {bad[0]} holds {bad[1]} samples, the batch size is {b}: PreciseBN "
                    "normalizes with one batch size, the one training used; only the last batch may "
                    "be smaller (it is left out)."
                )
            if size < b:
                held = (j, size)
                continue
            yield inp

    return inputs(), b


def _check_layers(model: nn.Module, layers: list[tuple[str, _BatchNorm]], batch_size: int) -> None:
    """Refuse, naming the layer, what :func:`precise_bn` cannot recompute: no running statistics, frozen
    statistics (an eval-mode layer in a training model), ghost batches that ``batch_size`` does not tile."""
    for name, layer in layers:
        if not layer.track_running_stats:
            raise ValueError(
                f"BatchNorm layer {name or '(the model)'!r} keeps no running statistics "
                "(track_running_stats=False): there is nothing to recompute; remove it from the model "
                "passed to precise_bn or construct it with track_running_stats=True."
            )
        if not layer.training and model.training:
            raise ValueError(
                f"BatchNorm layer {name or '(the model)'!r} is in eval mode while the model trains "
                "(frozen statistics): PreciseBN would overwrite them. Recompute on a sub-module "
                "without it, or unfreeze it first."
            )
    for name, layer in layers:
        v = getattr(layer, "virtual_batch_size", None)
        if v is not None and batch_size != v and batch_size % v:
            raise ValueError(
                f"layer {name or '(the model)'!r} is a GhostBatchNorm with ghost batches of {v}: "
                f"batch_size {batch_size} must be {v} or a multiple of it."
            )
