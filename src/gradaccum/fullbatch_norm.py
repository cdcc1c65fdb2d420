"""The normalization the full-batch-statistics scheme puts in place of each batch-statistics BatchNorm layer.

:class:`Moments` (count, mean, M₂ per channel, combinable across micro-batches); :class:`_FullBatchNorm`,
x̂ = (x − μ)/s with the full batch's μ and s = √(σ² + ε), whose backward is the constants' a/s or, in a sweep of
the exact scheme, the full-batch BatchNorm gradient; :class:`_Patch`, what each layer's ``forward`` becomes during
one pass; :func:`normalized_with`. Chapter 2 of the book.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


@dataclass
class Moments:
    """Per-channel count, mean and sum of squared deviations :math:`M_2`, combinable across micro-batches."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    @staticmethod
    def of(x: torch.Tensor) -> Moments:
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims)
        centered = x - mean.view(1, -1, *([1] * (x.dim() - 2)))
        return Moments(x.numel() // x.shape[1], mean, (centered * centered).sum(dims))

    def combine(self, other: Moments) -> Moments:
        """Chan et al.'s pairwise update: exact, and stable (no E[x²] − E[x]² cancellation)."""
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta * delta * (self.count * other.count / n)
        return Moments(n, mean, m2)

    @property
    def var(self) -> torch.Tensor:
        """Biased variance (divisor = count), what BatchNorm normalizes with."""
        return self.m2 / self.count


ORDER_MESSAGE = (
    "the model calls its BatchNorm layers in a different order for different micro-batches, or not all "
    "of them for every micro-batch (data-dependent control flow?); the scheme needs the same BatchNorm "
    "calls, in the same order, for every micro-batch."
)


class _StopForward(Exception):
    """Raised inside a forward pass to end it early, once the layer of interest has seen its input."""


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, -1, *([1] * (x.dim() - 2)))


def _label(name: str) -> str:
    return f"'{name}'" if name else "(the model itself)"


def _twice_message(name: str) -> str:
    return (
        f"BatchNorm layer {_label(name)} is called more than once per forward pass; the scheme gives each layer "
        "one set of full-batch statistics, so it needs each batch-statistics BatchNorm called once. Give each "
        "call its own BatchNorm module (or freeze this one with .eval()). If the second call is activation "
        "checkpointing recomputing the layer during backward, the scheme supports it only with "
        "torch.utils.checkpoint(..., use_reentrant=False) and cache=True (its running statistics are then "
        "updated once, as by a full batch without checkpointing; a checkpointed full batch updates them twice, "
        "once more in the recomputation)."
    )


def _inplace_message(name: str) -> str:
    return (
        f"the input of BatchNorm layer {_label(name)} was modified in place after the layer read it (e.g. "
        "x.relu_() or x += ... on the tensor fed to the layer); its gradient needs that input, and "
        "nn.BatchNorm's own backward fails on this too. Use the out-of-place operation."
    )


def _no_grad_message() -> str:
    return (
        "the loss needs no gradient: no parameter that requires grad reaches it (or gradients are disabled, "
        "e.g. under torch.no_grad())."
    )


class _Sweep:
    """Per-layer state of one backward sweep of the exact scheme.

    ``corrections[layer] = (A1, A2)``: full-batch means of a = ∂L/∂x̂ and of a·x̂, once known;
    ``collect``: the layer whose sums Σa, Σa·x̂ this sweep gathers (into ``sums``), read in its backward;
    ``inputs``: (input, version) of every layer called in the current forward, so that an in-place change of an
    input, which the backward would read, is refused before any gradient is computed.
    """

    def __init__(
        self, corrections: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]], collect: _BatchNorm | None = None
    ):
        self.corrections = corrections
        self.collect = collect
        self.sums: tuple[torch.Tensor, torch.Tensor] | None = None
        self.inputs: dict[_BatchNorm, tuple[torch.Tensor, int, str]] = {}

    def check_inputs(self) -> None:
        for x, version, name in self.inputs.values():
            if x._version != version:
                raise ValueError(_inplace_message(name))


class _FullBatchNorm(torch.autograd.Function):
    r""":math:`\hat x = (x-\mu)/s` with the full batch's :math:`\mu` and :math:`s=\sqrt{\sigma^2+\epsilon}`
    held constant.

    Backward, given :math:`a = \partial L/\partial\hat x` of the micro-batch: without a sweep (constants) it
    returns :math:`a/s`; in a sweep it returns the full-batch BatchNorm gradient
    :math:`\frac1s\big(a - \bar a - \hat x\,\overline{a\hat x}\big)` when the full-batch means
    :math:`\bar a, \overline{a\hat x}` are known, and for the layer being collected adds :math:`\sum a` and
    :math:`\sum a\hat x` to the sweep. :math:`\hat x` is recomputed from the saved input, so an in-place change
    of the returned tensor (``ReLU(inplace=True)``) cannot reach what the backward reads.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, layer: _BatchNorm, sweep: _Sweep | None
    ) -> torch.Tensor:
        ctx.scale, ctx.layer, ctx.sweep = scale, layer, sweep
        if sweep is not None:
            ctx.mean = mean
            ctx.save_for_backward(x)
        return (x - mean) / scale

    @staticmethod
    def backward(ctx, a: torch.Tensor):
        sweep: _Sweep | None = ctx.sweep
        if sweep is None:
            return a / ctx.scale, None, None, None, None
        (x,) = ctx.saved_tensors
        xhat = (x - ctx.mean) / ctx.scale
        if ctx.layer is sweep.collect:
            dims = [0, *range(2, a.dim())]
            p1, p2 = a.sum(dims), (a * xhat).sum(dims)
            sweep.sums = (p1, p2) if sweep.sums is None else (sweep.sums[0] + p1, sweep.sums[1] + p2)
        correction = sweep.corrections.get(ctx.layer)
        if correction is not None:
            shape = _shape(a)
            a = a - (correction[0].view(shape) + xhat * correction[1].view(shape))
        return a / ctx.scale, None, None, None, None


class _Patch:
    """What each batch-statistics BatchNorm layer does during one sweep (it replaces the layer's ``forward``).

    Modes: ``discover`` (first statistics sweep: record the call order and the first layer's input moments,
    normalize with the micro-batch's own statistics — values after the first layer do not matter there — or,
    with ``stop_after_first``, stop at the first layer);
    ``target`` (gather that layer's input moments and stop the forward); otherwise normalize with ``stats``.
    ``once``: refuse a layer called twice in one forward (call :meth:`new_forward` before each forward).
    """

    def __init__(
        self,
        names: dict[_BatchNorm, str],
        stats: dict[_BatchNorm, Moments],
        sweep: _Sweep | None = None,
        once: bool = True,
    ):
        self.names, self.stats, self.sweep, self.once = names, stats, sweep, once
        self.discover = False
        self.stop_after_first = False
        self.target: _BatchNorm | None = None
        self.total: Moments | None = None
        self.order: list[_BatchNorm] = []
        self.called: set[_BatchNorm] = set()
        self._consts: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]] = {}

    def new_forward(self) -> None:
        self.called.clear()
        self.order = []
        if self.sweep is not None:
            self.sweep.inputs.clear()

    def _gather(self, x: torch.Tensor) -> None:
        part = Moments.of(x.detach())
        self.total = part if self.total is None else self.total.combine(part)

    def forward(self, layer: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        name = self.names.get(layer, type(layer).__name__)
        if self.once:
            if layer in self.called:
                raise ValueError(_twice_message(name))
            self.called.add(layer)
        layer._check_input_dim(x)
        if self.discover:
            self.order.append(layer)
            if len(self.order) == 1:
                self._gather(x)
                if self.stop_after_first:
                    raise _StopForward
            if x.numel() == x.shape[1]:  # one value per channel: any finite output will do here
                return _affine(layer, x - x)
            with torch._C.DisableTorchFunction():  # the layer's own statistics: not what _NoFunctionalBatchNorm seeks
                return F.batch_norm(x, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)
        if layer is self.target:
            self._gather(x)
            raise _StopForward
        full = self.stats.get(layer)
        if full is None:
            raise ValueError(
                f"BatchNorm layer {_label(name)} was reached in a different order than in the first forward pass "
                "(data-dependent control flow?); the scheme needs the same BatchNorm calls, in the same order, "
                "in every pass."
            )
        if self.sweep is not None:
            self.sweep.inputs[layer] = (x, x._version, name)
        consts = self._consts.get(layer)
        if consts is None or consts[0].dim() != x.dim():
            shape = _shape(x)
            consts = self._consts[layer] = (full.mean.view(shape), torch.sqrt(full.var + layer.eps).view(shape))
        return _affine(layer, _FullBatchNorm.apply(x, *consts, layer, self.sweep))


def _affine(layer: _BatchNorm, xhat: torch.Tensor) -> torch.Tensor:
    """γ·x̂ + β (a new tensor), or x̂ itself without an affine transform, as ``F.batch_norm`` does."""
    shape = _shape(xhat)
    if layer.weight is not None:
        xhat = xhat * layer.weight.view(shape)
    if layer.bias is not None:
        xhat = xhat + layer.bias.view(shape)
    return xhat


@contextmanager
def _patched(patch: _Patch, layers: Sequence[_BatchNorm]) -> Iterator[_Patch]:
    saved = {layer: layer.__dict__.get("forward") for layer in layers}
    for layer in layers:
        # an instance attribute shadows the method on purpose (removed again below)
        layer.forward = functools.partial(patch.forward, layer)  # type: ignore[method-assign]
    try:
        yield patch
    finally:
        for layer, old in saved.items():
            if old is None:
                del layer.forward
            else:
                layer.forward = old  # type: ignore[method-assign]  # put back what the instance had


@contextmanager
def normalized_with(stats: dict[_BatchNorm, Moments], sweep: _Sweep | None = None) -> Iterator[None]:
    """Within the block, each BatchNorm layer in ``stats`` normalizes with the given statistics (and leaves its
    running statistics alone); the other layers run as they are."""
    with _patched(_Patch({}, stats, sweep, once=False), list(stats)):
        yield
