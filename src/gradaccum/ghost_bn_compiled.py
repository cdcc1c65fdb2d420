r"""Ghost BatchNorm's ``impl="compile"``: its formulas and their gradient written as array math
(:func:`_kernel_forward`, :func:`_kernel_backward`) and compiled by ``torch.compile`` into a few fused loops.

Per ghost batch and channel, over its v·P values: the mean, then the biased variance (two passes, in float32 for
float16 and bfloat16 inputs, as BatchNorm computes), then :math:`y = x\,s + (\beta - \mu s)` with
:math:`s = \gamma/\sqrt{\sigma^2+\epsilon}`; the backward pass is BatchNorm's gradient per ghost batch. Every
layer shares one compiled function per formula. After a first failure to compile, warned about once, the same
formulas run eagerly (:func:`_run_compiled`). Differentiable once. :class:`gradaccum.ghost_bn.GhostBatchNorm` runs
it by name, beside its other implementations.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch
from torch.autograd.function import FunctionCtx


def _kernel_forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, v: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Ghost BatchNorm written as array math on the (G, v, C, P) view of a contiguous input (P positions per
    channel; 1 for features), in float32 for float16 and bfloat16 inputs: per ghost batch and channel the mean
    :math:`\mu` and then the biased variance :math:`\sigma^2` over the v·P values (two passes), then
    :math:`y = x\,s + (\beta - \mu s)` with :math:`s = \gamma/\sqrt{\sigma^2+\epsilon}`. Returns the output;
    the mean over ghost batches of their means and of their unbiased variances (the biased ones times m/(m−1),
    m = v·P), shape (C,); and the (G, 1, C, 1) means and reciprocal standard deviations, for the backward
    pass."""
    n, c = x.shape[0], x.shape[1]
    xs = x.view(n // v, v, c, -1).to(_accumulate_in(x.dtype))
    mean = xs.mean(dim=(1, 3), keepdim=True)
    var = (xs - mean).square().mean(dim=(1, 3), keepdim=True)  # two passes, as BatchNorm's CPU kernel
    rstd = torch.rsqrt(var + eps)
    scale = rstd if weight is None else rstd * weight.view(1, 1, c, 1).to(rstd.dtype)
    shift = -mean * scale if bias is None else bias.view(1, 1, c, 1).to(rstd.dtype) - mean * scale
    m = xs.shape[1] * xs.shape[3]
    unbiased = var.mean(dim=(0, 1, 3)) * (m / (m - 1))
    out = (xs * scale + shift).to(x.dtype).view(x.shape)
    return out, mean.mean(dim=(0, 1, 3)), unbiased, mean, rstd


def _kernel_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The gradients of :func:`_kernel_forward`, per ghost batch and channel over its m = v·P values:
    with :math:`\hat x = (x-\mu)\,r` (r the reciprocal standard deviation),
    :math:`\partial x = \gamma r\,(\partial y - \overline{\partial y} - \hat x\,\overline{\partial y\,\hat x})`
    (bars: means over the m values); :math:`\partial\gamma = \sum \partial y\,\hat x`,
    :math:`\partial\beta = \sum \partial y` over all N·P values."""
    n, c = x.shape[0], x.shape[1]
    xs = x.view(n // v, v, c, -1).to(rstd.dtype)
    dys = grad_out.reshape(xs.shape).to(rstd.dtype)
    xhat = (xs - mean) * rstd
    m = xs.shape[1] * xs.shape[3]
    sum_dy = dys.sum(dim=(1, 3), keepdim=True)
    sum_dy_xhat = (dys * xhat).sum(dim=(1, 3), keepdim=True)
    scale = rstd if weight is None else rstd * weight.view(1, 1, c, 1).to(rstd.dtype)
    grad_x = scale * (dys - sum_dy / m - xhat * (sum_dy_xhat / m))
    return grad_x.to(x.dtype).view(x.shape), sum_dy_xhat.sum(dim=(0, 1, 3)), sum_dy.sum(dim=(0, 1, 3))


_P = ParamSpec("_P")


_R = TypeVar("_R")


_COMPILED: dict[Callable[..., object], Callable[..., object]] = {}


def _accumulate_in(dtype: torch.dtype) -> torch.dtype:
    """The dtype the compiled kernel computes in: float32 for float16 and bfloat16 inputs (as BatchNorm does),
    else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _compiled(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return cast(Callable[_P, _R], _COMPILED[fn])


_compile_failed = False


def _run_compiled(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``fn`` through ``torch.compile``; after the first failure, warned about once, ``fn`` itself (the same
    formulas, eager: the results stay the same up to float rounding). A failure that the eager formulas share
    is the input's, not the compiler's: it is raised as it is, and compiling stays on."""
    global _compile_failed
    if not _compile_failed:
        try:
            return _compiled(fn)(*args, **kwargs)
        except Exception as err:  # any failure to compile (no C++ compiler, unsupported platform): fall back
            result = fn(*args, **kwargs)  # raises if the input itself is at fault
            _compile_failed = True
            warnings.warn(
                f"torch.compile failed ({type(err).__name__}: {str(err)[:200]}); GhostBatchNorm("
                "impl='compile') runs the same formulas eagerly from now on (slower, same results).",
                RuntimeWarning,
                stacklevel=4,
            )
            return result
    return fn(*args, **kwargs)


class _Kernel(torch.autograd.Function):
    """:func:`_kernel_forward` and :func:`_kernel_backward`, each compiled by ``torch.compile`` into a few
    fused loops (the mean, the variance, then the normalization; the two sums, then the input gradient). The
    output and the input gradient have the input's dtype, the parameter gradients the parameters'. Once
    differentiable."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, v: int, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        out, mean_c, var_c, mean, rstd = _run_compiled(_kernel_forward, x, weight, bias, v, eps)
        ctx.save_for_backward(x, weight, mean, rstd)  # type: ignore[arg-type]  # None: no affine
        ctx.v = v  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(mean_c, var_c)
        return out, mean_c, var_c

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # backward(create_graph=True): the compiled gradient carries no graph
            raise ValueError(
                "GhostBatchNorm's 'compile' implementation is differentiable once; for a double "
                "backward (create_graph=True) construct the layer with impl='fold'."
            )
        x, weight, mean, rstd = ctx.saved_tensors
        grad_x, grad_w, grad_b = _run_compiled(_kernel_backward, grad_out.contiguous(), x, weight, mean, rstd, ctx.v)
        if weight is not None:
            grad_w, grad_b = grad_w.to(weight.dtype), grad_b.to(weight.dtype)
        keep = ctx.needs_input_grad
        return (grad_x if keep[0] else None, grad_w if keep[1] else None, grad_b if keep[2] else None, None, None)


def _compile(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    stats_like: torch.Tensor,
    v: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_Kernel`: the output, and the means over ghost batches of their means and unbiased variances."""
    out, mean, var = _Kernel.apply(x, weight, bias, v, eps)
    return out, mean.to(stats_like.dtype), var.to(stats_like.dtype)
