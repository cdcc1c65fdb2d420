"""Ghost BatchNorm (Hoffer et al. 2017): normalize a batch in virtual ("ghost") batches of size v.

Plain gradient accumulation with micro-batches of b = v computes exactly the same forward pass and gradient as
:class:`GhostBatchNorm` on the whole batch: accumulation *is* ghost BatchNorm. :func:`ghostify` swaps every
BatchNorm layer of a model for one. The opposite wish, full-batch statistics under accumulation, is
:mod:`gradaccum.fullbatch_bn`. Chapter 2 of the book.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


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

    # Always tracked (``track_running_stats=True`` below), so never None; annotations only, no runtime effect.
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

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
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        rest = x.shape[2:]
        folded = x.reshape(g, v, c, *rest).transpose(0, 1).reshape(v, g * c, *rest)
        running_mean = self.running_mean.repeat(g)
        running_var = self.running_var.repeat(g)
        weight = self.weight.repeat(g) if self.affine else None
        bias = self.bias.repeat(g) if self.affine else None
        out = F.batch_norm(folded, running_mean, running_var, weight, bias, True, factor, self.eps)
        with torch.no_grad():  # G identical updates, one per ghost batch: their mean is one averaged update
            self.running_mean.copy_(running_mean.view(g, c).mean(0))
            self.running_var.copy_(running_var.view(g, c).mean(0))
        return out.reshape(v, g, c, *rest).transpose(0, 1).reshape(x.shape)


class LoopGhostBatchNorm(nn.Module):
    """Reference implementation: one ``nn.BatchNorm2d`` applied to each ghost batch in turn (its running
    statistics are then updated once per ghost batch)."""

    def __init__(self, num_features: int, virtual_batch_size: int):
        super().__init__()
        self.bn, self.virtual_batch_size = nn.BatchNorm2d(num_features), virtual_batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.bn(chunk) for chunk in x.split(self.virtual_batch_size)])


def ghostify(model: nn.Module, virtual_batch_size: int) -> nn.Module:
    """A copy of ``model`` whose BatchNorm layers are :class:`GhostBatchNorm` with the same parameters and
    running statistics.

    Supported: ``nn.BatchNorm1d`` on (N, C) inputs and ``nn.BatchNorm2d``, with running statistics. Refused with a
    ``ValueError`` naming the layer, before anything is copied: ``BatchNorm3d``, ``SyncBatchNorm``, other
    subclasses, ``track_running_stats=False``, and a model that is itself a BatchNorm layer (wrap it in a
    container). A ``BatchNorm1d`` applied to (N, C, L) inputs is refused at its first forward pass.
    """
    if isinstance(model, _BatchNorm):
        raise ValueError("the model is itself a BatchNorm layer: wrap it, e.g. nn.Sequential(layer), to ghostify it.")
    for name, layer in model.named_modules():
        if isinstance(layer, _BatchNorm) and not isinstance(layer, GhostBatchNorm):
            if type(layer) not in (nn.BatchNorm1d, nn.BatchNorm2d):
                raise ValueError(f"layer {name!r} is {type(layer).__name__}: GhostBatchNorm replaces nn.BatchNorm1d "
                                 "and nn.BatchNorm2d only; keep this layer, or write its ghost version by hand.")
            if not layer.track_running_stats:
                raise ValueError(f"layer {name!r} keeps no running statistics (track_running_stats=False); "
                                 "GhostBatchNorm needs them: construct the layer with track_running_stats=True.")
    model = copy.deepcopy(model)
    replaced = 0
    for _name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, GhostBatchNorm):
                dims = 1 if isinstance(child, nn.BatchNorm1d) else 2
                ghost = GhostBatchNorm(child.num_features, virtual_batch_size, dims=dims,
                                       eps=child.eps, momentum=child.momentum, affine=child.affine)
                ghost.load_state_dict(child.state_dict())
                ghost.to(next(child.buffers()).device, next(child.buffers()).dtype)
                setattr(module, child_name, ghost.train(child.training))
                replaced += 1
    if not replaced:
        raise ValueError("the model has no BatchNorm layer to turn into GhostBatchNorm.")
    return model
