"""How the loss weighs the micro-batches of a window (the full batch's weights :math:`f_j`), read on the loss
alone: from ``loss_fn`` at the model's outputs, or, for a model that computes its own loss (``loss_fn=None``),
from the gradients of that loss with respect to the output it is computed from (or, where none is found, from
the gradients)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .batch import Batch, call, loss_of
from .measure import fit_weights


@dataclass
class _Probe:
    weights: list[float]
    residual: float
    tokens: list[int]
    moved: list[float] | None = None  # the weights again at moved outputs, where they follow the outputs
    thr: float = 1e-9  # what counts as equal in this reading (a thousand roundings of the loss's dtype)


def _loss_probe(loss_fn: Callable, out: torch.Tensor, y: torch.Tensor, k: int, b: int) -> _Probe:
    r"""How the loss weighs micro-batches, measured on the loss alone: with :math:`G` its gradient with respect to
    the full batch's output and :math:`G_j` the gradient of micro-batch j's loss with respect to its part,
    :math:`f_j = \langle G[j], G_j\rangle / \|G_j\|^2`; ``residual`` is how far :math:`G[j]` is from
    :math:`f_j G_j` (0 for a loss that is a sum over positions, to the rounding of the loss's dtype: ``thr``).
    ``tokens``: positions with a non-zero gradient (padding and ignored targets have none).

    A loss whose weights are fixed by the targets or by counts (a token mean, a class-weighted mean, a mean over
    the non-zero losses) keeps the same :math:`f_j` when the outputs move a little. ``moved`` holds the weights at
    outputs moved by a thousandth of their spread (a hundredth below float64; three random directions) when they
    change with the outputs, smoothly (moving the other way changes them by as much, with the opposite sign): a
    batch-wide value of the outputs sets them (a logsumexp or softmax over the samples' losses, the square root of
    a mean), which no fixed normalization reproduces."""
    n = out.shape[0]
    dim = 0 if out.shape[0] == n else next(d for d, s in enumerate(out.shape) if s == n)
    base = out.detach().double()
    weights, residuals, tokens = _probe_at(loss_fn, base, out.dtype, y, k, b, dim)
    thr = max(1e-9, 1000 * torch.finfo(out.dtype).eps) if out.is_floating_point() else 1e-9
    probe = _Probe(weights, max(residuals), tokens, thr=thr)
    top = max(abs(f) for f in weights) if weights else 0.0
    if n < 2 or top == 0 or not out.is_floating_point():
        return probe
    eps = 1e-3 if out.dtype == torch.float64 else max(1e-2, 16 * torch.finfo(out.dtype).eps)
    noise = max(1e-12, 100 * torch.finfo(out.dtype).eps) * top  # the rounding of weights read in the loss's dtype
    for seed in range(3):  # three random directions: one may leave the weights nearly where they were
        step = (
            eps
            * float(base.std())
            * torch.randn(base.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        )
        try:  # outputs a little away, both ways
            up = _probe_at(loss_fn, base + step, out.dtype, y, k, b, dim)[0]
            down = _probe_at(loss_fn, base - step, out.dtype, y, k, b, dim)[0]
        except Exception:  # noqa: BLE001 (a loss that refuses moved outputs: the weights are read as fixed)
            return probe
        rise = [u - f for u, f in zip(up, weights)]
        fall = [d - f for d, f in zip(down, weights)]
        largest = max(max(abs(r) for r in rise), max(abs(f) for f in fall))
        if largest > 10 * noise and all(
            math.isfinite(r) and math.isfinite(f) and abs(r + f) <= 0.1 * largest + noise for r, f in zip(rise, fall)
        ):
            probe.moved = up
            break
    return probe


def _probe_at(
    loss_fn: Callable, o: torch.Tensor, dtype: torch.dtype, y: torch.Tensor, k: int, b: int, dim: int
) -> tuple[list[float], list[float], list[int]]:
    """:func:`_loss_probe`'s reading at the (float64) outputs ``o``, the loss computed in ``dtype``: weights,
    residuals and tokens."""
    o = o.detach().clone().requires_grad_()
    full = loss_fn(o.to(dtype), y)
    (g_full,) = torch.autograd.grad(full, o, allow_unused=True)
    g_full = torch.zeros_like(o) if g_full is None else g_full
    grads = []
    for j in range(k):
        oj = o.detach().narrow(dim, j * b, b).clone().requires_grad_()
        (gj,) = torch.autograd.grad(loss_fn(oj.to(dtype), y[j * b : (j + 1) * b]), oj, allow_unused=True)
        grads.append(torch.zeros_like(oj) if gj is None else gj)
    return _weigh(g_full, grads, b, dim)


def _weigh(
    g_full: torch.Tensor, grads: list[torch.Tensor], b: int, dim: int = 0
) -> tuple[list[float], list[float], list[int]]:
    r"""Weights, residuals and tokens from the loss's gradient with respect to the outputs: ``g_full`` for the full
    batch, ``grads[j]`` for micro-batch j alone (``dim``: the batch dimension, ``b`` samples each)."""
    weights, residuals, tokens = [], [], []
    for j, gj in enumerate(grads):
        gf = g_full.narrow(dim, j * b, b).double()
        gj = gj.double()
        gg = float((gj * gj).sum())
        fj = float((gf * gj).sum()) / gg if gg > 0 else 0.0
        weights.append(fj)
        scale = max(float(gf.norm()), float(gj.norm()) * abs(fj), 1e-300)
        residuals.append(float((gf - fj * gj).norm()) / scale if gg > 0 or float(gf.norm()) > 0 else 0.0)
        nz = gj != 0
        tokens.append(int(nz.reshape(*nz.shape[:-1], -1).any(-1).sum()) if gj.dim() >= 2 else int(nz.sum()))
    return weights, residuals, tokens


class LossSource:
    """The output a model's own loss is computed from: forward hooks on every module keep the output of the last
    module to finish, in the full batch's forward pass, with a floating tensor of one row per sample that requires
    grad (a language model's logits, as its head returns them; a classifier's last layer), by the module's name
    and the index of that call in the pass. :meth:`gradient_at` then reads the model's loss on a micro-batch with
    that output set to the full batch's rows of it: the loss alone, at the outputs the full batch had, as
    :func:`_loss_probe` reads a ``loss_fn`` (a layer that couples samples does not enter the reading)."""

    def __init__(self, model: nn.Module, n: int):
        self.n = n
        self.calls: dict[str, int] = {}
        self.last: tuple[str, int, torch.Tensor] | None = None  # held: a loss-only output is not returned
        self.value: torch.Tensor | None = None
        self.handles = [
            m.register_forward_hook(functools.partial(self._keep, name))
            for name, m in model.named_modules()
            if not isinstance(m, torch.jit.ScriptModule)
        ]

    def _keep(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        index = self.calls.get(name, 0)
        self.calls[name] = index + 1
        if (
            isinstance(output, torch.Tensor)
            and output.is_floating_point()
            and output.requires_grad
            and output.dim()
            and output.shape[0] == self.n
        ):
            self.last = (name, index, output)

    def stop(self) -> torch.Tensor | None:
        """End the watch (after the full batch's forward): the source output, its gradient retained; None when
        there is none."""
        for h in self.handles:
            h.remove()
        if self.last is None:
            return None
        name, index, source = self.last
        source.retain_grad()
        self.value = source.detach()
        self.last = (name, index, self.value)  # the caller holds the source until its backward; the probe does not
        return source

    def gradient_at(self, work: nn.Module, xb: Batch, start: int, b: int) -> torch.Tensor | None:
        """The gradient of the model's own loss on micro-batch ``xb`` (rows ``start`` to ``start + b - 1``) with
        respect to the source output, set to the full batch's rows of it; None where the pass does not produce
        that output with those rows."""
        if self.last is None or self.value is None:
            return None
        name, index, _ = self.last
        leaf = self.value.narrow(0, start, b).clone().requires_grad_()
        count, hit = [0], [False]

        def replace(module: nn.Module, args: Any, output: Any) -> Any:
            count[0] += 1
            if count[0] - 1 == index and isinstance(output, torch.Tensor) and output.shape == leaf.shape:
                hit[0] = True
                return leaf
            return None

        handle = dict(work.named_modules())[name].register_forward_hook(replace)
        try:
            loss = loss_of(None, call(work, xb), None)
        finally:
            handle.remove()
        if not hit[0]:
            return None
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        return torch.zeros_like(leaf) if grad is None else grad


def own_loss_probe(
    grads: list[torch.Tensor | None], basis: torch.Tensor, full: torch.Tensor, k: int, b: int, dtype: torch.dtype
) -> _Probe:
    r"""The weights of a loss the model computes itself (``output.loss``): ``grads`` holds its gradient with
    respect to the output it is computed from (:class:`LossSource`), for the full batch and then for each
    micro-batch at the full batch's rows, read as :func:`_loss_probe` reads ``loss_fn``'s (the outputs cannot be
    moved without the loss function, so ``moved`` stays None). Where that output could not be found, the weights
    are the least-squares fit of the full batch's gradient on the micro-batch gradients ``basis`` (exact for a
    model whose samples do not interact; a layer or a loss that couples them is then read as the model's), and
    every micro-batch counts its ``b`` samples."""
    thr = max(1e-9, 1000 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-9
    if len(grads) == k + 1 and all(g is not None for g in grads):
        g_full, *parts = (g for g in grads if g is not None)
        weights, residuals, tokens = _weigh(g_full, parts, b)
        return _Probe(weights, max(residuals), tokens, thr=thr)
    weights = fit_weights(basis, full)[0]
    return _Probe(weights, 0.0, [b] * k, thr=thr)
