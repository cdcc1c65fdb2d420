"""Argument validators shared by the core modules (private): each returns its argument or raises a
``ValueError`` that says what is wrong and what to pass instead."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch


def _numpy_hint(value: object) -> str:
    """For a NumPy integer, the advice to convert it; else nothing."""
    numpy_int = isinstance(value, numbers.Integral) and type(value).__module__ == "numpy"
    return " (a NumPy integer: pass int(...) of it)" if numpy_int else ""


def require_k(k: int) -> int:
    """Validate the number of accumulation steps K (a positive Python int; a NumPy integer is refused with a
    message that says to convert it, so that no NumPy scalar leaks into the results)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"K (accumulation steps) must be an int >= 1, got {k!r}{_numpy_hint(k)}; K = 1 means no accumulation."
        )
    return k


def require_momentum(m: float, allow_zero: bool = False) -> float:
    """Validate a BatchNorm momentum m ∈ (0, 1], or m ∈ [0, 1] with ``allow_zero`` (momentum 0 is legal in
    ``nn.BatchNorm``: the running statistics never move; a formula for them is then exact and trivial)."""
    span = "[0, 1]" if allow_zero else "(0, 1]"
    if m is None:
        raise ValueError(
            f"momentum=None is BatchNorm's cumulative average, not a momentum; pass a number in {span} "
            "(PyTorch's default is 0.1)."
        )
    value = float(m) if isinstance(m, numbers.Real) and not isinstance(m, bool) else math.nan
    if not 0.0 <= value <= 1.0 or (value == 0.0 and not allow_zero):  # NaN fails the first test
        raise ValueError(f"momentum must be a number in {span}, got {m!r}; PyTorch's default is 0.1.")
    return float(m)


def require_micro_batch(b: int, batch_norm: bool = True) -> int:
    """Validate a micro-batch size (a positive Python int); with BatchNorm in training it must be at least 2."""
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise ValueError(f"micro-batch size must be an int >= 1, got {b!r}{_numpy_hint(b)}.")
    if batch_norm and b < 2:
        raise ValueError(
            "micro-batch size 1 with BatchNorm in training: where a channel has one value per sample (a "
            "BatchNorm1d on features) its batch variance is 0, every output equals the shift β and no gradient "
            "reaches the layer's input; a convolutional BatchNorm normalizes over one image only. Use b >= 2, or "
            "replace "
            "BatchNorm with GroupNorm/LayerNorm."
        )
    return b


def require_count(value: int, name: str, minimum: int = 1) -> int:
    """Validate a count (a Python int ≥ ``minimum``) named ``name`` in the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}{_numpy_hint(value)}.")
    return value


def require_positive(value: float, name: str) -> float:
    """Validate a positive finite number named ``name`` in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    return float(value)


def require_nonnegative(value: float, name: str) -> float:
    """Validate a finite number >= 0 named ``name`` in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    return float(value)


def require_partial(present: int, k: int) -> int:
    """Validate the micro-batches of a partial last window: an int in [1, K)."""
    if isinstance(present, bool) or not isinstance(present, int) or not 1 <= present < k:
        raise ValueError(
            f"a partial window holds between 1 and K − 1 = {k - 1} micro-batches (an int), got "
            f"{present!r}{_numpy_hint(present)}."
        )
    return present


def require_flag(value: bool, name: str, meaning: str = "") -> bool:
    """Validate a Python bool named ``name`` (``meaning`` says what True does); "no", 0 or None are refused, so that
    a truthy string never switches a behaviour on by accident."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False{f' ({meaning})' if meaning else ''}, got {value!r}.")
    return value


def require_vectors(vectors: Sequence[torch.Tensor], name: str = "micro_grads") -> list[torch.Tensor]:
    """K >= 1 finite floating-point tensors of one shape (the micro-gradients, flattened or not), named ``name``
    in the messages; returned as a list."""
    if isinstance(vectors, torch.Tensor) or not isinstance(vectors, Sequence):
        raise ValueError(
            f"{name} must be a list of K tensors (one per micro-batch), got "
            f"{type(vectors).__name__}; for a stacked (K, n) tensor pass list(t)."
        )
    require_k(len(vectors))
    first = vectors[0]
    for i, v in enumerate(vectors):
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            raise ValueError(
                f"{name}[{i}] must be a floating-point tensor (as a gradient is), got "
                f"{v.dtype if isinstance(v, torch.Tensor) else type(v).__name__}."
            )
        if v.shape != first.shape:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(v.shape)}, {name}[0] {tuple(first.shape)}: every "
                "micro-gradient must cover the same parameters (flatten each with flat_grad)."
            )
        if not torch.isfinite(v).all():
            raise ValueError(
                f"{name}[{i}] contains inf or NaN: no step can be computed from it (chapter 4: a "
                "GradScaler skips such a step; find the overflow or the NaN upstream)."
            )
    return list(vectors)


def require_tensor(x: object, name: str = "x") -> torch.Tensor:
    """A torch.Tensor with a batch dimension (a NumPy array is refused with the advice to convert it)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(
            f"{name} must be a torch.Tensor with the samples along dimension 0, got "
            f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' of shape ()'}; convert "
            "it with torch.as_tensor(...)."
        )
    return x
