r"""Chapter 4: loss scaling meets accumulation (fp16, bf16, ``torch.amp.GradScaler``).

With a loss scale :math:`S` and K micro-batches, the loss whose backward pass runs for micro-batch k is

.. math:: L_k^{\text{scaled}} = \frac{S}{K}\,L(\theta; B_k),

so every gradient computed inside the backward pass carries the factor :math:`S/K`: the *effective* scale per
micro-batch. ``.grad`` (fp32 under autocast) accumulates :math:`S\,g`, and ``unscale_`` divides by :math:`S`
once, at the boundary. For that to be right, :math:`S` must not change inside the window, the inf/NaN check
must see the accumulated gradient, and a skip must skip the whole effective step.

Here: where a backward pass's gradients sit in a format's range (:func:`activation_gradients`,
:func:`kernel_gradients`), the scale a GradScaler holds and what mixing scales does, and the largest safe scale.
The window of the recipe and of its mistakes (:func:`amp_window`) is in :mod:`gradaccum.amp_recipe`; formats and
casts are in :mod:`gradaccum.formats`; both are re-exported here.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Sequence
from typing import Literal, cast

import torch
from torch import nn

from gradaccum._validate import require_count, require_k, require_vectors
from gradaccum.accumulate import LossFn, flat_grad, full_batch_gradient, split_batch

# the amp window and its patterns live in gradaccum.amp_recipe, formats and casts in gradaccum.formats; chapter 4
# reads them from here too
from gradaccum.amp_recipe import PATTERNS as PATTERNS
from gradaccum.amp_recipe import Pattern as Pattern
from gradaccum.amp_recipe import WindowResult as WindowResult
from gradaccum.amp_recipe import _require_amp, _require_divide, _require_float32_model
from gradaccum.amp_recipe import amp_window as amp_window
from gradaccum.formats import CastReport as CastReport
from gradaccum.formats import FormatInfo as FormatInfo
from gradaccum.formats import _require_scale
from gradaccum.formats import accumulate_in as accumulate_in
from gradaccum.formats import accumulation_error as accumulation_error
from gradaccum.formats import cast_report as cast_report
from gradaccum.formats import format_info as format_info
from gradaccum.formats import largest_fitting_log2 as largest_fitting_log2


def _hooked_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules, plus modules that own parameters directly (their computation may bypass their children,
    as ``nn.MultiheadAttention`` does with ``out_proj``)."""
    return [
        (name, m) for name, m in model.named_modules() if not list(m.children()) or list(m.parameters(recurse=False))
    ]


def activation_gradients(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int = 1
) -> torch.Tensor:
    r"""Gradients of the loss / K with respect to every leaf module's output (what a backward pass holds in
    low precision under autocast), computed in the model's own precision; on a copy of ``model``.

    A tensor hook is registered on each output as it is produced, and the gradient it receives is cloned. A hook
    registered before an in-place change (``nn.ReLU(inplace=True)``) receives the gradient with respect to the
    value *before* the change, so a Linear layer followed by an in-place ReLU contributes its own output's
    gradient :math:`\partial L/\partial z`, and the ReLU its output's, exactly as without ``inplace``.

    Raises ``ValueError`` for a module whose output is not one tensor (``nn.GRU``, ``nn.LSTM`` and
    ``nn.MultiheadAttention`` return tuples): which of its outputs' gradients to report is not defined here.
    """
    require_k(k)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters: its backward pass computes no layer gradients.")
    work = copy.deepcopy(model)
    grads: list[torch.Tensor | None] = []

    def watch(name: str):
        def keep(module: nn.Module, inputs: object, out: object) -> None:
            if not isinstance(out, torch.Tensor):
                raise ValueError(
                    f"activation_gradients needs modules that return one tensor; module "
                    f"{name or '(root)'!r} ({type(module).__name__}) returns {type(out).__name__}. "
                    "Pass a model without it, or hook the tensor you care about yourself."
                )
            if out.requires_grad:
                slot = len(grads)
                grads.append(None)

                def store(g: torch.Tensor) -> None:
                    grads[slot] = g.detach().clone()

                out.register_hook(store)

        return keep

    hooks = [m.register_forward_hook(watch(name)) for name, m in _hooked_modules(work)]
    try:
        (loss_fn(work(x), y) / k).backward()
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([g.flatten() for g in grads if g is not None])


#: The layers whose kernels autocast runs in fp16: their weight and bias gradients are written in fp16 too.
FP16_KERNELS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def kernel_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    r"""The gradients an fp16 kernel writes for the parameters, computed in the model's precision on a copy: for
    each of the K micro-batches, the gradient of its mean loss with respect to the weights and biases of the linear
    and convolution layers (:data:`FP16_KERNELS`) — and, when ``x`` is on the CPU, of ``nn.LayerNorm`` layers,
    whose CPU kernel computes its weight gradients in fp16 under fp16 autocast — as one flat vector. BatchNorm,
    GroupNorm and InstanceNorm parameters are left out: autocast gives their gradients in fp32, so they cannot
    overflow fp16. A model with parameters elsewhere (``nn.MultiheadAttention``'s ``in_proj_weight``, a layer of
    one's own calling ``F.linear``) is refused: whether their gradients pass through fp16 is not known here; so is
    a layer run more than once per forward pass (each call's fp16 gradient is added in fp16, and a part can
    overflow where the total fits).
    The edge they predict assumes a loss that leaves autocast in fp32 (chapter 4's conditions)."""
    require_k(k)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters: no parameter gradient is written in fp16.")
    _require_input_dtype(model, x)
    work = copy.deepcopy(model)
    kernels = FP16_KERNELS + ((nn.LayerNorm,) if x.device.type == "cpu" else ())
    fp32 = (nn.modules.batchnorm._NormBase, nn.GroupNorm) + (() if x.device.type == "cpu" else (nn.LayerNorm,))
    params = [p for m in work.modules() if isinstance(m, kernels) for p in m.parameters(recurse=False)]
    other = [
        f"{name}.{pname}" if name else pname
        for name, m in work.named_modules()
        if not isinstance(m, kernels + fp32)
        for pname, _ in m.named_parameters(recurse=False)
    ]
    if other:
        raise ValueError(
            f"parameter(s) {other[:3]} sit outside linear, convolution and normalization modules: "
            "whether an fp16 kernel writes their gradients is not known here, so the prediction "
            "would leave them out; measure the edge with amp_window instead."
        )
    if not params:
        raise ValueError("the model has no linear or convolution layer: no parameter gradient is written in fp16.")
    calls: dict[str, int] = {}
    hooks = [
        m.register_forward_hook(lambda mod, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        for name, m in work.named_modules()
        if isinstance(m, kernels)
    ]
    out = []
    try:
        for xb, yb in split_batch(x, y, k):
            work.zero_grad(set_to_none=True)
            calls.clear()
            loss_fn(work(xb), yb).backward()
            twice = sorted(name for name, n in calls.items() if n > 1)
            if twice:  # each call writes its own fp16 gradient; their fp16 sum can overflow where the total fits
                raise ValueError(
                    f"layer(s) {twice[:3]} run more than once per forward pass: autocast writes an "
                    "fp16 weight gradient for each call and adds them in fp16, so a part can overflow "
                    "where the summed gradient fits and the prediction would be too high; measure the "
                    "edge with amp_window instead."
                )
            out += [p.grad.detach().reshape(-1) for p in params if p.grad is not None]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(out)


def _require_input_dtype(model: nn.Module, x: torch.Tensor) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if isinstance(x, torch.Tensor) and x.is_floating_point() and dtypes and x.dtype not in dtypes:
        raise ValueError(
            f"x is {x.dtype} and the model's parameters {sorted(map(str, dtypes))}: pass x in the "
            f"model's precision (x.to({sorted(map(str, dtypes))[0]}))."
        )


def reference_gradient(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The full-precision full-batch gradient, as a flat vector: what one correct window applies when nothing in
    the model couples the samples of a batch (with BatchNorm in training mode the accumulated window normalizes
    with micro-batch statistics and differs from it; chapter 1). The model runs in the mode it is in."""

    return full_batch_gradient(model, loss_fn, x, y)


def mixed_scale_sum(micro_grads: Sequence[torch.Tensor], scales: Sequence[float], unscale_by: float) -> torch.Tensor:
    r"""What ``unscale_`` leaves in ``.grad`` when micro-batch k ran its backward pass at scale :math:`S_k`:

    .. math:: \frac{1}{S_{\text{unscale}}}\sum_{k=1}^{K} \frac{S_k}{K}\,g_k ,

    with :math:`g_k` the gradient of micro-batch k's mean loss. With every :math:`S_k = S_{\text{unscale}}` this is
    the accumulated gradient; otherwise micro-batch k is weighted by :math:`S_k/S_{\text{unscale}}`.
    """
    micro_grads = require_vectors(micro_grads)
    k = len(micro_grads)
    if not isinstance(scales, (list, tuple)):
        raise ValueError(f"scales must be a list with one scale per micro-gradient, got {type(scales).__name__}.")
    if len(scales) != k:
        raise ValueError(f"need one scale per micro-gradient: {k} micro-gradients, {len(scales)} scales.")
    _require_scale(unscale_by)
    for s in scales:
        _require_scale(s)
    total = cast(torch.Tensor, sum(s / unscale_by * g / k for s, g in zip(scales, micro_grads)))  # K >= 1 terms
    if not bool(torch.isfinite(total).all()):
        raise ValueError(
            "the weighted sum overflows: scales / unscale_by this far apart are not ones a GradScaler "
            "holds in one window (float32's range); check the scales."
        )
    return total


def scale_history(
    updates: int,
    growth_interval: int,
    overflow_at: Sequence[int] = (),
    init_scale: float = 2.0**16,
    device_type: str = "cpu",
) -> list[float]:
    """The scale a real ``torch.amp.GradScaler`` holds after each of ``updates`` iterations of
    ``scale(loss).backward()`` → ``step`` → ``update`` on a one-parameter model; the iterations listed in
    ``overflow_at`` (0-based) produce an inf gradient.

    GradScaler multiplies the scale by ``backoff_factor`` (0.5) after a skipped step and by ``growth_factor`` (2)
    after ``growth_interval`` consecutive unskipped ones; nothing else changes it.
    """
    _require_scale(init_scale)
    require_count(updates, "updates")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(
            f"growth_interval must be an int >= 1 (GradScaler's default is 2000), got {growth_interval!r}."
        )
    if not isinstance(overflow_at, (list, tuple, range)):
        raise ValueError(f"overflow_at must be a list of iterations, e.g. (4,), got {overflow_at!r}.")
    overflow_at = [int(i) if isinstance(i, numbers.Integral) and not isinstance(i, bool) else i for i in overflow_at]
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < updates for i in overflow_at):
        raise ValueError(f"overflow_at must list iterations in [0, {updates}), got {list(overflow_at)}.")
    param = nn.Parameter(torch.ones(1, device=device_type))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)
    history = []
    for i in range(updates):
        opt.zero_grad(set_to_none=True)
        factor = float("inf") if i in overflow_at else 1.0
        scaler.scale((param * factor).sum()).backward()
        scaler.step(opt)
        scaler.update()
        history.append(float(scaler.get_scale()))
    return history


def scaled_window_grads(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    scale: float,
    divide: Literal["loss", "grads"] = "loss",
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    r"""The flat fp32 ``.grad`` after one window under autocast with the loss multiplied by ``scale`` (what
    ``scaler.scale(loss)`` does), before any unscaling; on a copy of ``model`` (float32 parameters).

    The copy runs in the mode ``model`` is in. ``divide="loss"``: each micro-batch's backward pass starts from
    (S/K)·L; ``"grads"``: from S·L. Since multiplying by a power of two is exact until something overflows or
    underflows, ``divide="loss"`` at S gives bitwise the same ``.grad`` as ``divide="grads"`` at S/K when K is a
    power of two: only S/K reaches the backward pass.
    """
    require_k(k)
    _require_scale(scale)
    _require_divide(divide)
    _require_float32_model(model, x)
    work = copy.deepcopy(model)  # in the mode it is in
    device_type = next(work.parameters()).device.type
    _require_amp(device_type, dtype)
    work.zero_grad(set_to_none=True)
    for xb, yb in split_batch(x, y, k):
        with torch.autocast(device_type, dtype=dtype):
            loss = loss_fn(work(xb), yb)
            if divide == "loss":
                loss = loss / k
        (loss * scale).backward()  # scaler.scale(loss): times S, in fp32
    return flat_grad(work).detach()


def _window_is_finite(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    scale: float,
    divide: Literal["loss", "grads"],
    dtype: torch.dtype,
) -> bool:
    return bool(torch.isfinite(scaled_window_grads(model, loss_fn, x, y, k, scale, divide, dtype)).all())


def largest_safe_log2_scale(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    k: int,
    divide: Literal["loss", "grads"] = "loss",
    lo: int = 0,
    hi: int = 40,
    dtype: torch.dtype = torch.float16,
) -> int:
    r"""The largest integer s in [lo, hi] for which one window (K micro-batches under autocast, loss scaled by
    :math:`S = 2^s`) leaves finite accumulated gradients — the edge a dynamic scaler probes.

    ``divide="loss"``: the backward pass holds :math:`\tfrac{S}{K}\nabla L`; ``divide="grads"``: it holds
    :math:`S\,\nabla L` (the 1/K is applied to the gradients afterwards). Multiplying by a power of two is exact
    in floating point until a value overflows, so the two edges differ by :math:`\log_2 K` when K is a power of
    two. Bisection: assumes that a window that overflows at :math:`2^s` also overflows at every larger scale.
    """
    require_k(k)
    _require_divide(divide)
    for name, value in (("lo", lo), ("hi", hi)):
        if isinstance(value, bool) or not isinstance(value, int) or not -126 <= value <= 127:
            raise ValueError(
                f"{name} is a power of two's exponent: an int in [-126, 127] (float32's range), got {value!r}."
            )
    if not lo < hi:
        raise ValueError(f"need lo < hi, got lo={lo}, hi={hi}.")
    _require_float32_model(model, x)
    _require_amp(next(model.parameters()).device.type, dtype)
    finite = lambda s: _window_is_finite(model, loss_fn, x, y, k, 2.0**s, divide, dtype)  # noqa: E731
    if not finite(lo):
        raise ValueError(f"the window already overflows at S = 2^{lo}; lower lo.")
    if finite(hi):
        if dtype == torch.bfloat16:
            raise ValueError(
                f"the window does not overflow bf16 even at S = 2^{hi}: bf16 shares float32's range, "
                "so it needs no loss scale (chapter 4); there is no edge to find."
            )
        raise ValueError(f"the window does not overflow even at S = 2^{hi}; raise hi (at most 127).")
    while hi - lo > 1:  # invariant: finite at lo, overflow at hi
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if finite(mid) else (lo, mid)
    return lo
