r"""Chapter 2: Ghost BatchNorm, full-batch statistics under accumulation, and the running-statistics fixes.

Two opposite ideas share the name "ghost batch norm":

* **Ghost BatchNorm** (Hoffer et al. 2017) normalizes a large batch in small *virtual* ("ghost") batches of
  size :math:`v`. Plain gradient accumulation with micro-batches of :math:`b = v` computes exactly the same
  forward pass and gradient: accumulation *is* ghost BatchNorm.
* **Full-batch statistics** is the opposite wish: normalize every micro-batch with the statistics of the whole
  logical batch of :math:`Kb`. Micro-batch :math:`k` would need the statistics of micro-batches :math:`k+1..K`
  before they have been computed, so it cannot be done in one pass; :func:`full_batch_stats_backward` does it
  in two (a statistics pass, then forward/backward).
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

from ._validate import require_k
from .accumulate import LossFn, flat_grad, split_batch
from .book.data import DigitsSplit

# ------------------------------------------------------------------------------------- Ghost BN


class GhostBatchNorm(_BatchNorm):
    r"""BatchNorm that, in training, normalizes each consecutive chunk of ``virtual_batch_size`` samples
    with that chunk's own statistics (Hoffer, Hubara & Soudry 2017).

    The :math:`G = N/v` ghost batches are folded into the channel dimension — a view of shape
    :math:`(v, G\cdot C, \dots)` — so that one ``F.batch_norm`` call normalizes all of them.

    **Running statistics** are updated *once per forward pass*, with the mean over ghost batches of their
    means and of their unbiased variances: :math:`\bar\mu \leftarrow (1-m)\bar\mu + m\,\frac1G\sum_g\hat\mu_g`
    (and likewise for the variance). With ``momentum=None`` the update is a cumulative average, as in
    ``nn.BatchNorm``, so ``torch.optim.swa_utils.update_bn`` works. When the batch is a single ghost batch the
    layer is exactly ``nn.BatchNorm``. In eval mode it uses the running statistics, as BatchNorm does.
    """

    def __init__(self, num_features: int, virtual_batch_size: int, dims: int = 2, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True):
        if dims not in (1, 2):
            raise ValueError(f"dims must be 1 (features) or 2 (feature maps), got {dims}.")
        if isinstance(virtual_batch_size, bool) or not isinstance(virtual_batch_size, int) or virtual_batch_size < 2:
            raise ValueError(
                f"virtual_batch_size must be an int >= 2, got {virtual_batch_size!r}: a ghost batch of one sample "
                "has zero variance. Use 2 or more (Hoffer et al. used 128 on ImageNet)."
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.virtual_batch_size = virtual_batch_size
        self.dims = dims

    def _check_input_dim(self, x: torch.Tensor) -> None:
        expected = 4 if self.dims == 2 else 2
        if x.dim() != expected:
            raise ValueError(f"GhostBatchNorm(dims={self.dims}) expects a {expected}-D input, got {x.dim()}-D.")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, virtual_batch_size={self.virtual_batch_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        n, c, v = x.shape[0], x.shape[1], self.virtual_batch_size
        if not self.training or n == v:
            return super().forward(x)
        if n % v:
            raise ValueError(
                f"a batch of {n} cannot be cut into ghost batches of {v}; use a batch size that is a multiple of "
                f"{v}, or a virtual batch size that divides {n}."
            )
        g = n // v
        self.num_batches_tracked.add_(1)  # type: ignore[operator]
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        rest = x.shape[2:]
        folded = x.reshape(g, v, c, *rest).transpose(0, 1).reshape(v, g * c, *rest)
        running_mean = self.running_mean.repeat(g)  # type: ignore[union-attr]
        running_var = self.running_var.repeat(g)  # type: ignore[union-attr]
        weight = self.weight.repeat(g) if self.affine else None
        bias = self.bias.repeat(g) if self.affine else None
        out = F.batch_norm(folded, running_mean, running_var, weight, bias, True, factor, self.eps)
        with torch.no_grad():  # G identical updates, one per ghost batch: their mean is one averaged update
            self.running_mean.copy_(running_mean.view(g, c).mean(0))  # type: ignore[union-attr]
            self.running_var.copy_(running_var.view(g, c).mean(0))  # type: ignore[union-attr]
        return out.reshape(v, g, c, *rest).transpose(0, 1).reshape(x.shape)


class LoopGhostBatchNorm(nn.Module):
    """Reference implementation: one ``nn.BatchNorm2d`` applied to each ghost batch in turn (its running
    statistics are then updated once per ghost batch)."""

    def __init__(self, num_features: int, virtual_batch_size: int):
        super().__init__()
        self.bn, self.virtual_batch_size = nn.BatchNorm2d(num_features), virtual_batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.bn(chunk) for chunk in x.split(self.virtual_batch_size)])


def layer_timings(shape: tuple[int, int, int, int] = (128, 16, 8, 8), v: int = 8, device: torch.device | str = "cpu",
                  repeat: int = 20) -> dict[str, float]:
    """Forward + backward time of the Ghost BatchNorm implementations, relative to ``nn.BatchNorm2d`` on the
    whole batch (float32, random input)."""
    from .timing import median_time

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(device).requires_grad_()
    grad = torch.ones_like(x)
    modules = {"nn.BatchNorm2d (whole batch)": nn.BatchNorm2d(shape[1]),
               "loop of nn.BatchNorm2d": LoopGhostBatchNorm(shape[1], v),
               "GhostBatchNorm (fold)": GhostBatchNorm(shape[1], v)}
    times = {}
    for name, module in modules.items():
        module.to(device).train()

        def step(m: nn.Module = module) -> None:
            x.grad = None
            m(x).backward(grad)

        times[name] = median_time(step, device, repeat=repeat)
    base = times["nn.BatchNorm2d (whole batch)"]
    return {name: t / base for name, t in times.items()}


def ghostify(model: nn.Module, virtual_batch_size: int) -> nn.Module:
    """A copy of ``model`` whose BatchNorm layers are :class:`GhostBatchNorm` with the same parameters and
    running statistics."""
    model = copy.deepcopy(model)
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, GhostBatchNorm):
                ghost = GhostBatchNorm(child.num_features, virtual_batch_size, dims=1 if isinstance(child, nn.BatchNorm1d) else 2,
                                       eps=child.eps, momentum=child.momentum, affine=child.affine)
                ghost.load_state_dict(child.state_dict())
                ghost.to(next(child.buffers()).device, next(child.buffers()).dtype)
                setattr(module, child_name, ghost.train(child.training))
                replaced += 1
    if not replaced:
        raise ValueError("the model has no BatchNorm layer to turn into GhostBatchNorm.")
    return model


# ------------------------------------------------------------------- full-batch statistics, two passes


@dataclass
class Moments:
    """Per-channel count, mean and sum of squared deviations :math:`M_2`, combinable across micro-batches."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    @staticmethod
    def of(x: torch.Tensor) -> "Moments":
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims)
        centered = x - mean.view(1, -1, *([1] * (x.dim() - 2)))
        return Moments(x.numel() // x.shape[1], mean, (centered * centered).sum(dims))

    def combine(self, other: "Moments") -> "Moments":
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
    def forward(ctx, x: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor,  # type: ignore[override]
                layer: _BatchNorm, sweep: _Sweep | None) -> torch.Tensor:
        ctx.scale, ctx.layer, ctx.sweep = scale, layer, sweep
        if sweep is not None:
            ctx.mean = mean
            ctx.save_for_backward(x)
        return (x - mean) / scale

    @staticmethod
    def backward(ctx, a: torch.Tensor):  # type: ignore[override]
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
        layer.forward = functools.partial(patch.forward, layer)  # type: ignore[method-assign]
    try:
        yield patch
    finally:
        for layer, old in saved.items():
            if old is None:
                del layer.forward
            else:
                layer.forward = old  # type: ignore[method-assign]


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
                layer.num_batches_tracked.add_(1)  # type: ignore[operator]
                if layer.momentum is None:
                    factor = 1.0 / float(layer.num_batches_tracked)
            if layer.running_mean is not None:
                layer.running_mean.mul_(1 - factor).add_(m.mean, alpha=factor)  # type: ignore[operator]
            if layer.running_var is not None:
                unbiased = m.var * m.count / (m.count - 1)
                layer.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)  # type: ignore[operator]


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


# ------------------------------------------------------------------------- running-statistics fixes


def precise_bn(model: nn.Module, x: torch.Tensor, batch_size: int) -> None:
    """Recompute every BatchNorm layer's running statistics after training ("PreciseBN", Wu & Johnson 2021).

    Uses ``torch.optim.swa_utils.update_bn``: it resets the running statistics, sets ``momentum=None`` so that
    they become the plain average over batches, runs the model over ``x`` in batches of ``batch_size`` (the
    micro-batch size b the model was trained with, so that the statistics match training-time normalization),
    and restores the momenta and the model's mode.
    """
    if batch_size < 2 or batch_size > x.shape[0]:
        raise ValueError(f"batch_size must be between 2 and {x.shape[0]}, got {batch_size}.")
    if not any(isinstance(m, _BatchNorm) for m in model.modules()):
        raise ValueError("the model has no BatchNorm layer; PreciseBN has nothing to recompute.")
    usable = x.shape[0] - x.shape[0] % batch_size
    with torch.no_grad():
        torch.optim.swa_utils.update_bn(list(x[:usable].split(batch_size)), model)


@dataclass(frozen=True)
class PreciseBNSizeEffect:
    """How PreciseBN's statistics and accuracy change with the batch size of its pass, per BatchNorm layer
    (in call order): ``var_ratio`` = (min, max) over channels of running_var(batches of ``small``) /
    running_var(one batch of ``large``); ``mean_shift`` = max over channels of |Δ running_mean| / running_std;
    ``acc`` = eval-mode validation accuracy after each pass."""

    small: int
    large: int
    var_ratio: dict[str, tuple[float, float]]
    mean_shift: dict[str, float]
    acc_small: float
    acc_large: float


def precise_bn_size_effect(model: nn.Module, x: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                           small: int, large: int) -> PreciseBNSizeEffect:
    """Run PreciseBN on two copies of ``model``, in batches of ``small`` and of ``large``, and compare.

    ``update_bn`` averages what BatchNorm stores per batch — the mean and the *unbiased* variance — so at the
    first BatchNorm layer both sizes estimate the same population values. At later layers the inputs
    themselves differ, because during the pass every earlier layer normalizes each batch with that batch's
    statistics.
    """
    from .accumulate import accuracy

    copies = {}
    for size in (small, large):
        copies[size] = copy.deepcopy(model)
        precise_bn(copies[size], x, size)
    ratios, shifts = {}, {}
    for name, layer in copies[small].named_modules():
        if isinstance(layer, _BatchNorm):
            ref = copies[large].get_submodule(name)
            ratio = layer.running_var / ref.running_var  # type: ignore[operator]
            ratios[name] = (float(ratio.min()), float(ratio.max()))
            shifts[name] = float(((layer.running_mean - ref.running_mean).abs()  # type: ignore[operator]
                                  / ref.running_var.sqrt()).max())  # type: ignore[union-attr]
    accs = {size: accuracy(m.eval(), x_val, y_val) for size, m in copies.items()}
    return PreciseBNSizeEffect(small, large, ratios, shifts, accs[small], accs[large])


# ------------------------------------------------------------------------- comparing the methods

#: The methods chapter 2 compares, in the order of its table. "ghost BN, 1 update/step" is this book's
#: one-pass GhostBatchNorm, which updates the running statistics once per step; Hoffer et al.'s reference code
#: runs backward per chunk and updates them once per chunk, which *is* the "plain accumulation" row.
METHODS: tuple[str, ...] = ("full batch", "plain accumulation", "ghost BN, 1 update/step", "full-batch stats",
                            "exact full-batch stats", "momentum-corrected", "GroupNorm", "LayerNorm")


@dataclass(frozen=True)
class MethodEffect:
    """One method's normalization-statistics error and gradient agreement on one batch of K·b images.

    ``stat_error``: RMS over normalization groups and channels of (μ_group − μ_full)/σ_full at the head's
    BatchNorm1d input (0 when the method normalizes with the full batch; NaN for per-sample norms);
    ``rel_error``/``cosine``: its gradient against the full-batch BatchNorm gradient (for GroupNorm and
    LayerNorm, against their own full-batch gradient).
    """

    method: str
    stat_error: float
    rel_error: float
    cosine: float


def _stat_error(feats: torch.Tensor, group: int) -> float:
    full_mean, full_std = feats.mean(0), feats.std(0, correction=0)
    keep = full_std > 1e-12
    means = torch.stack([c.mean(0) for c in feats.split(group)])
    return float((((means - full_mean) / torch.where(keep, full_std, 1.0))[:, keep] ** 2).mean().sqrt())


def method_effects(k: int, b: int, v: int, x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> list[MethodEffect]:
    """Compare, on the first K·b images, how each method normalizes and what gradient it produces.

    ``v`` is Ghost BatchNorm's virtual batch size for a single pass over the K·b images (v = b reproduces
    plain accumulation exactly).
    """
    from ._validate import require_micro_batch
    from .accumulate import accumulated_gradient, agreement, full_batch_gradient
    from .bn import layer_inputs
    from .book.models import make_cnn

    require_k(k)
    require_micro_batch(b)
    n = k * b
    if n > x.shape[0]:
        raise ValueError(f"K·b = {k}·{b} = {n} exceeds the {x.shape[0]} images available; lower K or b.")
    if isinstance(v, bool) or not isinstance(v, int) or v < 2 or n % v:
        raise ValueError(f"the virtual batch size v = {v} must be >= 2 and divide K·b = {n}.")
    xb, yb = x[:n].double(), y[:n]
    loss_fn = nn.CrossEntropyLoss()
    model = make_cnn("batch", seed=seed, device=x.device).train()
    g_full = full_batch_gradient(model, loss_fn, xb, yb)
    stats = full_batch_statistics(model, list(xb.split(b)))
    with normalized_with(stats):  # every BatchNorm normalizes with the full batch: the full-batch forward
        feats = layer_inputs(model, xb, "head.1")
    rows = []
    for method, grad, group in (
        ("plain accumulation", accumulated_gradient(model, loss_fn, xb, yb, k), b),
        ("ghost BN, 1 update/step", full_batch_gradient(ghostify(model, v), loss_fn, xb, yb), v),
        ("full-batch stats", full_batch_stats_gradient(model, loss_fn, xb, yb, k), n),
        ("exact full-batch stats", full_batch_stats_gradient(model, loss_fn, xb, yb, k, exact=True), n),
    ):
        a = agreement(g_full, grad)
        rows.append(MethodEffect(method, _stat_error(feats, group), a.rel_error, a.cosine))
    for norm, label in (("group", "GroupNorm"), ("layer", "LayerNorm")):
        other = make_cnn(norm, seed=seed, device=x.device).train()  # type: ignore[arg-type]
        a = agreement(full_batch_gradient(other, loss_fn, xb, yb), accumulated_gradient(other, loss_fn, xb, yb, k))
        rows.append(MethodEffect(label, float("nan"), a.rel_error, a.cosine))
    return rows


@dataclass(frozen=True)
class MethodRun:
    """One training run of the side-by-side experiment.

    ``k``: forward/backward passes per optimizer step (1 for the full batch and the one-pass Ghost BatchNorm);
    ``b``: how many samples each BatchNorm statistic was computed from in training (the micro-batch, the ghost
    batch, or the whole batch of 64 for the full batch and both full-batch-statistics schemes).
    ``val_acc``: eval-mode validation accuracy with the running statistics training left behind;
    ``val_acc_precise``: the same model after PreciseBN (:func:`precise_bn` over the training set in batches
    of the size the method normalized with; NaN for GroupNorm/LayerNorm, which keep no statistics);
    ``weight_growth``: for each layer whose output feeds a BatchNorm, ‖W_end‖/‖W_start‖ (empty without
    BatchNorm) — the drift Ioffe and Szegedy predicted for gradients that ignore the statistics.
    """

    method: str
    k: int
    b: int
    seed: int
    schedule: str
    val_acc: float
    val_acc_precise: float
    weight_growth: tuple[float, ...]
    steps: int


def pre_bn_layers(model: nn.Module) -> list[str]:
    """Names of the layers whose output is the input of a BatchNorm layer (the module just before a
    ``_BatchNorm`` in an ``nn.Sequential``)."""
    names = []
    for parent, module in model.named_modules():
        if isinstance(module, nn.Sequential):
            children = list(module.named_children())
            for (name, before), (_, after) in zip(children, children[1:]):
                if isinstance(after, _BatchNorm) and getattr(before, "weight", None) is not None:
                    names.append(f"{parent}.{name}" if parent else name)
    return names


def _normalization_size(method: str, k: int, batch_size: int) -> int:
    """The number of samples each BatchNorm statistic was computed from while ``method`` trained."""
    return batch_size if method in ("full batch", "full-batch stats", "exact full-batch stats") else batch_size // k


class ShadowRunningStats:
    r"""The running statistics every BatchNorm layer of ``model`` *would* keep with another ``momentum``,
    tracked beside the real ones during training.

    A training-mode forward normalizes with the batch statistics and never reads the running ones, so the
    momentum changes nothing in training — not the gradients, not the weights — only the running statistics.
    One run can therefore serve two momenta: a forward pre-hook applies BatchNorm's own update,
    :math:`\bar\mu \leftarrow (1-m)\bar\mu + m\,\hat\mu_B` and the same for the unbiased variance, with the
    other momentum.
    """

    def __init__(self, model: nn.Module, momentum: float):
        self.momentum = momentum
        self.stats = {name: (layer.running_mean.clone(), layer.running_var.clone())  # type: ignore[union-attr]
                      for name, layer in model.named_modules() if isinstance(layer, _BatchNorm)}
        self._hooks = [layer.register_forward_pre_hook(functools.partial(self._update, name))
                       for name, layer in model.named_modules() if isinstance(layer, _BatchNorm)]

    def _update(self, name: str, layer: _BatchNorm, inputs: tuple[torch.Tensor, ...]) -> None:
        if not layer.training:
            return
        x = inputs[0].detach()
        dims = [0, *range(2, x.dim())]
        mean, var = self.stats[name]
        mean.mul_(1 - self.momentum).add_(x.mean(dims), alpha=self.momentum)
        var.mul_(1 - self.momentum).add_(x.var(dims, correction=1), alpha=self.momentum)

    def apply_to(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` (hooks removed from the original) with the shadow running statistics."""
        for h in self._hooks:
            h.remove()
        twin = copy.deepcopy(model)
        for name, (mean, var) in self.stats.items():
            layer = twin.get_submodule(name)
            layer.running_mean.copy_(mean)  # type: ignore[union-attr,operator]
            layer.running_var.copy_(var)  # type: ignore[union-attr,operator]
        return twin


def train_method(split: DigitsSplit, method: str, k: int, batch_size: int = 64, epochs: int = 8, seed: int = 0,
                 schedule: str = "constant", shadow: list[MethodRun] | None = None) -> tuple[MethodRun, nn.Module]:
    """Train a fresh SmallCNN with one method on 64-image batches (K micro-batches of b = 64/K): SGD with
    momentum 0.9, learning rate 0.05 (``schedule`` "constant" or "cosine"), cross-entropy, float64.

    "full batch" and "ghost BN, 1 update/step" take one forward/backward per batch (K = 1); every other method
    accumulates K micro-batches. Returns the run and the trained model (in eval mode).

    With ``shadow`` (a list, for "plain accumulation" only), the momentum-corrected run is read off the same
    training run with :class:`ShadowRunningStats` and appended to it: it has the same weights, so only its
    running statistics differ.
    """
    from .accumulate import accuracy, train
    from .bn import corrected_momentum, set_bn_momentum
    from .book.models import make_cnn

    require_k(k)
    if batch_size % k or batch_size // k < 2:
        raise ValueError(f"K = {k} must divide the batch size {batch_size} into micro-batches of at least 2.")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}.")
    b = batch_size // k
    norm = {"GroupNorm": "group", "LayerNorm": "layer"}.get(method, "batch")
    model: nn.Module = make_cnn(norm, seed=seed, device=split.x_train.device)  # type: ignore[arg-type]
    steps_k, backward_fn = k, None
    if method == "full batch":
        steps_k = 1
    elif method == "ghost BN, 1 update/step":
        model, steps_k = ghostify(model, b), 1
    elif method == "full-batch stats":
        backward_fn = full_batch_stats_backward
    elif method == "exact full-batch stats":
        backward_fn = functools.partial(full_batch_stats_backward, exact=True)
    elif method == "momentum-corrected":
        set_bn_momentum(model, corrected_momentum(0.1, k))
    if shadow is not None and method != "plain accumulation":
        raise ValueError("shadow running statistics are read off a plain-accumulation run only.")
    tracker = ShadowRunningStats(model, corrected_momentum(0.1, k)) if shadow is not None else None
    watched = {name: m.weight.detach().norm().item() for name, m in model.named_modules()
               if name in pre_bn_layers(model)}
    result = train(model, split.x_train, split.y_train, split.x_val, split.y_val, batch_size=batch_size,
                   k=steps_k, epochs=epochs, seed=seed, backward_fn=backward_fn, schedule=schedule)  # type: ignore[arg-type]
    growth = tuple(model.get_submodule(name).weight.detach().norm().item() / start
                   for name, start in watched.items())
    precise = float("nan")
    if norm == "batch":
        recomputed = copy.deepcopy(model)
        precise_bn(recomputed, split.x_train, _normalization_size(method, k, batch_size))  # the size it trained with
        precise = accuracy(recomputed.eval(), split.x_val, split.y_val)
    group = _normalization_size(method, k, batch_size)
    run = MethodRun(method, steps_k, group, seed, schedule, result.val_acc, precise, growth, result.optimizer_steps)
    if tracker is not None and shadow is not None:
        twin = tracker.apply_to(model).eval()
        shadow.append(MethodRun("momentum-corrected", steps_k, group, seed, schedule,
                                accuracy(twin, split.x_val, split.y_val), precise, growth, result.optimizer_steps))
    return run, model.eval()


def train_methods(split: DigitsSplit, k: int, batch_size: int = 64, epochs: int = 8, seed: int = 0,
                  methods: Sequence[str] = METHODS, schedule: str = "constant") -> list[MethodRun]:
    """:func:`train_method` for each of ``methods`` (in the order of :data:`METHODS`), on the same batches.

    When both "plain accumulation" and "momentum-corrected" are asked for, one training run serves both
    (:class:`ShadowRunningStats`; a test checks it against a separate momentum-corrected run).
    """
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}.")
    runs: dict[str, MethodRun] = {}
    for m in METHODS:
        if m not in methods or m in runs:
            continue
        if m == "plain accumulation" and "momentum-corrected" in methods:  # one run, two momenta
            shadow: list[MethodRun] = []
            runs[m] = train_method(split, m, k, batch_size, epochs, seed, schedule, shadow=shadow)[0]
            runs["momentum-corrected"] = shadow[0]
        else:
            runs[m] = train_method(split, m, k, batch_size, epochs, seed, schedule)[0]
    return [runs[m] for m in METHODS if m in methods]


def seed_study(split: DigitsSplit, seeds: Sequence[int] = (0, 1, 2),
               schedules: Sequence[str] = ("constant", "cosine"), k: int = 16, k_small: int = 4,
               batch_size: int = 64, epochs: int = 8) -> list[MethodRun]:
    """The runs behind chapter 2's comparative claims, for every seed and learning-rate schedule: the full
    batch, plain accumulation at ``k_small`` and at ``k``, and momentum-corrected accumulation at ``k``
    (each with its PreciseBN accuracy)."""
    runs = []
    for schedule in schedules:
        for seed in seeds:
            runs += train_methods(split, k, batch_size, epochs, seed,
                                  ("full batch", "plain accumulation", "momentum-corrected"), schedule)
            runs += train_methods(split, k_small, batch_size, epochs, seed, ("plain accumulation",), schedule)
    return runs


def study_table(runs: Sequence[MethodRun]) -> dict[tuple[str, int, str, int], MethodRun]:
    """Index runs by (method, K, schedule, seed); refuses duplicates."""
    table: dict[tuple[str, int, str, int], MethodRun] = {}
    for r in runs:
        key = (r.method, r.k, r.schedule, r.seed)
        if key in table:
            raise ValueError(f"two runs for {key}; pass each run once.")
        table[key] = r
    return table


def format_study(runs: Sequence[MethodRun]) -> str:
    """Validation accuracy per seed and schedule: each column as "running stats → after PreciseBN"."""
    table = study_table(runs)
    columns = list(dict.fromkeys((m, k) for m, k, _, _ in table))
    heads = {("full batch", 1): "full batch"}
    lines = [f"{'schedule':<9}{'seed':>5}" + "".join(
        f"{heads.get(c, c[0].replace('accumulation', 'accum.').replace('momentum-', 'mom.-') + f' K={c[1]}'):>22}"
        for c in columns)]
    for schedule in dict.fromkeys(s for _, _, s, _ in table):
        for seed in dict.fromkeys(s for _, _, _, s in table):
            cells = []
            for m, k in columns:
                r = table[m, k, schedule, seed]
                cells.append(f"{100 * r.val_acc:.1f} → {100 * r.val_acc_precise:.1f}%")
            lines.append(f"{schedule:<9}{seed:>5}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def format_methods(runs: list[MethodRun]) -> str:
    """The side-by-side table: validation accuracy per method with its running statistics and after
    PreciseBN, and the growth of the weights that feed BatchNorm layers."""
    lines = [f"{'method':<26}{'K':>3}{'BN n':>5}{'val acc':>9}{'after PreciseBN':>17}{'pre-BN weight growth':>23}"]
    for r in runs:
        precise = "—" if r.val_acc_precise != r.val_acc_precise else f"{100 * r.val_acc_precise:.1f}%"
        growth = "—" if not r.weight_growth else f"{min(r.weight_growth):.1f}–{max(r.weight_growth):.1f}×"
        group = f"{r.b}" if r.weight_growth else "—"  # GroupNorm/LayerNorm: per-sample statistics
        lines.append(f"{r.method:<26}{r.k:>3}{group:>5}{100 * r.val_acc:>8.1f}%{precise:>17}{growth:>23}")
    return "\n".join(lines)


def plot_methods(runs: list[MethodRun]):
    """Validation accuracy of every method, with its running statistics and after PreciseBN."""
    import numpy as np

    from .book.plotting import PALETTE, decorate, figure

    fig, (ax,) = figure(1, 9.6, 3.8)
    pos = np.arange(len(runs))
    ax.bar(pos - 0.2, [100 * r.val_acc for r in runs], 0.4, color=PALETTE["sky"], label="running statistics")
    ax.bar(pos + 0.2, [100 * r.val_acc_precise for r in runs], 0.4, color=PALETTE["vermillion"], hatch="//",
           edgecolor="white", label="after PreciseBN")
    ax.set_xticks(pos, [f"{r.method}\n(K={r.k}, BN n={r.b})" for r in runs], rotation=25, ha="right", fontsize=8)
    title = f"Digits, seed {runs[0].seed}, {runs[0].schedule} LR, {runs[0].steps} optimizer steps"
    decorate(ax, "", "validation accuracy (%)", title)
    ax.set_ylim(0, 118)
    ax.set_yticks(range(0, 101, 20))
    ax.legend(loc="upper center", ncol=2, frameon=False)
    return fig


def plot_study(runs: Sequence[MethodRun]):
    """Each claim's runs, seed by seed: PreciseBN and momentum correction against plain accumulation at K,
    and plain accumulation at the small K against the full batch, for each schedule."""
    from .book.plotting import PALETTE, decorate, figure

    table = study_table(runs)
    schedules = list(dict.fromkeys(s for _, _, s, _ in table))
    seeds = sorted({s for _, _, _, s in table})
    k = max(kk for m, kk, _, _ in table if m == "momentum-corrected")
    k_small = min(kk for m, kk, _, _ in table if m == "plain accumulation")
    fig, axes = figure(len(schedules), 4.8 * len(schedules), 3.6)
    for ax, schedule in zip(axes, schedules):
        for i, seed in enumerate(seeds):
            plain = table["plain accumulation", k, schedule, seed]
            full = table["full batch", 1, schedule, seed]
            small = table["plain accumulation", k_small, schedule, seed]
            mom = table["momentum-corrected", k, schedule, seed]
            pairs = [(0, plain.val_acc_precise - plain.val_acc, PALETTE["vermillion"], f"PreciseBN − plain (K={k})"),
                     (1, mom.val_acc - plain.val_acc, PALETTE["blue"], f"momentum-corrected − plain (K={k})"),
                     (2, small.val_acc - full.val_acc, PALETTE["orange"], f"K={k_small} − full batch"),
                     (3, small.val_acc_precise - full.val_acc_precise, PALETTE["green"],
                      f"K={k_small} − full batch, both PreciseBN")]
            for x, diff, color, label in pairs:
                ax.scatter(x + (i - 1) * 0.12, 100 * diff, color=color, s=28, label=label if i == 0 else None)
        ax.axhline(0, color="0.4", lw=0.8)
        b_small = table["plain accumulation", k_small, schedule, seeds[0]].b
        ax.set_xticks(range(4), ["PreciseBN", "momentum\ncorrection", f"b={b_small}\nvs full",
                                 f"b={b_small} vs full\n(PreciseBN)"], fontsize=8)
        decorate(ax, "", "difference (points)", f"{schedule} learning rate, seeds {seeds[0]}–{seeds[-1]}")
    return fig


@dataclass(frozen=True)
class StepCost:
    """What one optimizer step of a method costs on a batch of K·b images: the model's forward calls (each
    micro-batch forward counts one, a forward stopped early by the statistics pass too) and wall time
    relative to plain accumulation (median over interleaved repeats)."""

    method: str
    forward_calls: int
    time_ratio: float


def step_costs(split: DigitsSplit, k: int = 16, batch_size: int = 64, repeat: int = 7,
               methods: Sequence[str] = ("full batch", "plain accumulation", "ghost BN, 1 update/step",
                                         "full-batch stats", "exact full-batch stats")) -> list[StepCost]:
    """Count the passes and time one optimizer step of each method on the same batch (SmallCNN, float64).

    Timing is interleaved: each round runs every method once, in turn, and each method's time is the median
    over ``repeat`` rounds (after one untimed round), so a machine that slows down or speeds up during the
    measurement affects every method alike.
    """
    from .accumulate import accumulate_backward
    from .book.models import make_cnn
    from .timing import interleaved_medians

    require_k(k)
    x, y = split.x_train[:batch_size], split.y_train[:batch_size]
    loss_fn = nn.CrossEntropyLoss()
    counts: dict[str, list[int]] = {}
    steps = {}
    for method in methods:
        model: nn.Module = make_cnn("batch", seed=0, device=x.device).train()
        steps_k, backward = k, accumulate_backward
        if method == "full batch":
            steps_k = 1
        elif method == "ghost BN, 1 update/step":
            model, steps_k = ghostify(model, batch_size // k), 1
        elif method == "full-batch stats":
            backward = full_batch_stats_backward
        elif method == "exact full-batch stats":
            backward = functools.partial(full_batch_stats_backward, exact=True)
        elif method != "plain accumulation":
            raise ValueError(f"no step cost for {method!r}; choose among the BatchNorm methods of METHODS.")
        counter = counts.setdefault(method, [0])
        model.register_forward_pre_hook(lambda *_, c=counter: c.__setitem__(0, c[0] + 1))

        def step(m: nn.Module = model, kk: int = steps_k, fn=backward) -> None:
            m.zero_grad(set_to_none=True)
            fn(m, loss_fn, x, y, kk)

        steps[method] = step
    for method, step in steps.items():  # one counted step per method
        counts[method][0] = 0
        step()
    calls = {m: c[0] for m, c in counts.items()}
    times = interleaved_medians(steps, repeat=repeat, warmup=1)
    base = times.get("plain accumulation") or next(iter(times.values()))
    return [StepCost(m, calls[m], times[m] / base) for m in methods]


def precise_bn_cost(split: DigitsSplit, b: int = 4, k: int = 16, repeat: int = 5) -> float:
    """Seconds of one PreciseBN pass (over the training set in batches of b) divided by the seconds of one
    plain-accumulation step (K micro-batches of b), interleaved medians."""
    from .accumulate import accumulate_backward
    from .book.models import make_cnn
    from .timing import interleaved_medians

    model = make_cnn("batch", seed=0, device=split.x_train.device).train()
    x, y = split.x_train[: k * b], split.y_train[: k * b]
    loss_fn = nn.CrossEntropyLoss()
    recompute = copy.deepcopy(model)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        accumulate_backward(model, loss_fn, x, y, k)

    times = interleaved_medians({"plain step": plain, "PreciseBN pass": lambda: precise_bn(recompute, split.x_train, b)},
                                repeat=repeat, warmup=1)
    return times["PreciseBN pass"] / times["plain step"]


def effect_grid(ks: Sequence[int], bs: Sequence[int], x: torch.Tensor, y: torch.Tensor) -> dict[str, "np.ndarray"]:
    """Gradient cosine to the full batch over a grid of K (rows) and b (columns), per method (v = b)."""
    import numpy as np

    grids: dict[str, list[list[float]]] = {}
    for k in ks:
        rows: dict[str, list[float]] = {}
        for b in bs:
            for e in method_effects(k, b, b, x, y):
                rows.setdefault(e.method, []).append(e.cosine)
        for method, values in rows.items():
            grids.setdefault(method, []).append(values)
    return {m: np.array(v) for m, v in grids.items()}


def plot_effect_grid(grids: dict[str, "np.ndarray"], ks: Sequence[int], bs: Sequence[int],
                     methods: Sequence[str] = ("plain accumulation", "full-batch stats", "exact full-batch stats")):
    """Heat maps of the gradient cosine to the full-batch gradient, one panel per method."""
    from .book.plotting import figure, heatmap

    fig, axes = figure(len(methods), 3.6 * len(methods), 3.6)
    for ax, method in zip(axes, methods):
        image = heatmap(ax, grids[method], ks, bs, vmin=0.0, vmax=1.0, aspect="equal", xlabel="micro-batch size b",
                        ylabel="K", title=method)
    fig.colorbar(image, ax=axes, label="cosine to the full-batch gradient", shrink=0.9)
    return fig


def plot_method_effects(k: int, b: int, v: int, x: torch.Tensor, y: torch.Tensor):
    """The widget's picture: statistics error and gradient cosine of each method for one (K, b, v)."""
    import numpy as np

    from .book.plotting import PALETTE, decorate, figure

    rows = method_effects(k, b, v, x, y)
    names = [r.method.replace(", 1 update/step", f" (v={v})") for r in rows]
    fig, (ax1, ax2) = figure(2, 9.6, 3.6)
    ax1.barh(names, [0 if np.isnan(r.stat_error) else r.stat_error for r in rows], color=PALETTE["vermillion"])
    for i, r in enumerate(rows):
        if np.isnan(r.stat_error):
            ax1.text(0.01, i, "per-sample statistics: n/a", va="center", fontsize=8)
        elif r.stat_error == 0:
            ax1.text(0.01, i, "0: full-batch statistics", va="center", fontsize=8)
    decorate(ax1, "RMS (μ_group − μ_full) / σ", "", f"Statistics error (K = {k}, b = {b})")
    ax2.barh(names, [r.cosine for r in rows], color=PALETTE["blue"])
    ax2.set_xlim(-0.05, 1.05)
    ax2.set_yticks(range(len(names)), [""] * len(names))
    decorate(ax2, "cosine to the full-batch gradient", "", "Gradient agreement")
    return fig
