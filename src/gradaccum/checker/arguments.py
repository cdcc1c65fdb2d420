"""What :func:`gradaccum.checker.check` refuses before it runs anything: arguments it cannot use, with a
``ValueError`` that says what to do instead."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from gradaccum._validate import require_k

from .batch import Batch, batch_size, call, describe, logits_of, output_field
from .report import CODES
from .run import _trainable


def _allowed_codes(allow: Any) -> tuple[str, ...]:
    """``allow`` as a tuple of known finding codes, or a ValueError naming the unknown ones."""
    if isinstance(allow, str) or not isinstance(allow, (list, tuple, set, frozenset)):
        raise ValueError(f"allow must be a list of finding codes, e.g. allow=['batch_coupled_layer'], got {allow!r}.")
    unknown = sorted(str(code) for code in allow if code not in CODES)
    if unknown:
        raise ValueError(f"allow: unknown finding code(s) {unknown}; the codes are {sorted(CODES)}.")
    return tuple(allow)


def _require_step_signature(step: Any) -> None:
    """A ValueError unless ``step`` can be called as step(model, loss_fn, x, y, k)."""
    if not callable(step):
        raise ValueError("step must be a function step(model, loss_fn, x, y, k), or None for plain accumulation.")
    try:
        inspect.signature(step).bind(None, None, None, None, 4)
    except TypeError as err:
        raise ValueError(
            f"step must take (model, loss_fn, x, y, k): {err}; add the parameters your step does not "
            "use (k is the number of micro-batches of the window)."
        ) from None
    except ValueError:  # a builtin or C function without a signature: called as it is
        pass


def _validate_batch(x: Any, y: Any, loss_fn: Any) -> None:
    """x: a tensor with a batch dimension or a mapping of such tensors (one batch size); y: a tensor of as many
    samples, or None exactly when the model computes its own loss (``loss_fn`` None); finite where they hold
    floats."""
    if isinstance(x, Mapping):
        _validate_mapping(x)
    elif not isinstance(x, torch.Tensor):
        raise ValueError(
            f"x must be a tensor whose first dimension is the batch, or a dict of such tensors (passed "
            f"as model(**x), as Hugging Face models take them), got {type(x).__name__}."
        )
    if loss_fn is None and y is not None:
        raise ValueError(
            "loss_fn=None means the model computes its own loss from x (its labels inside x, as "
            "x['labels'] for a Hugging Face model) and the checker uses output.loss: pass y=None, or "
            "pass the loss_fn that takes y."
        )
    if loss_fn is not None and y is None:
        raise ValueError(
            "y=None is for a model that computes its own loss (pass loss_fn=None, and the labels "
            "inside x); with a loss_fn, pass the targets y it takes."
        )
    if y is not None and not isinstance(y, torch.Tensor):
        raise ValueError(
            f"y must be a tensor whose first dimension is the batch (or None with loss_fn=None), got "
            f"{type(y).__name__}."
        )
    if isinstance(x, torch.Tensor) and (x.dim() == 0 or (y is not None and y.dim() == 0)):
        shape_y = f" and {tuple(y.shape)}" if y is not None else ""
        raise ValueError(
            f"x and y need a batch dimension (shapes {tuple(x.shape)}{shape_y}); for one sample use "
            "x[None] and y[None]."
        )
    n = batch_size(x)
    if y is not None and (y.dim() == 0 or y.shape[0] != n):
        raise ValueError(
            f"x has {n} samples but y has {y.shape[0] if y.dim() else 'no batch dimension'}; pass "
            "matching inputs and targets."
        )
    named = [("x", t) for t in ([x] if isinstance(x, torch.Tensor) else [])]
    named += [
        (f"x[{key!r}]", t) for key, t in (x.items() if isinstance(x, Mapping) else ()) if isinstance(t, torch.Tensor)
    ]
    for name, t in named + ([("y", y)] if y is not None else []):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(
                f"{name} contains NaN or inf: the check compares gradients of finite inputs; clean or "
                f"drop those samples first (torch.isfinite({name}) finds them)."
            )


def _validate_mapping(x: Mapping) -> None:
    """A dict batch: string keys, at least one tensor, every tensor with the same first (batch) dimension."""
    if not all(isinstance(key, str) for key in x):
        raise ValueError(
            "a dict batch x is passed as model(**x): its keys must be the names of the model's "
            f"arguments (strings), got {sorted(map(repr, x))}."
        )
    tensors = {key: v for key, v in x.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(
            "the dict batch x holds no tensor: give it the model's input tensors (input_ids, ...), "
            "each with the batch as its first dimension."
        )
    scalar = [key for key, v in tensors.items() if v.dim() == 0]
    if scalar:
        raise ValueError(
            f"x[{scalar[0]!r}] has no batch dimension: every tensor of a dict batch is cut into "
            "micro-batches along its first dimension; pass a per-batch constant as a Python number, "
            "or from your step."
        )
    sizes = {key: int(v.shape[0]) for key, v in tensors.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"the tensors of the dict batch x have different first dimensions {sizes}: they must "
            "share the batch dimension (one row per sample)."
        )


def _validate_arguments(
    model: Any, loss_fn: Any, x: Any, y: Any, k: Any, step: Any, clip: Any, tolerance: Any, seed: Any
) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(
            "loss_fn must be callable as loss_fn(model(x), y) and return a scalar tensor, or None "
            "when the model computes its own loss (output.loss, labels inside x)."
        )
    _validate_batch(x, y, loss_fn)
    require_k(k)
    n = batch_size(x)
    if n == 0:
        raise ValueError("the batch is empty: there is nothing to cut into micro-batches.")
    if n % k:
        raise ValueError(
            f"a batch of {n} samples cannot be cut into K = {k} equal micro-batches; choose K among "
            f"the divisors of {n}, or a batch size that is a multiple of {k}."
        )
    if step is not None:
        _require_step_signature(step)
    for name, value in (("clip", clip), ("tolerance", tolerance)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
        ):
            raise ValueError(f"{name} must be a positive finite number or None, got {value!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
    if not _trainable(model):
        raise ValueError("the model has no trainable parameters to compare gradients of.")
    sparse = [name for name, m in model.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(
            f"module(s) {sparse[:3]} produce sparse gradients (sparse=True), which the checker cannot "
            "compare; check a copy built with sparse=False: the gradient's values are the same."
        )


def _check_outputs(model: nn.Module, loss_fn: Callable | None, x: Batch, y: torch.Tensor | None) -> torch.Tensor:
    """The loss of the whole batch (no gradient), or a ValueError when the model's output or the loss cannot be
    used: a tensor (or an output's ``logits``) with one row per sample that ``loss_fn`` takes, or, with
    ``loss_fn=None``, an output that carries a scalar ``loss``."""
    how = describe(x)
    try:
        with torch.no_grad():
            out = call(copy.deepcopy(model), x)
    except Exception as err:
        raise ValueError(
            f"{how} raised {type(err).__name__}: {err}; the checker needs a model that runs on the whole batch x."
        ) from err
    if loss_fn is None:
        loss = output_field(out, "loss")
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                f"loss_fn=None: the checker uses the loss the model returns (output.loss, or "
                f"output['loss']), but {how} returned {type(out).__name__} without one: put the "
                "labels in x (x['labels'] for a Hugging Face model), or pass a loss_fn and y."
            )
        if loss.numel() != 1:
            raise ValueError(
                f"the model's loss must be a scalar (a mean or sum over the batch), got shape {tuple(loss.shape)}."
            )
        return loss
    logits = logits_of(out)
    if logits is None:
        raise ValueError(
            f"the model must return a tensor that loss_fn can take, or an output with logits (a "
            f"ModelOutput, a dict with 'logits'), got {type(out).__name__}; wrap it so that {how} "
            "returns the logits, or pass loss_fn=None to use the loss it computes (output.loss)."
        )
    n = batch_size(x)
    if logits.dim() == 0 or logits.shape[0] != n:
        raise ValueError(
            f"{how} must return one output per sample (first dimension {n}), got shape {tuple(logits.shape)}."
        )
    try:
        with torch.no_grad():
            loss = loss_fn(logits, y)
    except Exception as err:
        raise ValueError(
            f"loss_fn(model(x), y) raised {type(err).__name__}: {str(err).strip().splitlines()[0]}; "
            "the checker needs a loss that takes the whole batch's output and targets (class indices "
            "as int64, within the number of classes)."
        ) from err
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn(model(x), y) must return a scalar tensor (a mean or sum over the batch).")
    return loss
