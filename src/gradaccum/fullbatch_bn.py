"""The exact full-batch-statistics scheme: every micro-batch normalized with the statistics of the whole
logical batch of K·b samples, with the full batch's gradient and running statistics, to float64 rounding.

Micro-batch k would need the statistics of micro-batches k+1..K before they have been computed, so it cannot be
done in one pass; :func:`full_batch_stats_backward` does it in two (a statistics pass, then forward/backward
sweeps), and refuses with a ``ValueError`` naming the layer where it cannot be exact. Chapter 2 of the book.
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._validate import require_k
from gradaccum.accumulate import LossFn, flat_grad, split_batch


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


class _StopForward(Exception):
    """Raised inside a forward pass to end it early, once the layer of interest has seen its input."""


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, -1, *([1] * (x.dim() - 2)))


def _label(name: str) -> str:
    return f"'{name}'" if name else "(the model itself)"


def _uses_batch_stats(layer: _BatchNorm) -> bool:
    """Whether ``layer`` normalizes with batch statistics, as ``nn.BatchNorm.forward`` decides: always in
    training mode, and in eval mode only when it keeps no running statistics (``track_running_stats=False``).
    An eval-mode layer with running statistics is the constant affine map
    :math:`y = \\gamma\\,(x-\\bar\\mu)/\\sqrt{\\bar\\sigma^2+\\epsilon} + \\beta`: the scheme leaves it alone."""
    return layer.training or (layer.running_mean is None and layer.running_var is None)


def _check_supported(name: str, layer: _BatchNorm) -> None:
    """Refuse batch-statistics layers whose forward is not ``nn.BatchNorm``'s: the scheme replaces that forward."""
    if type(layer).forward is _BatchNorm.forward:
        return
    if isinstance(layer, nn.SyncBatchNorm):
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return  # outside torch.distributed, SyncBatchNorm computes exactly what nn.BatchNorm does
        raise ValueError(
            f"BatchNorm layer {_label(name)} is a SyncBatchNorm under torch.distributed: it normalizes with the "
            "statistics of all processes, and this scheme computes them on this process only. Convert it to "
            "nn.BatchNorm (per-process statistics) or accumulate as usual."
        )
    raise ValueError(
        f"BatchNorm layer {_label(name)} is a {type(layer).__name__} with its own forward, which this scheme cannot "
        "reproduce (it reimplements nn.BatchNorm1d/2d/3d only). Replace it with nn.BatchNorm, freeze it with "
        ".eval() so that it uses its running statistics, or accumulate as usual."
    )


def _batch_stat_layers(model: nn.Module) -> dict[_BatchNorm, str]:
    """Name of every BatchNorm layer of ``model`` that normalizes with batch statistics (checked supported)."""
    named = {m: n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    if not named:
        raise ValueError("the model has no BatchNorm layer: full-batch statistics change nothing. Accumulate as usual.")
    layers = {m: n for m, n in named.items() if _uses_batch_stats(m)}
    for m, n in layers.items():
        _check_supported(n, m)
    return layers


def batchnorm_layers(model: nn.Module, x: torch.Tensor) -> list[tuple[str, _BatchNorm]]:
    """The model's BatchNorm layers in the order the forward pass calls them (found by running ``x`` in eval
    mode, without gradients; every module's mode and the random-number generators are left as they were)."""
    named = {m: n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    if not named:
        raise ValueError("the model has no BatchNorm layer: full-batch statistics change nothing. Accumulate as usual.")
    order: list[tuple[str, _BatchNorm]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, inp: order.append((named[mod], mod))) for m in named]
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model, x)):
            model.eval()(x)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    seen = [n for n, _ in order]
    for n in seen:
        if seen.count(n) > 1:
            raise ValueError(_twice_message(n))
    return order


def _twice_message(name: str) -> str:
    return (f"BatchNorm layer {_label(name)} is called more than once per forward pass; the scheme gives each layer "
            "one set of full-batch statistics, so it needs each batch-statistics BatchNorm called once. Give each "
            "call its own BatchNorm module (or freeze this one with .eval()).")


def _cuda_devices(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Indices of the CUDA devices holding the model or the input (whose generators dropout draws from)."""
    tensors = [*model.parameters(), *model.buffers(), x]
    return sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in tensors if t.device.type == "cuda"})


class _Rng:
    """Random-number-generator states replayed per micro-batch, so that every sweep draws the same dropout masks.

    The first statistics sweep runs micro-batch 0's whole forward. If it drew no random numbers, the model is
    deterministic: every micro-batch replays the entry state (which is then a no-op). Otherwise that sweep runs
    every micro-batch's whole forward and records ``starts[i]``, the state micro-batch i starts from: the entry
    state for i = 0, the state micro-batch i−1's forward ended in for i > 0 — the states plain accumulation would
    use, so the masks are plain accumulation's. The CPU generator and those of the CUDA devices in use are
    replayed.
    """

    def __init__(self, devices: list[int]):
        self.devices = devices
        self.starts = [self._get()]
        self.random: bool | None = None  # whether a forward draws random numbers; None: not known (no replay)

    def _get(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return torch.get_rng_state(), tuple(torch.cuda.get_rng_state(d) for d in self.devices)

    def at(self, i: int) -> None:
        """Set the generators to the start state of micro-batch ``i``."""
        if self.random is None:
            return
        cpu, cuda = self.starts[min(i, len(self.starts) - 1)]
        torch.set_rng_state(cpu)
        for d, state in zip(self.devices, cuda):
            torch.cuda.set_rng_state(state, d)

    def ended(self, i: int) -> None:
        """Micro-batch ``i``'s whole forward has run: record the state micro-batch i+1 starts from."""
        state = self._get()
        if i == 0:
            first = self.starts[0]
            self.random = not (torch.equal(state[0], first[0]) and all(map(torch.equal, state[1], first[1])))
        if self.random:
            self.starts.append(state)


class _Sweep:
    """Per-layer state of one backward sweep of the exact scheme.

    ``corrections[layer] = (A1, A2)``: full-batch means of a = ∂L/∂x̂ and of a·x̂, once known;
    ``collect``: the layer whose sums Σa, Σa·x̂ this sweep gathers (into ``sums``), read in its backward;
    ``inputs``: (input, version) of every layer called in the current forward, so that an in-place change of an
    input, which the backward would read, is refused before any gradient is computed.
    """

    def __init__(self, corrections: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]],
                 collect: _BatchNorm | None = None):
        self.corrections = corrections
        self.collect = collect
        self.sums: tuple[torch.Tensor, torch.Tensor] | None = None
        self.inputs: dict[_BatchNorm, tuple[torch.Tensor, int, str]] = {}

    def check_inputs(self) -> None:
        for x, version, name in self.inputs.values():
            if x._version != version:
                raise ValueError(
                    f"the input of BatchNorm layer {_label(name)} was modified in place after the layer read it "
                    "(e.g. x.relu_() or x += ... on the tensor fed to the layer); its gradient needs that input, "
                    "and nn.BatchNorm's own backward fails on this too. Use the out-of-place operation."
                )


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
    def forward(ctx, x: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor,
                layer: _BatchNorm, sweep: _Sweep | None) -> torch.Tensor:
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

    def __init__(self, names: dict[_BatchNorm, str], stats: dict[_BatchNorm, Moments], sweep: _Sweep | None = None,
                 once: bool = True):
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


def _statistics_pass(model: nn.Module, micro_batches: Sequence[torch.Tensor], names: dict[_BatchNorm, str],
                     rng: _Rng) -> dict[_BatchNorm, Moments]:
    """Full-batch input moments of every batch-statistics layer, in call order (see :func:`full_batch_statistics`)."""
    stats: dict[_BatchNorm, Moments] = {}
    if not names:
        return stats
    patch = _Patch(names, stats)
    order: list[_BatchNorm] | None = None
    with torch.no_grad(), _patched(patch, list(names)):
        patch.discover = True  # sweep 1: call order, first layer's moments, RNG states (see _Rng)
        for i, xb in enumerate(micro_batches):
            rng.at(i)
            patch.new_forward()
            patch.stop_after_first = i > 0 and not rng.random
            try:
                model(xb)
            except _StopForward:
                pass
            else:
                rng.ended(i)
            if order is None:
                order = patch.order
            elif patch.order != order[: len(patch.order)] or (not patch.stop_after_first and patch.order != order):
                raise ValueError("the model calls its BatchNorm layers in a different order for different "
                                 "micro-batches (data-dependent control flow?); the scheme needs the same order.")
        patch.discover = False
        assert order is not None
        for layer in order:
            if layer is not order[0]:
                patch.target, patch.total = layer, None
                for i, xb in enumerate(micro_batches):
                    rng.at(i)
                    patch.new_forward()
                    try:
                        model(xb)
                    except _StopForward:
                        pass
            moments = patch.total
            if moments is None:  # pragma: no cover - the layer was reached in sweep 1
                raise RuntimeError("a BatchNorm layer was not reached")
            if moments.count < 2:
                raise ValueError(f"BatchNorm layer {_label(names[layer])} sees {moments.count} value per channel in "
                                 "the whole batch; batch statistics need at least 2 (nn.BatchNorm refuses this too).")
            stats[layer] = moments
            patch.target, patch.total = None, None
    return stats


def full_batch_statistics(model: nn.Module, micro_batches: Sequence[torch.Tensor]) -> dict[_BatchNorm, Moments]:
    """Statistics pass: for every BatchNorm layer that normalizes with batch statistics, the moments of its input
    over *all* micro-batches, with every earlier such layer already normalizing with its full-batch statistics.

    Layer ℓ's input depends on how layers 1..ℓ−1 normalize, so the layers are handled in call order, one
    sweep over the micro-batches each, stopped at layer ℓ; the first sweep also runs micro-batch 0's whole forward,
    which finds the call order. Eval-mode layers with running statistics are constant affine maps and are left out. No
    gradients are kept and no running statistic changes. Random layers (dropout) draw the same masks in every
    sweep: micro-batch i starts each sweep from the generator state micro-batch i−1's forward ended in, which is
    where plain accumulation would start it (finding those states costs one whole forward per micro-batch in the
    first sweep, only for a model that draws random numbers); the generators are left where K plain forwards
    leave them.
    """
    if len(micro_batches) == 0:
        raise ValueError("micro_batches is empty; pass the K micro-batches of one logical batch.")
    rng = _Rng(_cuda_devices(model, micro_batches[0]))
    stats = _statistics_pass(model, micro_batches, _batch_stat_layers(model), rng)
    rng.at(len(micro_batches))
    return stats


def update_running_stats(stats: dict[_BatchNorm, Moments]) -> None:
    """One running-statistics update per layer from the full batch's mean and unbiased variance, as one
    ``nn.BatchNorm`` forward over the whole batch does: only in training mode with ``track_running_stats``;
    ``num_batches_tracked`` += 1; factor = ``momentum``, or 1/``num_batches_tracked`` when ``momentum=None``
    (cumulative average)."""
    with torch.no_grad():
        for layer, m in stats.items():
            if not (layer.training and layer.track_running_stats):
                continue
            factor = 0.0 if layer.momentum is None else layer.momentum
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.add_(1)
                if layer.momentum is None:
                    factor = 1.0 / float(layer.num_batches_tracked)
            if layer.running_mean is not None:
                layer.running_mean.mul_(1 - factor).add_(m.mean, alpha=factor)
            if layer.running_var is not None:
                unbiased = m.var * m.count / (m.count - 1)
                layer.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)


def _collect_corrections(model: nn.Module, loss_fn: LossFn, micro: list, k: int, stats: dict[_BatchNorm, Moments],
                         names: dict[_BatchNorm, str],
                         rng: _Rng) -> dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]]:
    """Backward sweeps from the last BatchNorm layer to the first: sweep ℓ gathers Σa and Σa·x̂ of layer ℓ over
    all micro-batches, with the corrections of the layers after it already applied. A layer whose input needs
    no gradient (BatchNorm on the raw input, everything before it frozen) needs no correction: one forward
    shows it, and its sweep stops there."""
    corrections: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in reversed(list(stats)):
        sweep = _Sweep(corrections, collect=layer)
        with _patched(_Patch(names, stats, sweep), list(names)) as patch:
            for i, (xb, yb) in enumerate(micro):
                rng.at(i)
                patch.new_forward()
                loss = loss_fn(model(xb), yb) / k
                sweep.check_inputs()
                x = sweep.inputs[layer][0]
                if not (x.requires_grad and loss.requires_grad):
                    break
                torch.autograd.grad(loss, x, allow_unused=True)
        if sweep.sums is not None:
            corrections[layer] = (sweep.sums[0] / stats[layer].count, sweep.sums[1] / stats[layer].count)
    return corrections


def full_batch_stats_backward(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int,
                              exact: bool = False) -> float:
    """One optimizer step's gradient with every micro-batch normalized by the *full* batch's statistics.

    Pass 1 (:func:`full_batch_statistics`) computes each batch-statistics BatchNorm layer's statistics over all
    K micro-batches; the last pass runs forward/backward of each micro-batch with those statistics (loss / K),
    so the forward equals the full-batch forward exactly. With ``exact=False`` the statistics are constants, and
    the gradient misses every term through them. With ``exact=True`` up to L more sweeps (one per BatchNorm
    layer whose input needs a gradient, last layer first) gather the full-batch means those terms need, and the
    gradient equals the full-batch gradient up to rounding, at the cost of L + 1 forward/backward sweeps.
    Running statistics are updated once, from the full batch. Gradients are added to ``.grad``; returns the
    batch loss. ``loss_fn`` must be a mean over the samples (each micro-batch's loss is divided by K); with a
    summed loss the step is 1/K of the full-batch sum's gradient.

    Layers are treated as ``nn.BatchNorm`` treats them: a training-mode layer (or an eval-mode one without
    running statistics) normalizes with the full batch's statistics; an eval-mode layer with running statistics
    is a constant affine map and is left alone; running statistics move only in training mode with
    ``track_running_stats``. Dropout draws the same masks in every sweep (see :func:`full_batch_statistics`), so
    the result is the full-batch gradient with the masks plain accumulation would draw. ValueError, naming the
    layer, for what the scheme cannot reproduce: a BatchNorm called twice per forward, a BatchNorm subclass with
    its own forward (or SyncBatchNorm under torch.distributed), a BatchNorm input modified in place after the
    layer read it (``exact=True``), a model in eval mode.
    """
    require_k(k)
    if not model.training:
        raise ValueError("full-batch statistics are a training-mode scheme; call model.train() first.")
    micro = split_batch(x, y, k)
    names = _batch_stat_layers(model)
    rng = _Rng(_cuda_devices(model, x))
    stats = _statistics_pass(model, [xb for xb, _ in micro], names, rng)
    sweep = _Sweep(_collect_corrections(model, loss_fn, micro, k, stats, names, rng)) if exact else None
    total = 0.0
    with _patched(_Patch(names, stats, sweep), list(names)) as patch:
        for i, (xb, yb) in enumerate(micro):
            rng.at(i)
            patch.new_forward()
            loss = loss_fn(model(xb), yb) / k
            if sweep is not None:
                sweep.check_inputs()
            if not loss.requires_grad:
                raise ValueError("the loss needs no gradient: no parameter that requires grad reaches it (or "
                                 "gradients are disabled, e.g. under torch.no_grad()).")
            loss.backward()
            total += float(loss.detach())
    update_running_stats(stats)
    return total


def full_batch_stats_gradient(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int,
                              exact: bool = False) -> torch.Tensor:
    """Flat gradient of :func:`full_batch_stats_backward`, computed on a copy (the model is not modified)."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    full_batch_stats_backward(work, loss_fn, x, y, k, exact)
    return flat_grad(work).detach()


@torch.no_grad()
def full_batch_forward_error(model: nn.Module, x: torch.Tensor, k: int) -> float:
    """Largest |difference| between the full-batch train-mode forward and the two-pass scheme's micro-batch
    forwards, on a copy of ``model`` with every module's mode kept (0 up to rounding for every K).

    Refused for a model with active dropout modules: one forward over the whole batch and K over its parts draw
    different masks, so the two forwards would differ by the masks, not by the normalization.
    """
    require_k(k)
    if x.shape[0] % k:
        raise ValueError(f"a batch of {x.shape[0]} cannot be cut into K = {k} equal micro-batches.")
    if not model.training:
        raise ValueError("full-batch statistics are a training-mode scheme; call model.train() first.")
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise ValueError(f"dropout layer {_label(name)} draws different masks for the whole batch and for its "
                             "K parts, so the forwards cannot be compared; put it in eval mode (.eval()) for this "
                             "check.")
    work = copy.deepcopy(model)
    reference = copy.deepcopy(work)(x)
    parts = list(x.split(x.shape[0] // k))
    stats = full_batch_statistics(work, parts)
    with normalized_with(stats):
        out = torch.cat([work(p) for p in parts])
    return float((out - reference).abs().max())
