r"""One accumulation window of the ``torch.amp`` recipe, or of one of its common mistakes (:func:`amp_window`,
chapter 4), and what autocast needs to run one: a float32 model, a device and a dtype autocast supports.

The recipe: for each micro-batch ``scaler.scale(loss / K).backward()`` under autocast, and at the window's boundary
``unscale_`` → ``step`` → ``update``, once. Each mistake in :data:`PATTERNS` moves one of those calls into the
micro-batch loop, or changes the scale inside the window; :class:`WindowResult` reports the update the optimizer
applied, the steps it took and the scale each backward pass used. :mod:`gradaccum.precision` re-exports the public
names, and its other tools share the validators here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from gradaccum._validate import require_k, require_positive
from gradaccum.accumulate import LossFn, split_batch
from gradaccum.formats import LOW_PRECISION, _require_scale

_T = TypeVar("_T")


def _require_divide(divide: object) -> None:
    if divide not in ("loss", "grads"):
        raise ValueError(
            f"divide must be 'loss' (divide each micro-batch's loss by K) or 'grads' (divide the "
            f"accumulated gradients by K after unscale_), got {divide!r}."
        )


def _require_float32_model(model: nn.Module, x: torch.Tensor | None = None) -> None:
    """Autocast (fp16/bf16) casts only float32 tensors: a float64 model would silently run in float64, so a
    "mixed-precision" experiment on it measures nothing. Refuse any floating-point parameter that is not float32,
    a model without trainable parameters, and a float64 input ``x``."""
    if not isinstance(model, nn.Module) or not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters: there is no gradient to scale.")
    bad = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if bad:
        raise ValueError(
            f"the model's parameters must be float32 for autocast fp16/bf16 (autocast leaves "
            f"{', '.join(bad)} alone, so nothing would run in 16 bits); pass model.float() or "
            "build it with dtype=torch.float32."
        )
    if x is not None and x.dtype == torch.float64:
        raise ValueError("x is float64, which autocast leaves alone (and a float32 model cannot take); pass x.float().")


def _require_amp(device_type: str, dtype: torch.dtype) -> None:
    """Autocast must exist on the device and accept the dtype; otherwise say what to use instead."""
    if dtype not in LOW_PRECISION:
        raise ValueError(
            f"autocast dtype must be torch.float16 or torch.bfloat16, got {dtype}; for full precision "
            "run without autocast."
        )
    try:
        available = torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type torch knows
        available = False
    if not available:
        raise ValueError(f"autocast is not available on device type {device_type!r}; use 'cpu' or 'cuda'.")
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bfloat16; use torch.float16 with a GradScaler.")


Pattern = Literal[
    "correct", "unscale_per_micro", "unscale_update_per_micro", "scale_changes_in_window", "step_per_micro", "no_scaler"
]


PATTERNS: tuple[str, ...] = (
    "correct",
    "unscale_per_micro",
    "unscale_update_per_micro",
    "scale_changes_in_window",
    "step_per_micro",
    "no_scaler",
)


@dataclass
class WindowResult:
    """One accumulation window run with an amp pattern.

    ``update``: the sum of the gradients the optimizer applied, read as it stepped (plain SGD moves the weights by
    −lr times it; exact at any learning rate); ``steps``: optimizer steps actually taken; ``scales``: the loss
    scale used for each micro-batch's backward pass; ``final_scale``: after the window; ``error``: the message of
    an exception the pattern raised, if any.
    """

    update: torch.Tensor
    steps: int
    scales: list[float] = field(default_factory=list)
    final_scale: float = float("nan")
    error: str | None = None


def amp_window(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    pattern: Pattern = "correct",
    dtype: torch.dtype = torch.float16,
    init_scale: float = 2.0**16,
    overflow_micro: int | None = None,
    lr: float = 0.1,
    divide: Literal["loss", "grads"] = "loss",
) -> WindowResult:
    r"""Run one accumulation window of the torch.amp recipe, or of one of its common mistakes, on a copy.

    * ``correct``: per micro-batch ``scaler.scale(loss / K).backward()`` under autocast; at the boundary
      ``unscale_`` → ``step`` → ``update``.
    * ``unscale_per_micro``: ``unscale_`` after every backward (raises on the second call).
    * ``unscale_update_per_micro``: ``unscale_`` then ``update()`` after every backward, ``step`` + ``update`` at
      the boundary. Nothing raises: each ``unscale_`` divides the whole running ``.grad`` by S again (and
      ``step`` unscales once more), and an inf stays in ``.grad``, so every later ``update()`` backs off again.
    * ``scale_changes_in_window``: the scale is set by hand to twice its value after every micro-batch
      (``update(new_scale=2·S)``), so micro-gradients are summed at different scales and ``unscale_`` divides
      them all by the scale in force at the boundary, :math:`2^K S`, which none of them used (a dynamic scaler
      grows only after ``growth_interval`` clean ``update()`` calls, never inside a window by itself).
    * ``step_per_micro``: ``step`` and ``update`` after every micro-batch: K small steps, not one.
    * ``no_scaler``: autocast only, loss / K (right for bf16; for fp16 small gradients underflow).

    ``overflow_micro`` makes that micro-batch overflow in fp16 (inputs × 10⁶; a ValueError with bf16, or where its
    gradients come out finite). The copy runs in ``model``'s mode (compare runs with dropout off).

    ``divide``: where the 1/K goes. ``"loss"`` (the recipe): each micro-batch's loss is divided by K before
    ``backward``, so the backward pass holds :math:`\tfrac{S}{K}\,\nabla L`. ``"grads"``: the loss is only
    scaled by S, and the accumulated gradients are divided by K after ``unscale_``; the backward pass then holds
    :math:`S\,\nabla L`, K times larger, and overflows at a K times smaller S.
    """
    _check_window(model, x, k, pattern, dtype, init_scale, overflow_micro, lr, divide)
    work = copy.deepcopy(model)  # in the mode it is in, as the other tools here (a training step: model.train())
    device_type = next(work.parameters()).device.type
    _require_amp(device_type, dtype)
    opt = torch.optim.SGD(work.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=pattern != "no_scaler")
    result = WindowResult(update=torch.empty(0), steps=0)
    applied, taken, handle = _record_steps(work, opt)
    opt.zero_grad(set_to_none=True)
    result.error = _run_window(
        work, loss_fn, x, y, k, pattern, overflow_micro, device_type, dtype, divide, scaler, opt, result.scales
    )
    handle.remove()
    result.steps = len(taken)
    result.final_scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    result.update = torch.cat([t.flatten() for t in applied])
    return result


def _run_window(
    work: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    pattern: str,
    overflow_micro: int | None,
    device_type: str,
    dtype: torch.dtype,
    divide: str,
    scaler: torch.amp.GradScaler,
    opt: torch.optim.Optimizer,
    scales: list[float],
) -> str | None:
    """:func:`amp_window`'s window on the copy ``work``: each micro-batch's backward (its scale appended to
    ``scales``) and what the pattern does after it, then the boundary (unless the pattern stepped per micro-batch).
    Returns the message of a GradScaler call that raised (the pattern's result), else None."""
    try:
        for i, (xb, yb) in enumerate(split_batch(x, y, k)):
            _micro_backward(
                work,
                loss_fn,
                xb * 1e6 if i == overflow_micro else xb,
                yb,
                k,
                i == overflow_micro,
                i,
                device_type,
                dtype,
                divide,
                scaler,
                scales,
            )
            _after_micro(pattern, scaler, opt)
        if pattern != "step_per_micro":
            _at_boundary(work, k, divide, scaler, opt)
    except _ScalerRefused as err:  # only the GradScaler's own errors are the pattern's result
        return str(err)
    return None


def _record_steps(work: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[int], Any]:
    """Sum, per parameter, the gradients the optimizer applies, read as it steps (GradScaler calls opt.step() only
    for a step it does not skip): exact at any learning rate, where a weight difference read back in fp32 loses the
    small updates. Returns (the sums, one entry per step taken, the hook's handle)."""
    applied = [torch.zeros_like(p, dtype=torch.float32) for p in work.parameters()]
    taken: list[int] = []

    def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        taken.append(1)
        for total, p in zip(applied, work.parameters()):
            if p.grad is not None:
                total.add_(p.grad.detach().float())

    return applied, taken, opt.register_step_pre_hook(record)


def _check_window(
    model: nn.Module,
    x: torch.Tensor,
    k: int,
    pattern: str,
    dtype: torch.dtype,
    init_scale: float,
    overflow_micro: int | None,
    lr: float,
    divide: str,
) -> None:
    """:func:`amp_window`'s arguments, refused with a ValueError that says what to pass."""
    require_k(k)
    _require_scale(init_scale)
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose one of {PATTERNS}.")
    _require_divide(divide)
    if divide == "grads" and pattern not in ("correct", "no_scaler"):
        raise ValueError(f"divide='grads' is defined for the patterns 'correct' and 'no_scaler', not {pattern!r}.")
    _require_float32_model(model, x)
    require_k(k)
    if overflow_micro is not None and (
        isinstance(overflow_micro, bool) or not isinstance(overflow_micro, int) or not 0 <= overflow_micro < k
    ):
        raise ValueError(
            f"overflow_micro must be None or the index of a micro-batch, an int in [0, {k}), got {overflow_micro!r}."
        )
    require_positive(lr, "lr (the update is divided by it)")
    if overflow_micro is not None and dtype != torch.float16:
        raise ValueError(
            f"overflow_micro makes a micro-batch overflow fp16 (inputs times 10^6); {dtype} shares "
            "float32's range and does not overflow that way: use dtype=torch.float16."
        )


def _micro_backward(
    work: nn.Module,
    loss_fn: LossFn,
    xb: torch.Tensor,
    yb: torch.Tensor,
    k: int,
    overflow: bool,
    i: int,
    device_type: str,
    dtype: torch.dtype,
    divide: str,
    scaler: torch.amp.GradScaler,
    scales: list[float],
) -> None:
    """One micro-batch under autocast: ``scaler.scale(loss [/ K]).backward()``, its scale appended to ``scales``;
    ValueError when the micro-batch meant to overflow (``overflow``, number ``i``) did not."""
    with torch.autocast(device_type, dtype=dtype):
        loss = loss_fn(work(xb), yb)
        if divide == "loss":
            loss = loss / k
    # the scale as the scaler holds it, in float32 (before its first use get_scale() returns the Python
    # float it was given)
    scales.append(float(torch.tensor(scaler.get_scale(), dtype=torch.float32)) if scaler.is_enabled() else 1.0)
    scaler.scale(loss).backward()
    if overflow and all(bool(torch.isfinite(p.grad).all()) for p in work.parameters() if p.grad is not None):
        raise ValueError(
            f"overflow_micro={i}: that micro-batch's inputs times 10^6 did not overflow fp16 "
            "(a normalization at the model's input, say, removes the scale), so the window "
            "would not show an overflow; choose a model whose first layer is linear or "
            "convolutional."
        )


def _after_micro(pattern: str, scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> None:
    """What the pattern does after each micro-batch's backward (the recipe: nothing)."""
    if pattern == "unscale_per_micro":
        _scaler(scaler.unscale_, opt)
    elif pattern == "unscale_update_per_micro":
        _scaler(scaler.unscale_, opt)
        _scaler(scaler.update)
    elif pattern == "scale_changes_in_window":
        _scaler(scaler.update, new_scale=2.0 * float(scaler.get_scale()))
    elif pattern == "step_per_micro":
        _scaler(_step, scaler, opt)
        opt.zero_grad(set_to_none=True)


def _at_boundary(
    work: nn.Module, k: int, divide: str, scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer
) -> None:
    """The window's boundary: (``divide="grads"``: ``unscale_``, then .grad / K) ``step`` and ``update``."""
    if divide == "grads":
        _scaler(scaler.unscale_, opt)  # no-op when the scaler is disabled
        for p in work.parameters():
            if p.grad is not None:
                p.grad /= k
    _scaler(_step, scaler, opt)


class _ScalerRefused(Exception):
    """A GradScaler call raised: what a mistaken pattern leads to, reported in :class:`WindowResult`."""


def _scaler(call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)``, with a RuntimeError or AssertionError the GradScaler raises turned into
    :class:`_ScalerRefused` (errors of the model or the loss, raised outside these calls, propagate as they are)."""
    try:
        return call(*args, **kwargs)
    except (RuntimeError, AssertionError) as err:
        raise _ScalerRefused(f"{type(err).__name__}: {err}") from err


def _step(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> None:
    """scaler.step + update (a skipped step leaves the parameters alone and never calls ``opt.step``)."""
    scaler.step(opt)
    scaler.update()
