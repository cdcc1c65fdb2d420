"""The full-batch-statistics scheme with ``cache=True`` (or ``"cpu"``): one forward and one recomputing backward
over the stages of :mod:`gradaccum.fullbatch_trace`, instead of the uncached scheme's restarts from the input.

Pass 1 runs stage 0 for all K micro-batches, takes layer 1's statistics from the K inputs, runs stage 1, and so
on. The backward goes stage by stage from the top: stage s is recomputed per micro-batch from its kept inputs
(same dropout masks) and back-propagated from the gradients at its outputs; between stage c and stage c−1, layer
c's correction needs only the K gradients a = ∂L/∂x̂ at the cut. The cost is memory (:class:`CacheBytes`).
Chapter 2 of the book.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.accumulate import LossFn
from gradaccum.fullbatch_norm import (
    Moments,
    _affine,
    _inplace_message,
    _label,
    _no_grad_message,
    _Patch,
    _patched,
    _shape,
)
from gradaccum.fullbatch_stats import _cuda_devices, _NoFunctionalBatchNorm, _Rng
from gradaccum.fullbatch_trace import _Plan


def _find_rng_starts(
    model: nn.Module, micro_batches: Sequence[torch.Tensor], names: dict[_BatchNorm, str], rng: _Rng
) -> None:
    """The uncached statistics pass's first sweep, for its generator states only (see :class:`_Rng`): micro-batch
    0's whole forward, and, if it drew random numbers, every micro-batch's."""
    patch = _Patch(names, {})
    patch.discover = True
    received: list[Any] = []
    last = model.register_forward_pre_hook(lambda _m, args: received.append(args[0] if args else None))
    try:
        with torch.no_grad(), _patched(patch, list(names)):
            for i, xb in enumerate(micro_batches):
                if i > 0 and not rng.random:
                    break
                rng.at(i)
                patch.new_forward()
                with _NoFunctionalBatchNorm() if i == 0 else contextlib.nullcontext():
                    model(xb)
                rng.ended(i)
                if received[-1] is not xb:
                    raise ValueError(
                        "a forward pre-hook on the model changes its input; cache=True runs the "
                        "traced stages on the micro-batches themselves. Remove the hook or use "
                        "cache=False."
                    )
    finally:
        last.remove()


def _holds_tensors(v: Any) -> bool:
    if isinstance(v, dict):
        v = list(v.values())
    return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(map(_holds_tensors, v)))


def _bn_output(layer: _BatchNorm, xhat: torch.Tensor) -> torch.Tensor:
    """γ·x̂ + β, always a new tensor (an in-place activation after the layer must not change the kept x̂)."""
    y = _affine(layer, xhat)
    return y.clone() if y is xhat else y


class _Cached:
    """One step with the cache: :meth:`forward` (pass 1), then :meth:`backward`. The tensors it keeps for all K
    micro-batches: ``held`` (values a later stage reads), ``xhat`` (x̂ of every cut) and ``grads`` (∂L/∂value at
    the cuts; for a cut node ∂L/∂x̂), all on ``device`` (the model's, or the CPU for cache="cpu")."""

    def __init__(
        self,
        plan: _Plan,
        micro: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        rng: _Rng,
        exact: bool,
        meter: list[int] | None = None,
    ):
        self.plan, self.rng, self.exact, self.device, self.meter = plan, rng, exact, device, meter
        self.xs, self.ys = [xb for xb, _ in micro], [yb for _, yb in micro]
        self.home = self.xs[0].device
        k = len(micro)
        self.held: list[dict[fx.Node, Any]] = [{} for _ in range(k)]
        self.grads: list[dict[fx.Node, torch.Tensor]] = [{} for _ in range(k)]
        self.xhat: list[list[torch.Tensor]] = []
        self.consts: list[tuple[torch.Tensor, torch.Tensor]] = []  # full-batch mean and √(σ²+ε) per cut
        self.sizes: list[list[int]] = []  # per cut, the K micro-batches' lengths of its input
        self.requires: dict[fx.Node, bool] = {}  # whether the value needs a gradient (a cut: whether x̂ does)
        self.starts: list[list[Any]] = [[] for _ in range(k)]  # generator state at each stage's start
        self.stats: dict[_BatchNorm, Moments] = {}

    def _put(self, v: Any) -> Any:
        return v.detach().to(self.device) if isinstance(v, torch.Tensor) else v

    def _get(self, v: Any) -> Any:
        return v.to(self.home) if isinstance(v, torch.Tensor) else v

    def _value(self, i: int, n: fx.Node) -> Any:
        return self.xs[i] if n is self.plan.input else self._get(self.held[i][n])

    def _release(self, i: int, step: int) -> None:
        held = self.held[i]
        for n in [n for n in held if self.plan.last_use[n] <= step and n not in self.plan.kept]:
            del held[n]

    def _measure(self) -> None:
        if self.meter is None:
            return
        tensors = [
            *(v for h in self.held for v in h.values()),
            *(t for ts in self.xhat for t in ts),
            *(g for d in self.grads for g in d.values()),
        ]
        self.meter.append(tensor_bytes(t for t in tensors if isinstance(t, torch.Tensor)))

    def _check(self, live: dict[fx.Node, Any], versions: dict[fx.Node, int], step: int) -> None:
        """Refuse a value changed in place after a later step's reader saw it (micro-batch 0 shows it for all:
        every micro-batch runs the same graph); forget the values no later step reads."""
        for n, version in versions.items():
            if live[n]._version == version or (n in self.plan.cut_of and self.plan.last_use[n] == step):
                continue  # unchanged, or a BatchNorm output changed by its last reader (an in-place activation)
            read = self.plan.read_at.get(n)
            if read is not None and read[0] < step:
                raise ValueError(_inplace_message(read[1]))
            raise ValueError(
                f"the value {n.name!r} of the traced forward is read after a BatchNorm layer and "
                "modified in place; cache=True keeps such values from pass to pass and cannot follow "
                "the change. Use the out-of-place operation, or cache=False."
            )
        for n in [n for n in live if self.plan.last_use[n] <= step]:
            del live[n]
            versions.pop(n, None)

    def forward(self) -> None:
        """Pass 1: stage s for all K micro-batches, then layer s+1's full-batch statistics from the K inputs, and
        x̂ = (x − μ)/√(σ²+ε) of each. Micro-batch 0 runs with its autograd graph (in the caller's grad mode): it
        shows which values need a gradient and which are changed in place."""
        plan, rng, k, grad = self.plan, self.rng, len(self.xs), torch.is_grad_enabled()
        last = len(plan.cuts)
        state = list(rng.starts[:k]) if rng.random else []
        live: dict[fx.Node, Any] = {plan.input: self.xs[0]}
        versions: dict[fx.Node, int] = {}
        for s, stage in enumerate(plan.stages):
            for i in range(k if rng.random else 0):
                self.starts[i].append(state[i])
            for i in range(k if s < last else 1):  # the last stage: micro-batch 0 only, for the checks
                if rng.random:
                    rng.load(state[i])
                with torch.set_grad_enabled(grad and i == 0):
                    outs = stage.run(*[live[n] if i == 0 else self._value(i, n) for n in stage.inputs])
                if rng.random:
                    state[i] = rng.state()
                for n, v in zip(stage.outputs, outs if s < last else ()):
                    if i == 0 and not isinstance(v, torch.Tensor) and _holds_tensors(v):
                        raise ValueError(
                            f"the value {n.name!r} of the traced forward, read after a BatchNorm layer, "
                            f"is a {type(v).__name__} of tensors; cache=True keeps single tensors across "
                            "the layers. Index it before the layer, or use cache=False."
                        )
                    self.held[i][n] = self._put(v)
                    if i == 0:
                        live[n] = v
                        self.requires[n] = isinstance(v, torch.Tensor) and v.requires_grad
                        if isinstance(v, torch.Tensor):
                            versions[n] = v._version
                if i == 0:
                    self._check(live, versions, 2 * s)
                self._release(i, 2 * s)
            if s < last:
                self._cut(s, live, versions, grad)
            self._measure()

    def _cut(self, c: int, live: dict[fx.Node, Any], versions: dict[fx.Node, int], grad: bool) -> None:
        """Layer c's statistics from its inputs of all K micro-batches (the moments of their concatenation), and
        x̂ = (x − μ)/√(σ²+ε) of each micro-batch, kept; the inputs are released unless a later stage reads them."""
        node, layer, step = self.plan.cuts[c], self.plan.layers[c], 2 * c + 1
        xn = node.args[0]
        assert isinstance(xn, fx.Node)
        layer._check_input_dim(live[xn])
        with torch.no_grad():
            parts = [live[xn].detach(), *(self._value(i, xn) for i in range(1, len(self.xs)))]
            self.sizes.append([len(p) for p in parts])
            x = torch.cat(parts)
            total = Moments.of(x)
            if total.count < 2:
                raise ValueError(
                    f"BatchNorm layer {_label(self.plan.read_at[xn][1])} sees {total.count} value per "
                    "channel in the whole batch; batch statistics need at least 2 (nn.BatchNorm "
                    "refuses this too)."
                )
            shape = _shape(x)
            mean, scale = total.mean.view(shape), torch.sqrt(total.var + layer.eps).view(shape)
            xhat = (x - mean) / scale
            ys = self._put(_bn_output(layer, xhat)).split(self.sizes[c]) if node.users else None
        self.stats[layer] = total
        self.consts.append((mean, scale))
        self.xhat.append(list(self._put(xhat).split(self.sizes[c])))
        with torch.set_grad_enabled(grad):  # micro-batch 0 again, with its graph
            xhat0 = (live[xn] - mean) / scale
            self.requires[node] = xhat0.requires_grad
            if node.users:
                live[node] = _bn_output(layer, xhat0)
                versions[node] = live[node]._version
        for i in range(len(self.xs)):
            if ys is not None:
                self.held[i][node] = ys[i]
            self._release(i, step)
        self._check(live, versions, step)

    def _add(self, i: int, n: fx.Node, g: torch.Tensor) -> None:
        old = self.grads[i].get(n)
        self.grads[i][n] = self._put(g if old is None else self._get(old) + g)

    def _leaf(self, i: int, n: fx.Node) -> tuple[Any, Any]:
        """Stage input n of micro-batch i as (what the stage gets, the leaf whose .grad is ∂L/∂n, or ∂L/∂x̂)."""
        c = self.plan.cut_of.get(n)
        if c is not None:
            xhat = self._get(self.xhat[c][i]).detach().requires_grad_(self.requires[n])
            return _bn_output(self.plan.layers[c], xhat), xhat
        v = self._get(self.held[i][n])
        if isinstance(v, torch.Tensor):
            v = v.detach().requires_grad_(self.requires[n])
        return v, v

    def backward(self, loss_fn: LossFn, k: int) -> float:
        """Stages from the last to the first: each recomputed per micro-batch from its kept inputs and
        back-propagated from the gradients at its outputs (the last: from loss / K); after stage c, layer c's
        gradient (see :meth:`_correct`). Returns the batch loss."""
        plan, total = self.plan, 0.0
        for s in reversed(range(len(plan.stages))):
            for i in range(len(self.xs)):
                total += self._back_through(s, i, loss_fn, k)
            for held in self.held:
                for n in [n for n in held if plan.kept.get(n) == s]:
                    del held[n]
            if s > 0:
                self._correct(s - 1)
            self._measure()
        return total

    def _back_through(self, s: int, i: int, loss_fn: LossFn, k: int) -> float:
        """Stage s of micro-batch i, recomputed and back-propagated; ∂L/∂ its inputs kept. Returns its loss / K
        (the last stage) or 0."""
        stage, last = self.plan.stages[s], s == len(self.plan.cuts)
        if self.rng.random:
            self.rng.load(self.starts[i][s])
        args, leaves = [], []
        for n in stage.inputs:
            if n is self.plan.input:
                args.append(self.xs[i])
            else:
                arg, leaf = self._leaf(i, n)
                args.append(arg)
                leaves.append((n, leaf))
        out = stage.run(*args)
        roots: list[torch.Tensor] = []
        seeds: list[torch.Tensor | None] = []
        loss = 0.0
        if last:
            root = loss_fn(out, self.ys[i]) / k
            if not root.requires_grad:
                raise ValueError(_no_grad_message())
            roots, seeds = [root], [None]
            loss = float(root.detach())
        for n, v in zip(stage.outputs, out if not last else ()):
            g = self.grads[i].pop(n, None)
            if g is not None and isinstance(v, torch.Tensor) and v.requires_grad:
                roots.append(v)
                seeds.append(self._get(g))
        if roots:
            torch.autograd.backward(roots, seeds)
        for n, leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
                self._add(i, n, leaf.grad)
        return loss

    def _correct(self, c: int) -> None:
        r"""Layer c's backward from the K micro-batches' :math:`a = \partial L/\partial\hat x`: exact,
        :math:`\frac1s(a - \bar a - \hat x\,\overline{a\hat x})` with the full-batch means; constants, :math:`a/s`."""
        node, layer = self.plan.cuts[c], self.plan.layers[c]
        xn = node.args[0]
        assert isinstance(xn, fx.Node)
        a = [self.grads[i].pop(node, None) for i in range(len(self.xs))]
        xhats, self.xhat[c] = self.xhat[c], []
        if not self.requires[node] or all(g is None for g in a):
            return
        mean, scale = self.consts[c]
        with torch.no_grad():
            g = torch.cat([self._get(t) if t is not None else torch.zeros_like(self._get(x)) for t, x in zip(a, xhats)])
            if self.exact:
                xhat, shape, dims = torch.cat([self._get(x) for x in xhats]), _shape(g), [0, *range(2, g.dim())]
                count = self.stats[layer].count
                g = g - ((g.sum(dims) / count).view(shape) + xhat * ((g * xhat).sum(dims) / count).view(shape))
            g = g / scale
        for i, gi in enumerate(g.split(self.sizes[c])):
            self._route(i, xn, gi)

    def _route(self, i: int, n: fx.Node, g: torch.Tensor) -> None:
        """Pass ∂L/∂x of a BatchNorm input x (value n) on to what computed x."""
        if n is self.plan.input:
            if self.xs[i].requires_grad:
                torch.autograd.backward(self.xs[i], g)
        elif n in self.plan.cut_of:  # the input is the previous BatchNorm's output γ·x̂ + β
            y, xhat = self._leaf(i, n)
            if y.requires_grad:
                torch.autograd.backward(y, g)
            if xhat.grad is not None:
                self._add(i, n, xhat.grad)
        else:
            self._add(i, n, g)


@dataclass(frozen=True)
class CacheBytes:
    """What ``cache=True`` keeps for one step, next to what one forward of the whole batch saves for its backward.

    ``cache``: the most bytes the cache holds at once (the values read across the cuts, x̂ of every cut and the
    gradients at the cuts, all K micro-batches; unique storages); ``activations``: the bytes autograd saves in one
    forward of the whole batch and its loss (unique storages, the parameters' and buffers' left out)."""

    cache: int
    activations: int

    @property
    def fraction(self) -> float:
        return self.cache / self.activations


def saved_activation_bytes(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for the backward of ``loss_fn(model(x), y)`` (unique storages, parameters and buffers
    not counted), on a copy of ``model``; the generators are left as they were."""
    work = copy.deepcopy(model)
    own = {t.untyped_storage().data_ptr() for t in [*work.parameters(), *work.buffers()]}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with (
        torch.random.fork_rng(devices=_cuda_devices(model, x)),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        loss = loss_fn(work(x), y)
    del loss
    return tensor_bytes(saved, exclude=own)


def tensor_bytes(tensors: Iterable[torch.Tensor], exclude: Set[int] = frozenset()) -> int:
    """Bytes the ``tensors`` occupy, every byte counted once: per storage, the union of the byte spans the
    tensors view, each from its first to its last element (a slice of a dataset counts its own rows, not the
    whole dataset's storage; two views of one buffer count it once; a strided view such as a column counts the
    span it crosses, an upper bound). Storages whose ``data_ptr`` is in ``exclude`` are left out."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr in exclude or t.numel() == 0:
            continue
        start = int(t.storage_offset()) * t.element_size()
        extent = 1 + sum((int(n) - 1) * int(stride) for n, stride in zip(t.shape, t.stride()))
        spans.setdefault(ptr, []).append((start, start + extent * t.element_size()))
    total = 0
    for ranges in spans.values():
        end = -1
        for a, b in sorted(ranges):
            total += max(0, b - max(a, end))
            end = max(end, b)
    return total
