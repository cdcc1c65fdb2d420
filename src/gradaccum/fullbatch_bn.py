"""The exact full-batch-statistics scheme: every micro-batch normalized with the statistics of the whole
logical batch of K·b samples, with the full batch's gradient and running statistics, to float64 rounding.

Micro-batch k would need the statistics of micro-batches k+1..K before they have been computed, so it cannot be
done in one pass; :func:`full_batch_stats_backward` does it in two (a statistics pass, then forward/backward
sweeps), and refuses with a ``ValueError`` naming the layer where it cannot be exact. With ``cache=True`` (or
``"cpu"``) it cuts the traced forward at the BatchNorm layers and keeps what crosses each cut for all K
micro-batches, so that the L partial forwards become one forward and the L + 1 sweeps one recomputing backward
(:func:`cache_bytes` measures the memory that costs). Chapter 2 of the book.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from gradaccum._validate import require_flag, require_k, require_tensor
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


ORDER_MESSAGE = ("the model calls its BatchNorm layers in a different order for different micro-batches, or not all "
                 "of them for every micro-batch (data-dependent control flow?); the scheme needs the same BatchNorm "
                 "calls, in the same order, for every micro-batch.")


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
    require_tensor(x)
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
            "call its own BatchNorm module (or freeze this one with .eval()). If the second call is activation "
            "checkpointing recomputing the layer during backward, the scheme supports it only with "
            "torch.utils.checkpoint(..., use_reentrant=False) and cache=True (its running statistics are then "
            "updated once, as by a full batch without checkpointing; a checkpointed full batch updates them twice, "
            "once more in the recomputation).")


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
        if self.random is not None:
            self.load(self.starts[min(i, len(self.starts) - 1)])

    def state(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self._get()

    def load(self, state: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> None:
        torch.set_rng_state(state[0])
        for d, cuda in zip(self.devices, state[1]):
            torch.cuda.set_rng_state(cuda, d)

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
                raise ValueError(_inplace_message(name))


def _inplace_message(name: str) -> str:
    return (f"the input of BatchNorm layer {_label(name)} was modified in place after the layer read it (e.g. "
            "x.relu_() or x += ... on the tensor fed to the layer); its gradient needs that input, and "
            "nn.BatchNorm's own backward fails on this too. Use the out-of-place operation.")


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


class _NoFunctionalBatchNorm(TorchFunctionMode):
    """Refuse a batch normalization with batch statistics that is not a BatchNorm module (``F.batch_norm(...,
    training=True)`` in a forward): the scheme replaces BatchNorm modules only, so it would stay per micro-batch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in (F.batch_norm, torch.batch_norm, torch.native_batch_norm):
            training = kwargs.get("training", args[5] if len(args) > 5 else False)
            if training:
                raise ValueError("the forward calls a batch normalization with batch statistics that is not a "
                                 "BatchNorm module (F.batch_norm(..., training=True)); the scheme replaces BatchNorm "
                                 "modules only, so it would normalize per micro-batch. Use an nn.BatchNorm module.")
        return func(*args, **kwargs)


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
            mode = _NoFunctionalBatchNorm() if i == 0 else contextlib.nullcontext()
            rng.at(i)
            patch.new_forward()
            patch.stop_after_first = i > 0 and not rng.random
            try:
                with mode:
                    model(xb)
            except _StopForward:
                pass
            else:
                if patch.stop_after_first:  # it should have stopped at the first layer: never reached it
                    raise ValueError(ORDER_MESSAGE)
                rng.ended(i)
            if order is None:
                order = patch.order
            elif patch.order != order[: len(patch.order)] or (not patch.stop_after_first and patch.order != order):
                raise ValueError(ORDER_MESSAGE)
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
                    else:  # this micro-batch's forward never reached the layer
                        raise ValueError(ORDER_MESSAGE)
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
                if layer not in sweep.inputs:
                    raise ValueError(ORDER_MESSAGE)
                x = sweep.inputs[layer][0]
                if not (x.requires_grad and loss.requires_grad):
                    break
                torch.autograd.grad(loss, x, allow_unused=True)
        if sweep.sums is not None:
            corrections[layer] = (sweep.sums[0] / stats[layer].count, sweep.sums[1] / stats[layer].count)
    return corrections


# ---------------------------------------------------------------------------------------- cache=True or "cpu"
#
# The uncached scheme restarts the model's forward from its input for every partial forward and every sweep. With
# the cache, torch.fx traces the forward once and cuts it at the L batch-statistics BatchNorm calls into L + 1
# stages; each stage runs on what earlier stages left (the values it reads), so nothing is recomputed from the
# input. Pass 1 runs stage 0 for all K micro-batches, takes layer 1's statistics from the K inputs, runs stage 1,
# and so on (one forward in all). The backward goes stage by stage from the top: stage s is recomputed for each
# micro-batch from its kept inputs (with the same dropout masks) and back-propagated from the gradients that
# arrived at its outputs; between stage c and stage c−1, layer c's correction needs only the K gradients
# a = ∂L/∂x̂ at the cut (one forward and one backward in all).


class _Refused(ValueError):
    """A refusal raised while tracing, told apart from torch.fx's own errors."""


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


class _Tracer(fx.Tracer):
    """torch.fx's tracer with every BatchNorm (subclasses too) kept as one call, the cuts of the cached scheme.
    Refuses a hook on a module it traces through: the graph would leave the hook out."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _BatchNorm) or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        name = self.path_of_module(m)
        if _has_hooks(m) and not self.is_leaf_module(m, name):
            raise _Refused(f"module {_label(name)} has hooks; cache=True runs a torch.fx trace of the model, which "
                           "runs only the hooks of the modules it keeps whole (torch.nn layers). Remove the hooks "
                           "or use cache=False.")
        return super().call_module(m, forward, args, kwargs)


@dataclass
class _Stage:
    run: fx.GraphModule  # the stage's inputs → its outputs (the last stage: → the model's output)
    inputs: list[fx.Node]  # values it reads that were computed before it
    outputs: list[fx.Node]  # its values read after it


@dataclass
class _Plan:
    """The traced forward cut at its L batch-statistics BatchNorm calls. Steps: stage 0, cut 1, stage 1, …,
    cut L, stage L, numbered 0..2L (stage s is step 2s, cut c step 2c − 1). ``last_use[n]``: the last step that
    reads value n; ``kept[n]``: the first stage whose recomputation reads n (a value only a BatchNorm reads is
    not kept: x̂ is); ``cut_of[n]``: the index of cut n; ``read_at[n]``: the first step whose BatchNorm reads n."""

    input: fx.Node
    stages: list[_Stage]
    cuts: list[fx.Node]
    layers: list[_BatchNorm]
    last_use: dict[fx.Node, int]
    kept: dict[fx.Node, int]
    cut_of: dict[fx.Node, int]
    read_at: dict[fx.Node, tuple[int, str]]


def _plan(model: nn.Module, names: dict[_BatchNorm, str]) -> _Plan:
    """The stages of ``model``, traced at every call: a trace bakes in whatever the forward read while it ran (a
    dict's entries, a module-level global, an attribute's value), and no check of the model can tell that one of
    those changed, so a kept trace could silently compute another network. ValueError
    for hooks the stages would skip: on the model (a forward pre-hook that only looks is allowed; one that changes
    the input is refused when it runs, see :func:`_find_rng_starts`) and on the BatchNorm layers they replace."""
    if model._forward_hooks or model._backward_hooks or model._backward_pre_hooks:
        raise ValueError("the model has forward or backward hooks; cache=True runs a torch.fx trace of its forward, "
                         "which leaves them out (forward pre-hooks are allowed). Remove them or use cache=False.")
    hooked = [name for layer, name in names.items() if _has_hooks(layer)]
    if hooked:
        raise ValueError(f"BatchNorm layer {_label(hooked[0])} has hooks; cache=True computes the layers it cuts at "
                         "itself, so their hooks would not run. Remove them or use cache=False.")
    return _trace(model, names)


@contextmanager
def _grad_mode_watch() -> Iterator[list[str]]:
    """Record every change of autograd's mode (``torch.no_grad``, ``enable_grad``, ``set_grad_enabled``,
    ``inference_mode``) made while the body runs: a torch.fx trace does not record them."""
    seen: list[str] = []
    set_grad, inference = torch._C._set_grad_enabled, torch._C._InferenceMode

    def watched_set_grad(mode: bool) -> None:
        seen.append(f"set_grad_enabled({mode})")
        set_grad(mode)

    def watched_inference(*args: Any, **kwargs: Any) -> Any:
        seen.append("inference_mode")
        return inference(*args, **kwargs)

    torch._C._set_grad_enabled, torch._C._InferenceMode = watched_set_grad, watched_inference  # type: ignore[misc,assignment]
    try:
        yield seen
    finally:
        torch._C._set_grad_enabled, torch._C._InferenceMode = set_grad, inference  # type: ignore[misc]


def _trace(model: nn.Module, names: dict[_BatchNorm, str]) -> _Plan:
    """Trace ``model`` and cut it into stages (ValueError, saying why, for a model the cache cannot run)."""
    state = random.getstate()
    try:
        with _grad_mode_watch() as changes:
            graph = _Tracer().trace(model)
    except _Refused:
        raise
    except Exception as e:
        raise ValueError(f"cache=True cuts the model's forward at its BatchNorm layers with torch.fx, which cannot "
                         f"trace this model ({type(e).__name__}: {e}). Use cache=False — unless model(x) itself "
                         f"raises this error, which is then a bug in the model to fix first.") from e
    if random.getstate() != state:
        random.setstate(state)
        raise ValueError("the forward draws from Python's random module; a torch.fx trace would freeze the value "
                         "drawn while tracing. Use cache=False (or torch's generators, which the scheme replays).")
    if changes:
        raise ValueError(f"the forward changes autograd's mode ({changes[0]}, e.g. a torch.no_grad() block); a "
                         "torch.fx trace does not record that, so cache=True would compute gradients the model "
                         "switched off. Use cache=False.")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ValueError(f"cache=True runs models called as model(x); this forward takes {len(placeholders)} "
                         "inputs. Use cache=False.")
    cuts: list[fx.Node] = []
    layers: list[_BatchNorm] = []
    step: dict[fx.Node, int] = {}
    read_at: dict[fx.Node, tuple[int, str]] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            continue  # copied into every stage that reads it
        layer = model.get_submodule(str(n.target)) if n.op == "call_module" else None
        if not (isinstance(layer, _BatchNorm) and layer in names):
            step[n] = -1 if n.op == "placeholder" else 2 * len(cuts)
            continue
        if layer in layers:
            raise ValueError(_twice_message(names[layer]))
        x = n.args[0] if len(n.args) == 1 and not n.kwargs else None
        if not isinstance(x, fx.Node) or x.op == "get_attr":
            raise ValueError(f"BatchNorm layer {_label(names[layer])} is called with {n.args} {n.kwargs}; cache=True "
                             "handles one input computed in the forward. Use cache=False.")
        cuts.append(n)
        layers.append(layer)
        step[n] = 2 * len(cuts) - 1
        read_at.setdefault(x, (step[n], names[layer]))
    last_use = {n: max((step[u] for u in n.users), default=step[n]) for n in step}
    cut_of = {n: c for c, n in enumerate(cuts)}
    stages: list[_Stage] = []
    kept: dict[fx.Node, int] = {}
    for s in range(len(cuts) + 1):
        nodes = [n for n in step if step[n] == 2 * s]
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a in step and step[a] != 2 * s))
        outputs = [n for n in nodes if n.op != "output" and last_use[n] > 2 * s]
        for a in inputs:
            if a.op != "placeholder" and a not in cut_of:
                kept.setdefault(a, s)
        g = fx.Graph()
        env = {a: g.placeholder(a.name) for a in inputs}
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in env:  # a get_attr node
                    env[a] = g.node_copy(a)
            env[n] = g.node_copy(n, env.__getitem__)
        if s < len(cuts):
            g.output(tuple(env[n] for n in outputs))
        stages.append(_Stage(fx.GraphModule(model, g), inputs, outputs))
    return _Plan(placeholders[0], stages, cuts, layers, last_use, kept, cut_of, read_at)


def _find_rng_starts(model: nn.Module, micro_batches: Sequence[torch.Tensor], names: dict[_BatchNorm, str],
                     rng: _Rng) -> None:
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
                    raise ValueError("a forward pre-hook on the model changes its input; cache=True runs the "
                                     "traced stages on the micro-batches themselves. Remove the hook or use "
                                     "cache=False.")
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

    def __init__(self, plan: _Plan, micro: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 rng: _Rng, exact: bool, meter: list[int] | None = None):
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
        tensors = [*(v for h in self.held for v in h.values()), *(t for ts in self.xhat for t in ts),
                   *(g for d in self.grads for g in d.values())]
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
            raise ValueError(f"the value {n.name!r} of the traced forward is read after a BatchNorm layer and "
                             "modified in place; cache=True keeps such values from pass to pass and cannot follow "
                             "the change. Use the out-of-place operation, or cache=False.")
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
                        raise ValueError(f"the value {n.name!r} of the traced forward, read after a BatchNorm layer, "
                                         f"is a {type(v).__name__} of tensors; cache=True keeps single tensors across "
                                         "the layers. Index it before the layer, or use cache=False.")
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
                raise ValueError(f"BatchNorm layer {_label(self.plan.read_at[xn][1])} sees {total.count} value per "
                                 "channel in the whole batch; batch statistics need at least 2 (nn.BatchNorm "
                                 "refuses this too).")
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
        plan, rng, total = self.plan, self.rng, 0.0
        for s in reversed(range(len(plan.stages))):
            stage = plan.stages[s]
            for i in range(len(self.xs)):
                if rng.random:
                    rng.load(self.starts[i][s])
                args, leaves = [], []
                for n in stage.inputs:
                    if n is plan.input:
                        args.append(self.xs[i])
                    else:
                        arg, leaf = self._leaf(i, n)
                        args.append(arg)
                        leaves.append((n, leaf))
                out = stage.run(*args)
                roots: list[torch.Tensor] = []
                seeds: list[torch.Tensor | None] = []
                if s == len(plan.cuts):
                    loss = loss_fn(out, self.ys[i]) / k
                    if not loss.requires_grad:
                        raise ValueError(_no_grad_message())
                    roots, seeds = [loss], [None]
                    total += float(loss.detach())
                for n, v in zip(stage.outputs, out if s < len(plan.cuts) else ()):
                    g = self.grads[i].pop(n, None)
                    if g is not None and isinstance(v, torch.Tensor) and v.requires_grad:
                        roots.append(v)
                        seeds.append(self._get(g))
                if roots:
                    torch.autograd.backward(roots, seeds)
                for n, leaf in leaves:
                    if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
                        self._add(i, n, leaf.grad)
            for held in self.held:
                for n in [n for n in held if plan.kept.get(n) == s]:
                    del held[n]
            if s > 0:
                self._correct(s - 1)
            self._measure()
        return total

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

    with torch.random.fork_rng(devices=_cuda_devices(model, x)), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
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


def cache_bytes(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int) -> CacheBytes:
    """Measure :class:`CacheBytes` for one step of ``full_batch_stats_backward(..., exact=True, cache=True)`` on
    a copy of ``model`` (the model, its gradients and the generators are left as they were)."""
    work = copy.deepcopy(model)
    meter: list[int] = []
    with torch.random.fork_rng(devices=_cuda_devices(model, x)):
        _step(work, loss_fn, x, y, k, True, True, meter)
    if not meter:
        raise ValueError("the model has no batch-statistics BatchNorm layer that its forward calls: nothing is "
                         "cached.")
    return CacheBytes(max(meter), saved_activation_bytes(model, loss_fn, x, y))


def _cache_device(cache: bool | str, x: torch.Tensor) -> torch.device | None:
    """Where the cache keeps its tensors (None: no cache)."""
    if isinstance(cache, bool):
        return x.device if cache else None
    if cache == "cpu":
        return torch.device("cpu")
    raise ValueError(f"cache must be False, True (keep the cached tensors on the model's device) or 'cpu' (keep "
                     f"them in host memory), got {cache!r}.")


def _no_grad_message() -> str:
    return ("the loss needs no gradient: no parameter that requires grad reaches it (or gradients are disabled, "
            "e.g. under torch.no_grad()).")


def full_batch_stats_backward(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int,
                              exact: bool = False, cache: bool | str = False) -> float:
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

    ``cache=True`` (tensors kept on the input's device) or ``"cpu"`` (kept in host memory) computes the same
    step — the same gradient, loss and running statistics up to rounding, the same dropout masks — without
    restarting the forward: torch.fx traces the model and cuts its forward at the L BatchNorm calls into L + 1
    stages. Pass 1 runs the stages in turn for all K micro-batches (layer ℓ's statistics from the K inputs of
    cut ℓ): one forward instead of L partial ones per micro-batch. The backward runs the stages from the last
    to the first, each recomputed per micro-batch from its kept inputs and back-propagated from the gradients
    kept at its outputs, with layer ℓ's full-batch means taken between stage ℓ and stage ℓ−1: one more
    forward and one backward instead of L + 1 forward/backward sweeps. The cost is memory: the values that cross
    each cut (x̂ of every layer and any skip connection) and the gradients at the cuts, for all K micro-batches
    (:func:`cache_bytes` measures it). With ``exact=False`` the cache gives the constants scheme's gradient at
    the same cost as the exact one. The model's ``forward`` itself is called once (micro-batch 0, which shows
    whether the model draws random numbers) or K times (it does: each micro-batch's generator state is found as
    without the cache); the stages call the model's submodules that torch.fx keeps whole (torch.nn layers),
    whose hooks run. The trace is made at every call (milliseconds: a trace bakes in what the forward read, and a
    kept one would silently go stale when a dict entry or a global the forward reads changes). ValueError, saying
    to use ``cache=False``, for a model torch.fx cannot trace (Python control flow on tensor values), with more
    than one input, whose forward changes autograd's mode (a ``torch.no_grad()`` block: a trace does not record
    it) or draws from Python's ``random``, with hooks the stages would skip (on the model, on the BatchNorm
    layers; a forward pre-hook on the model that leaves the input alone is allowed and sees the calls above), or
    whose values read across a cut are changed in place.

    Layers are treated as ``nn.BatchNorm`` treats them: a training-mode layer (or an eval-mode one without
    running statistics) normalizes with the full batch's statistics; an eval-mode layer with running statistics
    is a constant affine map and is left alone; running statistics move only in training mode with
    ``track_running_stats``. Dropout draws the same masks in every sweep (see :func:`full_batch_statistics`), so
    the result is the full-batch gradient with the masks plain accumulation would draw. ValueError, naming the
    layer, for what the scheme cannot reproduce: a BatchNorm called twice per forward, a BatchNorm subclass with
    its own forward (or SyncBatchNorm under torch.distributed), a functional batch norm with batch statistics in
    the forward (``F.batch_norm(..., training=True)``: only modules are replaced), a BatchNorm input modified in
    place after the layer read it (``exact=True``), a model in eval mode. ``loss_fn`` must not draw random
    numbers (the generator states are replayed around the model's forward, not the loss). Hooks on the model's
    layers run in every pass of the uncached scheme (L + 1 or more times per micro-batch), so hooks that record
    activations see each micro-batch several times.
    """
    require_tensor(x)
    require_tensor(y, "y")
    require_flag(exact, "exact", "True: the exact full-batch gradient; False: the statistics as constants")
    _require_sample_mean(loss_fn, y)
    return _restoring(model, lambda: _step(model, loss_fn, x, y, k, exact, cache))


def _require_sample_mean(loss_fn: LossFn, y: torch.Tensor) -> None:
    """Refuse the torch losses whose ``reduction="mean"`` is not a mean over the samples: a class-weighted mean
    (divided by the summed weights of the targets) or one with ignored targets (divided by the targets left), whose
    micro-batch means, each divided by K, do not add up to the full batch's. A functional loss is not inspected."""
    if not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) or loss_fn.reduction != "mean":
        return
    name = type(loss_fn).__name__
    if loss_fn.weight is not None:
        raise ValueError(f"{name}(weight=...) with reduction='mean' divides by the summed weights of each "
                         "micro-batch's targets, not by the number of samples: its micro-batch losses divided by K "
                         f"do not add up to the full batch's. Pass a sample mean instead, e.g. "
                         f"{name}(weight=w, reduction='none') averaged with .mean().")
    if not y.is_floating_point() and bool((y == loss_fn.ignore_index).any()):
        raise ValueError(f"y contains {name}'s ignore_index ({loss_fn.ignore_index}): the mean runs over the "
                         "targets left in each micro-batch, not over its samples, so the micro-batch losses divided "
                         "by K do not add up to the full batch's. This scheme needs a mean over the samples (it "
                         "divides each micro-batch's loss by K): drop the ignored targets from x and y, or pass a "
                         "loss_fn that averages over samples.")


def _restoring(model: nn.Module, run: Callable[[], float]) -> float:
    """Run one step; on a refusal put every ``.grad`` and buffer back as they were (no partial window's gradient
    is left behind), and refuse a model whose forward changes a buffer of its own (a power iteration's vectors, a
    counter, an InstanceNorm's running statistics): the scheme runs the forward several times per micro-batch, so
    its later passes would see a different network from its first."""
    grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    buffers = [(name, b, b.clone()) for name, b in model.named_buffers()]
    own = {id(b) for layer in _batch_stat_layers(model) for b in layer.buffers()}

    def restore() -> None:
        with torch.no_grad():
            for p, g in grads:
                p.grad = g
            for _, b, saved in buffers:
                b.copy_(saved)

    try:
        total = run()
    except BaseException:
        restore()
        raise
    changed = [name for name, b, saved in buffers if id(b) not in own and not torch.equal(b, saved)]
    if changed:
        restore()
        raise ValueError(f"the forward changes the model's buffer(s) {changed[:3]} (a power iteration such as "
                         "spectral_norm's, a counter, an InstanceNorm's running statistics): the scheme runs the "
                         "forward several times per micro-batch, so later passes would see a different network; "
                         "put those modules in eval mode for this step, or accumulate plainly.")
    return total


def _step(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int, exact: bool,
          cache: bool | str, meter: list[int] | None = None) -> float:
    require_k(k)
    device = _cache_device(cache, x)
    if not model.training:
        raise ValueError("full-batch statistics are a training-mode scheme; call model.train() first.")
    micro = split_batch(x, y, k)
    names = _batch_stat_layers(model)
    rng = _Rng(_cuda_devices(model, x))
    plan = _plan(model, names) if device is not None and names else None
    if device is not None and plan is not None and plan.cuts:  # else: no BatchNorm to cut, plain accumulation
        _find_rng_starts(model, [xb for xb, _ in micro], names, rng)
        run = _Cached(plan, micro, device, rng, exact, meter)
        run.forward()
        total = run.backward(loss_fn, k)
        update_running_stats(run.stats)
        rng.at(len(micro))
        return total
    stats = _statistics_pass(model, [xb for xb, _ in micro], names, rng)
    sweep = _Sweep(_collect_corrections(model, loss_fn, micro, k, stats, names, rng)) if exact else None
    total = 0.0
    with _patched(_Patch(names, stats, sweep), list(names)) as patch:
        for i, (xb, yb) in enumerate(micro):
            rng.at(i)
            patch.new_forward()
            loss = loss_fn(model(xb), yb) / k
            if patch.called != set(stats):
                raise ValueError(ORDER_MESSAGE)
            if sweep is not None:
                sweep.check_inputs()
            if not loss.requires_grad:
                raise ValueError(_no_grad_message())
            loss.backward()
            total += float(loss.detach())
    update_running_stats(stats)
    return total


def full_batch_stats_gradient(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int,
                              exact: bool = False, cache: bool | str = False) -> torch.Tensor:
    """Flat gradient of :func:`full_batch_stats_backward`, computed on a copy (the model is not modified)."""
    work = copy.deepcopy(model)
    work.zero_grad(set_to_none=True)
    full_batch_stats_backward(work, loss_fn, x, y, k, exact, cache)
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
