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

from .accumulate import LossFn, check_k, flat_grad, split_batch
from .data import DigitsSplit


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
    """Raised by a hook to end a forward pass early, once the layer of interest has seen its input."""


def batchnorm_layers(model: nn.Module, x: torch.Tensor) -> list[tuple[str, _BatchNorm]]:
    """The model's BatchNorm layers in the order the forward pass calls them (found by running ``x``)."""
    named = {m: n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    if not named:
        raise ValueError("the model has no BatchNorm layer: full-batch statistics change nothing. Accumulate as usual.")
    order: list[tuple[str, _BatchNorm]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, inp: order.append((named[mod], mod))) for m in named]
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    seen = [n for n, _ in order]
    if len(seen) != len(set(seen)):
        raise ValueError("a BatchNorm layer is called more than once per forward pass; this scheme needs each once.")
    return order


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, -1, *([1] * (x.dim() - 2)))


@dataclass
class _Sweep:
    """Per-layer state of one backward sweep of the exact scheme.

    ``corrections[layer] = (A1, A2)``: full-batch means of a = ∂L/∂x̂ and of a·x̂, once known;
    ``collect``: the layer whose sums Σa, Σa·x̂ this sweep gathers (into ``sums``).
    """

    corrections: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]]
    collect: _BatchNorm | None = None
    xhat: torch.Tensor | None = None
    sums: tuple[torch.Tensor, torch.Tensor] | None = None


def _normalize(layer: _BatchNorm, x: torch.Tensor, full: Moments, sweep: _Sweep | None) -> torch.Tensor:
    r"""Normalize ``x`` with the full-batch statistics ``full`` (constants: no gradient through them).

    With a ``sweep``, the gradient term through the statistics that the constants leave out is added back on
    x's gradient, :math:`-\frac{1}{s}\big(\bar a + \hat x\,\overline{a\hat x}\big)` with
    :math:`s=\sqrt{\sigma^2+\epsilon}` and the bars full-batch means (known from earlier sweeps); or, for
    the layer being collected, x̂ is kept so that ∂L/∂x̂ can be read.
    """
    s = torch.sqrt(full.var + layer.eps).view(_shape(x))
    xhat = (x - full.mean.view(_shape(x))) / s
    if sweep is not None:
        if layer is sweep.collect:
            sweep.xhat = xhat
        elif layer in sweep.corrections and x.requires_grad:
            a1, a2 = sweep.corrections[layer]
            xh = xhat.detach()
            x.register_hook(lambda g: g - (a1.view(_shape(xh)) + xh * a2.view(_shape(xh))) / s)
    if layer.affine:
        return xhat * layer.weight.view(_shape(x)) + layer.bias.view(_shape(x))
    return xhat


@contextmanager
def normalized_with(stats: dict[_BatchNorm, Moments], sweep: _Sweep | None = None) -> Iterator[None]:
    """Within the block, each BatchNorm layer in ``stats`` normalizes with the given statistics (and leaves its
    running statistics alone)."""
    for layer, moments in stats.items():
        layer.forward = lambda x, _l=layer, _m=moments: _normalize(_l, x, _m, sweep)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in stats:
            del layer.forward


def full_batch_statistics(model: nn.Module, micro_batches: Sequence[torch.Tensor]) -> dict[_BatchNorm, Moments]:
    """Statistics pass: for every BatchNorm layer, the moments of its input over *all* micro-batches, with
    every earlier BatchNorm layer already normalizing with its full-batch statistics.

    Layer ℓ's input depends on how layers 1..ℓ−1 normalize, so the layers are handled in call order, one
    sweep over the micro-batches each, and each sweep stops the forward pass at layer ℓ. No gradients are
    kept and no running statistic changes.
    """
    stats: dict[_BatchNorm, Moments] = {}
    for _, layer in batchnorm_layers(model, micro_batches[0]):
        total: Moments | None = None

        def grab(mod, inp):
            nonlocal total
            part = Moments.of(inp[0])
            total = part if total is None else total.combine(part)
            raise _StopForward

        handle = layer.register_forward_pre_hook(grab)
        try:
            with torch.no_grad(), normalized_with(stats):
                for xb in micro_batches:
                    try:
                        model(xb)
                    except _StopForward:
                        pass
        finally:
            handle.remove()
        if total is None:  # pragma: no cover - the hook always fires for a layer found by batchnorm_layers
            raise RuntimeError("a BatchNorm layer was not reached")
        stats[layer] = total
    return stats


def update_running_stats(stats: dict[_BatchNorm, Moments]) -> None:
    """One running-statistics update per layer from the full batch's mean and unbiased variance (as one
    ``nn.BatchNorm`` forward over the whole batch would do)."""
    with torch.no_grad():
        for layer, m in stats.items():
            if not layer.track_running_stats:
                continue
            layer.num_batches_tracked.add_(1)  # type: ignore[operator]
            factor = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
            layer.running_mean.mul_(1 - factor).add_(m.mean, alpha=factor)  # type: ignore[union-attr]
            layer.running_var.mul_(1 - factor).add_(m.var * m.count / (m.count - 1), alpha=factor)  # type: ignore[union-attr]


def _collect_corrections(model: nn.Module, loss_fn: LossFn, micro: list, k: int,
                         stats: dict[_BatchNorm, Moments]) -> dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]]:
    """Backward sweeps from the last BatchNorm layer to the first: sweep ℓ gathers Σa and Σa·x̂ of layer ℓ over
    all micro-batches, with the corrections of the layers after it already applied."""
    corrections: dict[_BatchNorm, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in reversed(list(stats)):
        sweep = _Sweep(corrections)
        sweep.collect = layer
        s1 = s2 = None
        with normalized_with(stats, sweep):
            for xb, yb in micro:
                loss = loss_fn(model(xb), yb) / k
                (a,) = torch.autograd.grad(loss, sweep.xhat)
                dims = [0, *range(2, a.dim())]
                p1, p2 = a.sum(dims), (a * sweep.xhat.detach()).sum(dims)
                s1, s2 = (p1, p2) if s1 is None else (s1 + p1, s2 + p2)
        corrections[layer] = (s1 / stats[layer].count, s2 / stats[layer].count)
    return corrections


def full_batch_stats_backward(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, k: int,
                              exact: bool = False) -> float:
    """One optimizer step's gradient with every micro-batch normalized by the *full* batch's statistics.

    Pass 1 (:func:`full_batch_statistics`) computes each BatchNorm layer's statistics over all K micro-batches;
    the last pass runs forward/backward of each micro-batch with those statistics (loss / K), so the forward
    equals the full-batch forward exactly. With ``exact=False`` the statistics are constants, and the gradient
    misses every term through them. With ``exact=True`` L more sweeps (one per BatchNorm layer, last layer
    first) gather the full-batch means those terms need, and the gradient equals the full-batch gradient up to
    rounding, at the cost of L + 1 forward/backward sweeps. Running statistics are updated once, from the full
    batch. Gradients are added to ``.grad``; returns the batch loss.
    """
    check_k(k)
    if not model.training:
        raise ValueError("full-batch statistics are a training-mode scheme; call model.train() first.")
    micro = split_batch(x, y, k)
    stats = full_batch_statistics(model, [xb for xb, _ in micro])
    sweep = _Sweep(_collect_corrections(model, loss_fn, micro, k, stats)) if exact else None
    total = 0.0
    with normalized_with(stats, sweep):
        for xb, yb in micro:
            loss = loss_fn(model(xb), yb) / k
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
    forwards, on a copy of ``model`` (0 up to rounding for every K)."""
    check_k(k)
    if x.shape[0] % k:
        raise ValueError(f"a batch of {x.shape[0]} cannot be cut into K = {k} equal micro-batches.")
    work = copy.deepcopy(model).train()
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


# ------------------------------------------------------------------------- comparing the methods

#: The methods chapter 2 compares, in the order of its table.
METHODS: tuple[str, ...] = ("full batch", "plain accumulation", "ghost BN (one pass)", "full-batch stats",
                            "exact full-batch stats", "momentum-corrected", "PreciseBN", "GroupNorm", "LayerNorm")


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
    from .accumulate import accumulated_gradient, agreement, full_batch_gradient
    from .bn import check_micro_batch, layer_inputs
    from .models import make_cnn

    check_k(k)
    check_micro_batch(b)
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
        ("ghost BN (one pass)", full_batch_gradient(ghostify(model, v), loss_fn, xb, yb), v),
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
    """One training run of the side-by-side experiment."""

    method: str
    k: int
    b: int
    val_acc: float
    seconds_per_step: float


def train_methods(split: DigitsSplit, k: int, batch_size: int = 64, epochs: int = 8, seed: int = 0,
                  methods: Sequence[str] = METHODS) -> list[MethodRun]:
    """Train a fresh SmallCNN with each method on the same 64-image batches (K micro-batches of b = 64/K).

    "full batch" and "ghost BN (one pass)" take one forward/backward per batch (K = 1); every other method
    accumulates K micro-batches. "PreciseBN" is the plain-accumulation model with its running statistics
    recomputed after training (so it costs no extra training run). Wall-clock time per optimizer step is
    measured around training, after a one-epoch warm-up.
    """
    import time

    from .accumulate import accuracy, train
    from .bn import corrected_momentum, set_bn_momentum
    from .models import make_cnn

    check_k(k)
    if batch_size % k or batch_size // k < 2:
        raise ValueError(f"K = {k} must divide the batch size {batch_size} into micro-batches of at least 2.")
    b = batch_size // k
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}.")
    device = split.x_train.device
    common = dict(batch_size=batch_size, epochs=epochs, seed=seed)
    data = (split.x_train, split.y_train, split.x_val, split.y_val)
    train(make_cnn("batch", seed=seed, device=device), *data, batch_size=batch_size, k=k, epochs=1)  # warm-up
    runs: dict[str, MethodRun] = {}
    plain_model: nn.Module | None = None
    for method in [m for m in METHODS if m in methods or (m == "plain accumulation" and "PreciseBN" in methods)]:
        if method == "PreciseBN":  # the plain run's model, with its running statistics recomputed afterwards
            assert plain_model is not None
            model = copy.deepcopy(plain_model)
            precise_bn(model, split.x_train, b)
            runs[method] = MethodRun(method, k, b, accuracy(model.eval(), split.x_val, split.y_val),
                                     runs["plain accumulation"].seconds_per_step)
            continue
        norm = {"GroupNorm": "group", "LayerNorm": "layer"}.get(method, "batch")
        model = make_cnn(norm, seed=seed, device=device)  # type: ignore[arg-type]
        steps_k, backward_fn = k, None
        if method == "full batch":
            steps_k = 1
        elif method == "ghost BN (one pass)":
            model, steps_k = ghostify(model, b), 1
        elif method == "full-batch stats":
            backward_fn = full_batch_stats_backward
        elif method == "exact full-batch stats":
            backward_fn = functools.partial(full_batch_stats_backward, exact=True)
        elif method == "momentum-corrected":
            set_bn_momentum(model, corrected_momentum(0.1, k))
        start = time.perf_counter()
        result = train(model, *data, k=steps_k, backward_fn=backward_fn, **common)  # type: ignore[arg-type]
        seconds = (time.perf_counter() - start) / result.optimizer_steps
        runs[method] = MethodRun(method, k, b, result.val_acc, seconds)
        if method == "plain accumulation":
            plain_model = model
    return [runs[m] for m in METHODS if m in methods]


def format_methods(runs: list[MethodRun], with_time: bool = False) -> str:
    """The side-by-side table (validation accuracy per method and K; optionally time relative to plain)."""
    ks = sorted({r.k for r in runs})
    header = f"{'method':<24}" + "".join(f"{f'K={k}, b={runs[0].b * runs[0].k // k}':>16}" for k in ks)
    lines = [header + ("   time / plain step" if with_time else "")]
    for method in dict.fromkeys(r.method for r in runs):
        by_k = {r.k: r for r in runs if r.method == method}
        line = f"{method:<24}" + "".join(f"{100 * by_k[k].val_acc:>15.1f}%" if k in by_k else f"{'':>16}" for k in ks)
        if with_time:
            plain = {r.k: r.seconds_per_step for r in runs if r.method == "plain accumulation"}
            line += "   " + "  ".join(f"{by_k[k].seconds_per_step / plain[k]:5.2f}×" for k in ks if k in by_k and k in plain)
        lines.append(line)
    return "\n".join(lines)


def plot_methods(runs: list[MethodRun]):
    """Validation accuracy of every method, one group of bars per K."""
    import numpy as np

    from .plotting import PALETTE, decorate, figure

    ks = sorted({r.k for r in runs})
    methods = list(dict.fromkeys(r.method for r in runs))
    colors = [PALETTE["sky"], PALETTE["vermillion"]] + [PALETTE["blue"], PALETTE["orange"]][: max(0, len(ks) - 2)]
    fig, (ax,) = figure(1, 9.6, 3.8)
    width = 0.8 / len(ks)
    pos = np.arange(len(methods))
    for i, k in enumerate(ks):
        by = {r.method: r.val_acc for r in runs if r.k == k}
        ax.bar(pos + (i - (len(ks) - 1) / 2) * width, [100 * by.get(m, np.nan) for m in methods], width,
               color=colors[i], label=f"K = {k}, b = {64 // k}", hatch="" if i == 0 else "//", edgecolor="white")
    ax.set_xticks(pos, methods, rotation=25, ha="right")
    decorate(ax, "", "validation accuracy (%)", "Digits, 152 optimizer steps on the same 64-image batches")
    ax.set_ylim(0, 118)
    ax.set_yticks(range(0, 101, 20))
    ax.legend(loc="upper center", ncol=len(ks), frameon=False)
    return fig


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
    from .plotting import figure, heatmap

    fig, axes = figure(len(methods), 3.6 * len(methods), 3.6)
    for ax, method in zip(axes, methods):
        image = heatmap(ax, grids[method], ks, bs, vmin=0.0, vmax=1.0, aspect="equal", xlabel="micro-batch size b",
                        ylabel="K", title=method)
    fig.colorbar(image, ax=axes, label="cosine to the full-batch gradient", shrink=0.9)
    return fig


def plot_method_effects(k: int, b: int, v: int, x: torch.Tensor, y: torch.Tensor):
    """The widget's picture: statistics error and gradient cosine of each method for one (K, b, v)."""
    import numpy as np

    from .plotting import PALETTE, decorate, figure

    rows = method_effects(k, b, v, x, y)
    names = [r.method.replace(" (one pass)", f" (v={v})") for r in rows]
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
