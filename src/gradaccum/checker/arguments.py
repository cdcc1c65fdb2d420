"""What :func:`gradaccum.checker.check` refuses before it runs anything: arguments it cannot use, with a
``ValueError`` that says what to do instead."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradaccum._validate import require_k
from gradaccum.accumulate import split_batch

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
        raise ValueError(f"step must take (model, loss_fn, x, y, k): {err}; add the parameters your step does not "
                         "use (k is the number of micro-batches of the window).") from None
    except ValueError:  # a builtin or C function without a signature: called as it is
        pass


def _validate_batch(x: Any, y: Any) -> None:
    """x and y: tensors with a batch dimension, finite where they hold floats."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise ValueError("x and y must be tensors whose first dimension is the batch; wrap other inputs in a model "
                         "that takes one tensor.")
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError(f"x and y need a batch dimension (shapes {tuple(x.shape)} and {tuple(y.shape)}); for one "
                         "sample use x[None] and y[None].")
    for name, t in (("x", x), ("y", y)):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or inf: the check compares gradients of finite inputs; clean or "
                             f"drop those samples first (torch.isfinite({name}) finds them).")


def _validate_arguments(model: Any, loss_fn: Any, x: Any, y: Any, k: Any, step: Any, clip: Any, tolerance: Any,
              seed: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(loss_fn):
        raise ValueError("loss_fn must be callable as loss_fn(model(x), y) and return a scalar tensor.")
    _validate_batch(x, y)
    require_k(k)
    split_batch(x, y, k)
    if step is not None:
        _require_step_signature(step)
    for name, value in (("clip", clip), ("tolerance", tolerance)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive finite number or None, got {value!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
    if not _trainable(model):
        raise ValueError("the model has no trainable parameters to compare gradients of.")
    sparse = [name for name, m in model.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(f"module(s) {sparse[:3]} produce sparse gradients (sparse=True), which the checker cannot "
                         "compare; check a copy built with sparse=False: the gradient's values are the same.")


def _check_outputs(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor) -> None:
    try:
        with torch.no_grad():
            out = copy.deepcopy(model)(x)
    except Exception as err:
        raise ValueError(f"model(x) raised {type(err).__name__}: {err}; the checker needs a model that runs on the "
                         "whole batch x.") from err
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the model must return a tensor that loss_fn can take, got {type(out).__name__}; "
                         "wrap it so that model(x) returns the logits.")
    if out.dim() == 0 or out.shape[0] != x.shape[0]:
        raise ValueError(f"model(x) must return one output per sample (first dimension {x.shape[0]}), got shape "
                         f"{tuple(out.shape)}.")
    try:
        with torch.no_grad():
            loss = loss_fn(out, y)
    except Exception as err:
        raise ValueError(f"loss_fn(model(x), y) raised {type(err).__name__}: {str(err).strip().splitlines()[0]}; "
                         "the checker needs a loss that takes the whole batch's output and targets (class indices "
                         "as int64, within the number of classes).") from err
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn(model(x), y) must return a scalar tensor (a mean or sum over the batch).")
