"""Ghost BatchNorm (Hoffer et al. 2017): normalize a batch in virtual ("ghost") batches of size v.

Plain gradient accumulation with micro-batches of b = v computes exactly the same forward pass and gradient as
:class:`GhostBatchNorm` on the whole batch: accumulation *is* ghost BatchNorm. :func:`ghostify` swaps every
BatchNorm layer of a model for one. The opposite wish, full-batch statistics under accumulation, is
:mod:`gradaccum.fullbatch_bn`. Chapter 2 of the book.

The layer normalizes with one of four implementations, with equal results up to rounding: the group, the loop and
the fold here, and the compiled formulas in :mod:`gradaccum.ghost_bn_compiled`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.ghost_bn_compiled import _compile

#: The implementations ``GhostBatchNorm(impl=...)`` accepts.
IMPLS = ("auto", "group", "loop", "fold", "compile")

#: On CPU, "auto" runs float32 and float64 feature maps with torch's GroupNorm kernel (``"group"``) when the
#: whole input holds fewer than this many values, and loops over the ghost batches (``"loop"``) from here on
#: (measured with ``benchmarks/ghost_bn.py``; see :func:`auto_impl`).
GROUP_MAX_VALUES = 2**22

#: On CPU, for every other input (features, float16 and bfloat16 maps), "auto" loops over the ghost batches when
#: one holds at least this many values (v · C · H · W), and folds them otherwise.
LOOP_MIN_VALUES = 2**16

#: The output, and the mean over ghost batches of their means and of their unbiased variances.
_Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def auto_impl(x: torch.Tensor, virtual_batch_size: int) -> str:
    """The implementation ``impl="auto"`` runs for input ``x``. On the CPU: float32 and float64 feature maps
    (N, C, H, W) get ``"group"`` below :data:`GROUP_MAX_VALUES` values and ``"loop"`` from there on; other inputs
    ``"loop"`` when a ghost batch holds at least :data:`LOOP_MIN_VALUES` values, else ``"fold"``. On every other
    device ``"fold"``.

    The thresholds come from forward + backward timings on the book's 2-core CPU, recorded in
    ``gradaccum/book/ghost_bn_cpu.json`` by ``benchmarks/ghost_bn.py``; ``benchmarks/README.md`` gives the
    measurements behind each crossover. ``"compile"`` is never picked.
    """
    if x.device.type != "cpu":
        return "fold"
    if x.dim() == 4 and x.dtype in (torch.float32, torch.float64):
        return "group" if x.numel() < GROUP_MAX_VALUES else "loop"
    return "loop" if x[:virtual_batch_size].numel() >= LOOP_MIN_VALUES else "fold"


def _fold(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    stats_like: torch.Tensor,
    v: int,
    eps: float,
) -> _Result:
    """Ghost batches folded into the channel dimension, a (v, G·C, ...) copy, and one ``F.batch_norm`` call on
    it, which writes each ghost batch's mean and unbiased variance into zeroed "running" statistics with
    momentum 1 (zeros like ``stats_like``, the layer's running mean); the output is copied back."""
    n, c, rest = x.shape[0], x.shape[1], x.shape[2:]
    g = n // v
    folded = x.reshape(g, v, c, *rest).transpose(0, 1).reshape(v, g * c, *rest)
    mean, var = stats_like.new_zeros(g * c), stats_like.new_zeros(g * c)
    out = F.batch_norm(
        folded,
        mean,
        var,
        None if weight is None else weight.repeat(g),
        None if bias is None else bias.repeat(g),
        True,
        1.0,
        eps,
    )
    out = out.reshape(v, g, c, *rest).transpose(0, 1).reshape(x.shape)
    return out, mean.view(g, c).mean(0), var.view(g, c).mean(0)


def _group(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    stats_like: torch.Tensor,
    v: int,
    eps: float,
) -> _Result:
    """Ghost batch g's channel c made one group of torch's GroupNorm kernel: the input copied to the (G, C, v·P)
    layout (P positions per channel), one kernel call with C groups of one channel each (its per-channel affine is
    BatchNorm's: :func:`_group_norm`), the output copied back. The kernel gives each group's variance + ε; the
    variance is that minus ε (exact to the rounding of σ̂² + ε, what evaluation uses), times m/(m − 1), m = v·P."""
    g, c = x.shape[0] // v, x.shape[1]
    if weight is None and x.dtype != stats_like.dtype:  # float32 parameters: GroupNorm's statistics in float32
        weight, bias = stats_like.new_ones(c), stats_like.new_zeros(c)
    grouped = x.reshape(g, v, c, -1).transpose(1, 2).contiguous()
    out, mean, inv = _group_norm(grouped, weight, bias, eps)
    out = out.view(g, c, v, -1).transpose(1, 2).reshape(x.shape)
    m = grouped.shape[2] * grouped.shape[3]
    with torch.no_grad():
        var = inv.sub_(eps).clamp_(min=0).mean(0).mul_(m / (m - 1))
        return out, mean.mean(0).to(stats_like.dtype), var.to(stats_like.dtype)


def _group_norm(
    grouped: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``native_group_norm`` call on ``grouped`` (G, C, v, P) with C groups of one channel each. The kernel
    returns each group's mean and r = 1/√(σ̂² + ε); returned are the (G, C, v·P) output and, without a graph and in
    float64 on the CPU and CUDA, each group's mean and r⁻² = σ̂² + ε. Groups far from zero (``_FAR``) are shifted
    by their first value and run again, which changes neither output nor gradient."""
    g, c = grouped.shape[0], grouped.shape[1]
    m = grouped.shape[2] * grouped.shape[3]
    acc = torch.float64 if grouped.device.type in ("cpu", "cuda") else torch.float32
    out, mean, rstd = torch.ops.aten.native_group_norm(grouped.view(g, c, m), weight, bias, g, c, m, c, eps)
    with torch.no_grad():
        mean_acc, inv = mean.to(acc), rstd.to(acc).pow(-2)  # inv: each group's variance + eps
        far = bool((mean_acc.square() > _FAR**2 * inv).any())
    if far:
        shift = grouped[:, :, :1, :1].detach()
        out, mean, rstd = torch.ops.aten.native_group_norm(
            (grouped - shift).view(g, c, m), weight, bias, g, c, m, c, eps
        )
        with torch.no_grad():
            mean_acc, inv = mean.to(acc) + shift.view(g, c).to(acc), rstd.to(acc).pow(-2)
    return out, mean_acc, inv


#: How many of its standard deviations a group's mean may lie from zero before :func:`_group` runs the kernel
#: again on the values minus each group's first value (which changes neither output nor gradient): GroupNorm's
#: CPU kernel loses accuracy far from zero (measured in float32: relative error of the variance 4e-7 at a mean
#: 100 standard deviations from zero, 1e-5 at 1000; BatchNorm's two passes, 1e-7).
_FAR = 30.0


class _Loop(torch.autograd.Function):
    """One native BatchNorm call per ghost batch, each writing straight into its slice of the output (a loop of
    ``F.batch_norm`` would copy the G outputs together with ``torch.cat``); ghost batch ``i`` writes its mean
    and unbiased variance into row ``i`` of ``means`` and ``variances`` (G, C, zeros, updated with momentum 1).
    Once differentiable."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        means: torch.Tensor,
        variances: torch.Tensor,
        v: int,
        eps: float,
    ) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        save_mean, save_invstd = torch.empty_like(means), torch.empty_like(variances)
        for i, (xi, oi) in enumerate(zip(x.split(v), out.split(v))):
            torch.ops.aten.native_batch_norm.out(
                xi,
                weight,
                bias,
                means[i],
                variances[i],
                True,
                1.0,
                eps,
                out=oi,
                save_mean=save_mean[i],
                save_invstd=save_invstd[i],
            )
        ctx.save_for_backward(x, weight, save_mean, save_invstd)  # type: ignore[arg-type]  # None: no affine
        ctx.v, ctx.eps = v, eps  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # backward(create_graph=True): the saved statistics carry no graph
            raise ValueError(
                "GhostBatchNorm's 'loop' implementation (impl='loop', or what impl='auto' picks for "
                "large ghost batches on the CPU) is differentiable once; for a double backward "
                "(create_graph=True) construct the layer with impl='fold'."
            )
        x, weight, save_mean, save_invstd = ctx.saved_tensors
        mask = list(ctx.needs_input_grad[:3])
        grads = [
            torch.ops.aten.native_batch_norm_backward(
                go, xi, weight, None, None, save_mean[i], save_invstd[i], True, ctx.eps, mask
            )
            for i, (go, xi) in enumerate(zip(grad_out.split(ctx.v), x.split(ctx.v)))
        ]
        grad_x = torch.cat([gr[0] for gr in grads]) if mask[0] else None
        grad_w, grad_b = (torch.stack([gr[j] for gr in grads]).sum(0) if mask[j] else None for j in (1, 2))
        return grad_x, grad_w, grad_b, None, None, None, None


def _loop(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    stats_like: torch.Tensor,
    v: int,
    eps: float,
) -> _Result:
    """Each ghost batch normalized by its own BatchNorm call (:class:`_Loop`)."""
    shape = (x.shape[0] // v, x.shape[1])
    mean, var = stats_like.new_zeros(shape), stats_like.new_zeros(shape)
    return _Loop.apply(x, weight, bias, mean, var, v, eps), mean.mean(0), var.mean(0)


_FORWARDS: dict[str, Callable[..., _Result]] = {"group": _group, "loop": _loop, "fold": _fold, "compile": _compile}


class GhostBatchNorm(_BatchNorm):
    r"""BatchNorm that, in training, normalizes each consecutive chunk of ``virtual_batch_size`` samples
    with that chunk's own statistics (Hoffer, Hubara & Soudry 2017).

    For ghost batch :math:`g` of the :math:`G = N/v`, channel :math:`c`:
    :math:`y = \gamma_c\,(x-\hat\mu_{g,c})/\sqrt{\hat\sigma^2_{g,c}+\epsilon} + \beta_c`, with the mean
    :math:`\hat\mu_{g,c}` and biased variance :math:`\hat\sigma^2_{g,c}` over the ghost batch's samples (and
    positions, for feature maps).

    **Running statistics** are updated *once per forward pass*, with the mean over ghost batches of their
    means and of their unbiased variances: :math:`\bar\mu \leftarrow (1-m)\bar\mu + m\,\frac1G\sum_g\hat\mu_g`
    (and likewise for the variance). With ``momentum=None`` the update is a cumulative average, as in
    ``nn.BatchNorm``, so ``torch.optim.swa_utils.update_bn`` works. When the batch is a single ghost batch the
    layer is exactly ``nn.BatchNorm``. In eval mode it uses the running statistics, as BatchNorm does.

    ``impl`` chooses how, with equal results up to float rounding (the group's running variance: up to the rounding
    of variance + eps, which is what evaluation uses; values far from zero: BatchNorm's own kernel, which the loop
    and the fold call, loses accuracy in float32 where the group shifts them first): ``"group"``, each ghost batch's
    channel one group of torch's GroupNorm kernel, on a copy of the input laid out as :math:`(G, C, v\cdot P)` (any
    number of times differentiable; the running variance is recovered from the kernel's reciprocal standard
    deviation; each call reads one value back from the device, to check for values far from zero); ``"loop"``, one
    BatchNorm call per ghost batch writing into its slice of the output (once differentiable: no double backward);
    ``"fold"``, the ghost batches folded into the channel dimension — a copy of shape :math:`(v, G\cdot C, \dots)` —
    so that one ``F.batch_norm`` call normalizes all of them; ``"compile"``, the formulas of ghost BatchNorm and of
    its gradient written as array math and compiled by ``torch.compile`` (once differentiable; seconds to compile
    per input shape; after a failure to compile it warns once and runs the same formulas eagerly; all layers share
    one compiled function, so after eight input shapes ``torch.compile``'s recompile limit runs further shapes
    eagerly too, without a warning: not measured here, and the compiled speed is gone); ``"auto"`` (default),
    :func:`auto_impl`: on the CPU the group for feature maps of fewer than 2**22 values and the loop above, for
    features the fold (the loop for large ghost batches); on other devices the fold.
    """

    # Always tracked (``track_running_stats=True`` below), so never None; annotations only, no runtime effect.
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(
        self,
        num_features: int,
        virtual_batch_size: int,
        dims: int = 2,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        impl: str = "auto",
    ):
        if dims not in (1, 2):
            raise ValueError(f"dims must be 1 (features) or 2 (feature maps), got {dims}.")
        if isinstance(virtual_batch_size, bool) or not isinstance(virtual_batch_size, int) or virtual_batch_size < 2:
            raise ValueError(
                f"virtual_batch_size must be an int >= 2, got {virtual_batch_size!r}: a ghost batch of one sample "
                "has zero variance on features, and on feature maps it normalizes each sample over its own "
                "positions (instance normalization), not over a batch. Use 2 or more (Hoffer et al. used 128 on "
                "ImageNet)."
            )
        if not eps > 0:
            raise ValueError(
                f"eps must be positive, got {eps!r} (F.batch_norm refuses it in training too): a ghost "
                "batch whose channel is constant would divide zero by zero."
            )
        if impl not in IMPLS:
            raise ValueError(
                f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}; 'auto' picks the "
                "fastest measured one for the device and shape."
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.virtual_batch_size = virtual_batch_size
        self.dims = dims
        self.impl = impl

    def _check_input_dim(self, x: torch.Tensor) -> None:
        expected = 4 if self.dims == 2 else 2
        if x.dim() != expected:
            raise ValueError(
                f"GhostBatchNorm(dims={self.dims}) expects a {expected}-D input, got {x.dim()}-D"
                + (
                    "; for (N, C, L) sequences, reshape to (N, C, 1, L) and use dims=2 (a layer "
                    "ghostify made from an nn.BatchNorm1d that sees sequences: reshape around it in the "
                    "model's forward, or leave that layer an nn.BatchNorm1d)."
                    if x.dim() == 3
                    else "."
                )
            )
        if not x.is_floating_point():
            raise ValueError(
                f"GhostBatchNorm normalizes floating-point inputs, got {x.dtype}: convert the input (x.float()) first."
            )
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"GhostBatchNorm({self.num_features}, ...) got an input with {x.shape[1]} channels "
                f"(shape {tuple(x.shape)}): its dimension 1 must hold the {self.num_features} "
                "channels."
            )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, virtual_batch_size={self.virtual_batch_size}, impl={self.impl!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        stats = self.running_mean.dtype
        if torch.float64 in (x.dtype, stats) and x.dtype != stats:  # lower precisions mix under autocast
            raise ValueError(
                f"the input is {x.dtype} and the layer's statistics {stats}: cast the model (.double() "
                "or .float()) or the input to one precision; nn.BatchNorm2d cannot mix them either."
            )
        n, v = x.shape[0], self.virtual_batch_size
        if not self.training or n == v or x.numel() == 0:  # an empty batch: nn.BatchNorm returns it empty too
            return super().forward(x)
        if n % v:
            raise ValueError(
                f"a batch of {n} cannot be cut into ghost batches of {v}; use a batch size that is a multiple of "
                f"{v}, or a virtual batch size that divides {n}."
            )
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        impl = auto_impl(x, v) if self.impl == "auto" else self.impl
        out, mean, var = _FORWARDS[impl](x, self.weight, self.bias, self.running_mean, v, self.eps)
        with torch.no_grad():
            self.running_mean.lerp_(mean, factor)
            self.running_var.lerp_(var, factor)
        if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            return out.contiguous(memory_format=torch.channels_last)  # as BatchNorm2d keeps its input's layout
        return out


class LoopGhostBatchNorm(nn.Module):
    """Reference implementation: one ``nn.BatchNorm2d`` (``dims=2``) or ``nn.BatchNorm1d`` (``dims=1``) applied
    to each ghost batch in turn (its running statistics are then updated once per ghost batch)."""

    def __init__(self, num_features: int, virtual_batch_size: int, dims: int = 2):
        super().__init__()
        self.bn = (nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d)(num_features)
        self.virtual_batch_size = virtual_batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.bn(chunk) for chunk in x.split(self.virtual_batch_size)])


def ghostify(model: nn.Module, virtual_batch_size: int, impl: str = "auto") -> nn.Module:
    """A copy of ``model`` whose BatchNorm layers are :class:`GhostBatchNorm` with the same parameters and
    running statistics, and implementation ``impl``.

    Supported: ``nn.BatchNorm1d`` on (N, C) inputs and ``nn.BatchNorm2d``, with running statistics; a layer used
    in several places stays one layer, parameters tied to other layers stay tied (the ghost holds the layer's own
    parameters and running statistics), and frozen parameters stay frozen. Refused with a ``ValueError`` naming the
    layer, before anything is copied: ``BatchNorm3d``, ``SyncBatchNorm``, other subclasses,
    ``track_running_stats=False``, a layer with hooks, and a model that is itself a BatchNorm layer (wrap it in a
    container). A ``BatchNorm1d`` applied to (N, C, L) inputs is refused at its first forward pass.
    """
    if isinstance(model, _BatchNorm):
        raise ValueError("the model is itself a BatchNorm layer: wrap it, e.g. nn.Sequential(layer), to ghostify it.")
    for name, layer in model.named_modules():
        if isinstance(layer, _BatchNorm) and not isinstance(layer, GhostBatchNorm):
            _check_ghostable(name, layer)
    model = copy.deepcopy(model)
    ghosts: dict[int, GhostBatchNorm] = {}  # a layer used in two places stays one layer
    for _name, module in list(model.named_modules()):
        for child_name, child in list(module._modules.items()):  # every slot (named_children skips repeats)
            if isinstance(child, _BatchNorm) and not isinstance(child, GhostBatchNorm):
                ghost = ghosts.get(id(child))
                if ghost is None:
                    ghost = ghosts[id(child)] = _ghost_of(child, virtual_batch_size, impl)
                setattr(module, child_name, ghost)
    if not ghosts:
        raise ValueError("the model has no BatchNorm layer to turn into GhostBatchNorm.")
    return model


def _check_ghostable(name: str, layer: _BatchNorm) -> None:
    """Refuse, naming the layer, a BatchNorm that :func:`ghostify` cannot replace with the same computation."""
    if type(layer) not in (nn.BatchNorm1d, nn.BatchNorm2d):
        raise ValueError(
            f"layer {name!r} is {type(layer).__name__}: GhostBatchNorm replaces nn.BatchNorm1d "
            "and nn.BatchNorm2d only; keep this layer, or write its ghost version by hand."
        )
    if not layer.track_running_stats:
        raise ValueError(
            f"layer {name!r} keeps no running statistics (track_running_stats=False); "
            "GhostBatchNorm needs them: construct the layer with track_running_stats=True."
        )
    if layer.affine and (layer.weight is None or layer.bias is None):
        raise ValueError(
            f"layer {name!r} is affine with only a scale or only a shift (bias=False); "
            "GhostBatchNorm keeps both or neither: construct it with affine=False, or keep both."
        )
    if layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks:
        raise ValueError(
            f"layer {name!r} has hooks, which a new GhostBatchNorm would not carry over; remove "
            "them, ghostify, and register them on the new layer."
        )


def _ghost_of(child: _BatchNorm, virtual_batch_size: int, impl: str) -> GhostBatchNorm:
    """The GhostBatchNorm holding ``child``'s own parameters and running statistics, in ``child``'s mode."""
    dims = 1 if isinstance(child, nn.BatchNorm1d) else 2
    ghost = GhostBatchNorm(
        child.num_features,
        virtual_batch_size,
        dims=dims,
        eps=child.eps,
        momentum=child.momentum,
        affine=child.affine,
        impl=impl,
    )
    # the layer's own tensors, not copies: a parameter tied to another layer (or used elsewhere
    # in the model) stays tied, and frozen stays frozen
    for key, param in child._parameters.items():
        if param is not None:
            setattr(ghost, key, param)
    for key, buf in child._buffers.items():
        if buf is not None and key in ghost._buffers:
            ghost._buffers[key] = buf
    return ghost.train(child.training)
