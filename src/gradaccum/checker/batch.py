"""The batches and model outputs :func:`gradaccum.checker.check` takes, Hugging Face's included, read by duck typing
(transformers is never imported).

A batch ``x`` is a tensor whose first dimension is the batch (the model is called as ``model(x)``), or a mapping of
names to tensors that share that first dimension (called as ``model(**x)``, as a Hugging Face model takes
``{"input_ids": ..., "attention_mask": ..., "labels": ...}``; values that are not tensors are passed to every
micro-batch unchanged). Micro-batch j holds rows :math:`jb \\dots (j+1)b - 1` of every tensor.

A model output is a tensor, or an object or mapping that carries ``loss`` and/or ``logits`` (a ``ModelOutput``,
a dict). With a ``loss_fn`` the loss is ``loss_fn(logits, y)`` (the tensor itself when the output is one); with
``loss_fn=None`` the model computes its own loss from ``x`` (labels inside the batch) and the loss is
``output.loss`` (``y`` is then None).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

#: A batch: one tensor, or a mapping of names to tensors that share their first dimension.
Batch = torch.Tensor | Mapping[str, Any]


def batch_tensors(x: Batch) -> list[torch.Tensor]:
    """The tensors of a batch: ``x`` itself, or a mapping's tensor values in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [v for v in x.values() if isinstance(v, torch.Tensor)]


def batch_size(x: Batch) -> int:
    """The number of samples: the first dimension of the batch's (first) tensor."""
    return int(batch_tensors(x)[0].shape[0])


def narrow(x: Batch, start: int, length: int) -> Batch:
    """Rows ``start`` to ``start + length - 1`` of the batch (of every tensor of a mapping; other values as they
    are)."""
    if isinstance(x, torch.Tensor):
        return x.narrow(0, start, length)
    return {key: v.narrow(0, start, length) if isinstance(v, torch.Tensor) else v for key, v in x.items()}


def micro_batches(x: Batch, y: torch.Tensor | None, k: int) -> list[tuple[Batch, torch.Tensor | None]]:
    """The K equal, consecutive micro-batches of ``(x, y)`` (``y`` None stays None); the batch size is divisible
    by K (checked before)."""
    b = batch_size(x) // k
    return [(narrow(x, j * b, b), None if y is None else y.narrow(0, j * b, b)) for j in range(k)]


def call(model: nn.Module, x: Batch) -> Any:
    """``model(**x)`` for a mapping, ``model(x)`` for a tensor."""
    return model(**x) if isinstance(x, Mapping) else model(x)


def output_field(out: Any, name: str) -> Any:
    """``out.name`` or ``out[name]`` (a ``ModelOutput`` has both, a dict the second), None when absent."""
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, Mapping):
        return out.get(name)
    return getattr(out, name, None)


def logits_of(out: Any) -> torch.Tensor | None:
    """The outputs a loss function takes: the tensor itself, or the output's ``logits``; None when there is none."""
    if isinstance(out, torch.Tensor):
        return out
    logits = output_field(out, "logits")
    return logits if isinstance(logits, torch.Tensor) else None


def loss_of(loss_fn: Callable | None, out: Any, y: torch.Tensor | None) -> torch.Tensor:
    """The loss of one forward pass: ``out.loss`` when ``loss_fn`` is None (the model's own), else
    ``loss_fn(logits, y)``."""
    if loss_fn is None:
        return output_field(out, "loss")
    return loss_fn(logits_of(out), y)


def describe(x: Batch) -> str:
    """How the model is called on ``x``, for messages: ``model(x)`` or ``model(**x)``."""
    return "model(**x)" if isinstance(x, Mapping) else "model(x)"


def accumulate_plain(model: nn.Module, loss_fn: Callable | None, x: Batch, y: torch.Tensor | None, k: int) -> float:
    """Plain accumulation on any batch the checker takes: each micro-batch's loss (``loss_fn``'s, or the model's own
    when it is None) divided by K, then backward; :func:`gradaccum.accumulate.accumulate_backward` for a dict of
    tensors or a model output that is not a tensor."""
    total = 0.0
    for xb, yb in micro_batches(x, y, k):
        loss = loss_of(loss_fn, call(model, xb), yb) / k
        loss.backward()
        total += float(loss.detach())
    return total
